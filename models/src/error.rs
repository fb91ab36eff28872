//! Typed errors of model loading, tokenization and generation. Messages name what the
//! caller gave ([`ModelInput`]: the GGUF file, the temperature, …) as data, so that a front
//! end renders them in its own words ([`ModelError::render`]; the CLI by its flags) and the
//! library spells no command line.
use std::path::PathBuf;

/// Something the caller of this crate gives, as a message names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ModelInput {
    /// A GGUF file ([`ModelSpec::Gguf`](crate::ModelSpec::Gguf)).
    Gguf,
    /// A safetensors directory ([`ModelSpec::Dir`](crate::ModelSpec::Dir)).
    ModelDir,
    /// Either of the two: another model source.
    ModelSource,
    /// The config.json of random weights ([`ModelSpec::Random`](crate::ModelSpec::Random)).
    Config,
    /// A tokenizer.json given beside the model ([`TextTokenizer::from_file`](crate::TextTokenizer::from_files)).
    Tokenizer,
    /// The prompt's tokens.
    Prompt,
    /// [`GenerateConfig::max_new_tokens`](crate::GenerateConfig::max_new_tokens).
    MaxNewTokens,
    /// [`GenerateConfig::temperature`](crate::GenerateConfig::temperature).
    Temperature,
    /// [`GenerateConfig::top_p`](crate::GenerateConfig::top_p).
    TopP,
    /// [`GenerateConfig::decode_ids`](crate::GenerateConfig::decode_ids) (teacher forcing).
    DecodeIds,
    /// The chat template ([`TextTokenizer::apply_chat`](crate::TextTokenizer::apply_chat_template)).
    Chat,
}

impl ModelInput {
    /// How the library's own messages name it.
    pub fn library_name(self) -> &'static str {
        match self {
            Self::Gguf => "`ModelSpec::Gguf`",
            Self::ModelDir => "`ModelSpec::Dir`",
            Self::ModelSource => "another `ModelSpec` (a GGUF file or a safetensors directory)",
            Self::Config => "`ModelSpec::Random`'s config",
            Self::Tokenizer => "`TextTokenizer::from_files`",
            Self::Prompt => "a prompt",
            Self::MaxNewTokens => "`max_new_tokens`",
            Self::Temperature => "`temperature`",
            Self::TopP => "`top_p`",
            Self::DecodeIds => "`decode_ids`",
            Self::Chat => "`apply_chat_template`",
        }
    }
}

/// One piece of a [`Message`].
#[derive(Clone, Debug, PartialEq)]
pub enum Part {
    /// Words.
    Text(String),
    /// Something the caller gave, named by whoever renders the message.
    Input(ModelInput),
}

/// A message whose [`ModelInput`]s are named when it is rendered.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Message(pub Vec<Part>);

impl Message {
    /// `self` followed by `text`.
    pub fn text(mut self, text: impl Into<String>) -> Self {
        self.0.push(Part::Text(text.into()));
        self
    }

    /// `self` followed by `input`'s name.
    pub fn input(mut self, input: ModelInput) -> Self {
        self.0.push(Part::Input(input));
        self
    }

    /// The message with each input named by `name`.
    pub fn render(&self, name: &dyn Fn(ModelInput) -> String) -> String {
        self.0
            .iter()
            .map(|p| match p {
                Part::Text(t) => t.clone(),
                Part::Input(i) => name(*i),
            })
            .collect()
    }
}

impl From<String> for Message {
    fn from(s: String) -> Self {
        Self(vec![Part::Text(s)])
    }
}

impl From<&str> for Message {
    fn from(s: &str) -> Self {
        Self::from(s.to_string())
    }
}

impl std::fmt::Display for Message {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.render(&|i| i.library_name().to_string()))
    }
}

/// Everything that can go wrong while loading or running a model. Its `Display` names
/// inputs the library's way; [`ModelError::render`] takes a front end's names.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A tensor operation failed.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// The KV policy failed.
    #[error(transparent)]
    Policy(#[from] kvpolicy_core::KvError),
    /// The prefix cache or a session failed.
    #[error(transparent)]
    Prefix(#[from] kvpolicy_prefix::PrefixError),
    /// A file could not be read or written.
    #[error("cannot access {}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// config.json is missing a field, has a bad value, or asks for something unsupported.
    #[error("config: field `{field}`: {message}")]
    Config {
        /// The offending field (dotted path).
        field: String,
        /// What is wrong and what to do.
        message: String,
    },
    /// A weight is missing or its shape disagrees with the config.
    #[error("weights in {}: {message}", path.display())]
    Weights {
        /// The weight file or directory.
        path: PathBuf,
        /// What is wrong and what to do.
        message: Message,
    },
    /// A file that should be GGUF is not, or is damaged.
    #[error("{} {message}", path.display())]
    Gguf {
        /// The file.
        path: PathBuf,
        /// What is wrong and what to do.
        message: Message,
    },
    /// The tokenizer could not be built or failed.
    #[error("tokenizer: {0}")]
    Tokenizer(Message),
    /// No source could provide the model.
    #[error("could not obtain the model: {0}")]
    Fetch(Message),
    /// A request that the model cannot serve (bad ids, too long, empty prompt).
    #[error("invalid input: {0}")]
    Input(Message),
}

impl ModelError {
    /// The message with each [`ModelInput`] named by `name` (a front end's spelling); the
    /// `Display` text when `name` is [`ModelInput::library_name`] (a test holds the two
    /// together).
    pub fn render(&self, name: &dyn Fn(ModelInput) -> String) -> String {
        match self {
            Self::Candle(_)
            | Self::Policy(_)
            | Self::Prefix(_)
            | Self::Io { .. }
            | Self::Config { .. } => self.to_string(),
            Self::Weights { path, message } => {
                format!("weights in {}: {}", path.display(), message.render(name))
            }
            Self::Gguf { path, message } => format!("{} {}", path.display(), message.render(name)),
            Self::Tokenizer(m) => format!("tokenizer: {}", m.render(name)),
            Self::Fetch(m) => format!("could not obtain the model: {}", m.render(name)),
            Self::Input(m) => format!("invalid input: {}", m.render(name)),
        }
    }
}

/// Result type of this crate.
pub type Result<T> = std::result::Result<T, ModelError>;

/// The message of a candle error without the backtrace candle attaches when
/// `RUST_BACKTRACE` is set (a user-facing load error should not dump one).
pub fn candle_message(e: &candle_core::Error) -> String {
    match e {
        candle_core::Error::WithBacktrace { inner, .. } => candle_message(inner),
        candle_core::Error::Context { inner, context } => {
            format!("{context}: {}", candle_message(inner))
        }
        other => other.to_string(),
    }
}

impl ModelError {
    /// An I/O error on `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }

    /// A config error on `field`.
    pub fn config(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self::Config {
            field: field.into(),
            message: message.into(),
        }
    }
}

/// A tokenizer error as a [`ModelError::Tokenizer`].
pub(crate) fn tok_err(e: impl std::fmt::Display) -> ModelError {
    ModelError::Tokenizer(e.to_string().into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inputs_are_named_by_the_renderer() {
        let e = ModelError::Input(
            Message::default()
                .input(ModelInput::TopP)
                .text(" 2 must be in (0, 1]"),
        );
        assert_eq!(e.to_string(), "invalid input: `top_p` 2 must be in (0, 1]");
        let flag = |i: ModelInput| format!("<{i:?}>");
        assert_eq!(e.render(&flag), "invalid input: <TopP> 2 must be in (0, 1]");
    }

    /// `render` with the library's names is `Display`, for every variant that has a
    /// message to render.
    #[test]
    fn render_with_library_names_is_display() {
        let m = || {
            Message::from("pass ")
                .input(ModelInput::Gguf)
                .text(" or ")
                .input(ModelInput::Chat)
        };
        let path = PathBuf::from("/x/m.gguf");
        let all = [
            ModelError::Weights {
                path: path.clone(),
                message: m(),
            },
            ModelError::Gguf { path, message: m() },
            ModelError::Tokenizer(m()),
            ModelError::Fetch(m()),
            ModelError::Input(m()),
            ModelError::config("f", "bad"),
        ];
        for e in all {
            assert_eq!(e.render(&|i| i.library_name().to_string()), e.to_string());
        }
    }

    /// A policy error is passed through whole: its message once in an error's chain.
    #[test]
    fn policy_errors_are_transparent() {
        use std::error::Error;
        let e = ModelError::from(kvpolicy_core::KvError::invariant("x"));
        assert!(e.source().is_none(), "{:?}", e.source());
    }
}

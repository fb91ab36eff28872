//! Text ↔ token ids, from a `tokenizer.json` or rebuilt from a GGUF vocabulary, plus the
//! model's chat template.
//!
//! A GGUF `gpt2`-type vocabulary (byte-level BPE: SmolLM2, Llama 3, Qwen2) is turned into a
//! `tokenizers` BPE model with the pre-tokenizer that llama.cpp uses for the file's
//! `tokenizer.ggml.pre` type, so that tokenization equals llama.cpp's (checked against
//! llama.cpp by `tests/gguf_llamacpp.rs`); a SentencePiece (`llama`) vocabulary (Gemma,
//! Llama 2, Mistral) becomes a BPE model with merges derived from its scores (`spm`).
use std::path::Path;

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

use crate::error::{tok_err, Message, ModelError, ModelInput, Result};
use crate::load::gguf::file::GgufFile;

mod chat;
mod guard;
mod spm;
pub mod stream;

const LLAMA3_REGEX: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_REGEX: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Instructions a chat template may run (minijinja's fuel): a real template takes a few
/// thousand for one message.
pub const CHAT_TEMPLATE_FUEL: u64 = 10_000_000;
/// Bytes a chat template may render for one message (its text included).
pub const CHAT_TEMPLATE_OUTPUT: usize = 64 << 20;

/// One turn of a conversation, for [`TextTokenizer::apply_chat_template_to`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant` (what the template knows).
    pub role: String,
    /// The turn's text.
    pub content: String,
}

/// A tokenizer with the model's special tokens and chat template.
pub struct TextTokenizer {
    inner: Tokenizer,
    /// Whether `encode` lets the tokenizer's post-processor add special tokens (tokenizer.json).
    post_process: bool,
    /// BOS to prepend by hand (GGUF vocabularies that ask for it).
    bos_prepend: Option<u32>,
    chat_template: Option<String>,
    bos_text: String,
    eos_text: String,
    /// `inner` with control tokens' text tokenized as text (made when first needed).
    plain: std::sync::OnceLock<Tokenizer>,
    /// The added tokens by kind (gathered when first needed).
    added: std::sync::OnceLock<AddedTokens>,
}

/// A vocabulary's added tokens, by kind.
struct AddedTokens {
    /// The control (special) tokens' ids.
    control: std::collections::HashSet<u32>,
    /// The others with some text (user-defined tokens: runs of newlines, markers a
    /// vocabulary did not mark special), with their text.
    plain: Vec<(u32, String)>,
}

/// A byte-level BPE (`gpt2`) vocabulary with the pre-tokenizer llama.cpp uses for the file's
/// `tokenizer.ggml.pre` type.
fn byte_level_bpe(g: &GgufFile, tokens: &[String]) -> Result<Tokenizer> {
    let merges = g.meta_strings("tokenizer.ggml.merges")?;
    let vocab: tokenizers::models::bpe::Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    let merges: Vec<(String, String)> = merges
        .iter()
        .filter_map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
        })
        .collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(tok_err)?;
    let pre = g
        .meta_str("tokenizer.ggml.pre")
        .unwrap_or_else(|| "default".into());
    let byte_level =
        |regex: bool| PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, regex));
    let split = |re: &str| -> Result<PreTokenizerWrapper> {
        let pat = SplitPattern::Regex(re.to_string());
        Ok(PreTokenizerWrapper::Split(
            Split::new(pat, SplitDelimiterBehavior::Isolated, false).map_err(tok_err)?,
        ))
    };
    let pre_tok = match pre.as_str() {
        "smollm" => Sequence::new(vec![PreTokenizerWrapper::Digits(Digits::new(true)), byte_level(true)]),
        "llama-bpe" | "llama3" => Sequence::new(vec![split(LLAMA3_REGEX)?, byte_level(false)]),
        "qwen2" => Sequence::new(vec![split(QWEN2_REGEX)?, byte_level(false)]),
        "default" | "gpt2" | "gpt-2" => Sequence::new(vec![byte_level(true)]),
        other => {
            return Err(ModelError::Tokenizer(Message::from(format!(
                "{} uses the `{other}` pre-tokenizer, which is not rebuilt from GGUF; pass the model's tokenizer.json with ",
                g.path().display()
            )).input(ModelInput::Tokenizer)))
        }
    };
    let mut inner = Tokenizer::new(bpe);
    inner.with_pre_tokenizer(Some(pre_tok));
    inner.with_decoder(Some(ByteLevelDecoder::default()));
    Ok(inner)
}

fn special_text(v: Option<&serde_json::Value>) -> String {
    match v {
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(serde_json::Value::Object(o)) => o
            .get("content")
            .and_then(|c| c.as_str())
            .unwrap_or_default()
            .to_string(),
        _ => String::new(),
    }
}

impl TextTokenizer {
    /// Loads `tokenizer.json`, with `tokenizer_config.json` (chat template, BOS/EOS) if given.
    pub fn from_files(tokenizer: &Path, config: Option<&Path>) -> Result<Self> {
        let bytes = kvpolicy_core::userfile::read_capped(
            tokenizer,
            "the tokenizer file",
            crate::load::files::TOKENIZER_CAP,
        )
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::InvalidInput => ModelError::Tokenizer(e.to_string().into()),
            _ => ModelError::Tokenizer(format!("cannot load {}: {e}", tokenizer.display()).into()),
        })?;
        let inner = Tokenizer::from_bytes(bytes).map_err(|e| {
            ModelError::Tokenizer(format!("cannot load {}: {e}", tokenizer.display()).into())
        })?;
        let mut me = Self {
            inner,
            post_process: true,
            bos_prepend: None,
            chat_template: None,
            bos_text: String::new(),
            eos_text: String::new(),
            plain: std::sync::OnceLock::new(),
            added: std::sync::OnceLock::new(),
        };
        if let Some(cfg) = config {
            let text = crate::load::files::read_text_capped(
                cfg,
                "tokenizer_config.json",
                crate::load::files::TOKENIZER_CAP,
            )?;
            let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
                ModelError::Tokenizer(format!("{} is not valid JSON: {e}", cfg.display()).into())
            })?;
            me.chat_template = match v.get("chat_template") {
                Some(serde_json::Value::String(s)) => Some(s.clone()),
                Some(serde_json::Value::Array(list)) => list
                    .iter()
                    .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                    .and_then(|t| t.get("template"))
                    .and_then(|t| t.as_str())
                    .map(str::to_string),
                _ => None,
            };
            me.bos_text = special_text(v.get("bos_token"));
            me.eos_text = special_text(v.get("eos_token"));
        }
        Ok(me)
    }

    /// Rebuilds the tokenizer from a GGUF file's `tokenizer.ggml.*` metadata: byte-level
    /// BPE (`gpt2`) or SentencePiece (`llama`) vocabularies.
    pub fn from_gguf(g: &GgufFile) -> Result<Self> {
        let model = g.meta_str("tokenizer.ggml.model").unwrap_or_default();
        let tokens = g.meta_strings("tokenizer.ggml.tokens")?;
        let types = g.meta_ints("tokenizer.ggml.token_type").unwrap_or_default();
        let mut inner = match model.as_str() {
            "gpt2" => byte_level_bpe(g, &tokens)?,
            "llama" => spm::spm_tokenizer(g, &tokens, &types)?,
            other => {
                return Err(ModelError::Tokenizer(Message::from(format!(
                    "{} has a `{other}` vocabulary; byte-level BPE (`gpt2`) and SentencePiece (`llama`) vocabularies are rebuilt from GGUF — pass the model's tokenizer.json with ",
                    g.path().display()
                )).input(ModelInput::Tokenizer)))
            }
        };
        // Control and user-defined tokens are matched whole in text (llama.cpp's
        // parse_special). Control tokens (`<bos>`, `<start_of_turn>`) print nothing when
        // decoded; user-defined ones (Gemma's runs of newlines and tabs) print their text.
        let (control, user): (Vec<_>, Vec<_>) = tokens
            .iter()
            .enumerate()
            .filter(|(i, _)| matches!(types.get(*i), Some(3) | Some(4)))
            .partition(|(i, _)| types.get(*i) == Some(&3));
        let added = |v: Vec<(usize, &String)>, special: bool| -> Vec<AddedToken> {
            v.into_iter()
                .map(|(_, t)| AddedToken::from(t.clone(), special).normalized(false))
                .collect()
        };
        inner
            .add_special_tokens(added(control, true))
            .map_err(tok_err)?;
        inner.add_tokens(added(user, false)).map_err(tok_err)?;
        let bos = g.meta_u32_opt("tokenizer.ggml.bos_token_id");
        let eos = g.meta_u32_opt("tokenizer.ggml.eos_token_id");
        let add_bos = g.meta_bool("tokenizer.ggml.add_bos_token").unwrap_or(false);
        let text_of = |id: Option<u32>| {
            id.and_then(|i| tokens.get(i as usize).cloned())
                .unwrap_or_default()
        };
        Ok(Self {
            bos_text: text_of(bos),
            eos_text: text_of(eos),
            inner,
            post_process: false,
            bos_prepend: if add_bos { bos } else { None },
            chat_template: g.meta_str("tokenizer.chat_template"),
            plain: std::sync::OnceLock::new(),
            added: std::sync::OnceLock::new(),
        })
    }

    /// Token ids of `text`, with the special tokens the model expects at the start.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.guarded_encode(text, self.post_process)?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        ids.extend(self.bos_prepend);
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    /// Token ids of `text` as [`encode`](Self::encode) gives them, except that text
    /// spelling a control token (`<|im_start|>`) is tokenized as text, not as that token:
    /// for text from users, who must not forge the model's markers.
    pub fn encode_text(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.guarded_encode_with(self.plain(), text, self.post_process)?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        ids.extend(self.bos_prepend);
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    /// Token ids of a piece of text with control tokens' text as text, and nothing added.
    fn encode_plain(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self
            .guarded_encode_with(self.plain(), text, false)?
            .get_ids()
            .to_vec())
    }

    /// The tokenizer that leaves control tokens' text as text.
    fn plain(&self) -> &Tokenizer {
        self.plain.get_or_init(|| {
            let mut t = self.inner.clone();
            t.set_encode_special_tokens(true);
            t
        })
    }

    /// Token ids of text that already holds its special tokens (a rendered chat template,
    /// which writes BOS itself when the model wants one, as HF's `apply_chat_template` does).
    pub fn encode_raw(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.guarded_encode(text, false)?;
        Ok(enc.get_ids().to_vec())
    }

    /// `tokenizers`' encode, within bounds a hostile tokenizer file cannot break: the
    /// normalizer's expansion is checked first, a panic of the regex engine is an error.
    fn guarded_encode(&self, text: &str, special: bool) -> Result<tokenizers::Encoding> {
        self.guarded_encode_with(&self.inner, text, special)
    }

    /// [`guarded_encode`](Self::guarded_encode) through `tok`.
    fn guarded_encode_with(
        &self,
        tok: &Tokenizer,
        text: &str,
        special: bool,
    ) -> Result<tokenizers::Encoding> {
        guard::check_expansion(tok.get_normalizer(), text)?;
        guard::quietly("encoding the text", || tok.encode(text, special))?.map_err(tok_err)
    }

    /// Text of `ids` (special tokens skipped).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, true).map_err(tok_err)
    }

    /// Whether token `id` stands for one raw byte (`<0xE6>`, SentencePiece's byte
    /// fallback): a run of them decodes to text only as a whole, so a later byte may change
    /// how the run before it decodes (invalid UTF-8 becomes one U+FFFD per byte).
    pub fn is_byte_piece(&self, id: u32) -> bool {
        self.inner.id_to_token(id).is_some_and(|t| {
            let b = t.as_bytes();
            b.len() == 6
                && t.starts_with("<0x")
                && b[5] == b'>'
                && b[3..5].iter().all(u8::is_ascii_hexdigit)
        })
    }

    /// Whether token `id` is a control token, which [`decode`](Self::decode) skips: it
    /// does not end a run of byte tokens.
    pub fn is_control(&self, id: u32) -> bool {
        self.added().control.contains(&id)
    }

    /// The added tokens by kind.
    fn added(&self) -> &AddedTokens {
        self.added.get_or_init(|| {
            let mut a = AddedTokens {
                control: std::collections::HashSet::new(),
                plain: Vec::new(),
            };
            for (id, t) in self.inner.get_added_tokens_decoder() {
                if t.special {
                    a.control.insert(id);
                } else if !t.content.trim().is_empty() {
                    a.plain.push((id, t.content));
                }
            }
            a
        })
    }

    /// The added tokens that are not control tokens, with their text (not blank).
    pub(crate) fn plain_added(&self) -> &[(u32, String)] {
        &self.added().plain
    }

    /// The underlying `tokenizers` tokenizer (for streaming decode).
    pub fn inner(&self) -> &Tokenizer {
        &self.inner
    }

    /// Whether a chat template is known.
    pub fn has_chat_template(&self) -> bool {
        self.chat_template.is_some()
    }

    /// Renders the chat template for one user message, ready for generation, within
    /// [`CHAT_TEMPLATE_FUEL`] instructions and [`CHAT_TEMPLATE_OUTPUT`] bytes.
    pub fn apply_chat_template(&self, user: &str) -> Result<String> {
        self.apply_chat_template_to(&[ChatMessage {
            role: "user".into(),
            content: user.into(),
        }])
    }

    /// `messages` rendered by the model's chat template (a conversation: system, user and
    /// assistant turns), ending in the prompt of the assistant's next turn.
    pub fn apply_chat_template_to(&self, messages: &[ChatMessage]) -> Result<String> {
        let Some(tpl) = &self.chat_template else {
            return Err(ModelError::Tokenizer(
                Message::from("this model has no chat template; drop ")
                    .input(ModelInput::Chat)
                    .text(" and write the prompt yourself"),
            ));
        };
        let mut env = minijinja::Environment::new();
        // A compute limit: a real chat template runs a few thousand instructions; nested
        // loops over a hostile template would otherwise run for ever while memory grows.
        env.set_fuel(Some(CHAT_TEMPLATE_FUEL));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env.add_template("chat", tpl).map_err(|e| {
            ModelError::Tokenizer(format!("the chat template does not parse: {e}").into())
        })?;
        let t = env.get_template("chat").map_err(tok_err)?;
        // Rendered into a writer that refuses bytes past the cap, so output that grows
        // within the fuel stops at the cap rather than after it.
        let mut out = guard::Capped::new(CHAT_TEMPLATE_OUTPUT);
        let rendered = t.render_captured_to(
            minijinja::context! {
                messages => messages
                    .iter()
                    .map(|m| minijinja::context! { role => m.role.as_str(), content => m.content.as_str() })
                    .collect::<Vec<_>>(),
                add_generation_prompt => true,
                bos_token => self.bos_text.clone(),
                eos_token => self.eos_text.clone(),
            },
            &mut out,
        );
        if out.overflowed() {
            return Err(ModelError::Tokenizer(format!(
                "the chat template rendered more than {} MiB for {} bytes of messages; the template is broken",
                CHAT_TEMPLATE_OUTPUT >> 20,
                messages.iter().map(|m| m.content.len()).sum::<usize>(),
            ).into()));
        }
        rendered
            .map_err(|e| ModelError::Tokenizer(format!("the chat template failed: {e}").into()))?;
        let text = out.into_string().map_err(|_| {
            ModelError::Tokenizer("the chat template rendered text that is not UTF-8".into())
        })?;
        Ok(text)
    }
}

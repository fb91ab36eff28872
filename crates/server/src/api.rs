//! The requests of OpenAI's API this server takes — `POST /v1/completions` and
//! `POST /v1/chat/completions` (OpenAI API reference, "Completions" and "Chat") — parsed
//! and checked: the prompt, and how to generate ([`Params`]). Every refusal is a 400
//! naming the field at fault (`serde_path_to_error` gives its path).
use serde::de::DeserializeOwned;
use serde::Deserialize;

use crate::error::ApiError;

/// At most this many stop sequences (OpenAI's limit).
pub const MAX_STOP: usize = 4;
/// At most this many bytes per stop sequence.
pub const MAX_STOP_BYTES: usize = 256;
/// At most this many alternatives per token in `logprobs` (completions) and
/// `top_logprobs` (chat).
pub const MAX_TOP_LOGPROBS: usize = 20;
/// `max_tokens` when a completion request gives none (OpenAI's default).
pub const DEFAULT_COMPLETION_TOKENS: usize = 16;
/// At most this many choices per request (`n`); fewer when the server's batch and queue
/// hold fewer.
pub const MAX_CHOICES: usize = 16;
/// At most this many `logit_bias` entries (OpenAI's limit).
pub const MAX_LOGIT_BIAS: usize = 300;

/// A prompt as `/v1/completions` takes it.
#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub enum PromptIn {
    /// Text.
    Text(String),
    /// Token ids.
    Ids(Vec<u32>),
    /// A batch of one text.
    Texts(Vec<String>),
    /// A batch of one list of token ids.
    IdLists(Vec<Vec<u32>>),
}

/// `stop`: one sequence or a list.
#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub enum StopIn {
    /// One sequence.
    One(String),
    /// Up to [`MAX_STOP`] sequences.
    Many(Vec<String>),
}

/// `stream_options`.
#[derive(Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    /// Send a last chunk with the usage counts before `[DONE]`.
    #[serde(default)]
    pub include_usage: bool,
}

/// What both endpoints share.
#[derive(Deserialize, Debug, Default)]
pub struct Common {
    /// The model's name: any string (the server serves one model; checked for its type).
    #[serde(default, rename = "model")]
    pub _model: Option<String>,
    /// Most tokens to generate.
    #[serde(default)]
    pub max_tokens: Option<u32>,
    /// Sampling temperature in [0, 2]; 0 (the default here) is greedy.
    #[serde(default)]
    pub temperature: Option<f64>,
    /// Nucleus sampling mass in (0, 1].
    #[serde(default)]
    pub top_p: Option<f64>,
    /// The sampler's seed.
    #[serde(default)]
    pub seed: Option<i64>,
    /// Sequences that end the generation (not included in the text).
    #[serde(default)]
    pub stop: Option<StopIn>,
    /// Completions per prompt: only 1.
    #[serde(default)]
    pub n: Option<u32>,
    /// Server-sent events instead of one response.
    #[serde(default)]
    pub stream: Option<bool>,
    /// Streaming options.
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    /// Added to the logits of the token ids named (as strings) before sampling, each in
    /// [-100, 100].
    #[serde(default)]
    pub logit_bias: Option<std::collections::BTreeMap<String, f64>>,
    /// Subtracted once from the logit of every token already generated, in [-2, 2].
    #[serde(default)]
    pub presence_penalty: Option<f64>,
    /// Subtracted from a token's logit per time it was generated, in [-2, 2].
    #[serde(default)]
    pub frequency_penalty: Option<f64>,
    /// The end user's identifier (no effect on the output).
    #[serde(default, rename = "user")]
    pub _user: Option<String>,
}

/// `POST /v1/completions`.
#[derive(Deserialize, Debug)]
pub struct CompletionBody {
    /// The prompt.
    pub prompt: PromptIn,
    /// Log-probabilities of the chosen token and this many alternatives.
    #[serde(default)]
    pub logprobs: Option<u32>,
    /// Echo the prompt back: not served.
    #[serde(default)]
    pub echo: Option<bool>,
    /// Candidates per choice: only `n` (each choice is one candidate).
    #[serde(default)]
    pub best_of: Option<u32>,
}

/// A chat message's content: text, or a list of parts of which text ones are read.
#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub enum ContentIn {
    /// Text.
    Text(String),
    /// Parts: `{"type": "text", "text": …}`.
    Parts(Vec<ContentPart>),
}

/// One part of a message's content.
#[derive(Deserialize, Debug)]
pub struct ContentPart {
    /// `text` (the only type served).
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a `text` part.
    #[serde(default)]
    pub text: Option<String>,
}

/// One chat message (no other fields: a `name` or tool call would be dropped).
#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub struct MessageIn {
    /// `system`, `developer`, `user` or `assistant`.
    pub role: String,
    /// Its content.
    #[serde(default)]
    pub content: Option<ContentIn>,
}

/// `POST /v1/chat/completions`.
#[derive(Deserialize, Debug)]
pub struct ChatBody {
    /// The conversation.
    pub messages: Vec<MessageIn>,
    /// The newer name of `max_tokens`.
    #[serde(default)]
    pub max_completion_tokens: Option<u32>,
    /// Return the chosen tokens' log-probabilities.
    #[serde(default)]
    pub logprobs: Option<bool>,
    /// Alternatives per token with `logprobs`.
    #[serde(default)]
    pub top_logprobs: Option<u32>,
}

/// How to generate, checked.
#[derive(Debug, Clone)]
pub struct Params {
    /// Most tokens to generate; `None`: up to the context.
    pub max_tokens: Option<usize>,
    /// 0: greedy.
    pub temperature: f64,
    /// Nucleus mass.
    pub top_p: Option<f64>,
    /// The sampler's seed.
    pub seed: u64,
    /// Stop sequences.
    pub stop: Vec<String>,
    /// Alternatives per token when log-probabilities are asked for.
    pub logprobs: Option<usize>,
    /// Stream the answer.
    pub stream: bool,
    /// Send the usage before `[DONE]` when streaming.
    pub include_usage: bool,
    /// Choices to generate.
    pub n: usize,
    /// How the logits are changed before sampling.
    pub shaping: Shaping,
}

/// What changes a row of logits before sampling (OpenAI's `logit_bias`,
/// `presence_penalty` and `frequency_penalty`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Shaping {
    /// Token ids and the bias added to their logits.
    pub bias: Vec<(u32, f32)>,
    /// Subtracted once from every generated token's logit.
    pub presence: f32,
    /// Subtracted per generation of a token from its logit.
    pub frequency: f32,
}

impl Shaping {
    /// Whether the logits are used as the model gave them.
    pub fn is_none(&self) -> bool {
        self.bias.is_empty() && self.presence == 0.0 && self.frequency == 0.0
    }
}

/// The room a request may take: token ids below `vocab`, up to `max_choices` choices.
#[derive(Debug, Clone, Copy)]
pub struct Room {
    /// Token ids below this.
    pub vocab: usize,
    /// Choices per request at most.
    pub max_choices: usize,
}

/// The body as a JSON object: malformed JSON, trailing bytes or another JSON value is a
/// 400 on `body`.
pub fn object(body: &[u8]) -> Result<serde_json::Value, ApiError> {
    let v: serde_json::Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::invalid("body", format!("the request body is not valid JSON: {e}"))
    })?;
    if !v.is_object() {
        return Err(ApiError::invalid(
            "body",
            "the request body must be a JSON object",
        ));
    }
    Ok(v)
}

/// `v` read as `T`: a missing field or a wrong type is a 400 naming the field's path.
pub fn read<T: DeserializeOwned>(v: &serde_json::Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(v).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if path == "." {
            // A missing field: serde names it in the message.
            let field = inner
                .to_string()
                .split('`')
                .nth(1)
                .unwrap_or("body")
                .to_string();
            ApiError::invalid(field, format!("{inner}"))
        } else {
            ApiError::invalid(path.clone(), format!("`{path}`: {inner}"))
        }
    })
}

/// The shared fields checked; `logprobs` as the endpoint asked.
pub fn params(
    c: &Common,
    max_tokens: Option<u32>,
    logprobs: Option<usize>,
    room: Room,
) -> Result<Params, ApiError> {
    let n = c.n.unwrap_or(1) as usize;
    if n == 0 || n > room.max_choices {
        return Err(ApiError::invalid(
            "n",
            format!("n = {n}: give 1 to {} choices", room.max_choices),
        ));
    }
    let shaping = shaping(c, room.vocab)?;
    let temperature = c.temperature.unwrap_or(0.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::invalid(
            "temperature",
            format!("temperature {temperature} is outside [0, 2]"),
        ));
    }
    if let Some(p) = c.top_p {
        if !(p > 0.0 && p <= 1.0) {
            return Err(ApiError::invalid(
                "top_p",
                format!("top_p {p} is outside (0, 1]"),
            ));
        }
    }
    let max_tokens = match max_tokens {
        Some(0) => {
            return Err(ApiError::invalid(
                "max_tokens",
                "max_tokens must be at least 1",
            ))
        }
        m => m.map(|m| m as usize),
    };
    let stop = match &c.stop {
        None => Vec::new(),
        Some(StopIn::One(s)) => vec![s.clone()],
        Some(StopIn::Many(v)) => v.clone(),
    };
    if stop.len() > MAX_STOP {
        return Err(ApiError::invalid(
            "stop",
            format!("{} stop sequences: at most {MAX_STOP}", stop.len()),
        ));
    }
    if let Some(s) = stop
        .iter()
        .find(|s| s.is_empty() || s.len() > MAX_STOP_BYTES)
    {
        return Err(ApiError::invalid(
            "stop",
            format!(
                "a stop sequence of {} bytes: each must hold 1 to {MAX_STOP_BYTES}",
                s.len()
            ),
        ));
    }
    if let Some(n) = logprobs {
        if n > MAX_TOP_LOGPROBS {
            return Err(ApiError::invalid(
                "logprobs",
                format!("{n} alternatives per token: at most {MAX_TOP_LOGPROBS}"),
            ));
        }
    }
    Ok(Params {
        max_tokens,
        temperature,
        top_p: c.top_p,
        // OpenAI's seed is any integer; the sampler's is its 64 bits.
        seed: c.seed.map_or(299_792_458, |s| s as u64),
        stop,
        logprobs,
        stream: c.stream.unwrap_or(false),
        include_usage: c.stream_options.as_ref().is_some_and(|o| o.include_usage),
        n,
        shaping,
    })
}

/// `logit_bias` and the penalties, checked: ids in the vocabulary, values in range.
fn shaping(c: &Common, vocab: usize) -> Result<Shaping, ApiError> {
    let mut bias = Vec::new();
    if let Some(map) = &c.logit_bias {
        if map.len() > MAX_LOGIT_BIAS {
            return Err(ApiError::invalid(
                "logit_bias",
                format!("{} entries: at most {MAX_LOGIT_BIAS}", map.len()),
            ));
        }
        for (id, &b) in map {
            let tok = id.parse::<u32>().ok().filter(|&t| (t as usize) < vocab);
            let Some(tok) = tok else {
                return Err(ApiError::invalid(
                    "logit_bias",
                    format!(
                        "`{id}` is not a token id of this model (0 to {})",
                        vocab.saturating_sub(1)
                    ),
                ));
            };
            if !(-100.0..=100.0).contains(&b) {
                return Err(ApiError::invalid(
                    "logit_bias",
                    format!("bias {b} for token {id} is outside [-100, 100]"),
                ));
            }
            bias.push((tok, b as f32));
        }
    }
    let penalty = |v: Option<f64>, name: &str| -> Result<f32, ApiError> {
        let p = v.unwrap_or(0.0);
        if !(-2.0..=2.0).contains(&p) {
            return Err(ApiError::invalid(
                name,
                format!("{name} {p} is outside [-2, 2]"),
            ));
        }
        Ok(p as f32)
    };
    Ok(Shaping {
        presence: penalty(c.presence_penalty, "presence_penalty")?,
        frequency: penalty(c.frequency_penalty, "frequency_penalty")?,
        bias,
    })
}

/// What a completion request's prompt is.
pub enum Prompt {
    /// Text to tokenize.
    Text(String),
    /// Token ids, used as they are.
    Ids(Vec<u32>),
}

/// The one prompt of a completion request.
pub fn completion_prompt(p: PromptIn) -> Result<Prompt, ApiError> {
    let one = |n: usize| {
        ApiError::invalid(
            "prompt",
            format!("a batch of {n} prompts: send one prompt per request"),
        )
    };
    Ok(match p {
        PromptIn::Text(t) => Prompt::Text(t),
        PromptIn::Ids(ids) => Prompt::Ids(ids),
        PromptIn::Texts(mut v) if v.len() == 1 => Prompt::Text(v.remove(0)),
        PromptIn::IdLists(mut v) if v.len() == 1 => Prompt::Ids(v.remove(0)),
        PromptIn::Texts(v) => return Err(one(v.len())),
        PromptIn::IdLists(v) => return Err(one(v.len())),
    })
}

/// The conversation as the chat template takes it.
pub fn chat_messages(
    messages: &[MessageIn],
) -> Result<Vec<kvpolicy::models::ChatMessage>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid("messages", "messages is empty"));
    }
    messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let role = match m.role.as_str() {
                "developer" => "system",
                r @ ("system" | "user" | "assistant") => r,
                other => {
                    return Err(ApiError::invalid(
                        format!("messages[{i}].role"),
                        format!("role `{other}`: use system, developer, user or assistant"),
                    ))
                }
            };
            let content = match &m.content {
                None => String::new(),
                Some(ContentIn::Text(t)) => t.clone(),
                Some(ContentIn::Parts(parts)) => {
                    let mut text = String::new();
                    for (j, p) in parts.iter().enumerate() {
                        match (p.kind.as_str(), &p.text) {
                            ("text", Some(t)) => text.push_str(t),
                            (kind, _) => {
                                return Err(ApiError::invalid(
                                    format!("messages[{i}].content[{j}]"),
                                    format!("a `{kind}` part: only text parts are served"),
                                ))
                            }
                        }
                    }
                    text
                }
            };
            Ok(kvpolicy::models::ChatMessage {
                role: role.to_string(),
                content,
            })
        })
        .collect()
}

//! The JSON of OpenAI's responses: a whole completion or chat completion, and the chunks
//! of a streamed one (`text_completion`, `chat.completion`, `chat.completion.chunk`), with
//! `usage` and, when asked, `logprobs` in each endpoint's shape.
use serde_json::{json, Value};

use crate::events::{Finish, TokenLogprob};

/// Which endpoint answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/completions`.
    Completion,
    /// `/v1/chat/completions`.
    Chat,
}

/// What every response of one request shares.
#[derive(Debug, Clone)]
pub struct Head {
    /// `cmpl-…` or `chatcmpl-…`.
    pub id: String,
    /// Unix seconds at the request.
    pub created: u64,
    /// The served model's name.
    pub model: String,
    /// The endpoint.
    pub endpoint: Endpoint,
}

/// Token counts (the prompt once, every choice's generated tokens).
#[derive(Debug, Clone, Copy, Default)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt: usize,
    /// Generated tokens.
    pub completion: usize,
}

impl Usage {
    fn json(self) -> Value {
        json!({
            "prompt_tokens": self.prompt,
            "completion_tokens": self.completion,
            "total_tokens": self.prompt + self.completion,
        })
    }
}

/// `logprobs` of `tokens` in the endpoint's shape (completions: parallel lists; chat: a
/// `content` list of objects).
pub fn logprobs(endpoint: Endpoint, tokens: &[TokenLogprob], offset: usize) -> Value {
    match endpoint {
        Endpoint::Completion => {
            let mut at = offset;
            let offsets: Vec<usize> = tokens
                .iter()
                .map(|t| {
                    let o = at;
                    at += t.token.len();
                    o
                })
                .collect();
            json!({
                "tokens": tokens.iter().map(|t| t.token.clone()).collect::<Vec<_>>(),
                "token_logprobs": tokens.iter().map(|t| t.logprob).collect::<Vec<_>>(),
                "top_logprobs": tokens.iter().map(|t| {
                    t.top.iter().map(|(s, l)| (s.clone(), json!(l))).collect::<serde_json::Map<_, _>>()
                }).collect::<Vec<_>>(),
                "text_offset": offsets,
            })
        }
        Endpoint::Chat => json!({
            "content": tokens.iter().map(|t| json!({
                "token": t.token,
                "logprob": t.logprob,
                "bytes": t.token.as_bytes(),
                "top_logprobs": t.top.iter().map(|(s, l)| json!({
                    "token": s, "logprob": l, "bytes": s.as_bytes(),
                })).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
        }),
    }
}

/// One choice of a whole response.
#[derive(Debug, Clone, Default)]
pub struct Choice {
    /// Its text.
    pub text: String,
    /// Its log-probabilities, when asked for.
    pub logprobs: Option<Value>,
    /// Why it ended.
    pub finish: Option<Finish>,
}

/// A whole response.
pub fn whole(head: &Head, choices: &[Choice], usage: Usage) -> Value {
    let choices: Vec<Value> = choices
        .iter()
        .enumerate()
        .map(|(index, c)| {
            let finish = c.finish.map(Finish::as_str);
            match head.endpoint {
                Endpoint::Completion => json!({
                    "index": index,
                    "text": c.text,
                    "logprobs": c.logprobs,
                    "finish_reason": finish,
                }),
                Endpoint::Chat => json!({
                    "index": index,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": c.logprobs,
                    "finish_reason": finish,
                }),
            }
        })
        .collect();
    json!({
        "id": head.id,
        "object": match head.endpoint {
            Endpoint::Completion => "text_completion",
            Endpoint::Chat => "chat.completion",
        },
        "created": head.created,
        "model": head.model,
        "choices": choices,
        "usage": usage.json(),
    })
}

/// A streamed chunk of choice `index`: a piece of text (chat: the first carries the
/// role), or the end.
pub fn chunk(
    head: &Head,
    index: usize,
    text: Option<&str>,
    logprobs: Option<Value>,
    finish: Option<Finish>,
    first: bool,
) -> Value {
    let choice = match head.endpoint {
        Endpoint::Completion => json!({
            "index": index,
            "text": text.unwrap_or(""),
            "logprobs": logprobs,
            "finish_reason": finish.map(Finish::as_str),
        }),
        Endpoint::Chat => {
            let mut delta = serde_json::Map::new();
            if first {
                delta.insert("role".into(), json!("assistant"));
            }
            if let Some(t) = text {
                delta.insert("content".into(), json!(t));
            }
            json!({
                "index": index,
                "delta": delta,
                "logprobs": logprobs,
                "finish_reason": finish.map(Finish::as_str),
            })
        }
    };
    json!({
        "id": head.id,
        "object": object_of_chunk(head.endpoint),
        "created": head.created,
        "model": head.model,
        "choices": [choice],
    })
}

/// The last chunk before `[DONE]` with `stream_options.include_usage`: no choices.
pub fn usage_chunk(head: &Head, usage: Usage) -> Value {
    json!({
        "id": head.id,
        "object": object_of_chunk(head.endpoint),
        "created": head.created,
        "model": head.model,
        "choices": [],
        "usage": usage.json(),
    })
}

fn object_of_chunk(e: Endpoint) -> &'static str {
    match e {
        Endpoint::Completion => "text_completion",
        Endpoint::Chat => "chat.completion.chunk",
    }
}

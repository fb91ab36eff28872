//! The fields of a request body, checked before it is read: each one the server serves, or a
//! 400 naming it — one it does not serve (`tools`, structured output, `suffix`) or does not
//! know — so that nothing a client asks for is accepted and silently ignored (OpenAI refuses
//! unknown arguments too).
use crate::error::ApiError;

/// Fields both endpoints serve.
const COMMON_FIELDS: &[&str] = &[
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "n",
    "stream",
    "stream_options",
    "logit_bias",
    "presence_penalty",
    "frequency_penalty",
    "user",
];
/// Fields only `/v1/completions` serves.
const COMPLETION_FIELDS: &[&str] = &["prompt", "logprobs", "echo", "best_of"];
/// Fields only `/v1/chat/completions` serves.
const CHAT_FIELDS: &[&str] = &[
    "messages",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
];

/// Which endpoint's fields a body is checked against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fields {
    /// `/v1/completions`.
    Completion,
    /// `/v1/chat/completions`.
    Chat,
}

/// Refuses a field this server would otherwise ignore (OpenAI refuses unknown arguments
/// too): one it does not serve (`tools`, `response_format` other than text, `suffix`, …)
/// or does not know. A field given as `null` is taken as absent, and the values that ask
/// for what the server does anyway (`response_format: {"type": "text"}`, no tools,
/// `tool_choice: "none"`) are accepted.
pub fn check_fields(v: &serde_json::Value, which: Fields) -> Result<(), ApiError> {
    let Some(map) = v.as_object() else {
        return Ok(());
    };
    let own = match which {
        Fields::Completion => COMPLETION_FIELDS,
        Fields::Chat => CHAT_FIELDS,
    };
    for (name, value) in map {
        if value.is_null() || COMMON_FIELDS.contains(&name.as_str()) || own.contains(&name.as_str())
        {
            continue;
        }
        let default_asked = match name.as_str() {
            "response_format" => value.get("type").and_then(|t| t.as_str()) == Some("text"),
            "tools" | "functions" => value.as_array().is_some_and(Vec::is_empty),
            "tool_choice" | "function_call" => value.as_str() == Some("none"),
            "parallel_tool_calls" | "store" | "logprobs" => value == &serde_json::json!(false),
            _ => false,
        };
        if default_asked {
            continue;
        }
        let why = match name.as_str() {
            "response_format" => "structured output (`response_format`) is not served: this server generates free text",
            "tools" | "tool_choice" | "functions" | "function_call" | "parallel_tool_calls" => {
                "tool and function calling is not served: this server generates free text"
            }
            "suffix" => "`suffix` (insertion) is not served",
            "echo" | "best_of" | "logprobs" | "top_logprobs" | "messages" | "prompt"
            | "max_completion_tokens" => "this field belongs to the other endpoint",
            _ => "unrecognized request argument: this server does not serve it",
        };
        return Err(ApiError::invalid(name.clone(), format!("`{name}`: {why}")));
    }
    Ok(())
}

//! The HTTP side (axum): the routes, and each request from its JSON to the engine and
//! back ([`crate::answer`]). The access rules run first ([`crate::guard`]); the body is
//! read, parsed and tokenized by [`crate::intake`]. A client that goes away drops its
//! receiver, which the engine sees at the next step boundary: the request is cancelled and
//! its cache freed.
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use kvpolicy::models::TextTokenizer;
use serde_json::json;
use tokio::sync::mpsc;

use crate::answer;
use crate::api::{self, ChatBody, Common, CompletionBody, Params, Prompt, Room};
use crate::engine::{EngineHandle, Refused};
use crate::error::ApiError;
use crate::events::{Job, Outbox};
use crate::fields::{check_fields, Fields};
use crate::guard::Access;
use crate::intake::Intake;
use crate::metrics::Metrics;
use crate::reply::{Endpoint, Head};

/// What every handler shares.
pub struct AppState {
    /// The engine.
    pub engine: EngineHandle,
    /// Bodies to token ids, off the I/O threads.
    pub intake: Intake,
    /// The name `/v1/models` lists and responses carry.
    pub model_name: String,
    /// Token ids below this.
    pub vocab: usize,
    /// Prompt plus generated tokens at most.
    pub context: usize,
    /// Prompt tokens at most (413 past it).
    pub max_prompt: Option<usize>,
    /// Choices per request at most (`n`).
    pub max_choices: usize,
    /// The metrics.
    pub metrics: Arc<Metrics>,
    /// Who may call.
    pub access: Access,
    /// Unix seconds at start-up.
    pub created: u64,
    /// Numbers request ids.
    pub next_id: AtomicU64,
}

/// A request parsed: its prompt's ids and how to generate.
pub struct Parsed {
    /// The prompt.
    pub ids: Vec<u32>,
    /// How to generate.
    pub params: Params,
    /// `max_tokens` as the client gave it.
    pub asked: Option<u32>,
}

impl AppState {
    fn room(&self) -> Room {
        Room {
            vocab: self.vocab,
            max_choices: self.max_choices,
        }
    }

    /// Prompt tokens at most: `--max-prompt-tokens` or the context.
    fn prompt_limit(&self) -> usize {
        self.max_prompt.unwrap_or(self.context).min(self.context)
    }

    /// Refuses `bytes` of text in `field` that no tokenization fits in the prompt limit.
    fn refuse_long_text(&self, bytes: usize, field: &str) -> Result<(), ApiError> {
        let most = self.prompt_limit();
        if !self.intake.exceeds(bytes, most) {
            return Ok(());
        }
        let (status, limit) = match self.max_prompt {
            Some(m) if m < self.context => (
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("this server takes at most {m} (--max-prompt-tokens)"),
            ),
            _ => (
                StatusCode::BAD_REQUEST,
                format!("this model's context is {} tokens", self.context),
            ),
        };
        Err(ApiError {
            param: Some(field.to_string()),
            ..ApiError::status(
                status,
                format!("the prompt's {bytes} bytes of text hold more tokens than fit: {limit}"),
            )
        })
    }
}

/// The server's routes over `state`.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .method_not_allowed_fallback(wrong_method)
        .layer(middleware::from_fn_with_state(state.clone(), guard))
        .with_state(state)
}

/// The access rules, then the route; every answer counted by route and status.
async fn guard(State(s): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let path = req.uri().path();
    let route = match path {
        "/v1/completions" | "/v1/chat/completions" | "/v1/models" | "/health" | "/metrics" => path,
        _ => "other",
    }
    .to_string();
    let response = match s.access.check(req.method(), path, req.headers()) {
        Ok(()) => next.run(req).await,
        Err(e) => e.into_response(),
    };
    s.metrics.answered(&route, response.status().as_u16());
    response
}

async fn not_found(req: Request) -> ApiError {
    ApiError::status(
        StatusCode::NOT_FOUND,
        format!(
            "no route {} {}: the server has POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health and GET /metrics",
            req.method(),
            req.uri().path()
        ),
    )
}

async fn wrong_method(req: Request) -> ApiError {
    ApiError::status(
        StatusCode::METHOD_NOT_ALLOWED,
        format!(
            "{} {}: this route takes {}",
            req.method(),
            req.uri().path(),
            if req.uri().path().starts_with("/v1/") && req.uri().path() != "/v1/models" {
                "POST"
            } else {
                "GET"
            }
        ),
    )
}

/// 200 while the engine runs; 503 once it has stopped.
async fn health(State(s): State<Arc<AppState>>) -> Response {
    if s.engine.alive() {
        Json(json!({"status": "ok"})).into_response()
    } else {
        ApiError::status(StatusCode::SERVICE_UNAVAILABLE, "the engine has stopped").into_response()
    }
}

async fn models(State(s): State<Arc<AppState>>) -> Json<serde_json::Value> {
    Json(json!({"object": "list", "data": [{
        "id": s.model_name, "object": "model", "created": s.created, "owned_by": "kvpolicy",
    }]}))
}

async fn metrics(State(s): State<Arc<AppState>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        s.metrics.render(),
    )
        .into_response()
}

async fn completions(State(s): State<Arc<AppState>>, req: Request) -> Response {
    take(s, req, Endpoint::Completion).await
}

async fn chat(State(s): State<Arc<AppState>>, req: Request) -> Response {
    take(s, req, Endpoint::Chat).await
}

/// A generation request: its body read, parsed and tokenized off the I/O threads
/// ([`Intake`]), then served.
async fn take(s: Arc<AppState>, req: Request, endpoint: Endpoint) -> Response {
    let body = match s.intake.body(req.into_body()).await {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    let st = s.clone();
    let parsed = s
        .intake
        .run(move |tok| match endpoint {
            Endpoint::Completion => completion_request(&st, tok, &body),
            Endpoint::Chat => chat_request(&st, tok, &body),
        })
        .await;
    let field = match endpoint {
        Endpoint::Completion => "prompt",
        Endpoint::Chat => "messages",
    };
    match parsed {
        Ok(p) => serve(&s, endpoint, p, field).await,
        Err(e) => e.into_response(),
    }
}

fn completion_request(s: &AppState, tok: &TextTokenizer, body: &[u8]) -> Result<Parsed, ApiError> {
    let v = api::object(body)?;
    check_fields(&v, Fields::Completion)?;
    let b: CompletionBody = api::read(&v)?;
    let common: Common = api::read(&v)?;
    if b.echo == Some(true) {
        return Err(ApiError::invalid("echo", "echo is not served"));
    }
    let logprobs = b.logprobs.map(|n| n as usize);
    let params = api::params(&common, common.max_tokens, logprobs, s.room())?;
    if let Some(best) = b.best_of {
        if best as usize != params.n {
            return Err(ApiError::invalid(
                "best_of",
                format!(
                    "best_of {best} with n = {}: only best_of = n is served (every candidate is returned)",
                    params.n
                ),
            ));
        }
    }
    let ids = match api::completion_prompt(b.prompt)? {
        Prompt::Ids(ids) => ids,
        Prompt::Text(t) => {
            s.refuse_long_text(t.len(), "prompt")?;
            let ids = if s.intake.parse_special {
                tok.encode(&t)
            } else {
                tok.encode_text(&t)
            };
            ids.map_err(|e| {
                ApiError::invalid("prompt", format!("the prompt does not tokenize: {e}"))
            })?
        }
    };
    Ok(Parsed {
        ids,
        params,
        asked: common.max_tokens,
    })
}

fn chat_request(s: &AppState, tok: &TextTokenizer, body: &[u8]) -> Result<Parsed, ApiError> {
    let v = api::object(body)?;
    check_fields(&v, Fields::Chat)?;
    let b: ChatBody = api::read(&v)?;
    let common: Common = api::read(&v)?;
    let logprobs = match (b.logprobs, b.top_logprobs) {
        (Some(true), n) => Some(n.unwrap_or(0) as usize),
        (_, Some(_)) => {
            return Err(ApiError::invalid(
                "top_logprobs",
                "top_logprobs needs logprobs: true",
            ))
        }
        _ => None,
    };
    let max = b.max_completion_tokens.or(common.max_tokens);
    let params = api::params(&common, max, logprobs, s.room())?;
    let messages = api::chat_messages(&b.messages)?;
    let most = s.prompt_limit();
    if messages.len() > most {
        return Err(ApiError::invalid(
            "messages",
            format!(
                "{} messages: at most {most} fit in a prompt of {most} tokens",
                messages.len()
            ),
        ));
    }
    s.refuse_long_text(messages.iter().map(|m| m.content.len()).sum(), "messages")?;
    // Only the template's own markers are control tokens: a message's text is text. A
    // rendering too long for the prompt is refused before it is tokenized.
    let ids = tok
        .encode_chat(&messages, s.intake.most_bytes(most))
        .map_err(|e| ApiError::invalid("messages", format!("{e}")))?;
    Ok(Parsed {
        ids,
        params,
        asked: max,
    })
}

/// Checks the prompt against the model, queues it, and answers whole or streamed.
async fn serve(s: &AppState, endpoint: Endpoint, parsed: Parsed, field: &str) -> Response {
    let Parsed {
        ids: prompt,
        params,
        asked,
    } = parsed;
    if prompt.is_empty() {
        return ApiError::invalid(field, "the prompt is empty").into_response();
    }
    if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= s.vocab) {
        return ApiError::invalid(
            field,
            format!(
                "token id {bad} is outside the vocabulary of {} ids",
                s.vocab
            ),
        )
        .into_response();
    }
    let room = s.context.saturating_sub(prompt.len());
    if room == 0 {
        return ApiError::invalid(
            field,
            format!(
                "the prompt holds {} tokens; this model's context is {} tokens",
                prompt.len(),
                s.context
            ),
        )
        .into_response();
    }
    // Past the model: 400 (above); past the server's own limit: 413.
    if let Some(most) = s.max_prompt.filter(|&m| prompt.len() > m) {
        return ApiError {
            param: Some(field.to_string()),
            ..ApiError::status(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!(
                    "the prompt holds {} tokens; this server takes at most {most} (--max-prompt-tokens)",
                    prompt.len()
                ),
            )
        }
        .into_response();
    }
    let max_tokens = match (params.max_tokens, endpoint) {
        (Some(m), _) if m > room => {
            let name = if asked.is_some() { "max_tokens" } else { field };
            return ApiError::invalid(
                name,
                format!(
                    "{} prompt tokens + max_tokens {m} exceed this model's context of {} tokens; ask for at most {room}",
                    prompt.len(),
                    s.context
                ),
            )
            .into_response();
        }
        (Some(m), _) => m,
        (None, Endpoint::Completion) => api::DEFAULT_COMPLETION_TOKENS.min(room),
        (None, Endpoint::Chat) => room,
    };
    let (tx, rx) = mpsc::unbounded_channel();
    let (stream, n) = (params.stream, params.n);
    let head = Head {
        id: format!(
            "{}-{}",
            if endpoint == Endpoint::Chat {
                "chatcmpl"
            } else {
                "cmpl"
            },
            s.next_id.fetch_add(1, Ordering::Relaxed)
        ),
        created: unix_now(),
        model: s.model_name.clone(),
        endpoint,
    };
    let include_usage = params.include_usage;
    let received = Instant::now();
    // Choice i samples with seed + i: n = 1 is the seed as given.
    let jobs = (0..n)
        .map(|index| Job {
            prompt: prompt.clone(),
            params: params.clone(),
            seed: params.seed.wrapping_add(index as u64),
            max_tokens,
            events: Outbox {
                index,
                tx: tx.clone(),
            },
            received,
        })
        .collect();
    drop(tx);
    match s.engine.submit(jobs) {
        Ok(()) => {}
        Err(Refused::Full) => {
            return ApiError {
                retry_after: Some(1),
                ..ApiError::status(
                    StatusCode::TOO_MANY_REQUESTS,
                    "the queue is full; retry shortly",
                )
            }
            .into_response()
        }
        Err(Refused::Stopped) => {
            return ApiError::status(
                StatusCode::SERVICE_UNAVAILABLE,
                "the server is shutting down",
            )
            .into_response()
        }
    }
    if stream {
        answer::streamed(head, n, rx, include_usage).into_response()
    } else {
        answer::whole(head, n, rx).await
    }
}

/// Seconds since the Unix epoch (0 on a clock before it).
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

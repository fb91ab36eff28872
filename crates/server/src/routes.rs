//! The HTTP side (axum): the routes, the API key, the body limit, and each request from its
//! JSON to the engine and back — whole, or streamed as server-sent events ending in
//! `data: [DONE]`. A client that goes away drops its receiver, which the engine sees at the
//! next step boundary: the request is cancelled and its cache freed.
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::stream::{self, Stream};
use kvpolicy::models::TextTokenizer;
use serde_json::json;
use tokio::sync::mpsc;

use crate::api::{self, ChatBody, Common, CompletionBody, Params, Prompt};
use crate::engine::{EngineHandle, Refused};
use crate::error::ApiError;
use crate::events::{Event, Job};
use crate::metrics::Metrics;
use crate::reply::{self, Endpoint, Head, Usage};

/// What every handler shares.
pub struct AppState {
    /// The engine.
    pub engine: EngineHandle,
    /// The model's tokenizer.
    pub tok: Arc<TextTokenizer>,
    /// The name `/v1/models` lists and responses carry.
    pub model_name: String,
    /// Token ids below this.
    pub vocab: usize,
    /// Prompt plus generated tokens at most.
    pub context: usize,
    /// Prompt tokens at most (413 past it).
    pub max_prompt: Option<usize>,
    /// The metrics.
    pub metrics: Arc<Metrics>,
    /// Requests to `/v1/…` must carry `Authorization: Bearer KEY`.
    pub api_key: Option<String>,
    /// Unix seconds at start-up.
    pub created: u64,
    /// Numbers request ids.
    pub next_id: AtomicU64,
}

/// The server's routes over `state`, with bodies up to `max_body` bytes.
pub fn router(state: Arc<AppState>, max_body: usize) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .method_not_allowed_fallback(wrong_method)
        .layer(DefaultBodyLimit::max(max_body))
        .layer(middleware::from_fn_with_state(state.clone(), guard))
        .with_state(state)
}

/// The API key on `/v1/…`, and every answer counted by route and status.
async fn guard(State(s): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let path = req.uri().path().to_string();
    let route = match path.as_str() {
        "/v1/completions" | "/v1/chat/completions" | "/v1/models" | "/health" | "/metrics" => {
            path.as_str()
        }
        _ => "other",
    }
    .to_string();
    let authorized = match (&s.api_key, path.starts_with("/v1/")) {
        (Some(key), true) => req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .is_some_and(|given| given == key),
        _ => true,
    };
    let response = if authorized {
        next.run(req).await
    } else {
        ApiError::status(
            StatusCode::UNAUTHORIZED,
            "missing or wrong API key: send `Authorization: Bearer KEY` with the server's --api-key",
        )
        .into_response()
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

/// The body, or the rejection as an OpenAI error (413 past the limit).
fn body_of(body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|r| {
        ApiError::status(
            r.status(),
            format!("the request body was refused: {}", r.body_text()),
        )
    })
}

async fn completions(
    State(s): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let run = || -> Result<(Vec<u32>, Params, Option<u32>), ApiError> {
        let v = api::object(&body_of(body)?)?;
        let b: CompletionBody = api::read(&v)?;
        let common: Common = api::read(&v)?;
        if b.echo == Some(true) {
            return Err(ApiError::invalid("echo", "echo is not served"));
        }
        let logprobs = b.logprobs.map(|n| n as usize);
        let p = api::params(&common, common.max_tokens, logprobs)?;
        let ids = match api::completion_prompt(b.prompt)? {
            Prompt::Ids(ids) => ids,
            Prompt::Text(t) => s.tok.encode(&t).map_err(|e| {
                ApiError::invalid("prompt", format!("the prompt does not tokenize: {e}"))
            })?,
        };
        Ok((ids, p, common.max_tokens))
    };
    match run() {
        Ok((ids, p, asked)) => serve(&s, Endpoint::Completion, ids, p, asked, "prompt").await,
        Err(e) => e.into_response(),
    }
}

async fn chat(State(s): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    let run = || -> Result<(Vec<u32>, Params, Option<u32>), ApiError> {
        let v = api::object(&body_of(body)?)?;
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
        let p = api::params(&common, max, logprobs)?;
        let messages = api::chat_messages(&b.messages)?;
        let text = s
            .tok
            .apply_chat_template_to(&messages)
            .map_err(|e| ApiError::invalid("messages", format!("{e}")))?;
        let ids = s.tok.encode_raw(&text).map_err(|e| {
            ApiError::invalid(
                "messages",
                format!("the conversation does not tokenize: {e}"),
            )
        })?;
        Ok((ids, p, max))
    };
    match run() {
        Ok((ids, p, asked)) => serve(&s, Endpoint::Chat, ids, p, asked, "messages").await,
        Err(e) => e.into_response(),
    }
}

/// Checks the prompt against the model, queues it, and answers whole or streamed.
async fn serve(
    s: &AppState,
    endpoint: Endpoint,
    prompt: Vec<u32>,
    params: Params,
    asked: Option<u32>,
    field: &str,
) -> Response {
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
    let stream = params.stream;
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
    let job = Job {
        prompt,
        params,
        max_tokens,
        events: tx,
        received: Instant::now(),
    };
    match s.engine.submit(job) {
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
        streamed(head, rx, include_usage).into_response()
    } else {
        whole(head, rx).await
    }
}

/// Seconds since the Unix epoch (0 on a clock before it).
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Waits for the whole generation.
async fn whole(head: Head, mut rx: mpsc::UnboundedReceiver<Event>) -> Response {
    let mut text = String::new();
    let mut lps = Vec::new();
    let mut any_lp = false;
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Token { text: t, logprob } => {
                text.push_str(&t);
                if let Some(l) = logprob {
                    any_lp = true;
                    lps.push(l);
                }
            }
            Event::Done {
                finish,
                text: tail,
                prompt_tokens,
                completion_tokens,
            } => {
                text.push_str(&tail);
                let lp = any_lp.then(|| reply::logprobs(head.endpoint, &lps, 0));
                let usage = Usage {
                    prompt: prompt_tokens,
                    completion: completion_tokens,
                };
                return Json(reply::whole(&head, &text, lp, finish, usage)).into_response();
            }
            Event::Failed(why) => {
                return ApiError::status(StatusCode::INTERNAL_SERVER_ERROR, why).into_response()
            }
        }
    }
    ApiError::status(StatusCode::INTERNAL_SERVER_ERROR, "the engine stopped").into_response()
}

/// The generation as server-sent events.
fn streamed(
    head: Head,
    rx: mpsc::UnboundedReceiver<Event>,
    include_usage: bool,
) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
    struct St {
        head: Head,
        rx: mpsc::UnboundedReceiver<Event>,
        first: bool,
        offset: usize,
        pending: Vec<SseEvent>,
        ended: bool,
        include_usage: bool,
    }
    let data = |v: serde_json::Value| SseEvent::default().data(v.to_string());
    let st = St {
        head,
        rx,
        first: true,
        offset: 0,
        pending: Vec::new(),
        ended: false,
        include_usage,
    };
    let events = stream::unfold(st, move |mut st| async move {
        loop {
            if let Some(e) = st.pending.pop() {
                return Some((Ok(e), st));
            }
            if st.ended {
                return None;
            }
            match st.rx.recv().await {
                Some(Event::Token { text, logprob }) => {
                    if text.is_empty() && logprob.is_none() {
                        continue;
                    }
                    let lp = logprob.map(|l| reply::logprobs(st.head.endpoint, &[l], st.offset));
                    st.offset += text.len();
                    let c = reply::chunk(&st.head, Some(&text), lp, None, st.first);
                    st.first = false;
                    return Some((Ok(data(c)), st));
                }
                Some(Event::Done {
                    finish,
                    text,
                    prompt_tokens,
                    completion_tokens,
                }) => {
                    // Sent in reverse order of `pending`'s pops.
                    let mut out = vec![SseEvent::default().data("[DONE]")];
                    if st.include_usage {
                        let u = Usage {
                            prompt: prompt_tokens,
                            completion: completion_tokens,
                        };
                        out.push(data(reply::usage_chunk(&st.head, u)));
                    }
                    let t = (!text.is_empty()).then_some(text.as_str());
                    out.push(data(reply::chunk(
                        &st.head,
                        t,
                        None,
                        Some(finish),
                        st.first,
                    )));
                    st.pending = out;
                    st.ended = true;
                }
                Some(Event::Failed(why)) => {
                    let e = ApiError::status(StatusCode::INTERNAL_SERVER_ERROR, why);
                    st.pending = vec![SseEvent::default().data("[DONE]"), data(e.body())];
                    st.ended = true;
                }
                None => return None,
            }
        }
    });
    // Comments while a request waits in the queue, so clients and proxies keep the stream.
    Sse::new(events).keep_alive(KeepAlive::default())
}

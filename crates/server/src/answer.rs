//! A request's answer from its choices' events: one JSON response once every choice has
//! ended, or server-sent events as tokens come (each chunk names its choice's `index`),
//! then the usage when asked and `data: [DONE]`. A failure of any choice ends the answer:
//! a 500 (503 when shutting down) whole, an error event streamed — with a message that
//! names an id in the server's log, never the cause.
use std::convert::Infallible;

use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, Stream};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::error::ApiError;
use crate::events::{Event, TokenLogprob};
use crate::reply::{self, Choice, Head, Usage};

/// The events of a request's choices, tagged with their index.
pub type Events = UnboundedReceiver<(usize, Event)>;

/// The error a failed or cancelled choice ends the answer with.
fn failure(ev: &Event) -> Option<ApiError> {
    match ev {
        Event::Failed(why) => Some(ApiError::status(StatusCode::INTERNAL_SERVER_ERROR, why)),
        Event::ShuttingDown => Some(ApiError::status(
            StatusCode::SERVICE_UNAVAILABLE,
            "the server is shutting down",
        )),
        _ => None,
    }
}

/// Waits for every choice's whole generation.
pub async fn whole(head: Head, n: usize, mut rx: Events) -> Response {
    let mut choices: Vec<Choice> = (0..n).map(|_| Choice::default()).collect();
    let mut lps: Vec<Vec<TokenLogprob>> = vec![Vec::new(); n];
    let mut usage = Usage::default();
    let mut left = n;
    while let Some((i, ev)) = rx.recv().await {
        if let Some(e) = failure(&ev) {
            return e.into_response();
        }
        let Some(c) = choices.get_mut(i) else {
            continue;
        };
        match ev {
            Event::Token { text, logprob } => {
                c.text.push_str(&text);
                lps[i].extend(logprob);
            }
            Event::Done {
                finish,
                text,
                prompt_tokens,
                completion_tokens,
            } => {
                c.text.push_str(&text);
                c.finish = Some(finish);
                usage.prompt = prompt_tokens;
                usage.completion += completion_tokens;
                left -= 1;
                if left == 0 {
                    break;
                }
            }
            Event::Failed(_) | Event::ShuttingDown => {}
        }
    }
    if left > 0 {
        return ApiError::internal("the engine stopped before the request ended").into_response();
    }
    for (c, l) in choices.iter_mut().zip(&lps) {
        if !l.is_empty() {
            c.logprobs = Some(reply::logprobs(head.endpoint, l, 0));
        }
    }
    Json(reply::whole(&head, &choices, usage)).into_response()
}

/// Every choice's generation as server-sent events.
pub fn streamed(
    head: Head,
    n: usize,
    rx: Events,
    include_usage: bool,
) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
    struct St {
        head: Head,
        rx: Events,
        /// Per choice: no chunk sent yet.
        first: Vec<bool>,
        /// Per choice: bytes of text sent.
        offset: Vec<usize>,
        left: usize,
        usage: Usage,
        include_usage: bool,
        pending: Vec<SseEvent>,
        ended: bool,
    }
    let data = |v: serde_json::Value| SseEvent::default().data(v.to_string());
    let st = St {
        head,
        rx,
        first: vec![true; n],
        offset: vec![0; n],
        left: n,
        usage: Usage::default(),
        include_usage,
        pending: Vec::new(),
        ended: false,
    };
    let events = stream::unfold(st, move |mut st| async move {
        loop {
            if let Some(e) = st.pending.pop() {
                return Some((Ok(e), st));
            }
            if st.ended {
                return None;
            }
            let (i, ev) = st.rx.recv().await?;
            if let Some(e) = failure(&ev) {
                st.pending = vec![SseEvent::default().data("[DONE]"), data(e.body())];
                st.ended = true;
                continue;
            }
            if i >= st.first.len() {
                continue;
            }
            match ev {
                Event::Token { text, logprob } => {
                    if text.is_empty() && logprob.is_none() {
                        continue;
                    }
                    let lp = logprob.map(|l| reply::logprobs(st.head.endpoint, &[l], st.offset[i]));
                    st.offset[i] += text.len();
                    let c = reply::chunk(&st.head, i, Some(&text), lp, None, st.first[i]);
                    st.first[i] = false;
                    return Some((Ok(data(c)), st));
                }
                Event::Done {
                    finish,
                    text,
                    prompt_tokens,
                    completion_tokens,
                } => {
                    st.usage.prompt = prompt_tokens;
                    st.usage.completion += completion_tokens;
                    st.left -= 1;
                    // Sent in reverse order of `pending`'s pops.
                    let mut out = Vec::new();
                    if st.left == 0 {
                        st.ended = true;
                        out.push(SseEvent::default().data("[DONE]"));
                        if st.include_usage {
                            out.push(data(reply::usage_chunk(&st.head, st.usage)));
                        }
                    }
                    let t = (!text.is_empty()).then_some(text.as_str());
                    out.push(data(reply::chunk(
                        &st.head,
                        i,
                        t,
                        None,
                        Some(finish),
                        st.first[i],
                    )));
                    st.first[i] = false;
                    st.pending = out;
                }
                Event::Failed(_) | Event::ShuttingDown => {}
            }
        }
    });
    // Comments while a request waits in the queue, so clients and proxies keep the stream.
    Sse::new(events).keep_alive(KeepAlive::default())
}

//! Errors as an OpenAI client reads them: an HTTP status and
//! `{"error": {"message", "type", "param", "code"}}` (OpenAI API reference, "Error codes").
//! A server-side failure's cause is logged, never sent: its message names only an id.
use std::sync::atomic::{AtomicU64, Ordering};

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// A request the server answers with an error.
#[derive(Debug, Clone)]
pub struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// What went wrong and what to do, for a person.
    pub message: String,
    /// The request field at fault (`max_tokens`, `messages[1].content`), when one is.
    pub param: Option<String>,
    /// Seconds after which a retry may succeed (429, 503).
    pub retry_after: Option<u64>,
    /// Ask for a bearer token (`WWW-Authenticate: Bearer`, with a 401).
    pub authenticate: bool,
}

impl ApiError {
    /// A 400 naming `param`.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: Some(param.into()),
            retry_after: None,
            authenticate: false,
        }
    }

    /// An error of `status` with no field at fault.
    pub fn status(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            param: None,
            retry_after: None,
            authenticate: false,
        }
    }

    /// A 500 that says nothing of its cause: `detail` (an error chain, perhaps with a
    /// backtrace) goes to the server's log under an id the client is given.
    pub fn internal(detail: &str) -> Self {
        Self::status(StatusCode::INTERNAL_SERVER_ERROR, internal_message(detail))
    }

    /// OpenAI's `type` for the status.
    fn kind(&self) -> &'static str {
        match self.status {
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            s if s.is_server_error() => "server_error",
            _ => "invalid_request_error",
        }
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind(),
            "param": self.param,
            "code": self.status.as_u16().to_string(),
        }})
    }
}

/// Logs `detail` under a fresh id; the message a client is given instead.
pub fn internal_message(detail: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let id = NEXT.fetch_add(1, Ordering::Relaxed);
    eprintln!("internal error #{id}: {detail}");
    format!("the server failed to serve this request (internal error #{id}; its log says more)")
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            if let Ok(v) = HeaderValue::from_str(&s.to_string()) {
                r.headers_mut().insert(header::RETRY_AFTER, v);
            }
        }
        if self.authenticate {
            r.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        r
    }
}

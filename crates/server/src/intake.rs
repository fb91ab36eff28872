//! A request from its bytes to token ids without holding the I/O threads: the body read
//! within `--body-timeout` (408) and `--max-body` (413); then JSON parsing, chat templating
//! and tokenization on blocking threads, at most `--tokenizer-threads` requests at once (the
//! rest wait their turn without a thread), so a few maximal prompts cannot stall `/health`
//! or the streams of others. A text that could not fit the prompt limit whatever its
//! tokenization — more bytes than the limit's tokens can cover, by the vocabulary's
//! longest token — is refused before it is tokenized ([`Intake::exceeds`]).
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::StatusCode;
use kvpolicy::models::TextTokenizer;
use tokio::sync::Semaphore;

use crate::error::ApiError;

/// How requests are taken in.
pub struct Intake {
    tok: Arc<TextTokenizer>,
    work: Arc<Semaphore>,
    body_timeout: Duration,
    max_body: usize,
    /// Completions' prompt text may spell control tokens.
    pub parse_special: bool,
    /// Bytes of text one token covers at most (by the vocabulary), times a margin for
    /// normalizers that shrink text.
    bytes_per_token: usize,
}

/// Normalization (NFKC composing characters, say) may shrink text before it is cut into
/// tokens: a token's bytes are its input's times at most this.
const NORMALIZER_MARGIN: usize = 4;

/// The most bytes of text one token of `tok` stands for: its decoding (what it matched in
/// the text, the vocabulary's own spelling of bytes and spaces aside), or the text of a
/// control token when prompts may spell those.
fn longest_token(tok: &TextTokenizer, parse_special: bool) -> usize {
    let inner = tok.inner();
    let size = u32::try_from(inner.get_vocab_size(true)).unwrap_or(u32::MAX);
    (0..size)
        .map(|id| {
            let decoded = inner.decode(&[id], true).map_or(0, |t| t.len());
            let spelled = if parse_special && tok.is_control(id) {
                inner.id_to_token(id).map_or(0, |t| t.len())
            } else {
                0
            };
            decoded.max(spelled)
        })
        .max()
        .unwrap_or(1)
        .max(1)
}

impl Intake {
    /// Intake over `tok` with `threads` requests parsed at once.
    pub fn new(
        tok: Arc<TextTokenizer>,
        threads: usize,
        body_timeout: Duration,
        max_body: usize,
        parse_special: bool,
    ) -> Self {
        let longest = longest_token(&tok, parse_special);
        Self {
            tok,
            work: Arc::new(Semaphore::new(threads.max(1))),
            body_timeout,
            max_body,
            parse_special,
            bytes_per_token: longest.saturating_mul(NORMALIZER_MARGIN),
        }
    }

    /// The whole body, within the time and size limits.
    pub async fn body(&self, body: Body) -> Result<Bytes, ApiError> {
        let limited = http_body_util::Limited::new(body, self.max_body);
        let read = tokio::time::timeout(self.body_timeout, async {
            http_body_util::BodyExt::collect(limited).await
        })
        .await;
        match read {
            Err(_) => Err(ApiError::status(
                StatusCode::REQUEST_TIMEOUT,
                format!(
                    "the request body did not arrive within {:?} (--body-timeout)",
                    self.body_timeout
                ),
            )),
            Ok(Ok(collected)) => Ok(collected.to_bytes()),
            Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => Err(ApiError::status(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!(
                    "the request body is larger than {} bytes (--max-body)",
                    self.max_body
                ),
            )),
            Ok(Err(_)) => Err(ApiError::status(
                StatusCode::BAD_REQUEST,
                "the request body could not be read",
            )),
        }
    }

    /// Whether `bytes` of text hold more than `tokens` tokens however they are tokenized.
    pub fn exceeds(&self, bytes: usize, tokens: usize) -> bool {
        bytes > self.most_bytes(tokens)
    }

    /// The most bytes of text that `tokens` tokens can hold.
    pub fn most_bytes(&self, tokens: usize) -> usize {
        tokens.saturating_mul(self.bytes_per_token)
    }

    /// `work` on a blocking thread once one of the `--tokenizer-threads` places is free.
    pub async fn run<T: Send + 'static>(
        &self,
        work: impl FnOnce(&TextTokenizer) -> Result<T, ApiError> + Send + 'static,
    ) -> Result<T, ApiError> {
        let place = self
            .work
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| ApiError::status(StatusCode::SERVICE_UNAVAILABLE, "shutting down"))?;
        let tok = self.tok.clone();
        tokio::task::spawn_blocking(move || {
            let out = work(&tok);
            drop(place);
            out
        })
        .await
        .map_err(|e| ApiError::internal(&format!("parsing a request failed: {e}")))?
    }
}

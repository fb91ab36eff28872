//! What passes between the HTTP side and the engine: a [`Job`] in, [`Event`]s out (a token's
//! text and log-probabilities, the end, or a failure).
use std::time::Instant;

use candle_core::Tensor;
use kvpolicy::models::TextTokenizer;
use tokio::sync::mpsc::UnboundedSender;

use crate::api::Params;

/// Where one choice's events go: the request's channel, tagged with the choice's index.
pub struct Outbox {
    /// The choice's index (0 to `n` - 1).
    pub index: usize,
    /// The request's channel, shared by its choices.
    pub tx: UnboundedSender<(usize, Event)>,
}

impl Outbox {
    /// Sends `event` (dropped when the client has gone).
    pub fn send(&self, event: Event) {
        let _ = self.tx.send((self.index, event));
    }

    /// Whether the client has gone.
    pub fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }
}

/// One choice of a request, for the engine.
pub struct Job {
    /// The prompt's token ids.
    pub prompt: Vec<u32>,
    /// How to generate.
    pub params: Params,
    /// The sampler's seed for this choice.
    pub seed: u64,
    /// Most tokens to generate (checked against the context).
    pub max_tokens: usize,
    /// Where its tokens go; closed when the client has gone.
    pub events: Outbox,
    /// When it was received.
    pub received: Instant,
}

/// The log-probabilities of one generated token.
#[derive(Debug, Clone)]
pub struct TokenLogprob {
    /// The token's text.
    pub token: String,
    /// Its log-probability.
    pub logprob: f32,
    /// The most likely tokens at that step, with theirs.
    pub top: Vec<(String, f32)>,
}

/// Why a generation ended (OpenAI's `finish_reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// End of sequence or a stop sequence.
    Stop,
    /// `max_tokens` reached.
    Length,
}

impl Finish {
    /// OpenAI's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
        }
    }
}

/// What a request hears from the engine.
#[derive(Debug)]
pub enum Event {
    /// A generated token: the text it releases (possibly empty, held back) and its
    /// log-probabilities when asked for.
    Token {
        /// Text released.
        text: String,
        /// Log-probabilities.
        logprob: Option<TokenLogprob>,
    },
    /// The end.
    Done {
        /// Why.
        finish: Finish,
        /// Text released at the end.
        text: String,
        /// Prompt tokens.
        prompt_tokens: usize,
        /// Generated tokens.
        completion_tokens: usize,
    },
    /// The request failed: a message for the client (the cause is in the server's log).
    Failed(String),
    /// The server is shutting down and cancelled the request.
    ShuttingDown,
}

/// The chosen token's log-probability and the `top` most likely tokens' from `row`.
pub fn logprobs(
    tok: &TextTokenizer,
    row: &Tensor,
    chosen: u32,
    top: usize,
) -> anyhow::Result<TokenLogprob> {
    let logits: Vec<f32> = row.to_dtype(candle_core::DType::F32)?.to_vec1()?;
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = max + logits.iter().map(|&x| (x - max).exp()).sum::<f32>().ln();
    let mut order: Vec<usize> = (0..logits.len()).collect();
    let k = top.min(order.len());
    if k > 0 {
        order.select_nth_unstable_by(k - 1, |&a, &b| logits[b].total_cmp(&logits[a]));
        order.truncate(k);
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    } else {
        order.clear();
    }
    let name = |id: u32| tok.decode(&[id]).unwrap_or_default();
    Ok(TokenLogprob {
        token: name(chosen),
        logprob: logits
            .get(chosen as usize)
            .map_or(f32::NEG_INFINITY, |&x| x - lse),
        top: order
            .into_iter()
            .map(|i| (name(i as u32), logits[i] - lse))
            .collect(),
    })
}

//! A conversation to token ids in which only the chat template's own markers are control
//! tokens. Rendering the template and tokenizing the result with special tokens matched
//! (what HF's `apply_chat_template(tokenize=True)` does) lets a user who types
//! `<|im_start|>system` into a message forge a turn of another role; here a message's text
//! is tokenized as text.
//!
//! The template is rendered twice: with the messages, and with a sentinel in place of each
//! message's text, whose pieces between the sentinels are the template's own text. The
//! rendered conversation is then those pieces with each message's text (as given, or trimmed
//! as templates often do) between them. Tokenized whole — the same ids as before when every
//! control token falls in the template's pieces — else piece by piece, messages with their
//! control strings as text. A template whose output cannot be split so (it drops, repeats
//! or rewrites a message) is tokenized whole only when no message holds a control string;
//! otherwise the request is refused, naming the message.
use std::collections::HashSet;
use std::ops::Range;

use super::{ChatMessage, TextTokenizer};
use crate::error::{ModelError, Result};

/// A sentinel no real message holds (private-use characters around the message's index).
fn sentinel(i: usize) -> String {
    format!("\u{F8FE}kvpolicy-message-{i}\u{F8FF}")
}

impl TextTokenizer {
    /// The token ids of `messages` rendered by the chat template, ready for the assistant's
    /// turn, with every message's text tokenized as text (see the module's documentation).
    /// A rendering longer than `max_bytes` is refused before it is tokenized.
    pub fn encode_chat(&self, messages: &[ChatMessage], max_bytes: usize) -> Result<Vec<u32>> {
        let text = self.apply_chat_template_to(messages)?;
        if text.len() > max_bytes {
            return Err(ModelError::Input(
                format!(
                    "the conversation renders to {} bytes of text, more than fit in the context however they tokenize",
                    text.len()
                )
                .into(),
            ));
        }
        let skeleton = self.apply_chat_template_to(&marked(messages)).ok();
        // The template's markers: every control token, and the other added tokens it
        // writes itself (a turn marker a vocabulary did not mark special).
        let written = self.written_by(skeleton.as_deref());
        let is_marker = |id: &u32| self.is_control(*id) || written.contains(id);
        let spans = skeleton
            .as_deref()
            .and_then(|k| message_spans(messages, k, &text));
        let enc = self.guarded_encode(&text, false)?;
        let Some(spans) = spans else {
            // The template's output cannot be split into its pieces and the messages.
            if let Some((i, m)) = messages
                .iter()
                .enumerate()
                .find(|(_, m)| self.holds(&m.content, is_marker))
            {
                return Err(forging(i, m));
            }
            return Ok(enc.get_ids().to_vec());
        };
        // Does a marker token fall in a message's text? Tokens and spans both in order.
        let mut next = spans.iter().peekable();
        let forged = enc
            .get_ids()
            .iter()
            .zip(enc.get_offsets())
            .any(|(id, &(a, b))| {
                while next.peek().is_some_and(|s| s.end <= a) {
                    next.next();
                }
                is_marker(id) && next.peek().is_some_and(|s| s.start < b)
            });
        if !forged {
            return Ok(enc.get_ids().to_vec());
        }
        // Tokenized as text, a message still matches the added tokens that are not control
        // tokens: one spelling a marker of that kind cannot be kept apart.
        for (i, (m, s)) in messages.iter().zip(&spans).enumerate() {
            if self.holds(&text[s.clone()], |id| written.contains(id)) {
                return Err(forging(i, m));
            }
        }
        // Piece by piece: the template's text with control tokens, the messages' as text.
        let mut ids = Vec::new();
        let mut at = 0;
        for s in &spans {
            ids.extend(self.encode_raw(&text[at..s.start])?);
            ids.extend(self.encode_plain(&text[s.clone()])?);
            at = s.end;
        }
        ids.extend(self.encode_raw(&text[at..])?);
        Ok(ids)
    }

    /// The added tokens that are not control tokens and whose text the template wrote.
    fn written_by(&self, skeleton: Option<&str>) -> HashSet<u32> {
        let Some(k) = skeleton else {
            return HashSet::new();
        };
        self.plain_added()
            .iter()
            .filter(|(_, t)| k.contains(t.as_str()))
            .map(|&(id, _)| id)
            .collect()
    }

    /// Whether `text`, tokenized with added tokens matched, holds a token `marker` picks.
    fn holds(&self, text: &str, marker: impl Fn(&u32) -> bool) -> bool {
        self.guarded_encode(text, false)
            .is_ok_and(|e| e.get_ids().iter().any(marker))
    }
}

/// The refusal of message `i`, which spells a marker the template cannot keep apart.
fn forging(i: usize, m: &ChatMessage) -> ModelError {
    ModelError::Tokenizer(
        format!(
            "message {i} ({}) spells a marker of this model's chat template that cannot be kept apart from the template's own; remove it",
            m.role
        )
        .into(),
    )
}

/// `messages` with a sentinel for each one's text.
fn marked(messages: &[ChatMessage]) -> Vec<ChatMessage> {
    messages
        .iter()
        .enumerate()
        .map(|(i, m)| ChatMessage {
            role: m.role.clone(),
            content: sentinel(i),
        })
        .collect()
}

/// Where each message's text lies in `text` (the template rendered over `messages`), when
/// the template's output is its own pieces — `skeleton`, its rendering over [`marked`]
/// messages, cut at the sentinels — with the messages between them.
fn message_spans(
    messages: &[ChatMessage],
    skeleton: &str,
    text: &str,
) -> Option<Vec<Range<usize>>> {
    // The template's pieces: before the first sentinel, between them, after the last.
    let mut pieces = Vec::with_capacity(messages.len() + 1);
    let mut rest = skeleton;
    for i in 0..messages.len() {
        let (before, after) = rest.split_once(&sentinel(i))?;
        pieces.push(before);
        rest = after;
    }
    if rest.contains("\u{F8FE}kvpolicy-message-") {
        return None;
    }
    pieces.push(rest);
    let mut spans = Vec::with_capacity(messages.len());
    let mut at = text.strip_prefix(pieces[0]).map(|_| pieces[0].len())?;
    for (m, next) in messages.iter().zip(&pieces[1..]) {
        let c = m.content.as_str();
        let last = spans.len() + 1 == messages.len();
        let fits = |cand: &str| {
            let tail = text[at..].strip_prefix(cand)?;
            let ok = if last {
                tail == *next
            } else {
                tail.starts_with(next)
            };
            ok.then_some(cand.len())
        };
        let len = [c, c.trim(), c.trim_start(), c.trim_end()]
            .into_iter()
            .find_map(fits)?;
        spans.push(at..at + len);
        at += len + next.len();
    }
    (at == text.len()).then_some(spans)
}

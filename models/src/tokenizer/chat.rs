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
    pub fn encode_chat(&self, messages: &[ChatMessage]) -> Result<Vec<u32>> {
        let text = self.apply_chat_template_to(messages)?;
        let spans = self.message_spans(messages, &text);
        let specials = self.special_ids();
        let enc = self.guarded_encode(&text, false)?;
        let Some(spans) = spans else {
            // The template's output cannot be split into its pieces and the messages.
            if let Some((i, m)) = messages
                .iter()
                .enumerate()
                .find(|(_, m)| self.holds_control(&m.content))
            {
                return Err(ModelError::Tokenizer(
                    format!(
                        "message {i} ({}) holds a control token of this model, which its chat template cannot keep apart from its own markers; remove it",
                        m.role
                    )
                    .into(),
                ));
            }
            return Ok(enc.get_ids().to_vec());
        };
        let forged = enc
            .get_ids()
            .iter()
            .zip(enc.get_offsets())
            .any(|(id, &(a, b))| {
                specials.contains(id) && spans.iter().any(|s| a < s.end && s.start < b)
            });
        if !forged {
            return Ok(enc.get_ids().to_vec());
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

    /// Where each message's text lies in `text` (the template rendered over `messages`),
    /// when the template's output is its own pieces with the messages between them.
    fn message_spans(&self, messages: &[ChatMessage], text: &str) -> Option<Vec<Range<usize>>> {
        let marked: Vec<ChatMessage> = messages
            .iter()
            .enumerate()
            .map(|(i, m)| ChatMessage {
                role: m.role.clone(),
                content: sentinel(i),
            })
            .collect();
        let skeleton = self.apply_chat_template_to(&marked).ok()?;
        // The template's pieces: before the first sentinel, between them, after the last.
        let mut pieces = Vec::with_capacity(messages.len() + 1);
        let mut rest = skeleton.as_str();
        for i in 0..messages.len() {
            let (before, after) = rest.split_once(&sentinel(i))?;
            pieces.push(before);
            rest = after;
        }
        if messages
            .iter()
            .enumerate()
            .any(|(i, _)| rest.contains(&sentinel(i)))
        {
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

    /// Whether `text` spells one of the tokenizer's control tokens.
    fn holds_control(&self, text: &str) -> bool {
        self.inner
            .get_added_tokens_decoder()
            .values()
            .any(|t| t.special && !t.content.is_empty() && text.contains(&t.content))
    }
}

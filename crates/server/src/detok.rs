//! Generated tokens to text a piece at a time, with stop sequences: each new token's text
//! is released once no stop sequence can begin in it and it ends on a whole character
//! (a token may carry half of a UTF-8 character, which decodes as U+FFFD until the rest
//! comes). A stop sequence ends the text where it begins, and is not part of it (OpenAI's
//! `stop`).
use kvpolicy::models::TextTokenizer;

/// One request's text so far.
pub struct Detok {
    ids: Vec<u32>,
    /// Bytes of the text already released.
    sent: usize,
    stop: Vec<String>,
}

/// What a new token released.
#[derive(Debug, PartialEq, Eq)]
pub enum Release {
    /// Text to send (may be empty: held back for now).
    Text(String),
    /// A stop sequence was generated: the text before it, then the end.
    Stopped(String),
}

impl Detok {
    /// Text for a generation ended by any of `stop`.
    pub fn new(stop: Vec<String>) -> Self {
        Self {
            ids: Vec::new(),
            sent: 0,
            stop,
        }
    }

    /// Adds token `id`; returns the text it releases.
    pub fn push(&mut self, tok: &TextTokenizer, id: u32) -> anyhow::Result<Release> {
        self.ids.push(id);
        let text = tok.decode(&self.ids)?;
        if !text.is_char_boundary(self.sent.min(text.len())) || text.len() < self.sent {
            // The decoding of what was sent changed under a later token: wait for it to
            // settle rather than send a torn piece.
            return Ok(Release::Text(String::new()));
        }
        // A stop sequence beginning anywhere not yet sent (it may straddle tokens).
        let longest = self.stop.iter().map(String::len).max().unwrap_or(0);
        let mut from = self.sent.saturating_sub(longest);
        while !text.is_char_boundary(from) {
            from -= 1;
        }
        let hit = self
            .stop
            .iter()
            .filter_map(|s| text[from..].find(s.as_str()).map(|i| from + i))
            .min();
        if let Some(at) = hit {
            let at = at.max(self.sent);
            let piece = text[self.sent..at].to_string();
            self.sent = text.len();
            return Ok(Release::Stopped(piece));
        }
        let mut end = text.len();
        // Hold an incomplete character back.
        while text[self.sent..end].ends_with('\u{FFFD}') {
            end -= '\u{FFFD}'.len_utf8();
        }
        // Hold back the longest tail that could still grow into a stop sequence.
        let held = self
            .stop
            .iter()
            .flat_map(|s| {
                (1..s.len())
                    .filter(|&k| s.is_char_boundary(k) && text[self.sent..end].ends_with(&s[..k]))
            })
            .max()
            .unwrap_or(0);
        end -= held;
        let piece = text[self.sent..end].to_string();
        self.sent = end;
        Ok(Release::Text(piece))
    }

    /// What is still held back once the generation ended without a stop sequence.
    pub fn finish(&mut self, tok: &TextTokenizer) -> anyhow::Result<String> {
        let text = tok.decode(&self.ids)?;
        let piece = text.get(self.sent..).unwrap_or_default().to_string();
        self.sent = text.len();
        Ok(piece)
    }
}

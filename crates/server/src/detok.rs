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

#[cfg(test)]
mod tests {
    use super::*;
    use kvpolicy::models::{load, resolve, ModelSpec};

    fn tokenizer() -> anyhow::Result<TextTokenizer> {
        let files = resolve(&ModelSpec::Default)?;
        let loaded = load(
            &files,
            &candle_core::Device::Cpu,
            candle_core::DType::F32,
            None,
        )?;
        loaded
            .tokenizer
            .ok_or_else(|| anyhow::anyhow!("the default model has a tokenizer"))
    }

    /// Every token of `text` pushed, then the end: the pieces released and how it ended.
    fn run(tok: &TextTokenizer, text: &str, stop: &[&str]) -> anyhow::Result<(Vec<String>, bool)> {
        let mut d = Detok::new(stop.iter().map(|s| s.to_string()).collect());
        let mut pieces = Vec::new();
        for id in tok.encode_raw(text)? {
            match d.push(tok, id)? {
                Release::Text(t) => pieces.push(t),
                Release::Stopped(t) => {
                    pieces.push(t);
                    return Ok((pieces, true));
                }
            }
        }
        pieces.push(d.finish(tok)?);
        Ok((pieces, false))
    }

    #[test]
    fn stop_sequences_across_tokens_end_the_text_before_them() -> anyhow::Result<()> {
        let tok = tokenizer()?;
        let (pieces, stopped) = run(&tok, " Paris is nice. Rome is too.", &["is n", "xyz"])?;
        assert!(stopped);
        assert_eq!(pieces.concat(), " Paris ");
        // A partial match held back, then released when the text goes another way.
        let (pieces, stopped) = run(&tok, " Paris is old", &["is n"])?;
        assert!(!stopped);
        assert_eq!(pieces.concat(), " Paris is old");
        // Held back until the end, then sent.
        let (pieces, stopped) = run(&tok, " Paris is", &["Paris is here"])?;
        assert!(!stopped);
        assert_eq!(pieces.concat(), " Paris is");
        assert_eq!(pieces.last().map(String::as_str), Some("Paris is"));
        Ok(())
    }

    #[test]
    fn no_piece_carries_half_a_character() -> anyhow::Result<()> {
        let tok = tokenizer()?;
        let text = "café naïve 日本語 🙂 done";
        let (pieces, _) = run(&tok, text, &[])?;
        assert!(pieces.iter().all(|p| !p.contains('\u{FFFD}')), "{pieces:?}");
        assert_eq!(pieces.concat(), tok.decode(&tok.encode_raw(text)?)?);
        Ok(())
    }
}

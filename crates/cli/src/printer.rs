//! Generated text streamed to stdout as it comes (ids when the model has no tokenizer); a
//! closed stdout ends the text, not the run.
use std::io::Write;

use kvpolicy::models::{Release, TextStream, TextTokenizer};

/// Streams generated text to stdout (or ids when the model has no tokenizer).
pub struct Printer<'a> {
    tok: Option<&'a TextTokenizer>,
    /// The text so far: every piece it releases is printed, and they add up to the
    /// tokens' decoding.
    text: TextStream,
    /// stdout stopped accepting text (a closed pipe): print nothing more, but the run and
    /// its output files go on.
    closed: bool,
}

impl<'a> Printer<'a> {
    pub fn new(tok: Option<&'a TextTokenizer>) -> Self {
        Self {
            tok,
            text: TextStream::new(Vec::new()),
            closed: false,
        }
    }

    /// A printer that prints nothing (a rank of `mpirun` other than 0).
    pub fn silent(mut self) -> Self {
        self.closed = true;
        self
    }

    pub fn push(&mut self, id: u32) {
        let text = match self.tok {
            // Multi-byte characters split across tokens come out whole, and a run of byte
            // tokens once it has ended (a later byte may change how it decodes).
            Some(t) => match self.text.push(t, id) {
                Ok(Release::Text(piece) | Release::Stopped(piece)) => piece,
                Err(_) => return,
            },
            None => format!("{id} "),
        };
        if !text.is_empty() {
            self.write(&text);
        }
    }

    fn write(&mut self, text: &str) {
        if self.closed {
            return;
        }
        let mut out = std::io::stdout().lock();
        if write!(out, "{text}").and_then(|()| out.flush()).is_err() {
            self.closed = true;
        }
    }

    pub fn finish(&mut self) {
        if let Some(t) = self.tok {
            // What was held back: a partial character, a run of bytes.
            if let Ok(rest) = self.text.finish(t) {
                self.write(&rest.into_text());
            }
        }
        self.write("\n");
    }
}

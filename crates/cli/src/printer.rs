//! Generated text streamed to stdout as it comes (ids when the model has no tokenizer); a
//! closed stdout ends the text, not the run.
use std::io::Write;

use kvpolicy::models::TextTokenizer;

/// Streams generated text to stdout (or ids when the model has no tokenizer).
pub struct Printer<'a> {
    tok: Option<&'a TextTokenizer>,
    ids: Vec<u32>,
    shown: usize,
    /// stdout stopped accepting text (a closed pipe): print nothing more, but the run and
    /// its output files go on.
    closed: bool,
}

impl<'a> Printer<'a> {
    pub fn new(tok: Option<&'a TextTokenizer>) -> Self {
        Self {
            tok,
            ids: Vec::new(),
            shown: 0,
            closed: false,
        }
    }

    /// A printer that prints nothing (a rank of `mpirun` other than 0).
    pub fn silent(mut self) -> Self {
        self.closed = true;
        self
    }

    pub fn push(&mut self, id: u32) {
        self.ids.push(id);
        let text = match self.tok {
            Some(t) => {
                // Decode the whole continuation and print what is new: multi-byte characters
                // split across tokens come out whole.
                match t.decode(&self.ids) {
                    Ok(text)
                        if text.len() > self.shown
                            && text.is_char_boundary(self.shown)
                            && !text.ends_with('\u{FFFD}') =>
                    {
                        let new = text[self.shown..].to_string();
                        self.shown = text.len();
                        new
                    }
                    _ => return,
                }
            }
            None => format!("{id} "),
        };
        self.write(&text);
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
        self.write("\n");
    }
}

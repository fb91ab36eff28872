//! Bounds on what a tokenizer file can make encoding do (issue "Hardening III"): a hostile
//! regex whose backtracking hits the engine's retry limit (Oniguruma then panics) becomes an
//! error, and a normalizer that would expand the text past [`NORMALIZED_CAP`] is refused
//! before it does: its steps are run one at a time on a copy, each only after a bound read
//! off that step's description, times the text it gets, stays under the cap.
use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Once;

use serde_json::Value;
use tokenizers::normalizers::NormalizerWrapper;
use tokenizers::{NormalizedString, Normalizer};

use crate::error::{ModelError, Result};

/// The most bytes normalization may produce from one text: a 512K-token prompt is a few
/// MiB, and `tokenizers` keeps two alignment words per normalized byte (~17× the text).
pub const NORMALIZED_CAP: f64 = (16u64 << 20) as f64;

thread_local! {
    /// Set while [`quietly`] runs: its panics are caught and reported as errors, so the
    /// panic hook stays silent for them.
    static QUIET: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f`, turning a panic inside it (the regex engine's) into an error naming `what`.
pub fn quietly<T>(what: &str, f: impl FnOnce() -> T) -> Result<T> {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !QUIET.with(Cell::get) {
                previous(info);
            }
        }));
    });
    QUIET.with(|q| q.set(true));
    let r = catch_unwind(AssertUnwindSafe(f));
    QUIET.with(|q| q.set(false));
    r.map_err(|payload| {
        let why = payload
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| payload.downcast_ref::<&str>().copied())
            .unwrap_or("an internal failure");
        ModelError::Tokenizer(format!(
            "{what} failed ({why}); the tokenizer's patterns cannot handle this text (a regex that backtracks without end?)"
        ).into())
    })
}

/// An upper bound on how many times longer than its input a normalizer's output can be,
/// from its serialized form (`tokenizer.json`'s `normalizer`).
pub fn expansion_bound(n: &Value) -> f64 {
    let s = |k: &str| n.get(k).and_then(Value::as_str).unwrap_or_default();
    match s("type") {
        "Sequence" => n
            .get("normalizers")
            .and_then(Value::as_array)
            .map_or(1.0, |v| v.iter().map(expansion_bound).product()),
        // A match of the pattern (a string of its length; a regex possibly empty, between
        // every two characters) becomes the content.
        "Replace" => {
            let content = s("content").len() as f64;
            match n
                .get("pattern")
                .and_then(|p| p.get("String"))
                .and_then(Value::as_str)
            {
                Some(p) if !p.is_empty() => (content / p.len() as f64).max(1.0),
                _ => content + 1.0,
            }
        }
        // Adds its text before every word at most.
        "Prepend" => s("prepend").len() as f64 + 1.0,
        "Strip" | "Lowercase" | "StripAccents" | "Nmt" => 3.0,
        // Unicode compatibility decompositions reach 18 code points per character.
        "NFC" | "NFD" | "NFKC" | "NFKD" => 18.0,
        // Spaces around CJK characters, cleaned control characters.
        "BertNormalizer" => 3.0,
        "ByteLevel" => 2.0,
        // A SentencePiece character map (NFKC-like), or a kind this code does not know.
        _ => 18.0,
    }
}

/// Refuses `text` when `normalizer` would expand it past [`NORMALIZED_CAP`]: its steps run
/// one at a time, each only when its own bound on the text it gets stays under the cap.
pub fn check_expansion(normalizer: Option<&NormalizerWrapper>, text: &str) -> Result<()> {
    let Some(n) = normalizer else {
        return Ok(());
    };
    let bad = |e: String| ModelError::Tokenizer(format!("the tokenizer's normalizer: {e}").into());
    let mut json = serde_json::to_value(n).map_err(|e| bad(e.to_string()))?;
    // The whole normalizer's bound already keeps this text under the cap (the usual case):
    // no step needs running here, ahead of the encode that runs them anyway.
    if text.len() as f64 * expansion_bound(&json) <= NORMALIZED_CAP {
        return Ok(());
    }
    let steps = if json.get("type").and_then(Value::as_str) == Some("Sequence") {
        match json["normalizers"].take() {
            Value::Array(steps) => steps,
            _ => Vec::new(),
        }
    } else {
        vec![json]
    };
    let mut s = NormalizedString::from(text);
    for step in steps {
        let bound = expansion_bound(&step);
        if s.len() as f64 * bound > NORMALIZED_CAP {
            return Err(ModelError::Tokenizer(format!(
                "the tokenizer's normalizer (a `{}` step) can expand text up to {bound:.0}×, this {}-byte text past the {} MiB allowed; shorten the text, or check the tokenizer's `normalizer`",
                step.get("type").and_then(Value::as_str).unwrap_or("?"),
                s.len(),
                (NORMALIZED_CAP as u64) >> 20
            ).into()));
        }
        let n: NormalizerWrapper = serde_json::from_value(step).map_err(|e| bad(e.to_string()))?;
        n.normalize(&mut s).map_err(|e| bad(e.to_string()))?;
    }
    Ok(())
}

/// A writer that keeps at most `cap` bytes and fails past them (a chat template's output).
pub struct Capped {
    buf: Vec<u8>,
    cap: usize,
    overflowed: bool,
}

impl Capped {
    /// Empty, holding at most `cap` bytes.
    pub fn new(cap: usize) -> Self {
        Self {
            buf: Vec::new(),
            cap,
            overflowed: false,
        }
    }

    /// Whether a write went past the cap (and failed).
    pub fn overflowed(&self) -> bool {
        self.overflowed
    }

    /// What was written, as text.
    pub fn into_string(self) -> std::result::Result<String, std::string::FromUtf8Error> {
        String::from_utf8(self.buf)
    }
}

impl std::io::Write for Capped {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        if self.buf.len() + data.len() > self.cap {
            self.overflowed = true;
            return Err(std::io::Error::other("output cap reached"));
        }
        self.buf.extend_from_slice(data);
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

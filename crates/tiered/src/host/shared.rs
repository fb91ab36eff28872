//! Runs of a layer's host-tier K/V held by reference: a prefix cache's chunks that several
//! live sequences read ([`kvpolicy_core::lease`]; vLLM's shared prefix blocks, PagedAttention
//! SOSP '23 §4.3; SGLang's HiCache keeps them in host memory, L2). A layer holds its shared
//! runs from position 0, one after another, and its own store from where they end; the
//! runs are never written, and only the store is on this sequence's books (the runs' owner
//! counts them once). A read of a token range is cut into [`HistoryPiece`]s: views of the
//! runs, then the store's part.
use candle_core::Tensor;
use kvpolicy_core::{HeadRange, KeptRun, Result, SharedRun, TokenRange};

/// Part of a read: K and V `(b, g, len, width)` of the tokens from `at` (counted from the
/// read's first token).
#[derive(Debug)]
pub struct HistoryPiece {
    /// Where the piece starts within the read.
    pub at: usize,
    /// Keys.
    pub k: Tensor,
    /// Values.
    pub v: Tensor,
}

/// One layer's shared runs, from position 0 (module docs).
#[derive(Debug, Default)]
pub(crate) struct LayerRuns {
    runs: Vec<KeptRun>,
}

impl LayerRuns {
    /// One past the last position the runs hold (0 without runs).
    pub(crate) fn end(&self) -> usize {
        self.runs.last().map_or(0, KeptRun::end)
    }

    /// Tokens held by reference.
    pub(crate) fn tokens(&self) -> usize {
        self.runs.iter().map(|r| r.end() - r.pos).sum()
    }

    /// Keeps `run` when it continues the runs (from position 0); returns whether it did.
    pub(crate) fn push(&mut self, run: &SharedRun<'_>) -> bool {
        if run.pos != self.end() {
            return false;
        }
        self.runs.push(run.keep());
        true
    }

    /// The runs' part of heads `heads` × tokens `tokens`: views, with their place in the
    /// read.
    pub(crate) fn pieces(&self, heads: HeadRange, tokens: TokenRange) -> Result<Vec<HistoryPiece>> {
        let mut out = Vec::new();
        for r in self.runs.iter() {
            let from = tokens.start.max(r.pos);
            let to = tokens.end().min(r.end());
            if from >= to {
                continue;
            }
            let view = |t: &Tensor| -> Result<Tensor> {
                Ok(t.narrow(1, heads.first, heads.count)?
                    .narrow(2, from - r.pos, to - from)?)
            };
            out.push(HistoryPiece {
                at: from - tokens.start,
                k: view(&r.k)?,
                v: view(&r.v)?,
            });
        }
        Ok(out)
    }
}

/// Where `runs` (skipping those that end by `base`) would take a layer whose own store holds
/// `base..len`: the position they end at, when they start at `base`, follow one another
/// and do not pass `len`; `None` otherwise.
pub(crate) fn adoptable(runs: &[SharedRun<'_>], base: usize, len: usize) -> Result<Option<usize>> {
    let mut end = None;
    for r in runs {
        let n = r.k.dim(2)?;
        if r.pos + n <= base {
            continue;
        }
        if r.pos != end.unwrap_or(base) {
            return Ok(None);
        }
        end = Some(r.pos + n);
    }
    Ok(end.filter(|&e| e <= len))
}

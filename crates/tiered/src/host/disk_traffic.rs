//! The disk tier's traffic as the host tier sees it ([`DiskTraffic`]): the reads started
//! ahead of their use, each on its own thread (the first stage of disk → host → device,
//! ahead of HeadInfer §3.2's host → device prefetch), and the bytes read and written and
//! the time spent on the files. The layer stores of the disk tier take their reads from it
//! and count into it; a RAM store never touches it.
use std::collections::VecDeque;
use std::time::Duration;

use candle_core::Tensor;
use kvpolicy_core::{HeadRange, KvError, KvStats, PolicyMetric, Result, TokenRange};

use crate::disk_read::DiskRead;

/// Disk reads in flight at once, each on its own thread: the next units', so that the disk
/// has requests queued while the compute thread collects one, and a layer in RAM (which
/// reads nothing) leaves the disk busy with the next layer's. Side by side, not one after
/// another: this disk delivers more with several requests outstanding
/// (bench-results/2026-11-24-cpu-disk-tier.md).
pub const READ_AHEAD: usize = 3;

/// What a read covers: heads and tokens of one layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ReadSpan {
    layer: usize,
    heads: HeadRange,
    tokens: TokenRange,
}

impl ReadSpan {
    /// Heads `heads`, tokens `tokens` of `layer`.
    pub(crate) fn new(layer: usize, heads: HeadRange, tokens: TokenRange) -> Self {
        Self {
            layer,
            heads,
            tokens,
        }
    }

    /// The heads it covers.
    pub(crate) fn heads(&self) -> HeadRange {
        self.heads
    }

    /// The tokens it covers.
    pub(crate) fn tokens(&self) -> TokenRange {
        self.tokens
    }
}

/// A read of the disk tier running on its own thread.
#[derive(Debug)]
struct ReadAhead {
    span: ReadSpan,
    thread: std::thread::JoinHandle<Result<(Tensor, Tensor)>>,
}

impl ReadAhead {
    /// Lets the read finish and drops what it read (it may hold files open or race a write).
    fn discard(self) {
        let _ = self.thread.join();
    }
}

/// The disk tier's reads ahead and its traffic (module docs).
#[derive(Debug, Default)]
pub(crate) struct DiskTraffic {
    /// The disk reads started ahead of their use, in the order they will be asked for (at
    /// most [`READ_AHEAD`]).
    ahead: VecDeque<ReadAhead>,
    /// Read-aheads started since the last clear.
    read_aheads: u64,
    /// Bytes read from the files.
    read: u64,
    /// Bytes written to the files.
    written: u64,
    /// Seconds spent on the files.
    wait_s: f64,
}

impl DiskTraffic {
    /// Whether a read-ahead of `span` would start: fewer than [`READ_AHEAD`] are in flight
    /// and none of `span` is.
    pub(crate) fn wants(&self, span: ReadSpan) -> bool {
        self.ahead.len() < READ_AHEAD && !self.ahead.iter().any(|a| a.span == span)
    }

    /// Runs `plan`, the read of `span`, on its own thread, queued behind the reads ahead.
    pub(crate) fn start(&mut self, span: ReadSpan, plan: DiskRead) -> Result<()> {
        let thread = std::thread::Builder::new()
            .name("kv-disk-read".into())
            .spawn(move || plan.run())
            .map_err(|e| KvError::invariant(format!("cannot start a disk read thread: {e}")))?;
        self.ahead.push_back(ReadAhead { span, thread });
        self.read_aheads += 1;
        Ok(())
    }

    /// What the read ahead of `span` read, if it was read ahead. Read-aheads queued before
    /// it were not asked for: finished and dropped (all of them when `span` was not read
    /// ahead).
    pub(crate) fn take(&mut self, span: ReadSpan) -> Result<Option<(Tensor, Tensor)>> {
        let hit = self.ahead.iter().position(|a| a.span == span);
        let stale = hit.unwrap_or(self.ahead.len());
        self.ahead.drain(..stale).for_each(ReadAhead::discard);
        match hit.and_then(|_| self.ahead.pop_front()) {
            Some(a) => Ok(Some(a.thread.join().map_err(|_| {
                KvError::invariant("a disk read-ahead thread panicked")
            })??)),
            None => Ok(None),
        }
    }

    /// Finishes and drops the read-aheads of `layer` touching `heads`: a write of their
    /// blocks is coming, and a read planned before it would find their headers changed
    /// (callers read ahead only what they wrote, so this is a guard).
    pub(crate) fn discard_overlapping(&mut self, layer: usize, heads: &HeadRange) {
        let (stale, keep): (Vec<_>, Vec<_>) = self
            .ahead
            .drain(..)
            .partition(|a| a.span.layer == layer && a.span.heads.overlaps(heads));
        self.ahead = keep.into();
        stale.into_iter().for_each(ReadAhead::discard);
    }

    /// Counts `bytes` read from the files.
    pub(crate) fn count_read(&mut self, bytes: u64) {
        self.read += bytes;
    }

    /// Counts `bytes` written to the files.
    pub(crate) fn count_written(&mut self, bytes: u64) {
        self.written += bytes;
    }

    /// Counts `spent` on the files.
    pub(crate) fn waited(&mut self, spent: Duration) {
        self.wait_s += spent.as_secs_f64();
    }

    /// `stats` with the traffic filled in, and the read-aheads started when there are
    /// `files`.
    pub(crate) fn report(&self, stats: KvStats, files: bool) -> KvStats {
        let mut stats = KvStats {
            disk_read_bytes: self.read,
            disk_write_bytes: self.written,
            disk_wait_s: self.wait_s,
            ..stats
        };
        if files {
            stats.set_metric(PolicyMetric::counter(
                "disk_read_aheads",
                self.read_aheads as f64,
                "reads",
            ));
        }
        stats
    }

    /// Finishes and drops every read ahead, and zeroes the counts.
    pub(crate) fn clear(&mut self) {
        self.ahead.drain(..).for_each(ReadAhead::discard);
        *self = Self::default();
    }
}

impl Drop for DiskTraffic {
    /// Joins the reads still ahead, so that the files they hold open close with the tier.
    fn drop(&mut self) {
        self.ahead.drain(..).for_each(ReadAhead::discard);
    }
}

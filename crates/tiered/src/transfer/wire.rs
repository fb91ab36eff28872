//! The simulated host↔device wire of CPU experiments: one per process, shared by every
//! engine and both directions (as every engine of one GPU shares its PCIe link). A batch
//! occupies it from the later of its submission and the wire's being free, for its bytes ÷
//! the bandwidth ([`Wire::book`]); the real copy runs inside that time, as a DMA engine's
//! copy *is* the wire time, so a batch completes when both its wire time and its copy are
//! over ([`Slot::completion`]). HeadInfer §3.2's claim — decode time is the transfer time —
//! is measured against this wire.
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// When a batch occupies the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slot {
    /// The wire starts carrying it.
    pub start: Instant,
    /// The wire is done with it.
    pub end: Instant,
}

impl Slot {
    /// When the batch is complete, its copy having finished at `copied`: the later of the
    /// two (a copy slower than the wire holds the batch up; a faster one hides in it).
    pub fn completion(&self, copied: Instant) -> Instant {
        self.end.max(copied)
    }

    /// How long the batch kept the link busy, completed at `done`, the batch before it
    /// having completed at `before`: from its start on the wire — or from `before`, when an
    /// earlier batch's copy overran into its slot and was counted there — to `done`. Summed
    /// over batches, the time the wire carried something, each instant counted once.
    pub fn busy(&self, before: Option<Instant>, done: Instant) -> Duration {
        let from = before.map_or(self.start, |b| b.max(self.start));
        done.saturating_duration_since(from)
    }
}

/// A wire of fixed bandwidth: when it is next free (module docs).
#[derive(Debug, Default)]
pub struct Wire {
    free_at: Option<Instant>,
}

impl Wire {
    /// Books a batch of `bytes` submitted at `now` on a wire of `bytes_per_s`: it starts
    /// when the wire is free (or at `now`, if that is later) and holds it for bytes ÷
    /// bandwidth.
    pub fn book(&mut self, now: Instant, bytes: u64, bytes_per_s: f64) -> Slot {
        let start = self.free_at.map_or(now, |f| f.max(now));
        let end = start + Duration::from_secs_f64(bytes as f64 / bytes_per_s);
        self.free_at = Some(end);
        Slot { start, end }
    }
}

/// The process's one simulated wire.
static WIRE: Mutex<Wire> = Mutex::new(Wire { free_at: None });

/// Books a batch of `bytes` submitted now on the process's wire of `bytes_per_s`.
pub fn book_shared(bytes: u64, bytes_per_s: f64) -> Slot {
    let now = Instant::now();
    match WIRE.lock() {
        Ok(mut w) => w.book(now, bytes, bytes_per_s),
        // A thread that panicked holding the lock left a wire time that is still valid.
        Err(poisoned) => poisoned.into_inner().book(now, bytes, bytes_per_s),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    /// A batch starts at its submission on an idle wire, after the batches booked before it
    /// on a busy one, and lasts bytes ÷ bandwidth either way.
    #[test]
    fn batches_queue_on_the_wire_and_take_bytes_over_bandwidth() {
        let t0 = Instant::now();
        let mut w = Wire::default();
        let a = w.book(t0, 2_000_000, 1e9);
        assert_eq!((a.start, a.end), (t0, t0 + 2 * MS));
        // Submitted while `a` is on the wire: it waits for it.
        let b = w.book(t0 + MS, 1_000_000, 1e9);
        assert_eq!((b.start, b.end), (t0 + 2 * MS, t0 + 3 * MS));
        // Submitted after the wire went idle: it starts at once.
        let c = w.book(t0 + 10 * MS, 3_000_000, 1e9);
        assert_eq!((c.start, c.end), (t0 + 10 * MS, t0 + 13 * MS));
    }

    /// The copy runs inside the wire time: a batch completes at the end of its wire time
    /// when its copy is faster, at the copy's end when it is slower — never after the two
    /// one behind the other.
    #[test]
    fn the_copy_overlaps_the_wire_time() {
        let t0 = Instant::now();
        let slot = Wire::default().book(t0, 10_000_000, 1e9); // 10 ms on the wire
                                                              // A 4 ms copy: done at the wire's end, not 14 ms.
        let done = slot.completion(t0 + 4 * MS);
        assert_eq!(done, t0 + 10 * MS);
        assert_eq!(slot.busy(None, done), 10 * MS);
        // A 15 ms copy: the copy is the bound.
        let done = slot.completion(t0 + 15 * MS);
        assert_eq!(done, t0 + 15 * MS);
        assert_eq!(slot.busy(None, done), 15 * MS);
        // The batch before overran into this slot until 3 ms: that time was counted there.
        let done = slot.completion(t0 + 7 * MS);
        assert_eq!(slot.busy(Some(t0 + 3 * MS), done), 7 * MS);
        // The batch before completed long before: the wire time counts from the slot.
        assert_eq!(slot.busy(Some(t0), done), 10 * MS);
    }
}

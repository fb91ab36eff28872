//! The CPU kernel's memory: scratch buffers counted by the call's [`Meter`] while they
//! live, one workspace per running task (taken from a pool sized by the thread count, so a
//! call's scratch is fixed by the tiles, not the context — HeadInfer §3.3), and the sink
//! several threads write disjoint output rows into.
use std::sync::{Mutex, MutexGuard};

use super::plan::Meter;

/// An f32 scratch buffer counted by a [`Meter`] while it lives.
pub(super) struct Scratch<'m> {
    /// The buffer.
    pub(super) buf: Vec<f32>,
    meter: &'m Meter,
}

impl<'m> Scratch<'m> {
    /// `len` values of `fill`, counted while they live.
    pub(super) fn new(len: usize, fill: f32, meter: &'m Meter) -> Self {
        meter.take((len * 4) as u64);
        Self {
            buf: vec![fill; len],
            meter,
        }
    }
}

impl Drop for Scratch<'_> {
    fn drop(&mut self) {
        self.meter.give((self.buf.len() * 4) as u64);
    }
}

/// The scratch one running task uses: scaled queries, the accumulator (output rows,
/// running max and sum), a score tile and, for half-precision inputs, widened K/V tiles.
pub(super) struct Workspace<'m> {
    pub(super) qs: Scratch<'m>,
    pub(super) o: Scratch<'m>,
    pub(super) m: Scratch<'m>,
    pub(super) l: Scratch<'m>,
    pub(super) sc: Scratch<'m>,
    pub(super) kt: Option<Scratch<'m>>,
    pub(super) vt: Option<Scratch<'m>>,
    /// One finished output row (d values and the log-sum-exp).
    pub(super) line: Scratch<'m>,
}

impl<'m> Workspace<'m> {
    /// Scratch for `rows` query rows against tiles of `tk` keys of width `d`.
    pub(super) fn new(rows: usize, tk: usize, d: usize, widen: bool, meter: &'m Meter) -> Self {
        Self {
            qs: Scratch::new(rows * d, 0.0, meter),
            o: Scratch::new(rows * d, 0.0, meter),
            m: Scratch::new(rows, 0.0, meter),
            l: Scratch::new(rows, 0.0, meter),
            sc: Scratch::new(rows * tk, 0.0, meter),
            kt: widen.then(|| Scratch::new(tk * d, 0.0, meter)),
            vt: widen.then(|| Scratch::new(tk * d, 0.0, meter)),
            line: Scratch::new(d + 1, 0.0, meter),
        }
    }
}

/// Where the next [`Pool::take`] starts looking, so concurrent tasks start apart.
static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Workspaces shared by the tasks: as many as can run at once, each taken by one task at a
/// time, so a call's scratch is fixed by the tiles and the thread count.
pub(super) struct Pool<'m>(pub(super) Vec<Mutex<Workspace<'m>>>);

impl<'m> Pool<'m> {
    /// A free workspace, waited for if every one is taken.
    pub(super) fn take(&self) -> MutexGuard<'_, Workspace<'m>> {
        // At most `len` tasks run at once, so a free workspace always exists; a task that
        // races another for the same one moves on to the next.
        let n = self.0.len();
        let start = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % n.max(1);
        loop {
            for i in 0..n {
                if let Ok(ws) = self.0[(start + i) % n].try_lock() {
                    return ws;
                }
            }
            std::thread::yield_now();
        }
    }
}

/// A buffer written at disjoint ranges from several threads.
pub(super) struct Sink {
    ptr: *mut f32,
    len: usize,
}

// SAFETY: writers touch disjoint ranges (each output row belongs to one item, each partial
// slot to one task) and the buffer outlives the parallel loops that write it.
unsafe impl Sync for Sink {}

impl Sink {
    /// A sink over `buf`.
    pub(super) fn of(buf: &mut [f32]) -> Self {
        Self {
            ptr: buf.as_mut_ptr(),
            len: buf.len(),
        }
    }

    /// Writes `vals` at `at` (a range no other writer touches).
    pub(super) fn write(&self, at: usize, vals: &[f32]) {
        assert!(
            at + vals.len() <= self.len,
            "flash_attn: write out of range"
        );
        // SAFETY: in bounds (checked above) and no other writer touches these elements.
        unsafe { std::ptr::copy_nonoverlapping(vals.as_ptr(), self.ptr.add(at), vals.len()) }
    }
}

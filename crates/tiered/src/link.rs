//! The link between the host and the device tier: a transfer engine with the copy
//! accounting every offloading policy reports (HeadInfer §3.2, KVPR §3.3 and HybridServe
//! §4.2 all overlap these copies with compute; the counts say how much moved).
use candle_core::Device;

use crate::transfer::{engine_for, CopyJob, Ticket, TransferEngine};
use kvpolicy_core::Result;
use kvpolicy_core::{DeviceMeter, KvStats};

/// Which way a batch of copies goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Host tier to device tier (loads, prefetches).
    H2d,
    /// Device tier to host tier (write-backs, demotions).
    D2h,
}

/// A transfer engine with the accounting every policy reports (see the module docs).
pub struct Link {
    engine: Box<dyn TransferEngine>,
    /// `engine.copy_seconds()` at the last reset (reports count from there).
    copy_base: f64,
    /// `engine.busy_seconds()` at the last reset.
    busy_base: f64,
    h2d_bytes: u64,
    d2h_bytes: u64,
    wait_s: f64,
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link")
            .field("h2d_bytes", &self.h2d_bytes)
            .field("d2h_bytes", &self.d2h_bytes)
            .finish()
    }
}

impl Link {
    /// The engine suited to `device` ([`engine_for`]), optionally a simulated link of
    /// `bytes_per_s` on the CPU.
    pub fn for_device(device: &Device, bytes_per_s: Option<f64>) -> Result<Self> {
        Ok(Self::new(engine_for(device, bytes_per_s)?))
    }

    /// A link over `engine`.
    pub fn new(engine: Box<dyn TransferEngine>) -> Self {
        Self {
            copy_base: engine.copy_seconds(),
            busy_base: engine.busy_seconds(),
            engine,
            h2d_bytes: 0,
            d2h_bytes: 0,
            wait_s: 0.0,
        }
    }

    /// The engine, e.g. to allocate host buffers through it.
    pub fn engine(&mut self) -> &mut dyn TransferEngine {
        self.engine.as_mut()
    }

    /// Queues `jobs` and counts their bytes; `None` when there is nothing to copy.
    pub fn submit(&mut self, jobs: Vec<CopyJob>, dir: Direction) -> Result<Option<Ticket>> {
        if jobs.is_empty() {
            return Ok(None);
        }
        self.count(jobs.iter().map(CopyJob::bytes).sum(), dir);
        Ok(Some(self.engine.submit(jobs)?))
    }

    /// Queues `jobs` without counting them: for copies made ahead of the step that uses
    /// them, whose bytes the caller counts with [`count`](Self::count) when that step takes
    /// them (or drops them). Returns the ticket and the bytes.
    pub fn submit_uncounted(&mut self, jobs: Vec<CopyJob>) -> Result<(Option<Ticket>, u64)> {
        if jobs.is_empty() {
            return Ok((None, 0));
        }
        let bytes = jobs.iter().map(CopyJob::bytes).sum();
        Ok((Some(self.engine.submit(jobs)?), bytes))
    }

    /// Counts `bytes` copied outside the engine (a synchronous write-back), or queued
    /// uncounted earlier ([`submit_uncounted`](Self::submit_uncounted)).
    pub fn count(&mut self, bytes: u64, dir: Direction) {
        match dir {
            Direction::H2d => self.h2d_bytes += bytes,
            Direction::D2h => self.d2h_bytes += bytes,
        }
    }

    /// Waits for a batch (nothing for `None`), counting the time blocked.
    pub fn wait(&mut self, ticket: Option<Ticket>) -> Result<()> {
        if let Some(t) = ticket {
            self.wait_s += self.engine.wait(t)?;
        }
        Ok(())
    }

    /// Waits for every queued batch, counting the time blocked.
    pub fn wait_all(&mut self) -> Result<()> {
        self.wait_s += self.engine.wait_all()?;
        Ok(())
    }

    /// Drains the queue and zeroes the accounting. A copy that failed here belonged to the
    /// sequence being dropped, so its error is not reported again.
    pub fn reset(&mut self) {
        let _ = self.engine.wait_all();
        self.h2d_bytes = 0;
        self.d2h_bytes = 0;
        self.wait_s = 0.0;
        self.copy_base = self.engine.copy_seconds();
        self.busy_base = self.engine.busy_seconds();
    }

    /// `stats` with this link's traffic, waits, copy and busy time and pinned bytes filled in.
    pub fn report(&self, stats: KvStats) -> KvStats {
        KvStats {
            h2d_bytes: self.h2d_bytes,
            d2h_bytes: self.d2h_bytes,
            transfer_wait_s: self.wait_s,
            copy_s: self.engine.copy_seconds() - self.copy_base,
            link_busy_s: self.engine.busy_seconds() - self.busy_base,
            host_pinned_bytes: self.engine.pinned_bytes(),
            ..stats
        }
    }
}

/// `stats` with the device tier's bytes now and at peak filled in from `meter`.
pub fn report_device(meter: &DeviceMeter, stats: KvStats) -> KvStats {
    KvStats {
        device_kv_bytes: meter.current(),
        device_kv_peak_bytes: meter.peak(),
        ..stats
    }
}

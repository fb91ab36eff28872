//! The CPU transfer engines: a worker thread that copies beside the compute (optionally
//! through a simulated link of fixed bandwidth, one wire shared by the process), and a
//! synchronous engine that copies at submission (HeadInfer §3.2's ping-pong needs the
//! former to overlap anything).
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use super::engine::{run_jobs, CopyJob, Ticket, TransferEngine};
use super::wire::{book_shared, Slot};
use kvpolicy_core::{KvError, Result};

/// Copies at submission time.
#[derive(Debug, Default)]
pub struct SyncTransferEngine {
    next: u64,
    busy_s: f64,
}

impl TransferEngine for SyncTransferEngine {
    fn submit(&mut self, jobs: Vec<CopyJob>) -> Result<Ticket> {
        let start = Instant::now();
        run_jobs(&jobs)?;
        self.busy_s += start.elapsed().as_secs_f64();
        self.next += 1;
        Ok(Ticket(self.next))
    }

    fn wait(&mut self, _ticket: Ticket) -> Result<f64> {
        Ok(0.0)
    }

    fn wait_all(&mut self) -> Result<f64> {
        Ok(0.0)
    }

    fn copy_seconds(&self) -> f64 {
        self.busy_s
    }
}

#[derive(Default)]
struct Progress {
    done: u64,
    error: Option<String>,
    /// Seconds spent copying.
    copy_s: f64,
    /// Seconds the link was busy (the copies, or on a simulated wire each batch's wire
    /// time with its copy inside).
    busy_s: f64,
}

/// A batch for the worker: its ticket, its jobs and, on a simulated link, its wire slot.
struct Batch {
    id: u64,
    jobs: Vec<CopyJob>,
    slot: Option<Slot>,
}

/// Batches below this many bytes run inline when nothing is queued: waking the worker costs
/// more than copying them (a decode step's write-back is one token per head).
pub const INLINE_BYTES: u64 = 64 * 1024;

/// Runs copies on a background thread (small batches inline when the queue is empty).
pub struct CpuTransferEngine {
    tx: Option<Sender<Batch>>,
    /// The simulated link's bandwidth, if any.
    link: Option<f64>,
    state: Arc<(Mutex<Progress>, Condvar)>,
    submitted: u64,
    worker: Option<JoinHandle<()>>,
    inline_bytes: u64,
}

impl std::fmt::Debug for CpuTransferEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuTransferEngine")
            .field("submitted", &self.submitted)
            .finish()
    }
}

impl CpuTransferEngine {
    /// Starts the worker thread.
    pub fn new() -> Result<Self> {
        Self::start(None)
    }

    /// A worker that simulates a host↔device link of `bytes_per_s` (CPU experiments: each
    /// batch occupies the process's one simulated wire for its bytes ÷ the bandwidth from
    /// its submission or after the batches of every engine booked before it, its copy
    /// running inside that time — see [`super::wire`]; nothing runs inline).
    pub fn with_link(bytes_per_s: f64) -> Result<Self> {
        if !(bytes_per_s.is_finite() && bytes_per_s > 0.0) {
            return Err(KvError::Unsupported(format!(
                "a simulated link of {bytes_per_s} bytes/s: its bandwidth must be positive"
            )));
        }
        Ok(Self::start(Some(bytes_per_s))?.with_inline_bytes(0))
    }

    fn start(link: Option<f64>) -> Result<Self> {
        let (tx, rx) = channel::<Batch>();
        let state = Arc::new((Mutex::new(Progress::default()), Condvar::new()));
        let st = Arc::clone(&state);
        let worker = std::thread::Builder::new()
            .name("kv-transfer".into())
            .spawn(move || {
                // When the previous batch completed: busy time is counted once.
                let mut last_done: Option<Instant> = None;
                for batch in rx {
                    let picked = Instant::now();
                    let err = run_jobs(&batch.jobs).err().map(|e| e.to_string());
                    let copied = Instant::now();
                    let busy = match batch.slot {
                        Some(slot) => {
                            let done = slot.completion(copied);
                            std::thread::sleep(done.saturating_duration_since(copied));
                            let busy = slot.busy(last_done, done);
                            last_done = Some(done);
                            busy
                        }
                        None => copied - picked,
                    };
                    let (lock, cv) = &*st;
                    if let Ok(mut p) = lock.lock() {
                        p.copy_s += (copied - picked).as_secs_f64();
                        p.busy_s += busy.as_secs_f64();
                        p.done = batch.id;
                        if p.error.is_none() {
                            p.error = err;
                        }
                    }
                    cv.notify_all();
                }
            })
            .map_err(|e| KvError::Transfer(format!("cannot start the transfer thread: {e}")))?;
        Ok(Self {
            tx: Some(tx),
            link,
            state,
            submitted: 0,
            worker: Some(worker),
            inline_bytes: INLINE_BYTES,
        })
    }

    /// Sets the size below which batches run inline (0: always use the worker).
    pub fn with_inline_bytes(mut self, bytes: u64) -> Self {
        self.inline_bytes = bytes;
        self
    }

    fn idle(&self) -> bool {
        self.state
            .0
            .lock()
            .map(|p| p.done == self.submitted && p.error.is_none())
            .unwrap_or(false)
    }

    fn wait_for(&mut self, id: u64) -> Result<f64> {
        let start = Instant::now();
        let (lock, cv) = &*self.state;
        let mut p = lock
            .lock()
            .map_err(|_| KvError::Transfer("the transfer thread panicked".into()))?;
        while p.done < id && p.error.is_none() {
            p = cv
                .wait(p)
                .map_err(|_| KvError::Transfer("the transfer thread panicked".into()))?;
        }
        if let Some(e) = p.error.take() {
            return Err(KvError::Transfer(e));
        }
        Ok(start.elapsed().as_secs_f64())
    }
}

impl TransferEngine for CpuTransferEngine {
    fn submit(&mut self, jobs: Vec<CopyJob>) -> Result<Ticket> {
        let bytes: u64 = jobs.iter().map(CopyJob::bytes).sum();
        if bytes < self.inline_bytes && self.idle() {
            // Nothing queued: running now keeps the order and saves a thread hand-off.
            let start = Instant::now();
            run_jobs(&jobs)?;
            self.submitted += 1;
            let (lock, _) = &*self.state;
            if let Ok(mut p) = lock.lock() {
                let took = start.elapsed().as_secs_f64();
                p.copy_s += took;
                p.busy_s += took;
                p.done = self.submitted;
            }
            return Ok(Ticket(self.submitted));
        }
        self.submitted += 1;
        let tx = self
            .tx
            .as_ref()
            .ok_or_else(|| KvError::Transfer("the transfer engine is shut down".into()))?;
        // The wire is booked at submission: a batch may start on it before the worker is
        // done with an earlier one's copy.
        let slot = self.link.map(|bw| book_shared(bytes, bw));
        tx.send(Batch {
            id: self.submitted,
            jobs,
            slot,
        })
        .map_err(|_| KvError::Transfer("the transfer thread has stopped".into()))?;
        Ok(Ticket(self.submitted))
    }

    fn wait(&mut self, ticket: Ticket) -> Result<f64> {
        self.wait_for(ticket.0)
    }

    fn wait_all(&mut self) -> Result<f64> {
        self.wait_for(self.submitted)
    }

    fn copy_seconds(&self) -> f64 {
        self.state.0.lock().map_or(0.0, |p| p.copy_s)
    }

    fn busy_seconds(&self) -> f64 {
        self.state.0.lock().map_or(0.0, |p| p.busy_s)
    }
}

impl Drop for CpuTransferEngine {
    fn drop(&mut self) {
        self.tx = None;
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    #[test]
    fn copies_in_order_in_the_background() -> Result<()> {
        let dev = Device::Cpu;
        let dst = Tensor::zeros((1, 2, 8, 3), candle_core::DType::F32, &dev)?;
        let mut eng = CpuTransferEngine::new()?.with_inline_bytes(0);
        let a = Tensor::ones((1, 1, 4, 3), candle_core::DType::F32, &dev)?;
        let b = (Tensor::ones((1, 1, 4, 3), candle_core::DType::F32, &dev)? * 2.0)?;
        let head1 = dst.narrow(1, 1, 1)?;
        let t1 = eng.submit(vec![CopyJob {
            src: a,
            dst: head1.clone(),
            dim: 2,
            offset: 2,
        }])?;
        let t2 = eng.submit(vec![CopyJob {
            src: b,
            dst: head1,
            dim: 2,
            offset: 4,
        }])?;
        assert!(t2 > t1);
        eng.wait(t2)?;
        let v = dst.narrow(1, 1, 1)?.flatten_all()?.to_vec1::<f32>()?;
        let want: Vec<f32> = (0..8)
            .flat_map(|i| {
                [match i {
                    2 | 3 => 1.0,
                    4..=7 => 2.0,
                    _ => 0.0,
                }; 3]
            })
            .collect();
        assert_eq!(v, want);
        assert_eq!(dst.narrow(1, 0, 1)?.sum_all()?.to_scalar::<f32>()?, 0.0);
        Ok(())
    }

    #[test]
    fn copy_time_adds_up_on_the_worker_inline_and_synchronously() -> Result<()> {
        let dev = Device::Cpu;
        let src = Tensor::ones((64, 1024), candle_core::DType::F32, &dev)?;
        let job = |dst: &Tensor| CopyJob {
            src: src.clone(),
            dst: dst.clone(),
            dim: 0,
            offset: 0,
        };
        let dst = Tensor::zeros((64, 1024), candle_core::DType::F32, &dev)?;
        // A 50 MB/s simulated link: 256 KiB take about 5 ms of wire time.
        let engines: Vec<Box<dyn TransferEngine>> = vec![
            Box::new(CpuTransferEngine::with_link(50e6)?),
            Box::new(CpuTransferEngine::new()?.with_inline_bytes(u64::MAX)),
            Box::new(SyncTransferEngine::default()),
        ];
        for mut eng in engines {
            assert_eq!(eng.copy_seconds(), 0.0);
            eng.submit(vec![job(&dst)])?;
            eng.wait_all()?;
            let once = eng.copy_seconds();
            assert!(once > 0.0);
            eng.submit(vec![job(&dst)])?;
            eng.wait_all()?;
            assert!(eng.copy_seconds() > once);
        }
        // The link is busy for at least the batch's wire time (the copy inside it).
        let mut eng = CpuTransferEngine::with_link(50e6)?;
        eng.submit(vec![job(&dst)])?;
        eng.wait_all()?;
        assert!(eng.busy_seconds() >= 256.0 * 1024.0 / 50e6 * 0.99);
        assert!(eng.busy_seconds() > eng.copy_seconds());
        Ok(())
    }

    #[test]
    fn a_failed_copy_is_reported() -> Result<()> {
        let dev = Device::Cpu;
        let dst = Tensor::zeros((1, 1, 2, 3), candle_core::DType::F32, &dev)?;
        let src = Tensor::ones((1, 1, 4, 3), candle_core::DType::F32, &dev)?;
        let job = CopyJob {
            src,
            dst,
            dim: 2,
            offset: 0,
        };
        // On the worker, the failure surfaces at the next wait.
        let mut eng = CpuTransferEngine::new()?.with_inline_bytes(0);
        eng.submit(vec![job.clone()])?;
        assert!(eng.wait_all().is_err());
        // Inline, at submission.
        let mut eng = CpuTransferEngine::new()?;
        assert!(eng.submit(vec![job]).is_err());
        Ok(())
    }

    #[test]
    fn small_batches_run_inline_only_when_nothing_is_queued() -> Result<()> {
        let dev = Device::Cpu;
        let dst = Tensor::zeros((1, 1, 4, 2), candle_core::DType::F32, &dev)?;
        let big = Tensor::ones((1, 1, 4, 2), candle_core::DType::F32, &dev)?;
        let small = (Tensor::ones((1, 1, 1, 2), candle_core::DType::F32, &dev)? * 5.0)?;
        // A 32-byte batch goes to the worker, then an 8-byte one: order is kept.
        let mut eng = CpuTransferEngine::new()?.with_inline_bytes(9);
        eng.submit(vec![CopyJob {
            src: big,
            dst: dst.clone(),
            dim: 2,
            offset: 0,
        }])?;
        eng.submit(vec![CopyJob {
            src: small.clone(),
            dst: dst.clone(),
            dim: 2,
            offset: 3,
        }])?;
        eng.wait_all()?;
        assert_eq!(
            dst.flatten_all()?.to_vec1::<f32>()?,
            vec![1., 1., 1., 1., 1., 1., 5., 5.]
        );
        // Idle engine: the small batch is done when submit returns.
        eng.submit(vec![CopyJob {
            src: small,
            dst: dst.clone(),
            dim: 2,
            offset: 0,
        }])?;
        assert_eq!(dst.flatten_all()?.to_vec1::<f32>()?[..2], [5., 5.]);
        Ok(())
    }
}

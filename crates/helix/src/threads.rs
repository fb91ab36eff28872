//! Ranks as threads of one process: a [`Collective`] over shared memory, so that tests and
//! benches run a KV-parallel group without `mpirun`. Same semantics as the MPI backend:
//! every rank calls the same collectives in the same order. A rank whose handle is dropped
//! (its thread returned an error, or panicked) has left: the others' collectives fail with
//! [`CollectiveError::PeerLost`] instead of waiting for it forever.
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use candle_core::Tensor;

use crate::collective::{host_values, stacked, Collective, CollectiveError, CollectiveResult};

/// Where the ranks meet: how many arrived in the current round, the round, and the first
/// rank that left the group.
#[derive(Debug, Default)]
struct Gate {
    arrived: usize,
    round: u64,
    left: Option<usize>,
}

/// What the ranks of one group share.
#[derive(Debug)]
struct Shared {
    slots: Mutex<Vec<Vec<f32>>>,
    words: Mutex<Vec<u32>>,
    counters: Mutex<Vec<Vec<u64>>>,
    gate: Mutex<Gate>,
    met: Condvar,
}

/// One rank of an in-process group ([`ThreadGroup::new`] makes all of them); dropping it
/// leaves the group.
#[derive(Debug)]
pub struct ThreadGroup {
    rank: usize,
    size: usize,
    shared: Arc<Shared>,
}

impl ThreadGroup {
    /// The `size` ranks of a new group, rank `r` at index `r`; hand each to its own thread.
    pub fn new(size: usize) -> Vec<ThreadGroup> {
        let shared = Arc::new(Shared {
            slots: Mutex::new(vec![Vec::new(); size]),
            words: Mutex::new(Vec::new()),
            counters: Mutex::new(vec![Vec::new(); size]),
            gate: Mutex::new(Gate::default()),
            met: Condvar::new(),
        });
        (0..size)
            .map(|rank| ThreadGroup {
                rank,
                size,
                shared: shared.clone(),
            })
            .collect()
    }

    fn poisoned() -> CollectiveError {
        CollectiveError::Backend("a rank's thread panicked".into())
    }

    fn gate(&self) -> CollectiveResult<MutexGuard<'_, Gate>> {
        self.shared.gate.lock().map_err(|_| Self::poisoned())
    }

    /// Returns once every rank has arrived; an error once a rank has left.
    fn meet(&self) -> CollectiveResult<()> {
        let mut g = self.gate()?;
        let lost = |rank| CollectiveError::PeerLost {
            rank,
            why: "its thread left the group".into(),
        };
        if let Some(rank) = g.left {
            return Err(lost(rank));
        }
        let round = g.round;
        g.arrived += 1;
        if g.arrived == self.size {
            g.arrived = 0;
            g.round += 1;
            self.shared.met.notify_all();
            return Ok(());
        }
        loop {
            g = self.shared.met.wait(g).map_err(|_| Self::poisoned())?;
            // A finished round first: a rank may leave right after the last one.
            if g.round != round {
                return Ok(());
            }
            if let Some(rank) = g.left {
                return Err(lost(rank));
            }
        }
    }

    /// Every rank's values, through `slots`, in rank order; the slots are free again when it
    /// returns. An error when the ranks' counts differ.
    fn exchange<T: Clone>(
        &self,
        slots: &Mutex<Vec<Vec<T>>>,
        values: Vec<T>,
    ) -> CollectiveResult<Vec<Vec<T>>> {
        slots.lock().map_err(|_| Self::poisoned())?[self.rank] = values;
        self.meet()?;
        let all = slots.lock().map_err(|_| Self::poisoned())?.clone();
        self.meet()?;
        let want = all[0].len();
        if let Some((rank, v)) = all.iter().enumerate().find(|(_, v)| v.len() != want) {
            return Err(CollectiveError::Mismatch {
                rank,
                got: v.len(),
                want,
            });
        }
        Ok(all)
    }
}

impl Collective for ThreadGroup {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn all_gather(&self, local: &Tensor) -> CollectiveResult<Tensor> {
        let all = self.exchange(&self.shared.slots, host_values(local)?)?;
        stacked(all.concat(), self.size, local)
    }
    fn all_reduce_sum(&self, local: &Tensor) -> CollectiveResult<Tensor> {
        let all = self.exchange(&self.shared.slots, host_values(local)?)?;
        let mut sum = vec![0f32; all[0].len()];
        for v in &all {
            for (s, x) in sum.iter_mut().zip(v) {
                *s += x;
            }
        }
        Ok(Tensor::from_vec(sum, local.dims(), local.device())?)
    }
    fn all_gather_u64(&self, local: &[u64]) -> CollectiveResult<Vec<u64>> {
        Ok(self
            .exchange(&self.shared.counters, local.to_vec())?
            .concat())
    }
    fn broadcast_u32(&self, values: &mut [u32], root: usize) -> CollectiveResult<()> {
        if self.rank == root {
            *self.shared.words.lock().map_err(|_| Self::poisoned())? = values.to_vec();
        }
        self.meet()?;
        let words = self
            .shared
            .words
            .lock()
            .map_err(|_| Self::poisoned())?
            .clone();
        self.meet()?;
        if words.len() != values.len() {
            return Err(CollectiveError::Mismatch {
                rank: root,
                got: words.len(),
                want: values.len(),
            });
        }
        values.copy_from_slice(&words);
        Ok(())
    }
    fn barrier(&self) -> CollectiveResult<()> {
        self.meet()
    }
    fn backend(&self) -> &'static str {
        "threads"
    }
}

impl Drop for ThreadGroup {
    fn drop(&mut self) {
        if let Ok(mut g) = self.shared.gate.lock() {
            g.left.get_or_insert(self.rank);
        }
        self.shared.met.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn three_threads_gather_reduce_and_broadcast() -> anyhow::Result<()> {
        let handles: Vec<_> = ThreadGroup::new(3)
            .into_iter()
            .map(|g| {
                std::thread::spawn(move || -> anyhow::Result<(Vec<f32>, Vec<f32>, Vec<u32>)> {
                    let r = g.rank() as f32;
                    let t = Tensor::new(&[r, r + 10.], &Device::Cpu)?;
                    let all = g.all_gather(&t)?.flatten_all()?.to_vec1::<f32>()?;
                    let sum = g.all_reduce_sum(&t)?.to_vec1::<f32>()?;
                    assert_eq!(g.all_gather_u64(&[g.rank() as u64 * 5])?, vec![0, 5, 10]);
                    let mut w = [g.rank() as u32 + 7; 2];
                    g.broadcast_u32(&mut w, 2)?;
                    g.barrier()?;
                    Ok((all, sum, w.to_vec()))
                })
            })
            .collect();
        for h in handles {
            let (all, sum, w) = h.join().map_err(|_| anyhow::anyhow!("rank panicked"))??;
            assert_eq!(all, vec![0., 10., 1., 11., 2., 12.]);
            assert_eq!(sum, vec![3., 33.]);
            assert_eq!(w, vec![9, 9]);
        }
        Ok(())
    }

    #[test]
    fn a_rank_that_leaves_fails_the_others_instead_of_hanging() -> anyhow::Result<()> {
        let mut ranks = ThreadGroup::new(3);
        let gone = ranks.remove(1);
        let handles: Vec<_> = ranks
            .into_iter()
            .map(|g| std::thread::spawn(move || g.barrier()))
            .collect();
        drop(gone);
        for h in handles {
            let e = h.join().map_err(|_| anyhow::anyhow!("rank panicked"))?;
            assert!(
                matches!(e, Err(CollectiveError::PeerLost { rank: 1, .. })),
                "{e:?}"
            );
        }
        Ok(())
    }
}

//! The host tier's RAM store ([`HostKv`]): one layer's K/V in `(b, kv_heads, cap,
//! head_dim)` host buffers allocated through the transfer engine (so the CUDA one
//! page-locks them), grown a chunk of tokens at a time (HeadInfer §3.2: "the full KV cache
//! lives in CPU memory"). Writes are queued on the link behind the compute, one job per
//! sequence and head; reads are views. It has no read-ahead: its reads cost nothing.
use std::any::Any;

use candle_core::Tensor;
use kvpolicy_core::Result;

use super::disk_traffic::{DiskTraffic, ReadSpan};
use super::store::{tensor_bytes, LayerStore, Room, WriteAt};
use crate::link::{Direction, Link};
use crate::transfer::{grown_host, CopyJob, TransferEngine};

/// One layer's K/V on the host tier: `(b, kv_heads, cap, head_dim)` each.
#[derive(Debug)]
pub struct HostKv {
    /// Keys.
    pub k: Tensor,
    /// Values.
    pub v: Tensor,
    /// Tokens the buffers hold room for.
    pub cap: usize,
}

impl HostKv {
    /// Buffers holding `tokens` (rounded up to whole growth chunks) with `old`'s copied in
    /// and handed back to the engine, once the copies queued on the link have landed (they
    /// may target `old`); `None` when they would pass the host budget (nothing allocated).
    pub(crate) fn grown(
        old: Option<&HostKv>,
        tokens: usize,
        room: &mut Room<'_>,
    ) -> Result<Option<Self>> {
        room.link().wait_all()?;
        let cap = room.capacity_for(tokens);
        if !room.fits(cap) {
            return Ok(None);
        }
        let (dims, dt) = room.buffers(cap)?;
        let engine = room.link().engine();
        let k = grown_host(engine, old.map(|o| &o.k), dims, 2, dt)?;
        let v = grown_host(engine, old.map(|o| &o.v), dims, 2, dt)?;
        Ok(Some(Self { k, v, cap }))
    }
}

impl LayerStore for HostKv {
    /// Larger buffers when `tokens` pass the capacity (a completed prefetch stays valid: it
    /// read the unchanged prefix); `false` when they would pass the host budget.
    fn make_room(&mut self, tokens: usize, room: &mut Room<'_>) -> Result<bool> {
        if tokens <= self.cap {
            return Ok(true);
        }
        let Some(grown) = Self::grown(Some(self), tokens, room)? else {
            return Ok(false);
        };
        *self = grown;
        Ok(true)
    }

    fn history(&self, span: ReadSpan, _: &mut DiskTraffic) -> Result<(Tensor, Tensor)> {
        let (heads, tokens) = (span.heads(), span.tokens());
        let view = |t: &Tensor| -> Result<Tensor> {
            Ok(t.narrow(1, heads.first, heads.count)?
                .narrow(2, tokens.start, tokens.len)?)
        };
        Ok((view(&self.k)?, view(&self.v)?))
    }

    /// Queued on `link` behind the compute: one job per sequence and head (one contiguous
    /// run each).
    fn write(
        &mut self,
        link: &mut Link,
        _: &mut DiskTraffic,
        at: WriteAt,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<()> {
        let WriteAt {
            first_head, offset, ..
        } = at;
        let (batch, heads) = (k.dim(0)?, k.dim(1)?);
        let mut jobs = Vec::with_capacity(2 * batch * heads);
        for bi in 0..batch {
            for j in 0..heads {
                for (src, dst) in [(k, &self.k), (v, &self.v)] {
                    jobs.push(CopyJob {
                        src: src.narrow(0, bi, 1)?.narrow(1, j, 1)?,
                        dst: dst.narrow(0, bi, 1)?.narrow(1, first_head + j, 1)?,
                        dim: 2,
                        offset,
                    });
                }
            }
        }
        link.submit(jobs, Direction::D2h)?;
        Ok(())
    }

    fn capacity(&self) -> usize {
        self.cap
    }
    fn drop_front(&mut self, n: usize, held: usize) -> Result<bool> {
        let keep = held.saturating_sub(n);
        kvpolicy_core::move_to_front(&self.k, 2, n, keep)?;
        kvpolicy_core::move_to_front(&self.v, 2, n, keep)?;
        Ok(true)
    }
    fn ram_bytes(&self) -> u64 {
        tensor_bytes(&self.k) + tensor_bytes(&self.v)
    }

    fn release(self: Box<Self>, engine: &mut dyn TransferEngine) {
        let _ = engine.host_release(&self.k);
        let _ = engine.host_release(&self.v);
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

//! Layers that read another layer's cache: multi-layer KV sharing (MLKV, Zuhri et al.,
//! arXiv 2406.09297 §3). Only `m` of a model's `L` layers project K/V; every other layer
//! attends, with its own queries, over the cache of the nearest KV layer below it. A policy
//! sees only the `m` KV layers ([`KvShape::n_layers`](crate::KvShape), with
//! [`KvShape::readers`](crate::KvShape) saying how many layers read each), so it stores,
//! moves and spills `m / L` of an unshared model's bytes; the readers' attention comes
//! through [`KvPolicy::attend_shared`](crate::KvPolicy::attend_shared).
//!
//! A reader's queries exist only after its owner's output does (they are computed from it),
//! so a policy cannot serve them in the owner's call. [`ReaderStash`] is what most policies
//! keep instead: the K/V they assembled on the device to attend the owner layer — views of
//! buffers that stay put, or copies of streaming buffers that will be refilled — until the
//! next layer's step, so that every reader attends over them without moving a byte again.
use candle_core::Tensor;

use crate::attention::{attend_partial, merge_partials, AttnInputs, Partial};
use crate::error::{KvError, Result};
use crate::step::AttnStep;

/// A piece of one layer's K/V kept on the device for its readers: heads
/// `first_head..first_head + k.dim(1)` over tokens from `k_pos` on.
#[derive(Clone, Debug)]
pub struct StashedUnit {
    /// The piece's first KV head.
    pub first_head: usize,
    /// Keys `(b, heads, tokens, head_dim)`, positional encoding applied.
    pub k: Tensor,
    /// Values, shaped like the keys.
    pub v: Tensor,
    /// Position of the first key.
    pub k_pos: usize,
}

/// Per sequence, the K/V of the layer its step attended last, for the layers that read
/// that layer's cache (module docs). Pieces over the same heads (token ranges) are merged
/// by their log-sum-exp; pieces over different heads are concatenated. In a ragged batch
/// the sequences' steps interleave, so each keeps its own.
#[derive(Debug, Default)]
pub struct ReaderStash {
    entries: Vec<Kept>,
}

/// One sequence's kept layer.
#[derive(Debug)]
struct Kept {
    /// The (layer, sequence, position) of the step the pieces belong to.
    at: (usize, usize, usize),
    units: Vec<StashedUnit>,
    /// Device bytes of the pieces that are copies (views of kept buffers cost nothing).
    copied: u64,
}

impl ReaderStash {
    /// Forgets every sequence's pieces; returns the device bytes of the copies freed.
    pub fn clear(&mut self) -> u64 {
        self.entries.drain(..).map(|e| e.copied).sum()
    }

    /// Forgets sequence `seq`'s pieces; returns the bytes freed.
    pub fn release(&mut self, seq: usize) -> u64 {
        let (gone, kept): (Vec<Kept>, Vec<Kept>) =
            self.entries.drain(..).partition(|e| e.at.1 == seq);
        self.entries = kept;
        gone.iter().map(|e| e.copied).sum()
    }

    /// Starts keeping `step`'s layer for its sequence (forgetting what that sequence kept);
    /// returns the bytes freed.
    pub fn begin(&mut self, step: &AttnStep<'_>) -> u64 {
        let freed = self.release(step.seq);
        self.entries.push(Kept {
            at: (step.layer, step.seq, step.pos),
            units: Vec::new(),
            copied: 0,
        });
        freed
    }

    fn current(&mut self) -> Result<&mut Kept> {
        self.entries
            .last_mut()
            .ok_or_else(|| KvError::invariant("K/V kept for readers before `begin`"))
    }

    /// Keeps a view of buffers that stay unchanged until the sequence's next layer step.
    pub fn keep_view(&mut self, unit: StashedUnit) -> Result<()> {
        self.current()?.units.push(unit);
        Ok(())
    }

    /// Keeps a device copy of `unit` (its buffers will be refilled); returns its bytes, to
    /// be counted on the device.
    pub fn keep_copy(&mut self, unit: StashedUnit) -> Result<u64> {
        self.keep_owned(StashedUnit {
            k: unit.k.copy()?,
            v: unit.v.copy()?,
            ..unit
        })
    }

    /// Keeps `unit`, whose tensors were made for this step (not views of a kept buffer), and
    /// counts their bytes like a copy's; returns them.
    pub fn keep_owned(&mut self, unit: StashedUnit) -> Result<u64> {
        let bytes = |t: &Tensor| (t.elem_count() * t.dtype().size_in_bytes()) as u64;
        let b = bytes(&unit.k) + bytes(&unit.v);
        let cur = self.current()?;
        cur.copied += b;
        cur.units.push(unit);
        Ok(b)
    }

    /// Device bytes of the copies kept now.
    pub fn copied_bytes(&self) -> u64 {
        self.entries.iter().map(|e| e.copied).sum()
    }

    fn entry(&self, step: &AttnStep<'_>) -> Option<&Kept> {
        self.entries
            .iter()
            .find(|e| e.at == (step.layer, step.seq, step.pos))
    }

    /// The reader `step`'s attention over the kept layer: `(b, n_heads, t, head_dim)` f32
    /// with its log-sum-exp.
    pub fn attend(&self, step: &AttnStep<'_>) -> Result<Partial> {
        let Some(kept) = self.entry(step) else {
            return Err(KvError::Protocol(format!(
                "a layer reading layer {}'s cache at position {} found none of it kept: readers \
                 follow their owner's attend, before the next layer's, and the policy learns \
                 which layers have readers from `prepare` (KvShape::readers) — prepare it \
                 with the model's shape before the first step",
                step.layer, step.pos
            )));
        };
        let (b, nh, t, d) = step.q.dims4()?;
        let nkv = step.spec.n_kv_heads.max(1);
        let g = nh / nkv;
        let mut units: Vec<&StashedUnit> = kept.units.iter().collect();
        units.sort_by_key(|u| u.first_head);
        let mut heads: Vec<Partial> = Vec::new();
        let mut i = 0;
        let mut next_head = 0;
        while i < units.len() {
            let (first, n) = (units[i].first_head, units[i].k.dim(1)?);
            if first != next_head {
                return Err(KvError::invariant(format!(
                    "the kept K/V start at head {first}, expected {next_head}"
                )));
            }
            let q = step.q.narrow(1, first * g, n * g)?;
            let mut parts = Vec::new();
            while i < units.len() && units[i].first_head == first {
                let u = units[i];
                parts.push(attend_partial(
                    AttnInputs {
                        q: &q,
                        k: &u.k,
                        v: &u.v,
                        q_pos: step.pos,
                        k_pos: u.k_pos,
                    },
                    step.spec,
                )?);
                i += 1;
            }
            heads.push(merge_partials(&parts)?);
            next_head = first + n;
        }
        if heads.is_empty() {
            return Partial::empty(b, nh, t, d, step.q.device());
        }
        if next_head != nkv {
            return Err(KvError::invariant(format!(
                "the kept K/V cover {next_head} of {nkv} KV heads"
            )));
        }
        if heads.len() == 1 {
            return Ok(heads.swap_remove(0));
        }
        let out: Vec<Tensor> = heads.iter().map(|p| p.out.clone()).collect();
        let lse: Vec<Tensor> = heads.iter().map(|p| p.lse.clone()).collect();
        Ok(Partial {
            out: Tensor::cat(&out, 1)?,
            lse: Tensor::cat(&lse, 1)?,
            scratch_bytes: heads.iter().map(|p| p.scratch_bytes).max().unwrap_or(0),
        })
    }
}

/// The error of a policy that cannot serve a reading layer.
pub fn not_shareable(policy: &str) -> KvError {
    KvError::Unsupported(format!(
        "`{policy}` cannot serve a model whose layers share K/V (MLKV: config.json's \
         num_key_value_layers below num_hidden_layers); use full, layer, headwise, auto, \
         recompute, hybrid, an approximate policy or helix"
    ))
}

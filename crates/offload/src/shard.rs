//! `layer`, `headwise` and `auto` holding one rank's share of a sequence (`helix`:
//! KV-parallel decoding, Helix §3). The share's tokens sit on the host tier (RAM or disk) —
//! or, for `auto`'s resident units, in their device buffers — at positions counted from the
//! share's first, so the tier, its windows, its files and `auto`'s placement (its plan sized
//! for the share, demotions) work unchanged;
//! only the attention sees absolute positions (queries at the step's, keys at the share's
//! first plus their offset), and it returns the partial (output and log-sum-exp) for
//! `helix` to merge. A step's K/V are stored only for the positions the share takes, and a
//! step past the share stores nothing and attends over what the share holds. Units are not
//! staged for a next step (`helix` calls come with and without stores; a unit staged for
//! the wrong range would be dropped unused).
use std::ops::Range;

use candle_core::Tensor;
use kvpolicy_core::{AttnStep, Partial, Result, ShardLocal, TokenRange};

use crate::resident::{UnitAt, UnitId};
use crate::runtime::{OffloadPolicy, StreamedUnit};
use crate::stream::StepAt;

impl ShardLocal for OffloadPolicy {
    fn attend_shard_shared(&mut self, step: &AttnStep<'_>) -> Result<Partial> {
        self.stash.attend(step)
    }

    fn attend_shard(&mut self, step: &AttnStep<'_>, store: Range<usize>) -> Result<Partial> {
        let (b, nh, t, d) = step.q.dims4()?;
        if !store.is_empty() {
            kvpolicy_core::check_store(step, &store)?;
            self.shard_base.get_or_insert(store.start);
        }
        let freed = self.stash.clear();
        self.meter.free(freed);
        let keep = self
            .host
            .known_shape()
            .is_some_and(|s| s.has_readers(step.layer));
        if keep {
            self.stash.begin(step);
        }
        let Some(base) = self.shard_base else {
            return Partial::empty(b, nh, t, d, step.q.device());
        };
        let layer = step.layer;
        // The share's own positions (from its first) for the host tier.
        let (kn, vn, pos) = if store.is_empty() {
            let none = |x: &Tensor| x.narrow(2, 0, 0);
            (none(step.k)?, none(step.v)?, self.host.seq_len())
        } else {
            let from = store.start - step.pos;
            (
                step.k.narrow(2, from, store.len())?,
                step.v.narrow(2, from, store.len())?,
                store.start - base,
            )
        };
        let local = AttnStep {
            k: &kn,
            v: &vn,
            pos,
            ..*step
        };
        let shape = self.host.shape_for(&local)?;
        self.host.begin(&mut self.link, &local, &shape)?;
        // What the step's first query sees of the share (its window, from the share's
        // first position on).
        let start = step
            .spec
            .window_start(step.pos)
            .saturating_sub(base)
            .min(pos);
        let hist = pos - start;
        let stored = store.len();
        let widest = self.host.widest_history(pos, hist);
        self.ensure_buffers(&shape, widest + stored, pos + stored)?;
        let gs = self.stream.group();
        let groups = shape.n_kv_heads / gs;
        let q_per_group = gs * step.spec.group_size();
        let at = StepAt::new(pos, stored, shape.n_layers, false);
        let act = shape.activation_bytes(t);
        let reserve = self.plan.scratch_bytes(&shape, gs, widest + stored);
        // `auto`'s resident units hold the share's positions from its first, as the host
        // tier does.
        let resident_at = UnitAt {
            q_pos: step.pos,
            keep_from: start,
            base,
            spec: step.spec,
        };
        let mut parts = Vec::with_capacity(groups);
        for g in 0..groups {
            let kg = kn.narrow(1, g * gs, gs)?.contiguous()?;
            let vg = vn.narrow(1, g * gs, gs)?.contiguous()?;
            let q = step.q.narrow(1, g * q_per_group, q_per_group)?;
            let unit = UnitId {
                layer,
                group: g,
                groups,
            };
            let resident = (&q, &kg, &vg);
            if let Some(part) =
                self.attend_resident(unit, resident, &resident_at, (reserve, act), keep)?
            {
                parts.push(part);
                continue;
            }
            parts.push(self.attend_streamed(StreamedUnit {
                layer,
                group: g,
                groups,
                q: &q,
                new: (&kg, &vg),
                history: TokenRange::new(start, hist),
                at,
                q_pos: step.pos,
                k_pos: base + start,
                spec: step.spec,
                act,
                keep,
            })?);
        }
        self.host.advance(layer, stored);
        if parts.len() == 1 {
            return Ok(parts.swap_remove(0));
        }
        let outs: Vec<&Tensor> = parts.iter().map(|p| &p.out).collect();
        let lses: Vec<&Tensor> = parts.iter().map(|p| &p.lse).collect();
        Ok(Partial {
            out: Tensor::cat(&outs, 1)?,
            lse: Tensor::cat(&lses, 1)?,
            scratch_bytes: parts.iter().map(|p| p.scratch_bytes).max().unwrap_or(0),
        })
    }
}

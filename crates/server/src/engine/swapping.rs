//! The engine's side of preemption by swapping ([`crate::swap`]; vLLM's swap preemption,
//! PagedAttention SOSP '23 §4.5): a preempted request's K/V written out before its cache is
//! freed, and appended back into its new slot when it is admitted again — under the prefix
//! cache's recording while its prompt is not in yet, so the chunks it stores at the end are
//! whole.
use kvpolicy::models::layer_specs;
use kvpolicy::prefix::{restore_kv, Placement};

use super::{Active, Engine};
use crate::swap::{PreemptionMode, Swapped};

impl Engine {
    /// Writes slot `seq`'s K/V (request `a`, being preempted) to the swap space; how it is
    /// preempted: by recomputation without a swap space, when the policy cannot hand its
    /// K/V back exactly, or when the write fails (said on stderr).
    pub(super) fn swap_out(&mut self, seq: usize, a: &mut Active) -> PreemptionMode {
        let Some(space) = self.swap.as_mut() else {
            return PreemptionMode::Recompute;
        };
        if a.pos == 0 {
            // Nothing to write.
            return PreemptionMode::Swap;
        }
        let layers = self.model.info().kv_layers();
        match space.swap_out(self.policy.as_mut(), seq, layers, a.pos) {
            Ok(Some(s)) => {
                a.swapped = Some(s);
                PreemptionMode::Swap
            }
            Ok(None) => PreemptionMode::Recompute,
            Err(e) => {
                eprintln!("swap: {e:#}; the request is recomputed instead");
                PreemptionMode::Recompute
            }
        }
    }

    /// Appends request `a`'s swapped K/V `s` into slot `seq`, after the `restored` positions
    /// the prefix cache gave it, and sets where it goes on (where it stopped, or past it when
    /// the cache now holds more of its prompt).
    pub(super) fn swap_in(
        &mut self,
        seq: usize,
        a: &mut Active,
        s: Swapped,
        restored: usize,
    ) -> anyhow::Result<()> {
        let n = s.tokens;
        let specs = layer_specs(self.model.info());
        // In the pieces its prefill ran in (the buffers they need fit: it was admitted), one
        // piece of every layer read at a time.
        let piece = self.cfg.prefill_chunk.max(1);
        // Its prompt was in: what it recorded was taken then (and `restored` stays what that
        // recording started from); nothing read back is recorded.
        let prompt_in = n >= a.job.prompt.len();
        if prompt_in {
            if let Some(r) = self.reuse.as_mut() {
                r.forget(seq);
            }
        }
        let mut from = restored;
        while from < n {
            let len = piece.min(n - from);
            let part = s.piece(from, len)?;
            let at = Placement {
                seq,
                pos: from,
                piece: 0,
            };
            match self.reuse.as_mut().filter(|_| !prompt_in) {
                Some(r) => {
                    r.recording(self.policy.as_mut(), |p| restore_kv(p, &part, at, &specs))?
                }
                None => restore_kv(self.policy.as_mut(), &part, at, &specs)?,
            }
            from += len;
        }
        drop(s);
        if !prompt_in {
            a.restored = restored;
        }
        a.pos = n.max(restored);
        Ok(())
    }
}

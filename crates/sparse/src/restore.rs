//! The page-selecting policies taking K/V computed elsewhere ([`KvRestore`]: a restored
//! session or a shared prefix) where `attend` puts them, without attention; a prefix shared
//! with other live sequences is held by reference on the host tier (SGLang HiCache's
//! host-memory L2; PagedAttention SOSP '23 §4.3's shared blocks), and the device side —
//! sinks, window, page summaries (Quest §3) — is each sequence's own. Still APPROXIMATE:
//! what a head attends is its selection, as after a prefill.
use kvpolicy_core::{AttnStep, KvLease, KvRestore, PoolTier, Result, SharedRun};

use crate::layers::LayerState;
use crate::policy::SparsePolicy;
use crate::selector::Selector;

/// K/V stored where `attend` puts them, without attention: no query, so the selector sees
/// none of them until the next prefill chunk or decode step.
impl<S: Selector> KvRestore for SparsePolicy<S> {
    fn append_kv(&mut self, step: &AttnStep<'_>) -> Result<()> {
        self.restore(step, None)
    }

    fn attaches_kv(&mut self, _seq: usize) -> bool {
        self.attaches()
    }

    /// Streamed from the host tier.
    fn attach_tier(&mut self) -> Option<PoolTier> {
        self.attaches().then_some(PoolTier::Host)
    }

    fn attach_kv(&mut self, step: &AttnStep<'_>, lease: &KvLease) -> Result<()> {
        self.restore(step, Some(lease))
    }

    /// A global layer's host copy of the prefix given up for the stored runs.
    fn adopt_kv(&mut self, _seq: usize, layer: usize, runs: &[SharedRun<'_>]) -> Result<bool> {
        let global = self.layers.get(layer).is_some_and(LayerState::global);
        if !global || !self.attaches() {
            return Ok(false);
        }
        self.host.adopt(&mut self.link, layer, runs)
    }
}

impl<S: Selector> SparsePolicy<S> {
    /// [`KvRestore::append_kv`], holding the K/V by reference when `lease` comes with them.
    fn restore(&mut self, step: &AttnStep<'_>, lease: Option<&KvLease>) -> Result<()> {
        let shape = self.host.shape_for(step)?;
        let ps = self.page_shape(step)?;
        self.store(step, &shape, lease)?;
        self.note_device(0);
        let end = step.pos + step.k.dim(2)?;
        self.layers[step.layer].trim(&self.pages, end, false, &ps)?;
        self.note_device(0);
        if step.layer == 0 || end > self.len {
            self.len = end;
        }
        Ok(())
    }
}

//! K/V given to a policy without attention ([`KvRestore`](crate::KvRestore)): a restored session, a shared
//! prefix, a synthetic history. [`append_kv`] calls it on any policy, and says clearly when
//! the policy stores something else; [`adopt_kv`] and [`export_kv`] call the rest of the
//! capability on any policy, doing nothing where it has none.
use crate::error::Result;
use crate::policy::KvPolicy;
use crate::step::AttnStep;

/// Stores `step`'s K/V in `policy` without attention ([`KvRestore::append_kv`](crate::KvRestore::append_kv)), or fails
/// naming the policy when it does not take K/V that way.
pub fn append_kv(policy: &mut dyn KvPolicy, step: &AttnStep<'_>) -> Result<()> {
    let name = policy.name().to_string();
    policy
        .as_restore()
        .ok_or_else(|| not_restorable(&name, step.layer))?
        .append_kv(step)
}

/// Keeps `step`'s K/V — shared with other sequences, held under `lease` — in `policy`
/// without attention ([`KvRestore::attach_kv`](crate::KvRestore::attach_kv): by reference
/// where it can, else a copy), or fails naming the policy when it does not take K/V that
/// way.
pub fn attach_kv(
    policy: &mut dyn KvPolicy,
    step: &AttnStep<'_>,
    lease: &crate::lease::KvLease,
) -> Result<()> {
    let name = policy.name().to_string();
    policy
        .as_restore()
        .ok_or_else(|| not_restorable(&name, step.layer))?
        .attach_kv(step, lease)
}

/// Whether sequence `seq` of `policy` holds `runs` of `layer` by reference instead of its
/// copy ([`KvRestore::adopt_kv`](crate::KvRestore::adopt_kv)); `false` for a policy that
/// takes no K/V without attention.
pub fn adopt_kv(
    policy: &mut dyn KvPolicy,
    seq: usize,
    layer: usize,
    runs: &[crate::lease::SharedRun<'_>],
) -> Result<bool> {
    match policy.as_restore() {
        Some(r) => r.adopt_kv(seq, layer, runs),
        None => Ok(false),
    }
}

/// Sequence `seq`'s K/V of `layer` handed back by `policy`
/// ([`KvRestore::export_kv`](crate::KvRestore::export_kv)); `None` for a policy that takes
/// no K/V without attention.
pub fn export_kv(
    policy: &mut dyn KvPolicy,
    seq: usize,
    layer: usize,
) -> Result<Option<crate::capabilities::LayerKv>> {
    match policy.as_restore() {
        Some(r) => r.export_kv(seq, layer),
        None => Ok(None),
    }
}

/// The error for `append_kv` on `policy`, which takes no K/V without attention.
pub(crate) fn not_restorable(policy: &str, layer: usize) -> crate::error::KvError {
    crate::error::KvError::Unsupported(format!(
        "`{policy}` does not take K/V without computing attention (append_kv; layer {layer}); \
         `full`, `layer`, `headwise` and `auto` do"
    ))
}

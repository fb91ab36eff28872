//! A request's side of the prefix cache: [`restore_prefix`] finds the longest run of cached
//! chunks at the start of a prompt and stores their K/V in the policy with
//! [`append_kv`], layer by layer, chunk by chunk, where a prefill
//! would have put them; [`store_new`] adds the chunks a prefill computed
//! ([`Capture`](crate::Capture)). The prefill that follows starts at the first position not
//! restored and gives the logits of a fresh run.
use std::time::Instant;

use candle_core::Tensor;
use kvpolicy_core::{append_kv, attach_kv, AttnStep, KvPolicy, NoRegen, SharedRun};

use crate::cache::{PrefixCache, Tier};
use crate::chunk::ChunkKv;
use crate::error::Result;
pub use crate::layers::LayerSpecs;
use crate::ram::Leased;

/// What one request got from the cache or a session.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Reuse {
    /// Prompt tokens restored (not prefilled).
    pub tokens: usize,
    /// Of those, from host RAM.
    pub from_ram: usize,
    /// Of those, from files.
    pub from_disk: usize,
    /// Of those, from a loaded session.
    pub from_session: usize,
    /// Seconds spent finding and restoring them.
    pub seconds: f64,
}

/// What [`restore_prefix`] restored.
#[derive(Debug, Default)]
pub struct Restored {
    /// The counts.
    pub reuse: Reuse,
    /// The K/V restored, in order from position 0 (a saved session holds them too).
    pub chunks: Vec<ChunkKv>,
}

/// Where restored K/V go in a policy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Placement {
    /// The sequence (a batched policy's request slot; 0 for one request).
    pub seq: usize,
    /// The position of the first token.
    pub pos: usize,
    /// Tokens per `append_kv` step (0: one step).
    pub piece: usize,
}

/// How [`restore_prefix`] may resume a prefill.
pub struct Resume<'a> {
    /// Whether a prefill can resume at a position (restoring fewer chunks otherwise).
    pub usable: &'a dyn Fn(usize) -> bool,
    /// Tokens per `append_kv` step.
    pub piece: usize,
    /// The sequence the K/V go to.
    pub seq: usize,
}

/// Stores `kv` in `policy` where `at` says, in steps of at most `at.piece` tokens, layer by
/// layer as a prefill would.
pub fn restore_kv(
    policy: &mut dyn KvPolicy,
    kv: &ChunkKv,
    at: Placement,
    layers: &LayerSpecs,
) -> Result<()> {
    let Placement { seq, pos, piece } = at;
    let tokens = kv.shape()?.tokens;
    let piece = if piece == 0 { tokens.max(1) } else { piece };
    let mut at = 0;
    while at < tokens {
        let n = piece.min(tokens - at);
        let part = kv.narrow(at, n)?;
        let x = Tensor::zeros((1, n, layers.hidden), layers.dtype, &layers.device)?;
        for (layer, (l, spec)) in part.layers.iter().zip(&layers.specs).enumerate() {
            let k = l.k.to_device(&layers.device)?.contiguous()?;
            let v = l.v.to_device(&layers.device)?.contiguous()?;
            append_kv(
                policy,
                &AttnStep {
                    layer,
                    seq,
                    // Not read by `append_kv`.
                    q: &k,
                    k: &k,
                    v: &v,
                    x: &x,
                    pos: pos + at,
                    spec,
                    regen: &NoRegen,
                },
            )?;
        }
        at += n;
    }
    Ok(())
}

/// Gives `policy` the chunk `held` (held in the cache's RAM) at `at.pos`, layer by layer,
/// with [`attach_kv`]: a policy that can keeps it by reference, and its lease.
fn attach_chunk(
    policy: &mut dyn KvPolicy,
    held: &Leased,
    at: Placement,
    layers: &LayerSpecs,
) -> Result<()> {
    let tokens = held.kv.shape()?.tokens;
    let x = Tensor::zeros((1, tokens, layers.hidden), layers.dtype, &layers.device)?;
    for (layer, (l, spec)) in held.kv.layers.iter().zip(&layers.specs).enumerate() {
        let step = AttnStep {
            layer,
            seq: at.seq,
            // Not read.
            q: &l.k,
            k: &l.k,
            v: &l.v,
            x: &x,
            pos: at.pos,
            spec,
            regen: &NoRegen,
        };
        attach_kv(policy, &step, &held.lease)?;
    }
    Ok(())
}

/// After sequence `seq` of `policy` computed `prompt` and its chunks were stored
/// ([`store_new`]): the sequence holds the prompt's chunks that the cache keeps in RAM by
/// reference instead of its own copy ([`adopt_kv`](kvpolicy_core::KvRestore::adopt_kv)), so that it and the
/// requests that restore them hold them once. Returns the chunks adopted (0 when the policy
/// keeps its copy).
pub fn adopt_prefix(
    cache: &PrefixCache,
    policy: &mut dyn KvPolicy,
    seq: usize,
    prompt: &[u32],
) -> Result<usize> {
    if !cache.shares_by_reference() {
        return Ok(0);
    }
    let c = cache.chunk_tokens();
    let keys = cache.keys(&prompt[..prompt.len() / c * c]);
    let held = keys
        .iter()
        .map_while(|k| cache.leased(k))
        .collect::<Vec<_>>();
    let Some(restore) = policy.as_restore().filter(|_| !held.is_empty()) else {
        return Ok(0);
    };
    let mut adopted = false;
    let n_layers = held[0].kv.layers.len();
    for layer in 0..n_layers {
        let runs = held
            .iter()
            .enumerate()
            .map(|(i, h)| SharedRun {
                k: &h.kv.layers[layer].k,
                v: &h.kv.layers[layer].v,
                pos: i * c,
                lease: &h.lease,
            })
            .collect::<Vec<_>>();
        adopted |= restore.adopt_kv(seq, layer, &runs)?;
    }
    Ok(if adopted { held.len() } else { 0 })
}

/// Restores into `policy` (prepared, holding nothing) the longest cached run of `prompt`'s
/// chunks from its start that `usable` accepts (the tokens restored; the prefill must be
/// able to resume there), leaving at least one token to prefill (the last position's
/// logits come from the prefill). A chunk of another shape than the model's (`layers` and
/// the cache's chunk size) is a miss, and its file removed.
/// Chunks are appended `piece` tokens at a time (joined first): a policy's buffers then
/// grow as often as a prefill in passes of `piece` makes them, not once per chunk.
pub fn restore_prefix(
    cache: &mut PrefixCache,
    policy: &mut dyn KvPolicy,
    prompt: &[u32],
    layers: &LayerSpecs,
    resume: Resume<'_>,
) -> Result<Restored> {
    let Resume { usable, piece, seq } = resume;
    let start = Instant::now();
    let c = cache.chunk_tokens();
    let whole = prompt.len().saturating_sub(1) / c;
    let keys = cache.keys(&prompt[..whole * c]);
    let lookup = tracing::info_span!("prefix_lookup", chunks = keys.len()).entered();
    // A chunk of another shape than the model's is a miss (its file removed).
    cache.expect_layers(layers);
    let mut found: Vec<(ChunkKv, Tier)> = Vec::new();
    for (i, key) in keys.iter().enumerate() {
        let Some((chunk, tier)) = cache.get_after(&keys[..i], key)? else {
            break;
        };
        found.push((chunk, tier));
    }
    // The prompt's first chunks the most recently used: evicted after its later ones.
    cache.touch_chain(&keys[..found.len()]);
    let take = (0..=found.len())
        .rev()
        .find(|&n| usable(n * c))
        .unwrap_or(0);
    found.truncate(take);
    drop(lookup);
    let _append = tracing::info_span!("prefix_append", chunks = take).entered();
    let mut out = Restored::default();
    for (chunk, tier) in found {
        out.chunks.push(chunk);
        match tier {
            Tier::Ram => out.reuse.from_ram += c,
            Tier::Disk => out.reuse.from_disk += c,
        }
    }
    if cache.shares_by_reference() && policy.as_restore().is_some_and(|r| r.attaches_kv(seq)) {
        // Held by reference where the chunk is in RAM (leased there while the sequence
        // reads it); copied where it came from a file and RAM could not keep it.
        for (i, chunk) in out.chunks.iter().enumerate() {
            let at = Placement {
                seq,
                pos: out.reuse.tokens,
                piece,
            };
            match cache.leased(&keys[i]) {
                Some(l) => attach_chunk(policy, &l, at, layers)?,
                None => restore_kv(policy, chunk, at, layers)?,
            }
            out.reuse.tokens += c;
        }
    } else {
        restore_copies(
            policy,
            &mut out,
            Placement { seq, pos: 0, piece },
            layers,
            c,
        )?;
    }
    out.reuse.seconds = start.elapsed().as_secs_f64();
    let per_tier = out.reuse.seconds / out.reuse.tokens.max(1) as f64;
    for (tier, tokens) in [
        (Tier::Ram, out.reuse.from_ram),
        (Tier::Disk, out.reuse.from_disk),
    ] {
        cache.count_restored(tier, tokens, per_tier * tokens as f64);
    }
    Ok(out)
}

/// Copies `out.chunks` into `policy` (a policy that keeps no K/V by reference), joined into
/// `at.piece` tokens per `append_kv` step: its buffers then grow as often as a prefill in
/// passes of that size makes them, not once per chunk. Counts the tokens in `out.reuse`.
fn restore_copies(
    policy: &mut dyn KvPolicy,
    out: &mut Restored,
    at: Placement,
    layers: &LayerSpecs,
    c: usize,
) -> Result<()> {
    let Placement { seq, piece, .. } = at;
    let per_piece = (piece / c).max(1);
    for group in out.chunks.chunks(per_piece) {
        let joined = match group {
            [one] => one.clone(),
            many => ChunkKv::cat(many)?
                .ok_or_else(|| crate::error::PrefixError::Invalid("no chunks to join".into()))?,
        };
        let at = Placement {
            seq,
            pos: out.reuse.tokens,
            piece,
        };
        restore_kv(policy, &joined, at, layers)?;
        out.reuse.tokens += group.len() * c;
    }
    Ok(())
}

/// Stores the whole chunks of `kv` — the K/V of `prompt[from..]` as a run computed them —
/// under their keys, skipping those already held (in RAM or as a file), in order, none
/// evicting the prompt's chunks before it; it stops at the first that fits nowhere, so that
/// a budget smaller than the prompt keeps its first chunks, which a restore can use. Chunks start at multiples of the
/// chunk size: when `from` is not one (after a session), the chunk it falls in is left out.
/// Returns how many were kept (in RAM or a file).
pub fn store_new(
    cache: &mut PrefixCache,
    prompt: &[u32],
    from: usize,
    kv: &ChunkKv,
) -> Result<usize> {
    let c = cache.chunk_tokens();
    let first = from.div_ceil(c);
    let computed = kv.shape()?.tokens.min(prompt.len().saturating_sub(from));
    let Some(skip) = (first * c).checked_sub(from).filter(|&s| s <= computed) else {
        return Ok(0);
    };
    let chunks = kv.narrow(0, computed)?.split(skip, c)?;
    let keys = cache.keys(prompt);
    let mut stored = 0;
    let mut end = first.min(keys.len());
    for (i, chunk) in (first..keys.len()).zip(chunks) {
        // A chunk that fits nowhere without evicting the ones before it is not kept; those
        // after it could never be restored (a restore stops at the first missing chunk).
        if !cache.contains(&keys[i]) {
            if !cache.put_after(&keys[..i], keys[i], chunk)? {
                break;
            }
            stored += 1;
        }
        end = i + 1;
    }
    cache.touch_chain(&keys[..end]);
    Ok(stored)
}

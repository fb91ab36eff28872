//! Generation that reuses K/V across requests (issue "KV reuse across requests"):
//! [`generate_reusing`] restores the prompt's longest cached prefix from a
//! [`PrefixCache`] — or a loaded [`Session`]'s history, the prompt continuing it — into the
//! policy with `append_kv`, prefills only the rest, keeping its K/V on the way
//! ([`Capture`]), stores the new whole chunks, decodes as
//! [`generate`](super::generate::generate) does, and hands back the run as a session to
//! save when asked. The logits equal a fresh run's: the cache and the session hold exactly
//! the K/V a prefill computes.
use std::time::Instant;

use kvpolicy_core::{AttnSpec, KvPolicy};
use kvpolicy_prefix::{
    restore_kv, restore_prefix, store_new, Capture, ChunkKv, Fingerprint, LayerSpecs, Placement,
    PrefixCache, Resume, Reuse, Session,
};

use crate::engine::generate::{
    begin, chunk_len, decode_phase, prefill_phase, EmitTokens, GenerateConfig, Generation,
};
use crate::error::{ModelError, Result};
use crate::model::{CausalLm, ModelInfo};

/// What a policy taking restored K/V needs to know of `info`'s layers.
pub fn layer_specs(info: &ModelInfo) -> LayerSpecs {
    let windows = info.kv_windows();
    let specs = (0..info.kv_layers())
        .map(|layer| {
            let mut spec = AttnSpec::new(info.n_heads, info.n_kv_heads, info.head_dim);
            spec.sliding_window = windows.get(layer).copied().flatten();
            spec
        })
        .collect();
    LayerSpecs {
        specs,
        hidden: info.hidden,
        device: info.device.clone(),
        dtype: info.dtype,
    }
}

/// Whether a prefill of `len` tokens in passes of `chunk` can resume at `from` and compute
/// every token as a fresh one would: the pass `from` falls in, cut short, takes the same
/// kernel as the whole pass ([`ModelInfo::row_split`]). Restoring less than is cached (down
/// to a position where it can) costs a few more tokens of prefill, never exactness.
pub fn resumable(info: &ModelInfo, from: usize, len: usize, chunk: usize) -> bool {
    let Some(split) = info.row_split else {
        return true;
    };
    let pass = chunk_len(chunk, len);
    let begin = from / pass * pass;
    let end = (begin + pass).min(len);
    from == begin || ((end - from >= split) == (end - begin >= split))
}

/// Where a request's K/V may come from and go to.
#[derive(Default)]
pub struct ReuseSources<'a> {
    /// The prefix cache: looked up (unless a session is given) and stored into.
    pub cache: Option<&'a mut PrefixCache>,
    /// A loaded session: its ids come before the prompt, its K/V are restored.
    pub session: Option<Session>,
    /// Hand back the run (ids and every token's K/V) as a session, with this fingerprint.
    pub save_session: Option<Fingerprint>,
}

/// A generation served through a prefix cache or a session.
#[derive(Debug)]
pub struct CachedGeneration {
    /// The generation ([`Generation::prompt_ids`] starts with a loaded session's ids;
    /// [`Generation::prefill_tokens`] counts the tokens prefilled, not those restored;
    /// [`Generation::prefill_s`] includes the restore).
    pub generation: Generation,
    /// What came from the cache or the session.
    pub reuse: Reuse,
    /// Chunks this request added to the cache.
    pub stored: usize,
    /// The run as a session, when asked for.
    pub session: Option<Session>,
}

/// [`generate`](super::generate::generate) with K/V reused across requests: the prompt
/// continues `src.session`'s ids when one is given (its K/V restored), else its longest
/// cached prefix is restored from `src.cache`; only the rest is prefilled, and the new whole
/// chunks go to the cache once the generation is done (the first token does not wait for
/// them). Restoring needs a policy that takes K/V without attention (`append_kv`: `full`,
/// `layer`, `headwise`, `auto`), and restored positions have no logits (`collect_logits`
/// then needs `decode_logits_only`); saving a session alone needs neither.
///
/// With a cache, a model whose numbers for a token depend on the pass it shares
/// ([`ModelInfo::row_split`]: GGUF on the CPU) prefills in passes of one cache chunk at
/// most, so that every stored chunk was computed exactly as any later prompt's fresh
/// prefill in such passes computes it: the logits then equal a fresh run with that
/// `prefill_chunk`, bit for bit, whatever prompt stored the chunks.
pub fn generate_reusing(
    model: &dyn CausalLm,
    policy: &mut dyn KvPolicy,
    prompt: &[u32],
    cfg: &GenerateConfig,
    src: ReuseSources<'_>,
    on_token: &mut dyn FnMut(u32) -> Result<()>,
) -> Result<CachedGeneration> {
    let ReuseSources {
        mut cache,
        session,
        save_session,
    } = src;
    let restoring = cache.is_some() || session.is_some();
    if restoring && cfg.collect_logits && !cfg.decode_logits_only {
        return Err(ModelError::Input(
            "a prompt restored from the prefix cache or a session has no logits for its restored positions; keep only the rows that predict generated tokens (decode_logits_only)"
                .into(),
        ));
    }
    if restoring && policy.as_restore().is_none() {
        return Err(ModelError::Input(
            format!(
                "the prefix cache and sessions restore K/V with append_kv, which `{}` does not take; use full, layer, headwise or auto",
                policy.name()
            )
            .into(),
        ));
    }
    let ids: Vec<u32> = match &session {
        Some(s) => s.ids.iter().chain(prompt).copied().collect(),
        None => prompt.to_vec(),
    };
    // Prepared for, and restored in, steps of the prefill chunk asked for (a policy's
    // buffers then grow as often as that prefill would make them); the passes may be
    // smaller.
    begin(model, policy, &ids, cfg)?;
    let piece = chunk_len(cfg.prefill_chunk, ids.len());
    let mut cfg = cfg.clone();
    if let (Some(c), Some(_)) = (cache.as_deref(), model.info().row_split) {
        cfg.prefill_chunk = piece.min(c.chunk_tokens());
    }
    let cfg = &cfg;
    let layers = layer_specs(model.info());
    let (reuse, restored) = match (&session, cache.as_deref_mut()) {
        (Some(s), _) => {
            let start = Instant::now();
            // The whole history: its reply tokens were computed one per decode step, so no
            // fresh prefill reproduces them anyway; restoring less would only recompute
            // tokens it has (with the numbers of yet another pass).
            let n = s.kv_tokens()?.min(ids.len() - 1);
            let kv = s.kv.narrow(0, n)?;
            let at = Placement {
                seq: 0,
                pos: 0,
                piece,
            };
            restore_kv(policy, &kv, at, &layers)?;
            let reuse = Reuse {
                tokens: n,
                from_session: n,
                seconds: start.elapsed().as_secs_f64(),
                ..Reuse::default()
            };
            (reuse, vec![kv])
        }
        (None, Some(c)) => {
            let usable = |from| resumable(model.info(), from, ids.len(), cfg.prefill_chunk);
            let resume = Resume {
                usable: &usable,
                piece,
                seq: 0,
            };
            let r = restore_prefix(c, policy, &ids, &layers, resume)?;
            (r.reuse, r.chunks)
        }
        (None, None) => (Reuse::default(), Vec::new()),
    };
    // What a session needs besides what this run computes; nothing otherwise.
    let restored = if save_session.is_some() {
        restored
    } else {
        Vec::new()
    };
    let mut capture = Capture::new(policy, reuse.tokens);
    capture.keeping(cache.is_some() || save_session.is_some());
    let mut prefilled = prefill_phase(model, &mut capture, &ids, reuse.tokens, cfg)?;
    prefilled.seconds += reuse.seconds;
    let computed = if cache.is_some() { capture.kv()? } else { None };
    if save_session.is_none() {
        capture.clear();
    }
    capture.keeping(save_session.is_some());
    let emit = EmitTokens {
        settle: &mut Ok,
        on_token,
    };
    let generation = decode_phase(model, &mut capture, &ids, cfg, prefilled, emit)?;
    let stored = match (cache, computed) {
        (Some(c), Some(kv)) => store_new(c, &ids, reuse.tokens, &kv)?,
        _ => 0,
    };
    let session = match save_session {
        Some(fingerprint) => {
            let mut parts = restored;
            parts.extend(capture.kv()?);
            let kv = ChunkKv::cat(&parts)?.ok_or_else(|| {
                ModelError::Input("a session of no tokens cannot be saved".into())
            })?;
            let mut all = ids;
            all.extend(&generation.generated_ids);
            Some(Session {
                fingerprint,
                ids: all,
                kv,
            })
        }
        None => None,
    };
    Ok(CachedGeneration {
        generation,
        reuse,
        stored,
        session,
    })
}

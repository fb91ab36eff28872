//! KV reuse across requests in the runner (issue "KV reuse across requests", item 4):
//! `--prefix-cache DIR`, `--prefix-cache-ram SIZE`, `--prefix-cache-disk SIZE`,
//! `--prefix-cache-chunk N`, `--save-session FILE`, `--load-session FILE`. Opens the cache
//! and the session for the loaded model's fingerprint, runs one prompt — or a prompts
//! file's prompts one after another, each reusing what the earlier ones stored — through
//! `generate_reusing`, and reports what came from where (the summary, `--stats-out`'s
//! `prefix_cache`).
use std::io::Write;

use anyhow::{bail, Context, Result};
use kvpolicy::models::{
    fingerprint, generate_reusing, CachedGeneration, GenerateConfig, ModelFiles, ReuseSources,
    TextTokenizer,
};
use kvpolicy::prefix::{Fingerprint, PrefixCache, PrefixStats, Reuse, Session};
use kvpolicy::{CausalLm, KvPolicy};
use serde::Serialize;

use crate::args::Args;

/// Whether any reuse flag is given.
pub fn wanted(args: &Args) -> bool {
    args.prefix.wanted() || args.save_session.is_some() || args.load_session.is_some()
}

/// The flag that asks to restore K/V (`None`: nothing is restored; a session may be saved).
fn restoring_flag(args: &Args) -> Option<&'static str> {
    if args.load_session.is_some() {
        Some("--load-session")
    } else {
        args.prefix.flag()
    }
}

/// Flag combinations reuse cannot serve, refused before the model loads.
pub fn check_flags(args: &Args) -> Result<()> {
    if let Some(flag) = restoring_flag(args) {
        if args.dump_logits.is_some() && !args.decode_logits_only {
            bail!(
                "--dump-logits with {flag} needs --decode-logits-only: positions restored from a cache or a session are not computed, so they have no logits"
            );
        }
    }
    args.prefix.check()
}

/// Refuses a policy that takes no K/V without attention, when K/V are to be restored.
pub fn check_policy(args: &Args, policy: &mut dyn KvPolicy) -> Result<()> {
    match restoring_flag(args) {
        Some(flag) => refuse_unrestorable(policy, flag),
        None => Ok(()),
    }
}

/// Refuses `policy` when it takes no K/V without attention; `flag` asked for a restore.
pub fn refuse_unrestorable(policy: &mut dyn KvPolicy, flag: &str) -> Result<()> {
    if policy.as_restore().is_none() {
        bail!(
            "`{}` cannot take restored K/V ({flag}): only full, layer, headwise, auto and the APPROXIMATE quest, flexicache and clo store K/V without attention; pick one of them",
            policy.name()
        );
    }
    Ok(())
}

/// The cache and session of a run, for one model.
pub struct Reusing {
    fingerprint: Fingerprint,
    cache: Option<PrefixCache>,
    session: Option<Session>,
}

impl Reusing {
    /// Fingerprints the model, opens the cache (its directory created if needed) and loads
    /// the session.
    pub fn open(args: &Args, files: &ModelFiles, model: &dyn CausalLm) -> Result<Self> {
        let fingerprint = fingerprint(files, model.info())?;
        let cache = args.prefix.open(fingerprint)?;
        let session = match &args.load_session {
            Some(path) => Some(Session::load(path, &fingerprint).context("--load-session")?),
            None => None,
        };
        Ok(Self {
            fingerprint,
            cache,
            session,
        })
    }

    /// Generates `prompt` (continuing the loaded session, the first time) through the cache.
    pub fn generate(
        &mut self,
        args: &Args,
        model: &dyn CausalLm,
        policy: &mut dyn KvPolicy,
        prompt: &[u32],
        cfg: &GenerateConfig,
        on_token: &mut dyn FnMut(u32) -> kvpolicy::models::Result<()>,
    ) -> Result<CachedGeneration> {
        let src = ReuseSources {
            cache: self.cache.as_mut(),
            session: self.session.take(),
            save_session: args.save_session.as_ref().map(|_| self.fingerprint),
        };
        Ok(generate_reusing(model, policy, prompt, cfg, src, on_token)?)
    }

    /// The cache's counters (none without a cache).
    pub fn cache_stats(&self) -> Option<PrefixStats> {
        self.cache.as_ref().map(PrefixCache::stats)
    }
}

/// One request's reuse, as `--stats-out` writes it.
#[derive(Serialize, Clone, Copy, Debug, Default)]
pub struct RequestReuse {
    /// Prompt tokens restored instead of prefilled.
    pub restored_tokens: usize,
    /// Of those, from the cache's host RAM.
    pub from_ram_tokens: usize,
    /// Of those, from the cache's files.
    pub from_disk_tokens: usize,
    /// Of those, from the loaded session.
    pub from_session_tokens: usize,
    /// Seconds spent finding and restoring them (inside `prefill_s`).
    pub restore_s: f64,
    /// Chunks this request added to the cache.
    pub stored_chunks: usize,
    /// Prompt tokens prefilled (not restored).
    pub prefill_tokens: usize,
    /// Seconds to the first token: the restore and the prefill.
    pub prefill_s: f64,
}

impl RequestReuse {
    /// What `gen` reused.
    pub fn of(gen: &CachedGeneration) -> Self {
        let r: Reuse = gen.reuse;
        Self {
            restored_tokens: r.tokens,
            from_ram_tokens: r.from_ram,
            from_disk_tokens: r.from_disk,
            from_session_tokens: r.from_session,
            restore_s: r.seconds,
            stored_chunks: gen.stored,
            prefill_tokens: gen.generation.prefill_tokens,
            prefill_s: gen.generation.prefill_s,
        }
    }
}

/// `--stats-out`'s `prefix_cache`: the requests' reuse and the cache's counters.
#[derive(Serialize, Debug)]
pub struct PrefixOut {
    /// Per request, in input order.
    pub requests: Vec<RequestReuse>,
    /// Chunks found.
    pub hits: u64,
    /// Chunk lookups that found nothing.
    pub misses: u64,
    /// Chunks stored.
    pub stored_chunks: u64,
    /// K/V bytes held in host RAM at the end (never above `--prefix-cache-ram`).
    pub ram_bytes: u64,
    /// Bytes of the chunk files known at the end (never above `--prefix-cache-disk`).
    pub disk_bytes: u64,
    /// Chunks evicted from host RAM.
    pub ram_evictions: u64,
    /// Chunk files removed to stay within the disk budget.
    pub disk_evictions: u64,
    /// Chunk files that failed their checks (removed; misses).
    pub damaged_files: u64,
    /// Chunk files that could not be written.
    pub write_errors: u64,
    /// Tokens restored from host RAM, over every request.
    pub tokens_from_ram: u64,
    /// Tokens restored from files, over every request.
    pub tokens_from_disk: u64,
    /// Seconds spent restoring from the cache, over every request.
    pub restore_s: f64,
}

impl PrefixOut {
    /// The output for `requests` and the cache's final counters.
    pub fn new(requests: Vec<RequestReuse>, cache: Option<PrefixStats>) -> Self {
        let c = cache.unwrap_or_default();
        Self {
            requests,
            hits: c.hits,
            misses: c.misses,
            stored_chunks: c.stored,
            ram_bytes: c.ram_bytes,
            disk_bytes: c.disk_bytes,
            ram_evictions: c.ram_evictions,
            disk_evictions: c.disk_evictions,
            damaged_files: c.damaged,
            write_errors: c.write_errors,
            tokens_from_ram: c.tokens_from_ram,
            tokens_from_disk: c.tokens_from_disk,
            restore_s: c.restore_s,
        }
    }
}

/// The summary's line for one request.
pub fn summary(req: &RequestReuse, cache: Option<&PrefixStats>) -> String {
    let mut line = format!(
        "reuse: {} prompt tokens restored in {:.3}s (RAM {}, disk {}, session {}), {} prefilled; {} chunks stored",
        req.restored_tokens,
        req.restore_s,
        req.from_ram_tokens,
        req.from_disk_tokens,
        req.from_session_tokens,
        req.prefill_tokens,
        req.stored_chunks
    );
    if let Some(c) = cache {
        line += &format!(
            "; cache holds {} in RAM, {} on disk ({} + {} evicted, {} damaged files)",
            kvpolicy::core::format_bytes(c.ram_bytes),
            kvpolicy::core::format_bytes(c.disk_bytes),
            c.ram_evictions,
            c.disk_evictions,
            c.damaged
        );
    }
    line
}

/// `--prompts-file` with a prefix cache: the prompts one after another under `policy`
/// (reset between them), each restoring what the earlier ones stored; prints each
/// completion as `[i] text` and returns the generations.
pub fn run_prompts(
    args: &Args,
    reusing: &mut Reusing,
    model: &dyn CausalLm,
    tok: Option<&TextTokenizer>,
    policy: &mut dyn KvPolicy,
    prompts: &[Vec<u32>],
) -> Result<Vec<CachedGeneration>> {
    let cfg = args.generate_config();
    let mut out = Vec::with_capacity(prompts.len());
    let mut stdout = std::io::stdout().lock();
    let mut open = true;
    for (i, ids) in prompts.iter().enumerate() {
        policy.reset();
        let gen = reusing.generate(args, model, policy, ids, &cfg, &mut |_| Ok(()))?;
        let g = &gen.generation.generated_ids;
        let text = match tok {
            Some(t) => t.decode(g)?,
            None => g.iter().map(u32::to_string).collect::<Vec<_>>().join(" "),
        };
        // A closed stdout ends the text, not the run.
        open = open && writeln!(stdout, "[{}] {}", i + 1, text.replace('\n', "\\n")).is_ok();
        let _ = writeln!(
            std::io::stderr(),
            "[{}] {}",
            i + 1,
            summary(&RequestReuse::of(&gen), None)
        );
        out.push(gen);
    }
    Ok(out)
}

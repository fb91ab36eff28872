//! One measurement: a policy variant at one context length — prefill tok/s, decode tok/s,
//! device/host KV bytes and bytes moved per decoded token.
use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::{Device, Tensor};
use kvpolicy::core::PolicyMetric;
use kvpolicy::models::engine::generate::kv_shape;
use kvpolicy::models::prefill;
use kvpolicy::{CausalLm, LogitsMode, PolicyOptions, PolicySpec, Profile};

/// A policy with its settings and options, as named on the command line (`headwise:1`,
/// `recompute:split=64`, `sinks:sinks=4,window=256`).
#[derive(Clone, Debug)]
pub struct Variant {
    /// The spec as given.
    pub label: String,
    /// The spec, parsed.
    pub spec: PolicySpec,
    /// The shared options.
    pub opts: PolicyOptions,
}

impl Variant {
    /// Parses a spec over the shared options, building it once so that an unknown policy,
    /// setting or value fails before any model work.
    pub fn parse(label: &str, base: &PolicyOptions) -> Result<Self> {
        let spec = PolicySpec::parse(label)?;
        kvpolicy_cli::registry::registry().build_spec(&spec, base)?;
        Ok(Self {
            label: label.to_string(),
            spec,
            opts: base.clone(),
        })
    }

    /// A fresh policy for one run.
    pub fn build(&self) -> Result<Box<dyn kvpolicy::KvPolicy>> {
        Ok(kvpolicy_cli::registry::registry().build_spec(&self.spec, &self.opts)?)
    }
}

/// `--policies` as clap splits it at every comma, with the settings of one spec joined
/// back (`sinks:sinks=4`, `window=256` → `sinks:sinks=4,window=256`): a piece with `=`
/// and no `:` continues the spec before it, which must have settings of its own.
pub fn join_specs(pieces: &[String]) -> Result<Vec<String>> {
    let mut specs: Vec<String> = Vec::new();
    for p in pieces {
        if !p.contains('=') || p.contains(':') {
            specs.push(p.clone());
            continue;
        }
        match specs.last_mut() {
            Some(last) if last.contains(':') => {
                last.push(',');
                last.push_str(p);
            }
            Some(last) => anyhow::bail!(
                "--policies: `{p}` follows `{last}`, which has no settings; write {last}:{p}"
            ),
            None => anyhow::bail!("--policies: `{p}` names no policy; write NAME:{p}"),
        }
    }
    Ok(specs)
}

/// What one variant measured at one context.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Row {
    /// Tokens cached before the timed decode steps.
    pub context: usize,
    /// Variant label (or `stock`).
    pub policy: String,
    /// Prefill tokens per second.
    pub prefill_tok_s: f64,
    /// Decode tokens per second (median over repeats).
    pub decode_tok_s: f64,
    /// Highest device-tier KV bytes.
    pub device_kv_peak_bytes: u64,
    /// Host-tier KV bytes at the end.
    pub host_kv_bytes: u64,
    /// Host→device bytes per decoded token.
    pub h2d_bytes_per_token: u64,
    /// Device→host bytes per decoded token.
    pub d2h_bytes_per_token: u64,
    /// The policy's own metrics at the end (`split`, `resident_units`, …): CSV columns.
    #[serde(skip)]
    pub metrics: Vec<PolicyMetric>,
    /// Seconds per decoded token the transfer engine spent copying (overlapped or not).
    pub copy_s_per_token: f64,
    /// The link's busy seconds over the decode's seconds (0 without a link): how close the
    /// decode is to the link's bound.
    pub link_utilization: f64,
    /// The profile the policy planned with, if any.
    #[serde(skip)]
    pub profile: Option<Profile>,
    /// Bytes of the disk tier's files at the end (`--disk-dir`).
    #[serde(skip)]
    pub disk_kv_bytes: u64,
    /// Disk-tier bytes read per decoded token.
    #[serde(skip)]
    pub disk_read_bytes_per_token: u64,
    /// Seconds per decoded token the compute thread waited on the disk tier.
    #[serde(skip)]
    pub disk_wait_s_per_token: f64,
    /// Whether the disk tier read past the page cache (O_DIRECT).
    #[serde(skip)]
    pub disk_direct_io: bool,
    /// Whether the policy is LOSSY (approximate, or a smaller stored dtype): its logits
    /// differ from `full`'s.
    pub lossy: bool,
}

impl Row {
    /// A peer implementation's row (candle's stock model, llama.cpp): speeds only.
    pub fn peer(context: usize, name: &str, prefill_tok_s: f64, decode_tok_s: f64) -> Self {
        Self {
            context,
            policy: name.into(),
            prefill_tok_s,
            decode_tok_s,
            device_kv_peak_bytes: 0,
            host_kv_bytes: 0,
            h2d_bytes_per_token: 0,
            d2h_bytes_per_token: 0,
            metrics: Vec::new(),
            copy_s_per_token: 0.0,
            link_utilization: 0.0,
            profile: None,
            disk_kv_bytes: 0,
            disk_read_bytes_per_token: 0,
            disk_wait_s_per_token: 0.0,
            disk_direct_io: false,
            lossy: false,
        }
    }
}

/// Deterministic prompt ids.
pub fn ids(n: usize, offset: usize, vocab: usize) -> Vec<u32> {
    // Every u32 is a valid id of a vocabulary past u32's range (never 0: ids are `% vocab`).
    let vocab = u32::try_from(vocab).unwrap_or(u32::MAX).max(1);
    (0..n)
        .map(|i| ((i + offset) as u32 * 7919 + 13) % vocab)
        .collect()
}

/// How each measurement runs.
#[derive(Clone, Copy, Debug)]
pub struct Timing {
    /// Timed decode steps.
    pub steps: usize,
    /// Runs (the median is reported).
    pub repeats: usize,
    /// Tokens per prefill (or fill) step.
    pub chunk: usize,
    /// Fill with random K/V through `append_kv` instead of a prefill.
    pub synthetic: bool,
}

/// Prefills `context` tokens under `v` and times `steps` decode steps, `repeats` times.
pub fn measure(
    model: &dyn CausalLm,
    v: &Variant,
    context: usize,
    how: Timing,
    tick: &mut dyn FnMut(),
) -> Result<Row> {
    let Timing {
        steps,
        repeats,
        chunk,
        synthetic,
    } = how;
    let dev: &Device = &model.info().device;
    let vocab = model.info().vocab_size;
    let prompt = ids(context, 0, vocab);
    let mut prefill_rates = Vec::new();
    let mut rates = Vec::new();
    let mut last = None;
    let mut decode_s = 0.0;
    for _ in 0..repeats.max(1) {
        let mut p = v.build()?;
        // As `generate` does: the policy plans for the run's length (`auto` sizes its
        // resident units for it).
        p.prepare(&kv_shape(model.info(), 1, context + steps, chunk))?;
        let t = Instant::now();
        if synthetic {
            crate::synthetic::fill(model, p.as_mut(), context, chunk)?;
            crate::synthetic::settle()?;
        } else {
            prefill(model, p.as_mut(), &prompt, chunk, false)?;
        }
        dev.synchronize()?;
        prefill_rates.push(context as f64 / t.elapsed().as_secs_f64());
        let before = p.stats();
        let t = Instant::now();
        for (i, &tok) in ids(steps, context, vocab).iter().enumerate() {
            let x = Tensor::new(&[tok], dev)?.unsqueeze(0)?;
            model.forward(&x, context + i, p.as_mut(), LogitsMode::Last)?;
        }
        dev.synchronize()?;
        decode_s = t.elapsed().as_secs_f64();
        rates.push(steps as f64 / decode_s);
        last = Some((
            before,
            p.stats(),
            p.as_profiled().and_then(|x| x.profile()).cloned(),
        ));
        tick();
    }
    let (before, after, profile) = last.context("no run")?;
    let per = |a: u64, b: u64| (a - b) / steps.max(1) as u64;
    Ok(Row {
        context,
        policy: v.label.clone(),
        prefill_tok_s: median(prefill_rates),
        decode_tok_s: median(rates),
        device_kv_peak_bytes: after.device_kv_peak_bytes,
        host_kv_bytes: after.host_kv_bytes,
        h2d_bytes_per_token: per(after.h2d_bytes, before.h2d_bytes),
        d2h_bytes_per_token: per(after.d2h_bytes, before.d2h_bytes),
        metrics: after.policy_metrics.clone(),
        copy_s_per_token: (after.copy_s - before.copy_s) / steps.max(1) as f64,
        link_utilization: (after.link_busy_s - before.link_busy_s) / decode_s.max(1e-9),
        profile,
        disk_kv_bytes: after.disk_kv_bytes,
        disk_read_bytes_per_token: per(after.disk_read_bytes, before.disk_read_bytes),
        disk_wait_s_per_token: (after.disk_wait_s - before.disk_wait_s) / steps.max(1) as f64,
        disk_direct_io: after.disk_direct_io,
        lossy: after.lossy,
    })
}

/// The median (the upper one for an even count).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

//! Measuring a [`Profile`] on the device (KVPR §3.3, HybridServe §4.3): host→device
//! copies through the policy's own transfer engine, and one layer regenerating K/V, timed.
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use kvpolicy_core::{KvRegen, Profile, Result};

use crate::transfer::{CopyJob, TransferEngine};

/// What the profiler measures with.
#[derive(Clone, Debug)]
pub struct Probe<'a> {
    /// The device tier.
    pub device: &'a Device,
    /// Sequences per step.
    pub batch: usize,
    /// Width of a layer input.
    pub hidden: usize,
    /// Activation dtype.
    pub dtype: DType,
    /// Bytes per transfer probe (e.g. one layer's K/V at the run's length).
    pub transfer_bytes: usize,
    /// Tokens per recompute probe.
    pub tokens: usize,
    /// The simulated link, if any (part of the cache key).
    pub link: Option<f64>,
}

/// Measures both rates on `probe.device`: copies of `probe.transfer_bytes` through
/// `engine`, and `regen` over `probe.tokens` tokens (one warm-up, median of three).
pub fn measure(
    probe: &Probe<'_>,
    engine: &mut dyn TransferEngine,
    regen: &dyn KvRegen,
) -> Result<Profile> {
    let dev = probe.device;
    let n = probe.transfer_bytes.max(1);
    // From a host-tier buffer of the engine, as the policies copy (page-locked on CUDA).
    let src = engine.host_zeros(n.into(), DType::U8)?;
    let dst = Tensor::zeros(n, DType::U8, dev)?;
    let mut rates = Vec::new();
    for i in 0..4 {
        let start = Instant::now();
        let t = engine.submit(vec![CopyJob {
            src: src.clone(),
            dst: dst.clone(),
            dim: 0,
            offset: 0,
        }])?;
        engine.wait(t)?;
        dev.synchronize()?;
        if i > 0 {
            rates.push(n as f64 / start.elapsed().as_secs_f64().max(1e-9));
        }
    }
    engine.host_release(&src)?;
    let h2d = median(rates);
    let tokens = probe.tokens.max(1);
    let x = Tensor::zeros((probe.batch, tokens, probe.hidden), probe.dtype, dev)?;
    let mut rates = Vec::new();
    for i in 0..4 {
        let start = Instant::now();
        let (k, v) = regen.regen(&x, 0)?;
        drop((k, v));
        dev.synchronize()?;
        if i > 0 {
            rates.push(tokens as f64 / start.elapsed().as_secs_f64().max(1e-9));
        }
    }
    let p = Profile {
        h2d_bytes_per_s: h2d,
        recompute_tokens_per_s: median(rates),
        device: Some(format!("{:?}", dev.location())),
        shape: Some(format!(
            "batch {} hidden {} {:?}, {} flops/token",
            probe.batch,
            probe.hidden,
            probe.dtype,
            regen.flops_per_token()
        )),
    };
    p.validate("measured on this device")?;
    Ok(p)
}

/// [`measure`], once per process for each device, layer shape, link and probe size.
pub fn measure_cached(
    probe: &Probe<'_>,
    engine: &mut dyn TransferEngine,
    regen: &dyn KvRegen,
) -> Result<Profile> {
    static CACHE: OnceLock<Mutex<HashMap<String, Profile>>> = OnceLock::new();
    let key = format!(
        "{:?}|{}|{}|{:?}|{}|{:?}|{}|{}",
        probe.device.location(),
        probe.batch,
        probe.hidden,
        probe.dtype,
        regen.flops_per_token(),
        probe.link,
        probe.transfer_bytes,
        probe.tokens
    );
    let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
    if let Some(p) = cache.lock().ok().and_then(|c| c.get(&key).cloned()) {
        return Ok(p);
    }
    let p = measure(probe, engine, regen)?;
    if let Ok(mut c) = cache.lock() {
        c.insert(key, p.clone());
    }
    Ok(p)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

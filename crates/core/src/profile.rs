//! The cost profile the schedulers plan with (KVPR §3.3, HybridServe §4.3): host→device
//! bandwidth for the transfer sizes in play and the rate at which one layer regenerates K/V
//! from stored activations.
//!
//! A [`Profile`] is either measured on the actual device at the first step
//! ([`Profile::measure`], cached per device and layer shape for the life of the process) or
//! read from a JSON file (a `profile` file, `--profile FILE` in the examples), so that schedules are reproducible and
//! testable:
//!
//! ```json
//! {"h2d_bytes_per_s": 2.5e10, "recompute_tokens_per_s": 1.0e6}
//! ```
use std::collections::HashMap;
use std::path::Path;
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};

use crate::error::{KvError, Result};
use crate::regen::KvRegen;
use crate::transfer::{CopyJob, TransferEngine};

/// Measured (or given) rates of one device for one layer shape.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    /// Host→device bandwidth in bytes per second.
    pub h2d_bytes_per_s: f64,
    /// Tokens (per sequence) whose K and V one layer regenerates per second.
    pub recompute_tokens_per_s: f64,
    /// What it was measured on (informational).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    /// The layer shape it was measured for (informational).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shape: Option<String>,
}

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

fn bad(origin: &str, reason: impl Into<String>) -> KvError {
    KvError::BadProfile {
        origin: origin.to_string(),
        reason: reason.into(),
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

impl Profile {
    /// Checks that both rates are positive and finite; `origin` names the source in errors.
    pub fn validate(&self, origin: &str) -> Result<()> {
        for (name, v) in [
            ("h2d_bytes_per_s", self.h2d_bytes_per_s),
            ("recompute_tokens_per_s", self.recompute_tokens_per_s),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(bad(
                    origin,
                    format!("`{name}` is {v}; it must be a positive number"),
                ));
            }
        }
        Ok(())
    }

    /// Parses and validates a JSON profile.
    pub fn from_json(text: &str, origin: &str) -> Result<Self> {
        let p: Profile = serde_json::from_str(text).map_err(|e| bad(origin, e.to_string()))?;
        p.validate(origin)?;
        Ok(p)
    }

    /// Reads and validates a JSON profile file.
    pub fn load(path: &Path) -> Result<Self> {
        let origin = path.display().to_string();
        // A profile is a few numbers: 1 MiB is far more than one holds.
        let text = crate::userfile::read_text_capped(path, "the profile", 1 << 20)
            .map_err(|e| bad(&origin, e.to_string()))?;
        Self::from_json(&text, &origin)
    }

    /// The profile as pretty JSON (what [`Profile::load`] reads).
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default()
    }

    /// Seconds to move `bytes` host→device.
    pub fn transfer_s(&self, bytes: f64) -> f64 {
        bytes / self.h2d_bytes_per_s
    }

    /// Seconds one layer needs to regenerate K/V of `tokens` tokens.
    pub fn recompute_s(&self, tokens: f64) -> f64 {
        tokens / self.recompute_tokens_per_s
    }

    /// Measures both rates on `probe.device`: copies of `probe.transfer_bytes` through
    /// `engine`, and `regen` over `probe.tokens` tokens (one warm-up, median of three).
    pub fn measure(
        probe: &Probe<'_>,
        engine: &mut dyn TransferEngine,
        regen: &dyn KvRegen,
    ) -> Result<Self> {
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

    /// [`Profile::measure`], once per process for each device, layer shape, link and probe size.
    pub fn measure_cached(
        probe: &Probe<'_>,
        engine: &mut dyn TransferEngine,
        regen: &dyn KvRegen,
    ) -> Result<Self> {
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
        let p = Self::measure(probe, engine, regen)?;
        if let Ok(mut c) = cache.lock() {
            c.insert(key, p.clone());
        }
        Ok(p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_rejects() {
        let p = Profile::from_json(
            r#"{"h2d_bytes_per_s": 1e9, "recompute_tokens_per_s": 5e4}"#,
            "t",
        );
        assert!(matches!(p, Ok(ref p) if p.h2d_bytes_per_s == 1e9));
        for (text, needle) in [
            (
                r#"{"h2d_bytes_per_s": 0, "recompute_tokens_per_s": 5}"#,
                "h2d_bytes_per_s",
            ),
            (
                r#"{"h2d_bytes_per_s": 1, "recompute_tokens_per_s": -5}"#,
                "recompute_tokens_per_s",
            ),
            (r#"{"h2d_bytes_per_s": 1}"#, "missing field"),
            (r#"{"h2d_bytes_per_s": 1, "recompute": 2}"#, "unknown field"),
            ("not json", "expected"),
        ] {
            let e = Profile::from_json(text, "f.json")
                .err()
                .map(|e| e.to_string());
            let e = e.unwrap_or_default();
            assert!(e.contains(needle) && e.contains("f.json"), "{text}: {e}");
        }
    }
}

//! What a policy reports: device-tier bytes now and at peak, host-tier bytes, bytes moved
//! each way, recompute work and time spent ([`KvStats`], what every policy has), and the
//! numbers only one policy counts ([`PolicyMetric`]s it owns: `auto`'s resident units,
//! `hybrid`'s blocks, `sinks`' evicted tokens). Memory numbers are deterministic (they
//! count allocated buffer bytes), so tests assert them exactly; times are for reports only.
use serde::Serialize;

use crate::error::{Advice, KvError};
use crate::pool::KvPool;
use std::sync::Arc;

/// Whether a metric is a current value or accumulates since the last `reset`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum MetricKind {
    /// A current value (units resident now).
    Gauge,
    /// A running total (tokens evicted so far).
    Counter,
}

/// A number one policy counts: a name, a value, a unit, and whether it is a gauge or a
/// counter. Shown in the runner's summary, in its stats file under `"policy_metrics"` and
/// as kvbench columns. Summed over the sequences of a batch ([`crate::PerSequence`]):
/// counters always, gauges of the live sequences.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PolicyMetric {
    /// Its name (`resident_units`, `evicted_tokens`), unique within a policy.
    #[serde(skip)]
    pub name: &'static str,
    /// Its value (whole numbers are written as integers).
    #[serde(serialize_with = "whole_as_integer")]
    pub value: f64,
    /// What it counts (`tokens`, `units`, `blocks`, `bytes`).
    pub unit: &'static str,
    /// Gauge or counter.
    pub kind: MetricKind,
}

impl PolicyMetric {
    /// A current value.
    pub fn gauge(name: &'static str, value: f64, unit: &'static str) -> Self {
        Self {
            name,
            value,
            unit,
            kind: MetricKind::Gauge,
        }
    }

    /// A running total.
    pub fn counter(name: &'static str, value: f64, unit: &'static str) -> Self {
        Self {
            name,
            value,
            unit,
            kind: MetricKind::Counter,
        }
    }
}

/// Writes a whole value as an integer (`10`, not `10.0`), any other as a float.
fn whole_as_integer<S: serde::Serializer>(v: &f64, s: S) -> Result<S::Ok, S::Error> {
    if v.fract() == 0.0 && v.abs() < 9.0e15 {
        s.serialize_i64(*v as i64)
    } else {
        s.serialize_f64(*v)
    }
}

/// Writes the metrics as a map from their names.
fn metrics_by_name<S: serde::Serializer>(m: &[PolicyMetric], s: S) -> Result<S::Ok, S::Error> {
    s.collect_map(m.iter().map(|x| (x.name, x)))
}

/// Counters every policy keeps; every field is cumulative (or a peak) since the last
/// `reset` except `device_kv_bytes`, `host_kv_bytes`, `disk_kv_bytes`, `kv_tokens` and
/// `sequences`, which are current values. What only one policy counts is in `policy_metrics`.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct KvStats {
    /// Bytes of KV (or activation) buffers held on the device tier now.
    pub device_kv_bytes: u64,
    /// Highest value `device_kv_bytes` reached, transient growth copies included.
    pub device_kv_peak_bytes: u64,
    /// Most bytes one attention call held as scratch (score tiles, running results), as the
    /// attention counted them; bounded by the tiles, not by the context.
    pub attn_scratch_peak_bytes: u64,
    /// Most device bytes a step held besides the KV: its attention scratch plus the model's
    /// activations for the step's tokens ([`crate::KvShape::activation_bytes_per_token`]).
    pub device_scratch_peak_bytes: u64,
    /// Bytes of KV (or activation) buffers held on the host tier now.
    pub host_kv_bytes: u64,
    /// Bytes of host-tier buffers page-locked for asynchronous copies (CUDA engine; 0 on
    /// CPU).
    pub host_pinned_bytes: u64,
    /// Bytes copied host→device. A copy made ahead for the next step (offload's staging) is
    /// counted in the step that uses it, so each step's count is what that step needed;
    /// one dropped unused is counted when dropped, and units staged for a step that never
    /// comes (a sampled run stopped early at an end-of-sequence token) are not counted.
    pub h2d_bytes: u64,
    /// Bytes copied device→host.
    pub d2h_bytes: u64,
    /// Floating-point operations spent regenerating K/V from stored activations.
    pub recompute_flops: u64,
    /// Tokens whose K/V were regenerated rather than transferred (summed over layers,
    /// steps and sequences).
    pub recompute_tokens: u64,
    /// Tokens cached per layer.
    pub kv_tokens: u64,
    /// Of those, tokens held by reference (a prefix shared with other sequences, whose
    /// bytes its owner counts: not in `device_kv_bytes`), in the first layer.
    pub shared_kv_tokens: u64,
    /// Seconds spent waiting for transfers that compute could not hide (host waits; on CUDA
    /// the compute stream waits on the device instead, so this stays near 0 there).
    pub transfer_wait_s: f64,
    /// Seconds the transfer engine spent copying (its worker or copy stream busy, overlapped
    /// with compute or not): with the step time, the overlap.
    pub copy_s: f64,
    /// Seconds the host↔device link was busy: the copies' time, or on a simulated link each
    /// batch's wire time (bytes ÷ bandwidth) with its copy inside. Over a decode's seconds,
    /// how close the run is to the link's bound (HeadInfer §3.2: decode time = transfer time).
    pub link_busy_s: f64,
    /// Sequences holding a cache in a batched run (0 for single-sequence runs).
    pub sequences: u64,
    /// Bytes of the disk tier's files (K/V past the host budget).
    pub disk_kv_bytes: u64,
    /// Bytes read from the disk tier.
    pub disk_read_bytes: u64,
    /// Bytes written to the disk tier.
    pub disk_write_bytes: u64,
    /// Seconds the compute thread spent on disk reads and writes (waiting for a read-ahead
    /// included).
    pub disk_wait_s: f64,
    /// Whether the disk tier reads past the page cache (`O_DIRECT`; see `DiskIo`).
    pub disk_direct_io: bool,
    /// Whether the cache is stored LOSSILY (a host dtype smaller than the model's): the
    /// logits then differ from `full`'s by the measured tolerance, not the exact one.
    pub lossy: bool,
    /// What only this policy counts, by name.
    #[serde(serialize_with = "metrics_by_name")]
    pub policy_metrics: Vec<PolicyMetric>,
}

impl KvStats {
    /// The value of the policy metric `name`, if the policy reports one.
    pub fn metric(&self, name: &str) -> Option<f64> {
        self.policy_metrics
            .iter()
            .find(|m| m.name == name)
            .map(|m| m.value)
    }

    /// Sets `metric`, replacing one of the same name.
    pub fn set_metric(&mut self, metric: PolicyMetric) {
        match self
            .policy_metrics
            .iter_mut()
            .find(|m| m.name == metric.name)
        {
            Some(m) => *m = metric,
            None => self.policy_metrics.push(metric),
        }
    }

    /// Adds `other`'s metrics to these: counters always, gauges when `live` (a retired
    /// sequence's gauges no longer hold). For sums over sequences.
    pub fn add_metrics(&mut self, other: &[PolicyMetric], live: bool) {
        for m in other {
            if m.kind == MetricKind::Gauge && !live {
                continue;
            }
            match self.policy_metrics.iter_mut().find(|x| x.name == m.name) {
                Some(x) => x.value += m.value,
                None => self.policy_metrics.push(m.clone()),
            }
        }
    }

    /// Records one attention call's scratch and the step's activation bytes.
    pub fn note_scratch(&mut self, attention: u64, activations: u64) {
        self.attn_scratch_peak_bytes = self.attn_scratch_peak_bytes.max(attention);
        self.device_scratch_peak_bytes =
            self.device_scratch_peak_bytes.max(attention + activations);
    }
}

/// How much a [`DeviceMeter::exceeded`] allocation needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Need {
    /// The whole of what the device must hold (a plan checked before the run).
    Total(u64),
    /// Bytes on top of what the meter holds now (a buffer growing).
    More(u64),
}

/// Tracks the device tier's current and peak bytes against an optional budget and, when
/// it joined one ([`Self::for_options`]), the device ledger of a [`KvPool`] shared with
/// other sequences: [`Self::fits`] then also asks the pool, and what the meter holds is on
/// the pool's books until it is freed, reset or dropped.
#[derive(Debug, Default)]
pub struct DeviceMeter {
    current: u64,
    peak: u64,
    budget: Option<u64>,
    pool: Option<Arc<KvPool>>,
}

impl DeviceMeter {
    /// A meter with an optional byte budget.
    pub fn new(budget: Option<u64>) -> Self {
        Self {
            current: 0,
            peak: 0,
            budget,
            pool: None,
        }
    }

    /// The meter `opts` ask for: `device_kv_budget`, and the shared pool when
    /// [`PolicyOptions::pool`](crate::options::PolicyOptions::pool) gives one.
    pub fn for_options(opts: &crate::options::PolicyOptions) -> Self {
        Self {
            pool: opts.pool.clone(),
            ..Self::new(opts.device_kv_budget)
        }
    }

    /// The budget, if any.
    pub fn budget(&self) -> Option<u64> {
        self.budget
    }

    /// What a policy may plan to hold by choice (resident units that could stream): the
    /// budget, or with a shared pool this sequence's share of it
    /// ([`KvPool::device_share`]).
    pub fn plannable(&self) -> Option<u64> {
        match &self.pool {
            Some(p) if p.device.budget().is_some() => p.device_share(self.current),
            _ => self.budget,
        }
    }

    /// Bytes held now.
    pub fn current(&self) -> u64 {
        self.current
    }

    /// Highest bytes held.
    pub fn peak(&self) -> u64 {
        self.peak
    }

    /// Whether `extra` more bytes would stay within the budget (and the shared pool's).
    pub fn fits(&self, extra: u64) -> bool {
        self.budget.is_none_or(|b| self.current + extra <= b)
            && self.pool.as_ref().is_none_or(|p| p.device.fits(extra))
    }

    /// Records an allocation of `bytes`.
    pub fn alloc(&mut self, bytes: u64) {
        self.set(self.current + bytes);
    }

    /// Records a release of `bytes`.
    pub fn free(&mut self, bytes: u64) {
        let now = self.current.saturating_sub(bytes);
        if let Some(p) = &self.pool {
            p.device.change(self.current, now);
        }
        self.current = now;
    }

    /// Records that `bytes` are held now (for tiers whose size is read off their pools).
    pub fn set(&mut self, bytes: u64) {
        if let Some(p) = &self.pool {
            p.device.change(self.current, bytes);
        }
        self.current = bytes;
        self.peak = self.peak.max(bytes);
    }

    /// The [`KvError::BudgetExceeded`] for `what`, which needs `need` against this meter's
    /// budget: `note` says why it cannot be made smaller here (may be empty), `advice` what
    /// the user can change, best first. The one way a policy builds a budget error.
    pub fn exceeded(
        &self,
        what: impl Into<String>,
        need: Need,
        note: &'static str,
        advice: Vec<Advice>,
    ) -> KvError {
        let (needed, in_use) = match need {
            Need::Total(bytes) => (bytes, 0),
            // With a shared pool, what every sequence holds.
            Need::More(bytes) => (
                bytes,
                self.pool.as_ref().map_or(self.current, |p| p.device.used()),
            ),
        };
        KvError::BudgetExceeded {
            what: what.into(),
            needed,
            budget: self.budget.unwrap_or(0),
            in_use,
            note,
            advice,
        }
    }

    /// Forgets everything held (the peak too).
    pub fn reset(&mut self) {
        self.free(self.current);
        self.peak = 0;
    }
}

impl Drop for DeviceMeter {
    /// What the meter held leaves the shared pool's books with it.
    fn drop(&mut self) {
        self.free(self.current);
    }
}

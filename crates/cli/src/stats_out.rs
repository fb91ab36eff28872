//! What `--stats-out` writes: the policy's stats (its metrics under `policy_metrics`), the
//! run's timings and the process's peak memory.
use kvpolicy::KvStats;
use serde::Serialize;

/// What --stats-out writes.
#[derive(Serialize)]
pub struct StatsOut<'a> {
    /// The policy's stats, flattened into the top level.
    #[serde(flatten)]
    pub stats: KvStats,
    /// The policy's name.
    pub policy: &'a str,
    /// Where the model came from.
    pub model: &'a str,
    /// Prompt tokens.
    pub prefill_tokens: usize,
    /// Seconds of prefill.
    pub prefill_s: f64,
    /// Decode steps.
    pub decode_tokens: usize,
    /// Seconds of decode.
    pub decode_s: f64,
    /// Peak resident memory of the process (Linux `VmHWM`), measured at the end of the run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peak_rss_bytes: Option<u64>,
    /// Stats after every step (batch mode).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub steps: Option<Vec<KvStats>>,
}

/// The process's peak resident memory from `/proc/self/status` (`VmHWM`), where there is one.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

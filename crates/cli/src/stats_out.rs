//! What `--stats-out` writes: the policy's stats (its metrics under `policy_metrics`), the
//! run's timings, the link's share of decode time and the process's peak memory.
use kvpolicy::models::Generation;
use kvpolicy::KvStats;
use serde::Serialize;

/// The host↔device link during decode: what it moved, how long it was busy, and that time's
/// share of the decode's seconds — how close decode is to the link's bound (HeadInfer §3.2:
/// decode time is the transfer time). From the stats at the end of prefill and at the end.
#[derive(Serialize, Clone, Copy, Debug, PartialEq)]
pub struct DecodeLink {
    /// Bytes moved over the link, both ways, during decode.
    pub decode_link_bytes: u64,
    /// Seconds the link was busy during decode.
    pub decode_link_busy_s: f64,
    /// `decode_link_busy_s` ÷ the decode's seconds.
    pub link_utilization: f64,
}

impl DecodeLink {
    /// The link during `gen`'s decode, whose final stats are `end`; `None` without decode
    /// steps or stats at the end of prefill (ragged batches), or for a policy with no link.
    pub fn of(gen: &Generation, end: &KvStats) -> Option<Self> {
        let start = gen.prefill_stats.as_ref()?;
        if gen.decode_tokens == 0 || gen.decode_s <= 0.0 || end.link_busy_s <= 0.0 {
            return None;
        }
        let moved = |s: &KvStats| s.h2d_bytes + s.d2h_bytes;
        let busy = (end.link_busy_s - start.link_busy_s).max(0.0);
        Some(Self {
            decode_link_bytes: moved(end).saturating_sub(moved(start)),
            decode_link_busy_s: busy,
            link_utilization: busy / gen.decode_s,
        })
    }
}

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
    /// The LOSSY conversion the model's files declare (`kvpolicy-compress`), if any; `lossy`
    /// is then true whatever the policy.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model_conversion: Option<&'a str>,
    /// Prompt tokens.
    pub prefill_tokens: usize,
    /// Seconds of prefill.
    pub prefill_s: f64,
    /// Decode steps.
    pub decode_tokens: usize,
    /// Seconds of decode.
    pub decode_s: f64,
    /// The link during decode (absent without one, or in batch mode).
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub link: Option<DecodeLink>,
    /// Peak resident memory of the process (Linux `VmHWM`), measured at the end of the run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peak_rss_bytes: Option<u64>,
    /// Stats after every step (batch mode).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub steps: Option<Vec<KvStats>>,
    /// What came from the prefix cache or a session (with those flags).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefix_cache: Option<crate::reuse::PrefixOut>,
    /// Every rank's share and KV (`helix` under `mpirun`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ranks: Option<Vec<crate::ranks::RankKv>>,
}

/// The process's peak resident memory from `/proc/self/status` (`VmHWM`), where there is one.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

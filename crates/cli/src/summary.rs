//! The run's summary on stderr: throughput, device KV and scratch peaks, recompute, bytes
//! moved each way and per token, the link's busy share of decode, the disk tier, the policy's own metrics (`auto`'s
//! resident units, `sinks`' evicted tokens), and whether the run was lossy.
use std::io::Write;

use kvpolicy::models::Generation;
use kvpolicy::KvStats;

use crate::stats_out::DecodeLink;

/// The policy's metrics as `name value unit` items.
pub fn metrics_text(stats: &KvStats) -> String {
    let items: Vec<String> = stats
        .policy_metrics
        .iter()
        .map(|m| format!("{} {} {}", m.name, m.value, m.unit))
        .collect();
    items.join(", ")
}

/// Prints the summary of `gen` under `policy` with its final `stats`; `smaller`: the flag
/// that stores K/V in a smaller dtype (`--kv-dtype`, `--host-kv-dtype`), if given.
pub fn print(gen: &Generation, stats: &KvStats, policy: &str, smaller: Option<&str>) {
    let _ = writeln!(
        std::io::stderr(),
        "{} prompt tokens in {:.2}s ({:.1} tok/s); {} decode steps in {:.2}s ({:.1} tok/s); policy {}; device KV peak {}; step scratch peak {}; recomputed {} tokens",
        gen.prefill_tokens,
        gen.prefill_s,
        gen.prefill_tokens as f64 / gen.prefill_s.max(1e-9),
        gen.decode_tokens,
        gen.decode_s,
        gen.decode_tokens as f64 / gen.decode_s.max(1e-9),
        policy,
        kvpolicy::core::format_bytes(stats.device_kv_peak_bytes),
        kvpolicy::core::format_bytes(stats.device_scratch_peak_bytes),
        stats.recompute_tokens,
    );
    let tokens = (gen.prefill_tokens + gen.decode_tokens).max(1) as u64;
    let mut moved = format!(
        "moved {} host→device ({} per token), {} device→host",
        kvpolicy::core::format_bytes(stats.h2d_bytes),
        kvpolicy::core::format_bytes(stats.h2d_bytes / tokens),
        kvpolicy::core::format_bytes(stats.d2h_bytes),
    );
    if let Some(l) = DecodeLink::of(gen, stats) {
        moved += &format!(
            "; link busy {:.2}s of {:.2}s decode ({:.0}%)",
            l.decode_link_busy_s,
            gen.decode_s,
            100.0 * l.link_utilization
        );
    }
    if stats.disk_kv_bytes > 0 {
        moved += &format!(
            "; disk tier {} (read {}, wrote {}, {:.2}s; {} reads)",
            kvpolicy::core::format_bytes(stats.disk_kv_bytes),
            kvpolicy::core::format_bytes(stats.disk_read_bytes),
            kvpolicy::core::format_bytes(stats.disk_write_bytes),
            stats.disk_wait_s,
            if stats.disk_direct_io {
                "direct"
            } else {
                "buffered"
            }
        );
    }
    if !stats.policy_metrics.is_empty() {
        moved += &format!("; {policy}: {}", metrics_text(stats));
    }
    if stats.lossy {
        moved += &match smaller {
            Some(flag) => {
                format!("; LOSSY: K/V stored in the smaller {flag}, logits differ from full")
            }
            None => "; LOSSY: an approximate policy, logits differ from full".into(),
        };
    }
    let _ = writeln!(std::io::stderr(), "{moved}");
}

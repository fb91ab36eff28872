//! A warning about a flag that makes a run crawl: a simulated link so slow that one decode
//! step takes minutes. (Flags the chosen policy does not read are warned of in `flags`.)
use kvpolicy::{ModelInfo, PolicyOption};

use crate::args::Args;

/// Seconds below which a simulated step is not worth a warning.
const SLOW_STEP_S: f64 = 60.0;

/// A warning when `--link-bandwidth` makes one decode step take minutes: an offload
/// policy may move the whole cache (`context` tokens of every layer's K and V) each step.
pub fn slow_link(info: &ModelInfo, bandwidth: u64, context: usize) -> Option<String> {
    let per_token = [
        info.kv_layers(),
        info.n_kv_heads,
        info.head_dim,
        info.dtype.size_in_bytes(),
    ]
    .iter()
    .fold(2u64, |acc, &x| acc.saturating_mul(x as u64));
    let bytes = per_token.saturating_mul(context as u64);
    let step_s = bytes as f64 / bandwidth.max(1) as f64;
    (step_s >= SLOW_STEP_S).then(|| {
        format!(
            "warning: --link-bandwidth {}/s makes a decode step at {context} tokens take up to {} (the cache is {}); raise it, e.g. 25GB for PCIe 4.0",
            kvpolicy::core::format_bytes(bandwidth),
            human_seconds(step_s),
            kvpolicy::core::format_bytes(bytes),
        )
    })
}

fn human_seconds(s: f64) -> String {
    match s {
        s if s < 3600.0 => format!("{:.0} minutes", s / 60.0),
        s if s < 86400.0 * 2.0 => format!("{:.1} hours", s / 3600.0),
        s => format!("{:.0} days", s / 86400.0),
    }
}

/// Prints a warning when `--link-bandwidth` would make a decode step of a prompt of
/// `longest` tokens take minutes under a policy that reads it.
pub fn warn_slow_link(args: &Args, info: &ModelInfo, longest: usize) {
    let reads = crate::registry::registry()
        .reads(args.kv.policy_name())
        .unwrap_or(&[]);
    if let (Some(bandwidth), true) = (
        args.kv.link_bandwidth,
        reads.contains(&PolicyOption::LinkBandwidth),
    ) {
        let context = longest
            .saturating_add(args.max_new_tokens)
            .min(info.max_positions);
        if let Some(w) = slow_link(info, bandwidth, context) {
            eprintln!("{w}");
        }
    }
}

//! Warnings about flags that change nothing or make a run crawl: a policy flag the chosen
//! policy does not read (`--head-group` with `full`, `--block-size` with `layer`), and a
//! simulated link so slow that one decode step takes minutes.
use clap::parser::ValueSource;
use clap::ArgMatches;
use kvpolicy::{ModelInfo, PolicyOption};

/// The policy flags given on the command line (not defaults) that `policy` does not read,
/// each with the message to print. An unknown policy gives none (building it fails later
/// with the list of names).
pub fn unused_flags(matches: &ArgMatches, policy: &str) -> Vec<String> {
    let reg = super::registry::registry();
    let Ok(reads) = reg.reads(policy) else {
        return Vec::new();
    };
    PolicyOption::ALL
        .into_iter()
        .filter(|o| !reads.contains(o))
        .filter(|o| {
            let id = o.flag().trim_start_matches("--").replace('-', "_");
            matches.value_source(&id) == Some(ValueSource::CommandLine)
        })
        .map(|o| {
            format!(
                "warning: {} does not apply to the `{policy}` policy and is ignored (it is read by {})",
                o.flag(),
                reg.readers(o).join(", ")
            )
        })
        .collect()
}

/// Seconds below which a simulated step is not worth a warning.
const SLOW_STEP_S: f64 = 60.0;

/// A warning when `--link-bandwidth` makes one decode step take minutes: an offload
/// policy may move the whole cache (`context` tokens of every layer's K and V) each step.
pub fn slow_link(info: &ModelInfo, bandwidth: u64, context: usize) -> Option<String> {
    let per_token = [
        info.n_layers,
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

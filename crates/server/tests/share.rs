//! Live requests share a prefix by reference (issue 54, item 4, done-when 2 and 3): eight
//! requests sent at once, sharing a 2,000-token system prompt and each with its own
//! question, hold the prefix once — every `/metrics` sample's K/V bytes over all tiers (the
//! policy's device, host and disk bytes and the prefix cache's RAM, where the shared chunks
//! live) stay within one prefix, their suffixes and one chunk per request — and each gets
//! exactly the tokens and log-probabilities `full` without a prefix cache gives it alone:
//! under `full` (the chunks attended in place), `headwise` and `auto` (streamed from the
//! host tier). Under the APPROXIMATE `quest` the stored tiers hold it once and each request
//! gets what `quest` gives it alone; its device holds each request's selected pages. And the prefix cache's RAM is in the same pool as the requests' K/V: its
//! chunks stay after their request finishes and are evicted when a live request needs the
//! room.
mod common;

use anyhow::{ensure, Result};
use common::{agent, get, greedy_logprobs, metric, run_sampled, Sampled, Server};
use serde_json::{json, Value};

/// SmolLM2-135M's K/V per token in f32: 30 layers × 3 KV heads × 64 × 2 (K and V) × 4 bytes.
const KV_PER_TOKEN: f64 = 30.0 * 3.0 * 64.0 * 2.0 * 4.0;
/// The prefix cache's chunk (its default).
const CHUNK: f64 = 256.0;
const PREFIX: usize = 2000;
const SUFFIX: usize = 40;
const REQUESTS: usize = 8;
const NEW_TOKENS: usize = 4;

/// The shared prefix, then request `i`'s own question.
fn prompt(i: usize) -> Value {
    let prefix = (0..PREFIX).map(|k| 100 + (k * 37) % 4000);
    let own = (0..SUFFIX).map(|k| 200 + (k * 53 + i * 211) % 4000);
    json!(prefix.chain(own).collect::<Vec<_>>())
}

/// A greedy answer's tokens and log-probabilities.
fn greedy(a: &ureq::Agent, url: &str, prompt: &Value) -> Result<Value> {
    greedy_logprobs(a, url, prompt, NEW_TOKENS)
}

/// The server's flags for `policy`, with `extra`.
fn flags<'a>(policy: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let base = [
        "--policy",
        policy,
        "--batch-invariant",
        "--ctx-size",
        "2048",
        "--max-batch",
        "8",
        "--prefill-chunk",
        "256",
    ];
    [&base[..], extra].concat()
}

/// K/V bytes over the policy's `tiers` in one `/metrics` text, and the prefix cache's RAM
/// (where shared chunks are held).
fn kv_bytes_in(m: &str, tiers: &[&str]) -> f64 {
    let mut sum = 0.0;
    for tier in tiers {
        sum += metric(m, &format!("kvpolicy_kv_bytes{{tier=\"{tier}\"}}")).unwrap_or(0.0);
    }
    // (Absent until the engine's first step publishes it.)
    sum + metric(m, "kvpolicy_prefix_cache_bytes{tier=\"ram\"}").unwrap_or(0.0)
}

/// Held by the test running now (two servers at once thrash two cores).
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The lossless policies that share, with their flags: `full` attends the shared chunks
/// in place; `headwise` and `auto` (under a device budget) stream them from the host tier.
const SHARING: [(&str, &[&str]); 3] = [
    ("full", &[]),
    ("headwise", &[]),
    ("auto", &["--device-kv-budget", "256MiB"]),
];

#[test]
fn eight_live_requests_hold_a_shared_prefix_once_and_stay_exact() -> Result<()> {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let a = agent();
    // What each request gets alone from `full` without a prefix cache: every lossless
    // policy gives it, bit for bit.
    let alone: Vec<Value> = {
        let plain = Server::start(&flags("full", &[]))?;
        let url = plain.url("/v1/completions");
        (0..REQUESTS)
            .map(|i| greedy(&a, &url, &prompt(i)))
            .collect::<Result<_>>()?
    };
    for (policy, extra) in SHARING {
        held_once(&a, policy, extra, &alone)?;
    }
    Ok(())
}

/// Done-when 3's approximate policy: `quest` (its default budget, below these prompts'
/// length: APPROXIMATE) shares the prefix as the lossless ones do, each request getting
/// exactly what `quest` without a prefix cache gives it alone, and the server still says
/// LOSSY.
#[test]
fn an_approximate_policy_shares_a_prefix_too_and_stays_labeled_lossy() -> Result<()> {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let a = agent();
    let alone: Vec<Value> = {
        let plain = Server::start(&flags("quest", &[]))?;
        ensure!(plain.banner.contains("LOSSY"), "{}", plain.banner);
        let url = plain.url("/v1/completions");
        (0..REQUESTS)
            .map(|i| greedy(&a, &url, &prompt(i)))
            .collect::<Result<_>>()?
    };
    held_once(&a, "quest", &[], &alone)
}

/// Done-when 2 under `policy`: the eight requests at once against `alone`.
fn held_once(a: &ureq::Agent, policy: &str, extra: &[&str], alone: &[Value]) -> Result<()> {
    let server = Server::start(&flags(
        policy,
        &[extra, &["--prefix-cache-ram", "512MiB"]].concat(),
    ))?;
    // The APPROXIMATE policy stays labeled LOSSY with a prefix cache.
    let lossy = policy == "quest";
    ensure!(
        server.banner.contains("LOSSY") == lossy,
        "{}",
        server.banner
    );
    let url = server.url("/v1/completions");
    let Sampled {
        results: together,
        metrics: samples,
    } = run_sampled(
        &server,
        (0..REQUESTS).map(|i| {
            let (a, url) = (a.clone(), url.clone());
            move || greedy(&a, &url, &prompt(i))
        }),
    )?;
    for (i, (got, want)) in together.iter().zip(alone).enumerate() {
        ensure!(
            got == want,
            "{policy}, request {i}: {got} sharing vs {want} alone"
        );
    }
    // One prefix, every suffix (question and answer), one chunk per request: over every
    // tier for a lossless policy; over the tiers that store K/V (host, disk, the cache's
    // RAM) for `quest`, whose device holds each request's selected pages — its working
    // set, a copy of at most its budget, shared prefix or not.
    let tiers: &[&str] = match lossy {
        true => &["host", "disk"],
        false => &["device", "host", "disk"],
    };
    let own = (SUFFIX + NEW_TOKENS) as f64;
    let bound = KV_PER_TOKEN * (PREFIX as f64 + REQUESTS as f64 * (own + CHUNK));
    let mut most = 0f64;
    let mut shared = 0f64;
    let mut device = 0f64;
    let mut all_running = 0;
    for m in &samples {
        if metric(m, "kvpolicy_requests_running") == Some(REQUESTS as f64) {
            all_running += 1;
        }
        let bytes = kv_bytes_in(m, tiers);
        most = most.max(bytes);
        ensure!(
            bytes <= bound,
            "{policy}: K/V over {tiers:?} and the cache {bytes} bytes, above one prefix, the suffixes and a chunk per request ({bound})"
        );
        device = device.max(metric(m, "kvpolicy_kv_bytes{tier=\"device\"}").unwrap_or(0.0));
        shared = shared.max(metric(m, "kvpolicy_kv_shared_bytes").unwrap_or(0.0));
    }
    // Seven whole chunks of the prefix (1,792 tokens) held by reference.
    let whole = (PREFIX as f64 / CHUNK).floor();
    ensure!(
        shared == whole * CHUNK * KV_PER_TOKEN,
        "{policy}: {shared} bytes shared at most, not {whole} chunks' (samples: {})",
        samples.len()
    );
    // Live together: the bound held while all eight ran.
    ensure!(
        all_running > 0,
        "{policy}: no sample saw the {REQUESTS} requests running at once"
    );
    let (_, end) = get(a, &server.url("/metrics"))?;
    let restored = metric(&end, "kvpolicy_prefix_cache_restored_tokens_total");
    ensure!(
        restored == Some((REQUESTS - 1) as f64 * whole * CHUNK),
        "{policy}: restored tokens: {restored:?}"
    );
    // Without sharing each request would hold its whole prompt: 8 × 2,048 tokens' buffers.
    eprintln!(
        "{policy}: K/V over {tiers:?} and the cache at most {:.1} MiB (bound {:.1} MiB), device at most {:.1} MiB; {} samples",
        most / 1048576.0,
        bound / 1048576.0,
        device / 1048576.0,
        samples.len()
    );
    Ok(())
}

/// The device pool's usage in a `/metrics` text.
fn device_usage(m: &str) -> f64 {
    metric(m, "kvpolicy_kv_cache_usage_perc{tier=\"device\"}").unwrap_or(0.0)
}

#[test]
fn the_prefix_cache_gives_its_room_to_live_requests() -> Result<()> {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = Server::start(&[
        "--policy",
        "full",
        "--batch-invariant",
        "--ctx-size",
        "1024",
        "--max-batch",
        "4",
        "--prefill-chunk",
        "256",
        "--device-kv-budget",
        "64MiB",
        "--prefix-cache-ram",
        "256MiB",
    ])?;
    let a = agent();
    let url = server.url("/v1/completions");
    let ids = |n: usize, salt: usize| {
        json!((0..n)
            .map(|k| 100 + (k * 53 + salt * 7) % 3000)
            .collect::<Vec<_>>())
    };
    // A 800-token prompt (a 1,024-token buffer, 45 MiB, while it runs): of its three whole
    // chunks, what fits beside that in the pool is stored, and stays after it finishes.
    greedy(&a, &url, &ids(800, 1))?;
    let (_, after) = get(&a, &server.url("/metrics"))?;
    let held = metric(&after, "kvpolicy_prefix_cache_bytes{tier=\"ram\"}").unwrap_or(0.0);
    let chunk = CHUNK * KV_PER_TOKEN;
    ensure!(
        held >= chunk && metric(&after, "kvpolicy_requests_running") == Some(0.0),
        "the cache holds {held} bytes after its request finished"
    );
    ensure!(
        (device_usage(&after) * 64.0 * 1048576.0 - held).abs() < 1.0,
        "the cache's chunks are not the device pool's bytes: usage {}",
        device_usage(&after)
    );
    // Two other 600-token prompts at once: each needs 768 tokens' buffers (33.75 MiB), so
    // the second needs the cache's room.
    let samples = run_sampled(
        &server,
        [2, 3].map(|salt| {
            let (a, url, p) = (a.clone(), url.clone(), ids(600, salt));
            move || greedy(&a, &url, &p)
        }),
    )?
    .metrics;
    for m in &samples {
        ensure!(
            device_usage(m) <= 1.0,
            "device KV at {} of its budget",
            device_usage(m)
        );
    }
    let (_, end) = get(&a, &server.url("/metrics"))?;
    let evicted = metric(&end, "kvpolicy_prefix_cache_evictions_total{tier=\"ram\"}");
    ensure!(
        evicted > Some(0.0),
        "no chunk was evicted for the live requests:\n{end}"
    );
    let peak = metric(&end, "kvpolicy_kv_peak_bytes{tier=\"device\"}").unwrap_or(f64::MAX);
    ensure!(peak <= 64.0 * 1048576.0, "the pool's peak {peak}");
    ensure!(
        metric(&end, "kvpolicy_requests_failed_total") == Some(0.0),
        "a request failed:\n{end}"
    );
    Ok(())
}

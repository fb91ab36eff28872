//! One device budget for the whole server (issue 54): requests whose K/V together pass
//! `--device-kv-budget` are admitted by memory and preempted (recomputed) rather than
//! refused or failed; each still gets exactly the tokens it gets alone
//! (`--batch-invariant`), and the pool never holds more than the budget (`/metrics`: every
//! sample's usage ≤ 1 and the peak the pool's books ever saw ≤ the budget).
mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use common::{agent, get, metric, post, Server};
use serde_json::{json, Value};

// SmolLM2-135M's K/V per token in f32: 30 layers × 3 KV heads × 64 × 2 × 4 bytes, so a
// sequence's device buffers (grown 256 tokens at a time) take 22.5 MiB per step under `full`.

/// Prompts of 210–240 tokens and 60 new tokens each: a sequence fits one growth step until
/// its generation passes 256 tokens, then needs two. Two fit the budget with one step each
/// (so two are admitted), not with two: whichever of a pair passes 256 first preempts the
/// other, which by then is running too (it cannot finish before passing 256 itself).
fn prompts() -> Vec<Value> {
    (0..4)
        .map(|i| {
            let n = [240, 230, 220, 210][i];
            json!((0..n)
                .map(|k| 100 + (k * 37 + i * 101) % 4000)
                .collect::<Vec<_>>())
        })
        .collect()
}

/// A greedy answer's tokens and log-probabilities (equal only when every kernel computed
/// the same numbers).
fn greedy(a: &ureq::Agent, url: &str, prompt: &Value) -> Result<Value> {
    // The special tokens (end of text among them) banned: every answer runs its length.
    let body = json!({"prompt": prompt, "max_tokens": 60, "temperature": 0, "logprobs": 0,
                      "logit_bias": {"0": -100, "1": -100, "2": -100}});
    let (status, text) = post(a, url, &serde_json::to_vec(&body)?)?;
    ensure!(status == 200, "{status}: {text}");
    let v: Value = serde_json::from_str(&text)?;
    let lp = &v["choices"][0]["logprobs"];
    Ok(json!([lp["tokens"], lp["token_logprobs"]]))
}

/// What one load under one policy must show.
struct Load<'a> {
    /// The server's flags beyond the batching ones.
    flags: &'a [&'a str],
    /// The device budget, in bytes (as `--device-kv-budget` gives it).
    device_budget: f64,
    /// The host budget, when one is given.
    host_budget: Option<f64>,
}

/// Runs `prompts()` alone, then all at once with `/metrics` sampled throughout: each gets
/// exactly its solo tokens, no sample's pool usage passes 1, the pools' peaks stay within
/// their budgets, none fails, and at least one request was preempted.
fn check(load: &Load<'_>) -> Result<()> {
    let batching = ["--ctx-size", "512", "--max-batch", "4", "--prefill-chunk", "64"];
    let server = Server::start(&[&batching[..], &["--batch-invariant"], load.flags].concat())?;
    let url = server.url("/v1/completions");
    let a = agent();
    let alone: Vec<Value> = prompts()
        .iter()
        .map(|p| greedy(&a, &url, p))
        .collect::<Result<_>>()?;
    let done = AtomicBool::new(false);
    let (together, samples) = std::thread::scope(|s| -> Result<(Vec<Value>, Vec<String>)> {
        let sampler = s.spawn(|| -> Result<Vec<String>> {
            let a = agent();
            let mut seen = Vec::new();
            while !done.load(Ordering::SeqCst) {
                seen.push(get(&a, &server.url("/metrics"))?.1);
                std::thread::sleep(Duration::from_millis(20));
            }
            Ok(seen)
        });
        let handles: Vec<_> = prompts()
            .into_iter()
            .map(|p| {
                let (a, url) = (a.clone(), url.clone());
                s.spawn(move || greedy(&a, &url, &p))
            })
            .collect();
        let got = handles
            .into_iter()
            .map(|h| h.join().map_err(|_| anyhow::anyhow!("panicked"))?)
            .collect::<Result<Vec<_>>>();
        done.store(true, Ordering::SeqCst);
        let seen = sampler.join().map_err(|_| anyhow::anyhow!("panicked"))??;
        Ok((got?, seen))
    })?;
    for (i, (got, want)) in together.iter().zip(&alone).enumerate() {
        ensure!(got == want, "prompt {i}: {got} together vs {want} alone");
    }
    ensure!(samples.len() > 3, "only {} samples of /metrics", samples.len());
    let tiers: Vec<(&str, f64)> = [("device", Some(load.device_budget)), ("host", load.host_budget)]
        .into_iter()
        .filter_map(|(t, b)| b.map(|b| (t, b)))
        .collect();
    for m in &samples {
        for (tier, _) in &tiers {
            let usage = metric(m, &format!("kvpolicy_kv_cache_usage_perc{{tier=\"{tier}\"}}"))
                .with_context(|| format!("no {tier} usage in /metrics"))?;
            ensure!(usage <= 1.0, "{tier} KV at {usage} of its budget");
        }
    }
    let (_, end) = get(&a, &server.url("/metrics"))?;
    for (tier, budget) in &tiers {
        let peak = metric(&end, &format!("kvpolicy_kv_peak_bytes{{tier=\"{tier}\"}}"))
            .context("peak")?;
        ensure!(
            peak <= *budget && peak > budget / 2.0,
            "the {tier} pool's peak {peak} against a budget of {budget}"
        );
    }
    let preempted = metric(&end, "kvpolicy_num_preemptions_total{mode=\"recompute\"}")
        .context("no preemptions counted")?;
    ensure!(preempted > 0.0, "no request was preempted:\n{end}");
    ensure!(
        metric(&end, "kvpolicy_requests_failed_total") == Some(0.0),
        "a request failed:\n{end}"
    );
    Ok(())
}

const MIB: f64 = 1024.0 * 1024.0;

#[test]
fn full_requests_past_the_device_budget_wait_or_are_preempted_and_stay_exact() -> Result<()> {
    check(&Load {
        flags: &["--device-kv-budget", "64MiB"],
        device_budget: 64.0 * MIB,
        host_budget: None,
    })
}

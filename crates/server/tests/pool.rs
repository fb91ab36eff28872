//! One memory budget for the whole server (issue 54): requests whose K/V together pass
//! `--device-kv-budget` (and, with a disk tier, `--host-kv-budget`) are admitted by memory
//! and preempted (recomputed) rather than refused or failed; each still gets exactly the
//! tokens it gets alone (`--batch-invariant`), and no pool holds more than its budget
//! (`/metrics`: every sample's usage ≤ 1, and the peak the pool's books ever saw ≤ the
//! budget) — under `full`, `headwise` and `auto` with a host budget and a disk tier, and
//! the approximate `quest` (its LOSSY label intact). Preemption in both of vLLM's modes
//! (`--preemption-mode`) under `full`: recomputed and swapped; a swapped request's file is
//! gone once it resumes. `headwise` recomputes (the default).
mod common;

use anyhow::{ensure, Context, Result};
use std::time::Duration;

use common::{agent, get, greedy_logprobs, metric, run_sampled, wait_for_metrics, Sampled, Server};
use serde_json::{json, Value};

// SmolLM2-135M's K/V per token in f32: 30 layers × 3 KV heads × 64 × 2 × 4 bytes = 45 KiB.
// Under `full` a sequence's device buffers grow 256 tokens (11.25 MiB) at a time; the host
// tier's stores hold a request's prompt and `max_tokens` (12 MiB for 274 tokens).

/// `n` prompts of 216–240 tokens; with 40 new tokens most pass 256 tokens, where the
/// device buffers grow by a step (so requests admitted together grow past what they were
/// admitted with).
fn prompts(n: usize) -> Vec<Value> {
    (0..n)
        .map(|i| {
            let len = [240, 234, 228, 222][i % 4] - 2 * (i / 4);
            json!((0..len)
                .map(|k| 100 + (k * 37 + i * 101) % 4000)
                .collect::<Vec<_>>())
        })
        .collect()
}

/// A greedy answer's tokens and log-probabilities (equal only when every kernel computed
/// the same numbers).
fn greedy(a: &ureq::Agent, url: &str, prompt: &Value) -> Result<Value> {
    greedy_logprobs(a, url, prompt, 40)
}

/// What one load under one policy must show.
struct Load<'a> {
    /// The policy served.
    policy: &'a str,
    /// Requests sent at once.
    requests: usize,
    /// Whether some must be preempted.
    preempts: bool,
    /// How preempted requests get their K/V back (`--preemption-mode`).
    mode: &'a str,
    /// Whether a prefix cache records what the load computes (then the solo runs, last,
    /// restore it: the chunks a request preempted and resumed stored are its prompt's K/V).
    prefix_cache: bool,
    /// Whether the policy is approximate (the server says LOSSY when it starts).
    lossy: bool,
    /// `--device-kv-budget` in MiB, when one is given.
    device_mib: Option<u32>,
    /// `--host-kv-budget` in MiB (over a disk tier in a temporary directory), when given.
    host_mib: Option<u32>,
}

/// Runs `prompts()` alone, then all at once with `/metrics` sampled throughout: each gets
/// exactly its solo tokens, no sample's pool usage passes 1, the pools' peaks stay within
/// their budgets, none fails, and (when `preempts`) at least one request was preempted.
fn check(load: &Load<'_>) -> Result<()> {
    // One load at a time: servers sharing the two cores of a CI machine spin against each
    // other's thread pools (four times the run time, measured).
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let batching = [
        "--ctx-size",
        "512",
        "--max-batch",
        "4",
        "--prefill-chunk",
        "64",
    ];
    let mut flags: Vec<String> = [
        &batching[..],
        &["--batch-invariant", "--policy", load.policy],
    ]
    .concat()
    .iter()
    .map(|f| f.to_string())
    .collect();
    if let Some(mib) = load.device_mib {
        flags.extend(["--device-kv-budget".into(), format!("{mib}MiB")]);
    }
    let disk = tempfile::tempdir()?;
    let dir = disk
        .path()
        .to_str()
        .context("a UTF-8 temporary directory")?;
    if load.host_mib.is_some() || load.mode == "swap" {
        flags.extend(["--disk-dir".into(), dir.into()]);
    }
    if let Some(mib) = load.host_mib {
        flags.extend(["--host-kv-budget".into(), format!("{mib}MiB")]);
    }
    flags.extend(["--preemption-mode".into(), load.mode.into()]);
    if load.prefix_cache {
        // Chunks of 64 tokens: each prompt stores three when it finishes.
        let cache = ["--prefix-cache-ram", "32MiB", "--prefix-cache-chunk", "64"];
        flags.extend(cache.map(String::from));
    }
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let server = Server::start(&flags)?;
    ensure!(
        server.banner.contains("LOSSY") == load.lossy,
        "the server's banner: {}",
        server.banner
    );
    let url = server.url("/v1/completions");
    let a = agent();
    let solo = || -> Result<Vec<Value>> {
        prompts(load.requests)
            .iter()
            .map(|p| greedy(&a, &url, p))
            .collect()
    };
    // With a prefix cache the solo runs come last: they restore what the load stored.
    let alone = if load.prefix_cache {
        None
    } else {
        Some(solo()?)
    };
    let Sampled {
        results: together,
        metrics: samples,
    } = run_sampled(
        &server,
        prompts(load.requests).into_iter().map(|p| {
            let (a, url) = (a.clone(), url.clone());
            move || greedy(&a, &url, &p)
        }),
    )?;
    let alone = match alone {
        Some(alone) => alone,
        None => solo()?,
    };
    for (i, (got, want)) in together.iter().zip(&alone).enumerate() {
        ensure!(got == want, "prompt {i}: {got} together vs {want} alone");
    }
    ensure!(
        samples.len() > 3,
        "only {} samples of /metrics",
        samples.len()
    );
    let tiers: Vec<(&str, f64)> = [("device", load.device_mib), ("host", load.host_mib)]
        .into_iter()
        .filter_map(|(t, b)| b.map(|mib| (t, f64::from(mib) * MIB)))
        .collect();
    for m in &samples {
        for (tier, _) in &tiers {
            let usage = metric(
                m,
                &format!("kvpolicy_kv_cache_usage_perc{{tier=\"{tier}\"}}"),
            )
            .with_context(|| format!("no {tier} usage in /metrics"))?;
            ensure!(usage <= 1.0, "{tier} KV at {usage} of its budget");
        }
    }
    let (_, end) = get(&a, &server.url("/metrics"))?;
    for (tier, budget) in &tiers {
        let peak =
            metric(&end, &format!("kvpolicy_kv_peak_bytes{{tier=\"{tier}\"}}")).context("peak")?;
        ensure!(
            peak <= *budget && peak > budget / 2.0,
            "the {tier} pool's peak {peak} against a budget of {budget}"
        );
    }
    let preempted = |mode: &str| {
        metric(
            &end,
            &format!("kvpolicy_num_preemptions_total{{mode=\"{mode}\"}}"),
        )
    };
    ensure!(
        !load.preempts || preempted(load.mode) > Some(0.0),
        "no request was preempted by {}:\n{end}",
        load.mode
    );
    if load.mode == "swap" {
        // Every preempted request's K/V could be handed back: none fell back to recompute.
        ensure!(
            preempted("recompute").unwrap_or(0.0) == 0.0,
            "a request was recomputed under swap:\n{end}"
        );
        // Every file read back and removed.
        ensure!(
            metric(&end, "kvpolicy_kv_swapped_bytes") == Some(0.0),
            "swapped bytes left:\n{end}"
        );
        ensure!(
            swap_files(disk.path())?.is_empty(),
            "swap files left: {:?}",
            swap_files(disk.path())?
        );
    }
    ensure!(
        metric(&end, "kvpolicy_requests_failed_total") == Some(0.0),
        "a request failed:\n{end}"
    );
    if load.prefix_cache {
        let restored = metric(&end, "kvpolicy_prefix_cache_restored_tokens_total");
        ensure!(restored > Some(0.0), "nothing restored:\n{end}");
    }
    Ok(())
}

const MIB: f64 = 1024.0 * 1024.0;

/// The files in the swap directories under `dir`, which only their owner may enter.
fn swap_files(dir: &std::path::Path) -> Result<Vec<std::path::PathBuf>> {
    use std::os::unix::fs::PermissionsExt;
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        if e.file_name()
            .to_string_lossy()
            .starts_with(".kvpolicy-swap-")
        {
            let mode = e.metadata()?.permissions().mode() & 0o777;
            ensure!(mode == 0o700, "the swap directory has mode {mode:o}");
            for f in std::fs::read_dir(e.path())? {
                out.push(f?.path());
            }
        }
    }
    Ok(out)
}

/// Held by the load running now.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Four requests that need 90 MiB of device buffers together under a 64 MiB budget.
#[test]
fn full_requests_past_the_device_budget_wait_or_are_preempted_and_stay_exact() -> Result<()> {
    check(&Load {
        policy: "full",
        requests: 4,
        preempts: true,
        mode: "recompute",
        prefix_cache: false,
        lossy: false,
        device_mib: Some(64),
        host_mib: None,
    })
}

/// The same four requests preempted by swapping: the preempted one's K/V go to a file
/// and come back bit for bit.
#[test]
fn full_requests_preempted_by_swapping_stay_exact() -> Result<()> {
    check(&Load {
        policy: "full",
        requests: 4,
        preempts: true,
        mode: "swap",
        prefix_cache: false,
        lossy: false,
        device_mib: Some(64),
        host_mib: None,
    })
}

/// Swapping with a prefix cache recording the load: a request preempted and resumed stores
/// its prompt's K/V, which the solo runs after the load restore — with the same tokens.
#[test]
fn full_requests_swapped_with_a_prefix_cache_store_their_prompts_exactly() -> Result<()> {
    check(&Load {
        policy: "full",
        requests: 4,
        preempts: true,
        mode: "swap",
        prefix_cache: true,
        lossy: false,
        device_mib: Some(64),
        host_mib: None,
    })
}

/// Sixteen requests whose K/V is 4 × the host budget (16 × 11.8 MiB against 47 MiB), the
/// device budget small enough that requests admitted together preempt one another
/// (recomputed: the default).
#[test]
fn headwise_sixteen_requests_past_four_host_budgets_stay_exact() -> Result<()> {
    check(&Load {
        policy: "headwise",
        requests: 16,
        preempts: true,
        mode: "recompute",
        prefix_cache: false,
        lossy: false,
        device_mib: Some(4),
        host_mib: Some(47),
    })
}

/// `auto` plans its resident units within an equal share of the device budget (budget ÷
/// `--max-batch`): eight requests, ~4 × the host budget, under a device budget that holds
/// every resident unit of none of them.
#[test]
fn auto_requests_share_the_device_budget_and_stay_exact() -> Result<()> {
    check(&Load {
        policy: "auto",
        requests: 8,
        preempts: false,
        mode: "recompute",
        prefix_cache: false,
        lossy: false,
        device_mib: Some(4),
        host_mib: Some(24),
    })
}

/// The approximate `quest` keeps its K/V on the host tier: eight requests, ~4 × the host
/// budget, admitted as it allows; still LOSSY, still each request's solo tokens.
#[test]
fn quest_requests_past_the_host_budget_wait_and_stay_lossy_and_exact() -> Result<()> {
    check(&Load {
        policy: "quest",
        requests: 8,
        preempts: false,
        mode: "recompute",
        prefix_cache: false,
        lossy: true,
        device_mib: None,
        host_mib: Some(24),
    })
}

/// `n` token ids from `seed` (a prompt no other shares).
fn ids(n: usize, seed: usize) -> Value {
    json!((0..n)
        .map(|k| 100 + (k * 53 + seed * 997) % 4000)
        .collect::<Vec<_>>())
}

/// A request preempted in the middle of its prefill, swapped and resumed, records its whole
/// prompt for the prefix cache. A short request (243 tokens) decodes past its buffers'
/// 256-token step while a long one admitted after it (1,000 tokens, prefilled 64 a step)
/// is near the end of its prefill: under 60 MiB the long one is swapped out; resumed after
/// the short one, it finishes and stores its prompt's chunks. Alone afterwards it restores
/// them (its 15 chunks, beside the short one's 3) and gets the same tokens.
#[test]
fn a_request_swapped_in_its_prefill_stores_its_whole_prompt() -> Result<()> {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (disk, cache) = (tempfile::tempdir()?, tempfile::tempdir()?);
    let path = |d: &tempfile::TempDir| -> Result<String> {
        Ok(d.path().to_str().context("a UTF-8 directory")?.to_string())
    };
    let (disk_dir, cache_dir) = (path(&disk)?, path(&cache)?);
    let server = Server::start(&[
        "--ctx-size",
        "1100",
        "--max-batch",
        "2",
        "--prefill-chunk",
        "64",
        "--batch-invariant",
        "--device-kv-budget",
        "60MiB",
        "--disk-dir",
        &disk_dir,
        "--preemption-mode",
        "swap",
        "--prefix-cache",
        &cache_dir,
        "--prefix-cache-ram",
        "4MiB",
        "--prefix-cache-chunk",
        "64",
    ])?;
    let url = server.url("/v1/completions");
    let a = agent();
    let (short, long) = (ids(243, 1), ids(1000, 2));
    let together = std::thread::scope(|s| -> Result<(Value, Value)> {
        let first = s.spawn(|| greedy(&a, &url, &short));
        // The long one comes once the short one decodes.
        wait_for_metrics(&server, Duration::from_secs(60), "a first token", |m| {
            metric(m, "kvpolicy_completion_tokens_total") >= Some(1.0)
        })?;
        let second = s.spawn(|| greedy(&a, &url, &long));
        let join = |h: std::thread::ScopedJoinHandle<'_, Result<Value>>| {
            h.join().map_err(|_| anyhow::anyhow!("a client panicked"))?
        };
        Ok((join(first)?, join(second)?))
    })?;
    let (_, m) = get(&a, &server.url("/metrics"))?;
    let swaps = metric(&m, "kvpolicy_num_preemptions_total{mode=\"swap\"}");
    ensure!(swaps >= Some(1.0), "nothing was swapped:\n{m}");
    let before = metric(&m, "kvpolicy_prefix_cache_restored_tokens_total").unwrap_or(0.0);
    let alone = (greedy(&a, &url, &short)?, greedy(&a, &url, &long)?);
    let (_, m) = get(&a, &server.url("/metrics"))?;
    let restored = metric(&m, "kvpolicy_prefix_cache_restored_tokens_total").unwrap_or(0.0);
    ensure!(
        restored - before >= 900.0,
        "the long prompt's chunks were not restored: {before} → {restored}"
    );
    ensure!(
        together.0 == alone.0,
        "the short request: {} vs {}",
        together.0,
        alone.0
    );
    ensure!(
        together.1 == alone.1,
        "the long request: {} vs {}",
        together.1,
        alone.1
    );
    Ok(())
}

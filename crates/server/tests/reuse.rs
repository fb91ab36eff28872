//! The prefix cache behind the server: a prompt that starts like an earlier one restores
//! the earlier one's chunks instead of prefilling them — from RAM in the same server, from
//! files in the next server over the same directory — and answers exactly as it did fresh
//! (`/metrics` counts the lookups, hits, restored tokens and stored chunks).
mod common;

use std::time::Duration;

use anyhow::{ensure, Result};

use common::{agent, completion_text, metric, wait_for_metrics, Server};
use serde_json::json;

fn ids(n: usize, salt: usize) -> Vec<usize> {
    (0..n).map(|k| 100 + (k * 53 + salt * 7) % 3000).collect()
}

fn greedy(a: &ureq::Agent, server: &Server, prompt: &[usize]) -> Result<String> {
    let body = json!({"prompt": prompt, "max_tokens": 8, "temperature": 0});
    completion_text(a, &server.url("/v1/completions"), &body)
}

/// The counter `name` once it reads `want` (the engine stores a request's chunks just
/// after its answer, so the counters may trail the answer briefly).
fn counter(server: &Server, name: &str, want: f64) -> Result<()> {
    wait_for_metrics(
        server,
        Duration::from_secs(10),
        &format!("{name} = {want}"),
        |m| metric(m, name) == Some(want),
    )?;
    Ok(())
}

#[test]
fn prompts_restore_earlier_chunks_from_ram_and_files_and_answer_alike() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let d = dir.path().to_string_lossy().into_owned();
    let flags = [
        "--prefix-cache",
        &d,
        "--prefix-cache-chunk",
        "64",
        "--prefill-chunk",
        "64",
        "--batch-invariant",
    ];
    let a = agent();
    let doc = ids(300, 1);
    let other: Vec<usize> = doc[..200].iter().copied().chain(ids(30, 2)).collect();
    let (fresh_doc, fresh_other) = {
        let server = Server::start(&flags)?;
        let first = greedy(&a, &server, &doc)?;
        counter(&server, "kvpolicy_prefix_cache_hits_total", 0.0)?;
        // 299 tokens before the last: 4 whole chunks of 64.
        counter(&server, "kvpolicy_prefix_cache_stored_chunks_total", 4.0)?;
        // Again, from RAM: the 4 chunks restored, the same answer.
        ensure!(greedy(&a, &server, &doc)? == first);
        counter(&server, "kvpolicy_prefix_cache_hits_total", 1.0)?;
        counter(
            &server,
            "kvpolicy_prefix_cache_restored_tokens_total",
            256.0,
        )?;
        // Both looked up, in tokens.
        counter(&server, "kvpolicy_prefix_cache_queries_total", 600.0)?;
        // A prompt sharing the first 200 tokens restores 3 chunks.
        let shared = greedy(&a, &server, &other)?;
        counter(
            &server,
            "kvpolicy_prefix_cache_restored_tokens_total",
            448.0,
        )?;
        (first, shared)
    };
    // A new server over the same directory: from files, the same answers.
    let server = Server::start(&flags)?;
    ensure!(greedy(&a, &server, &doc)? == fresh_doc);
    ensure!(greedy(&a, &server, &other)? == fresh_other);
    counter(
        &server,
        "kvpolicy_prefix_cache_restored_tokens_total",
        256.0 + 192.0,
    )?;
    // Without a cache, the shared prompt computed fresh answers the same.
    let plain = Server::start(&["--prefill-chunk", "64", "--batch-invariant"])?;
    ensure!(greedy(&a, &plain, &other)? == fresh_other);
    Ok(())
}

#[test]
fn a_policy_that_cannot_restore_is_refused_at_start_up() -> Result<()> {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvpolicy-server"))
        .args([
            "--cpu",
            "--port",
            "0",
            "--policy",
            "recompute",
            "--prefix-cache-ram",
            "64MiB",
        ])
        .output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    ensure!(!out.status.success(), "{err}");
    ensure!(
        err.contains("cannot take restored K/V (--prefix-cache-ram)"),
        "{err}"
    );
    Ok(())
}

/// A cache directory removed under a running server: requests are still answered, and the
/// chunk files it could not write are counted by cause in `/metrics` (issue "Hardening
/// IV", class 15).
#[test]
fn write_errors_are_counted_not_silent() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let cache = dir.path().join("cache");
    let d = cache.to_string_lossy().into_owned();
    let server = Server::start(&["--prefix-cache", &d, "--prefix-cache-chunk", "64"])?;
    std::fs::remove_dir_all(&cache)?;
    let a = agent();
    greedy(&a, &server, &ids(200, 3))?;
    wait_for_metrics(
        &server,
        Duration::from_secs(10),
        "a counted write error",
        |m| {
            metric(
                m,
                r#"kvpolicy_prefix_cache_write_errors_total{kind="dir_missing"}"#,
            )
            .is_some_and(|n| n >= 1.0)
        },
    )?;
    // Still answering.
    greedy(&a, &server, &ids(10, 4))?;
    Ok(())
}

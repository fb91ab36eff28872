//! The approximate policies through the command line (issue 29): the runner's summary and
//! `--stats-out` label them lossy and report their pages; kvbench's table and CSV say
//! LOSSY; with a budget covering the context the generated ids equal `full`'s.
mod common;

use std::process::{Command, Output};

use anyhow::{ensure, Context, Result};
use common::cli::llama;

/// The `llama` example on the GQA fixture: 40 prompt tokens (chunks of 8), 12 generated.
fn run(policy: &str, extra: &[&str]) -> Result<Output> {
    let g = common::fixture("llama_gqa").to_string_lossy().into_owned();
    let ids: Vec<String> = (1..=40).map(|i| (i * 7 % 90 + 1).to_string()).collect();
    let ids = ids.join(",");
    let mut args = vec![
        "--model-dir",
        &g,
        "--prompt-ids",
        &ids,
        "--max-new-tokens",
        "12",
        "--prefill-chunk",
        "8",
        "--policy",
        policy,
    ];
    args.extend(extra);
    llama(&args)
}

/// The generated ids and `--stats-out` of a run under `policy`.
fn outputs(policy: &str) -> Result<(serde_json::Value, serde_json::Value)> {
    let dir = tempfile::tempdir()?;
    let (ids, stats) = (dir.path().join("ids.json"), dir.path().join("stats.json"));
    let (i, s) = (ids.to_string_lossy(), stats.to_string_lossy());
    let o = run(policy, &["--ids-out", &i, "--stats-out", &s])?;
    ensure!(
        o.status.success(),
        "{policy}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let ids: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&ids)?)?;
    let stats = serde_json::from_str(&std::fs::read_to_string(&stats)?)?;
    Ok((ids["generated_ids"].clone(), stats))
}

#[test]
fn the_runner_labels_them_lossy_and_reports_their_pages() -> Result<()> {
    let (full_ids, _) = outputs("full")?;
    for name in ["quest", "flexicache", "clo"] {
        // A budget past the context: the same tokens as full, still labeled lossy.
        let wide = format!("{name}:page=4,sinks=4,window=8,budget=1024");
        let (ids, stats) = outputs(&wide)?;
        ensure!(ids == full_ids, "{wide}: {ids} vs {full_ids}");
        ensure!(stats["lossy"] == true, "{stats}");
        let metrics = &stats["policy_metrics"];
        let attended = metrics["attended_pages"]["value"]
            .as_f64()
            .context("attended_pages")?;
        ensure!(attended > 0.0, "{stats}");
        // The summary names the approximation.
        let o = run(&format!("{name}:page=4,sinks=4,window=8,budget=8"), &[])?;
        let err = String::from_utf8_lossy(&o.stderr);
        ensure!(o.status.success(), "{err}");
        ensure!(err.contains("LOSSY: an approximate policy"), "{err}");
        ensure!(err.contains("attended_pages"), "{err}");
    }
    Ok(())
}

#[test]
fn kvbench_marks_them_lossy() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let csv = dir.path().join("sweep.csv");
    let bin = common::example_bin("kvbench");
    ensure!(bin.is_file(), "example binary missing at {}", bin.display());
    let g = common::fixture("llama_gqa").to_string_lossy().into_owned();
    let o = Command::new(bin)
        .args([
            "--model-dir",
            &g,
            "--cpu",
            "--context",
            "48",
            "--steps",
            "3",
            "--repeats",
            "1",
        ])
        .args([
            "--prefill-chunk",
            "16",
            "--policies",
            "full,quest:page=4,budget=8,sinks=4,window=8",
        ])
        .args(["--csv", &csv.to_string_lossy()])
        .output()?;
    let out = String::from_utf8_lossy(&o.stdout);
    ensure!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    ensure!(out.contains("(LOSSY)"), "{out}");
    let text = std::fs::read_to_string(&csv)?;
    let header: Vec<&str> = text.lines().next().context("header")?.split(',').collect();
    let col = header
        .iter()
        .position(|h| *h == "lossy")
        .context("lossy column")?;
    for line in text.lines().skip(1) {
        // The quest spec is quoted (it holds commas): one cell once unquoted.
        let line = match (line.find('"'), line.rfind('"')) {
            (Some(a), Some(b)) if a < b => format!("{}spec{}", &line[..a], &line[b + 1..]),
            _ => line.to_string(),
        };
        let cells: Vec<&str> = line.split(',').collect();
        let want = if cells[1] == "full" { "false" } else { "true" };
        ensure!(cells[col] == want, "{line}");
    }
    Ok(())
}

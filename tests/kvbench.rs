//! The kvbench sweep as other tools read it: the CSV columns, the charts, `--quick`, and
//! clear errors for a bad policy variant or an output it cannot write.
mod common;

use std::process::{Command, Output};

use anyhow::Result;

const TINY: &str = r#"{"model_type": "opt", "hidden_size": 16, "ffn_dim": 32,
 "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 64,
 "max_position_embeddings": 512}"#;

fn kvbench(args: &[&str]) -> Result<Output> {
    let bin = common::example_bin("kvbench");
    anyhow::ensure!(bin.is_file(), "example binary missing at {}", bin.display());
    Ok(Command::new(bin).args(args).output()?)
}

#[test]
fn sweep_writes_csv_and_charts() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let cfg = dir.path().join("config.json");
    std::fs::write(&cfg, TINY)?;
    let profile = dir.path().join("profile.json");
    std::fs::write(
        &profile,
        r#"{"h2d_bytes_per_s": 1e9, "recompute_tokens_per_s": 1e9}"#,
    )?;
    let csv = dir.path().join("sweep.csv");
    let plots = dir.path().join("charts");
    let s = |p: &std::path::Path| p.to_string_lossy().into_owned();
    let o = kvbench(&[
        "--random-weights",
        "--config",
        &s(&cfg),
        "--cpu",
        "--context",
        "8,24",
        "--steps",
        "2",
        "--repeats",
        "1",
        "--prefill-chunk",
        "5",
        "--policies",
        "full,layer,headwise:1,recompute,recompute:4",
        "--profile",
        &s(&profile),
        "--link-bandwidth",
        "1GB",
        "--csv",
        &s(&csv),
        "--plot",
        &s(&plots),
    ])?;
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(stdout.contains("simulated link: 953.67 MiB/s"), "{stdout}");
    // The model's load time, a line of its own (scripts/scale_bench.py reads it).
    assert!(
        stdout.lines().any(|l| l
            .strip_prefix("load: ")
            .and_then(|t| t.strip_suffix(" s"))
            .is_some_and(|t| t.parse::<f64>().is_ok())),
        "no `load: X s` line: {stdout}"
    );
    let text = std::fs::read_to_string(&csv)?;
    let mut lines = text.lines();
    assert_eq!(
        lines.next(),
        Some("context,policy,prefill_tok_s,decode_tok_s,decode_vs_full,device_kv_peak_bytes,device_vs_full,host_kv_bytes,h2d_bytes_per_token,d2h_bytes_per_token,link_utilization,lossy,split")
    );
    let rows: Vec<Vec<&str>> = lines.map(|l| l.split(',').collect()).collect();
    assert_eq!(rows.len(), 10, "{text}");
    for r in &rows {
        assert_eq!(r.len(), 13, "{r:?}");
        let utilization: f64 = r[10].parse()?;
        // None of these policies is approximate.
        assert_eq!(r[11], "false", "{r:?}");
        if r[1] == "full" {
            assert_eq!((r[4], r[6]), ("1.000000", "1.000000"), "{r:?}");
            assert_eq!(r[8], "0");
            assert_eq!(utilization, 0.0, "no link: {r:?}");
        } else {
            // Every offloading policy here moves K/V over the link while it decodes.
            assert!(utilization > 0.0 && utilization.is_finite(), "{r:?}");
        }
        if r[1] == "layer" {
            // The whole history crosses once per token: 2 layers × K+V × 4 heads × 4 wide.
            let ctx: u64 = r[0].parse()?;
            let h2d: u64 = r[8].parse()?;
            assert!(h2d >= 2 * 2 * 16 * 4 * ctx, "{r:?}");
        }
        if r[1] == "recompute:4" {
            assert_eq!(r[12], "4", "{r:?}");
        }
    }
    for f in [
        "decode_tok_s.svg",
        "device_kv_bytes.svg",
        "h2d_bytes_per_token.svg",
    ] {
        let svg = std::fs::read_to_string(plots.join(f))?;
        assert!(svg.starts_with("<svg") && svg.contains("headwise:1"), "{f}");
    }
    Ok(())
}

#[test]
fn kv_dtype_rows_are_lossy_in_the_csv() -> Result<()> {
    // `--kv-dtype f16`: every policy that reads it stores half the bytes and its CSV row
    // says lossy; with f32 nothing is.
    let dir = tempfile::tempdir()?;
    let cfg = dir.path().join("config.json");
    std::fs::write(&cfg, TINY)?;
    let mut lossy = Vec::new();
    for kv in ["f32", "f16"] {
        let csv = dir.path().join(format!("{kv}.csv"));
        let o = kvbench(&[
            "--random-weights",
            "--config",
            &cfg.to_string_lossy(),
            "--cpu",
            "--context",
            "24",
            "--steps",
            "2",
            "--repeats",
            "1",
            "--policies",
            "full,headwise:1",
            "--kv-dtype",
            kv,
            "--csv",
            &csv.to_string_lossy(),
        ])?;
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let text = std::fs::read_to_string(&csv)?;
        let mut lines = text.lines();
        let head: Vec<&str> = lines.next().unwrap_or_default().split(',').collect();
        let at = |name: &str| head.iter().position(|h| *h == name);
        let (Some(l), Some(dev)) = (at("lossy"), at("device_kv_peak_bytes")) else {
            anyhow::bail!("columns missing: {head:?}");
        };
        for row in lines {
            let cells: Vec<&str> = row.split(',').collect();
            lossy.push((
                kv,
                cells[1].to_string(),
                cells[l].to_string(),
                cells[dev].to_string(),
            ));
        }
    }
    for (kv, policy, l, _) in &lossy {
        assert_eq!(
            l,
            if *kv == "f16" { "true" } else { "false" },
            "{kv} {policy}"
        );
    }
    // `full`'s device bytes halve.
    let full = |kv: &str| -> Result<u64> {
        let row = lossy
            .iter()
            .find(|(k, p, _, _)| *k == kv && p == "full")
            .ok_or_else(|| anyhow::anyhow!("no full row for {kv}"))?;
        Ok(row.3.parse()?)
    };
    assert_eq!(2 * full("f16")?, full("f32")?);
    Ok(())
}

#[test]
fn quick_runs_two_short_contexts() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let cfg = dir.path().join("config.json");
    std::fs::write(&cfg, TINY)?;
    let o = kvbench(&[
        "--quick",
        "--random-weights",
        "--config",
        &cfg.to_string_lossy(),
        "--cpu",
        "--policies",
        "full,layer",
    ])?;
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("steps 4; repeats 1"), "{out}");
    let rows: Vec<&str> = out
        .lines()
        .filter(|l| l.starts_with("| 64 |") || l.starts_with("| 256 |"))
        .collect();
    assert_eq!(rows.len(), 4, "{out}");
    Ok(())
}

#[test]
fn bad_variants_and_outputs_are_clear_errors() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let cfg = dir.path().join("config.json");
    std::fs::write(&cfg, TINY)?;
    let c = cfg.to_string_lossy().into_owned();
    let missing = dir
        .path()
        .join("no/such/dir/out.csv")
        .to_string_lossy()
        .into_owned();
    for (extra, needle) in [
        (vec!["--policies", "bogus"], "unknown KV policy `bogus`"),
        (
            vec!["--policies", "recompute:half"],
            "the `recompute` policy's setting `split` = half",
        ),
        (
            vec!["--policies", "full:lots"],
            "the `full` policy's setting `budget` = lots",
        ),
        (
            vec!["--policies", "headwise:zero"],
            "neither `auto` nor a positive number",
        ),
        (
            vec!["--context", "600"],
            "exceeds the model's 512 positions",
        ),
        (vec!["--steps", "0"], "--steps must be at least 1"),
        // The message names kvbench's own spelling of a head group, not the examples' flag.
        (
            vec!["--policies", "headwise:3"],
            "headwise:group=3 does not divide the model's 4 KV heads; use one of 1, 2, 4 or auto",
        ),
        (vec!["--csv", missing.as_str()], "does not exist"),
        (
            vec!["--llamacpp", "python3"],
            "--llamacpp needs a GGUF model (--gguf, or the default)",
        ),
    ] {
        let mut args = vec![
            "--random-weights",
            "--config",
            c.as_str(),
            "--cpu",
            "--repeats",
            "1",
        ];
        for (flag, value) in [("--context", "8"), ("--steps", "1")] {
            if !extra.contains(&flag) {
                args.extend([flag, value]);
            }
        }
        args.extend(extra.iter().copied());
        let o = kvbench(&args)?;
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{extra:?}: {err}");
        assert!(
            err.contains(needle),
            "{extra:?}: stderr lacks {needle:?}:\n{err}"
        );
        assert!(!err.contains("panicked"), "{err}");
    }
    Ok(())
}

#[test]
fn stock_anchor_for_gguf_llama_unless_no_stock() -> Result<()> {
    let g = common::default_gguf()?.to_string_lossy().into_owned();
    let base = [
        "--gguf",
        g.as_str(),
        "--cpu",
        "--context",
        "8",
        "--steps",
        "1",
        "--repeats",
        "1",
        "--policies",
        "full",
    ];
    let o = kvbench(&base)?;
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stdout).contains("| 8 | stock |"));
    let mut args = base.to_vec();
    args.push("--no-stock");
    let o = kvbench(&args)?;
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(!String::from_utf8_lossy(&o.stdout).contains("stock"));
    Ok(())
}

#[test]
fn bandwidth_adds_the_bound_and_the_copy_time() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let cfg = dir.path().join("config.json");
    std::fs::write(&cfg, TINY)?;
    let cfg = cfg.to_string_lossy().into_owned();
    let args = |mib: &'static str| {
        [
            "--random-weights",
            "--config",
            &cfg,
            "--cpu",
            "--context",
            "24",
            "--steps",
            "2",
            "--repeats",
            "1",
            "--policies",
            "full,layer",
            "--link-bandwidth",
            "10MB",
            "--bandwidth-mib",
            mib,
        ]
        .map(String::from)
    };
    let o = Command::new(common::example_bin("kvbench"))
        .args(args("1"))
        .output()?;
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // On the CPU the pageable path copies nothing; the engine goes through the 10 MB/s link
    // (slow enough that a step's copies show in the four decimals of the table).
    let line = stdout
        .lines()
        .find(|l| l.starts_with("host→device bandwidth: pageable n/a (CPU); transfer engine "))
        .ok_or_else(|| anyhow::anyhow!("no bandwidth line in {stdout}"))?;
    let gbs: f64 = line
        .split("transfer engine ")
        .nth(1)
        .and_then(|r| r.split(" GB/s").next())
        .ok_or_else(|| anyhow::anyhow!("no engine bandwidth in {line}"))?
        .parse()?;
    assert!(gbs > 0.0 && gbs <= 0.011, "{line}");
    assert!(
        stdout.contains(
            "| PCIe bound s/token | s/token | bound ÷ s/token | copy s/token | link busy ÷ decode |"
        ),
        "{stdout}"
    );
    // `layer` moves its whole history every step: the bound is positive and cannot be beaten
    // by much (the bound and the step are measured separately), and the link was busy (the
    // copies themselves run inside the wire time and may round to 0 s/token).
    let row: Vec<&str> = stdout
        .lines()
        .find(|l| l.starts_with("| 24 | layer |"))
        .ok_or_else(|| anyhow::anyhow!("no layer row in {stdout}"))?
        .split('|')
        .map(str::trim)
        .collect();
    let n = row.len();
    let (of_bound, copy, busy): (f64, f64, f64) = (
        row[n - 4].parse()?,
        row[n - 3].parse()?,
        row[n - 2].parse()?,
    );
    assert!(of_bound > 0.0 && of_bound <= 1.5, "{row:?}");
    assert!(copy >= 0.0, "{row:?}");
    assert!(busy > 0.0, "{row:?}");
    // A zero-sized probe is an error, not a division by zero.
    let o = Command::new(common::example_bin("kvbench"))
        .args(args("0"))
        .output()?;
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("--bandwidth-mib must be at least 1"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    Ok(())
}

#[test]
fn llamacpp_with_a_python_that_cannot_run_it_is_a_clear_error() -> Result<()> {
    // The default GGUF, one context: the policies' rows run, then the llama.cpp row fails
    // before anything is printed as a result.
    let gguf = common::default_gguf()?;
    let g = gguf.to_string_lossy().into_owned();
    let common_args = [
        "--gguf",
        &g,
        "--cpu",
        "--context",
        "4",
        "--steps",
        "1",
        "--repeats",
        "1",
        "--policies",
        "full",
        "--no-stock",
    ];
    let mut args = common_args.to_vec();
    args.extend(["--llamacpp", "/nonexistent/python3"]);
    let o = kvbench(&args)?;
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("--llamacpp /nonexistent/python3: cannot run it; give a Python interpreter with llama-cpp-python==0.3.36 installed"),
        "{err}"
    );
    // An interpreter that fails, as a Python without llama-cpp-python does: its status and
    // how to install llama-cpp-python.
    let mut args = common_args.to_vec();
    args.extend(["--llamacpp", "/bin/false"]);
    let o = kvbench(&args)?;
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("failed") && err.contains("pip install llama-cpp-python==0.3.36"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    Ok(())
}

#[test]
fn auto_budget_variants_sweep_and_chart() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let cfg = dir.path().join("config.json");
    std::fs::write(&cfg, TINY)?;
    let charts = dir.path().join("charts");
    let s = |p: &std::path::Path| p.to_string_lossy().into_owned();
    let o = kvbench(&[
        "--random-weights",
        "--config",
        &s(&cfg),
        "--cpu",
        "--context",
        "24",
        "--steps",
        "2",
        "--repeats",
        "1",
        "--policies",
        "full,auto:1MiB,auto:8MiB",
        "--plot",
        &s(&charts),
    ])?;
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(
        out.contains("| 24 | auto:1MiB |") && out.contains("| 24 | auto:8MiB |"),
        "{out}"
    );
    assert!(charts.join("auto_budget.svg").is_file());
    // A budget that is not a size names the variant.
    let o = kvbench(&[
        "--random-weights",
        "--config",
        &s(&cfg),
        "--cpu",
        "--context",
        "8",
        "--steps",
        "1",
        "--policies",
        "auto:lots",
    ])?;
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("the `auto` policy's setting `budget` = lots: cannot parse the size"),
        "{err}"
    );
    Ok(())
}

#[test]
fn a_downstream_policy_runs_by_name() -> Result<()> {
    // `sinks` comes from examples/custom-policy, a crate on kvpolicy's public API; the
    // runner and kvbench build it by name like the built-in ones.
    let dir = tempfile::tempdir()?;
    let cfg = dir.path().join("config.json");
    std::fs::write(&cfg, TINY)?;
    let o = kvbench(&[
        "--quick",
        "--random-weights",
        "--config",
        &cfg.to_string_lossy(),
        "--cpu",
        "--policies",
        "full,sinks",
    ])?;
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.lines().any(|l| l.contains("sinks")), "{out}");
    // Nothing is evicted below 1,024 tokens: the same tokens as `full`.
    let g = common::fixture("llama_gqa");
    let run = |policy: &str| -> Result<String> {
        let o = common::cli::llama(&[
            "--model-dir",
            &g.to_string_lossy(),
            "--prompt-ids",
            "1,2,3,4",
            "--max-new-tokens",
            "6",
            "--temperature",
            "0",
            "--policy",
            policy,
        ])?;
        anyhow::ensure!(
            o.status.success(),
            "{policy}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        Ok(String::from_utf8_lossy(&o.stdout).into_owned())
    };
    assert_eq!(run("sinks")?, run("full")?);
    Ok(())
}

#[test]
fn a_disk_tier_row_reports_its_reads() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let cfg = dir.path().join("config.json");
    std::fs::write(&cfg, TINY)?;
    let disk = dir.path().join("disk");
    std::fs::create_dir(&disk)?;
    let o = kvbench(&[
        "--quick",
        "--random-weights",
        "--config",
        &cfg.to_string_lossy(),
        "--cpu",
        "--policies",
        "full,layer",
        "--disk-dir",
        &disk.to_string_lossy(),
    ])?;
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.lines()
            .any(|l| l.starts_with("disk tier: layer at ") && l.contains("MB/s during decode")),
        "{out}"
    );
    assert_eq!(std::fs::read_dir(&disk)?.count(), 0);
    // A synthetic history (random K/V through append_kv) read through the page cache.
    let synthetic = |policies: &str| {
        kvbench(&[
            "--random-weights",
            "--config",
            &cfg.to_string_lossy(),
            "--cpu",
            "--context",
            "300",
            "--steps",
            "2",
            "--repeats",
            "1",
            "--policies",
            policies,
            "--synthetic-history",
            "--disk-dir",
            &disk.to_string_lossy(),
            "--disk-io",
            "buffered",
        ])
    };
    let o = synthetic("full,headwise:1")?;
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("history: synthetic"), "{out}");
    assert!(
        out.lines()
            .any(|l| l.starts_with("disk tier: headwise:1 at 300: ")
                && l.contains("(buffered reads)")),
        "{out}"
    );
    // `auto` places restored units as it would when attending; `recompute` stores layer
    // inputs, not K/V, and refuses, naming `append_kv`.
    let o = synthetic("auto")?;
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = synthetic("recompute")?;
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("append_kv"), "{err}");
    assert_eq!(std::fs::read_dir(&disk)?.count(), 0);
    Ok(())
}

//! kvbench's arguments checked before the sweep (issue "Hardening II", item 9): an empty
//! setting after `POLICY:` is an error, not the default; `--repeats 0` measures nothing and
//! is refused; `--synthetic-history` with a policy that cannot take it fails before the
//! other policies are measured; and a CSV named as `/dev/stdout` reaches a pipe. The
//! read-bandwidth probe beside it (`examples/membw.rs`, scripts/scale_bench.py's roofline)
//! prints its JSON and refuses a buffer the caches would hold.
mod common;

use std::process::{Command, Output};

use anyhow::{ensure, Result};

const TINY: &str = r#"{"model_type": "llama", "hidden_size": 32, "intermediate_size": 32,
 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
 "vocab_size": 64, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
 "rope_theta": 10000.0}"#;

fn kvbench(cfg: &std::path::Path, args: &[&str]) -> Result<Output> {
    Ok(Command::new(common::example_bin("kvbench"))
        .args(["--random-weights", "--config"])
        .arg(cfg)
        .args(["--cpu", "--context", "32", "--steps", "2", "--no-stock"])
        .args(args)
        .output()?)
}

/// Exit code 1 with `needle`, and no table printed (nothing was measured).
fn refused(o: &Output, needle: &str) -> Result<()> {
    let err = String::from_utf8_lossy(&o.stderr);
    ensure!(
        o.status.code() == Some(1),
        "exit {:?}: {err}",
        o.status.code()
    );
    ensure!(err.contains(needle), "stderr lacks {needle:?}: {err}");
    let out = String::from_utf8_lossy(&o.stdout);
    ensure!(!out.contains("| policy"), "a table was printed: {out}");
    Ok(())
}

#[test]
fn bad_sweep_arguments_fail_before_any_measurement() -> Result<()> {
    let d = tempfile::tempdir()?;
    let cfg = d.path().join("config.json");
    std::fs::write(&cfg, TINY)?;
    for p in ["auto:", "headwise:", "recompute:"] {
        let o = kvbench(&cfg, &["--policies", p])?;
        refused(&o, "nothing follows the colon")?;
    }
    let o = kvbench(&cfg, &["--policies", "full", "--repeats", "0"])?;
    refused(&o, "--repeats must be at least 1")?;
    // `recompute` takes no synthetic history (it stores layer inputs, not K/V): refused
    // before `full` is measured.
    let disk = d.path().join("disk");
    std::fs::create_dir(&disk)?;
    let o = kvbench(
        &cfg,
        &["--policies", "full,recompute", "--synthetic-history"],
    )?;
    refused(&o, "--synthetic-history with `recompute`")?;
    Ok(())
}

#[test]
fn a_csv_on_stdout_reaches_a_pipe() -> Result<()> {
    let d = tempfile::tempdir()?;
    let cfg = d.path().join("config.json");
    std::fs::write(&cfg, TINY)?;
    let o = Command::new("sh")
        .arg("-c")
        .arg(r#""$@" --csv /dev/stdout | cat"#)
        .arg("sh")
        .arg(common::example_bin("kvbench"))
        .args(["--random-weights", "--config"])
        .arg(&cfg)
        .args([
            "--cpu",
            "--context",
            "32",
            "--steps",
            "2",
            "--no-stock",
            "--policies",
            "full",
        ])
        .args(["--repeats", "1"])
        .output()?;
    let err = String::from_utf8_lossy(&o.stderr);
    ensure!(o.status.success(), "{err}");
    let out = String::from_utf8_lossy(&o.stdout);
    ensure!(
        out.lines().any(|l| l.starts_with("context,policy,")),
        "no CSV header in stdout: {out}"
    );
    Ok(())
}

#[test]
fn membw_prints_its_json_and_refuses_a_cache_sized_buffer() -> Result<()> {
    let bin = common::example_bin("membw");
    let o = Command::new(&bin)
        .args(["--mib", "64", "--threads", "2", "--passes", "1"])
        .output()?;
    ensure!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout)?;
    ensure!(v["threads"] == 2 && v["mib"] == 64, "{v}");
    ensure!(v["read_gb_s"].as_f64().is_some_and(|g| g > 0.0), "{v}");
    for (flag, value, needle) in [
        ("--mib", "8", "--mib must be at least 64"),
        ("--passes", "0", "--passes must be at least 1"),
    ] {
        let o = Command::new(&bin).args([flag, value]).output()?;
        let err = String::from_utf8_lossy(&o.stderr);
        ensure!(
            o.status.code() == Some(1) && err.contains(needle),
            "{flag} {value}: {:?} {err}",
            o.status.code()
        );
        ensure!(
            o.stdout.is_empty(),
            "printed a result: {}",
            String::from_utf8_lossy(&o.stdout)
        );
    }
    Ok(())
}

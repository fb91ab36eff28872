//! The disk tier's checks before any work (issue "Hardening II", items 6 and 7): a
//! `--disk-dir` where no file can be made, a file system without room for the K/V that must
//! go there, and an open-file limit too low for the files a batch would hold are one-line
//! errors before the model runs; a soft limit below the hard one is raised instead.
//! (Item 8 — files unnamed from the start, mode 0600, nothing left after SIGKILL — is in
//! `tests/signals.rs`.)
mod common;

use std::process::{Command, Output};

use anyhow::{ensure, Result};

fn fixture() -> String {
    common::fixture("llama_gqa").to_string_lossy().into_owned()
}

#[test]
fn a_disk_dir_where_no_file_can_be_made_fails_before_any_work() -> Result<()> {
    // /proc takes no new files (a read-only file system answers the same way, EROFS);
    // root ignores permission bits, so a mode-0500 directory would not show it in CI.
    let o = common::cli::llama(&[
        "--model-dir",
        &fixture(),
        "--prompt-ids",
        "1,2,3",
        "--policy",
        "headwise",
        "--disk-dir",
        "/proc",
    ])?;
    common::cli::one_line_error(
        &o,
        true,
        &[
            "--disk-dir /proc cannot hold the disk tier's files",
            "writable",
        ],
    )
}

#[test]
fn a_disk_without_room_fails_before_any_work() -> Result<()> {
    // Two layers of 64 KV heads × 256 on a 64-wide model: 256 KiB of f32 K/V per token and
    // layer, so 16M tokens need 8 TiB on disk — more than any test machine has free.
    let d = tempfile::tempdir()?;
    let cfg = d.path().join("config.json");
    std::fs::write(
        &cfg,
        serde_json::json!({
            "model_type": "llama", "hidden_size": 64, "intermediate_size": 64,
            "num_attention_heads": 64, "num_key_value_heads": 64, "head_dim": 256,
            "num_hidden_layers": 2, "vocab_size": 64, "max_position_embeddings": 1 << 25,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": true
        })
        .to_string(),
    )?;
    let disk = d.path().join("disk");
    std::fs::create_dir(&disk)?;
    let o = common::cli::llama(&[
        "--random-weights",
        "--config",
        &cfg.to_string_lossy(),
        "--prompt-ids",
        "1,2,3",
        "--max-new-tokens",
        "16000000",
        "--policy",
        "headwise",
        "--disk-dir",
        &disk.to_string_lossy(),
    ])?;
    common::cli::one_line_error(
        &o,
        true,
        &[
            "--disk-dir",
            "free, but the disk tier needs at least",
            "16000003 tokens",
        ],
    )?;
    ensure!(std::fs::read_dir(&disk)?.count() == 0);
    // A short run of the same model passes the check and runs.
    let o = common::cli::llama(&[
        "--random-weights",
        "--config",
        &cfg.to_string_lossy(),
        "--prompt-ids",
        "1,2,3",
        "--max-new-tokens",
        "2",
        "--policy",
        "headwise",
        "--disk-dir",
        &disk.to_string_lossy(),
    ])?;
    ensure!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    Ok(())
}

/// Runs 17 prompts as a batch under `headwise` with the disk tier (every layer on disk,
/// unless `extra` gives a host budget), after `ulimit`.
fn batch_under(ulimit: &str, extra: &[&str]) -> Result<Output> {
    let d = tempfile::tempdir()?;
    let prompts = d.path().join("p.jsonl");
    std::fs::write(&prompts, "[1, 2, 3]\n".repeat(17))?;
    let disk = d.path().join("disk");
    std::fs::create_dir(&disk)?;
    let o = Command::new("sh")
        .arg("-c")
        .arg(format!("{ulimit} && exec \"$@\""))
        .arg("sh")
        .arg(common::example_bin("llama"))
        .args(["--model-dir", &fixture(), "--max-new-tokens", "2"])
        .args(["--policy", "headwise", "--disk-dir"])
        .arg(&disk)
        .arg("--prompts-file")
        .arg(&prompts)
        .args(extra)
        .output()?;
    ensure!(std::fs::read_dir(&disk)?.count() == 0, "files left on disk");
    Ok(o)
}

#[test]
fn an_open_file_limit_too_low_for_the_batch_fails_before_any_work() -> Result<()> {
    // The hard limit itself is low: 17 requests × 3 layers cannot be held open.
    let o = batch_under("ulimit -n 100", &[])?;
    common::cli::one_line_error(&o, true, &["open-file limit is 100", "ulimit -n"])
}

#[test]
fn a_low_soft_open_file_limit_is_raised() -> Result<()> {
    // Only the soft limit is low (the common `ulimit -Sn 1024`, scaled to this fixture):
    // the run raises it to the hard one and completes.
    let o = batch_under("ulimit -Sn 60", &[])?;
    let err = String::from_utf8_lossy(&o.stderr);
    ensure!(o.status.success(), "{err}");
    ensure!(String::from_utf8_lossy(&o.stdout).lines().count() == 17);
    // A host budget that holds every layer: no file will be opened, nothing is refused.
    let o = batch_under("ulimit -n 100", &["--host-kv-budget", "1GiB"])?;
    let err = String::from_utf8_lossy(&o.stderr);
    ensure!(o.status.success(), "{err}");
    Ok(())
}

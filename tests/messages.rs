//! The CLI's messages name the flag or field at fault and suggest only what applies
//! (issue 16, item 8): sizes past 64 bits, config fields of the wrong type, hybrid's ratio,
//! the `layer` policy's budget hint, batch errors, flags the chosen policy ignores, and a
//! simulated link so slow that a step takes minutes.
mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use anyhow::Result;
use common::cli::{fails_with, llama};

fn gqa() -> String {
    common::fixture("llama_gqa").to_string_lossy().into_owned()
}

/// Runs with `args` on the GQA fixture; must succeed; returns stderr.
fn warns(args: &[&str]) -> Result<String> {
    let g = gqa();
    let mut all = vec![
        "--model-dir",
        &g,
        "--prompt-ids",
        "1,2",
        "--max-new-tokens",
        "2",
    ];
    all.extend(args);
    let o = llama(&all)?;
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    anyhow::ensure!(o.status.success(), "{args:?}: {err}");
    Ok(err)
}

#[test]
fn sizes_past_64_bits_are_named_so() -> Result<()> {
    let g = gqa();
    for big in ["1000000000000TiB", "18446744073709551616"] {
        // The latter used to saturate silently, the former to say "at least one byte".
        fails_with(
            &[
                "--model-dir",
                &g,
                "--prompt-ids",
                "1",
                "--device-kv-budget",
                big,
            ],
            "does not fit in 64 bits",
        )?;
    }
    Ok(())
}

#[test]
fn a_config_value_of_the_wrong_type_names_its_field() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let text = std::fs::read_to_string(common::fixture("llama_gqa").join("config.json"))?;
    let mut cfg: serde_json::Value = serde_json::from_str(&text)?;
    cfg["hidden_size"] = (-64).into();
    let path = dir.path().join("config.json");
    std::fs::write(&path, cfg.to_string())?;
    fails_with(
        &[
            "--random-weights",
            "--config",
            &path.to_string_lossy(),
            "--prompt-ids",
            "1",
        ],
        "field `hidden_size`: invalid value: integer `-64`",
    )
}

#[test]
fn policy_errors_suggest_what_applies() -> Result<()> {
    let g = gqa();
    let base = ["--model-dir", g.as_str(), "--prompt-ids", "1,2"];
    let run = |extra: &[&str]| -> Result<String> {
        let mut a = base.to_vec();
        a.extend(extra);
        let o = llama(&a)?;
        anyhow::ensure!(!o.status.success(), "{extra:?} succeeded");
        Ok(String::from_utf8_lossy(&o.stderr).into_owned())
    };
    let e = run(&["--policy", "hybrid", "--kv-act-ratio", "1.5"])?;
    assert!(e.contains("--kv-act-ratio 1.5 is outside [0, 1]"), "{e}");
    assert!(!e.contains("inconsistent attention step"), "{e}");
    // `layer` has no head groups: its hint points at headwise, not at --head-group.
    let e = run(&["--policy", "layer", "--device-kv-budget", "10"])?;
    assert!(e.contains("use `--policy headwise`"), "{e}");
    assert!(!e.contains("--head-group"), "{e}");
    Ok(())
}

#[test]
fn a_batch_error_says_invalid_input_once() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let prompts = dir.path().join("p.jsonl");
    std::fs::write(&prompts, "[1, 2]\n[1, 2, 3]\n")?;
    fails_with(
        &[
            "--model-dir",
            &gqa(),
            "--prompts-file",
            &prompts.to_string_lossy(),
            "--max-new-tokens",
            "200",
        ],
        "error: invalid input: prompt 1 of the batch: prompt (2 tokens)",
    )
}

#[test]
fn flags_the_policy_does_not_read_are_warned_about() -> Result<()> {
    let e = warns(&["--head-group", "1", "--block-size", "4"])?;
    assert!(
        e.contains("warning: --head-group does not apply to the `full` policy and is ignored (it is read by headwise)"),
        "{e}"
    );
    assert!(
        e.contains("warning: --block-size does not apply to the `full` policy"),
        "{e}"
    );
    let e = warns(&[
        "--policy",
        "layer",
        "--recompute-split",
        "1",
        "--kv-act-ratio",
        "0.5",
    ])?;
    assert!(
        e.contains("--recompute-split does not apply to the `layer` policy"),
        "{e}"
    );
    assert!(e.contains("(it is read by hybrid)"), "{e}");
    // Defaults and flags the policy reads: no warning.
    let e = warns(&[
        "--policy",
        "headwise",
        "--head-group",
        "1",
        "--link-bandwidth",
        "1GB",
    ])?;
    assert!(!e.contains("warning"), "{e}");
    Ok(())
}

#[test]
fn a_link_that_makes_steps_take_minutes_is_warned_about() -> Result<()> {
    // 1 B/s: the run would go on for hours; the warning comes before the first step, then
    // the test stops the child.
    let bin = common::example_bin("llama");
    let mut child = Command::new(bin)
        .args([
            "--model-dir",
            &gqa(),
            "--prompt-ids",
            "1,2",
            "--policy",
            "layer",
        ])
        .args(["--link-bandwidth", "1B", "--max-new-tokens", "2"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()?;
    let stderr = child
        .stderr
        .take()
        .ok_or_else(|| anyhow::anyhow!("no stderr"))?;
    let first = BufReader::new(stderr).lines().next().transpose()?;
    child.kill()?;
    child.wait()?;
    let line = first.unwrap_or_default();
    assert!(
        line.starts_with(
            "warning: --link-bandwidth 1 B/s makes a decode step at 4 tokens take up to 51 minutes"
        ),
        "{line}"
    );
    Ok(())
}

#[test]
fn a_default_model_that_cannot_be_fetched_says_where_to_put_it() -> Result<()> {
    // Gemma 3 270M (the gemma example's default) with an empty cache and fetching forbidden:
    // an error naming the model, the cache path and what to do; nothing is created there.
    let cache = tempfile::tempdir()?;
    let o = Command::new(common::example_bin("gemma"))
        .args(["--prompt-ids", "2,3"])
        .env("KVPOLICY_CACHE", cache.path())
        .env("HF_HUB_OFFLINE", "1")
        .output()?;
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("Gemma 3 270M is not cached at")
            && err.contains("gemma-3-270m-q4_k_m.gguf")
            && err.contains("HF_HUB_OFFLINE forbids fetching it; place the GGUF there, or pass --gguf/--model-dir"),
        "{err}"
    );
    assert_eq!(std::fs::read_dir(cache.path())?.count(), 0);
    Ok(())
}

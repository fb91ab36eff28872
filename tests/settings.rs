//! Policies' own settings and metrics through the command line (issue 28): `--list-policies`
//! lists every policy's settings with types, defaults and docs; a spec's settings reach the
//! policy (`sinks:sinks=2,window=4`, `headwise:group=1` = `--head-group 1`); bad specs are
//! one-line errors naming the policy, the key and the valid keys; policy metrics reach the
//! summary, `--stats-out` (`"policy_metrics"`) and kvbench's CSV; `sinks` is labeled lossy.
mod common;

use std::process::{Command, Output};

use anyhow::{ensure, Context, Result};
use common::cli::{llama, one_line_error};

fn gqa() -> String {
    common::fixture("llama_gqa").to_string_lossy().into_owned()
}

/// The `llama` example on the GQA fixture: 12 prompt tokens, 8 generated, greedy.
fn run(extra: &[&str]) -> Result<Output> {
    let g = gqa();
    let mut args = vec![
        "--model-dir",
        &g,
        "--prompt-ids",
        "1,2,3,4,5,6,7,8,9,10,11,12",
        "--max-new-tokens",
        "8",
        "--prefill-chunk",
        "4",
    ];
    args.extend(extra);
    llama(&args)
}

/// `--stats-out` of a run with `extra`.
fn stats(extra: &[&str]) -> Result<serde_json::Value> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("stats.json");
    let p = path.to_string_lossy().into_owned();
    let mut args = extra.to_vec();
    args.extend(["--stats-out", &p]);
    let o = run(&args)?;
    ensure!(
        o.status.success(),
        "{extra:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    Ok(serde_json::from_str(&std::fs::read_to_string(&path)?)?)
}

#[test]
fn list_policies_names_every_setting_with_type_default_and_doc() -> Result<()> {
    let o = llama(&["--list-policies"])?;
    ensure!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = String::from_utf8_lossy(&o.stdout);
    for needle in [
        "headwise:group=<auto|N> (default auto; flag --head-group)",
        "recompute:split=<integer >= 0> (default unset; flag --recompute-split)",
        "hybrid:block_size=<integer >= 0> (default 16; flag --block-size)",
        "hybrid:kv_act_ratio=<number> (default unset; flag --kv-act-ratio)",
        "sinks:sinks=<integer >= 0> (default 4)",
        "sinks:window=<integer >= 0> (default 1020)",
        "auto:budget=<bytes> (default unset; flag --device-kv-budget)",
        "Recent tokens every query attends to",
        "APPROXIMATE",
    ] {
        ensure!(
            out.contains(needle),
            "--list-policies lacks {needle:?}:\n{out}"
        );
    }
    for name in kvpolicy::policy_names().into_iter().chain(["sinks"]) {
        ensure!(
            out.lines().any(|l| l == name),
            "--list-policies lacks {name}:\n{out}"
        );
    }
    let bench = Command::new(common::example_bin("kvbench"))
        .arg("--list-policies")
        .output()?;
    ensure!(bench.status.success());
    // kvbench's settings are specs only: the same listing without the runner's flags.
    let listed = String::from_utf8_lossy(&bench.stdout);
    for needle in [
        "headwise:group=<auto|N> (default auto)",
        "sinks:window=<integer >= 0> (default 1020)",
        "auto:budget=<bytes> (default unset)",
    ] {
        ensure!(
            listed.contains(needle),
            "kvbench lacks {needle:?}:\n{listed}"
        );
    }
    ensure!(
        !listed.contains("--"),
        "kvbench lists a flag it does not have:\n{listed}"
    );
    Ok(())
}

#[test]
fn bad_specs_are_one_line_errors_naming_policy_key_and_valid_keys() -> Result<()> {
    for (spec, needles) in [
        (
            "headwise:grp=1",
            &[
                "`headwise` policy has no setting `grp`",
                "its settings are: group, budget",
            ][..],
        ),
        (
            "full:group=1",
            &[
                "`full` policy has no setting `group`",
                "its settings are: budget",
            ],
        ),
        (
            "layer:lots",
            &["`layer` policy's setting `budget` = lots", "bytes"],
        ),
        (
            "headwise:group=x",
            &[
                "`headwise` policy's setting `group` = x",
                "(expected: auto|N)",
            ],
        ),
        (
            "hybrid:block_size=-1",
            &[
                "`hybrid` policy's setting `block_size` = -1",
                "integer >= 0",
            ],
        ),
        (
            "auto:budget=lots",
            &["`auto` policy's setting `budget` = lots", "bytes"],
        ),
        (
            "sinks:window=0",
            &["invalid option for the `sinks` policy: sinks:window=0: every query"],
        ),
        (
            "headwise:",
            &[
                "cannot parse the policy spec `headwise:`",
                "nothing follows the colon",
            ],
        ),
        ("headwise:group=1,2", &["`2` is not `key=value`"]),
        (
            "nosuch:a=1",
            &["unknown KV policy `nosuch`", "valid policies are: full"],
        ),
        (
            "sinks:window=4,budget=1GiB",
            &[
                "`sinks` policy has no setting `budget`",
                "its settings are: sinks, window",
            ],
        ),
    ] {
        let o = run(&["--policy", spec])?;
        one_line_error(&o, true, needles).with_context(|| spec.to_string())?;
    }
    Ok(())
}

#[test]
fn alias_flags_and_spec_settings_are_one_thing() -> Result<()> {
    let by_flag = stats(&["--policy", "headwise", "--head-group", "1"])?;
    let by_spec = stats(&["--policy", "headwise:group=1"])?;
    let auto = stats(&["--policy", "headwise"])?;
    // GQA fixture: 2 KV heads; one head per group streams half a layer's bytes at a time.
    ensure!(by_flag["h2d_bytes"] == by_spec["h2d_bytes"]);
    ensure!(by_flag["device_kv_peak_bytes"] == by_spec["device_kv_peak_bytes"]);
    ensure!(
        by_spec["device_kv_peak_bytes"].as_u64() < auto["device_kv_peak_bytes"].as_u64(),
        "group=1 {} vs auto {}",
        by_spec["device_kv_peak_bytes"],
        auto["device_kv_peak_bytes"]
    );
    // A spec key wins over its alias flag.
    let both = stats(&["--policy", "headwise:group=1", "--head-group", "2"])?;
    ensure!(both["device_kv_peak_bytes"] == by_spec["device_kv_peak_bytes"]);
    // The budget key sets the device budget: too small is the budget error.
    let o = run(&["--policy", "headwise:budget=1KiB"])?;
    one_line_error(
        &o,
        true,
        &["device KV budget exceeded", "--device-kv-budget"],
    )?;
    Ok(())
}

#[test]
fn sinks_takes_its_settings_reports_evictions_and_is_labeled_lossy() -> Result<()> {
    // 12 prompt + 8 generated tokens: 2 sinks + a window of 4 evict.
    let small = stats(&["--policy", "sinks:sinks=2,window=4"])?;
    let evicted = &small["policy_metrics"]["evicted_tokens"];
    ensure!(
        evicted["unit"] == "tokens" && evicted["kind"] == "counter",
        "{small}"
    );
    let n = evicted["value"].as_u64().context("evicted_tokens")?;
    ensure!(n > 0 && n <= 20 - 2 - 4, "evicted {n}");
    ensure!(small["lossy"] == true, "{small}");
    // The defaults (4 + 1,020) hold the whole run: nothing evicted.
    let default = stats(&["--policy", "sinks"])?;
    ensure!(default["policy_metrics"]["evicted_tokens"]["value"] == 0);
    // The summary names the metric and the approximation.
    let o = run(&["--policy", "sinks:window=4"])?;
    let err = String::from_utf8_lossy(&o.stderr);
    ensure!(o.status.success(), "{err}");
    ensure!(err.contains("sinks: evicted_tokens "), "{err}");
    ensure!(err.contains("LOSSY: an approximate policy"), "{err}");
    Ok(())
}

#[test]
fn a_batch_under_sinks_is_lossy_and_counts_evictions() -> Result<()> {
    // Each request gets its own `sinks` (one instance per sequence): the batch's stats say
    // lossy and sum the evictions.
    let dir = tempfile::tempdir()?;
    let prompts = dir.path().join("prompts.jsonl");
    std::fs::write(
        &prompts,
        "[1,2,3,4,5,6,7,8,9,10,11,12]\n[5,6,7,8,9,10,11,12,13,14]\n",
    )?;
    let path = dir.path().join("stats.json");
    let o = llama(&[
        "--model-dir",
        &gqa(),
        "--prompts-file",
        &prompts.to_string_lossy(),
        "--max-new-tokens",
        "8",
        "--policy",
        "sinks:sinks=2,window=4",
        "--stats-out",
        &path.to_string_lossy(),
    ])?;
    let err = String::from_utf8_lossy(&o.stderr);
    ensure!(o.status.success(), "{err}");
    ensure!(
        err.contains("LOSSY: logits differ from full (an approximate policy)"),
        "{err}"
    );
    let st: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path)?)?;
    ensure!(st["lossy"] == true, "{st}");
    let evicted = st["policy_metrics"]["evicted_tokens"]["value"].as_u64();
    ensure!(evicted > Some(0), "{st}");
    Ok(())
}

#[test]
fn kvbench_takes_specs_with_settings_and_writes_metric_columns() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let csv = dir.path().join("sweep.csv");
    let o = Command::new(common::example_bin("kvbench"))
        .args([
            "--model-dir",
            &gqa(),
            "--cpu",
            "--context",
            "16",
            "--steps",
            "2",
            "--repeats",
            "1",
            "--prefill-chunk",
            "4",
            "--policies",
            "full,sinks:sinks=2,window=4,headwise:group=1,auto:budget=64MiB",
            "--csv",
            &csv.to_string_lossy(),
        ])
        .output()?;
    let err = String::from_utf8_lossy(&o.stderr);
    ensure!(o.status.success(), "{err}");
    let text = std::fs::read_to_string(&csv)?;
    let mut lines = text.lines();
    let header = lines.next().context("empty csv")?;
    ensure!(
        header.ends_with(",evicted_tokens,resident_units,streamed_units,demotions"),
        "{header}"
    );
    let rows: Vec<&str> = lines.collect();
    ensure!(rows.len() == 4, "{text}");
    let sinks = rows
        .iter()
        .find(|r| r.contains("\"sinks:sinks=2,window=4\""))
        .context("no quoted sinks row")?;
    // Evicted lazily: after the 4th prefill chunk of 4 the tail holds 14 tokens, more than
    // 2 × window + the chunk, and keeps the last 4 (10 dropped); the 2 decode steps bring it
    // to 6, under 2 × 4 + 1.
    ensure!(sinks.ends_with(",10,,,"), "{sinks}");
    let stdout = String::from_utf8_lossy(&o.stdout);
    ensure!(stdout.contains("evicted_tokens 10 tokens"), "{stdout}");
    // A setting after a spec without settings is named, not glued onto its name.
    let o = Command::new(common::example_bin("kvbench"))
        .args([
            "--model-dir",
            &gqa(),
            "--cpu",
            "--policies",
            "full,budget=1GiB",
        ])
        .output()?;
    one_line_error(
        &o,
        true,
        &["`budget=1GiB` follows `full`", "write full:budget=1GiB"],
    )?;
    // A bad setting fails before any work, in kvbench's words.
    let o = Command::new(common::example_bin("kvbench"))
        .args([
            "--model-dir",
            &gqa(),
            "--cpu",
            "--policies",
            "headwise:group=x",
        ])
        .output()?;
    one_line_error(&o, true, &["`headwise` policy's setting `group` = x"])?;
    Ok(())
}

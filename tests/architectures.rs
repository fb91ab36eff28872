//! Every architecture through its example, as other tools drive it: `--model-dir … --prompt-ids
//! … --decode-ids … --dump-logits` under every policy, single-pass and chunked, equals HF
//! transformers' logits; unsupported configs are clear errors naming the field.
mod common;

use std::path::Path;
use std::process::{Command, Output};

use anyhow::{Context, Result};
use candle_core::Tensor;
use kvpolicy::models::engine::generate::kv_shape;
use kvpolicy::PolicyOptions;

const TOL: f32 = 1e-4;

/// The example that runs a fixture's `model_type`.
fn example_of(dir: &Path) -> Result<&'static str> {
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json"))?)?;
    Ok(
        match cfg["model_type"]
            .as_str()
            .context("fixture without model_type")?
        {
            "mistral" => "mistral",
            "qwen2" => "qwen",
            "gemma" | "gemma2" | "gemma3_text" => "gemma",
            "opt" => "opt",
            _ => "llama",
        },
    )
}

fn run(example: &str, args: &[&str]) -> Result<Output> {
    let bin = common::example_bin(example);
    anyhow::ensure!(bin.is_file(), "example binary missing at {}", bin.display());
    Ok(Command::new(bin).args(args).output()?)
}

#[test]
fn every_fixture_under_every_policy_matches_hf_through_the_cli() -> Result<()> {
    let names = common::hf_fixtures();
    for arch in [
        "llama_gqa",
        "mistral",
        "qwen2",
        "gemma",
        "gemma2",
        "gemma3",
        "opt",
    ] {
        assert!(names.iter().any(|n| n == arch), "fixture {arch} missing");
    }
    let join = |v: &[u32]| v.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
    let tmp = tempfile::tempdir()?;
    let out = tmp.path().join("l.npy");
    let out_s = out.to_string_lossy().into_owned();
    let policies: [&[&str]; 7] = [
        &["--policy", "full"],
        &["--policy", "auto"],
        &["--policy", "layer"],
        &["--policy", "headwise", "--head-group", "1"],
        &["--policy", "headwise"],
        &["--policy", "recompute"],
        &["--policy", "recompute", "--recompute-split", "16"],
    ];
    for name in &names {
        let dir = common::fixture(name);
        let example = example_of(&dir)?;
        let (prompt, decode) = common::fixture_ids(name)?;
        let want = common::fixture_logits(name)?;
        let dir_s = dir.to_string_lossy().into_owned();
        let (p, d) = (join(&prompt), join(&decode));
        // `auto` with a budget for the streaming buffers, a step's scratch and half the
        // layers resident, planned as the policy plans it for a prefill chunk of `step`.
        let info = common::load_fixture(name)?.model.info().clone();
        let total = prompt.len() + decode.len();
        let budget_for = |step: usize| {
            let shape = kv_shape(&info, 1, total, step);
            let grow = PolicyOptions::default().grow_tokens;
            let cap = total.div_ceil(grow) * grow;
            let unit = shape.kv_bytes(info.n_kv_heads, cap);
            let scratch = shape.step_scratch_bytes(info.n_kv_heads, cap, &candle_core::Device::Cpu);
            ((2 + info.n_layers as u64 / 2) * unit + scratch).to_string()
        };
        let budgets = [budget_for(prompt.len()), budget_for(5)];
        let stats = tmp.path().join("stats.json");
        let stats_s = stats.to_string_lossy().into_owned();
        let with_budget: [&str; 5] = [
            "--policy",
            "auto",
            "--stats-out",
            &stats_s,
            "--device-kv-budget",
        ];
        for policy in policies.iter().copied().chain([&with_budget[..]]) {
            for (chunk, budget) in ["0", "5"].into_iter().zip(&budgets) {
                let mut args = vec![
                    "--model-dir",
                    &dir_s,
                    "--prompt-ids",
                    &p,
                    "--decode-ids",
                    &d,
                    "--dtype",
                    "f32",
                    "--cpu",
                    "--prefill-chunk",
                    chunk,
                    "--dump-logits",
                    &out_s,
                ];
                args.extend_from_slice(policy);
                if policy.contains(&"--stats-out") {
                    args.push(budget);
                }
                let o = run(example, &args)?;
                assert!(
                    o.status.success(),
                    "{name} {policy:?}: {}",
                    String::from_utf8_lossy(&o.stderr)
                );
                let got = Tensor::read_npy(&out)?;
                assert_eq!(got.dims(), want.dims(), "{name} {policy:?}");
                let diff = common::max_abs_diff(&got, &want)?;
                assert!(
                    diff <= TOL,
                    "{name} {policy:?} chunk {chunk}: max |Δ| = {diff}"
                );
                if policy.contains(&"--stats-out") {
                    // The budget left some units resident and streamed the others.
                    let st: serde_json::Value =
                        serde_json::from_str(&std::fs::read_to_string(&stats)?)?;
                    let m = &st["policy_metrics"];
                    let (r, s) = (&m["resident_units"]["value"], &m["streamed_units"]["value"]);
                    assert!(
                        r.as_u64() > Some(0) && s.as_u64() > Some(0),
                        "{name} chunk {chunk}: resident {r}, streamed {s}"
                    );
                }
            }
        }
    }
    Ok(())
}

/// Copies a fixture with its config.json edited by `edit`.
fn edited_fixture(name: &str, to: &Path, edit: impl Fn(&mut serde_json::Value)) -> Result<String> {
    let src = common::fixture(name);
    std::fs::copy(src.join("model.safetensors"), to.join("model.safetensors"))?;
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json"))?)?;
    edit(&mut cfg);
    std::fs::write(to.join("config.json"), cfg.to_string())?;
    Ok(to.to_string_lossy().into_owned())
}

fn fails(example: &str, dir: &str, needle: &str) -> Result<()> {
    let o = run(
        example,
        &[
            "--model-dir",
            dir,
            "--prompt-ids",
            "1,2",
            "--max-new-tokens",
            "2",
        ],
    )?;
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{needle}: {err}");
    assert!(err.contains(needle), "stderr lacks {needle:?}:\n{err}");
    assert!(!err.contains("panicked"), "{err}");
    Ok(())
}

#[test]
fn unsupported_configs_are_errors_naming_the_field() -> Result<()> {
    type Edit = Box<dyn Fn(&mut serde_json::Value)>;
    let cases: Vec<(&str, &str, Edit, &str)> = vec![
        (
            "llama_gqa",
            "llama",
            Box::new(|c| {
                c.as_object_mut().map(|o| o.remove("model_type"));
            }),
            "config: field `model_type`: missing",
        ),
        (
            "llama_gqa",
            "llama",
            Box::new(|c| c["model_type"] = "mamba".into()),
            "config: field `model_type`: `mamba` is not supported; supported architectures are llama, mistral, qwen2, gemma, gemma2, gemma3_text, opt",
        ),
        (
            "qwen2",
            "qwen",
            Box::new(|c| c["rope_scaling"] = serde_json::json!({"rope_type": "yarn", "factor": 4.0})),
            "config: field `rope_scaling.rope_type`: `yarn` is not supported",
        ),
        (
            "opt",
            "opt",
            Box::new(|c| c["do_layer_norm_before"] = false.into()),
            "config: field `do_layer_norm_before`: false (the post-norm layout of OPT-350M) is not supported",
        ),
        (
            "opt",
            "opt",
            Box::new(|c| c["word_embed_proj_dim"] = 32.into()),
            "config: field `word_embed_proj_dim`",
        ),
        (
            "gemma2",
            "gemma",
            Box::new(|c| c["layer_types"] = serde_json::json!(["sliding_attention", "chunked_attention", "full_attention"])),
            "config: field `layer_types`: `chunked_attention` is not supported",
        ),
        (
            "gemma2",
            "gemma",
            Box::new(|c| c["attn_logit_softcapping"] = 0.0.into()),
            "config: field `attn_logit_softcapping`",
        ),
        (
            "mistral",
            "mistral",
            Box::new(|c| c["hidden_act"] = "softsign".into()),
            "config: field `hidden_act`: `softsign` is not supported",
        ),
    ];
    for (fixture, example, edit, needle) in cases {
        let dir = tempfile::tempdir()?;
        let d = edited_fixture(fixture, dir.path(), edit)?;
        fails(example, &d, needle)?;
    }
    Ok(())
}

#[test]
fn an_example_refuses_another_architecture() -> Result<()> {
    let opt = common::fixture("opt").to_string_lossy().into_owned();
    fails(
        "mistral",
        &opt,
        "the `mistral` example runs mistral models, but",
    )?;
    fails("mistral", &opt, "run `--example opt`")?;
    // Only `llama` and `gemma` have a default model.
    let o = run("qwen", &["--prompt", "hi"])?;
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("the `qwen` example needs a model"), "{err}");
    Ok(())
}

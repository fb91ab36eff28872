//! The example CLI as other tools use it: output files in the documented formats, and every
//! bad input answered with a clear message, a non-zero exit, no panic and no output file.
mod common;

use common::cli::{fails_with, llama};

use std::path::Path;

use anyhow::Result;
use candle_core::Tensor;

fn fixture_dir() -> String {
    common::fixture("llama_gqa").to_string_lossy().into_owned()
}

#[test]
fn writes_logits_ids_and_stats_in_the_documented_formats() -> Result<()> {
    let name = "llama_gqa";
    let (prompt, decode) = common::fixture_ids(name)?;
    let join = |v: &[u32]| v.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
    let dir = tempfile::tempdir()?;
    let p = |f: &str| dir.path().join(f).to_string_lossy().into_owned();
    let o = llama(&[
        "--model-dir",
        &fixture_dir(),
        "--prompt-ids",
        &join(&prompt),
        "--decode-ids",
        &join(&decode),
        "--prefill-chunk",
        "5",
        "--dump-logits",
        &p("l.npy"),
        "--ids-out",
        &p("ids.json"),
        "--stats-out",
        &p("s.json"),
    ])?;
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let got = Tensor::read_npy(p("l.npy"))?;
    let want = common::fixture_logits(name)?;
    assert_eq!(got.dims(), want.dims());
    assert!(common::max_abs_diff(&got, &want)? <= 1e-4);
    let ids: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(p("ids.json"))?)?;
    assert_eq!(common::ids_of(&ids["prompt_ids"])?, prompt);
    assert_eq!(common::ids_of(&ids["generated_ids"])?, decode);
    let stats: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(p("s.json"))?)?;
    for key in [
        "policy",
        "model",
        "prefill_tokens",
        "prefill_s",
        "decode_tokens",
        "decode_s",
        "device_kv_peak_bytes",
        "h2d_bytes",
        "d2h_bytes",
        "host_kv_bytes",
    ] {
        assert!(stats.get(key).is_some(), "stats lack {key}: {stats}");
    }
    assert_eq!(stats["policy"], "full");
    assert_eq!(stats["prefill_tokens"], prompt.len());
    assert_eq!(stats["decode_tokens"], decode.len());
    Ok(())
}

#[test]
fn unknown_policy_lists_the_valid_ones() -> Result<()> {
    fails_with(
        &[
            "--model-dir",
            &fixture_dir(),
            "--prompt-ids",
            "1",
            "--policy",
            "bogus",
        ],
        "unknown KV policy `bogus`; valid policies are: full",
    )
}

#[test]
fn missing_model_files() -> Result<()> {
    fails_with(
        &["--gguf", "/nonexistent/model.gguf", "--prompt-ids", "1"],
        "--gguf /nonexistent/model.gguf: no such file",
    )?;
    fails_with(
        &["--model-dir", "/nonexistent-dir", "--prompt-ids", "1"],
        "has no config.json",
    )
}

#[test]
fn non_gguf_and_truncated_gguf() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let junk = dir.path().join("junk.gguf");
    std::fs::write(&junk, b"this is not a model at all")?;
    let junk_s = junk.to_string_lossy().into_owned();
    fails_with(
        &["--gguf", &junk_s, "--prompt-ids", "1"],
        "is not a GGUF file",
    )?;

    let full = std::fs::read(common::default_gguf()?)?;
    for (cut, needle) in [
        (2_000_000usize, "is truncated: tensor"),
        (100_000, "damaged or truncated GGUF header"),
    ] {
        let t = dir.path().join(format!("cut{cut}.gguf"));
        std::fs::write(&t, &full[..cut])?;
        fails_with(
            &["--gguf", &t.to_string_lossy(), "--prompt-ids", "1"],
            needle,
        )?;
    }
    Ok(())
}

fn copy_fixture(to: &Path) -> Result<()> {
    std::fs::create_dir_all(to)?;
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(common::fixture("llama_gqa").join(f), to.join(f))?;
    }
    Ok(())
}

#[test]
fn config_that_disagrees_with_the_weights() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let m = dir.path().join("m");
    copy_fixture(&m)?;
    let cfg = std::fs::read_to_string(m.join("config.json"))?
        .replace("\"intermediate_size\": 112", "\"intermediate_size\": 128");
    std::fs::write(m.join("config.json"), cfg)?;
    fails_with(
        &["--model-dir", &m.to_string_lossy(), "--prompt-ids", "1"],
        "check that config.json belongs to these weights",
    )?;

    let cfg = std::fs::read_to_string(common::fixture("llama_gqa").join("config.json"))?.replace(
        "\"rope_scaling\": null",
        "\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4.0}",
    );
    std::fs::write(m.join("config.json"), cfg)?;
    fails_with(
        &["--model-dir", &m.to_string_lossy(), "--prompt-ids", "1"],
        "field `rope_scaling.rope_type`: `yarn` is not supported",
    )
}

#[test]
fn truncated_safetensors() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let m = dir.path().join("m");
    copy_fixture(&m)?;
    let w = std::fs::read(m.join("model.safetensors"))?;
    std::fs::write(m.join("model.safetensors"), &w[..w.len() / 2])?;
    fails_with(
        &["--model-dir", &m.to_string_lossy(), "--prompt-ids", "1"],
        "is truncated",
    )
}

#[test]
fn token_ids_outside_the_vocabulary() -> Result<()> {
    fails_with(
        &["--model-dir", &fixture_dir(), "--prompt-ids", "1,999"],
        "prompt token 1 is id 999, but the vocabulary has 384 tokens",
    )?;
    fails_with(
        &[
            "--model-dir",
            &fixture_dir(),
            "--prompt-ids",
            "1",
            "--decode-ids",
            "5,384",
        ],
        "decode token 1 is id 384",
    )
}

#[test]
fn empty_prompt() -> Result<()> {
    fails_with(
        &[
            "--gguf",
            &common::default_gguf()?.to_string_lossy(),
            "--prompt",
            "",
        ],
        "the prompt is empty",
    )
}

#[test]
fn longer_than_the_model_positions() -> Result<()> {
    fails_with(
        &[
            "--model-dir",
            &fixture_dir(),
            "--prompt-ids",
            "1,2,3",
            "--max-new-tokens",
            "200",
        ],
        "exceeds the model's 128 positions",
    )
}

#[test]
fn prompt_text_without_a_tokenizer() -> Result<()> {
    fails_with(
        &["--model-dir", &fixture_dir(), "--prompt", "hello"],
        "this model has no tokenizer",
    )
}

#[test]
fn offload_option_errors() -> Result<()> {
    let f = fixture_dir();
    let cases: [(&str, &str, &str, &str); 5] = [
        (
            "headwise",
            "--device-kv-budget",
            "12 parsecs",
            "cannot parse the size `12 parsecs`",
        ),
        (
            "headwise",
            "--head-group",
            "3",
            "--head-group 3 does not divide the model's 2 KV heads",
        ),
        (
            "headwise",
            "--head-group",
            "zero",
            "neither `auto` nor a positive number",
        ),
        (
            "headwise",
            "--device-kv-budget",
            "1KiB",
            "budget is smaller than one head group's buffers",
        ),
        (
            "full",
            "--device-kv-budget",
            "1KiB",
            "use `--policy headwise`",
        ),
    ];
    for (policy, flag, value, needle) in cases {
        fails_with(
            &[
                "--model-dir",
                &f,
                "--prompt-ids",
                "1",
                "--policy",
                policy,
                flag,
                value,
            ],
            needle,
        )?;
    }
    Ok(())
}

#[test]
fn random_weights_from_a_config() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let stats = dir.path().join("s.json");
    let cfg = common::fixture("llama3_rope").join("config.json");
    let o = llama(&[
        "--random-weights",
        "--config",
        &cfg.to_string_lossy(),
        "--prompt-ids",
        "1,2,3,4",
        "--max-new-tokens",
        "3",
        "--policy",
        "headwise",
        "--head-group",
        "1",
        "--stats-out",
        &stats.to_string_lossy(),
    ])?;
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let s: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(stats)?)?;
    assert_eq!(s["policy"], "headwise");
    assert!(s["h2d_bytes"].as_u64().is_some_and(|b| b > 0), "{s}");
    assert!(s["d2h_bytes"].as_u64().is_some_and(|b| b > 0), "{s}");
    fails_with(
        &[
            "--random-weights",
            "--config",
            "/nonexistent.json",
            "--prompt-ids",
            "1",
        ],
        "--config /nonexistent.json: no such file",
    )?;
    // A directory where a file belongs says so, naming the flag.
    let dir = tempfile::tempdir()?;
    let d = dir.path().to_string_lossy().into_owned();
    fails_with(
        &["--random-weights", "--config", &d, "--prompt-ids", "1"],
        &format!("--config {d} is a directory; give a config.json file"),
    )?;
    fails_with(
        &["--gguf", &d, "--prompt-ids", "1"],
        &format!("--gguf {d} is a directory; give a .gguf file"),
    )
}

#[test]
fn generation_option_errors() -> Result<()> {
    let f = fixture_dir();
    let cases: [(&[&str], &str); 4] = [
        (
            &["--dtype", "f64"],
            "unknown --dtype `f64`; use f32, f16 or bf16",
        ),
        (
            &["--temperature=-1"],
            "--temperature -1 must be a finite number ≥ 0",
        ),
        (
            &["--temperature", "0.5", "--top-p", "1.5"],
            "--top-p 1.5 must be in (0, 1]",
        ),
        (
            &["--tokenizer", "/nonexistent/tokenizer.json"],
            "cannot load /nonexistent/tokenizer.json",
        ),
    ];
    for (extra, needle) in cases {
        let mut args = vec!["--model-dir", f.as_str(), "--prompt-ids", "1,2"];
        args.extend_from_slice(extra);
        fails_with(&args, needle)?;
    }
    // Offline, a hub id that is not in the local hub cache is a clear error.
    fails_with(
        &["--model-id", "nobody/no-such-model", "--prompt-ids", "1"],
        "not in the local hub cache and HF_HUB_OFFLINE is set",
    )
}

#[test]
fn seeded_sampling_repeats_and_bf16_runs() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let f = fixture_dir();
    let run = |out: &str, extra: &[&str]| -> Result<Vec<u32>> {
        let path = dir.path().join(out);
        let p = path.to_string_lossy().into_owned();
        let mut args = vec![
            "--model-dir",
            f.as_str(),
            "--prompt-ids",
            "5,6,7",
            "--max-new-tokens",
            "12",
            "--ids-out",
            p.as_str(),
        ];
        args.extend_from_slice(extra);
        let o = llama(&args)?;
        anyhow::ensure!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path)?)?;
        common::ids_of(&v["generated_ids"])
    };
    let sampled = ["--temperature", "0.9", "--top-p", "0.95", "--seed", "7"];
    let a = run("a.json", &sampled)?;
    let b = run("b.json", &sampled)?;
    assert!(!a.is_empty());
    assert_eq!(a, b, "same seed, same tokens");
    let c = run(
        "c.json",
        &[
            "--dtype",
            "bf16",
            "--policy",
            "headwise",
            "--head-group",
            "1",
        ],
    )?;
    assert!(!c.is_empty() && c.len() <= 12);
    Ok(())
}

#[test]
fn chat_template_wraps_the_prompt() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let out = dir.path().join("ids.json");
    let gguf = common::default_gguf()?;
    let o = llama(&[
        "--gguf",
        &gguf.to_string_lossy(),
        "--chat",
        "--prompt",
        "Hi",
        "--max-new-tokens",
        "1",
        "--ids-out",
        &out.to_string_lossy(),
    ])?;
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out)?)?;
    let ids = common::ids_of(&v["prompt_ids"])?;
    // SmolLM2's template: <|im_start|>system … <|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n
    let refs = common::llamacpp_refs()?;
    let chat = &refs["tokenizations"][5]; // "<|im_start|>user\nHi there<|im_end|>…" with special tokens
    let im_start = common::ids_of(&chat["ids"])?[0];
    assert_eq!(ids[0], im_start, "{ids:?}");
    assert_eq!(ids.iter().filter(|&&t| t == im_start).count(), 3, "{ids:?}");
    Ok(())
}

#[test]
fn recompute_option_errors_and_stats() -> Result<()> {
    let f = common::fixture("llama_mha").to_string_lossy().into_owned();
    let dir = tempfile::tempdir()?;
    let write = |name: &str, text: &str| -> Result<String> {
        let p = dir.path().join(name);
        std::fs::write(&p, text)?;
        Ok(p.to_string_lossy().into_owned())
    };
    let garbage = write("garbage.json", "{\"h2d_bytes_per_s\": ")?;
    let zero = write(
        "zero.json",
        r#"{"h2d_bytes_per_s": 1e9, "recompute_tokens_per_s": 0}"#,
    )?;
    let missing = dir.path().join("nope.json").to_string_lossy().into_owned();
    let good = write(
        "good.json",
        r#"{"h2d_bytes_per_s": 1e9, "recompute_tokens_per_s": 1e9}"#,
    )?;
    let base = [
        "--model-dir",
        &f,
        "--prompt-ids",
        "1,2,3",
        "--policy",
        "recompute",
    ];
    for (flag, value, needle) in [
        ("--profile", garbage.as_str(), "cannot use the profile"),
        ("--profile", zero.as_str(), "`recompute_tokens_per_s` is 0"),
        ("--profile", missing.as_str(), "nope.json"),
        (
            "--recompute-split",
            "40",
            "--recompute-split 40 is beyond the sequence",
        ),
        (
            "--recompute-split",
            "half",
            "invalid value 'half' for '--recompute-split <N>'",
        ),
        (
            "--link-bandwidth",
            "0",
            "invalid value '0' for '--link-bandwidth <BYTES>'",
        ),
    ] {
        let mut args = base.to_vec();
        args.extend(["--max-new-tokens", "4", flag, value]);
        fails_with(&args, needle)?;
    }
    // A valid profile where regeneration is fast: the MHA fixture recomputes, and says so.
    let stats = dir.path().join("s.json");
    let mut args = base.to_vec();
    let s = stats.to_string_lossy().into_owned();
    args.extend([
        "--max-new-tokens",
        "4",
        "--profile",
        &good,
        "--stats-out",
        &s,
    ]);
    let o = llama(&args)?;
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&stats)?)?;
    assert_eq!(v["policy"], "recompute");
    assert!(
        v["policy_metrics"]["split"]["value"].as_u64().unwrap_or(0) > 0,
        "{v}"
    );
    assert!(v["recompute_tokens"].as_u64().unwrap_or(0) > 0, "{v}");
    Ok(())
}

#[test]
fn fuzz_found_inputs_are_errors() -> Result<()> {
    // A GGUF whose `embedding_length` (0x8080…) once sized a 2 GB RoPE table before the
    // tensors were consulted (found by `cargo fuzz run gguf` under a 2 GB limit): sizes are
    // now checked against the tensors first (this file has none: its layer count is the
    // first size found wanting).
    let f = common::fixture("fuzz/gguf-oom-embedding-length.gguf");
    fails_with(
        &["--gguf", &f.to_string_lossy(), "--prompt-ids", "1"],
        "the metadata does not match the tensors",
    )
}

#[test]
fn random_prompt_and_peak_rss() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let (ids, stats) = (dir.path().join("i.json"), dir.path().join("s.json"));
    let run = |seed: &str| {
        llama(&[
            "--model-dir",
            &fixture_dir(),
            "--random-prompt",
            "7",
            "--seed",
            seed,
            "--max-new-tokens",
            "1",
            "--ids-out",
            &ids.to_string_lossy(),
            "--stats-out",
            &stats.to_string_lossy(),
        ])
    };
    let o = run("5")?;
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let first: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&ids)?)?;
    let p = first["prompt_ids"].as_array().map_or(0, Vec::len);
    assert_eq!(p, 7, "{first}");
    let s: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&stats)?)?;
    assert!(s["peak_rss_bytes"].as_u64().is_some_and(|b| b > 0), "{s}");
    // The same seed draws the same prompt; another seed another one.
    assert!(run("5")?.status.success());
    let again: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&ids)?)?;
    assert_eq!(first["prompt_ids"], again["prompt_ids"]);
    assert!(run("6")?.status.success());
    let other: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&ids)?)?;
    assert_ne!(first["prompt_ids"], other["prompt_ids"]);
    Ok(())
}

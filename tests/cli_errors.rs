//! The example CLI given bad input: every bad model file, request and option answered with
//! a clear message, a non-zero exit, no panic and no output file.
mod common;

use common::cli::fails_with;

use std::path::Path;

use anyhow::Result;

fn fixture_dir() -> String {
    common::fixture("llama_gqa").to_string_lossy().into_owned()
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

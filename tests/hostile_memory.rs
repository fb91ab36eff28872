//! Peak memory for hostile model directories (issue "Hardening III"): a config.json at its
//! 16 MiB cap (900,000 `layer_types`), one past it, a safetensors header of tens of MiB of
//! tiny entries, and a tokenizer.json of a few million vocabulary entries each end in a
//! one-line error (or, for the tokenizer, a run) whose peak resident memory stays within
//! [`bound`]: 256 MiB for the program and its test model, plus 32× the bytes of the files
//! the directory holds. Measured by the kernel (`getrusage` of the children, one test in
//! this binary so that no other child counts).
mod common;

use std::path::Path;
use std::process::Output;

use anyhow::{ensure, Result};
use serde_json::json;

/// The stated bound for a directory holding `bytes` of files.
fn bound(bytes: u64) -> u64 {
    (256 << 20) + 32 * bytes
}

/// The largest resident set of any child so far, in bytes.
fn children_peak_rss() -> u64 {
    let mut u = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage fills the struct it is given.
    unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, u.as_mut_ptr()) };
    // SAFETY: zeroed, then filled by getrusage.
    let u = unsafe { u.assume_init() };
    u.ru_maxrss as u64 * 1024
}

fn dir_bytes(dir: &Path) -> Result<u64> {
    let mut n = 0;
    for e in std::fs::read_dir(dir)? {
        n += e?.metadata()?.len();
    }
    Ok(n)
}

fn run(dir: &Path, extra: &[&str]) -> Result<Output> {
    Ok(std::process::Command::new(common::example_bin("llama"))
        .arg("--model-dir")
        .arg(dir)
        .args(["--max-new-tokens", "1"])
        .args(extra)
        .env("HF_HUB_OFFLINE", "1")
        .env("RAYON_NUM_THREADS", "1")
        .output()?)
}

/// A safetensors file whose header lists `n` one-element tensors.
fn wide_header(path: &Path, n: usize) -> Result<()> {
    let mut header = serde_json::Map::new();
    for i in 0..n {
        header.insert(
            format!("t{i}"),
            json!({"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]}),
        );
    }
    let h = serde_json::Value::Object(header).to_string();
    let mut bytes = (h.len() as u64).to_le_bytes().to_vec();
    bytes.extend(h.as_bytes());
    bytes.extend(vec![0u8; 4 * n]);
    std::fs::write(path, bytes)?;
    Ok(())
}

#[test]
fn hostile_directories_stay_within_the_stated_memory_bound() -> Result<()> {
    // The kernel reports a running maximum over the children: the cases run from the
    // smallest expected peak to the largest, so each is held to its own bound.
    let mut report = Vec::new();
    let mut check = |what: &str, dir: &Path, o: Output, must_fail: bool| -> Result<()> {
        let err = String::from_utf8_lossy(&o.stderr);
        ensure!(!err.contains("panicked"), "{what}: {err}");
        if must_fail {
            ensure!(
                o.status.code() == Some(1),
                "{what}: exit {:?}: {err}",
                o.status.code()
            );
            ensure!(err.lines().count() == 1, "{what}: {err}");
        } else {
            ensure!(o.status.success(), "{what}: {err}");
        }
        let (peak, files) = (children_peak_rss(), dir_bytes(dir)?);
        report.push(format!(
            "{what}: peak {} MiB, files {} MiB",
            peak >> 20,
            files >> 20
        ));
        ensure!(
            peak <= bound(files),
            "{what}: peak RSS {peak} > bound {} ({files} bytes of files)",
            bound(files)
        );
        Ok(())
    };

    // config.json at its cap: 900,000 layer types, for 900,000 layers the weights lack.
    let d = common::copy_fixture("llama_gqa")?;
    let n = 900_000;
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(d.path().join("config.json"))?)?;
    cfg["num_hidden_layers"] = json!(n);
    cfg["layer_types"] = json!(vec!["full_attention"; n]);
    let text = cfg.to_string();
    ensure!(text.len() < 16 << 20);
    std::fs::write(d.path().join("config.json"), &text)?;
    let o = run(d.path(), &["--prompt-ids", "1"])?;
    check("config.json of 900,000 layer types", d.path(), o, true)?;

    // One past the cap: refused unread.
    let d = common::copy_fixture("llama_gqa")?;
    let mut big = text.clone();
    big.push_str(&" ".repeat((16 << 20) + 1 - big.len()));
    std::fs::write(d.path().join("config.json"), big)?;
    let o = run(d.path(), &["--prompt-ids", "1"])?;
    check("config.json past its cap", d.path(), o, true)?;

    // A weight file whose header lists 600,000 tensors (~50 MiB of header) the model does
    // not read: it loads, and the run completes.
    let d = common::copy_fixture("llama_gqa")?;
    wide_header(&d.path().join("zz-wide.safetensors"), 600_000)?;
    let o = run(d.path(), &["--prompt-ids", "1"])?;
    check("a 50 MiB safetensors header", d.path(), o, false)?;

    // A tokenizer of two million words: it loads, and the run completes.
    let d = common::copy_fixture("llama_gqa")?;
    let vocab: serde_json::Map<String, serde_json::Value> = (0..2_000_000)
        .map(|i| (format!("w{i}"), json!(i % 384)))
        .collect();
    let tok = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "w0"}
    });
    std::fs::write(d.path().join("tokenizer.json"), tok.to_string())?;
    let o = run(d.path(), &["--prompt", "w1 w2"])?;
    check("a tokenizer of two million words", d.path(), o, false)?;
    eprintln!("{}", report.join("\n"));
    Ok(())
}

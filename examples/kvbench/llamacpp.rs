//! llama.cpp in the same run: `scripts/llamacpp_bench.py` (llama-cpp-python 0.3.36) timed
//! on the same GGUF, prompt ids, decode ids, threads, prefill chunk, steps and repeats as
//! the policies' rows (its KV cache in f32 like ours on the CPU, or f16 with `--kv-dtype f16`), so the `full ÷ llama.cpp`
//! ratios are measured side by side rather than copied from another day.
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result};

use crate::sweep::Row;

/// The timing script, in this repository.
fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/llamacpp_bench.py")
}

/// What the script prints.
#[derive(serde::Deserialize)]
struct Timing {
    prefill_tok_s: f64,
    decode_tok_s: f64,
}

/// How `python` runs llama.cpp on `gguf`.
pub struct LlamaCpp {
    /// The Python with llama-cpp-python installed.
    pub python: PathBuf,
    /// The GGUF file.
    pub gguf: PathBuf,
    /// Threads for prefill and decode (ours: candle's thread count).
    pub threads: usize,
    /// Prefill batch.
    pub chunk: usize,
    /// Its KV cache type (`f32`, `f16` — its default —, `bf16` or `q8_0`): kvbench's
    /// `--kv-dtype`, f32 unless given.
    pub kv_type: &'static str,
}

impl LlamaCpp {
    /// Times `steps` decode steps after `context` prompt tokens, medians of `repeats`.
    pub fn measure(&self, context: usize, steps: usize, repeats: usize) -> Result<Row> {
        let out = Command::new(&self.python)
            .arg(script())
            .arg("--gguf")
            .arg(&self.gguf)
            .args([
                "--context",
                &context.to_string(),
                "--steps",
                &steps.to_string(),
                "--repeats",
                &repeats.max(1).to_string(),
                "--threads",
                &self.threads.to_string(),
                "--chunk",
                &self.chunk.to_string(),
            ])
            .args(["--kv-type", self.kv_type])
            // Its flash attention, as scripts/perf_table.py runs it (it quantizes a V cache
            // only under it).
            .arg("--flash-attn")
            .output()
            .with_context(|| {
                format!(
                    "--llamacpp {}: cannot run it; give a Python interpreter with llama-cpp-python==0.3.36 installed",
                    self.python.display()
                )
            })?;
        anyhow::ensure!(
            out.status.success(),
            "--llamacpp {}: {} failed ({}): {}\ninstall it with `CMAKE_ARGS=-DGGML_NATIVE=OFF {} -m pip install llama-cpp-python==0.3.36`",
            self.python.display(),
            script().display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim(),
            self.python.display()
        );
        let t: Timing = serde_json::from_slice(&out.stdout).with_context(|| {
            format!(
                "--llamacpp: unexpected output from {}: {}",
                script().display(),
                String::from_utf8_lossy(&out.stdout)
            )
        })?;
        Ok(Row::peer(
            context,
            "llama.cpp",
            t.prefill_tok_s,
            t.decode_tok_s,
        ))
    }
}

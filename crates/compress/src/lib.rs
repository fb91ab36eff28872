//! `kvpolicy-compress`: fewer bytes per token from the model itself. Converts a
//! Llama-shaped checkpoint (Llama, Mistral, Qwen2; a local safetensors directory or a GGUF
//! file, dequantized to f32) to fewer KV heads and writes a standard HF directory that every
//! example loads with `--model-dir` and HF transformers loads too.
//!
//! * [`Method::Svd`] — Yu et al., "Effectively Compress KV Heads for LLM" (arXiv 2406.07056)
//!   §3: the KV heads merged into one are replaced by the principal subspace of their
//!   outputs on calibration activations, and the reconstruction maps are folded into the
//!   query and output projections, so no extra matmul runs at inference. Values: a rank-`d`
//!   PCA of the group's concatenated values. Keys: RoPE rotates each pair of channels
//!   `(i, i + d/2)` as one complex number, so a map that commutes with RoPE can only scale
//!   and rotate that number — per frequency, a rank-1 complex PCA of the group's heads
//!   ([`heads`]). The paper handles RoPE by its own construction; this one is exact
//!   whenever the merged heads are complex multiples of each other frequency by frequency.
//! * [`Method::Mean`] — the heads' projections averaged (GQA's conversion, Ainslie et al.
//!   2023 §2; MLKV's converter): the baseline the paper beats.
//!
//! And to fewer KV layers ([`layers`]: MLKV, arXiv 2406.09297 — `num_key_value_layers`, the
//! layers in between reading the cache of the KV layer below them), the group's K/V
//! projections averaged into its KV layer as MLKV's converter does.
//!
//! Training-free: neither method uptrains afterwards (the papers do), so the output is
//! **lossy**. The converter says so in the output's `config.json` (`kvpolicy_conversion`),
//! which the runner shows in its summary and `--stats-out`.
#![deny(missing_docs)]

pub mod calibrate;
pub mod checkpoint;
pub mod error;
pub mod gguf;
pub mod heads;
pub mod layers;
pub mod linalg;
pub mod output;

pub use error::{CompressError, Result};

/// How KV heads are merged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Method {
    /// Principal subspaces of calibration activations, RoPE-aware for keys (the default).
    Svd,
    /// The heads' projections averaged.
    Mean,
}

impl Method {
    /// The name used on the command line and in `config.json`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Svd => "svd",
            Self::Mean => "mean",
        }
    }
}

/// The key `config.json` carries for a converted model: what was done, and that it is lossy.
pub const CONVERSION_KEY: &str = "kvpolicy_conversion";

//! `kvpolicy-kernels`: the custom ops the policies run on the device.
//!
//! * [`HeadsInto`] — KVPR §3.1 / HybridServe §4.1's regeneration epilogue: after the
//!   `X·W` projection (cuBLAS through candle), one kernel splits the projected rows into
//!   heads, applies RoPE to K at the tokens' positions, and writes the result straight into
//!   the destination K (or V) buffer — a strided view of the policy's device buffer — with
//!   no intermediate tensors. It is a candle in-place op: the CUDA kernel runs with the
//!   `cuda` feature, and its `cpu_fwd` is the reference implementation, so the CPU tests
//!   cover the semantics (checked against plain tensor code in `tests`).
//!
//! * [`flash_attn`] — exact attention with scratch bounded by tiles (online softmax,
//!   per-tile masks from positions, GQA without repeating K/V, soft-cap, windows), returning
//!   each row's log-sum-exp; every policy's attention runs through it.
//!
//! * [`quant`] — CPU quantized matmul for GGML's formats: integer dot products per block
//!   for a few activation rows (Q4_0 … Q8_0, Q4_K, Q6_K; AVX2/AVX-VNNI with runtime
//!   detection, a portable fallback) and, for a prefill chunk, an integer GEMM over weight
//!   panels repacked per call (the same formats; AVX-512 VNNI, AVX-VNNI or AVX2
//!   micro-kernels), on candle's CPU worker pool.
//!
//! * `gather` (feature `cuda`) — CLO §4's zero-copy transfer: a kernel gathers pages
//!   from page-locked host memory mapped into the device's address space.
//!
//! Without the `cuda` feature nothing is compiled for the GPU and the build script does
//! nothing; the CPU path is always available.
#![deny(missing_docs)]
#![deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

pub mod flash;
pub mod heads_into;
mod heads_layout;
pub mod quant;

pub use flash::{
    flash_attn, flash_attn_runs, CallShape, FlashAttn, FlashOut, FlashParams, KvRun, TILE_KEYS,
    TILE_ROWS,
};
pub use heads_into::{heads_into, HeadsInto, Rotation};

#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "cuda")]
pub mod gather;
#[cfg(feature = "cuda")]
mod ptx;

//! What every model offers the generation loop: a forward pass that takes the KV policy as
//! an argument, so one loaded model runs under every policy.
use candle_core::{DType, Device, Tensor};
use kvpolicy_core::KvPolicy;

use crate::error::Result;

/// Which positions' logits a forward pass returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitsMode {
    /// Only the last position: `(b, 1, vocab)`.
    Last,
    /// Every position: `(b, t, vocab)`.
    All,
}

/// Shape and identity of a loaded model.
#[derive(Clone, Debug)]
pub struct ModelInfo {
    /// Architecture (`llama`, …).
    pub architecture: String,
    /// Where it was loaded from, for reports.
    pub source: String,
    /// Vocabulary size (logit width).
    pub vocab_size: usize,
    /// Longest sequence (prompt + generation) the model supports.
    pub max_positions: usize,
    /// Decoder layers.
    pub n_layers: usize,
    /// Query heads.
    pub n_heads: usize,
    /// KV heads.
    pub n_kv_heads: usize,
    /// Head width.
    pub head_dim: usize,
    /// Model width.
    pub hidden: usize,
    /// Width of the feed-forward layer's inner activations.
    pub intermediate: usize,
    /// Activation dtype.
    pub dtype: DType,
    /// Compute device.
    pub device: Device,
    /// Beginning-of-sequence token, if the model has one.
    pub bos: Option<u32>,
    /// End-of-sequence tokens.
    pub eos: Vec<u32>,
    /// Per layer, its sliding attention window in tokens (`None`: global attention).
    pub windows: Vec<Option<usize>>,
    /// A LOSSY conversion the model's files declare (`kvpolicy-compress` writes
    /// `kvpolicy_conversion` into config.json), in a few words; `None` for a model as
    /// published. Runs on a converted model say so in their summaries and stats.
    pub conversion: Option<String>,
    /// Per decoder layer, the KV layer whose cache it attends — the policy's layer index
    /// ([`AttnStep::layer`](kvpolicy_core::AttnStep)): `0, 1, 2, …` when every layer
    /// projects K/V; with MLKV (`num_key_value_layers`) a layer without projections repeats
    /// its owner's. Empty: every layer its own.
    pub kv_layer: Vec<usize>,
    /// Rows of a forward pass from which its matmuls take another kernel, with other
    /// rounding: quantized weights on the CPU run the integer GEMM (or dequantize) for a
    /// pass of this many tokens or more and dot row by row below it
    /// ([`DEQUANT_MIN_ROWS`](crate::arch::layers::DEQUANT_MIN_ROWS)).
    /// `None`: a token's numbers do not depend on how many tokens share its pass. A prefill
    /// resumed after restored K/V splits its passes so that each token takes the kernel a
    /// fresh prefill would ([`crate::engine::reuse`]).
    pub row_split: Option<usize>,
}

impl ModelInfo {
    /// Layers that project K/V: the layers a policy stores ([`KvShape::n_layers`](kvpolicy_core::KvShape)).
    pub fn kv_layers(&self) -> usize {
        self.kv_layer.last().map_or(self.n_layers, |l| l + 1)
    }

    /// Whether some layers read another layer's cache (MLKV).
    pub fn shares_kv(&self) -> bool {
        self.kv_layers() < self.n_layers
    }

    /// The sliding window of each KV layer (its owner layer's; readers share it).
    pub fn kv_windows(&self) -> Vec<Option<usize>> {
        if self.kv_layer.is_empty() {
            return self.windows.clone();
        }
        let mut out = vec![None; self.kv_layers()];
        for (i, &k) in self.kv_layer.iter().enumerate().rev() {
            out[k] = self.windows.get(i).copied().flatten();
        }
        out
    }

    /// Per KV layer, how many other layers read its cache; empty without sharing.
    pub fn kv_readers(&self) -> Vec<usize> {
        if !self.shares_kv() {
            return Vec::new();
        }
        let mut out = vec![0; self.kv_layers()];
        for &k in &self.kv_layer {
            out[k] += 1;
        }
        out.iter().map(|n| n - 1).collect()
    }

    /// Device bytes of activations one layer step holds at once per token, besides the KV
    /// and the attention scratch: the larger of the attention phase (residual, normalised
    /// input, query projections before and after RoPE, new K/V, the f32 attention output and
    /// its reshaped copy) and the MLP phase (residual, its sum, normalised input, gate, up,
    /// activation and product). An estimate from the tensor shapes, used to plan budgets.
    pub fn activation_bytes_per_token(&self) -> u64 {
        let e = self.dtype.size_in_bytes();
        let (h, q, kv) = (
            self.hidden,
            self.n_heads * self.head_dim,
            self.n_kv_heads * self.head_dim,
        );
        let attention = e * (2 * h + 3 * q + 4 * kv) + 4 * 2 * self.n_heads * (self.head_dim + 1);
        let mlp = e * (3 * h + 4 * self.intermediate);
        attention.max(mlp) as u64
    }
}

/// One request's tokens in a ragged batch step: `ids` continue sequence `seq` at `pos`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeqChunk {
    /// The sequence's slot ([`kvpolicy_core::AttnStep::seq`]).
    pub seq: usize,
    /// Position of `ids[0]` in the sequence.
    pub pos: usize,
    /// The tokens (a prompt piece, or one decode token).
    pub ids: Vec<u32>,
}

/// A causal language model whose attention goes through a [`KvPolicy`].
pub trait CausalLm: Send + Sync {
    /// Shape and identity.
    fn info(&self) -> &ModelInfo;
    /// Runs tokens `ids` `(b, t)` whose first token sits at `pos`, returning f32 logits.
    fn forward(
        &self,
        ids: &Tensor,
        pos: usize,
        policy: &mut dyn KvPolicy,
        mode: LogitsMode,
    ) -> Result<Tensor>;
    /// Runs a ragged batch: `groups` are mini-batches of chunks of different sequences
    /// (any lengths, each at its own position), run layer by layer across the mini-batches
    /// (HybridServe's column-by-column schedule). Returns f32 logits per chunk, in the
    /// order of the flattened groups: `(1, vocab)` for [`LogitsMode::Last`], `(t, vocab)`
    /// for [`LogitsMode::All`]. `policy` must keep one cache per sequence
    /// ([`KvPolicy::as_batched`]).
    fn forward_batch(
        &self,
        groups: &[Vec<SeqChunk>],
        policy: &mut dyn KvPolicy,
        mode: LogitsMode,
    ) -> Result<Vec<Tensor>> {
        let _ = (groups, policy, mode);
        Err(crate::error::ModelError::Input(
            format!(
                "{} models do not run ragged batches",
                self.info().architecture
            )
            .into(),
        ))
    }
}

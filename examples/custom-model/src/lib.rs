//! A model kvpolicy does not ship, written on candle-nn, with kvpolicy's policies plugged
//! into its attention layer: how a user gives their own model long-context KV policies.
//!
//! [`TinyLm`] is a small pre-norm decoder (learned absolute positions, grouped-query
//! attention, a GELU MLP, tied embeddings) built from a [`candle_nn::VarBuilder`]. Its
//! attention layer projects Q, K and V and hands them to a [`KvPolicy`] as an [`AttnStep`];
//! the policy stores the new K/V where it decides (device, host, disk; or the layer input,
//! for policies that regenerate K/V) and returns the attention output. The layer also
//! implements [`KvRegen`] — K and V recomputed from a stored layer input, exactly as the
//! forward pass computes them — which is all `recompute` and `hybrid` need from a model.
//!
//! ```
//! use candle_core::{DType, Device};
//! use candle_nn::{VarBuilder, VarMap};
//! use kvpolicy_custom_model::{TinyConfig, TinyLm};
//!
//! let vars = VarMap::new();
//! let vb = VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu);
//! let model = TinyLm::new(&TinyConfig::default(), vb)?;
//! let mut policy = kvpolicy::build_policy("headwise:group=1", &Default::default())?;
//! let logits = model.forward(&[1, 2, 3], 0, policy.as_mut())?; // prefill
//! let next = model.forward(&[4], 3, policy.as_mut())?; // one decode step
//! assert_eq!(logits.dims(), &[3, TinyConfig::default().vocab]);
//! assert_eq!(next.dims(), &[1, TinyConfig::default().vocab]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![deny(missing_docs)]
use candle_core::{DType, Module, Result, Tensor};
use candle_nn::{embedding, layer_norm, linear, Embedding, LayerNorm, Linear, VarBuilder};
use kvpolicy::core::Result as KvResult;
use kvpolicy::{AttnSpec, AttnStep, KvPolicy, KvRegen, KvShape};

/// The model's sizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TinyConfig {
    /// Tokens in the vocabulary.
    pub vocab: usize,
    /// Width of a token's hidden state.
    pub hidden: usize,
    /// Decoder layers.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (divides `heads`).
    pub kv_heads: usize,
    /// Longest sequence (learned positions).
    pub max_positions: usize,
}

impl Default for TinyConfig {
    fn default() -> Self {
        Self {
            vocab: 96,
            hidden: 64,
            layers: 3,
            heads: 4,
            kv_heads: 2,
            max_positions: 256,
        }
    }
}

/// One layer's attention: projections, and the call into the policy.
struct SelfAttention {
    layer: usize,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    spec: AttnSpec,
}

impl SelfAttention {
    /// `x` `(b, t, hidden)` as `n` heads `(b, n, t, head_dim)` through `proj`.
    fn heads(&self, x: &Tensor, proj: &Linear, n: usize) -> Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        proj.forward(x)?
            .reshape((b, t, n, self.spec.head_dim))?
            .transpose(1, 2)?
            .contiguous()
    }

    fn forward(&self, x: &Tensor, pos: usize, policy: &mut dyn KvPolicy) -> KvResult<Tensor> {
        let (b, t, hidden) = x.dims3()?;
        let q = self.heads(x, &self.q, self.spec.n_heads)?;
        let (k, v) = self.regen(x, pos)?;
        // The one place the model touches its KV cache.
        let out = policy.attend(&AttnStep {
            layer: self.layer,
            seq: 0,
            q: &q,
            k: &k,
            v: &v,
            x,
            pos,
            spec: &self.spec,
            regen: self,
        })?;
        let out = out.transpose(1, 2)?.reshape((b, t, hidden))?;
        Ok(self.o.forward(&out)?)
    }
}

impl KvRegen for SelfAttention {
    /// K and V as the forward pass computes them: positions are added to the layer's input
    /// before it, so nothing position-dependent is applied to K here.
    fn regen(&self, x: &Tensor, _pos: usize) -> KvResult<(Tensor, Tensor)> {
        let k = self.heads(x, &self.k, self.spec.n_kv_heads)?;
        let v = self.heads(x, &self.v, self.spec.n_kv_heads)?;
        Ok((k, v))
    }

    fn flops_per_token(&self) -> u64 {
        let kv_width = self.spec.n_kv_heads * self.spec.head_dim;
        // K and V: one multiply-add per input width and output value each.
        (2 * 2 * self.spec.n_heads * self.spec.head_dim * kv_width) as u64
    }
}

/// One pre-norm decoder layer.
struct Block {
    norm1: LayerNorm,
    attn: SelfAttention,
    norm2: LayerNorm,
    up: Linear,
    down: Linear,
}

/// A small decoder on candle-nn whose attention runs under any [`KvPolicy`] (see the crate
/// docs).
pub struct TinyLm {
    embed: Embedding,
    positions: Embedding,
    blocks: Vec<Block>,
    norm: LayerNorm,
    cfg: TinyConfig,
}

impl TinyLm {
    /// The model with weights from `vb` (random ones from a fresh `VarMap`).
    pub fn new(cfg: &TinyConfig, vb: VarBuilder) -> Result<Self> {
        let head_dim = cfg.hidden / cfg.heads;
        let kv = cfg.kv_heads * head_dim;
        let blocks = (0..cfg.layers)
            .map(|l| {
                let vb = vb.pp(format!("layers.{l}"));
                Ok(Block {
                    norm1: layer_norm(cfg.hidden, 1e-5, vb.pp("norm1"))?,
                    attn: SelfAttention {
                        layer: l,
                        q: linear(cfg.hidden, cfg.hidden, vb.pp("q"))?,
                        k: linear(cfg.hidden, kv, vb.pp("k"))?,
                        v: linear(cfg.hidden, kv, vb.pp("v"))?,
                        o: linear(cfg.hidden, cfg.hidden, vb.pp("o"))?,
                        spec: AttnSpec::new(cfg.heads, cfg.kv_heads, head_dim),
                    },
                    norm2: layer_norm(cfg.hidden, 1e-5, vb.pp("norm2"))?,
                    up: linear(cfg.hidden, 4 * cfg.hidden, vb.pp("up"))?,
                    down: linear(4 * cfg.hidden, cfg.hidden, vb.pp("down"))?,
                })
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            embed: embedding(cfg.vocab, cfg.hidden, vb.pp("embed"))?,
            positions: embedding(cfg.max_positions, cfg.hidden, vb.pp("positions"))?,
            blocks,
            norm: layer_norm(cfg.hidden, 1e-5, vb.pp("norm"))?,
            cfg: *cfg,
        })
    }

    /// The model's sizes.
    pub fn config(&self) -> &TinyConfig {
        &self.cfg
    }

    /// The cache a run of `max_tokens` tokens, prefilled `step_tokens` at a time, will
    /// need: what [`KvPolicy::prepare`] takes, so that a policy sizes its buffers (and
    /// checks its budget) before the first step.
    pub fn kv_shape(&self, max_tokens: usize, step_tokens: usize) -> KvShape {
        let c = &self.cfg;
        KvShape {
            n_layers: c.layers,
            n_heads: c.heads,
            n_kv_heads: c.kv_heads,
            head_dim: c.hidden / c.heads,
            hidden: c.hidden,
            batch: 1,
            dtype: self.embed.embeddings().dtype(),
            max_tokens,
            step_tokens,
            // The layer input, attention output and MLP activations of one token.
            activation_bytes_per_token: (7
                * c.hidden
                * self.embed.embeddings().dtype().size_in_bytes())
                as u64,
            windows: vec![None; c.layers],
            // Every layer projects its own K/V.
            readers: Vec::new(),
        }
    }

    /// Logits `(t, vocab)` for `ids`, the first at position `pos`, continuing the sequence
    /// `policy` holds (a prefill chunk, or a decode step of one token).
    pub fn forward(&self, ids: &[u32], pos: usize, policy: &mut dyn KvPolicy) -> KvResult<Tensor> {
        let dev = self.embed.embeddings().device();
        let t = ids.len();
        let tokens = Tensor::new(ids, dev)?.unsqueeze(0)?;
        let at = Tensor::arange(pos as u32, (pos + t) as u32, dev)?.unsqueeze(0)?;
        let mut h = (self.embed.forward(&tokens)? + self.positions.forward(&at)?)?;
        for block in &self.blocks {
            let a = block.attn.forward(&block.norm1.forward(&h)?, pos, policy)?;
            h = (h + a)?;
            let m = block
                .down
                .forward(&block.up.forward(&block.norm2.forward(&h)?)?.gelu()?)?;
            h = (h + m)?;
        }
        let h = self.norm.forward(&h)?.squeeze(0)?;
        // Tied embeddings: the output head is the embedding matrix.
        let w = self.embed.embeddings().to_dtype(DType::F32)?;
        Ok(h.to_dtype(DType::F32)?.matmul(&w.t()?)?)
    }
}

//! What the model's layers look like to the prefix cache: [`LayerSpecs`], the attention of
//! each layer a policy taking restored K/V needs, and the shape every chunk of the model has
//! ([`LayerSpecs::expect`]) — what a chunk file's header is checked against.
use candle_core::{DType, Device};
use kvpolicy_core::AttnSpec;

use crate::chunk::Expect;

/// What the model's layers look like to a policy taking restored K/V.
#[derive(Clone, Debug)]
pub struct LayerSpecs {
    /// Per layer, its attention (sliding windows matter to what a policy keeps).
    pub specs: Vec<AttnSpec>,
    /// Width of a layer's input (the shape of a step's `x`; not read by `append_kv`).
    pub hidden: usize,
    /// The policy's device.
    pub device: Device,
    /// K/V dtype.
    pub dtype: DType,
}

impl LayerSpecs {
    /// The shape of the model's chunks of `tokens` tokens: its layer count, KV heads and
    /// head width (where every layer has the same) and dtype.
    pub fn expect(&self, tokens: usize) -> Expect {
        let first = self.specs.first();
        let uniform = |f: fn(&AttnSpec) -> usize| {
            first
                .map(f)
                .filter(|v| self.specs.iter().all(|s| f(s) == *v))
        };
        Expect {
            n_layers: Some(self.specs.len()),
            n_kv_heads: uniform(|s| s.n_kv_heads),
            tokens: Some(tokens),
            head_dim: uniform(|s| s.head_dim),
            dtype: Some(self.dtype),
        }
    }
}

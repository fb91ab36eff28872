//! A two-layer model's attention without the model, for tests of how policies hold K/V
//! (`tests/prefix_share.rs`, `tests/swap_export.rs`): random K/V of its shape, policies
//! prepared for one sequence of up to 1,024 tokens, and steps through every layer.
use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use kvpolicy::prefix::{ChunkKv, LayerKv, LayerSpecs};
use kvpolicy::{build_policy, AttnSpec, AttnStep, KvPolicy, KvShape, NoRegen, PolicyOptions};

/// Layers.
pub const LAYERS: usize = 2;
/// KV heads (the queries have twice as many).
pub const HEADS: usize = 2;
/// Head width.
pub const DIM: usize = 64;

/// The model: layer 0 global, layer 1 a sliding window of `window` tokens when one is
/// given; its policies plan for steps of `step_tokens`.
#[derive(Clone, Copy, Debug)]
pub struct Synthetic {
    /// Layer 1's sliding window.
    pub window: Option<usize>,
    /// Tokens a step takes at most.
    pub step_tokens: usize,
}

impl Synthetic {
    /// What a policy taking restored K/V needs to know of the layers.
    pub fn specs(&self) -> LayerSpecs {
        let mut specs = vec![AttnSpec::new(2 * HEADS, HEADS, DIM); LAYERS];
        specs[1].sliding_window = self.window;
        LayerSpecs {
            specs,
            hidden: 2 * HEADS * DIM,
            device: Device::Cpu,
            dtype: DType::F32,
        }
    }

    /// Policy `name` built with `opts`, prepared for one sequence of up to 1,024 tokens.
    pub fn prepared(&self, name: &str, opts: &PolicyOptions) -> Result<Box<dyn KvPolicy>> {
        let mut p = build_policy(name, opts)?;
        p.prepare(&KvShape {
            n_layers: LAYERS,
            n_heads: 2 * HEADS,
            n_kv_heads: HEADS,
            head_dim: DIM,
            hidden: 2 * HEADS * DIM,
            batch: 1,
            dtype: DType::F32,
            max_tokens: 1024,
            step_tokens: self.step_tokens,
            activation_bytes_per_token: 0,
            windows: vec![None, self.window],
            readers: Vec::new(),
        })?;
        Ok(p)
    }

    /// One step of `kv` at `pos` through every layer (`attend`), with queries `q`; the
    /// outputs.
    pub fn step(
        &self,
        p: &mut dyn KvPolicy,
        q: &Tensor,
        kv: &ChunkKv,
        pos: usize,
    ) -> Result<Vec<Tensor>> {
        let specs = self.specs();
        let x = Tensor::zeros((1, q.dim(2)?, specs.hidden), DType::F32, &Device::Cpu)?;
        let mut out = Vec::new();
        for (layer, (l, spec)) in kv.layers.iter().zip(&specs.specs).enumerate() {
            out.push(p.attend(&AttnStep {
                layer,
                seq: 0,
                q,
                k: &l.k,
                v: &l.v,
                x: &x,
                pos,
                spec,
                regen: &NoRegen,
            })?);
        }
        Ok(out)
    }
}

/// Random K/V of `tokens` tokens, every layer.
pub fn kv(tokens: usize) -> Result<ChunkKv> {
    let layers = (0..LAYERS)
        .map(|_| -> Result<LayerKv> {
            let r = || Tensor::randn(0f32, 1.0, (1, HEADS, tokens, DIM), &Device::Cpu);
            Ok(LayerKv { k: r()?, v: r()? })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(ChunkKv { layers })
}

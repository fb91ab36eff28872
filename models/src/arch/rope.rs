//! Rotary position embeddings, computed for the positions of each step (no table sized by
//! the maximum context, which at 1M tokens would itself be half a gigabyte).
//!
//! Two layouts: HF checkpoints rotate the halves of a head (`rotate_half`, pairs `i` and
//! `i + d/2`); llama.cpp's converter permutes Q/K weights so that GGUF Llama models rotate
//! adjacent pairs (`2i`, `2i+1`). Llama 3 frequency scaling follows HF's
//! `_compute_llama3_parameters`; GGUF files carry the same as a `rope_freqs` tensor.
use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Tensor};

use crate::error::Result;

/// How RoPE frequencies are scaled for long contexts.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE.
    None,
    /// Positions divided by `factor`.
    Linear {
        /// Scale.
        factor: f64,
    },
    /// Llama 3.1 piecewise frequency scaling.
    Llama3 {
        /// Scale of low frequencies.
        factor: f64,
        /// Wavelength threshold for low frequencies.
        low_freq_factor: f64,
        /// Wavelength threshold for high frequencies.
        high_freq_factor: f64,
        /// Pre-training context.
        original_max_position_embeddings: usize,
    },
}

/// Base and scaling of a model's RoPE.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeConfig {
    /// Base frequency θ.
    pub theta: f64,
    /// Scaling.
    pub scaling: RopeScaling,
    /// Per-frequency divisors (GGUF `rope_freqs.weight`).
    pub freq_factors: Option<Vec<f32>>,
}

/// Pair layout of the rotation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Rotate halves (HF).
    Half,
    /// Rotate adjacent pairs (GGUF Llama).
    Interleaved,
}

type CosSin = (usize, usize, DType, Tensor, Tensor);

/// RoPE for one head width. Clones share a one-entry cache of the last step's cos/sin, so
/// the layers of one forward step compute them once.
#[derive(Clone, Debug)]
pub struct Rope {
    inv_freq: Vec<f32>,
    style: RopeStyle,
    cache: Arc<Mutex<Option<CosSin>>>,
}

impl Rope {
    /// RoPE over `head_dim` with the given frequencies and layout.
    pub fn new(cfg: &RopeConfig, head_dim: usize, style: RopeStyle) -> Self {
        let half = head_dim / 2;
        // f32 arithmetic throughout, as HF (`_compute_default_rope_parameters`) and candle do:
        // this model family amplifies one-ulp differences in cos/sin through quantized matmuls.
        let mut inv_freq: Vec<f32> = (0..half)
            .map(|i| 1f32 / (cfg.theta as f32).powf((2 * i) as f32 / head_dim as f32))
            .collect();
        match &cfg.scaling {
            RopeScaling::None => {}
            RopeScaling::Linear { factor } => {
                inv_freq.iter_mut().for_each(|f| *f /= *factor as f32)
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                let (factor, low, high) = (
                    *factor as f32,
                    *low_freq_factor as f32,
                    *high_freq_factor as f32,
                );
                let old = *original_max_position_embeddings as f32;
                let low_wavelen = old / low;
                let high_wavelen = old / high;
                for f in inv_freq.iter_mut() {
                    let wavelen = 2.0 * std::f32::consts::PI / *f;
                    if wavelen > low_wavelen {
                        *f /= factor;
                    } else if wavelen >= high_wavelen {
                        let smooth = (old / wavelen - low) / (high - low);
                        *f = (1.0 - smooth) * *f / factor + smooth * *f;
                    }
                }
            }
        }
        if let Some(ff) = &cfg.freq_factors {
            for (f, d) in inv_freq.iter_mut().zip(ff) {
                *f /= *d;
            }
        }
        Self {
            inv_freq,
            style,
            cache: Arc::new(Mutex::new(None)),
        }
    }

    /// cos and sin `(t, head_dim/2)` for positions `pos..pos+t`.
    pub fn cos_sin(
        &self,
        pos: usize,
        t: usize,
        dtype: DType,
        dev: &Device,
    ) -> Result<(Tensor, Tensor)> {
        if let Ok(guard) = self.cache.lock() {
            if let Some((p, n, d, c, s)) = guard.as_ref() {
                if (*p, *n, *d) == (pos, t, dtype) && c.device().same_device(dev) {
                    return Ok((c.clone(), s.clone()));
                }
            }
        }
        let (cos, sin) = self.compute(pos, t, dtype, dev)?;
        if let Ok(mut guard) = self.cache.lock() {
            *guard = Some((pos, t, dtype, cos.clone(), sin.clone()));
        }
        Ok((cos, sin))
    }

    fn compute(
        &self,
        pos: usize,
        t: usize,
        dtype: DType,
        dev: &Device,
    ) -> Result<(Tensor, Tensor)> {
        self.compute_at(pos..pos + t, dtype, dev)
    }

    /// cos and sin `(n, head_dim/2)` for arbitrary positions (one row per position).
    pub fn cos_sin_at(
        &self,
        positions: &[usize],
        dtype: DType,
        dev: &Device,
    ) -> Result<(Tensor, Tensor)> {
        self.compute_at(positions.iter().copied(), dtype, dev)
    }

    fn compute_at(
        &self,
        positions: impl ExactSizeIterator<Item = usize>,
        dtype: DType,
        dev: &Device,
    ) -> Result<(Tensor, Tensor)> {
        let half = self.inv_freq.len();
        let t = positions.len();
        let mut cos = Vec::with_capacity(t * half);
        let mut sin = Vec::with_capacity(t * half);
        for p in positions {
            for f in &self.inv_freq {
                let a = p as f32 * *f;
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
        let cos = Tensor::from_vec(cos, (t, half), dev)?.to_dtype(dtype)?;
        let sin = Tensor::from_vec(sin, (t, half), dev)?.to_dtype(dtype)?;
        Ok((cos, sin))
    }

    /// Rotates `x` `(b, heads, t, head_dim)` whose first token sits at `pos`.
    pub fn apply(&self, x: &Tensor, pos: usize) -> Result<Tensor> {
        let t = x.dim(2)?;
        let (cos, sin) = self.cos_sin(pos, t, x.dtype(), x.device())?;
        self.apply_with(x, &cos, &sin)
    }

    /// The pairing of this encoding, as the fused regeneration kernel names it.
    pub fn rotation(&self) -> kvpolicy_kernels::Rotation {
        match self.style {
            RopeStyle::Half => kvpolicy_kernels::Rotation::Half,
            RopeStyle::Interleaved => kvpolicy_kernels::Rotation::Interleaved,
        }
    }

    /// Rotates `x` with precomputed cos/sin (shared by Q and K of a step).
    pub fn apply_with(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let x = x.contiguous()?;
        Ok(match self.style {
            RopeStyle::Half => candle_nn::rotary_emb::rope(&x, cos, sin)?,
            RopeStyle::Interleaved => candle_nn::rotary_emb::rope_i(&x, cos, sin)?,
        })
    }
}

//! Building blocks shared by the model files: linear layers that are either dense
//! (safetensors) or quantized (GGUF), RMSNorm and the gated-SiLU MLP.
use candle_core::quantized::QMatMul;
use candle_core::{Module, Tensor};

use crate::error::Result;

/// A linear layer `y = x·Wᵀ (+ b)` with dense or quantized weights.
#[derive(Debug, Clone)]
pub enum Linear {
    /// Dense weights `(out, in)`.
    Dense(candle_nn::Linear),
    /// Quantized weights (GGUF block formats) and an optional dense bias.
    Quant {
        /// The quantized matmul.
        w: QMatMul,
        /// Bias `(out,)`.
        bias: Option<Tensor>,
        /// Output features.
        out: usize,
        /// Input features.
        inp: usize,
    },
}

impl Linear {
    /// Output features.
    pub fn out_dim(&self) -> usize {
        match self {
            Self::Dense(l) => l.weight().dim(0).unwrap_or(0),
            Self::Quant { out, .. } => *out,
        }
    }

    /// Input features.
    pub fn in_dim(&self) -> usize {
        match self {
            Self::Dense(l) => l.weight().dim(1).unwrap_or(0),
            Self::Quant { inp, .. } => *inp,
        }
    }

    /// Applies the layer to `x` `(…, in)`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(match self {
            Self::Dense(l) => l.forward(x)?,
            Self::Quant { w, bias, .. } => {
                let y = w.forward(x)?;
                match bias {
                    Some(b) => y.broadcast_add(b)?,
                    None => y,
                }
            }
        })
    }
}

/// Root-mean-square norm, `x / rms(x) · (offset + w)`; `offset` is 1 for Gemma.
#[derive(Debug, Clone)]
pub struct RmsNorm {
    weight: Tensor,
    eps: f64,
}

impl RmsNorm {
    /// A norm with the given (already offset) weight.
    pub fn new(weight: Tensor, eps: f64) -> Self {
        Self { weight, eps }
    }

    /// Normalises the last dimension of `x`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let w = self.weight.to_dtype(x.dtype())?;
        Ok(candle_nn::ops::rms_norm(
            &x.contiguous()?,
            &w,
            self.eps as f32,
        )?)
    }
}

/// The gated MLP `down(silu(gate(x)) · up(x))`.
#[derive(Debug, Clone)]
pub struct GatedMlp {
    /// Gate projection.
    pub gate: Linear,
    /// Up projection.
    pub up: Linear,
    /// Down projection.
    pub down: Linear,
}

impl GatedMlp {
    /// Applies the MLP.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let g = candle_nn::ops::silu(&self.gate.forward(x)?)?;
        self.down.forward(&(g * self.up.forward(x)?)?)
    }
}

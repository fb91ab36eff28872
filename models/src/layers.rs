//! Building blocks shared by the model files: linear layers that are either dense
//! (safetensors) or quantized (GGUF), the two norms (RMSNorm, LayerNorm) and the two MLP
//! shapes (gated, as in Llama/Gemma; plain, as in OPT).
use candle_core::quantized::QMatMul;
use candle_core::{Module, Tensor};
use kvpolicy_kernels::quant::{self, QuantMatMul};

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
        /// Our CPU kernel for the formats candle dots with a scalar loop (Q4_1, Q5_0, Q5_1),
        /// used for activation rows below [`DEQUANT_MIN_ROWS`].
        fast: Option<QuantMatMul>,
        /// Bias `(out,)`.
        bias: Option<Tensor>,
        /// Output features.
        out: usize,
        /// Input features.
        inp: usize,
    },
}

/// Activation rows from which a quantized layer on the CPU dequantizes its weight for the
/// call and multiplies densely (see [`Linear::forward`]).
pub const DEQUANT_MIN_ROWS: usize = 32;

/// Rows of `x` `(…, in)`: the product of every dimension but the last.
fn rows(x: &Tensor) -> usize {
    let d = x.dims();
    d[..d.len().saturating_sub(1)].iter().product()
}

impl Linear {
    /// A quantized layer `(out, inp)` with an optional bias.
    pub fn quantized(w: QMatMul, bias: Option<Tensor>, out: usize, inp: usize) -> Self {
        let fast = match &w {
            QMatMul::QTensor(q) => QuantMatMul::new(q.clone()),
            _ => None,
        };
        Self::Quant {
            w,
            fast,
            bias,
            out,
            inp,
        }
    }

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
            Self::Quant { w, fast, bias, .. } => {
                let y = match w {
                    QMatMul::QTensor(q) if x.device().is_cpu() && rows(x) >= DEQUANT_MIN_ROWS => {
                        // candle's CPU quantized matmul dots one activation row at a time
                        // against the quantized blocks (~10 GFLOP/s here); a prefill chunk
                        // of many rows pays far less for dequantizing the weight once
                        // (out × in work) and one f32 gemm.
                        let dense = q.dequantize(x.device())?.to_dtype(x.dtype())?;
                        x.broadcast_matmul(&dense.t()?)?
                    }
                    _ => match fast {
                        Some(op) if quant::applies(x) => op.forward(x)?,
                        _ => w.forward(x)?,
                    },
                };
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

/// A norm over the last dimension.
#[derive(Debug, Clone)]
pub enum Norm {
    /// RMSNorm (Llama, Mistral, Qwen2; Gemma with its `1 + w` weight folded in).
    Rms(RmsNorm),
    /// LayerNorm with weight and bias (OPT).
    Layer(candle_nn::LayerNorm),
}

impl Norm {
    /// Normalises the last dimension of `x`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Self::Rms(n) => n.forward(x),
            Self::Layer(n) => Ok(n.forward(&x.contiguous()?)?),
        }
    }
}

/// The feed-forward part of a block.
#[derive(Debug, Clone)]
pub enum Mlp {
    /// `down(act(gate(x)) · up(x))` (SiLU for Llama, GeLU-tanh for Gemma).
    Gated {
        /// Gate projection.
        gate: Linear,
        /// Up projection.
        up: Linear,
        /// Down projection.
        down: Linear,
        /// Activation of the gate.
        act: candle_nn::Activation,
    },
    /// `fc2(act(fc1(x)))` (ReLU for OPT).
    Plain {
        /// First projection.
        fc1: Linear,
        /// Second projection.
        fc2: Linear,
        /// Activation between them.
        act: candle_nn::Activation,
    },
}

impl Mlp {
    /// Applies the MLP.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Self::Gated {
                gate,
                up,
                down,
                act,
            } => {
                let g = gate.forward(x)?.apply(act)?;
                down.forward(&(g * up.forward(x)?)?)
            }
            Self::Plain { fc1, fc2, act } => fc2.forward(&fc1.forward(x)?.apply(act)?),
        }
    }
}

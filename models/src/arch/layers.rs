//! Building blocks shared by the model files: token embeddings and linear layers that are
//! either dense (safetensors) or quantized (GGUF), the two norms (RMSNorm, LayerNorm) and the two MLP
//! shapes (gated, as in Llama/Gemma; plain, as in OPT).
use std::borrow::Cow;
use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QMatMul, QStorage, QTensor};
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
        /// Candle's quantized matmul; `None` when `fast` holds the weight's only copy
        /// (Q4_0 or Q4_K interleaved for the decode kernel, `QuantMatMul::interleaved`).
        w: Option<QMatMul>,
        /// Our CPU kernels (`kvpolicy_kernels::quant`): row dot products for GGML's
        /// 32-element formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) below [`DEQUANT_MIN_ROWS`]
        /// rows, the integer GEMM for those and Q4_K/Q6_K from there where the CPU runs it.
        fast: Option<QuantMatMul>,
        /// Bias `(out,)`.
        bias: Option<Tensor>,
        /// Output features.
        out: usize,
        /// Input features.
        inp: usize,
    },
}

/// Token embeddings: a dense table, or a quantized one (GGUF) kept in its block format
/// whose rows are dequantized as they are looked up — llama.cpp's `ggml_get_rows`. A
/// dequantized copy of the table would cost `vocab × hidden × 4` bytes (671 MB for Gemma 3
/// 270M, 113 MB for SmolLM2-135M) beside the quantized one the tied LM head reads.
#[derive(Debug, Clone)]
pub enum Embedding {
    /// A dense `(vocab, hidden)` table.
    Dense(candle_nn::Embedding),
    /// A quantized `(vocab, hidden)` table.
    Quant(Arc<QTensor>),
    /// A quantized table held by the tied LM head's own kernel (interleaved for it): rows
    /// are reassembled and dequantized at lookup, with no second copy of the table.
    Shared(QuantMatMul),
}

impl Embedding {
    /// The embeddings of `ids` (any shape): `(…, hidden)`.
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        let table = match self {
            Self::Dense(e) => return Ok(e.forward(ids)?),
            Self::Quant(t) => t,
            Self::Shared(op) => {
                let flat = ids.flatten_all()?.to_vec1::<u32>()?;
                let rows = op.plain_rows(&flat)?;
                return dequantize_rows(rows, op.ggml_dtype(), op.dims().1, ids);
            }
        };
        let (vocab, hidden) = table.shape().dims2()?;
        let dtype = table.dtype();
        let row_bytes = hidden / dtype.block_size() * dtype.type_size();
        let data = table.data()?;
        let flat = ids.flatten_all()?.to_vec1::<u32>()?;
        let mut rows = Vec::with_capacity(flat.len() * row_bytes);
        for &id in &flat {
            let i = id as usize;
            if i >= vocab {
                return Err(candle_core::Error::Msg(format!(
                    "token id {id} is outside the embedding table's {vocab} rows"
                ))
                .into());
            }
            rows.extend_from_slice(&data[i * row_bytes..(i + 1) * row_bytes]);
        }
        dequantize_rows(rows, dtype, hidden, ids)
    }
}

/// Looked-up table rows `rows` (row-major blocks of `dtype`, one row of `hidden` per id in
/// `ids`) dequantized onto `ids`' device, shaped `(…ids, hidden)`.
fn dequantize_rows(rows: Vec<u8>, dtype: GgmlDType, hidden: usize, ids: &Tensor) -> Result<Tensor> {
    let picked = QTensor::new(
        QStorage::from_data(Cow::Owned(rows), &candle_core::Device::Cpu, dtype)?,
        (ids.elem_count(), hidden),
    )?;
    let mut dims = ids.dims().to_vec();
    dims.push(hidden);
    Ok(picked.dequantize(ids.device())?.reshape(dims)?)
}

/// Activation rows from which a quantized layer on the CPU runs as the integer GEMM
/// (`kvpolicy_kernels::quant::gemm`), or, on a CPU without one of its kernels, dequantizes
/// its weight for the call and multiplies densely (see [`Linear::forward`]).
pub const DEQUANT_MIN_ROWS: usize = quant::GEMM_MIN_ROWS;

/// Rows of `x` `(…, in)`: the product of every dimension but the last.
fn rows(x: &Tensor) -> usize {
    let d = x.dims();
    d[..d.len().saturating_sub(1)].iter().product()
}

impl Linear {
    /// A quantized layer `(out, inp)` with an optional bias. A Q4_0 or Q4_K weight on a CPU
    /// with AVX2 is interleaved for the decode kernel (`QuantMatMul::interleaved`) and its
    /// row-major copy let go (freed once no other holder, such as a tied embedding, keeps it).
    pub fn quantized(w: QMatMul, bias: Option<Tensor>, out: usize, inp: usize) -> Self {
        let fast = match &w {
            QMatMul::QTensor(q) => QuantMatMul::new(q.clone()),
            _ => None,
        };
        let (w, fast) = match fast.as_ref().and_then(QuantMatMul::interleaved) {
            Some(op) => (None, Some(op)),
            None => (Some(w), fast),
        };
        Self::Quant {
            w,
            fast,
            bias,
            out,
            inp,
        }
    }

    /// A quantized layer `(out, inp)` whose weight only `op` holds (interleaved at load,
    /// `QuantMatMul::interleave_owned`), with an optional bias.
    pub fn from_op(op: QuantMatMul, bias: Option<Tensor>, out: usize, inp: usize) -> Self {
        Self::Quant {
            w: None,
            fast: Some(op),
            bias,
            out,
            inp,
        }
    }

    /// The layer's own quantized kernel, when it has one (a tied embedding reads the table
    /// through it).
    pub fn quant_op(&self) -> Option<&QuantMatMul> {
        match self {
            Self::Quant { fast, .. } => fast.as_ref(),
            Self::Dense(_) => None,
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
                let y = match (w, fast) {
                    // Ours: row dot products for a few rows, the integer GEMM for a chunk
                    // where the CPU runs one of its kernels (`QuantMatMul::handles`).
                    (_, Some(op)) if quant::applies(x) && op.handles(rows(x)) => op.forward(x)?,
                    // The interleaved weight's only reader (it handles every row count).
                    (None, Some(op)) => op.forward(x)?,
                    (Some(QMatMul::QTensor(q)), _)
                        if x.device().is_cpu() && rows(x) >= DEQUANT_MIN_ROWS =>
                    {
                        // No integer GEMM here: candle's CPU quantized matmul dots one
                        // activation row at a time against the quantized blocks (~10
                        // GFLOP/s); a prefill chunk of many rows pays far less for
                        // dequantizing the weight once (out × in work) and one f32 gemm.
                        let dense = q.dequantize(x.device())?.to_dtype(x.dtype())?;
                        x.broadcast_matmul(&dense.t()?)?
                    }
                    (Some(w), _) => w.forward(x)?,
                    (None, None) => unreachable!("a quantized layer without a weight"),
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
    /// Width of its inner activations.
    pub fn inner_dim(&self) -> usize {
        match self {
            Self::Gated { up, .. } => up.out_dim(),
            Self::Plain { fc1, .. } => fc1.out_dim(),
        }
    }

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

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::GgmlDType;
    use candle_core::{DType, Device};

    /// A quantized table's lookup equals the dense lookup of its dequantized copy exactly,
    /// for ids of any shape; an id past the table is an error.
    #[test]
    fn quantized_lookup_equals_the_dequantized_table() -> Result<()> {
        let dev = Device::Cpu;
        let dense = Tensor::randn(0f32, 1.0, (40, 256), &dev)?;
        for dtype in [
            GgmlDType::Q4_1,
            GgmlDType::Q5_0,
            GgmlDType::Q6K,
            GgmlDType::Q8_0,
        ] {
            let q = Arc::new(QTensor::quantize(&dense, dtype)?);
            let reference = Embedding::Dense(candle_nn::Embedding::new(q.dequantize(&dev)?, 256));
            let ours = Embedding::Quant(q);
            let ids = Tensor::new(&[[3u32, 39, 0], [3, 7, 21]], &dev)?;
            let (a, b) = (ours.forward(&ids)?, reference.forward(&ids)?);
            assert_eq!(a.dims(), [2, 3, 256]);
            let diff = (a - b)?
                .abs()?
                .flatten_all()?
                .max(0)?
                .to_dtype(DType::F32)?;
            assert_eq!(diff.to_scalar::<f32>()?, 0.0, "{dtype:?}");
            let looked_up = ours.forward(&Tensor::new(&[40u32], &dev)?);
            assert!(looked_up.is_err(), "id 40 of a 40-row table was looked up");
            let err = looked_up.err().map(|e| e.to_string()).unwrap_or_default();
            assert!(
                err.to_string()
                    .contains("token id 40 is outside the embedding table's 40 rows"),
                "{err}"
            );
        }
        Ok(())
    }
}

//! How policies store K/V on the device tier (`kv_dtype`) and the host and disk tiers
//! (`host_kv_dtype`, else `kv_dtype`) — options every offloading policy reads
//! ([`PolicyOptions`](crate::PolicyOptions)), implemented by `full` and the toolkit
//! (`kvpolicy-tiered`).
//!
//! [`KvCodec`]: the stored form — in the model's dtype (lossless), or — LOSSY,
//! opt-in — in a smaller one, encoded on the device before anything moves: f16/bf16 (half
//! the bytes of f32), or llama.cpp's `q8_0` (blocks of 32 values as one f16 scale and 32
//! signed bytes: 34 bytes per 32 values, 0.266× f32; HF's `QuantizedCache` quantizes K/V
//! too, but cannot offload it). The CPU attention kernel reads every form in place under
//! f32 queries; elsewhere it is decoded before attention. [`DiskIo`]: how the disk tier
//! reads its files.
use std::borrow::Cow;

use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::{DType, Device, Tensor};

use crate::error::{KvError, Result};

/// A stored form of K/V (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvCodec {
    /// The model's own dtype: lossless.
    #[default]
    Model,
    /// A float dtype (LOSSY when smaller than the model's).
    Float(DType),
    /// `q8_0` blocks along the head dimension (LOSSY).
    Q8_0,
}

/// Values per `q8_0` block, and its bytes.
const Q8_BLOCK: (usize, usize) = (32, 34);

impl KvCodec {
    /// The stored dtype and row width for a model of dtype `model` and head width `d`.
    pub fn stored(&self, model: DType, d: usize) -> (DType, usize) {
        match self {
            Self::Model => (model, d),
            Self::Float(dt) => (*dt, d),
            Self::Q8_0 => (DType::U8, d / Q8_BLOCK.0 * Q8_BLOCK.1),
        }
    }

    /// Bytes of one stored row of `d` values.
    pub fn row_bytes(&self, model: DType, d: usize) -> u64 {
        let (dt, w) = self.stored(model, d);
        (w * dt.size_in_bytes()) as u64
    }

    /// Whether storing loses information for a model of dtype `model`.
    pub fn lossy(&self, model: DType) -> bool {
        // f32 holds every f16/bf16 value exactly: widening is not lossy.
        *self != Self::Float(DType::F32) && self.stored(model, Q8_BLOCK.0).0 != model
    }

    /// Checks that heads of width `d` can be stored this way.
    pub fn check(&self, d: usize) -> Result<()> {
        if *self == Self::Q8_0 && !d.is_multiple_of(Q8_BLOCK.0) {
            return Err(KvError::Unsupported(format!(
                "storing K/V as q8_0 needs a head width that is a multiple of 32, not {d}; store them as f16 or bf16"
            )));
        }
        Ok(())
    }

    /// `t` `(b, g, n, d)` in stored form `(b, g, n, w)`, on `t`'s device (q8_0 is encoded
    /// on the CPU).
    pub fn encode(&self, t: &Tensor) -> Result<Tensor> {
        match self {
            Self::Model => Ok(t.clone()),
            Self::Float(dt) => Ok(t.to_dtype(*dt)?),
            Self::Q8_0 => {
                let (b, g, n, d) = t.dims4()?;
                self.check(d)?;
                // A fresh buffer: candle's quantize reads the storage from its start,
                // ignoring a view's offset.
                let values = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                let rows = Tensor::from_vec(values, (b * g * n, d), &Device::Cpu)?;
                let q = QTensor::quantize(&rows, GgmlDType::Q8_0)?;
                let w = d / Q8_BLOCK.0 * Q8_BLOCK.1;
                let bytes = q.data()?.into_owned();
                Ok(Tensor::from_vec(bytes, (b, g, n, w), &Device::Cpu)?.to_device(t.device())?)
            }
        }
    }

    /// `t` stored as `from` in this form instead: unchanged when both store alike (q8_0
    /// blocks are never quantized twice), else decoded to `model` and encoded.
    pub fn recode(&self, t: &Tensor, from: KvCodec, model: DType, d: usize) -> Result<Tensor> {
        if self.stored(model, d) == from.stored(model, d) {
            Ok(t.clone())
        } else {
            self.encode(&from.decode(t, model, d)?)
        }
    }

    /// Stored `t` `(b, g, n, w)` back to `(b, g, n, d)` in `model`, on `t`'s device.
    pub fn decode(&self, t: &Tensor, model: DType, d: usize) -> Result<Tensor> {
        match self {
            Self::Model | Self::Float(_) => Ok(t.to_dtype(model)?),
            Self::Q8_0 => {
                let (b, g, n, _) = t.dims4()?;
                let bytes = t.flatten_all()?.to_vec1::<u8>()?;
                // Blocks hold an f16 scale: read them from a 2-byte-aligned copy.
                let mut aligned = vec![0u16; bytes.len().div_ceil(2)];
                let view: &mut [u8] = bytemuck::cast_slice_mut(&mut aligned);
                view[..bytes.len()].copy_from_slice(&bytes);
                let data = Cow::Borrowed(&view[..bytes.len()]);
                let storage = QStorage::from_data(data, &Device::Cpu, GgmlDType::Q8_0)?;
                let q = QTensor::new(storage, (b * g * n, d))?;
                Ok(q.dequantize(&Device::Cpu)?
                    .reshape((b, g, n, d))?
                    .to_dtype(model)?
                    .to_device(t.device())?)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recoding_into_the_same_form_keeps_the_bytes() -> Result<()> {
        // Blocks a quantizer would never write (every value 1·scale: it would store 127s
        // with a scale 127× smaller): recoded q8_0 → q8_0 they are kept as they are, where a
        // decode and encode would rewrite them. Into f16 they are decoded.
        let mut bytes = Vec::new();
        for _ in 0..4 {
            bytes.extend_from_slice(&half::f16::from_f32(0.5).to_le_bytes());
            bytes.extend(std::iter::repeat_n(1u8, 32));
        }
        let t = Tensor::from_vec(bytes.clone(), (1, 2, 2, 34), &Device::Cpu)?;
        let same = KvCodec::Q8_0.recode(&t, KvCodec::Q8_0, DType::F32, 32)?;
        assert_eq!(same.flatten_all()?.to_vec1::<u8>()?, bytes);
        let twice = KvCodec::Q8_0.encode(&KvCodec::Q8_0.decode(&t, DType::F32, 32)?)?;
        assert_ne!(twice.flatten_all()?.to_vec1::<u8>()?, bytes);
        let f16 = KvCodec::Float(DType::F16).recode(&t, KvCodec::Q8_0, DType::F32, 32)?;
        let values = f16.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        assert!(values.iter().all(|&x| x == 0.5), "{values:?}");
        Ok(())
    }

    #[test]
    fn q8_0_round_trips_within_its_block_precision() -> Result<()> {
        // A view that starts inside its storage (candle's quantize alone would miss that).
        let t = Tensor::randn(0f32, 1.0, (1, 3, 5, 64), &Device::Cpu)?.narrow(1, 1, 2)?;
        let enc = KvCodec::Q8_0.encode(&t)?;
        assert_eq!(enc.dims4()?, (1, 2, 5, 68));
        let dec = KvCodec::Q8_0.decode(&enc, DType::F32, 64)?;
        let err = (dec - &t)?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f32>()?;
        let max = t.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
        // One step of a block's scale (its max / 127) at most, half of it when rounding.
        assert!(err <= max / 127.0, "{err} vs {max}");
        Ok(())
    }
}

/// How the disk tier reads its files.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum DiskIo {
    /// `O_DIRECT` reads into aligned buffers, past the page cache: what the disk delivers,
    /// and reads that do not fill RAM with the files the host budget kept out of it. Falls
    /// back to [`DiskIo::Buffered`] on a file system that refuses `O_DIRECT` (tmpfs).
    #[default]
    Direct,
    /// Plain `pread` through the page cache: re-reads of KV that fits in free RAM come
    /// from memory.
    Buffered,
}

impl std::str::FromStr for DiskIo {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "direct" => Ok(Self::Direct),
            "buffered" => Ok(Self::Buffered),
            other => Err(format!(
                "unknown disk I/O mode `{other}`: use `direct` or `buffered`"
            )),
        }
    }
}

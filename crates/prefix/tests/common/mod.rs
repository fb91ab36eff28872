//! Synthetic chunks and file helpers shared by the hardening tests.
#![allow(dead_code)]
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use kvpolicy_core::AttnSpec;
use kvpolicy_prefix::{ChunkKey, ChunkKv, Fingerprint, FingerprintBuilder, LayerKv, LayerSpecs};

/// The shape of the synthetic model: layers, KV heads, head width.
pub const LAYERS: usize = 3;
/// KV heads.
pub const HEADS: usize = 2;
/// Head width.
pub const DIM: usize = 4;

/// A chunk of `layers` × `heads` × `tokens` × `dim` f32 whose values encode `seed`.
pub fn chunk_of(
    layers: usize,
    heads: usize,
    tokens: usize,
    dim: usize,
    seed: f32,
) -> Result<ChunkKv> {
    let layers = (0..layers)
        .map(|l| -> Result<LayerKv> {
            let n = heads * tokens * dim;
            let k = Tensor::arange(0f32, n as f32, &Device::Cpu)?
                .affine(0.5, (seed * 100.0 + l as f32) as f64)?
                .reshape((1, heads, tokens, dim))?;
            Ok(LayerKv {
                v: (k.clone() * -1.0)?,
                k,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(ChunkKv { layers })
}

/// A chunk of the synthetic model's shape.
pub fn chunk(tokens: usize, seed: f32) -> Result<ChunkKv> {
    chunk_of(LAYERS, HEADS, tokens, DIM, seed)
}

/// The synthetic model's fingerprint.
pub fn fp() -> Fingerprint {
    FingerprintBuilder::new().field("m", b"1").finish()
}

/// What the synthetic model's layers look like.
pub fn specs() -> LayerSpecs {
    LayerSpecs {
        specs: vec![AttnSpec::new(HEADS, HEADS, DIM); LAYERS],
        hidden: HEADS * DIM,
        device: Device::Cpu,
        dtype: DType::F32,
    }
}

/// The file of `key` in `dir`.
pub fn chunk_path(dir: &Path, key: &ChunkKey) -> PathBuf {
    dir.join(format!("{}.kvc", key.hex()))
}

/// Sets `path`'s permission bits.
pub fn chmod(path: &Path, mode: u32) -> Result<()> {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))?;
    Ok(())
}

/// Whether two chunks hold the same values.
pub fn same(a: &ChunkKv, b: &ChunkKv) -> Result<bool> {
    for (x, y) in a.layers.iter().zip(&b.layers) {
        for (s, t) in [(&x.k, &y.k), (&x.v, &y.v)] {
            if s.flatten_all()?.to_vec1::<f32>()? != t.flatten_all()?.to_vec1::<f32>()? {
                return Ok(false);
            }
        }
    }
    Ok(a.layers.len() == b.layers.len())
}

/// `c` in another element type.
pub fn cast(c: &ChunkKv, dtype: DType) -> Result<ChunkKv> {
    let layers = c
        .layers
        .iter()
        .map(|l| {
            Ok(LayerKv {
                k: l.k.to_dtype(dtype)?,
                v: l.v.to_dtype(dtype)?,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(ChunkKv { layers })
}

//! One chunk of K/V ([`ChunkKv`]: every layer's keys and values for `C` consecutive tokens,
//! on the host) and its bytes in a cache file: a header — magic, version, the model
//! [`Fingerprint`], the [`ChunkKey`], the shape, the dtype, the payload's length and a
//! SHA-256 over header and payload — padded to a page, then every layer's K then V,
//! padded to a page (so that the file can be read with `O_DIRECT`). A file whose checksum,
//! fingerprint, key or shape is not what the reader expects is damaged: a miss, never K/V.
use candle_core::{DType, Device, Tensor};
use sha2::Digest;

use crate::error::{PrefixError, Result};
pub use crate::header::{round_up, ChunkShape, Damage, Expect, ALIGN};
use crate::header::{Header, HEADER_PAGE};
use crate::key::{ChunkKey, Fingerprint};
pub use kvpolicy_core::LayerKv;

/// Every layer's K/V for one chunk of tokens, on the host.
#[derive(Clone, Debug)]
pub struct ChunkKv {
    /// Per layer, in order.
    pub layers: Vec<LayerKv>,
}

impl ChunkKv {
    /// The chunk's shape, checked to be the same in every layer (batch 1).
    pub fn shape(&self) -> Result<ChunkShape> {
        let first = self
            .layers
            .first()
            .ok_or_else(|| PrefixError::Invalid("a chunk with no layers".into()))?;
        let (b, n_kv_heads, tokens, head_dim) = first.k.dims4()?;
        let shape = ChunkShape {
            n_layers: self.layers.len(),
            n_kv_heads,
            tokens,
            head_dim,
            dtype: first.k.dtype(),
        };
        let want = [1, n_kv_heads, tokens, head_dim];
        for (i, l) in self.layers.iter().enumerate() {
            for t in [&l.k, &l.v] {
                if b != 1 || t.dims() != want || t.dtype() != shape.dtype {
                    return Err(PrefixError::Invalid(format!(
                        "layer {i} of a chunk is {:?} {:?}, not {want:?} {:?} like layer 0 (batch 1)",
                        t.dims(),
                        t.dtype(),
                        shape.dtype
                    )));
                }
            }
        }
        Ok(shape)
    }

    /// Tokens `start..start + len` of every layer (views; no copy).
    pub fn narrow(&self, start: usize, len: usize) -> Result<Self> {
        let layers = self
            .layers
            .iter()
            .map(|l| {
                Ok(LayerKv {
                    k: l.k.narrow(2, start, len)?,
                    v: l.v.narrow(2, start, len)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { layers })
    }

    /// `parts` one after another along the tokens (each of the same layers and heads);
    /// `None` for no parts.
    pub fn cat(parts: &[ChunkKv]) -> Result<Option<Self>> {
        let Some(first) = parts.first() else {
            return Ok(None);
        };
        let layers = (0..first.layers.len())
            .map(|i| {
                let ks = parts.iter().map(|p| &p.layers[i].k).collect::<Vec<_>>();
                let vs = parts.iter().map(|p| &p.layers[i].v).collect::<Vec<_>>();
                Ok(LayerKv {
                    k: Tensor::cat(&ks, 2)?,
                    v: Tensor::cat(&vs, 2)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Some(Self { layers }))
    }

    /// The whole chunks of `chunk` tokens of tokens `skip..`, each in storage of its own (a
    /// view would keep the whole run's K/V alive behind a chunk's counted bytes); a trailing
    /// partial chunk is left out.
    pub fn split(&self, skip: usize, chunk: usize) -> Result<Vec<Self>> {
        let tokens = self.shape()?.tokens.saturating_sub(skip);
        (0..tokens / chunk.max(1))
            .map(|c| {
                let part = self.narrow(skip + c * chunk, chunk)?;
                let layers = part
                    .layers
                    .into_iter()
                    .map(|l| {
                        Ok(LayerKv {
                            k: l.k.force_contiguous()?,
                            v: l.v.force_contiguous()?,
                        })
                    })
                    .collect::<Result<Vec<_>>>()?;
                Ok(Self { layers })
            })
            .collect()
    }

    /// Bytes of K and V of every layer (what a tier's budget counts).
    pub fn bytes(&self) -> u64 {
        self.layers
            .iter()
            .map(|l| (l.k.elem_count() + l.v.elem_count()) * l.k.dtype().size_in_bytes())
            .sum::<usize>() as u64
    }
}

/// Appends `t`'s elements, little-endian, to `out`.
fn put_tensor(t: &Tensor, out: &mut Vec<u8>) -> Result<()> {
    let t = t.to_device(&Device::Cpu)?.flatten_all()?;
    match t.dtype() {
        DType::F32 => t
            .to_vec1::<f32>()?
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        DType::F16 => t
            .to_vec1::<half::f16>()?
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        DType::BF16 => t
            .to_vec1::<half::bf16>()?
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        other => return Err(PrefixError::Invalid(format!("cannot cache {other:?} K/V"))),
    }
    Ok(())
}

/// The file's bytes for `chunk` under `key` of model `fp`: page-aligned length.
pub fn encode(fp: &Fingerprint, key: &ChunkKey, chunk: &ChunkKv) -> Result<Vec<u8>> {
    let shape = chunk.shape()?;
    let bytes = shape
        .payload_bytes()
        .ok_or_else(|| PrefixError::Invalid("a chunk too large to store".into()))?;
    let mut payload = Vec::with_capacity(bytes);
    for l in &chunk.layers {
        put_tensor(&l.k, &mut payload)?;
        put_tensor(&l.v, &mut payload)?;
    }
    let mut out = Header::encode(fp, key, &shape, &payload).map_err(PrefixError::Invalid)?;
    out.resize(HEADER_PAGE, 0);
    out.extend_from_slice(&payload);
    out.resize(round_up(out.len()), 0);
    Ok(out)
}

/// The chunk in `bytes` — a whole chunk, its padding included, nothing after — when it is
/// `key`'s of model `fp`, of the shape `expect` says, unaltered.
pub fn decode(
    bytes: &[u8],
    fp: &Fingerprint,
    key: &ChunkKey,
    expect: &Expect,
) -> std::result::Result<ChunkKv, Damage> {
    let header = Header::parse(bytes)?;
    header.check(fp, key, expect, bytes.len() as u64)?;
    let payload = &bytes[HEADER_PAGE..HEADER_PAGE + header.payload];
    header.verify(header.hasher().chain_update(payload))?;
    ChunkKv::from_payload(payload, &header.shape)
}

impl ChunkKv {
    /// The chunk whose every layer's K then V are `payload` (little-endian), of `shape`.
    pub fn from_payload(payload: &[u8], shape: &ChunkShape) -> std::result::Result<Self, Damage> {
        if shape.payload_bytes() != Some(payload.len()) || shape.n_layers == 0 {
            return Err(Damage(
                "a payload of another length than its shape's".into(),
            ));
        }
        let per = payload.len() / (2 * shape.n_layers);
        let dims = [1, shape.n_kv_heads, shape.tokens, shape.head_dim];
        let tensor = |at: usize| {
            Tensor::from_raw_buffer(&payload[at..at + per], shape.dtype, &dims, &Device::Cpu)
                .map_err(|e| Damage(format!("unreadable payload: {e}")))
        };
        let layers = (0..shape.n_layers)
            .map(|i| {
                Ok(LayerKv {
                    k: tensor(2 * i * per)?,
                    v: tensor((2 * i + 1) * per)?,
                })
            })
            .collect::<std::result::Result<Vec<_>, Damage>>()?;
        Ok(Self { layers })
    }
}

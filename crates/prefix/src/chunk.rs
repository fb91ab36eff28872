//! One chunk of K/V ([`ChunkKv`]: every layer's keys and values for `C` consecutive tokens,
//! on the host) and its bytes in a cache file: a header — magic, version, the model
//! [`Fingerprint`], the [`ChunkKey`], the shape, the dtype, the payload's length and a
//! SHA-256 over header and payload — padded to a page, then every layer's K then V,
//! padded to a page (so that the file can be read with `O_DIRECT`). A file whose checksum,
//! fingerprint, key or shape is not what the reader expects is damaged: a miss, never K/V.
use candle_core::{DType, Device, Tensor};
use sha2::{Digest, Sha256};

use crate::error::{PrefixError, Result};
use crate::key::{ChunkKey, Fingerprint};

/// Alignment of a chunk file's header, payload and length: the page size, a multiple of
/// every common logical block size (direct reads need it).
pub const ALIGN: usize = 4096;
/// "KVPC".
const MAGIC: [u8; 4] = *b"KVPC";
/// The file format's version.
const VERSION: u32 = 1;
/// Bytes of the header before the padding.
const HEADER: usize = 4 + 4 + 32 + 32 + 5 * 4 + 8 + 32;

/// One layer's K and V for a chunk: `(1, n_kv_heads, tokens, head_dim)` each.
#[derive(Clone, Debug)]
pub struct LayerKv {
    /// Keys, positional encoding applied (as the model hands them to a policy).
    pub k: Tensor,
    /// Values.
    pub v: Tensor,
}

/// Every layer's K/V for one chunk of tokens, on the host.
#[derive(Clone, Debug)]
pub struct ChunkKv {
    /// Per layer, in order.
    pub layers: Vec<LayerKv>,
}

/// The shape every layer of a chunk shares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkShape {
    /// Layers.
    pub n_layers: usize,
    /// KV heads.
    pub n_kv_heads: usize,
    /// Tokens.
    pub tokens: usize,
    /// Head width.
    pub head_dim: usize,
    /// Element type.
    pub dtype: DType,
}

impl ChunkShape {
    /// Bytes of K and V of every layer (`None`: more than a `usize` holds — a damaged
    /// header's dimensions).
    pub fn payload_bytes(&self) -> Option<usize> {
        [
            self.n_kv_heads,
            self.tokens,
            self.head_dim,
            self.dtype.size_in_bytes(),
        ]
        .into_iter()
        .try_fold(2 * self.n_layers, usize::checked_mul)
    }
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

fn dtype_code(dtype: DType) -> Result<u32> {
    match dtype {
        DType::F32 => Ok(0),
        DType::F16 => Ok(1),
        DType::BF16 => Ok(2),
        other => Err(PrefixError::Invalid(format!(
            "K/V of dtype {other:?} cannot be cached; f32, f16 and bf16 can"
        ))),
    }
}

fn dtype_of(code: u32) -> Option<DType> {
    [DType::F32, DType::F16, DType::BF16]
        .get(code as usize)
        .copied()
}

/// `n` rounded up to whole pages.
pub fn round_up(n: usize) -> usize {
    n.div_ceil(ALIGN) * ALIGN
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

/// The header fields, as written.
fn header(fp: &Fingerprint, key: &ChunkKey, shape: &ChunkShape) -> Result<Vec<u8>> {
    let mut h = Vec::with_capacity(HEADER);
    h.extend_from_slice(&MAGIC);
    h.extend_from_slice(&VERSION.to_le_bytes());
    h.extend_from_slice(&fp.0);
    h.extend_from_slice(&key.0);
    for n in [
        shape.n_layers,
        shape.n_kv_heads,
        shape.tokens,
        shape.head_dim,
    ] {
        let n = u32::try_from(n)
            .map_err(|_| PrefixError::Invalid(format!("a chunk dimension of {n} is too large")))?;
        h.extend_from_slice(&n.to_le_bytes());
    }
    h.extend_from_slice(&dtype_code(shape.dtype)?.to_le_bytes());
    let bytes = shape
        .payload_bytes()
        .ok_or_else(|| PrefixError::Invalid("a chunk too large to store".into()))?;
    h.extend_from_slice(&(bytes as u64).to_le_bytes());
    Ok(h)
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
    let mut out = header(fp, key, &shape)?;
    let sum = Sha256::new()
        .chain_update(&out)
        .chain_update(&payload)
        .finalize();
    out.extend_from_slice(&sum);
    out.resize(round_up(HEADER), 0);
    out.extend_from_slice(&payload);
    out.resize(round_up(out.len()), 0);
    Ok(out)
}

/// Why a file's bytes are not the chunk asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Damage(pub String);

/// The chunk in `bytes` when it is `key`'s of model `fp`, whole and unaltered.
pub fn decode(
    bytes: &[u8],
    fp: &Fingerprint,
    key: &ChunkKey,
) -> std::result::Result<ChunkKv, Damage> {
    let bad = |why: &str| Damage(why.to_string());
    if bytes.len() < round_up(HEADER) || bytes[..4] != MAGIC {
        return Err(bad("not a chunk file (no KVPC header)"));
    }
    let u32_at =
        |at: usize| u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]]);
    if u32_at(4) != VERSION {
        return Err(bad("another format version"));
    }
    if bytes[8..40] != fp.0 {
        return Err(bad(
            "written by another model, dtype or codec (fingerprint)",
        ));
    }
    if bytes[40..72] != key.0 {
        return Err(bad("holds another chunk (key)"));
    }
    let dims: Vec<usize> = (0..4).map(|i| u32_at(72 + 4 * i) as usize).collect();
    let dtype = dtype_of(u32_at(88)).ok_or_else(|| bad("unknown dtype"))?;
    let shape = ChunkShape {
        n_layers: dims[0],
        n_kv_heads: dims[1],
        tokens: dims[2],
        head_dim: dims[3],
        dtype,
    };
    let mut len = [0u8; 8];
    len.copy_from_slice(&bytes[92..100]);
    let len = u64::from_le_bytes(len) as usize;
    let start = round_up(HEADER);
    let fits = start.checked_add(len).is_some_and(|end| end <= bytes.len());
    if shape.payload_bytes() != Some(len) || !fits || shape.n_layers == 0 {
        return Err(bad("truncated, or its length disagrees with its shape"));
    }
    let payload = &bytes[start..start + len];
    let sum = Sha256::new()
        .chain_update(&bytes[..100])
        .chain_update(payload)
        .finalize();
    if sum.as_slice() != &bytes[100..132] {
        return Err(bad("checksum mismatch"));
    }
    let per = len / (2 * shape.n_layers.max(1));
    let dims = (1, shape.n_kv_heads, shape.tokens, shape.head_dim);
    let tensor = |at: usize| {
        Tensor::from_raw_buffer(
            &payload[at..at + per],
            dtype,
            &[dims.0, dims.1, dims.2, dims.3],
            &Device::Cpu,
        )
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
    Ok(ChunkKv { layers })
}

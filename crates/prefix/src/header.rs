//! A chunk's header, checked before anything else in its file is read: magic, version, the
//! model [`Fingerprint`], the [`ChunkKey`], the shape, the dtype, the payload's length and a
//! SHA-256 over header and payload, padded to a page. [`Header::parse`] takes the page,
//! [`Header::check`] compares every field with what the reader expects — the model, the key,
//! each dimension it knows ([`Expect`]) and the bytes the file holds after the header — so
//! that a file of another shape, or a header claiming more than its file holds, is refused
//! before a byte of its payload is allocated or read.
use candle_core::DType;
use sha2::{Digest, Sha256};

use crate::key::{ChunkKey, Fingerprint};

/// Alignment of a chunk file's header, payload and length: the page size, a multiple of
/// every common logical block size (direct reads need it).
pub const ALIGN: usize = 4096;
/// "KVPC".
const MAGIC: [u8; 4] = *b"KVPC";
/// The file format's version.
const VERSION: u32 = 1;
/// Bytes of the header's fields (what the checksum covers besides the payload).
const FIELDS: usize = 4 + 4 + 32 + 32 + 5 * 4 + 8;
/// Bytes of the header before the padding: the fields and the checksum.
pub const HEADER: usize = FIELDS + 32;

/// `n` rounded up to whole pages.
pub const fn round_up(n: usize) -> usize {
    n.div_ceil(ALIGN) * ALIGN
}

/// Bytes a header takes in a file: one page.
pub const HEADER_PAGE: usize = round_up(HEADER);

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

/// The code of a dtype chunks can hold (f32, f16, bf16).
pub fn dtype_code(dtype: DType) -> Option<u32> {
    match dtype {
        DType::F32 => Some(0),
        DType::F16 => Some(1),
        DType::BF16 => Some(2),
        _ => None,
    }
}

fn dtype_of(code: u32) -> Option<DType> {
    [DType::F32, DType::F16, DType::BF16]
        .get(code as usize)
        .copied()
}

/// Why a file's bytes are not the chunk asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Damage(pub String);

/// What a reader expects of a chunk's shape; a field left `None` is not compared (the
/// lengths are still checked against each other and against the file).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Expect {
    /// Layers.
    pub n_layers: Option<usize>,
    /// KV heads.
    pub n_kv_heads: Option<usize>,
    /// Tokens (a cache's chunk size).
    pub tokens: Option<usize>,
    /// Head width.
    pub head_dim: Option<usize>,
    /// Element type.
    pub dtype: Option<DType>,
}

impl Expect {
    /// Whether `shape` is what is expected; the first field that is not, otherwise.
    pub fn check(&self, shape: &ChunkShape) -> std::result::Result<(), Damage> {
        let dims = [
            ("layers", self.n_layers, shape.n_layers),
            ("KV heads", self.n_kv_heads, shape.n_kv_heads),
            ("tokens", self.tokens, shape.tokens),
            ("head width", self.head_dim, shape.head_dim),
        ];
        for (what, want, got) in dims {
            if want.is_some_and(|w| w != got) {
                return Err(Damage(format!(
                    "{got} {what}, not the model's {}",
                    want.unwrap_or_default()
                )));
            }
        }
        match self.dtype {
            Some(d) if d != shape.dtype => Err(Damage(format!(
                "K/V of {:?}, not the model's {d:?}",
                shape.dtype
            ))),
            _ => Ok(()),
        }
    }
}

/// A chunk file's header, parsed (not yet checked against what the reader expects).
#[derive(Clone, Debug)]
pub struct Header {
    fields: [u8; FIELDS],
    sum: [u8; 32],
    /// The model that computed the chunk.
    pub fingerprint: Fingerprint,
    /// The chunk's key.
    pub key: ChunkKey,
    /// Its shape.
    pub shape: ChunkShape,
    /// Bytes of its payload (every layer's K then V).
    pub payload: usize,
}

fn word(b: &[u8], at: usize) -> u32 {
    let mut w = [0u8; 4];
    w.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(w)
}

impl Header {
    /// The header's bytes (fields and checksum, unpadded) for a payload of `shape`.
    pub fn encode(
        fp: &Fingerprint,
        key: &ChunkKey,
        shape: &ChunkShape,
        payload: &[u8],
    ) -> std::result::Result<Vec<u8>, String> {
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
            let n =
                u32::try_from(n).map_err(|_| format!("a chunk dimension of {n} is too large"))?;
            h.extend_from_slice(&n.to_le_bytes());
        }
        let code = dtype_code(shape.dtype).ok_or_else(|| {
            format!(
                "K/V of dtype {:?} cannot be cached; f32, f16 and bf16 can",
                shape.dtype
            )
        })?;
        h.extend_from_slice(&code.to_le_bytes());
        if shape.payload_bytes() != Some(payload.len()) {
            return Err("a payload of another length than its shape's".into());
        }
        h.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        let sum = Sha256::new()
            .chain_update(&h)
            .chain_update(payload)
            .finalize();
        h.extend_from_slice(&sum);
        Ok(h)
    }

    /// The header in `bytes` (at least [`HEADER`] of them): its magic, version, dtype and
    /// lengths consistent with each other.
    pub fn parse(bytes: &[u8]) -> std::result::Result<Self, Damage> {
        let bad = |why: &str| Damage(why.to_string());
        if bytes.len() < HEADER || bytes[..4] != MAGIC {
            return Err(bad("not a chunk file (no KVPC header)"));
        }
        if word(bytes, 4) != VERSION {
            return Err(bad("another format version"));
        }
        let mut fp = [0u8; 32];
        fp.copy_from_slice(&bytes[8..40]);
        let mut key = [0u8; 32];
        key.copy_from_slice(&bytes[40..72]);
        let dims: [usize; 4] = std::array::from_fn(|i| word(bytes, 72 + 4 * i) as usize);
        let dtype = dtype_of(word(bytes, 88)).ok_or_else(|| bad("unknown dtype"))?;
        let shape = ChunkShape {
            n_layers: dims[0],
            n_kv_heads: dims[1],
            tokens: dims[2],
            head_dim: dims[3],
            dtype,
        };
        let mut len = [0u8; 8];
        len.copy_from_slice(&bytes[92..100]);
        let payload = usize::try_from(u64::from_le_bytes(len))
            .map_err(|_| bad("a payload length no file has"))?;
        if shape.payload_bytes() != Some(payload) || shape.n_layers == 0 || payload == 0 {
            return Err(bad("its length disagrees with its shape"));
        }
        let mut fields = [0u8; FIELDS];
        fields.copy_from_slice(&bytes[..FIELDS]);
        let mut sum = [0u8; 32];
        sum.copy_from_slice(&bytes[FIELDS..HEADER]);
        Ok(Self {
            fields,
            sum,
            fingerprint: Fingerprint(fp),
            key: ChunkKey(key),
            shape,
            payload,
        })
    }

    /// Bytes of the chunk with its padding: the header's page and the payload's pages.
    pub fn chunk_bytes(&self) -> u64 {
        (HEADER_PAGE + round_up(self.payload)) as u64
    }

    /// Whether this is `key`'s chunk of model `fp`, of the shape `expect` says, taking
    /// exactly the `available` bytes its file holds from the header on.
    pub fn check(
        &self,
        fp: &Fingerprint,
        key: &ChunkKey,
        expect: &Expect,
        available: u64,
    ) -> std::result::Result<(), Damage> {
        if self.fingerprint != *fp {
            return Err(Damage(
                "written by another model, dtype or codec (fingerprint)".into(),
            ));
        }
        if self.key != *key {
            return Err(Damage("holds another chunk (key)".into()));
        }
        expect.check(&self.shape)?;
        if self.chunk_bytes() != available {
            return Err(Damage(format!(
                "its header's length ({} bytes) is not the file's ({available} bytes): truncated or grown",
                self.chunk_bytes()
            )));
        }
        Ok(())
    }

    /// A hasher that has taken the header's fields: feed it the payload, then
    /// [`Header::verify`].
    pub fn hasher(&self) -> Sha256 {
        Sha256::new().chain_update(self.fields)
    }

    /// Whether `hasher`, fed the payload after [`Header::hasher`], gives the checksum.
    pub fn verify(&self, hasher: Sha256) -> std::result::Result<(), Damage> {
        if hasher.finalize().as_slice() == self.sum {
            Ok(())
        } else {
            Err(Damage("checksum mismatch".into()))
        }
    }
}

/// Payload bytes read per call: a bounded piece, a multiple of [`ALIGN`].
pub const PIECE: usize = 8 << 20;

impl Header {
    /// Fills `buf` — the payload, and any padding after it up to `buf`'s length — by
    /// `read(piece, offset)` (offsets from the payload's start, each piece at most [`PIECE`]
    /// bytes, each offset a multiple of it), hashing the payload as it comes; then checks
    /// the checksum. The outer error is the I/O's (which says nothing of the file's bytes).
    pub fn read_payload(
        &self,
        buf: &mut [u8],
        read: &mut dyn FnMut(&mut [u8], u64) -> std::io::Result<()>,
    ) -> std::io::Result<std::result::Result<(), Damage>> {
        if buf.len() < self.payload {
            return Ok(Err(Damage("a buffer shorter than the payload".into())));
        }
        let mut hasher = self.hasher();
        for (i, piece) in buf.chunks_mut(PIECE).enumerate() {
            let at = i * PIECE;
            read(piece, at as u64)?;
            let payload_part = self.payload.saturating_sub(at).min(piece.len());
            hasher.update(&piece[..payload_part]);
        }
        Ok(self.verify(hasher))
    }
}

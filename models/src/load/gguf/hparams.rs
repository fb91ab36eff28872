//! The hyperparameters a GGUF file's metadata gives (`{arch}.attention.head_count`, …),
//! each checked against the others and against the tensors the file holds before anything
//! is sized from it: a `block_count` of a billion or a head width of 2^40 is an error
//! naming the key, never an allocation.
use crate::error::Result;
use crate::load::gguf::file::GgufFile;
use crate::load::gguf::rules::{unsupported, GGUF_ARCHITECTURES};

/// A GGUF model's shape and numeric settings, checked.
#[derive(Clone, Debug)]
pub struct Hparams {
    /// `general.architecture`, one of [`GGUF_ARCHITECTURES`].
    pub arch: String,
    /// Query heads.
    pub n_heads: usize,
    /// KV heads (divides `n_heads`).
    pub n_kv_heads: usize,
    /// Decoder layers (each has its tensors in the file).
    pub n_layers: usize,
    /// Model width.
    pub hidden: usize,
    /// Head width (even; `n_heads × head_dim` is the query projection's width).
    pub head_dim: usize,
    /// Vocabulary (rows of `token_embd.weight`).
    pub vocab: usize,
    /// RMSNorm epsilon.
    pub eps: f64,
    /// RoPE base.
    pub theta: f64,
    /// Longest sequence (`context_length`).
    pub max_positions: usize,
}

impl Hparams {
    /// Reads and checks `g`'s hyperparameters.
    pub fn read(g: &GgufFile) -> Result<Self> {
        let arch = g.architecture()?;
        if !GGUF_ARCHITECTURES.contains(&arch.as_str()) {
            return Err(unsupported(g, &arch));
        }
        let key = |k: &str| format!("{arch}.{k}");
        let nh = g.meta_usize(&key("attention.head_count"))?;
        let nkv = g.meta_usize_or(&key("attention.head_count_kv"), nh)?;
        let n_layers = g.meta_usize(&key("block_count"))?;
        let h = g.meta_usize(&key("embedding_length"))?;
        let eps = g.meta_f64_or(&key("attention.layer_norm_rms_epsilon"), 1e-5)?;
        let theta = g.meta_f64_or(&key("rope.freq_base"), 10_000.0)?;
        let max_positions = g.meta_usize_or(&key("context_length"), 2048)?;
        if nh == 0 || nkv == 0 || nh % nkv != 0 {
            return Err(g.corrupt(format!(
                "has inconsistent head counts ({nh} heads, {nkv} KV heads): the query heads must be a \
                 whole multiple of the KV heads, both at least 1"
            )));
        }
        if n_layers == 0 {
            return Err(g.corrupt(format!(
                "says {arch}.block_count = 0; a decoder needs at least one layer"
            )));
        }
        if !(eps.is_finite() && eps >= 0.0) {
            return Err(g.corrupt(format!(
                "has {arch}.attention.layer_norm_rms_epsilon = {eps}; it must be a finite number ≥ 0"
            )));
        }
        if !(theta.is_finite() && theta > 0.0) {
            return Err(g.corrupt(format!(
                "has {arch}.rope.freq_base = {theta}; it must be a finite number > 0"
            )));
        }
        // The layer count sizes per-layer tables: it must be one the tensors bear out (each
        // layer is several tensors, and each tensor takes bytes of the file).
        let last = format!("blk.{}.attn_q.weight", n_layers - 1);
        if n_layers > g.content().tensor_infos.len() || !g.has_tensor(&last) {
            return Err(g.corrupt(format!(
                "says {arch}.block_count = {n_layers} but holds no {last}; the metadata does not match the tensors"
            )));
        }
        // Gemma's heads are wider than hidden / heads: `attention.key_length` says how wide.
        let hd = match g.meta(&key("attention.key_length")) {
            Some(_) => g.meta_usize(&key("attention.key_length"))?,
            None if h % nh == 0 => g.meta_usize_or(&key("rope.dimension_count"), h / nh)?,
            None => {
                return Err(g.corrupt(format!(
                "has a width of {h} that {nh} heads do not divide, and no {arch}.attention.key_length"
            )))
            }
        };
        // Sizes in the metadata are checked against the tensors (whose bytes the file holds)
        // before anything is allocated from them.
        let (vocab, emb_w) = match g.tensor_dims("token_embd.weight")?.as_slice() {
            [v, w] => (*v, *w),
            other => {
                return Err(g.corrupt(format!(
                    "token_embd.weight has dimensions {other:?}, expected 2"
                )))
            }
        };
        if emb_w != h {
            return Err(g.corrupt(format!(
                "token_embd.weight is {vocab}×{emb_w} but the embedding width is {h}"
            )));
        }
        let q = g.tensor_dims("blk.0.attn_q.weight")?;
        if q.get(1).copied() != Some(h)
            || hd.checked_mul(nh) != q.first().copied()
            || hd == 0
            || hd % 2 != 0
        {
            return Err(g.corrupt(format!(
                "blk.0.attn_q.weight has dimensions {q:?}, but {nh} heads × {hd} (even) from a width of {h} were expected"
            )));
        }
        Ok(Self {
            arch,
            n_heads: nh,
            n_kv_heads: nkv,
            n_layers,
            hidden: h,
            head_dim: hd,
            vocab,
            eps,
            theta,
            max_positions,
        })
    }
}

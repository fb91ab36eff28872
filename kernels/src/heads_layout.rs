//! The shapes [`heads_into`](crate::heads_into) works in: how RoPE pairs a head's values
//! ([`Rotation`]) and the index arithmetic the CPU loops and the CUDA kernel share.

/// How RoPE pairs the values of a head (candle's `rope` and `rope_i`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rotation {
    /// No rotation: a plain copy into heads (V, or models without RoPE).
    None,
    /// Value `i` pairs with `i + head_dim/2` (Llama's HF layout).
    Half,
    /// Value `2i` pairs with `2i + 1` (GGUF / original Llama layout).
    Interleaved,
}

impl Rotation {
    /// The code the CUDA kernel takes.
    pub fn code(self) -> i32 {
        match self {
            Rotation::None => 0,
            Rotation::Half => 1,
            Rotation::Interleaved => 2,
        }
    }
}

/// The index arithmetic both implementations share, checked against the layouts.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Geometry {
    pub b: usize,
    pub t: usize,
    pub heads: usize,
    pub d: usize,
    pub rows_offset: usize,
    pub trig_offset: usize,
    pub dst_offset: usize,
    pub dst_strides: [usize; 4],
}

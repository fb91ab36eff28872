//! Column panels: a quantized weight's rows repacked, 16 output columns at a time, into the
//! layout the integer GEMM ([`super::gemm`]) multiplies — llama.cpp's "repack" idea
//! (`ggml-cpu/repack.cpp`, weights interleaved so that one vector instruction computes many
//! output columns), done per call into a buffer the size of one panel instead of kept
//! beside the weight, so the model's memory does not grow.
//!
//! Every format becomes the same thing: per column and 32-element block, 32 unsigned bytes
//! `q`, one f32 scale per sub-block (32 or 16 elements) and one f32 offset, with the value
//! `scale·(q − z) + offset` for the format's zero `z`. `z` stays an integer so that
//! `Σ (q − z)·x` is exact (it is folded into the integer accumulator as `−z·Σx`).
//! Bytes are interleaved for `vpdpbusd`: group `g` of a block holds, for each of the 16
//! columns, that column's elements `4g … 4g+3` — one 64-byte load feeds 16 columns.
//!
//! Formats: GGML's 32-element Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (ggml-common.h, via
//! [`super::blocks`]) and the K-quants Gemma 3's GGUF uses (via [`super::kquants`]), Q4_K
//! (256-element super-blocks, eight 32-element sub-blocks with 6-bit scales and mins) and
//! Q6_K (sixteen 16-element sub-blocks, 8-bit scales, values `q − 32`).
use super::blocks::{self, f16_at, WeightFormat, QK};
use super::{kquants, rows8, rows8_k};

/// Where a weight's blocks are read from: its row-major bytes, or Q4_0 / Q4_K interleaved
/// eight rows at a time ([`rows8`], [`rows8_k`]), whose row-major blocks are reassembled as
/// they are packed.
#[derive(Debug, Clone, Copy)]
pub enum WeightRows<'a> {
    /// Row-major blocks (GGUF's own layout).
    Plain(&'a [u8]),
    /// Q4_0 in [`rows8`]'s layout, or Q4_K in [`rows8_k`]'s.
    Rows8(&'a [u8]),
}

/// Output columns per panel (one 512-bit register of i32 lanes).
pub const NR: usize = 16;

/// Bytes of one block's quantized values in a panel (32 elements × 16 columns).
pub const BLOCK_QS: usize = QK * NR;

/// A weight format the integer GEMM packs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PanelFormat {
    /// One of the 32-element block formats.
    Block(WeightFormat),
    /// GGML's Q4_K: 144 bytes per 256 elements.
    Q4K,
    /// GGML's Q6_K: 210 bytes per 256 elements.
    Q6K,
}

impl PanelFormat {
    /// Elements per stored block (32, or 256 for the K-quants).
    pub const fn block_elems(self) -> usize {
        match self {
            Self::Block(_) => QK,
            Self::Q4K | Self::Q6K => 256,
        }
    }

    /// Bytes per stored block.
    pub const fn block_bytes(self) -> usize {
        match self {
            Self::Block(f) => f.block_bytes(),
            Self::Q4K => 144,
            Self::Q6K => 210,
        }
    }

    /// Bytes of one weight row of `k` elements (`k` a multiple of [`Self::block_elems`]).
    pub const fn row_bytes(self, k: usize) -> usize {
        k / self.block_elems() * self.block_bytes()
    }

    /// Scales per 32-element block: 2 for Q6_K's 16-element sub-blocks, else 1.
    pub const fn subs(self) -> usize {
        match self {
            Self::Q6K => 2,
            _ => 1,
        }
    }

    /// The integer zero `z` subtracted from every unsigned value.
    pub const fn zero(self) -> i32 {
        match self {
            Self::Block(WeightFormat::Q4_0) => 8,
            Self::Block(WeightFormat::Q5_0) => 16,
            Self::Block(WeightFormat::Q8_0) => 128,
            Self::Q6K => 32,
            _ => 0,
        }
    }

    /// Whether values carry an f32 offset (Q4_1, Q5_1, Q4_K's mins).
    pub const fn has_offset(self) -> bool {
        matches!(
            self,
            Self::Block(WeightFormat::Q4_1) | Self::Block(WeightFormat::Q5_1) | Self::Q4K
        )
    }
}

/// One 32-element block of one column, decoded: unsigned values, sub-block scales, offset.
#[derive(Debug, Clone, Copy, Default)]
pub struct Decoded {
    /// Unsigned values, `q − z` being the integer value.
    pub q: [u8; QK],
    /// Scale of each sub-block (only the first [`PanelFormat::subs`] are used).
    pub scale: [f32; 2],
    /// Offset added to every element (0 without one).
    pub offset: f32,
}

/// One panel: [`NR`] columns of a weight, all of `k`.
#[derive(Debug, Default)]
pub struct Panel {
    /// `blocks × 8 groups × NR columns × 4` bytes.
    pub qs: Vec<u8>,
    /// `blocks × subs × NR` scales.
    pub scales: Vec<f32>,
    /// `blocks × NR` offsets (empty without them).
    pub offsets: Vec<f32>,
}

/// Decodes 32-element block `j` (within its stored block `b`) of `fmt`.
#[inline(always)]
pub fn decode(fmt: PanelFormat, b: &[u8], j: usize) -> Decoded {
    let mut out = Decoded::default();
    match fmt {
        PanelFormat::Block(f) => {
            let (d, m, qh, qs) = blocks::fields(f, b);
            let z = fmt.zero();
            for (o, v) in out.q.iter_mut().zip(blocks::values(f, qh, qs)) {
                *o = (v + z) as u8;
            }
            out.scale = [d, 0.0];
            out.offset = m;
        }
        PanelFormat::Q4K => {
            let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
            let (sc, mn) = kquants::q4k_scale_min(j, &b[4..16]);
            out.q = kquants::q4k_values(b, j);
            out.scale = [d * sc as f32, 0.0];
            out.offset = -(dmin * mn as f32);
        }
        PanelFormat::Q6K => {
            let (sc, d) = (kquants::q6k_scales(b), f16_at(b, 208));
            out.q = kquants::q6k_values(b, j);
            out.scale = [d * sc[2 * j] as f32, d * sc[2 * j + 1] as f32];
        }
    }
    out
}

impl Panel {
    /// Packs columns `NR·p ..` of the `(n, k)` weight `data` (columns past `n` zero).
    pub fn pack(&mut self, fmt: PanelFormat, data: &[u8], n: usize, k: usize, p: usize) {
        self.pack_from(fmt, WeightRows::Plain(data), n, k, p)
    }

    /// [`Self::pack`] from either layout (the same panel from the same weight).
    pub fn pack_from(
        &mut self,
        fmt: PanelFormat,
        data: WeightRows<'_>,
        n: usize,
        k: usize,
        p: usize,
    ) {
        // One copy of the loop per format, so that `decode` is compiled for a constant
        // format (its per-format branches gone, its value loops vectorized).
        macro_rules! each {
            ($($f:expr),*) => {
                match fmt {
                    $(f if f == $f => self.pack_with($f, data, n, k, p, |b, j| decode($f, b, j)),)*
                    _ => self.pack_with(fmt, data, n, k, p, |b, j| decode(fmt, b, j)),
                }
            };
        }
        each!(
            PanelFormat::Block(WeightFormat::Q4_0),
            PanelFormat::Block(WeightFormat::Q4_1),
            PanelFormat::Block(WeightFormat::Q5_0),
            PanelFormat::Block(WeightFormat::Q5_1),
            PanelFormat::Block(WeightFormat::Q8_0),
            PanelFormat::Q4K,
            PanelFormat::Q6K
        )
    }

    #[inline(always)]
    fn pack_with(
        &mut self,
        fmt: PanelFormat,
        data: WeightRows<'_>,
        n: usize,
        k: usize,
        p: usize,
        decode: impl Fn(&[u8], usize) -> Decoded,
    ) {
        let blocks = k / QK;
        let subs = fmt.subs();
        self.qs.clear();
        self.qs.resize(blocks * BLOCK_QS, 0);
        self.scales.clear();
        self.scales.resize(blocks * subs * NR, 0.0);
        self.offsets.clear();
        if fmt.has_offset() {
            self.offsets.resize(blocks * NR, 0.0);
        }
        let per_stored = fmt.block_elems() / QK;
        let row_bytes = fmt.row_bytes(k);
        let mut reassembled = [0u8; rows8_k::SUPER_BYTES];
        for c in 0..NR.min(n.saturating_sub(NR * p)) {
            let r = NR * p + c;
            for blk in 0..blocks {
                let stored = blk / per_stored;
                let b: &[u8] = match data {
                    WeightRows::Plain(data) => {
                        let at = r * row_bytes + stored * fmt.block_bytes();
                        &data[at..at + fmt.block_bytes()]
                    }
                    WeightRows::Rows8(data) if fmt == PanelFormat::Q4K => {
                        // Once per super-block, not per each of its eight 32-element blocks.
                        if blk % per_stored == 0 {
                            reassembled = rows8_k::plain_block(data, k, r, stored);
                        }
                        &reassembled
                    }
                    WeightRows::Rows8(data) => {
                        reassembled[..18].copy_from_slice(&rows8::plain_block(data, k, r, stored));
                        &reassembled[..18]
                    }
                };
                let dec = decode(b, blk % per_stored);
                let qs = &mut self.qs[blk * BLOCK_QS..(blk + 1) * BLOCK_QS];
                for (g, four) in dec.q.chunks_exact(4).enumerate() {
                    qs[g * 4 * NR + 4 * c..g * 4 * NR + 4 * c + 4].copy_from_slice(four);
                }
                for s in 0..subs {
                    self.scales[(blk * subs + s) * NR + c] = dec.scale[s];
                }
                if fmt.has_offset() {
                    self.offsets[blk * NR + c] = dec.offset;
                }
            }
        }
    }
}

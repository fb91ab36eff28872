//! GGML's K-quants that Gemma 3's GGUF uses — Q4_K and Q6_K, 256-element super-blocks —
//! read from a weight's raw bytes, and their decode-side dot products with Q8_K activations
//! (llama.cpp's `ggml_vec_dot_q4_K_q8_K` / `ggml_vec_dot_q6_K_q8_K`, ggml-quants.c): the
//! portable reference the AVX2 path (`avx2_kquants`, x86-64) equals bit for bit.
//!
//! Layouts (ggml-common.h): Q4_K is `d`, `dmin` (f16), twelve bytes of 6-bit scales and mins
//! for eight 32-element sub-blocks, 128 bytes of nibbles (sub-blocks `2c` and `2c + 1` the
//! low and high nibbles of bytes `32c .. 32c + 32`); a value is `d·sc·q − dmin·m`. Q6_K is
//! 128 bytes of low nibbles `ql`, 64 bytes of high bit pairs `qh`, sixteen signed 8-bit
//! scales (one per 16 elements), `d` (f16); a value is `d·sc·(q − 32)`.
//!
//! Per super-block the integer sum `Σ sc·Σ q·x` (and Q4_K's `Σ m·Σ x`, Q6_K's `32·Σ sc·Σ x`
//! from the activations' 16-element sums, as `BlockQ8K::bsums` keeps them) is exact in i32;
//! the f32 part is then `d·d_x·sum` (less `dmin·d_x·mins`), in one order for every path.
use super::blocks::{f16_at, quantize_row_q8k, ActBlock, QK};

/// Elements per K-quant super-block.
pub const QK_K: usize = 256;

/// A K-quant weight format with its own decode dot product here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KQuant {
    /// GGML's Q4_K: 144 bytes per 256 elements.
    Q4K,
    /// GGML's Q6_K: 210 bytes per 256 elements.
    Q6K,
}

impl KQuant {
    /// Bytes per 256-element super-block.
    pub const fn block_bytes(self) -> usize {
        match self {
            Self::Q4K => 144,
            Self::Q6K => 210,
        }
    }
}

/// One activation row quantized for the K-quants: Q8_K (eight [`ActBlock`]s per 256
/// elements sharing one scale, as [`quantize_row_q8k`] makes them) and the sum of each
/// 16 quantized values.
#[derive(Debug, Clone)]
pub struct Q8KRow {
    /// The row's 32-element blocks.
    pub blocks: Vec<ActBlock>,
    /// `Σ q` over each 16 consecutive elements.
    pub sums: Vec<i16>,
}

impl Q8KRow {
    /// Quantizes `x`.
    ///
    /// # Panics
    /// If `x`'s length is not a multiple of 256.
    pub fn new(x: &[f32]) -> Self {
        assert!(
            x.len().is_multiple_of(QK_K),
            "Q8KRow: {} values are not whole super-blocks of {QK_K}",
            x.len()
        );
        let mut blocks = vec![ActBlock::ZERO; x.len() / QK];
        quantize_row_q8k(x, &mut blocks);
        let sums = blocks
            .iter()
            .flat_map(|b| b.qs.chunks_exact(16))
            .map(|s| s.iter().map(|q| *q as i16).sum())
            .collect();
        Self { blocks, sums }
    }

    /// The shared scale of super-block `sb`.
    pub fn scale(&self, sb: usize) -> f32 {
        self.blocks[sb * (QK_K / QK)].d
    }
}

/// Q4_K's 6-bit scale and min of sub-block `j` from its twelve scale bytes `s` (ggml's
/// `get_scale_min_k4`).
#[inline(always)]
pub fn q4k_scale_min(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// Q4_K's eight 6-bit scales and eight mins from its twelve scale bytes `s`, all at once
/// (llama.cpp's unpacking through three 32-bit words: what [`q4k_scale_min`] gives for each
/// sub-block, without a branch).
#[inline(always)]
pub fn q4k_scales_mins(s: &[u8]) -> Q4KScales {
    let word = |i: usize| u32::from_le_bytes([s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]]);
    let (w0, w1, w2) = (word(0), word(1), word(2));
    let (six, four, two) = (0x3f3f_3f3f, 0x0f0f_0f0f, 0x0303_0303);
    // Scales 0..4: low six bits of bytes 0..4; 4..8: low nibbles of bytes 8..12 with the top
    // two bits of bytes 0..4. Mins likewise from bytes 4..8 and the high nibbles.
    let scales_hi = (w2 & four) | (((w0 >> 6) & two) << 4);
    let mins_hi = ((w2 >> 4) & four) | (((w1 >> 6) & two) << 4);
    let join = |a: u32, b: u32| {
        let (a, b) = (a.to_le_bytes(), b.to_le_bytes());
        [a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3]]
    };
    Q4KScales {
        scales: join(w0 & six, scales_hi),
        mins: join(w1 & six, mins_hi),
    }
}

/// Q4_K's unpacked scales and mins of one super-block, per 32-element sub-block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(C, align(8))]
pub struct Q4KScales {
    /// The eight 6-bit scales.
    pub scales: [u8; 8],
    /// The eight 6-bit mins.
    pub mins: [u8; 8],
}

/// The 32 unsigned values (0..=15) of Q4_K sub-block `j` of super-block `b`.
#[inline(always)]
pub fn q4k_values(b: &[u8], j: usize) -> [u8; QK] {
    let qs = &b[16 + 32 * (j / 2)..16 + 32 * (j / 2) + 32];
    let shift = 4 * (j % 2);
    let mut out = [0u8; QK];
    for (o, q) in out.iter_mut().zip(qs) {
        *o = (q >> shift) & 0x0F;
    }
    out
}

/// The 32 unsigned values (0..=63, the value being `q − 32`) of elements `32j .. 32j + 32`
/// of Q6_K super-block `b`.
#[inline(always)]
pub fn q6k_values(b: &[u8], j: usize) -> [u8; QK] {
    let (ql, qh) = (&b[0..128], &b[128..192]);
    // Elements 128h + 32t + l: the low nibble (t < 2) or high one of ql[64h + 32(t % 2) + l],
    // and bits 2t, 2t + 1 of qh[32h + l].
    let (h, t) = (j / 4, j % 4);
    let low = &ql[64 * h + 32 * (t % 2)..64 * h + 32 * (t % 2) + 32];
    let high = &qh[32 * h..32 * h + 32];
    let mut out = [0u8; QK];
    for ((o, l), q) in out.iter_mut().zip(low).zip(high) {
        let l = if t < 2 { l & 0x0F } else { l >> 4 };
        *o = l | (((q >> (2 * t)) & 3) << 4);
    }
    out
}

/// Q6_K's sixteen signed scales of super-block `b`.
#[inline(always)]
pub fn q6k_scales(b: &[u8]) -> [i8; 16] {
    std::array::from_fn(|s| b[192 + s] as i8)
}

/// One super-block's contribution from its exact integer sums: `d·d_x·sum − dmin·d_x·mins`
/// (Q6_K: `mins` 0). Every path ends each super-block here, so all agree bit for bit.
#[inline(always)]
pub fn finish(acc: f32, d: f32, dmin: f32, xd: f32, sum: i32, mins: i32) -> f32 {
    acc + (d * xd) * sum as f32 - (dmin * xd) * mins as f32
}

/// Q4_K's `Σ m_j · Σ x` over sub-blocks `j` of super-block `sb` (the mins' part).
#[inline(always)]
pub fn q4k_mins(scales: &[u8], sums: &[i16], sb: usize) -> i32 {
    (0..8)
        .map(|j| {
            let m = q4k_scale_min(j, scales).1 as i32;
            m * (sums[16 * sb + 2 * j] as i32 + sums[16 * sb + 2 * j + 1] as i32)
        })
        .sum()
}

/// Q6_K's `32 · Σ sc_s · Σ x` over the sixteen 16-element sub-blocks `s` of super-block
/// `sb` (what the zero of `q − 32` takes off `Σ sc·Σ q·x`).
#[inline(always)]
pub fn q6k_offset(scales: &[i8; 16], sums: &[i16], sb: usize) -> i32 {
    32 * scales
        .iter()
        .zip(&sums[16 * sb..16 * sb + 16])
        .map(|(s, x)| *s as i32 * *x as i32)
        .sum::<i32>()
}

/// The dot product of one weight row (its super-blocks' bytes) with `x`: the portable
/// path.
pub fn dot_scalar(fmt: KQuant, row: &[u8], x: &Q8KRow) -> f32 {
    let mut acc = 0f32;
    for (sb, b) in row.chunks_exact(fmt.block_bytes()).enumerate() {
        let xs = &x.blocks[sb * 8..sb * 8 + 8];
        let xd = x.scale(sb);
        match fmt {
            KQuant::Q4K => {
                let scales = &b[4..16];
                let mut sum = 0i32;
                for (j, xb) in xs.iter().enumerate() {
                    let sc = q4k_scale_min(j, scales).0 as i32;
                    sum += sc * int_dot(&q4k_values(b, j), &xb.qs);
                }
                let mins = q4k_mins(scales, &x.sums, sb);
                acc = finish(acc, f16_at(b, 0), f16_at(b, 2), xd, sum, mins);
            }
            KQuant::Q6K => {
                let scales = q6k_scales(b);
                let mut sum = 0i32;
                for (j, xb) in xs.iter().enumerate() {
                    let q = q6k_values(b, j);
                    sum += scales[2 * j] as i32 * int_dot(&q[..16], &xb.qs[..16])
                        + scales[2 * j + 1] as i32 * int_dot(&q[16..], &xb.qs[16..]);
                }
                sum -= q6k_offset(&scales, &x.sums, sb);
                acc = finish(acc, f16_at(b, 208), 0.0, xd, sum, 0);
            }
        }
    }
    acc
}

/// `Σ w·x` of unsigned weight and signed activation bytes.
fn int_dot(w: &[u8], x: &[i8]) -> i32 {
    w.iter().zip(x).map(|(w, x)| *w as i32 * *x as i32).sum()
}

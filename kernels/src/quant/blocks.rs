//! GGML's 32-element block formats — Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 — read from a weight's
//! raw bytes, the activation side quantized to Q8_0/Q8_1 the way candle does it (so integer
//! sums match candle's exactly; Q8_K's one scale per 256 for the K-quants), and the portable
//! reference dot products the SIMD paths are checked against.
//!
//! Layouts (ggml-common.h): element `j < 16` of a 4/5-bit block is the low nibble of
//! `qs[j]`, element `j + 16` its high nibble; Q5's fifth bit of element `j` is bit `j` of
//! the little-endian `qh`. Q4_1/Q5_1 values are `d·q + m`, Q4_0's `d·(q − 8)`, Q5_0's
//! `d·(q − 16)`, Q8_0's `d·q` with `q` a signed byte.
use half::f16;

/// Elements per block (every format here).
pub const QK: usize = 32;

/// A weight block format handled here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightFormat {
    /// `d` (f16), 16 bytes of nibbles: 18 bytes.
    Q4_0,
    /// `d`, `m` (f16), 16 bytes of nibbles: 20 bytes.
    Q4_1,
    /// `d` (f16), `qh` (u32), 16 bytes of nibbles: 22 bytes.
    Q5_0,
    /// `d`, `m` (f16), `qh` (u32), 16 bytes of nibbles: 24 bytes.
    Q5_1,
    /// `d` (f16), 32 signed bytes: 34 bytes.
    Q8_0,
}

impl WeightFormat {
    /// Bytes per block.
    pub const fn block_bytes(self) -> usize {
        match self {
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q5_0 => 22,
            Self::Q5_1 => 24,
            Self::Q8_0 => 34,
        }
    }
}

/// One activation block, Q8_0 or Q8_1 (`x ≈ d·q`; `s = d·Σq`, Q8_1 only, else 0), or a
/// 32-value eighth of a Q8_K block (its `d` shared by the eight, `s` 0).
#[derive(Debug, Clone, Copy)]
#[repr(C, align(32))]
pub struct ActBlock {
    /// The 32 quantized values.
    pub qs: [i8; QK],
    /// Scale.
    pub d: f32,
    /// `d·Σq`, rounded as candle's `BlockQ8_1` rounds it (f16 sum × f16 scale).
    pub s: f32,
}

impl ActBlock {
    /// The block of 32 zeros (what a buffer of blocks starts as before quantizing into it).
    pub const ZERO: Self = Self {
        qs: [0; QK],
        d: 0.0,
        s: 0.0,
    };
}

/// Quantizes `x` (a multiple of 32 long) into `out` as candle's `BlockQ8_0`/`BlockQ8_1`
/// `from_float` do: `d = amax/127` (kept at f16 precision), `q = round(x/d)` (ties away from
/// zero) — bit for bit, on AVX2 where the CPU has it (runtime detection; the same code
/// compiled for 256-bit vectors), else portably.
pub fn quantize_row(x: &[f32], out: &mut [ActBlock]) {
    #[cfg(target_arch = "x86_64")]
    if super::features::avx2() {
        // SAFETY: `features::avx2` checked AVX2 (and FMA, F16C).
        return unsafe { quantize_row_avx2(x, out) };
    }
    quantize_row_portable(x, out);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn quantize_row_avx2(x: &[f32], out: &mut [ActBlock]) {
    quantize_row_portable(x, out);
}

/// [`quantize_row`]'s math, written so that it vectorizes: no `round` (a libm call without
/// SSE4.1), the maximum over eight lanes.
#[inline(always)]
fn quantize_row_portable(x: &[f32], out: &mut [ActBlock]) {
    for (xs, b) in x.chunks_exact(QK).zip(out.iter_mut()) {
        let amax = abs_max(xs);
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let sum = round_block(xs, id, &mut b.qs);
        let d16 = f16::from_f32(d);
        b.d = d16.to_f32();
        b.s = (f16::from_f32(sum as f32) * d16).to_f32();
    }
}

/// `qs[i] = round(scale · x[i])` (ties away from zero, saturated into i8) for one block of
/// 32 values; returns the sum of the values written.
#[inline(always)]
fn round_block(x: &[f32], scale: f32, qs: &mut [i8; QK]) -> i32 {
    let mut q = [0i32; QK];
    for (q, v) in q.iter_mut().zip(x) {
        *q = round_away(scale * v);
    }
    for (o, v) in qs.iter_mut().zip(q) {
        *o = v as i8;
    }
    q.iter().sum()
}

/// `t.round() as i8` (saturating; NaN gives 0) as an i32: clamped into i8's range, the
/// truncation, then one step away from zero where the exact remainder `t − trunc(t)` is at
/// least a half.
#[inline(always)]
fn round_away(t: f32) -> i32 {
    let t = if t.is_nan() {
        0.0
    } else {
        t.clamp(-128.0, 127.0)
    };
    // SAFETY: `t` is finite and within i32's range (`as` would compile to a scalar
    // saturating conversion, this to one vector instruction per eight values).
    let i = unsafe { t.to_int_unchecked::<i32>() };
    let f = t - i as f32;
    i + (f >= 0.5) as i32 - (f <= -0.5) as i32
}

/// Quantizes `x` (a multiple of 256 long) as candle's `BlockQ8K::from_float` does (ggml's
/// `quantize_row_q8_K` too, but for ties, which it rounds to even), the activation side of
/// the K-quants: one scale per 256
/// values, `d = max/−127` from the value of largest magnitude, `q = round(x/d)`; each
/// 256 fill eight blocks of `out` sharing `d` (`s` left 0).
pub fn quantize_row_q8k(x: &[f32], out: &mut [ActBlock]) {
    #[cfg(target_arch = "x86_64")]
    if super::features::avx2() {
        // SAFETY: `features::avx2` checked AVX2 (and FMA, F16C).
        return unsafe { quantize_row_q8k_avx2(x, out) };
    }
    quantize_row_q8k_portable(x, out);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn quantize_row_q8k_avx2(x: &[f32], out: &mut [ActBlock]) {
    quantize_row_q8k_portable(x, out);
}

/// [`quantize_row_q8k`]'s math, vectorizable as [`quantize_row_portable`]'s: the largest
/// magnitude over eight lanes, then the first value of that magnitude (candle keeps the
/// first).
#[inline(always)]
fn quantize_row_q8k_portable(x: &[f32], out: &mut [ActBlock]) {
    for (xs, bs) in x.chunks_exact(256).zip(out.chunks_exact_mut(256 / QK)) {
        let amax = abs_max(xs);
        let max = xs.iter().copied().find(|v| v.abs() == amax).unwrap_or(0.0);
        let iscale = if amax == 0.0 { 0.0 } else { -127.0 / max };
        let d = if amax == 0.0 { 0.0 } else { 1.0 / iscale };
        for (x32, b) in xs.chunks_exact(QK).zip(bs.iter_mut()) {
            round_block(x32, iscale, &mut b.qs);
            b.d = d;
            b.s = 0.0;
        }
    }
}

/// The largest `|v|` of `xs` (a multiple of 8 long), NaN skipped as `f32::max` skips it.
#[inline(always)]
fn abs_max(xs: &[f32]) -> f32 {
    debug_assert!(xs.len().is_multiple_of(8), "abs_max: {} values", xs.len());
    let mut lanes = [0f32; 8];
    for eight in xs.chunks_exact(8) {
        for (m, v) in lanes.iter_mut().zip(eight) {
            let a = v.abs();
            *m = if a > *m { a } else { *m };
        }
    }
    lanes.iter().fold(0f32, |a, v| a.max(*v))
}

/// The f16 at byte `at` of `b`.
pub(crate) fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// The fields of one weight block: scale, offset (0 without one), fifth bits (0 without),
/// the packed values (16 bytes of nibbles, or Q8_0's 32 bytes).
#[inline(always)]
pub fn fields(fmt: WeightFormat, b: &[u8]) -> (f32, f32, u32, &[u8]) {
    let qh = |at: usize| u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
    match fmt {
        WeightFormat::Q4_0 => (f16_at(b, 0), 0.0, 0, &b[2..18]),
        WeightFormat::Q4_1 => (f16_at(b, 0), f16_at(b, 2), 0, &b[4..20]),
        WeightFormat::Q5_0 => (f16_at(b, 0), 0.0, qh(2), &b[6..22]),
        WeightFormat::Q5_1 => (f16_at(b, 0), f16_at(b, 2), qh(4), &b[8..24]),
        WeightFormat::Q8_0 => (f16_at(b, 0), 0.0, 0, &b[2..34]),
    }
}

/// The 32 integer values of one block: nibble, plus 16 for a set fifth bit (Q5), less 8
/// for Q4_0 and 16 for Q5_0; element `j < 16` from the low nibble of `qs[j]`, `j + 16` from
/// its high one. Q8_0's are its signed bytes.
#[inline(always)]
pub(crate) fn values(fmt: WeightFormat, qh: u32, qs: &[u8]) -> [i32; QK] {
    let mut v = [0i32; QK];
    if fmt == WeightFormat::Q8_0 {
        for (x, q) in v.iter_mut().zip(qs) {
            *x = *q as i8 as i32;
        }
        return v;
    }
    let (lo, hi) = v.split_at_mut(QK / 2);
    for (j, ((l, h), q)) in lo.iter_mut().zip(hi.iter_mut()).zip(qs).enumerate() {
        *l = (q & 0x0F) as i32;
        *h = (q >> 4) as i32;
        if matches!(fmt, WeightFormat::Q5_0 | WeightFormat::Q5_1) {
            *l |= (((qh >> j) & 1) << 4) as i32;
            *h |= (((qh >> (j + 16)) & 1) << 4) as i32;
        }
        let zero = match fmt {
            WeightFormat::Q4_0 => 8,
            WeightFormat::Q5_0 => 16,
            _ => 0,
        };
        *l -= zero;
        *h -= zero;
    }
    v
}

/// The dot product of one weight row (its blocks' bytes) with quantized activations:
/// per block `d_w·d_x·Σ q_w q_x` (`+ m_w·s_x` for Q4_1 and Q5_1), integer sums exact. The
/// portable path.
pub fn dot_scalar(fmt: WeightFormat, row: &[u8], x: &[ActBlock]) -> f32 {
    let mut acc = 0f32;
    for (b, xb) in row.chunks_exact(fmt.block_bytes()).zip(x) {
        let (d, m, qh, qs) = fields(fmt, b);
        let sum: i32 = values(fmt, qh, qs)
            .iter()
            .zip(&xb.qs)
            .map(|(w, x)| w * *x as i32)
            .sum();
        // The offset term only where the format has one: `0·s` would turn a block whose
        // activation sum overflows f16 (`s` infinite, |Σx| past ~65,504) into NaN.
        acc += if matches!(fmt, WeightFormat::Q4_1 | WeightFormat::Q5_1) {
            d * xb.d * sum as f32 + m * xb.s
        } else {
            d * xb.d * sum as f32
        };
    }
    acc
}

/// One weight row dequantized to f32 (for tests and references).
pub fn dequantize_row(fmt: WeightFormat, row: &[u8], out: &mut [f32]) {
    for (b, o) in row
        .chunks_exact(fmt.block_bytes())
        .zip(out.chunks_exact_mut(QK))
    {
        let (d, m, qh, qs) = fields(fmt, b);
        for (y, q) in o.iter_mut().zip(values(fmt, qh, qs)) {
            *y = d * q as f32 + m;
        }
    }
}

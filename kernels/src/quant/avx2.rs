//! AVX2 + FMA dot products of Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 weight rows with Q8 activations: per block the
//! 32 weight values are unpacked to bytes in one register, multiplied with the activation
//! bytes by `maddubs` (u8 × i8 → pairs of i16), widened by `madd` to eight i32 sums and
//! accumulated in f32 with the block's scale by FMA. Integer sums are exact, as in the
//! scalar path ([`super::blocks::dot_scalar`]); only the f32 accumulation order differs.
#![allow(unsafe_code)]

use std::arch::x86_64::*;

use super::blocks::{ActBlock, WeightFormat};

/// Whether this CPU has AVX-VNNI (`vpdpbusd` on 256-bit registers: the u8 × i8 products of
/// a block summed into i32 lanes in one instruction, where AVX2 takes `maddubs` + `madd`).
/// Checked once.
pub fn vnni() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| available() && is_x86_feature_detected!("avxvnni"))
}

/// Whether this CPU runs the AVX2 path (checked once).
pub fn available() -> bool {
    super::features::avx2()
}

/// The 32 weight values of one block, unpacked to bytes: nibbles, plus 16 where the
/// block's fifth bit is set (Q5). Unsigned 0..=31.
#[inline(always)]
unsafe fn unpack(qs: *const u8, qh: Option<u32>) -> __m256i {
    let raw = _mm_loadu_si128(qs as *const __m128i);
    let low = _mm_set1_epi8(0x0F);
    let lo = _mm_and_si128(raw, low);
    let hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low);
    let v = _mm256_set_m128i(hi, lo);
    match qh {
        None => v,
        Some(qh) => {
            // Byte j takes byte j/8 of qh, then tests bit j%8 of it.
            let spread = _mm256_shuffle_epi8(
                _mm256_set1_epi32(qh as i32),
                _mm256_setr_epi8(
                    0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3,
                    3, 3, 3, 3, 3, 3,
                ),
            );
            let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
            let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
            _mm256_or_si256(v, _mm256_and_si256(set, _mm256_set1_epi8(0x10)))
        }
    }
}

/// Σ over the block of w·x as eight f32 lanes: `w` unsigned bytes (or signed when
/// `signed`), `x` signed bytes; one `vpdpbusd` with `V` (AVX-VNNI), else `maddubs` +
/// `madd`. The same exact integer sums either way (no product pair reaches i16's limit:
/// |w| ≤ 128, |x| ≤ 127).
#[inline(always)]
unsafe fn block_sum<const V: bool>(w: __m256i, x: __m256i, signed: bool) -> __m256 {
    // The unsigned operand comes first: move a signed w's sign onto x.
    let (w, x) = if signed {
        (_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w))
    } else {
        (w, x)
    };
    if V {
        return _mm256_cvtepi32_ps(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, x));
    }
    let pairs = _mm256_maddubs_epi16(w, x);
    _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
}

#[inline(always)]
unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// The f16 at `p` (F16C).
#[inline(always)]
pub(super) unsafe fn f16_at(p: *const u8) -> f32 {
    let h = u16::from_le_bytes([*p, *p.add(1)]);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)))
}

/// The u32 at `p`.
#[inline(always)]
unsafe fn u32_at(p: *const u8) -> u32 {
    (p as *const u32).read_unaligned()
}

const Q4_0: u8 = 0;
const Q4_1: u8 = 1;
const Q5_0: u8 = 2;
const Q5_1: u8 = 3;
const Q8_0: u8 = 4;

/// One block's contribution: `d_w·d_x·Σ q_w q_x` as eight lanes added into `acc`, and
/// `m_w·s_x` returned. `F` is the format, `b` the block's bytes.
#[inline(always)]
unsafe fn block<const F: u8, const V: bool>(
    b: *const u8,
    xb: &ActBlock,
    acc: __m256,
) -> (__m256, f32) {
    let xv = _mm256_load_si256(xb.qs.as_ptr() as *const __m256i);
    let d = f16_at(b);
    let (sum, m) = match F {
        Q4_0 => (
            block_sum::<V>(
                _mm256_sub_epi8(unpack(b.add(2), None), _mm256_set1_epi8(8)),
                xv,
                true,
            ),
            0.0,
        ),
        Q8_0 => (
            block_sum::<V>(_mm256_loadu_si256(b.add(2) as *const __m256i), xv, true),
            0.0,
        ),
        Q4_1 => (
            block_sum::<V>(unpack(b.add(4), None), xv, false),
            f16_at(b.add(2)),
        ),
        Q5_0 => (
            block_sum::<V>(
                _mm256_sub_epi8(
                    unpack(b.add(6), Some(u32_at(b.add(2)))),
                    _mm256_set1_epi8(16),
                ),
                xv,
                true,
            ),
            0.0,
        ),
        _ => (
            block_sum::<V>(unpack(b.add(8), Some(u32_at(b.add(4)))), xv, false),
            f16_at(b.add(2)),
        ),
    };
    // The offset term only where the format has one (as the portable loop: `0·s` is NaN
    // for an activation block whose f16 sum overflowed).
    let off = if F == Q4_1 || F == Q5_1 {
        m * xb.s
    } else {
        0.0
    };
    (_mm256_fmadd_ps(_mm256_set1_ps(d * xb.d), sum, acc), off)
}

/// The dot product for format `F`: two blocks per iteration into two accumulators (the
/// FMA latency is not on one chain).
#[inline(always)]
unsafe fn dot_fmt<const F: u8, const V: bool>(bytes: usize, row: &[u8], x: &[ActBlock]) -> f32 {
    let n = x.len().min(row.len() / bytes);
    let p = row.as_ptr();
    let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let (mut o0, mut o1) = (0f32, 0f32);
    let mut i = 0;
    while i + 1 < n {
        let (acc, off) = block::<F, V>(p.add(i * bytes), &x[i], a0);
        a0 = acc;
        o0 += off;
        let (acc, off) = block::<F, V>(p.add((i + 1) * bytes), &x[i + 1], a1);
        a1 = acc;
        o1 += off;
        i += 2;
    }
    if i < n {
        let (acc, off) = block::<F, V>(p.add(i * bytes), &x[i], a0);
        a0 = acc;
        o0 += off;
    }
    hsum(_mm256_add_ps(a0, a1)) + o0 + o1
}

/// [`dot_fmt`] for four rows against the same activations: each activation block is
/// loaded once for the four, and every row keeps [`dot_fmt`]'s two accumulators and its
/// order of additions, so each result is bit for bit the one row's [`dot_fmt`].
#[inline(always)]
unsafe fn dot4_fmt<const F: u8, const V: bool>(
    bytes: usize,
    rows: [*const u8; 4],
    x: &[ActBlock],
) -> [f32; 4] {
    let n = x.len();
    let mut a0 = [_mm256_setzero_ps(); 4];
    let mut a1 = [_mm256_setzero_ps(); 4];
    let (mut o0, mut o1) = ([0f32; 4], [0f32; 4]);
    let mut i = 0;
    while i + 1 < n {
        for j in 0..4 {
            let (acc, off) = block::<F, V>(rows[j].add(i * bytes), &x[i], a0[j]);
            a0[j] = acc;
            o0[j] += off;
            let (acc, off) = block::<F, V>(rows[j].add((i + 1) * bytes), &x[i + 1], a1[j]);
            a1[j] = acc;
            o1[j] += off;
        }
        i += 2;
    }
    if i < n {
        for j in 0..4 {
            let (acc, off) = block::<F, V>(rows[j].add(i * bytes), &x[i], a0[j]);
            a0[j] = acc;
            o0[j] += off;
        }
    }
    let mut out = [0f32; 4];
    for j in 0..4 {
        out[j] = hsum(_mm256_add_ps(a0[j], a1[j])) + o0[j] + o1[j];
    }
    out
}

/// Consecutive rows of `data` (`row_bytes` each, `out.len()` of them) dotted with `x`
/// into `out` in one call (one dispatch for all of them); Q4_0 and Q4_1 rows four at a
/// time. Measured on SmolLM2 decode at 512 tokens (2-core Xeon, AVX-VNNI): four rows at a
/// time took Q4_1 from 59.5 to 73.4 tok/s and Q4_0 from 62.0 to 73.8, but Q8_0 from 61.0
/// to 56.0 (its 34-byte blocks are a wider stream per row), so the other formats go a row
/// at a time (Q5_0/Q5_1 not measured: no such model here).
#[inline(always)]
unsafe fn rows_fmt<const F: u8, const V: bool>(
    bytes: usize,
    data: &[u8],
    x: &[ActBlock],
    out: &mut [f32],
) {
    let row_bytes = x.len() * bytes;
    let p = data.as_ptr();
    let four = F == Q4_0 || F == Q4_1;
    let mut r = 0;
    let n_rows = out.len();
    let prefetch = |r: usize, n: usize| prefetch_ahead(p, row_bytes, n_rows, r, n);
    while four && r + 4 <= out.len() {
        prefetch(r, 4);
        let rows = [0, 1, 2, 3].map(|j| p.add((r + j) * row_bytes));
        out[r..r + 4].copy_from_slice(&dot4_fmt::<F, V>(bytes, rows, x));
        r += 4;
    }
    while r < out.len() {
        prefetch(r, 1);
        out[r] = dot_fmt::<F, V>(bytes, &data[r * row_bytes..(r + 1) * row_bytes], x);
        r += 1;
    }
}

/// Asks the cache (`prefetcht0`) for rows `r + PREFETCH_ROWS ..` of the `n_rows` rows of
/// `row_bytes` at `p`, `n` of them (as many as a pass over rows `r ..` takes).
#[inline(always)]
pub(super) unsafe fn prefetch_ahead(
    p: *const u8,
    row_bytes: usize,
    n_rows: usize,
    r: usize,
    n: usize,
) {
    let end = (r + PREFETCH_ROWS + n).min(n_rows);
    let from = (r + PREFETCH_ROWS).min(end);
    let mut at = from * row_bytes;
    while at < end * row_bytes {
        _mm_prefetch::<_MM_HINT_T0>(p.add(at) as *const i8);
        at += 64;
    }
}

/// Rows ahead whose bytes a pass asks the cache for (`prefetcht0`): a decode step reads
/// each weight once, so the hardware prefetcher alone left the loads waiting on memory
/// (perf: two thirds of Gemma 3's decode in this loop, most of it on the weight load);
/// with it Gemma 3 270M decodes at 42 tok/s instead of 32 here.
const PREFETCH_ROWS: usize = 8;

/// [`dot`] for `out.len()` consecutive weight rows of `data` (each `x.len()` blocks), into
/// `out`: each result bit for bit [`dot`]'s.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C ([`available`]); `data` holds at least
/// `out.len()` rows.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_rows(fmt: WeightFormat, data: &[u8], x: &[ActBlock], out: &mut [f32]) {
    debug_assert!(data.len() >= out.len() * x.len() * fmt.block_bytes());
    let bytes = fmt.block_bytes();
    match fmt {
        WeightFormat::Q4_0 => rows_fmt::<Q4_0, false>(bytes, data, x, out),
        WeightFormat::Q4_1 => rows_fmt::<Q4_1, false>(bytes, data, x, out),
        WeightFormat::Q5_0 => rows_fmt::<Q5_0, false>(bytes, data, x, out),
        WeightFormat::Q5_1 => rows_fmt::<Q5_1, false>(bytes, data, x, out),
        WeightFormat::Q8_0 => rows_fmt::<Q8_0, false>(bytes, data, x, out),
    }
}

/// [`dot_rows`] with AVX-VNNI: each result bit for bit [`dot_vnni`]'s.
///
/// # Safety
/// The CPU must support AVX2, FMA, F16C and AVX-VNNI ([`vnni`]); `data` holds at least
/// `out.len()` rows.
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
pub unsafe fn dot_rows_vnni(fmt: WeightFormat, data: &[u8], x: &[ActBlock], out: &mut [f32]) {
    debug_assert!(data.len() >= out.len() * x.len() * fmt.block_bytes());
    let bytes = fmt.block_bytes();
    match fmt {
        WeightFormat::Q4_0 => rows_fmt::<Q4_0, true>(bytes, data, x, out),
        WeightFormat::Q4_1 => rows_fmt::<Q4_1, true>(bytes, data, x, out),
        WeightFormat::Q5_0 => rows_fmt::<Q5_0, true>(bytes, data, x, out),
        WeightFormat::Q5_1 => rows_fmt::<Q5_1, true>(bytes, data, x, out),
        WeightFormat::Q8_0 => rows_fmt::<Q8_0, true>(bytes, data, x, out),
    }
}

/// [`super::blocks::dot_scalar`] with AVX2: the same per-block integer sums, blocks taken
/// two at a time.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C ([`available`]).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot(fmt: WeightFormat, row: &[u8], x: &[ActBlock]) -> f32 {
    debug_assert_eq!(x.len() * fmt.block_bytes(), row.len());
    let bytes = fmt.block_bytes();
    match fmt {
        WeightFormat::Q4_0 => dot_fmt::<Q4_0, false>(bytes, row, x),
        WeightFormat::Q4_1 => dot_fmt::<Q4_1, false>(bytes, row, x),
        WeightFormat::Q5_0 => dot_fmt::<Q5_0, false>(bytes, row, x),
        WeightFormat::Q5_1 => dot_fmt::<Q5_1, false>(bytes, row, x),
        WeightFormat::Q8_0 => dot_fmt::<Q8_0, false>(bytes, row, x),
    }
}

/// [`dot`] with AVX-VNNI's `vpdpbusd` for each block's integer sum (the same sums).
///
/// # Safety
/// The CPU must support AVX2, FMA, F16C and AVX-VNNI ([`vnni`]).
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
pub unsafe fn dot_vnni(fmt: WeightFormat, row: &[u8], x: &[ActBlock]) -> f32 {
    debug_assert_eq!(x.len() * fmt.block_bytes(), row.len());
    let bytes = fmt.block_bytes();
    match fmt {
        WeightFormat::Q4_0 => dot_fmt::<Q4_0, true>(bytes, row, x),
        WeightFormat::Q4_1 => dot_fmt::<Q4_1, true>(bytes, row, x),
        WeightFormat::Q5_0 => dot_fmt::<Q5_0, true>(bytes, row, x),
        WeightFormat::Q5_1 => dot_fmt::<Q5_1, true>(bytes, row, x),
        WeightFormat::Q8_0 => dot_fmt::<Q8_0, true>(bytes, row, x),
    }
}

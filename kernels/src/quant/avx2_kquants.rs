//! AVX2 dot products of Q4_K and Q6_K weight rows with Q8_K activations, a decode step's
//! matrix–vector product (llama.cpp's AVX2 `ggml_vec_dot_q4_K_q8_K` /
//! `ggml_vec_dot_q6_K_q8_K` in ggml-cpu/arch/x86/quants.c, rewritten here): per 32 weight
//! values one register of unsigned bytes (Q4_K: a nibble; Q6_K: a nibble and a bit pair, so
//! 0..=63 with the zero 32 taken off afterwards from the activations' 16-element sums),
//! `maddubs` with the activation bytes (u8 × i8 → pairs of i16, at most 2·63·128: no
//! saturation), then the sub-block scales by `madd` (AVX-VNNI: `vpdpwssd`, the same sums)
//! into eight i32 lanes per super-block. The integer sum of each super-block is exact and
//! its f32 part is [`finish`], so every result is bit for bit [`super::kquants::dot_scalar`]'s.
#![allow(unsafe_code)]

use std::arch::x86_64::*;

use super::avx2::{f16_at, prefetch_ahead};
use super::kquants::{finish, q4k_scales_mins, KQuant, Q8KRow, QK_K};

/// The sum of eight i32 lanes.
#[inline(always)]
unsafe fn hsum_i32(v: __m256i) -> i32 {
    hsum_i32x4(_mm_add_epi32(
        _mm256_castsi256_si128(v),
        _mm256_extracti128_si256(v, 1),
    ))
}

/// `acc + Σ pairs·scales` per i32 lane (`pairs`, `scales` sixteen i16 each).
#[inline(always)]
unsafe fn add_scaled<const V: bool>(acc: __m256i, pairs: __m256i, scales: __m256i) -> __m256i {
    if V {
        return _mm256_dpwssd_avx_epi32(acc, pairs, scales);
    }
    _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, scales))
}

/// The activation bytes of 32-element block `j` of `x`.
#[inline(always)]
unsafe fn act(x: &Q8KRow, j: usize) -> __m256i {
    _mm256_load_si256(x.blocks[j].qs.as_ptr() as *const __m256i)
}

/// The sum of four i32 lanes.
#[inline(always)]
unsafe fn hsum_i32x4(s: __m128i) -> i32 {
    let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
    _mm_cvtsi128_si32(s)
}

/// Sixteen i16 lanes each holding i16 lane `j` of `v` (both 128-bit halves alike).
#[inline(always)]
unsafe fn broadcast_lane(v: __m256i, j: usize) -> __m256i {
    let j = 2 * j as i16;
    _mm256_shuffle_epi8(v, _mm256_set1_epi16(((j + 1) << 8) | j))
}

/// The activations' sixteen 16-element sums of super-block `sb`, as two halves of eight i16.
#[inline(always)]
unsafe fn sums16(x: &Q8KRow, sb: usize) -> (__m128i, __m128i) {
    let s = &x.sums[16 * sb..16 * sb + 16];
    (
        _mm_loadu_si128(s.as_ptr() as *const __m128i),
        _mm_loadu_si128(s.as_ptr().add(8) as *const __m128i),
    )
}

/// Q4_K super-block `sb` of the row at `p`: its exact `Σ sc·Σ q·x` and `Σ m·Σ x`.
#[inline(always)]
unsafe fn q4k_sums<const V: bool>(p: *const u8, x: &Q8KRow, sb: usize) -> (i32, i32) {
    let unpacked = q4k_scales_mins(std::slice::from_raw_parts(p.add(4), 12));
    let scales = _mm_cvtepu8_epi16(_mm_loadl_epi64(unpacked.scales.as_ptr() as *const __m128i));
    let scales = _mm256_broadcastsi128_si256(scales);
    // Mins: Σ_j m_j·(sum of the two 16-element sums of sub-block j), as i32.
    let mins = _mm_cvtepu8_epi16(_mm_loadl_epi64(unpacked.mins.as_ptr() as *const __m128i));
    let (s0, s1) = sums16(x, sb);
    let mins = hsum_i32x4(_mm_madd_epi16(mins, _mm_hadd_epi16(s0, s1)));
    let low = _mm256_set1_epi8(0x0F);
    let mut acc = _mm256_setzero_si256();
    for c in 0..4 {
        let raw = _mm256_loadu_si256(p.add(16 + 32 * c) as *const __m256i);
        let lo = _mm256_and_si256(raw, low);
        let hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
        let p0 = _mm256_maddubs_epi16(lo, act(x, 8 * sb + 2 * c));
        let p1 = _mm256_maddubs_epi16(hi, act(x, 8 * sb + 2 * c + 1));
        acc = add_scaled::<V>(acc, p0, broadcast_lane(scales, 2 * c));
        acc = add_scaled::<V>(acc, p1, broadcast_lane(scales, 2 * c + 1));
    }
    (hsum_i32(acc), mins)
}

/// Q6_K super-block `sb` of the row at `p`: its exact `Σ sc·Σ (q − 32)·x`.
#[inline(always)]
unsafe fn q6k_sum<const V: bool>(p: *const u8, x: &Q8KRow, sb: usize) -> i32 {
    // The sixteen signed scales as i16: lanes 0..8 and 8..16.
    let raw = _mm_loadu_si128(p.add(192) as *const __m128i);
    let (sc_lo, sc_hi) = (
        _mm_cvtepi8_epi16(raw),
        _mm_cvtepi8_epi16(_mm_srli_si128(raw, 8)),
    );
    // The zero: 32·Σ_s sc_s·(16-element sum s).
    let (s0, s1) = sums16(x, sb);
    let offset = hsum_i32x4(_mm_add_epi32(
        _mm_madd_epi16(sc_lo, s0),
        _mm_madd_epi16(sc_hi, s1),
    ));
    let (low, pair) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(3));
    let mut acc = _mm256_setzero_si256();
    for h in 0..2 {
        // Scales 8h .. 8h + 8 of this half, in both 128-bit halves of a register.
        let scales = _mm256_broadcastsi128_si256(if h == 0 { sc_lo } else { sc_hi });
        let ql0 = _mm256_loadu_si256(p.add(64 * h) as *const __m256i);
        let ql1 = _mm256_loadu_si256(p.add(64 * h + 32) as *const __m256i);
        let qh = _mm256_loadu_si256(p.add(128 + 32 * h) as *const __m256i);
        // Blocks t = 0..4 of this half: low nibbles of ql0, ql1, then their high nibbles;
        // bit pair t of qh as bits 4 and 5.
        let nibbles = [
            _mm256_and_si256(ql0, low),
            _mm256_and_si256(ql1, low),
            _mm256_and_si256(_mm256_srli_epi16(ql0, 4), low),
            _mm256_and_si256(_mm256_srli_epi16(ql1, 4), low),
        ];
        let pairs = [
            _mm256_and_si256(qh, pair),
            _mm256_and_si256(_mm256_srli_epi16(qh, 2), pair),
            _mm256_and_si256(_mm256_srli_epi16(qh, 4), pair),
            _mm256_and_si256(_mm256_srli_epi16(qh, 6), pair),
        ];
        for t in 0..4 {
            let q = _mm256_or_si256(nibbles[t], _mm256_slli_epi16(pairs[t], 4));
            let prod = _mm256_maddubs_epi16(q, act(x, 8 * sb + 4 * h + t));
            // Lanes 0..8 are elements 0..16 (scale 2t of the half), lanes 8..16 the next 16.
            let sc = _mm256_permute2x128_si256(
                broadcast_lane(scales, 2 * t),
                broadcast_lane(scales, 2 * t + 1),
                0x20,
            );
            acc = add_scaled::<V>(acc, prod, sc);
        }
    }
    hsum_i32(acc) - 32 * offset
}

/// One row's dot product for format `F` (0: Q4_K, 1: Q6_K).
#[inline(always)]
unsafe fn dot_fmt<const F: u8, const V: bool>(row: *const u8, x: &Q8KRow, blocks: usize) -> f32 {
    let mut acc = 0f32;
    for sb in 0..blocks {
        let xd = x.scale(sb);
        if F == 0 {
            let b = row.add(sb * 144);
            let (sum, mins) = q4k_sums::<V>(b, x, sb);
            acc = finish(acc, f16_at(b), f16_at(b.add(2)), xd, sum, mins);
        } else {
            let b = row.add(sb * 210);
            let sum = q6k_sum::<V>(b, x, sb);
            acc = finish(acc, f16_at(b.add(208)), 0.0, xd, sum, 0);
        }
    }
    acc
}

/// Consecutive rows of `data` dotted with `x` into `out`, prefetching rows ahead as
/// [`super::avx2`]'s rows do (a decode step reads each weight once).
#[inline(always)]
unsafe fn rows_fmt<const F: u8, const V: bool>(
    fmt: KQuant,
    data: &[u8],
    x: &Q8KRow,
    out: &mut [f32],
) {
    let blocks = x.blocks.len() * super::blocks::QK / QK_K;
    let row_bytes = blocks * fmt.block_bytes();
    assert!(
        data.len() >= out.len() * row_bytes,
        "K-quant rows: {} bytes hold fewer than {} rows of {row_bytes}",
        data.len(),
        out.len()
    );
    let p = data.as_ptr();
    let n_rows = out.len();
    for (r, o) in out.iter_mut().enumerate() {
        prefetch_ahead(p, row_bytes, n_rows, r, 1);
        *o = dot_fmt::<F, V>(p.add(r * row_bytes), x, blocks);
    }
}

/// `out.len()` consecutive weight rows of `data` (each `x`'s length in `fmt`) dotted with
/// `x` into `out`, each bit for bit [`super::kquants::dot_scalar`]'s.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C ([`super::avx2::available`]); `data` holds at
/// least `out.len()` rows (checked).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_rows(fmt: KQuant, data: &[u8], x: &Q8KRow, out: &mut [f32]) {
    match fmt {
        KQuant::Q4K => rows_fmt::<0, false>(fmt, data, x, out),
        KQuant::Q6K => rows_fmt::<1, false>(fmt, data, x, out),
    }
}

/// [`dot_rows`] with AVX-VNNI's `vpdpwssd` for the scales (the same sums).
///
/// # Safety
/// The CPU must support AVX2, FMA, F16C and AVX-VNNI ([`super::avx2::vnni`]); `data` holds
/// at least `out.len()` rows (checked).
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
pub unsafe fn dot_rows_vnni(fmt: KQuant, data: &[u8], x: &Q8KRow, out: &mut [f32]) {
    match fmt {
        KQuant::Q4K => rows_fmt::<0, true>(fmt, data, x, out),
        KQuant::Q6K => rows_fmt::<1, true>(fmt, data, x, out),
    }
}

//! The decode step's kernel for Q4_0 weights interleaved eight rows at a time
//! ([`super::rows8`]): per block of a group, the eight rows' scales converted by one
//! `vcvtph2ps`, their 128 nibble bytes read as four 32-byte runs and split into eight
//! registers (low and high nibbles), each multiplied with four broadcast activation bytes —
//! `maddubs` with the products summed in i16 (at most 16 products of 15·128 each: no
//! overflow) and one `madd` to i32 lanes on AVX2, or eight `vpdpbusd` straight into i32
//! lanes with AVX-VNNI or AVX-512 VNNI (256-bit) — then `− 8·Σx`, and one multiply–add
//! per block for all eight rows. About six instructions per row and block where the
//! row-at-a-time kernel ([`super::avx2`]) spends seventeen.
#![allow(unsafe_code)]

use std::arch::x86_64::*;

use super::blocks::ActBlock;
use super::rows8::{GROUP_BLOCK_BYTES, ROWS};

/// The integer paths of the eight-row kernels (this one and [`super::avx2_rows8_k`]):
/// which instruction sums a block's products — `maddubs` (AVX2) …
pub const MADDUBS: u8 = 0;
/// … AVX-VNNI's `vpdpbusd` …
pub const AVX_VNNI: u8 = 1;
/// … or AVX-512 VNNI's on 256-bit registers. The same exact sums on each.
pub const AVX512_VNNI: u8 = 2;

/// Whether this CPU runs integer path `path`.
pub fn runs(path: u8) -> bool {
    match path {
        MADDUBS => super::features::avx2(),
        AVX_VNNI => super::avx2::vnni(),
        AVX512_VNNI => super::features::avx2() && avx512_vnni(),
        _ => false,
    }
}

/// The widest integer path this CPU runs (given AVX2).
pub fn best_path() -> u8 {
    [AVX512_VNNI, AVX_VNNI]
        .into_iter()
        .find(|p| runs(*p))
        .unwrap_or(MADDUBS)
}

/// Whether this CPU has AVX-512 VNNI on 256-bit registers (AVX512VL), checked once.
pub fn avx512_vnni() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512vnni")
            && is_x86_feature_detected!("avx512vl")
    })
}

/// Four activation bytes `4i … 4i+3` of `x`, broadcast to every 32-bit lane.
#[inline(always)]
unsafe fn four(x: &ActBlock, i: usize) -> __m256i {
    _mm256_set1_epi32((x.qs.as_ptr().add(4 * i) as *const i32).read_unaligned())
}

/// One group's eight rows dotted with `x`: `p` is the group's first block.
#[inline(always)]
unsafe fn group<const S: u8>(p: *const u8, x: &[ActBlock], xsum: &[i32]) -> __m256 {
    let low = _mm256_set1_epi8(0x0F);
    let mut acc = _mm256_setzero_ps();
    for (b, (xb, &sum)) in x.iter().zip(xsum).enumerate() {
        let blk = p.add(b * GROUP_BLOCK_BYTES);
        let scales = _mm256_cvtph_ps(_mm_loadu_si128(blk as *const __m128i));
        let zero = _mm256_set1_epi32(-8 * sum);
        let mut lanes = zero;
        let mut pairs = _mm256_setzero_si256();
        for h in 0..4 {
            let run = _mm256_loadu_si256(blk.add(16 + 32 * h) as *const __m256i);
            let lo = _mm256_and_si256(run, low);
            let hi = _mm256_and_si256(_mm256_srli_epi16(run, 4), low);
            let (xl, xh) = (four(xb, h), four(xb, 4 + h));
            match S {
                MADDUBS => {
                    pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(lo, xl));
                    pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(hi, xh));
                }
                AVX_VNNI => {
                    lanes = _mm256_dpbusd_avx_epi32(lanes, lo, xl);
                    lanes = _mm256_dpbusd_avx_epi32(lanes, hi, xh);
                }
                _ => {
                    lanes = _mm256_dpbusd_epi32(lanes, lo, xl);
                    lanes = _mm256_dpbusd_epi32(lanes, hi, xh);
                }
            }
        }
        if S == MADDUBS {
            lanes = _mm256_add_epi32(zero, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
        }
        // acc += (d_w·d_x)·Σ, as the portable loop rounds it (no fused multiply–add).
        let dd = _mm256_mul_ps(scales, _mm256_set1_ps(xb.d));
        acc = _mm256_add_ps(acc, _mm256_mul_ps(dd, _mm256_cvtepi32_ps(lanes)));
    }
    acc
}

/// Every group of `groups` into `out`, eight results per group.
#[inline(always)]
unsafe fn groups_with<const S: u8>(groups: &[u8], x: &[ActBlock], xsum: &[i32], out: &mut [f32]) {
    let group_bytes = x.len() * GROUP_BLOCK_BYTES;
    for (g, o) in out.chunks_exact_mut(ROWS).enumerate() {
        let acc = group::<S>(groups.as_ptr().add(g * group_bytes), x, xsum);
        _mm256_storeu_ps(o.as_mut_ptr(), acc);
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn groups_maddubs(groups: &[u8], x: &[ActBlock], xsum: &[i32], out: &mut [f32]) {
    groups_with::<MADDUBS>(groups, x, xsum, out)
}

#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
unsafe fn groups_avx_vnni(groups: &[u8], x: &[ActBlock], xsum: &[i32], out: &mut [f32]) {
    groups_with::<AVX_VNNI>(groups, x, xsum, out)
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
unsafe fn groups_avx512_vnni(groups: &[u8], x: &[ActBlock], xsum: &[i32], out: &mut [f32]) {
    groups_with::<AVX512_VNNI>(groups, x, xsum, out)
}

/// `out.len() / 8` whole interleaved groups `groups` dotted with `x` (`xsum` its blocks'
/// integer sums) into `out`, on the widest integer dot product this CPU has; the same
/// exact sums and f32 steps on each.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `groups` holds `out.len() / 8` groups of `x.len()`
/// blocks; `xsum.len() == x.len()`.
pub unsafe fn dot_groups(groups: &[u8], x: &[ActBlock], xsum: &[i32], out: &mut [f32]) {
    debug_assert!(groups.len() >= out.len() / ROWS * x.len() * GROUP_BLOCK_BYTES);
    // `best_path` runs here (AVX2 at least, by the caller's contract).
    let _ = dot_groups_on(best_path(), groups, x, xsum, out);
}

/// [`dot_groups`] on a chosen path ([`MADDUBS`], [`AVX_VNNI`], [`AVX512_VNNI`]); `None`
/// when this CPU lacks it ([`runs`]).
///
/// # Safety
/// As [`dot_groups`].
pub unsafe fn dot_groups_on(
    path: u8,
    groups: &[u8],
    x: &[ActBlock],
    xsum: &[i32],
    out: &mut [f32],
) -> Option<()> {
    if !runs(path) {
        return None;
    }
    match path {
        MADDUBS => groups_maddubs(groups, x, xsum, out),
        AVX_VNNI => groups_avx_vnni(groups, x, xsum, out),
        _ => groups_avx512_vnni(groups, x, xsum, out),
    }
    Some(())
}

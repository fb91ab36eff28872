//! The decode step's kernel for Q4_K weights interleaved eight rows at a time
//! ([`super::rows8_k`]): per super-block of a group, the eight rows' `d` and `dmin` convert
//! in one instruction each, their 6-bit scales and mins are unpacked row by row
//! ([`q4k_scales_mins`]) and turned into one vector per sub-block; each of the 32 runs is
//! split into low and high nibbles (two sub-blocks) and multiplied with four broadcast
//! activation bytes — `maddubs` summed in i16 over a sub-block's eight runs (at most 16
//! products of 15·128: no overflow) then one `madd`, or `vpdpbusd` (AVX-VNNI, or AVX-512
//! VNNI on 256 bits) — then scaled by the sub-block's scales in i32, exactly, and finished
//! in f32 for eight rows at once as [`super::kquants::finish`] does for one.
#![allow(unsafe_code)]

use std::arch::x86_64::*;

use super::kquants::{q4k_scales_mins, Q8KRow};
use super::rows8_k::{GROUP_SUPER_BYTES, ROWS, RUNS_AT, SCALES_AT};

use super::avx2_rows8::{runs, AVX512_VNNI, AVX_VNNI, MADDUBS};

/// Four activation bytes `4i … 4i+3` of 32-element block `j` of `x`, broadcast.
#[inline(always)]
unsafe fn four(x: &Q8KRow, j: usize, i: usize) -> __m256i {
    _mm256_set1_epi32(
        (x.blocks.get_unchecked(j).qs.as_ptr().add(4 * i) as *const i32).read_unaligned(),
    )
}

/// Eight unsigned bytes as eight i32 lanes.
#[inline(always)]
unsafe fn lanes_of(b: &[u8; 8]) -> __m256i {
    _mm256_cvtepu8_epi32(_mm_loadl_epi64(b.as_ptr() as *const __m128i))
}

/// One group's eight rows dotted with `x`: `p` is the group's first super-block.
#[inline(always)]
unsafe fn group<const S: u8>(p: *const u8, x: &Q8KRow, supers: usize) -> __m256 {
    let low = _mm256_set1_epi8(0x0F);
    let mut acc = _mm256_setzero_ps();
    for sb in 0..supers {
        let blk = p.add(sb * GROUP_SUPER_BYTES);
        // Scales and mins per sub-block j, one lane per row.
        let (mut sc, mut mn) = ([[0u8; 8]; 8], [[0u8; 8]; 8]);
        for r in 0..ROWS {
            let u = q4k_scales_mins(std::slice::from_raw_parts(blk.add(SCALES_AT + 12 * r), 12));
            for j in 0..8 {
                sc[j][r] = u.scales[j];
                mn[j][r] = u.mins[j];
            }
        }
        let sums = &x.sums[16 * sb..16 * sb + 16];
        let mut mins = _mm256_setzero_si256();
        for (j, m) in mn.iter().enumerate() {
            let xs = sums[2 * j] as i32 + sums[2 * j + 1] as i32;
            mins = _mm256_add_epi32(mins, _mm256_mullo_epi32(lanes_of(m), _mm256_set1_epi32(xs)));
        }
        let mut sum = _mm256_setzero_si256();
        for pair in 0..4 {
            let (jl, jh) = (8 * sb + 2 * pair, 8 * sb + 2 * pair + 1);
            let (mut lo32, mut hi32) = (_mm256_setzero_si256(), _mm256_setzero_si256());
            let (mut lo16, mut hi16) = (_mm256_setzero_si256(), _mm256_setzero_si256());
            for c in 0..8 {
                let run =
                    _mm256_loadu_si256(blk.add(RUNS_AT + 32 * (8 * pair + c)) as *const __m256i);
                let lo = _mm256_and_si256(run, low);
                let hi = _mm256_and_si256(_mm256_srli_epi16(run, 4), low);
                let (xl, xh) = (four(x, jl, c), four(x, jh, c));
                match S {
                    MADDUBS => {
                        lo16 = _mm256_add_epi16(lo16, _mm256_maddubs_epi16(lo, xl));
                        hi16 = _mm256_add_epi16(hi16, _mm256_maddubs_epi16(hi, xh));
                    }
                    AVX_VNNI => {
                        lo32 = _mm256_dpbusd_avx_epi32(lo32, lo, xl);
                        hi32 = _mm256_dpbusd_avx_epi32(hi32, hi, xh);
                    }
                    _ => {
                        lo32 = _mm256_dpbusd_epi32(lo32, lo, xl);
                        hi32 = _mm256_dpbusd_epi32(hi32, hi, xh);
                    }
                }
            }
            if S == MADDUBS {
                let ones = _mm256_set1_epi16(1);
                lo32 = _mm256_madd_epi16(lo16, ones);
                hi32 = _mm256_madd_epi16(hi16, ones);
            }
            sum = _mm256_add_epi32(sum, _mm256_mullo_epi32(lo32, lanes_of(&sc[2 * pair])));
            sum = _mm256_add_epi32(sum, _mm256_mullo_epi32(hi32, lanes_of(&sc[2 * pair + 1])));
        }
        // `finish`: acc + (d·d_x)·sum − (dmin·d_x)·mins, rounded step by step as it is.
        let xd = _mm256_set1_ps(x.scale(sb));
        let d = _mm256_cvtph_ps(_mm_loadu_si128(blk as *const __m128i));
        let dmin = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(16) as *const __m128i));
        let plus = _mm256_mul_ps(_mm256_mul_ps(d, xd), _mm256_cvtepi32_ps(sum));
        let minus = _mm256_mul_ps(_mm256_mul_ps(dmin, xd), _mm256_cvtepi32_ps(mins));
        acc = _mm256_sub_ps(_mm256_add_ps(acc, plus), minus);
    }
    acc
}

/// Every group of `groups` into `out`, eight results per group.
#[inline(always)]
unsafe fn groups_with<const S: u8>(groups: &[u8], x: &Q8KRow, out: &mut [f32]) {
    let supers = x.blocks.len() / 8;
    let group_bytes = supers * GROUP_SUPER_BYTES;
    for (g, o) in out.chunks_exact_mut(ROWS).enumerate() {
        let acc = group::<S>(groups.as_ptr().add(g * group_bytes), x, supers);
        _mm256_storeu_ps(o.as_mut_ptr(), acc);
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn groups_maddubs(groups: &[u8], x: &Q8KRow, out: &mut [f32]) {
    groups_with::<MADDUBS>(groups, x, out)
}

#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
unsafe fn groups_avx_vnni(groups: &[u8], x: &Q8KRow, out: &mut [f32]) {
    groups_with::<AVX_VNNI>(groups, x, out)
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
unsafe fn groups_avx512_vnni(groups: &[u8], x: &Q8KRow, out: &mut [f32]) {
    groups_with::<AVX512_VNNI>(groups, x, out)
}

/// `out.len() / 8` whole interleaved Q4_K groups `groups` dotted with `x` into `out` on
/// integer path `path` ([`super::avx2_rows8::best_path`] for the widest); `None` when this
/// CPU lacks it ([`runs`]).
///
/// # Safety
/// `groups` holds `out.len() / 8` groups of `x`'s super-blocks.
pub unsafe fn dot_groups_on(path: u8, groups: &[u8], x: &Q8KRow, out: &mut [f32]) -> Option<()> {
    if !runs(path) {
        return None;
    }
    match path {
        MADDUBS => groups_maddubs(groups, x, out),
        AVX_VNNI => groups_avx_vnni(groups, x, out),
        _ => groups_avx512_vnni(groups, x, out),
    }
    Some(())
}

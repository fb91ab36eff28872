//! The integer GEMM's micro-kernel at 256 bits, for CPUs without AVX-512 VNNI: the same
//! [`Panel`] as [`super::avx512`] (a group's 64 bytes are two registers, columns 0–7 and
//! 8–15), `MR` rows at a time. With AVX-VNNI (`V`) each group is one `vpdpbusd` per half;
//! with plain AVX2 it is `maddubs` (u8 × i8 → pairs of i16) and `madd` (pairs → i32), which
//! saturates a pair beyond 32767 — so plain AVX2 takes only formats whose unsigned values
//! stay below 64 (2·63·128 < 32767): every one here but Q8_0 ([`exact_without_vnni`]).
#![allow(unsafe_code)]

use std::arch::x86_64::*;

use super::avx512::TileRows;
use super::blocks::WeightFormat;
use super::panel::{Panel, PanelFormat, BLOCK_QS, NR};

/// Whether `maddubs` sums `fmt`'s values exactly (no pair of products past i16).
pub fn exact_without_vnni(fmt: PanelFormat) -> bool {
    fmt != PanelFormat::Block(WeightFormat::Q8_0)
}

/// One group's contribution to one row's two halves.
#[inline(always)]
unsafe fn group<const V: bool>(sum: __m256i, w: __m256i, x: __m256i) -> __m256i {
    if V {
        _mm256_dpbusd_avx_epi32(sum, w, x)
    } else {
        let pairs = _mm256_maddubs_epi16(w, x);
        _mm256_add_epi32(sum, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
    }
}

#[inline(always)]
unsafe fn tile_impl<const MR: usize, const SUBS: usize, const OFF: bool, const V: bool>(
    panel: &Panel,
    rows: &TileRows<'_>,
    out: *mut f32,
    ldo: usize,
    cols: usize,
) {
    let blocks = rows.blocks;
    let groups = 8 / SUBS;
    let mut acc = [[_mm256_setzero_ps(); 2]; MR];
    for b in 0..blocks {
        let qs = panel.qs.as_ptr().add(b * BLOCK_QS);
        for s in 0..SUBS {
            let mut sums = [[_mm256_setzero_si256(); 2]; MR];
            for (r, sum) in sums.iter_mut().enumerate() {
                let z = _mm256_set1_epi32(*rows.zsum.get_unchecked((r * blocks + b) * SUBS + s));
                *sum = [z, z];
            }
            for g in s * groups..(s + 1) * groups {
                let w0 = _mm256_loadu_si256(qs.add(g * 4 * NR) as *const __m256i);
                let w1 = _mm256_loadu_si256(qs.add(g * 4 * NR + 32) as *const __m256i);
                for (r, sum) in sums.iter_mut().enumerate() {
                    let xb = rows.x.get_unchecked(r * blocks + b);
                    let four = (xb.qs.as_ptr().add(4 * g) as *const i32).read_unaligned();
                    let x = _mm256_set1_epi32(four);
                    sum[0] = group::<V>(sum[0], w0, x);
                    sum[1] = group::<V>(sum[1], w1, x);
                }
            }
            let at = panel.scales.as_ptr().add((b * SUBS + s) * NR);
            let dw = [_mm256_loadu_ps(at), _mm256_loadu_ps(at.add(8))];
            for (r, (a, sum)) in acc.iter_mut().zip(sums).enumerate() {
                let dx = _mm256_set1_ps(rows.x.get_unchecked(r * blocks + b).d);
                for h in 0..2 {
                    let scale = _mm256_mul_ps(dw[h], dx);
                    a[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[h]), scale, a[h]);
                }
            }
        }
        if OFF {
            let at = panel.offsets.as_ptr().add(b * NR);
            let m = [_mm256_loadu_ps(at), _mm256_loadu_ps(at.add(8))];
            for (r, a) in acc.iter_mut().enumerate() {
                let sx = _mm256_set1_ps(*rows.sx.get_unchecked(r * blocks + b));
                for h in 0..2 {
                    a[h] = _mm256_fmadd_ps(m[h], sx, a[h]);
                }
            }
        }
    }
    for (r, a) in acc.iter().enumerate() {
        let mut row = [0f32; NR];
        _mm256_storeu_ps(row.as_mut_ptr(), a[0]);
        _mm256_storeu_ps(row.as_mut_ptr().add(8), a[1]);
        std::ptr::copy_nonoverlapping(row.as_ptr(), out.add(r * ldo), cols.min(NR));
    }
}

/// `MR` rows × the panel's 16 columns with AVX-VNNI, as [`super::avx512::tile`].
///
/// # Safety
/// The CPU has AVX2, FMA and AVX-VNNI; otherwise as [`super::avx512::tile`].
#[target_feature(enable = "avx2,fma,avxvnni")]
pub unsafe fn tile_vnni<const MR: usize, const SUBS: usize, const OFF: bool>(
    panel: &Panel,
    rows: &TileRows<'_>,
    out: *mut f32,
    ldo: usize,
    cols: usize,
) {
    tile_impl::<MR, SUBS, OFF, true>(panel, rows, out, ldo, cols)
}

/// `MR` rows × the panel's 16 columns with AVX2 (`maddubs` + `madd`).
///
/// # Safety
/// The CPU has AVX2 and FMA; the panel's format is [`exact_without_vnni`]; otherwise as
/// [`super::avx512::tile`].
#[target_feature(enable = "avx2,fma")]
pub unsafe fn tile_avx2<const MR: usize, const SUBS: usize, const OFF: bool>(
    panel: &Panel,
    rows: &TileRows<'_>,
    out: *mut f32,
    ldo: usize,
    cols: usize,
) {
    tile_impl::<MR, SUBS, OFF, false>(panel, rows, out, ldo, cols)
}

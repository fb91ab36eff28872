//! The integer GEMM's AVX-512 VNNI micro-kernel: `MR` activation rows × one 16-column
//! [`Panel`], every 32-element block as eight `vpdpbusd` per row (the panel's unsigned
//! weight bytes × four broadcast activation bytes → 16 columns' i32 sums), the integer zero
//! folded in exactly (the accumulator starts at `−z·Σx`), then scaled by `d_w·d_x` into
//! f32 with one FMA per row (plus one for the formats with an offset, `m_w·d_x·Σx`). Sums of
//! `u8 × i8` products never overflow i32 here (|Σ| ≤ 32·255·128).
//! llama.cpp's `ggml_gemm_q4_0_8x8_q8_0` (repack.cpp) is the same idea at 256 bits.
#![allow(unsafe_code)]

use std::arch::x86_64::*;

use super::blocks::ActBlock;
use super::panel::{Panel, BLOCK_QS, NR};

/// Whether this CPU runs the AVX-512 VNNI GEMM (checked once).
pub fn available() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vnni")
    })
}

/// The rows a tile reads: quantized activations and their integer zero terms.
pub struct TileRows<'a> {
    /// `MR` rows of `blocks` activation blocks each.
    pub x: &'a [ActBlock],
    /// `MR` rows of `blocks · SUBS` values `−z·Σq` (per sub-block).
    pub zsum: &'a [i32],
    /// `MR` rows of `blocks` values `d·Σq` (formats with an offset; else empty).
    pub sx: &'a [f32],
    /// 32-element blocks per row.
    pub blocks: usize,
}

/// `MR` rows × the panel's 16 columns into `out` (row stride `ldo`), the first `cols`
/// columns stored.
///
/// # Safety
/// The CPU has AVX-512 F/BW/VNNI ([`available`]); `rows` holds `MR` rows; the panel holds
/// `rows.blocks` blocks with `SUBS` scales each (and offsets when `OFF`); `out` is valid
/// for writes of `cols ≤ 16` floats at each of `MR` rows, and nothing else writes them.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub unsafe fn tile<const MR: usize, const SUBS: usize, const OFF: bool>(
    panel: &Panel,
    rows: &TileRows<'_>,
    out: *mut f32,
    ldo: usize,
    cols: usize,
) {
    let blocks = rows.blocks;
    let groups = 8 / SUBS;
    let mut acc = [_mm512_setzero_ps(); MR];
    for b in 0..blocks {
        let qs = panel.qs.as_ptr().add(b * BLOCK_QS);
        for s in 0..SUBS {
            let mut sums = [_mm512_setzero_si512(); MR];
            for (r, sum) in sums.iter_mut().enumerate() {
                *sum = _mm512_set1_epi32(*rows.zsum.get_unchecked((r * blocks + b) * SUBS + s));
            }
            for g in s * groups..(s + 1) * groups {
                let w = _mm512_loadu_si512(qs.add(g * 4 * NR) as *const _);
                for (r, sum) in sums.iter_mut().enumerate() {
                    let xb = rows.x.get_unchecked(r * blocks + b);
                    let four = (xb.qs.as_ptr().add(4 * g) as *const i32).read_unaligned();
                    *sum = _mm512_dpbusd_epi32(*sum, w, _mm512_set1_epi32(four));
                }
            }
            let dw = _mm512_loadu_ps(panel.scales.as_ptr().add((b * SUBS + s) * NR));
            for (r, (a, sum)) in acc.iter_mut().zip(sums).enumerate() {
                let dx = _mm512_set1_ps(rows.x.get_unchecked(r * blocks + b).d);
                *a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(dw, dx), *a);
            }
        }
        if OFF {
            let m = _mm512_loadu_ps(panel.offsets.as_ptr().add(b * NR));
            for (r, a) in acc.iter_mut().enumerate() {
                let sx = _mm512_set1_ps(*rows.sx.get_unchecked(r * blocks + b));
                *a = _mm512_fmadd_ps(m, sx, *a);
            }
        }
    }
    let mask: __mmask16 = if cols >= NR { !0 } else { (1u16 << cols) - 1 };
    for (r, a) in acc.iter().enumerate() {
        _mm512_mask_storeu_ps(out.add(r * ldo), mask, *a);
    }
}

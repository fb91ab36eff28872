//! The two tile products of [`super::cpu`] for the few query rows of a decode step (one
//! row per query head of a KV head's group): `S = Q·Kᵀ` and `O += P·V` with AVX2 + FMA,
//! each key row loaded once for all query rows. The `gemm` crate packs its operands for
//! large products; at 1–8 rows that packing and dispatch cost as much as the arithmetic
//! (half of the attention time of a SmolLM2 decode step, measured with perf). Larger row
//! counts, other strides or CPUs without AVX2 keep the `gemm` path. Keys and values are
//! read as f32, or as f16/bf16 widened in registers (a cache stored smaller, `kv_dtype`):
//! no widened copy of the tile is written.
#![allow(unsafe_code)]

/// Key/value lanes: f32.
pub const F32: u8 = 0;
/// Key/value lanes: f16 (F16C conversion).
pub const F16: u8 = 1;
/// Key/value lanes: bf16 (the upper half of an f32).
pub const BF16: u8 = 2;

/// Bytes of one element of lane kind `L`.
pub const fn elem_bytes(l: u8) -> usize {
    if l == F32 {
        4
    } else {
        2
    }
}

/// Eight values of kind `L` at `p` (elements), widened to f32.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn load8<const L: u8>(p: *const u8) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    match L {
        F32 => _mm256_loadu_ps(p as *const f32),
        F16 => _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)),
        _ => _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i)),
            16,
        )),
    }
}

/// Most query rows this path takes.
pub const MAX_ROWS: usize = 16;

/// Whether the small path applies: few rows, width a multiple of 8, AVX2 + FMA present.
pub fn applies(rows: usize, d: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        rows <= MAX_ROWS && d.is_multiple_of(8) && crate::quant::avx2::available()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (rows, d);
        false
    }
}

/// `s[r·nk + j] = Σ_c q[r·d + c] · k(j)[c]` for `rows` query rows and `nk` keys, key `j`'s
/// `d` values (of kind `L`) contiguous at element `k + j·rs`.
///
/// # Safety
/// [`applies`] holds (with F16C for f16); `q` holds `rows·d`, `s` `rows·nk`; elements
/// `k + j·rs + c` are readable for `j < nk`, `c < d`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn scores<const L: u8>(
    q: &[f32],
    rows: usize,
    d: usize,
    k: *const u8,
    rs: isize,
    nk: usize,
    s: &mut [f32],
) {
    use std::arch::x86_64::*;
    debug_assert!(q.len() >= rows * d && s.len() >= rows * nk);
    let size = elem_bytes(L);
    let mut acc = [_mm256_setzero_ps(); MAX_ROWS];
    for j in 0..nk {
        let kj = k.offset(j as isize * rs * size as isize);
        for a in acc.iter_mut().take(rows) {
            *a = _mm256_setzero_ps();
        }
        for c in (0..d).step_by(8) {
            let kv = load8::<L>(kj.add(c * size));
            for (r, a) in acc.iter_mut().enumerate().take(rows) {
                *a = _mm256_fmadd_ps(_mm256_loadu_ps(q.as_ptr().add(r * d + c)), kv, *a);
            }
        }
        for (r, a) in acc.iter().enumerate().take(rows) {
            let h = _mm_add_ps(_mm256_castps256_ps128(*a), _mm256_extractf128_ps(*a, 1));
            let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
            let h = _mm_add_ss(h, _mm_movehdup_ps(h));
            s[r * nk + j] = _mm_cvtss_f32(h);
        }
    }
}

/// `o[r·d + c] += Σ_j p[r·nk + j] · v(j)[c]`, value `j`'s `d` values (of kind `L`)
/// contiguous at element `v + j·rs`.
///
/// # Safety
/// As [`scores`], with `o` holding `rows·d` and `p` `rows·nk`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn accumulate<const L: u8>(
    p: &[f32],
    rows: usize,
    nk: usize,
    v: *const u8,
    rs: isize,
    d: usize,
    o: &mut [f32],
) {
    use std::arch::x86_64::*;
    debug_assert!(p.len() >= rows * nk && o.len() >= rows * d);
    let size = elem_bytes(L);
    let op = o.as_mut_ptr();
    for j in 0..nk {
        let vj = v.offset(j as isize * rs * size as isize);
        for c in (0..d).step_by(8) {
            let vv = load8::<L>(vj.add(c * size));
            for r in 0..rows {
                let w = *p.get_unchecked(r * nk + j);
                let at = op.add(r * d + c);
                _mm256_storeu_ps(
                    at,
                    _mm256_fmadd_ps(_mm256_set1_ps(w), vv, _mm256_loadu_ps(at)),
                );
            }
        }
    }
}

//! The online softmax's exponentials (FlashAttention-2 §3.1: each tile's scores become
//! `exp(s − m)` against the running max `m`, and their sum) sixteen or eight lanes at a
//! time. A prefill tile of a long context is mostly this loop: with libm's scalar `expf`
//! it was 11% of a SmolLM2 4K prefill (perf). The vector `exp` is Cephes' `expf`
//! (`2ⁿ·p(r)`, `n = round(x·log₂e)`, `r = x − n·ln 2` in two steps, a degree-6 polynomial),
//! within 2 ulp of the correctly rounded value; `exp(−∞) = 0` and tiny arguments underflow
//! to 0 as libm's do.
#![allow(unsafe_code)]

/// Below this, `exp` is 0 in f32 (its smallest subnormal is `e^−103.3`).
const LOW: f32 = -110.0;

/// `row[i] = exp(row[i] − m)` for every element, and the sum of the results.
pub fn exp_shifted(row: &mut [f32], m: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if avx512() {
            // SAFETY: `avx512` checked AVX-512 F.
            return unsafe { exp_shifted_avx512(row, m) };
        }
        if crate::quant::avx2::available() {
            // SAFETY: `available` checked AVX2 and FMA.
            return unsafe { exp_shifted_avx2(row, m) };
        }
    }
    exp_shifted_scalar(row, m)
}

/// The portable path: libm's `exp`.
pub fn exp_shifted_scalar(row: &mut [f32], m: f32) -> f32 {
    let mut sum = 0f32;
    for x in row.iter_mut() {
        *x = (*x - m).exp();
        sum += *x;
    }
    sum
}

/// Whether this CPU has AVX-512 F (checked once).
#[cfg(target_arch = "x86_64")]
pub fn avx512() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| is_x86_feature_detected!("avx512f"))
}

/// Cephes' `expf` polynomial coefficients, highest degree first.
const POLY: [f32; 6] = [
    1.987_569_2e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5,
];
/// `ln 2` in two parts: `C1` exact in few bits, `C2` the rest.
const C1: f32 = 0.693_359_4;
const C2: f32 = -2.121_944_4e-4;

/// [`exp_shifted`] with AVX-512: `2ⁿ` applied by `vscalefps`.
///
/// # Safety
/// The CPU has AVX-512 F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub unsafe fn exp_shifted_avx512(row: &mut [f32], m: f32) -> f32 {
    use std::arch::x86_64::*;
    let mv = _mm512_set1_ps(m);
    let mut acc = _mm512_setzero_ps();
    let mut chunks = row.chunks_exact_mut(16);
    let exp = |x: __m512| {
        // max(LOW, x) keeps a NaN x (the second operand is returned for NaN).
        let x = _mm512_max_ps(_mm512_set1_ps(LOW), x);
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)),
        );
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(C1), x);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(C2), r);
        let mut p = _mm512_set1_ps(POLY[0]);
        for c in &POLY[1..] {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(*c));
        }
        let y = _mm512_fmadd_ps(
            _mm512_mul_ps(p, r),
            r,
            _mm512_add_ps(r, _mm512_set1_ps(1.0)),
        );
        _mm512_scalef_ps(y, n)
    };
    for c in &mut chunks {
        let v = exp(_mm512_sub_ps(_mm512_loadu_ps(c.as_ptr()), mv));
        _mm512_storeu_ps(c.as_mut_ptr(), v);
        acc = _mm512_add_ps(acc, v);
    }
    let tail = chunks.into_remainder();
    if !tail.is_empty() {
        let k: __mmask16 = (1u16 << tail.len()) - 1;
        let v = exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, tail.as_ptr()), mv));
        _mm512_mask_storeu_ps(tail.as_mut_ptr(), k, v);
        acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(k, v));
    }
    _mm512_reduce_add_ps(acc)
}

/// [`exp_shifted`] with AVX2 + FMA: `2ⁿ` built in the exponent bits, arguments below
/// `ln` of the smallest normal set to 0.
///
/// # Safety
/// The CPU has AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub unsafe fn exp_shifted_avx2(row: &mut [f32], m: f32) -> f32 {
    use std::arch::x86_64::*;
    let mv = _mm256_set1_ps(m);
    let mut acc = _mm256_setzero_ps();
    let mut chunks = row.chunks_exact_mut(8);
    for c in &mut chunks {
        let x = _mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), mv);
        // Below ln(f32::MIN_POSITIVE) the result is not a normal f32: 0 (a NaN compares
        // false and stays).
        let under = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(-87.336_55));
        let xc = _mm256_min_ps(x, _mm256_set1_ps(88.3));
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(xc, _mm256_set1_ps(std::f32::consts::LOG2_E)),
        );
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(C1), xc);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(C2), r);
        let mut p = _mm256_set1_ps(POLY[0]);
        for k in &POLY[1..] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(*k));
        }
        let y = _mm256_fmadd_ps(
            _mm256_mul_ps(p, r),
            r,
            _mm256_add_ps(r, _mm256_set1_ps(1.0)),
        );
        let two_n = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
            _mm256_cvtps_epi32(n),
            _mm256_set1_epi32(127),
        )));
        let v = _mm256_andnot_ps(under, _mm256_mul_ps(y, two_n));
        _mm256_storeu_ps(c.as_mut_ptr(), v);
        acc = _mm256_add_ps(acc, v);
    }
    let tail = chunks.into_remainder();
    let mut sum = exp_shifted_scalar(tail, m);
    let mut lanes = [0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
    for l in lanes {
        sum += l;
    }
    sum
}

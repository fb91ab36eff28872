//! The online softmax's exponentials (FlashAttention-2 §3.1: each tile's scores become
//! `exp(s − m)` against the running max `m`, and their sum) eight lanes at a time. A prefill
//! tile of a long context is mostly this loop: libm's scalar `expf` made a SmolLM2 4K
//! prefill 29% slower. The vector `exp` works in f64 (`2ⁿ·p(r)`, `n = round(x·log₂e)`,
//! `r = x − n·ln 2` in two steps, an 11th-degree Taylor polynomial, error ~1e-14) and rounds
//! once to f32, so each result is the correctly rounded `exp` — libm's own, but where libm
//! is off by its last half-ulp — and the logits stay libm's to the last bit almost
//! everywhere: an f32 polynomial (2 ulp) moved a near-tie of Gemma 3's greedy choice past
//! llama.cpp's own numerical spread (`tests/gguf_gemma3.rs`). `exp(−∞) = 0`.
#![allow(unsafe_code)]

/// Below this, `exp` rounds to 0 in f32 (its smallest subnormal is `e^−103.3`).
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

/// The largest element of `row`, NaN when any is (`-inf` for an empty row): a tile's running
/// max in the online softmax, eight lanes at a time (a scalar NaN-aware fold was a quarter
/// of a SmolLM2 8K prefill).
pub fn max_or_nan(row: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if crate::quant::avx2::available() {
        // SAFETY: `available` checked AVX2.
        return unsafe { max_or_nan_avx2(row) };
    }
    max_or_nan_portable(row)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn max_or_nan_avx2(row: &[f32]) -> f32 {
    max_or_nan_portable(row)
}

/// [`max_or_nan`]'s math, written to vectorize: per lane a max by `>` (which skips NaN) and a
/// NaN flag.
#[inline(always)]
fn max_or_nan_portable(row: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 8];
    let mut nan = [false; 8];
    let mut eights = row.chunks_exact(8);
    for eight in &mut eights {
        for ((m, n), x) in lanes.iter_mut().zip(nan.iter_mut()).zip(eight) {
            *m = if *x > *m { *x } else { *m };
            *n |= x.is_nan();
        }
    }
    let mut max = f32::NEG_INFINITY;
    let mut any_nan = nan.iter().any(|n| *n);
    for x in lanes.iter().chain(eights.remainder()) {
        max = if *x > max { *x } else { max };
        any_nan |= x.is_nan();
    }
    if any_nan {
        f32::NAN
    } else {
        max
    }
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

/// `exp` on `r ∈ [−ln2/2, ln2/2]`: Taylor coefficients `1/k!`, `k = 11 … 0` (the
/// truncation error, `r¹²/12!`, is below 1e-14 relative).
const TAYLOR: [f64; 12] = [
    1.0 / 39_916_800.0,
    1.0 / 3_628_800.0,
    1.0 / 362_880.0,
    1.0 / 40_320.0,
    1.0 / 5_040.0,
    1.0 / 720.0,
    1.0 / 120.0,
    1.0 / 24.0,
    1.0 / 6.0,
    0.5,
    1.0,
    1.0,
];
/// `ln 2` in two parts: `LN2_HI` with trailing zero bits (so `n·LN2_HI` is exact), `LN2_LO`
/// the rest.
const LN2_HI: f64 = f64::from_bits(0x3FE6_2E42_FEE0_0000);
const LN2_LO: f64 = f64::from_bits(0x3DEA_39EF_3579_3C76);
/// Arguments are clamped to `[LOW, HIGH]` (NaN kept): below, `exp` rounds to 0 in f32;
/// above, to +∞.
const HIGH: f64 = 89.0;

/// [`exp_shifted`] with AVX-512, eight lanes of f64 per step.
///
/// # Safety
/// The CPU has AVX-512 F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub unsafe fn exp_shifted_avx512(row: &mut [f32], m: f32) -> f32 {
    use std::arch::x86_64::*;
    let exp = |x: __m256| {
        // Exact in f64; max/min return their second operand for a NaN, so it stays.
        let x = _mm512_cvtps_pd(x);
        let x = _mm512_max_pd(_mm512_set1_pd(LOW as f64), x);
        let x = _mm512_min_pd(_mm512_set1_pd(HIGH), x);
        let n = _mm512_roundscale_pd::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm512_mul_pd(x, _mm512_set1_pd(std::f64::consts::LOG2_E)),
        );
        let r = _mm512_fnmadd_pd(n, _mm512_set1_pd(LN2_HI), x);
        let r = _mm512_fnmadd_pd(n, _mm512_set1_pd(LN2_LO), r);
        let mut p = _mm512_set1_pd(TAYLOR[0]);
        for c in &TAYLOR[1..] {
            p = _mm512_fmadd_pd(p, r, _mm512_set1_pd(*c));
        }
        _mm512_cvtpd_ps(_mm512_scalef_pd(p, n))
    };
    over_row(row, m, exp)
}

/// [`exp_shifted`] with AVX2 + FMA, four lanes of f64 per step, `2ⁿ` built in the
/// exponent bits (`n ≥ −159` after the clamp: a normal f64).
///
/// # Safety
/// The CPU has AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub unsafe fn exp_shifted_avx2(row: &mut [f32], m: f32) -> f32 {
    use std::arch::x86_64::*;
    let exp4 = |x: __m128| {
        let x = _mm256_cvtps_pd(x);
        let x = _mm256_max_pd(_mm256_set1_pd(LOW as f64), x);
        let x = _mm256_min_pd(_mm256_set1_pd(HIGH), x);
        let n = _mm256_round_pd::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_pd(x, _mm256_set1_pd(std::f64::consts::LOG2_E)),
        );
        let r = _mm256_fnmadd_pd(n, _mm256_set1_pd(LN2_HI), x);
        let r = _mm256_fnmadd_pd(n, _mm256_set1_pd(LN2_LO), r);
        let mut p = _mm256_set1_pd(TAYLOR[0]);
        for c in &TAYLOR[1..] {
            p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(*c));
        }
        let bits = _mm256_slli_epi64::<52>(_mm256_add_epi64(
            _mm256_cvtepi32_epi64(_mm256_cvtpd_epi32(n)),
            _mm256_set1_epi64x(1023),
        ));
        _mm256_cvtpd_ps(_mm256_mul_pd(p, _mm256_castsi256_pd(bits)))
    };
    let exp = |x: __m256| {
        _mm256_set_m128(
            exp4(_mm256_extractf128_ps::<1>(x)),
            exp4(_mm256_castps256_ps128(x)),
        )
    };
    over_row(row, m, exp)
}

/// `row[i] = exp(row[i] − m)` eight at a time with `exp`, and their sum; the tail padded
/// with −∞ (whose exponential is 0), so it rounds as the rest does.
///
/// # Safety
/// The CPU has AVX; `exp` is safe to call on it.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn over_row(
    row: &mut [f32],
    m: f32,
    exp: impl Fn(std::arch::x86_64::__m256) -> std::arch::x86_64::__m256,
) -> f32 {
    use std::arch::x86_64::*;
    let mv = _mm256_set1_ps(m);
    let mut acc = _mm256_setzero_ps();
    let mut chunks = row.chunks_exact_mut(8);
    for c in &mut chunks {
        let v = exp(_mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), mv));
        _mm256_storeu_ps(c.as_mut_ptr(), v);
        acc = _mm256_add_ps(acc, v);
    }
    let tail = chunks.into_remainder();
    if !tail.is_empty() {
        let mut pad = [f32::NEG_INFINITY; 8];
        pad[..tail.len()].copy_from_slice(tail);
        let v = exp(_mm256_sub_ps(_mm256_loadu_ps(pad.as_ptr()), mv));
        _mm256_storeu_ps(pad.as_mut_ptr(), v);
        tail.copy_from_slice(&pad[..tail.len()]);
        acc = _mm256_add_ps(acc, v);
    }
    let mut lanes = [0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
    lanes.iter().sum()
}

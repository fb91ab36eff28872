//! The two tile products of [`super::cpu`] for the few query rows of a decode step (one
//! row per query head of a KV head's group): `S = Q·Kᵀ` and `O += P·V` with AVX2 + FMA,
//! each key row loaded once for all query rows. The `gemm` crate packs its operands for
//! large products; at 1–8 rows that packing and dispatch cost as much as the arithmetic
//! (half of the attention time of a SmolLM2 decode step, measured with perf). Larger row
//! counts, other strides or CPUs without AVX2 keep the `gemm` path.
#![allow(unsafe_code)]

/// Most query rows this path takes.
pub const MAX_ROWS: usize = 16;

/// Whether the small path applies: few rows, width a multiple of 8, AVX2 + FMA present.
pub fn applies(rows: usize, d: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        rows <= MAX_ROWS && d % 8 == 0 && crate::quant::avx2::available()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (rows, d);
        false
    }
}

/// `s[r·nk + j] = Σ_c q[r·d + c] · k(j)[c]` for `rows` query rows and `nk` keys, key `j`'s
/// `d` values contiguous at `k + j·rs`.
///
/// # Safety
/// [`applies`] holds; `q` holds `rows·d`, `s` `rows·nk`; `k + j·rs + c` is readable for
/// `j < nk`, `c < d`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub unsafe fn scores(
    q: &[f32],
    rows: usize,
    d: usize,
    k: *const f32,
    rs: isize,
    nk: usize,
    s: &mut [f32],
) {
    use std::arch::x86_64::*;
    debug_assert!(q.len() >= rows * d && s.len() >= rows * nk);
    let mut acc = [_mm256_setzero_ps(); MAX_ROWS];
    for j in 0..nk {
        let kj = k.offset(j as isize * rs);
        for a in acc.iter_mut().take(rows) {
            *a = _mm256_setzero_ps();
        }
        for c in (0..d).step_by(8) {
            let kv = _mm256_loadu_ps(kj.add(c));
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

/// `o[r·d + c] += Σ_j p[r·nk + j] · v(j)[c]`, value `j`'s `d` values contiguous at
/// `v + j·rs`.
///
/// # Safety
/// As [`scores`], with `o` holding `rows·d` and `p` `rows·nk`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub unsafe fn accumulate(
    p: &[f32],
    rows: usize,
    nk: usize,
    v: *const f32,
    rs: isize,
    d: usize,
    o: &mut [f32],
) {
    use std::arch::x86_64::*;
    debug_assert!(p.len() >= rows * nk && o.len() >= rows * d);
    let op = o.as_mut_ptr();
    for j in 0..nk {
        let vj = v.offset(j as isize * rs);
        for c in (0..d).step_by(8) {
            let vv = _mm256_loadu_ps(vj.add(c));
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

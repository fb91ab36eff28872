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
/// `d` values (of kind `L`) contiguous at element `k + j·rs`. Eight keys at a time per
/// row: eight independent FMA chains (one chain per key would wait on each FMA's latency),
/// their lanes reduced together by shuffles, in the one-key order (the same bits).
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
    let key = |j: usize| k.offset(j as isize * rs * size as isize);
    let mut j = 0;
    while j + 8 <= nk {
        let ks: [*const u8; 8] = std::array::from_fn(|i| key(j + i));
        for r in 0..rows {
            let qr = q.as_ptr().add(r * d);
            let mut a = [_mm256_setzero_ps(); 8];
            for c in (0..d).step_by(8) {
                let qv = _mm256_loadu_ps(qr.add(c));
                for (ai, kp) in a.iter_mut().zip(&ks) {
                    *ai = _mm256_fmadd_ps(qv, load8::<L>(kp.add(c * size)), *ai);
                }
            }
            // Eight sums at once, each added in the order the one-key reduction below adds
            // its lanes ((x0 + x2) + (x1 + x3) with x_i = lane i + lane i+4), so a key's
            // score has the same bits whichever path computed it.
            let halves = |p: __m256, q: __m256| {
                _mm256_add_ps(
                    _mm256_permute2f128_ps(p, q, 0x20),
                    _mm256_permute2f128_ps(p, q, 0x31),
                )
            };
            let (b01, b23) = (halves(a[0], a[1]), halves(a[2], a[3]));
            let (b45, b67) = (halves(a[4], a[5]), halves(a[6], a[7]));
            // y_k0 = x_k0 + x_k2, y_k1 = x_k1 + x_k3, two keys per 128-bit lane.
            let pairs = |p: __m256, q: __m256| {
                _mm256_add_ps(
                    _mm256_shuffle_ps(p, q, 0b01_00_01_00),
                    _mm256_shuffle_ps(p, q, 0b11_10_11_10),
                )
            };
            let (c0, c1) = (pairs(b01, b23), pairs(b45, b67));
            // z_k = y_k0 + y_k1: lanes hold keys 0, 2, 4, 6 | 1, 3, 5, 7.
            let z = _mm256_add_ps(
                _mm256_shuffle_ps(c0, c1, 0b10_00_10_00),
                _mm256_shuffle_ps(c0, c1, 0b11_01_11_01),
            );
            let z = _mm256_permutevar8x32_ps(z, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_ps(s.as_mut_ptr().add(r * nk + j), z);
        }
        j += 8;
    }
    for j in j..nk {
        let kj = key(j);
        for r in 0..rows {
            let qr = q.as_ptr().add(r * d);
            let mut a = _mm256_setzero_ps();
            for c in (0..d).step_by(8) {
                a = _mm256_fmadd_ps(_mm256_loadu_ps(qr.add(c)), load8::<L>(kj.add(c * size)), a);
            }
            let h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
            let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
            let h = _mm_add_ss(h, _mm_movehdup_ps(h));
            s[r * nk + j] = _mm_cvtss_f32(h);
        }
    }
}

/// `o[r·d + c] += Σ_j p[r·nk + j] · v(j)[c]`, value `j`'s `d` values (of kind `L`)
/// contiguous at element `v + j·rs`. The output is held in registers across the keys, a
/// block of `8·CB` channels of `R` rows at a time (`R·CB` independent FMA chains), for up
/// to 8 rows; more rows go through memory.
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
    debug_assert!(p.len() >= rows * nk && o.len() >= rows * d);
    let x = (p, nk, v, rs, d);
    match rows {
        1 => accumulate_rows::<L, 1, 4>(x, o),
        2 => accumulate_rows::<L, 2, 4>(x, o),
        3 => accumulate_rows::<L, 3, 4>(x, o),
        4 => accumulate_rows::<L, 4, 2>(x, o),
        5 => accumulate_rows::<L, 5, 2>(x, o),
        6 => accumulate_rows::<L, 6, 2>(x, o),
        7 => accumulate_rows::<L, 7, 1>(x, o),
        8 => accumulate_rows::<L, 8, 1>(x, o),
        _ => accumulate_any::<L>(x, rows, o),
    }
}

/// The inputs of [`accumulate`]: probabilities, keys, values, their row stride, width.
type AccIn<'a> = (&'a [f32], usize, *const u8, isize, usize);

/// [`accumulate`] for `R` rows, `8·CB` channels per pass (then 8 for what is left).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn accumulate_rows<const L: u8, const R: usize, const CB: usize>(
    (p, nk, v, rs, d): AccIn<'_>,
    o: &mut [f32],
) {
    use std::arch::x86_64::*;
    let size = elem_bytes(L);
    let op = o.as_mut_ptr();
    let mut c = 0;
    let pass = |c: usize, cb: usize| {
        // `cb` ≤ CB blocks of 8 channels from `c`.
        let mut acc = [[_mm256_setzero_ps(); CB]; R];
        for (r, a) in acc.iter_mut().enumerate() {
            for (b, x) in a.iter_mut().enumerate().take(cb) {
                *x = _mm256_loadu_ps(op.add(r * d + c + 8 * b));
            }
        }
        for j in 0..nk {
            let vj = v.offset(j as isize * rs * size as isize).add(c * size);
            let mut vv = [_mm256_setzero_ps(); CB];
            for (b, x) in vv.iter_mut().enumerate().take(cb) {
                *x = load8::<L>(vj.add(8 * b * size));
            }
            for (r, a) in acc.iter_mut().enumerate() {
                let w = _mm256_set1_ps(*p.get_unchecked(r * nk + j));
                for (x, y) in a.iter_mut().zip(&vv).take(cb) {
                    *x = _mm256_fmadd_ps(w, *y, *x);
                }
            }
        }
        for (r, a) in acc.iter().enumerate() {
            for (b, x) in a.iter().enumerate().take(cb) {
                _mm256_storeu_ps(op.add(r * d + c + 8 * b), *x);
            }
        }
    };
    while c + 8 * CB <= d {
        pass(c, CB);
        c += 8 * CB;
    }
    while c < d {
        pass(c, 1);
        c += 8;
    }
}

/// [`accumulate`] for any number of rows, the output read and written per key.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn accumulate_any<const L: u8>((p, nk, v, rs, d): AccIn<'_>, rows: usize, o: &mut [f32]) {
    use std::arch::x86_64::*;
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

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use crate::flash::small::{applies, scores, F32};

    /// Keys scored eight at a time get the same bits as each scored alone (the reduction
    /// order is the one-key path's): a model's logits do not depend on how the keys fell
    /// into blocks (Gemma 3 270M moved by ~0.8 logits over a few steps when they did).
    #[test]
    fn blocked_scores_equal_one_key_scores_bit_for_bit() {
        if !applies(3, 64) {
            return;
        }
        let (rows, d, nk) = (3usize, 64usize, 19usize);
        let q: Vec<f32> = (0..rows * d)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let k: Vec<f32> = (0..nk * d)
            .map(|i| ((i * 53 % 97) as f32 - 48.0) / 3.0)
            .collect();
        let mut all = vec![0f32; rows * nk];
        // SAFETY: AVX2/FMA/F16C checked by `applies`; q holds rows·d, k nk·d, all rows·nk.
        unsafe {
            scores::<F32>(
                &q,
                rows,
                d,
                k.as_ptr() as *const u8,
                d as isize,
                nk,
                &mut all,
            )
        };
        for j in 0..nk {
            let mut one = vec![0f32; rows];
            let kj = k[j * d..].as_ptr() as *const u8;
            // SAFETY: as above, one key.
            unsafe { scores::<F32>(&q, rows, d, kj, d as isize, 1, &mut one) };
            for r in 0..rows {
                assert_eq!(
                    all[r * nk + j].to_bits(),
                    one[r].to_bits(),
                    "row {r} key {j}"
                );
            }
        }
    }
}

//! The online softmax's vector `exp` (`flash::softmax`) on every path this CPU has: each
//! result is f64's `exp` rounded once to f32 — the correctly rounded value, bit for bit —
//! (libm's scalar path within 1 ulp of it); `exp(−∞) = 0` exactly (masked scores); the
//! returned sum is the sum of what was written. Row lengths cover the vector tails.
use kvpolicy_kernels::flash::softmax;

fn inputs(len: usize) -> Vec<f32> {
    // From −120 (far below underflow) to +5, plus −∞ (a masked score), repeated.
    (0..len)
        .map(|i| match i % 97 {
            13 => f32::NEG_INFINITY,
            j => -120.0 + 125.0 * j as f32 / 96.0 + (i as f32 * 0.001).sin(),
        })
        .collect()
}

fn check(name: &str, exact: bool, f: impl Fn(&mut [f32], f32) -> f32) {
    for len in [1, 7, 8, 15, 16, 17, 33, 256, 1000] {
        let m = 1.5f32;
        let x = inputs(len);
        let mut y = x.clone();
        let sum = f(&mut y, m);
        let mut total = 0f64;
        for (i, (a, b)) in x.iter().zip(&y).enumerate() {
            let want = ((*a - m) as f64).exp();
            total += *b as f64;
            if a.is_infinite() {
                assert_eq!(*b, 0.0, "{name}: exp(−∞) at {i}");
            } else if exact {
                assert_eq!(*b, want as f32, "{name}: exp({})", a - m);
            } else {
                let ulp = (want as f32).abs() * f32::EPSILON;
                assert!(
                    (*b as f64 - want).abs() <= ulp.max(f32::from_bits(1)) as f64,
                    "{name}: exp({}) = {b}, want {want}",
                    a - m
                );
            }
        }
        assert!(
            (sum as f64 - total).abs() <= 1e-6 * total + 1e-37,
            "{name} len {len}: sum {sum} vs {total}"
        );
    }
}

/// Scores past the ordinary: NaN stays NaN, an overflowing argument gives +∞, on every path.
#[test]
fn nan_and_overflow_are_kept() {
    type Path = Box<dyn Fn(&mut [f32], f32) -> f32>;
    let paths: Vec<(&str, Path)> = vec![
        ("dispatch", Box::new(softmax::exp_shifted)),
        ("scalar", Box::new(softmax::exp_shifted_scalar)),
    ];
    for (name, f) in paths {
        let mut row = vec![0.5f32; 11];
        row[2] = f32::NAN;
        row[9] = 200.0;
        let sum = f(&mut row, 0.0);
        assert!(row[2].is_nan(), "{name}: exp(NaN) = {}", row[2]);
        assert_eq!(row[9], f32::INFINITY, "{name}: exp(200)");
        assert!(sum.is_nan(), "{name}: a NaN's row sums to {sum}");
    }
}

#[test]
fn vector_exp_matches_f64_on_every_path() {
    #[cfg(target_arch = "x86_64")]
    let vector = kvpolicy_kernels::quant::avx2::available();
    #[cfg(not(target_arch = "x86_64"))]
    let vector = false;
    check("dispatch", vector, softmax::exp_shifted);
    check("scalar", false, softmax::exp_shifted_scalar);
    #[cfg(target_arch = "x86_64")]
    {
        if softmax::avx512() {
            // SAFETY: `avx512` checked AVX-512 F.
            check("avx512", true, |r, m| unsafe {
                softmax::exp_shifted_avx512(r, m)
            });
        }
        if kvpolicy_kernels::quant::avx2::available() {
            // SAFETY: `available` checked AVX2 and FMA.
            check("avx2", true, |r, m| unsafe {
                softmax::exp_shifted_avx2(r, m)
            });
        }
    }
}

/// A tile's running max: the largest element, NaN when any element is NaN wherever it sits
/// (in the eight-lane body or the tail), `-inf` for rows of masked scores or none.
#[test]
fn tile_max_is_the_fold_and_nan_wins() {
    let fold = |row: &[f32]| {
        if row.iter().any(|x| x.is_nan()) {
            f32::NAN
        } else {
            row.iter().copied().fold(f32::NEG_INFINITY, f32::max)
        }
    };
    for len in [0, 1, 7, 8, 9, 16, 31, 256, 1001] {
        let x = inputs(len);
        assert_eq!(
            softmax::max_or_nan(&x).to_bits(),
            fold(&x).to_bits(),
            "len {len}"
        );
        for at in [0, len / 2, len.saturating_sub(1)] {
            if len > 0 {
                let mut y = x.clone();
                y[at] = f32::NAN;
                assert!(softmax::max_or_nan(&y).is_nan(), "len {len}: NaN at {at}");
            }
        }
    }
    assert_eq!(
        softmax::max_or_nan(&[f32::NEG_INFINITY; 20]),
        f32::NEG_INFINITY
    );
}

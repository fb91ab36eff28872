//! The tiled attentions (the CPU kernel behind `attend_partial`, and the candle-op tiles
//! used on other devices) against the eager reference that materialises every score:
//! random heads, groups, head widths, windows, soft-caps, chunk offsets, key pieces at an
//! offset, strided K/V views, and sizes on both sides of every tile boundary (decode's
//! `t = 1` included).
use candle_core::{DType, Device, Tensor};
use kvpolicy_core::attention::{attend_partial_eager, tiled::attend_partial_tiled, tiled::Tiles};
use kvpolicy_core::{attend, attend_partial, AttnInputs, AttnSpec, Partial};
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

#[derive(Clone, Debug)]
struct Case {
    b: usize,
    nkv: usize,
    g: usize,
    d: usize,
    t: usize,
    hist: usize,
    /// The key piece starts this many tokens into the sequence (KVPR's ranges, head-wise
    /// windows).
    k_skip: usize,
    window: Option<usize>,
    softcap: Option<f64>,
    causal: bool,
    /// Keys and values are a narrow of a buffer this much longer than needed.
    spare: usize,
    /// Keys and values laid out (b, s, heads, d) and transposed into place.
    transposed: bool,
    tiles: Tiles,
    seed: u64,
}

fn case() -> impl Strategy<Value = Case> {
    (
        (
            1usize..=2,
            1usize..=3,
            1usize..=5,
            prop::sample::select(vec![1usize, 4, 8, 16, 64]),
        ),
        (1usize..=140, 0usize..=600, 0usize..=400),
        (
            prop::option::of(1usize..=300),
            prop::option::of(0.5f64..30.0),
            prop::bool::weighted(0.9),
        ),
        (
            0usize..=40,
            any::<bool>(),
            (1usize..=70, 1usize..=300),
            any::<u64>(),
        ),
    )
        .prop_map(
            |(
                (b, nkv, g, d),
                (t, hist, skip),
                (window, softcap, causal),
                (spare, transposed, tiles, seed),
            )| Case {
                b,
                nkv,
                g,
                d,
                t,
                hist,
                k_skip: skip.min(hist + t - 1),
                window,
                softcap,
                causal,
                spare,
                transposed,
                tiles: Tiles {
                    queries: tiles.0,
                    keys: tiles.1,
                },
                seed,
            },
        )
}

struct Inputs {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    spec: AttnSpec,
    q_pos: usize,
    k_pos: usize,
}

fn inputs(c: &Case) -> candle_core::Result<Inputs> {
    let dev = Device::Cpu;
    let mut rng = StdRng::seed_from_u64(c.seed);
    let mut randn = |scale: f32, shape: (usize, usize, usize, usize)| {
        let n = shape.0 * shape.1 * shape.2 * shape.3;
        let vals: Vec<f32> = (0..n).map(|_| rng.random_range(-scale..scale)).collect();
        Tensor::from_vec(vals, shape, &dev)
    };
    let nh = c.nkv * c.g;
    let s = c.hist + c.t - c.k_skip;
    let q = randn(2.5, (c.b, nh, c.t, c.d))?;
    let (k, v) = if c.transposed {
        let kk = randn(2.5, (c.b, s + c.spare, c.nkv, c.d))?;
        let vv = randn(1.5, (c.b, s + c.spare, c.nkv, c.d))?;
        (
            kk.transpose(1, 2)?.narrow(2, 0, s)?,
            vv.transpose(1, 2)?.narrow(2, 0, s)?,
        )
    } else {
        let kk = randn(2.5, (c.b, c.nkv, s + c.spare, c.d))?;
        let vv = randn(1.5, (c.b, c.nkv, s + c.spare, c.d))?;
        (kk.narrow(2, 0, s)?, vv.narrow(2, 0, s)?)
    };
    let mut spec = AttnSpec::new(nh, c.nkv, c.d);
    spec.sliding_window = c.window;
    spec.softcap = c.softcap;
    spec.causal = c.causal;
    Ok(Inputs {
        q,
        k,
        v,
        spec,
        q_pos: c.hist,
        k_pos: c.k_skip,
    })
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    let a = a
        .flatten_all()
        .and_then(|t| t.to_vec1::<f32>())
        .unwrap_or_default();
    let b = b
        .flatten_all()
        .and_then(|t| t.to_vec1::<f32>())
        .unwrap_or_default();
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(&b)
        .map(|(x, y)| if x == y { 0.0 } else { (x - y).abs() })
        .fold(0f32, f32::max)
}

fn check(want: &Partial, got: &Partial, what: &str) -> Result<(), TestCaseError> {
    let (o, l) = (max_diff(&want.out, &got.out), max_diff(&want.lse, &got.lse));
    prop_assert!(o <= 1e-5, "{what}: outputs differ by {o}");
    prop_assert!(l <= 1e-4, "{what}: log-sum-exps differ by {l}");
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn tiled_equals_eager(c in case()) {
        let i = inputs(&c).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let want = attend_partial_eager(AttnInputs { q: &i.q, k: &i.k, v: &i.v, q_pos: i.q_pos, k_pos: i.k_pos }, &i.spec)
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        let kernel = attend_partial(AttnInputs { q: &i.q, k: &i.k, v: &i.v, q_pos: i.q_pos, k_pos: i.k_pos }, &i.spec)
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        check(&want, &kernel, "cpu kernel")?;
        let ops = attend_partial_tiled(AttnInputs { q: &i.q, k: &i.k, v: &i.v, q_pos: i.q_pos, k_pos: i.k_pos }, &i.spec, c.tiles)
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        check(&want, &ops, "candle-op tiles")?;
    }
}

/// Half-precision inputs are widened exactly and accumulated in f32: the kernel on f16 or
/// bf16 equals the eager f32 attention over the same (rounded) values.
#[test]
fn half_inputs_accumulate_in_f32() -> anyhow::Result<()> {
    for dt in [DType::F16, DType::BF16] {
        for (t, hist) in [(1, 700), (37, 300), (130, 0)] {
            let c = Case {
                b: 1,
                nkv: 2,
                g: 3,
                d: 64,
                t,
                hist,
                k_skip: 0,
                window: Some(500),
                softcap: Some(20.0),
                causal: true,
                spare: 5,
                transposed: false,
                tiles: Tiles {
                    queries: 1,
                    keys: 1,
                },
                seed: 7,
            };
            let i = inputs(&c)?;
            let (q, k, v) = (i.q.to_dtype(dt)?, i.k.to_dtype(dt)?, i.v.to_dtype(dt)?);
            let f32s = |x: &Tensor| x.to_dtype(DType::F32);
            let want = attend_partial_eager(
                AttnInputs {
                    q: &f32s(&q)?,
                    k: &f32s(&k)?,
                    v: &f32s(&v)?,
                    q_pos: hist,
                    k_pos: 0,
                },
                &i.spec,
            )?;
            let got = attend_partial(
                AttnInputs {
                    q: &q,
                    k: &k,
                    v: &v,
                    q_pos: hist,
                    k_pos: 0,
                },
                &i.spec,
            )?;
            let d = max_diff(&want.out, &got.out);
            assert!(d <= 1e-5, "{dt:?} t={t}: {d}");
            assert_eq!(
                attend(
                    AttnInputs {
                        q: &q,
                        k: &k,
                        v: &v,
                        q_pos: hist,
                        k_pos: 0
                    },
                    &i.spec
                )?
                .dtype(),
                dt
            );
        }
    }
    Ok(())
}

/// The kernel's scratch depends on the tiles and threads, not on the context: a decode
/// step and a 256-token chunk at 1K, 4K and 16K cached tokens use the same bytes (on a
/// two-thread pool: with more threads a decode step splits its keys further, up to the
/// number of key tiles).
#[test]
fn scratch_does_not_grow_with_the_context() -> anyhow::Result<()> {
    let spec = AttnSpec::new(9, 3, 64);
    let dev = Device::Cpu;
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build()?;
    for t in [1usize, 256] {
        let mut seen = Vec::new();
        for s in [1024usize, 4096, 16384] {
            let q = Tensor::randn(0f32, 1.0, (1, 9, t, 64), &dev)?;
            let k = Tensor::randn(0f32, 1.0, (1, 3, s, 64), &dev)?;
            let p = pool.install(|| {
                attend_partial(
                    AttnInputs {
                        q: &q,
                        k: &k,
                        v: &k,
                        q_pos: s - t,
                        k_pos: 0,
                    },
                    &spec,
                )
            })?;
            seen.push(p.scratch_bytes);
        }
        assert!(seen[0] > 0, "t={t}: no scratch counted");
        assert!(
            seen.iter().all(|&b| b == seen[0]),
            "t={t}: scratch grew with the context: {seen:?}"
        );
    }
    Ok(())
}

//! Property tests (proptest): random attention shapes (heads, KV heads, head width, layers,
//! sliding window, batch), random sequences of prefill chunks and decode steps, random
//! policy options (head groups, forced splits, growth steps, budgets that fit). Every
//! policy's attention output equals `full`'s within 1e-5 at every step and layer.
//!
//! Policies are driven directly through [`AttnStep`]s, without a model. K and V are random;
//! the layer input X is their concatenation, so the test's [`KvRegen`] (split X back into K
//! and V) regenerates them exactly, as a model's projections would.
use candle_core::{Device, Tensor};
use kvpolicy::{build_policy, AttnSpec, AttnStep, HeadGroup, KvPolicy, KvRegen, PolicyOptions};
use proptest::prelude::*;

/// X = [K | V] per token: `(b, t, 2·nkv·d)`.
struct SplitRegen {
    nkv: usize,
    d: usize,
}

impl KvRegen for SplitRegen {
    fn regen(&self, x: &Tensor, _pos: usize) -> kvpolicy::core::Result<(Tensor, Tensor)> {
        let (b, t, _) = x.dims3()?;
        let w = self.nkv * self.d;
        let heads = |off: usize| -> kvpolicy::core::Result<Tensor> {
            Ok(x.narrow(2, off, w)?
                .reshape((b, t, self.nkv, self.d))?
                .transpose(1, 2)?
                .contiguous()?)
        };
        Ok((heads(0)?, heads(w)?))
    }
    fn flops_per_token(&self) -> u64 {
        1
    }
}

#[derive(Debug, Clone)]
struct Case {
    n_kv: usize,
    group: usize,
    head_dim: usize,
    layers: usize,
    batch: usize,
    window: Option<usize>,
    chunks: Vec<usize>,
    head_group: usize,
    split: usize,
    grow: usize,
    seed: u64,
}

fn case() -> impl Strategy<Value = Case> {
    (
        1usize..=4,
        1usize..=3,
        prop::sample::select(vec![2usize, 4, 8]),
        1usize..=3,
        1usize..=2,
        prop::option::of(1usize..=9),
        prop::collection::vec(1usize..=7, 1..=8),
        1usize..=4,
        0usize..=40,
        prop::sample::select(vec![1usize, 3, 8, 64]),
        any::<u64>(),
    )
        .prop_map(
            |(n_kv, group, head_dim, layers, batch, window, mut chunks, hg, split, grow, seed)| {
                // A few decode steps after the prefill chunks.
                chunks.extend([1, 1, 1]);
                Case {
                    n_kv,
                    group,
                    head_dim,
                    layers,
                    batch,
                    window,
                    chunks,
                    head_group: (1..=n_kv)
                        .rev()
                        .find(|g| n_kv % g == 0 && *g <= hg)
                        .unwrap_or(1),
                    split,
                    grow,
                    seed,
                }
            },
        )
}

fn tensor(dims: &[usize], seed: u64, dev: &Device) -> candle_core::Result<Tensor> {
    let n: usize = dims.iter().product();
    let mut s = seed | 1;
    let v: Vec<f32> = (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s % 20011) as f32 / 20011.0 - 0.5) * 4.0
        })
        .collect();
    Tensor::from_vec(v, dims, dev)
}

/// Every step's output of every layer.
fn drive(p: &mut dyn KvPolicy, c: &Case) -> Result<Vec<Tensor>, TestCaseError> {
    let dev = Device::Cpu;
    let fail = |e: &dyn std::fmt::Display| TestCaseError::fail(e.to_string());
    let mut spec = AttnSpec::new(c.n_kv * c.group, c.n_kv, c.head_dim);
    spec.sliding_window = c.window;
    let regen = SplitRegen {
        nkv: c.n_kv,
        d: c.head_dim,
    };
    let (b, d, nkv) = (c.batch, c.head_dim, c.n_kv);
    let mut outs = Vec::new();
    let mut pos = 0;
    for (i, &t) in c.chunks.iter().enumerate() {
        for layer in 0..c.layers {
            let salt = c.seed ^ ((i as u64) << 20) ^ ((layer as u64) << 40);
            let q = tensor(&[b, spec.n_heads, t, d], salt ^ 1, &dev).map_err(|e| fail(&e))?;
            let x = tensor(&[b, t, 2 * nkv * d], salt ^ 2, &dev).map_err(|e| fail(&e))?;
            let (k, v) = regen.regen(&x, pos).map_err(|e| fail(&e))?;
            let out = p
                .attend(&AttnStep {
                    seq: 0,
                    layer,
                    q: &q,
                    k: &k,
                    v: &v,
                    x: &x,
                    pos,
                    spec: &spec,
                    regen: &regen,
                })
                .map_err(|e| fail(&e))?;
            outs.push(out);
        }
        pos += t;
    }
    Ok(outs)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn every_policy_equals_full(c in case()) {
        let opts = |f: &dyn Fn(&mut PolicyOptions)| {
            let mut o = PolicyOptions { grow_tokens: c.grow, ..PolicyOptions::default() };
            f(&mut o);
            o
        };
        let mut full = build_policy("full", &opts(&|_| {})).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let want = drive(full.as_mut(), &c)?;
        let total: usize = c.chunks.iter().sum();
        let variants: Vec<(&str, PolicyOptions)> = vec![
            ("layer", opts(&|_| {})),
            ("headwise", opts(&|o| o.head_group = HeadGroup::Fixed(c.head_group))),
            ("headwise", opts(&|o| o.head_group = HeadGroup::Auto)),
            ("recompute", opts(&|o| o.recompute_split = Some(c.split.min(total)))),
            ("recompute", opts(&|_| {})),
        ];
        for (name, o) in variants {
            let mut p = build_policy(name, &o).map_err(|e| TestCaseError::fail(e.to_string()))?;
            let got = drive(p.as_mut(), &c)?;
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                let d = (g - w)
                    .and_then(|t| t.abs())
                    .and_then(|t| t.flatten_all())
                    .and_then(|t| t.max(0))
                    .and_then(|t| t.to_scalar::<f32>())
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                prop_assert!(d <= 1e-5, "{} {:?}: output {} differs by {}", name, o.head_group, i, d);
            }
        }
    }
}

//! Property tests (proptest): random attention shapes (heads, KV heads, head width, layers,
//! sliding window, batch), random sequences of prefill chunks and decode steps, random
//! policy options (head groups, forced splits, growth steps, block sizes, KV:ACT shares,
//! budgets that fit). Every
//! policy's attention output equals `full`'s within 1e-5 at every step and layer.
//!
//! Policies are driven directly through [`AttnStep`]s, without a model. K and V are random;
//! the layer input X is their concatenation, so the test's [`KvRegen`] (split X back into K
//! and V) regenerates them exactly, as a model's projections would.
mod common;

use candle_core::{Device, Tensor};
use kvpolicy::core::SeqLoad;
use kvpolicy::{build_policy, AttnSpec, AttnStep, KvPolicy, KvRegen, PolicyOptions};
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
    /// `hybrid`: tokens per block, forced KV share (`None`: from a synthetic profile), and
    /// device-pool slots for activation blocks (`None`: no budget).
    block: usize,
    share: Option<f64>,
    act_slots: Option<u64>,
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
        (
            prop::sample::select(vec![1usize, 2, 3, 5, 16]),
            prop::option::of(prop::sample::select(vec![0.0, 0.25, 0.5, 2.0 / 3.0, 1.0])),
            prop::option::of(0u64..=3),
        ),
        any::<u64>(),
    )
        .prop_map(
            |(
                n_kv,
                group,
                head_dim,
                layers,
                batch,
                window,
                mut chunks,
                hg,
                split,
                grow,
                (block, share, act_slots),
                seed,
            )| {
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
                    block,
                    share,
                    act_slots,
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

/// Every step's output of every layer. With `per_seq`, each batch row is its own sequence
/// (`AttnStep::seq`), stepped layer by layer across the rows as a ragged batch would be.
fn drive(p: &mut dyn KvPolicy, c: &Case, per_seq: bool) -> Result<Vec<Tensor>, TestCaseError> {
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
        let plan = if per_seq {
            let loads: Vec<SeqLoad> = (0..b)
                .map(|seq| SeqLoad {
                    seq,
                    cached: pos,
                    new: t,
                })
                .collect();
            match p.as_batched() {
                Some(batched) => batched.plan(&loads).map_err(|e| fail(&e))?,
                None => vec![(0..b).collect()],
            }
        } else {
            Vec::new()
        };
        for layer in 0..c.layers {
            let salt = c.seed ^ ((i as u64) << 20) ^ ((layer as u64) << 40);
            let q = tensor(&[b, spec.n_heads, t, d], salt ^ 1, &dev).map_err(|e| fail(&e))?;
            let x = tensor(&[b, t, 2 * nkv * d], salt ^ 2, &dev).map_err(|e| fail(&e))?;
            let (k, v) = regen.regen(&x, pos).map_err(|e| fail(&e))?;
            let rows: Vec<(usize, usize)> = if per_seq {
                // In the policy's mini-batch order, as a model runs a ragged batch.
                plan.iter().flatten().map(|&r| (r, 1)).collect()
            } else {
                vec![(0, b)]
            };
            let mut parts = Vec::new();
            for (r, n) in rows {
                let row = |t: &Tensor| t.narrow(0, r, n).map_err(|e| fail(&e));
                let out = p
                    .attend(&AttnStep {
                        seq: r,
                        layer,
                        q: &row(&q)?,
                        k: &row(&k)?,
                        v: &row(&v)?,
                        x: &row(&x)?,
                        pos,
                        spec: &spec,
                        regen: &regen,
                    })
                    .map_err(|e| fail(&e))?;
                parts.push((r, out));
            }
            // Back in row order for the comparison.
            parts.sort_by_key(|(r, _)| *r);
            let parts: Vec<Tensor> = parts.into_iter().map(|(_, t)| t).collect();
            outs.push(Tensor::cat(&parts, 0).map_err(|e| fail(&e))?);
        }
        pos += t;
    }
    Ok(outs)
}

/// Every policy variant against `full` on case `c`.
fn check(c: &Case) -> Result<(), TestCaseError> {
    let opts = |f: &dyn Fn(&mut PolicyOptions)| {
        let mut o = PolicyOptions {
            grow_tokens: c.grow,
            ..PolicyOptions::default()
        };
        f(&mut o);
        o
    };
    let mut full =
        build_policy("full", &opts(&|_| {})).map_err(|e| TestCaseError::fail(e.to_string()))?;
    let want = drive(full.as_mut(), c, false)?;
    let total: usize = c.chunks.iter().sum();
    // hybrid: a budget of two staging units of the whole run plus `act_slots` blocks.
    let kv_row = (2 * c.n_kv * c.head_dim * 4) as u64;
    // A block never holds more than the run's tokens (hybrid bounds --block-size by them).
    let act_slot = (c.layers * c.block.min(total) * 2 * c.n_kv * c.head_dim * 4) as u64;
    // Plus a step's attention scratch, planned as the policy plans it (one pass over the
    // whole run: no step size is given).
    let shape = kvpolicy::KvShape {
        n_layers: c.layers,
        n_heads: c.n_kv * c.group,
        n_kv_heads: c.n_kv,
        head_dim: c.head_dim,
        hidden: 2 * c.n_kv * c.head_dim,
        batch: c.batch,
        dtype: candle_core::DType::F32,
        max_tokens: total,
        step_tokens: 0,
        activation_bytes_per_token: 0,
        windows: Vec::new(),
        readers: Vec::new(),
    };
    let scratch = shape.step_scratch_bytes(c.n_kv, total, &candle_core::Device::Cpu);
    let budget = c
        .act_slots
        .map(|n| 2 * total as u64 * kv_row + n * act_slot + scratch);
    let hybrid_spec = match c.share {
        Some(r) => format!("hybrid:block_size={},kv_act_ratio={r}", c.block),
        None => format!("hybrid:block_size={}", c.block),
    };
    let hybrid = opts(&|o| {
        o.device_kv_budget = budget;
        o.profile = Some(kvpolicy::Profile {
            h2d_bytes_per_s: 1e9,
            recompute_tokens_per_s: 1e6,
            device: None,
            shape: None,
        });
    });
    // auto: the streaming buffers of a whole layer at the run's capacity and a step's
    // scratch over it, plus room for a random number of whole-layer units (0 to all).
    // Without `prepare` it plans for the first chunk's capacity, so growth later demotes.
    let cap = total.div_ceil(c.grow) * c.grow;
    let unit = shape.kv_bytes(c.n_kv, cap);
    let reserve = shape.step_scratch_bytes(c.n_kv, cap, &candle_core::Device::Cpu);
    let auto_budget = 2 * unit + reserve + (c.seed % (c.layers as u64 + 1)) * unit;
    // The disk tier: room in RAM for a random number of whole layers (0 to all), the rest
    // in files that must be gone after a reset.
    let disk = tempfile::tempdir().map_err(|e| TestCaseError::fail(e.to_string()))?;
    let host_layer = shape.kv_bytes(c.n_kv, total.div_ceil(8 * c.grow) * 8 * c.grow);
    let host_budget = (c.seed / 7 % (c.layers as u64 + 1)) * host_layer;
    let on_disk = |o: &mut PolicyOptions| {
        o.disk_dir = Some(disk.path().to_path_buf());
        o.host_kv_budget = Some(host_budget);
    };
    let headwise = format!("headwise:group={}", c.head_group);
    let split = format!("recompute:split={}", c.split.min(total));
    let variants: Vec<(&str, PolicyOptions)> = vec![
        ("auto", opts(&|_| {})),
        (&headwise, opts(&|o| on_disk(o))),
        (
            "auto",
            opts(&|o| {
                o.device_kv_budget = Some(auto_budget);
                on_disk(o);
            }),
        ),
        ("auto", opts(&|o| o.device_kv_budget = Some(auto_budget))),
        (&hybrid_spec, hybrid),
        ("layer", opts(&|_| {})),
        (&headwise, opts(&|_| {})),
        ("headwise:group=auto", opts(&|_| {})),
        (&split, opts(&|_| {})),
        ("recompute", opts(&|_| {})),
    ];
    for (name, o) in variants {
        let mut built = build_policy(name, &o).map_err(|e| TestCaseError::fail(e.to_string()))?;
        // Every call checked against KvPolicy's call protocol.
        let mut p = kvpolicy::core::Checked::new(built.as_mut());
        let per_seq = p.as_batched().is_some();
        if per_seq {
            p.prepare(&shape)
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
        }
        let got = drive(&mut p, c, per_seq)
            .map_err(|e| TestCaseError::fail(format!("{name} {:?}: {e}", o.device_kv_budget)))?;
        if name == "auto" {
            let st = p.stats();
            let budget = o.device_kv_budget.unwrap_or(u64::MAX);
            prop_assert!(
                st.device_kv_peak_bytes <= budget,
                "auto: device KV peak {} > budget {budget}",
                st.device_kv_peak_bytes
            );
            if o.device_kv_budget.is_none() {
                // No budget: everything resident, nothing moves.
                prop_assert_eq!(
                    (
                        common::metric(&st, "streamed_units"),
                        st.h2d_bytes,
                        st.d2h_bytes
                    ),
                    (0, 0, 0)
                );
            }
        }
        if let (true, Some(n)) = (per_seq, c.act_slots) {
            let st = p.stats();
            prop_assert!(
                common::metric(&st, "device_blocks") <= n,
                "{} resident blocks > {}",
                common::metric(&st, "device_blocks"),
                n
            );
            prop_assert!(st.device_kv_peak_bytes <= budget.unwrap_or(u64::MAX));
        }
        if o.disk_dir.is_some() {
            p.reset();
            let left = common::unnamed_files("self", disk.path())
                .map_err(|e| TestCaseError::fail(e.to_string()))?
                .len()
                + std::fs::read_dir(disk.path())
                    .map_err(|e| TestCaseError::fail(e.to_string()))?
                    .count();
            prop_assert_eq!(left, 0, "{} left disk-tier files after reset", name);
        }
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let d = (g - w)
                .and_then(|t| t.abs())
                .and_then(|t| t.flatten_all())
                .and_then(|t| t.max(0))
                .and_then(|t| t.to_scalar::<f32>())
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert!(
                d <= 1e-5,
                "{} {:?}: output {} differs by {}",
                name,
                o.device_kv_budget,
                i,
                d
            );
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn every_policy_equals_full(c in case()) {
        check(&c)?;
    }
}

/// Cases proptest shrank failures to, kept as they were found.
#[test]
fn shrunk_failures() -> Result<(), TestCaseError> {
    let base = Case {
        n_kv: 1,
        group: 1,
        head_dim: 2,
        layers: 1,
        batch: 1,
        window: None,
        chunks: vec![1, 1, 1, 1],
        head_group: 1,
        split: 0,
        grow: 1,
        block: 1,
        share: None,
        act_slots: None,
        seed: 0,
    };
    // hybrid, one layer: the next step's layer-0 prefetch ran before the step wrote its
    // own tokens there.
    check(&base)?;
    // hybrid, three layers, two sequences, all-ACT: staging went past the device budget.
    check(&Case {
        layers: 3,
        batch: 2,
        chunks: vec![5, 5, 2, 6, 2, 1, 1, 1, 1],
        block: 16,
        share: Some(0.0),
        act_slots: Some(0),
        ..base.clone()
    })?;
    check(&Case {
        layers: 3,
        batch: 2,
        chunks: vec![5, 1, 7, 1, 4, 1, 1, 1],
        block: 5,
        share: Some(0.0),
        act_slots: Some(1),
        ..base.clone()
    })?;
    // auto under a budget over the disk tier, a window of 9: a demoted resident unit wrote
    // its history past a gap in the tier ("a disk write of tokens 7..8 would leave a gap").
    check(&Case {
        n_kv: 4,
        head_dim: 8,
        layers: 2,
        window: Some(9),
        chunks: vec![6, 5, 4, 5, 1, 1, 1],
        seed: 4458955066769276610,
        ..base
    })
}

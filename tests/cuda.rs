//! GPU tests (feature `cuda`; they need a CUDA device and fail without one): the CUDA
//! transfer engine's copies against `slice_set`, its page-locked host tier, and every policy
//! on the GPU against `full` on the fixtures (on the GPU in f32 and bf16, and on the CPU);
//! the zero-copy page gather (CLO §4) against the copy engine — the same bytes, and each
//! one's bandwidth on the same pages printed (`scripts/gpu_run.sh` records it); the
//! approximate policies on the GPU against the same on the CPU; with feature `nccl`, a
//! one-rank NCCL group's all-gather and sum on GPU memory, and `helix` over it against `full`.
//!
//! Built without the feature (CI's CPU run) this file is empty. On a GPU machine:
//! `cargo test --release --features nccl --test cuda` (`nccl` is `cuda` and the NCCL test;
//! or build it with `--no-run` here and run the binary there; docs/gpu.md).
#![cfg(feature = "cuda")]
mod common;

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};
use kvpolicy::models::{load, resolve, ModelSpec};
use kvpolicy::tiered::{engine_for, CopyJob, MappedGather, TransferEngine};
use kvpolicy::{build_policy, AttnSpec, AttnStep, HeadGroup, KvPolicy, NoRegen, PolicyOptions};

fn gpu() -> Result<Device> {
    Device::new_cuda(0).context("these tests need a CUDA GPU (feature `cuda` is on)")
}

fn copy(
    eng: &mut dyn TransferEngine,
    src: &Tensor,
    dst: &Tensor,
    dim: usize,
    offset: usize,
) -> Result<()> {
    let t = eng.submit(vec![CopyJob {
        src: src.clone(),
        dst: dst.clone(),
        dim,
        offset,
    }])?;
    eng.wait(t)?;
    Ok(())
}

#[test]
fn engine_copies_equal_slice_set() -> Result<()> {
    let dev = gpu()?;
    let mut eng = engine_for(&dev, None)?;
    // A host-tier buffer of 2 MiB is page-locked; handing it back unlocks it.
    let host = eng.host_zeros((2, 4, 256, 128).into(), DType::F32)?;
    assert_eq!(eng.pinned_bytes(), 2 * 4 * 256 * 128 * 4);
    let n = host.elem_count();
    let values = Tensor::arange(0f32, n as f32, &Device::Cpu)?.reshape(host.dims())?;
    host.slice_set(&values, 0, 0)?;

    // Host → device: one head's token range into a device buffer at an offset.
    let dbuf = Tensor::zeros((1, 1, 64, 128), DType::F32, &dev)?;
    let src = host.narrow(0, 1, 1)?.narrow(1, 2, 1)?.narrow(2, 10, 40)?;
    copy(eng.as_mut(), &src, &dbuf, 2, 5)?;
    let want = Tensor::zeros((1, 1, 64, 128), DType::F32, &Device::Cpu)?;
    want.slice_set(&src.contiguous()?, 2, 5)?;
    assert_eq!(
        common::max_abs_diff(&dbuf.to_device(&Device::Cpu)?, &want)?,
        0.0
    );

    // Device → host: new rows written back behind a compute result.
    let rows = (Tensor::ones((1, 1, 3, 128), DType::F32, &dev)? * 7.0)?;
    let head = host.narrow(0, 0, 1)?.narrow(1, 3, 1)?;
    copy(eng.as_mut(), &rows, &head, 2, 100)?;
    eng.wait_all()?;
    let back = head.narrow(2, 100, 3)?;
    assert_eq!(back.flatten_all()?.min(0)?.to_scalar::<f32>()?, 7.0);
    assert_eq!(back.flatten_all()?.max(0)?.to_scalar::<f32>()?, 7.0);

    // Device → device, and a view too scattered for runs (falls back to a gathering copy).
    let ddst = Tensor::zeros((1, 1, 64, 128), DType::F32, &dev)?;
    copy(eng.as_mut(), &dbuf.narrow(2, 5, 40)?, &ddst, 2, 0)?;
    assert_eq!(
        common::max_abs_diff(&ddst.narrow(2, 0, 40)?, &dbuf.narrow(2, 5, 40)?)?,
        0.0
    );
    let tall = Tensor::arange(0f32, 2.0 * 5000.0, &Device::Cpu)?.reshape((5000, 2))?;
    let wide = Tensor::zeros((2, 5000), DType::F32, &dev)?;
    copy(eng.as_mut(), &tall.t()?, &wide, 0, 0)?;
    assert_eq!(
        common::max_abs_diff(&wide.to_device(&Device::Cpu)?, &tall.t()?)?,
        0.0
    );

    eng.host_release(&host)?;
    assert_eq!(eng.pinned_bytes(), 0);
    Ok(())
}

#[test]
fn every_policy_on_the_gpu_equals_full() -> Result<()> {
    let dev = gpu()?;
    let opts = PolicyOptions {
        device: dev.clone(),
        grow_tokens: 4,
        ..PolicyOptions::default()
    };
    for name in common::hf_fixtures() {
        let files = resolve(&ModelSpec::Dir(common::fixture(&name)))?;
        let (prompt, decode) = common::fixture_ids(&name)?;
        // The CPU's `full` in f32: cuBLAS and the CPU gemm sum in different orders, so the
        // GPU may differ by f32 rounding, nothing more.
        let cpu = common::load_fixture(&name)?;
        let mut cpu_full = build_policy("full", &PolicyOptions::default())?;
        let on_cpu = common::teacher_forced_logits(
            cpu.model.as_ref(),
            cpu_full.as_mut(),
            &prompt,
            &decode,
            5,
        )?;
        // bf16: the tolerance scripts/policy_exactness.py uses, twice bf16 `full`'s own
        // distance e from the f32 logits: a per-head-group or regenerated matmul rounds in
        // another order, a second bf16 computation as far from f32 as `full` is (H200:
        // headwise on llama_gqa 0.078; a lost copy is off by far more).
        let mut f32_logits = None;
        for dtype in [DType::F32, DType::BF16] {
            let loaded = load(&files, &dev, dtype, None)?;
            let model = loaded.model.as_ref();
            let mut full = build_policy("full", &opts)?;
            let want = common::teacher_forced_logits(model, full.as_mut(), &prompt, &decode, 5)?;
            let tol = match &f32_logits {
                None => 1e-4f32,
                Some(f) => 2.0 * common::max_abs_diff(&want, f)?,
            };
            if dtype == DType::F32 {
                f32_logits = Some(want.clone());
            }
            for policy in ["full", "layer", "headwise", "recompute", "hybrid"] {
                let mut p = build_policy(&common::spec(policy, HeadGroup::Fixed(1)), &opts)?;
                let got = common::teacher_forced_logits(model, p.as_mut(), &prompt, &decode, 5)?;
                let d = common::max_abs_diff(&got, &want)?;
                assert!(d <= tol, "{name} {dtype:?} {policy}: max |Δ| = {d}");
                if dtype == DType::F32 {
                    let d = common::max_abs_diff(&got, &on_cpu)?;
                    assert!(d <= 1e-3, "{name} {policy} GPU vs CPU full: max |Δ| = {d}");
                }
                if !matches!(policy, "full" | "hybrid") {
                    let s = p.stats();
                    assert!(s.h2d_bytes > 0, "{name} {policy}: nothing crossed the link");
                }
            }
        }
    }
    Ok(())
}

#[test]
fn zero_copy_gathers_what_the_copy_engine_copies() -> Result<()> {
    let dev = gpu()?;
    let mut eng = engine_for(&dev, None)?;
    // A host tier of 4 heads × 65,536 tokens × 128 f32 (128 MiB), page-locked and mapped.
    let (nkv, cap, d, page) = (4usize, 65_536usize, 128usize, 16usize);
    let host = eng.host_zeros((1, nkv, cap, d).into(), DType::F32)?;
    host.slice_set(
        &Tensor::randn(0f32, 1.0, (1, nkv, cap, d), &Device::Cpu)?,
        2,
        0,
    )?;
    let page_bytes = page * d * 4;
    // 2,048 scattered pages of head 2 (32 MiB), as a selection would pick them.
    let pages: Vec<usize> = (0..2048).map(|i| (i * 7919) % (cap / page)).collect();
    let n = pages.len();
    let src_offsets: Vec<u64> = pages
        .iter()
        .map(|p| ((2 * cap + p * page) * d * 4) as u64)
        .collect();
    let dst_offsets: Vec<u64> = (0..n).map(|i| (i * page_bytes) as u64).collect();
    let zc = Tensor::zeros((1, 1, n * page, d), DType::F32, &dev)?;
    let g = MappedGather {
        src: &host,
        dst: &zc,
        src_offsets,
        dst_offsets,
        page_bytes,
    };
    anyhow::ensure!(
        eng.gather_mapped(&g)?,
        "the host tier is not mapped into the device"
    );
    dev.synchronize()?;
    // The copy engine's copies of the same pages.
    let ce = Tensor::zeros((1, 1, n * page, d), DType::F32, &dev)?;
    let jobs: Vec<CopyJob> = pages
        .iter()
        .enumerate()
        .map(|(i, &p)| -> Result<CopyJob> {
            Ok(CopyJob {
                src: host.narrow(1, 2, 1)?.narrow(2, p * page, page)?,
                dst: ce.clone(),
                dim: 2,
                offset: i * page,
            })
        })
        .collect::<Result<_>>()?;
    let t = eng.submit(jobs.clone())?;
    eng.wait(t)?;
    dev.synchronize()?;
    let want = Tensor::cat(
        &pages
            .iter()
            .map(|&p| host.narrow(1, 2, 1)?.narrow(2, p * page, page))
            .collect::<candle_core::Result<Vec<_>>>()?,
        2,
    )?;
    for got in [&zc, &ce] {
        let d = common::max_abs_diff(&got.to_device(&Device::Cpu)?, &want)?;
        anyhow::ensure!(d == 0.0, "gathered pages differ by {d}");
    }
    // Bandwidth on the same pages, each the best of 5 (printed; gpu_run.sh records it).
    let bytes = g.bytes() as f64;
    let time = |f: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
        let mut best = f64::MAX;
        for _ in 0..5 {
            dev.synchronize()?;
            let t0 = std::time::Instant::now();
            f()?;
            dev.synchronize()?;
            best = best.min(t0.elapsed().as_secs_f64());
        }
        Ok(best)
    };
    let zero_copy = time(&mut || {
        eng.gather_mapped(&g)?;
        Ok(())
    })?;
    let copies = time(&mut || {
        let t = eng.submit(jobs.clone())?;
        eng.wait(t)?;
        Ok(())
    })?;
    println!(
        "zero-copy bandwidth: {n} pages of {page_bytes} B: zero-copy kernel {:.2} GB/s, copy engine {:.2} GB/s",
        bytes / zero_copy / 1e9,
        bytes / copies / 1e9
    );
    Ok(())
}

/// Random steps (chunked prefill, then decode) through `policy`; every output on the CPU.
fn drive_sparse(policy: &mut dyn KvPolicy, dev: &Device) -> Result<Vec<Tensor>> {
    let mut spec = AttnSpec::new(8, 2, 64);
    let mut outs = Vec::new();
    let mut pos = 0;
    let mut chunks = vec![300, 300];
    chunks.extend(std::iter::repeat_n(1, 24));
    for (i, &t) in chunks.iter().enumerate() {
        for layer in 0..2 {
            spec.sliding_window = (layer == 1).then_some(64);
            let r = |h: usize, salt: u64| -> Result<Tensor> {
                let seed = (i as u64) * 1000 + layer as u64 * 10 + salt;
                let n = h * t * 64;
                let v: Vec<f32> = (0..n)
                    .map(|j| {
                        (((j as u64 + 1) * 2654435761 + seed * 40503) % 10007) as f32 / 5003.0 - 1.0
                    })
                    .collect();
                Ok(Tensor::from_vec(v, (1, h, t, 64), dev)?)
            };
            let (q, k, v) = (r(8, 1)?, r(2, 2)?, r(2, 3)?);
            let x = Tensor::zeros((1, t, 8), DType::F32, dev)?;
            let step = AttnStep {
                seq: 0,
                layer,
                q: &q,
                k: &k,
                v: &v,
                x: &x,
                pos,
                spec: &spec,
                regen: &NoRegen,
            };
            outs.push(policy.attend(&step)?.to_device(&Device::Cpu)?);
        }
        pos += t;
    }
    Ok(outs)
}

#[test]
fn approximate_policies_on_the_gpu_equal_the_cpu_and_zero_copy_equals_copies() -> Result<()> {
    let dev = gpu()?;
    let gpu_opts = PolicyOptions {
        device: dev.clone(),
        ..PolicyOptions::default()
    };
    for spec in [
        "quest:budget=64",
        "flexicache:budget=64,rerank=4",
        "clo:budget=64,zero_copy=false",
        "clo:budget=64,zero_copy=true",
    ] {
        let mut on_cpu = build_policy(spec, &PolicyOptions::default())?;
        let want = drive_sparse(on_cpu.as_mut(), &Device::Cpu)?;
        let mut on_gpu = build_policy(spec, &gpu_opts)?;
        let got = drive_sparse(on_gpu.as_mut(), &dev)?;
        for (a, b) in want.iter().zip(&got) {
            let d = common::max_abs_diff(a, b)?;
            anyhow::ensure!(d <= 1e-3, "{spec}: GPU vs CPU max |Δ| = {d}");
        }
        let (c, g) = (on_cpu.stats(), on_gpu.stats());
        anyhow::ensure!(
            c.h2d_bytes == g.h2d_bytes,
            "{spec}: {} vs {} bytes",
            c.h2d_bytes,
            g.h2d_bytes
        );
    }
    Ok(())
}

/// One rank's NCCL group (NCCL needs a GPU per rank, so one GPU holds one rank): its
/// all-gather and sum return the rank's own tensor, from GPU memory (a non-contiguous input
/// too), and `helix:local=headwise:1` over it equals `full` on every fixture.
#[cfg(feature = "nccl")]
#[test]
fn nccl_group_of_one_gathers_sums_and_carries_helix() -> Result<()> {
    use kvpolicy::helix::nccl_world::NcclWorld;
    use kvpolicy::helix::{Collective, HelixPolicy, Solo};
    use std::sync::Arc;

    let dev = gpu()?;
    let world = Arc::new(NcclWorld::new(Solo));
    let t = Tensor::arange(0f32, 24., &dev)?.reshape((2, 3, 4))?;
    let odd = t.transpose(1, 2)?;
    let gathered = world.all_gather(&odd)?;
    assert!(gathered.device().is_cuda(), "the all-gather left the GPU");
    assert_eq!(gathered.dims(), &[1, 2, 4, 3]);
    let d = (gathered.squeeze(0)? - &odd)?
        .abs()?
        .max_all()?
        .to_scalar::<f32>()?;
    assert_eq!(d, 0.0, "a rank's all-gather of itself changed it");
    let summed = world.all_reduce_sum(&t)?;
    let d = (summed - &t)?.abs()?.max_all()?.to_scalar::<f32>()?;
    assert_eq!(d, 0.0, "a rank's sum of itself changed it");
    assert!(world.group().is_some(), "no NCCL group was founded");

    let opts = PolicyOptions {
        device: dev.clone(),
        grow_tokens: 4,
        ..PolicyOptions::default()
    };
    for name in common::hf_fixtures() {
        let files = resolve(&ModelSpec::Dir(common::fixture(&name)))?;
        let (prompt, decode) = common::fixture_ids(&name)?;
        let loaded = load(&files, &dev, DType::F32, None)?;
        let model = loaded.model.as_ref();
        let mut full = build_policy("full", &opts)?;
        let want = common::teacher_forced_logits(model, full.as_mut(), &prompt, &decode, 5)?;
        let local = build_policy(&common::spec("headwise", HeadGroup::Fixed(1)), &opts)?;
        let mut helix = HelixPolicy::new(local, world.clone())?;
        let got = common::teacher_forced_logits(model, &mut helix, &prompt, &decode, 5)?;
        let d = common::max_abs_diff(&got, &want)?;
        // f32 on the GPU: the merge of partial softmaxes sums in another order than `full`'s
        // attention (H200: 1.2e-5 on mlkv_llama), as every GPU f32 comparison here, 1e-4.
        assert!(d <= 1e-4, "{name} helix over NCCL: max |Δ| = {d}");
        assert!(
            helix.counters().decode_calls > 0,
            "{name}: no decode collective ran"
        );
    }
    Ok(())
}

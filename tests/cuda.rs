//! GPU tests (feature `cuda`; they need a CUDA device and fail without one): the CUDA
//! transfer engine's copies against `slice_set`, its page-locked host tier, and every policy
//! on the GPU against `full` on the fixtures (on the GPU in f32 and bf16, and on the CPU).
//!
//! Built without the feature (CI's CPU run) this file is empty. On a GPU machine:
//! `cargo test --release --features cuda --test cuda` (or build it with `--no-run` here and
//! run the binary there; README, "GPU").
#![cfg(feature = "cuda")]
mod common;

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};
use kvpolicy::models::{load, resolve, ModelSpec};
use kvpolicy::tiered::{engine_for, CopyJob, TransferEngine};
use kvpolicy::{build_policy, HeadGroup, PolicyOptions};

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
        // bf16: the same tolerance as scripts/policy_exactness.py (a regenerated or
        // per-head-group matmul may round differently; a lost copy is off by far more).
        for (dtype, tol) in [(DType::F32, 1e-4f32), (DType::BF16, 2e-2)] {
            let loaded = load(&files, &dev, dtype, None)?;
            let model = loaded.model.as_ref();
            let mut full = build_policy("full", &opts)?;
            let want = common::teacher_forced_logits(model, full.as_mut(), &prompt, &decode, 5)?;
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

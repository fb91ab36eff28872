//! Launches `cuda/heads_into.cu` on candle's CUDA stream (feature `cuda`).
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{CudaStorage, DType, Result};

use crate::heads_layout::{Geometry, Rotation};

use crate::ptx;

fn launch<T: CudaDType + DeviceRepr>(
    g: &Geometry,
    rotation: Rotation,
    dst: &mut CudaStorage,
    rows: &CudaStorage,
    trig: &CudaStorage,
    suffix: &str,
) -> Result<()> {
    let dev = dst.device.clone();
    let func = dev.get_or_load_custom_func(
        &format!("heads_into_{suffix}"),
        "kvpolicy_heads_into",
        ptx::HEADS_INTO,
    )?;
    let rows = rows.as_cuda_slice::<T>()?.slice(g.rows_offset..);
    let trig = trig.as_cuda_slice::<T>()?.slice(g.trig_offset..);
    let mut out = dst.as_cuda_slice_mut::<T>()?.slice_mut(g.dst_offset..);
    let n = g.b * g.t * g.heads * g.d;
    let cfg = LaunchConfig::for_num_elems(n.min(u32::MAX as usize) as u32);
    let [s0, s1, s2, s3] = g.dst_strides;
    let sizes = [g.b, g.t, g.heads, g.d, s0, s1, s2, s3];
    let code = rotation.code();
    let mut b = func.builder();
    b.arg(&rows);
    b.arg(&trig);
    b.arg(&mut out);
    for s in &sizes {
        b.arg(s);
    }
    b.arg(&code);
    // SAFETY: the kernel reads `n` rows values and writes `n` destination elements whose
    // offsets the layout checks in `Geometry` bound; the arguments match its signature.
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
}

/// Runs the kernel for the dtype of `dst`.
pub(crate) fn heads_into(
    g: &Geometry,
    rotation: Rotation,
    dst: &mut CudaStorage,
    rows: &CudaStorage,
    trig: &CudaStorage,
) -> Result<()> {
    match dst.dtype() {
        DType::F32 => launch::<f32>(g, rotation, dst, rows, trig, "f32"),
        DType::F16 => launch::<half::f16>(g, rotation, dst, rows, trig, "f16"),
        DType::BF16 => launch::<half::bf16>(g, rotation, dst, rows, trig, "bf16"),
        other => Err(candle_core::Error::Msg(format!(
            "heads_into: {other:?} is not supported; use f32, f16 or bf16"
        ))),
    }
}

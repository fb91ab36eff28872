//! [`HeadsInto`]: projected rows `(b, t, heads·head_dim)` written as heads
//! `(b, heads, t, head_dim)` into a strided destination — a token range of a device K/V
//! buffer — with RoPE applied on the way (KVPR §3.1: regenerated K must carry the
//! positional encoding of its original positions). One pass, no intermediate tensors.
//!
//! `cpu_fwd` is the reference: plain loops over the layouts, arithmetic in f32. The CUDA
//! kernel (`cuda/heads_into.cu`) does the same per element.
use candle_core::{CpuStorage, InplaceOp3, Layout, Result, Tensor};

use crate::heads_layout::Geometry;
pub use crate::heads_layout::Rotation;

/// The in-place op: `dst.inplace_op3(&rows, &trig, &HeadsInto { .. })`. `dst` is
/// `(b, heads, t, head_dim)` with any strides (a narrow of a larger buffer); `rows` is
/// contiguous `(b, t, heads·head_dim)`; `trig` is contiguous `(t, head_dim)`: cos in its
/// first half, sin in its second (ignored when `rotation` is [`Rotation::None`]). All share
/// one dtype (f32, f16 or bf16).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeadsInto {
    /// Heads in a row.
    pub heads: usize,
    /// Values per head.
    pub head_dim: usize,
    /// The positional rotation to apply.
    pub rotation: Rotation,
}

/// Writes `rows` into `dst` as heads, rotated by `cos`/`sin` when given (see [`HeadsInto`]).
pub fn heads_into(
    dst: &Tensor,
    rows: &Tensor,
    rope: Option<(&Tensor, &Tensor, Rotation)>,
) -> Result<()> {
    let (_, heads, _, head_dim) = dst.dims4()?;
    let (trig, rotation) = match rope {
        Some((c, s, r)) => (Tensor::cat(&[c, s], 1)?.contiguous()?, r),
        None => (rows.clone(), Rotation::None),
    };
    dst.inplace_op3(
        rows,
        &trig,
        &HeadsInto {
            heads,
            head_dim,
            rotation,
        },
    )
}

impl HeadsInto {
    pub(crate) fn geometry(&self, dst: &Layout, rows: &Layout, trig: &Layout) -> Result<Geometry> {
        let bad = |m: String| candle_core::Error::Msg(format!("heads_into: {m}"));
        let (b, heads, t, d) = dst.shape().dims4()?;
        if (heads, d) != (self.heads, self.head_dim) {
            return Err(bad(format!(
                "destination {:?} does not have {} heads of {}",
                dst.dims(),
                self.heads,
                self.head_dim
            )));
        }
        if rows.dims() != [b, t, heads * d] || !rows.is_contiguous() {
            return Err(bad(format!(
                "rows {:?} are not contiguous ({b}, {t}, {})",
                rows.dims(),
                heads * d
            )));
        }
        if self.rotation != Rotation::None {
            if d % 2 != 0 {
                return Err(bad(format!("RoPE needs an even head width, not {d}")));
            }
            if trig.dims() != [t, d] || !trig.is_contiguous() {
                return Err(bad(format!(
                    "the cos|sin table {:?} is not contiguous ({t}, {d})",
                    trig.dims()
                )));
            }
        }
        let s = dst.stride();
        Ok(Geometry {
            b,
            t,
            heads,
            d,
            rows_offset: rows.start_offset(),
            trig_offset: trig.start_offset(),
            dst_offset: dst.start_offset(),
            dst_strides: [s[0], s[1], s[2], s[3]],
        })
    }
}

/// Element types the reference handles, computed in f32.
trait Elem: Copy {
    fn f(self) -> f32;
    fn of(v: f32) -> Self;
}

impl Elem for f32 {
    fn f(self) -> f32 {
        self
    }
    fn of(v: f32) -> Self {
        v
    }
}

impl Elem for half::f16 {
    fn f(self) -> f32 {
        self.to_f32()
    }
    fn of(v: f32) -> Self {
        half::f16::from_f32(v)
    }
}

impl Elem for half::bf16 {
    fn f(self) -> f32 {
        self.to_f32()
    }
    fn of(v: f32) -> Self {
        half::bf16::from_f32(v)
    }
}

fn reference<T: Elem>(
    g: &Geometry,
    rotation: Rotation,
    dst: &mut [T],
    rows: &[T],
    trig: &[T],
) -> Result<()> {
    let half = g.d / 2;
    let at = |v: &[T], i: usize| -> Result<f32> {
        v.get(i)
            .map(|x| x.f())
            .ok_or_else(|| candle_core::Error::Msg(format!("heads_into: index {i} out of range")))
    };
    for bi in 0..g.b {
        for ti in 0..g.t {
            for hi in 0..g.heads {
                let src = g.rows_offset + (bi * g.t + ti) * g.heads * g.d + hi * g.d;
                let [s0, s1, s2, s3] = g.dst_strides;
                let out = g.dst_offset + bi * s0 + hi * s1 + ti * s2;
                for i in 0..g.d {
                    let v = match rotation {
                        Rotation::None => at(rows, src + i)?,
                        Rotation::Half | Rotation::Interleaved => {
                            let (j, first) = match rotation {
                                Rotation::Half => (i % half, i < half),
                                _ => (i / 2, i % 2 == 0),
                            };
                            let (a, b) = match rotation {
                                Rotation::Half => (src + j, src + j + half),
                                _ => (src + 2 * j, src + 2 * j + 1),
                            };
                            let c = at(trig, g.trig_offset + ti * g.d + j)?;
                            let s = at(trig, g.trig_offset + ti * g.d + half + j)?;
                            let (x1, x2) = (at(rows, a)?, at(rows, b)?);
                            if first {
                                x1 * c - x2 * s
                            } else {
                                x1 * s + x2 * c
                            }
                        }
                    };
                    let slot = dst.get_mut(out + i * s3).ok_or_else(|| {
                        candle_core::Error::Msg("heads_into: destination out of range".into())
                    })?;
                    *slot = T::of(v);
                }
            }
        }
    }
    Ok(())
}

impl InplaceOp3 for HeadsInto {
    fn name(&self) -> &'static str {
        "heads-into"
    }

    fn cpu_fwd(
        &self,
        dst: &mut CpuStorage,
        dst_l: &Layout,
        rows: &CpuStorage,
        rows_l: &Layout,
        trig: &CpuStorage,
        trig_l: &Layout,
    ) -> Result<()> {
        let g = self.geometry(dst_l, rows_l, trig_l)?;
        match (dst, rows, trig) {
            (CpuStorage::F32(d), CpuStorage::F32(r), CpuStorage::F32(t)) => {
                reference(&g, self.rotation, d, r, t)
            }
            (CpuStorage::F16(d), CpuStorage::F16(r), CpuStorage::F16(t)) => {
                reference(&g, self.rotation, d, r, t)
            }
            (CpuStorage::BF16(d), CpuStorage::BF16(r), CpuStorage::BF16(t)) => {
                reference(&g, self.rotation, d, r, t)
            }
            _ => Err(candle_core::Error::Msg(
                "heads_into: the destination, rows and table must all be f32, f16 or bf16".into(),
            )),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        dst: &mut candle_core::CudaStorage,
        dst_l: &Layout,
        rows: &candle_core::CudaStorage,
        rows_l: &Layout,
        trig: &candle_core::CudaStorage,
        trig_l: &Layout,
    ) -> Result<()> {
        let g = self.geometry(dst_l, rows_l, trig_l)?;
        crate::cuda::heads_into(&g, self.rotation, dst, rows, trig)
    }
}

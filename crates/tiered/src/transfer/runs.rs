//! A copy between two strided views as contiguous byte runs.
//!
//! An asynchronous copy engine (the CUDA one: `cuMemcpy*Async` on a copy stream, HeadInfer
//! §3.2 / KVPR §3.3 overlap) moves contiguous byte ranges, while a [`CopyJob`](super::CopyJob) names
//! strided views. [`copy_runs`] pairs the two views' element blocks in logical order and
//! returns the byte runs to copy, merged where both sides continue contiguously. The
//! policies' jobs are one run each (one KV head's token range, one block of rows); views too
//! scattered to be worth it get `None`, and the engine falls back to a gathering copy.
use candle_core::Layout;

/// One contiguous piece of a copy: `len` bytes from byte `src` of the source storage to
/// byte `dst` of the destination storage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    /// Byte offset in the source storage.
    pub src: usize,
    /// Byte offset in the destination storage.
    pub dst: usize,
    /// Bytes to copy.
    pub len: usize,
}

/// The most runs one copy is split into; past this, gathering first is cheaper than
/// issuing that many small copies.
pub const MAX_RUNS: usize = 4096;

/// The element blocks `(start, len)` of a view in logical order: the longest contiguous
/// suffix of its dims is one block, the leading dims are walked in order. `None` past
/// [`MAX_RUNS`] blocks.
fn blocks(layout: &Layout) -> Option<Vec<(usize, usize)>> {
    let (dims, stride) = (layout.dims(), layout.stride());
    let mut block_len = 1;
    let mut lead = dims.len();
    while lead > 0 && (dims[lead - 1] == 1 || stride[lead - 1] == block_len) {
        block_len *= dims[lead - 1];
        lead -= 1;
    }
    let count: usize = dims[..lead].iter().product();
    if count > MAX_RUNS {
        return None;
    }
    let mut out = Vec::with_capacity(count);
    let mut index = vec![0usize; lead];
    for _ in 0..count {
        let start: usize = index.iter().zip(stride).map(|(i, s)| i * s).sum();
        out.push((layout.start_offset() + start, block_len));
        for d in (0..lead).rev() {
            index[d] += 1;
            if index[d] < dims[d] {
                break;
            }
            index[d] = 0;
        }
    }
    Some(out)
}

/// The byte runs copying the view `src` onto the view `dst` (same element count, elements
/// of `elem` bytes, both in logical row-major order); `None` when the views have different
/// sizes or would need more than [`MAX_RUNS`] runs.
pub fn copy_runs(src: &Layout, dst: &Layout, elem: usize) -> Option<Vec<Run>> {
    let n = src.shape().elem_count();
    if n != dst.shape().elem_count() {
        return None;
    }
    let (a, b) = (blocks(src)?, blocks(dst)?);
    let mut runs: Vec<Run> = Vec::new();
    let (mut i, mut j, mut used_a, mut used_b) = (0, 0, 0, 0);
    while i < a.len() && j < b.len() {
        let (sa, la) = a[i];
        let (sb, lb) = b[j];
        let len = (la - used_a).min(lb - used_b);
        let run = Run {
            src: (sa + used_a) * elem,
            dst: (sb + used_b) * elem,
            len: len * elem,
        };
        match runs.last_mut() {
            Some(last) if last.src + last.len == run.src && last.dst + last.len == run.dst => {
                last.len += run.len;
            }
            _ if len > 0 => {
                if runs.len() == MAX_RUNS {
                    return None;
                }
                runs.push(run);
            }
            _ => {}
        }
        used_a += len;
        used_b += len;
        if used_a == la {
            i += 1;
            used_a = 0;
        }
        if used_b == lb {
            j += 1;
            used_b = 0;
        }
    }
    Some(runs)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Tensor};

    /// Applies `runs` as plain byte copies between two f32 buffers.
    fn apply(runs: &[Run], src: &[f32], dst: &mut [f32]) {
        for r in runs {
            let (s, d, n) = (r.src / 4, r.dst / 4, r.len / 4);
            dst[d..d + n].copy_from_slice(&src[s..s + n]);
        }
    }

    /// Copies `src` (a view of `base`) into `dst.narrow(dim, offset, ..)` through runs and
    /// through `slice_set`, and compares the two results.
    fn check(
        src: &Tensor,
        dst_dims: &[usize],
        dim: usize,
        offset: usize,
    ) -> candle_core::Result<usize> {
        let dev = Device::Cpu;
        let n: usize = dst_dims.iter().product();
        let want = (Tensor::arange(0f32, n as f32, &dev)?.reshape(dst_dims)? * -1.0)?;
        let region = want.narrow(dim, offset, src.dim(dim)?)?;
        let runs = copy_runs(src.layout(), region.layout(), 4).expect("runs");
        let mut got = want.flatten_all()?.to_vec1::<f32>()?;
        let (st, _) = src.storage_and_layout();
        let candle_core::Storage::Cpu(candle_core::CpuStorage::F32(s)) = &*st else {
            panic!("f32 cpu storage")
        };
        apply(&runs, s, &mut got);
        drop(st);
        want.slice_set(&src.contiguous()?, dim, offset)?;
        assert_eq!(got, want.flatten_all()?.to_vec1::<f32>()?);
        Ok(runs.len())
    }

    #[test]
    fn one_head_token_range_is_one_run() -> candle_core::Result<()> {
        let base =
            Tensor::arange(0f32, 2.0 * 4.0 * 16.0 * 8.0, &Device::Cpu)?.reshape((2, 4, 16, 8))?;
        let src = base.narrow(0, 1, 1)?.narrow(1, 2, 1)?.narrow(2, 3, 5)?;
        assert_eq!(check(&src, &[1, 1, 12, 8], 2, 4)?, 1);
        // All heads of a token range: one run per head on each side.
        let src = base.narrow(0, 0, 1)?.narrow(2, 3, 5)?;
        assert_eq!(check(&src, &[1, 4, 9, 8], 2, 2)?, 4);
        Ok(())
    }

    #[test]
    fn transposed_and_broadcast_views_match_slice_set() -> candle_core::Result<()> {
        let base = Tensor::arange(0f32, 6.0 * 5.0, &Device::Cpu)?.reshape((6, 5))?;
        check(&base.t()?, &[5, 9], 1, 2)?;
        check(&base.narrow(1, 1, 3)?, &[8, 3], 0, 1)?;
        let row = Tensor::arange(0f32, 4.0, &Device::Cpu)?.reshape((1, 4))?;
        check(&row.broadcast_as((3, 4))?, &[3, 7], 1, 3)?;
        Ok(())
    }

    #[test]
    fn too_scattered_or_mismatched_views_are_refused() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let big = Tensor::zeros((MAX_RUNS + 1, 2), DType::F32, &dev)?;
        let dst = Tensor::zeros((2, MAX_RUNS + 1), DType::F32, &dev)?;
        assert!(copy_runs(big.t()?.layout(), dst.layout(), 4).is_none());
        let small = Tensor::zeros((3, 2), DType::F32, &dev)?;
        assert!(copy_runs(small.layout(), dst.layout(), 4).is_none());
        Ok(())
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(200))]
        /// Random 3-d views (narrowed, possibly transposed) into random destination offsets.
        #[test]
        fn runs_equal_slice_set(
            dims in proptest::collection::vec(1usize..6, 3),
            cut in proptest::collection::vec((0usize..5, 0usize..5), 3),
            swap in 0usize..3,
            dim in 0usize..3,
            extra in 0usize..4,
        ) {
            let dev = Device::Cpu;
            let n: usize = dims.iter().product();
            let base = Tensor::arange(0f32, n as f32, &dev).unwrap().reshape(dims.clone()).unwrap();
            let mut v = base;
            for (d, &(lo, len)) in cut.iter().enumerate() {
                let size = v.dim(d).unwrap();
                let lo = lo % size;
                let len = 1 + len % (size - lo);
                v = v.narrow(d, lo, len).unwrap();
            }
            if swap > 0 {
                v = v.transpose(0, swap).unwrap();
            }
            let mut dst_dims = v.dims().to_vec();
            dst_dims[dim] += extra;
            check(&v, &dst_dims, dim, extra).unwrap();
        }
    }
}

//! The attention kernel over K/V stored as q8_0 blocks (`--kv-dtype q8_0`) reads exactly
//! the values candle's `dequantize` gives those blocks: its output equals the kernel's over
//! the dequantized f32 K/V (the same tile products on the same numbers), for decode rows
//! and chunks, causal or not, windowed, soft-capped, GQA groups, views into a larger
//! buffer (a policy's preallocated cache); views that cut blocks are refused.
use anyhow::Result;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use kvpolicy_kernels::flash::{flash_attn, FlashParams, Q8_BYTES, Q8_VALUES};
use proptest::prelude::*;

/// `t` `(b, g, n, d)` as q8_0 blocks `(b, g, n, d / 32 · 34)` bytes, and the f32 values
/// they hold — both from candle's quantizer and dequantizer.
fn q8(t: &Tensor) -> Result<(Tensor, Tensor)> {
    let (b, g, n, d) = t.dims4()?;
    let q = QTensor::quantize(&t.reshape((b * g * n, d))?, GgmlDType::Q8_0)?;
    let bytes = q.data()?.into_owned();
    let w = d / Q8_VALUES * Q8_BYTES;
    let blocks = Tensor::from_vec(bytes, (b, g, n, w), &Device::Cpu)?;
    let values = q.dequantize(&Device::Cpu)?.reshape((b, g, n, d))?;
    Ok((blocks, values))
}

fn max_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    Ok((a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?)
}

/// The case's sizes: `(b, n_kv, group, t, s, d)` and the mask.
#[derive(Debug, Clone)]
struct Case {
    b: usize,
    n_kv: usize,
    group: usize,
    t: usize,
    s: usize,
    d: usize,
    window: Option<usize>,
    softcap: Option<f32>,
    /// Extra rows in the buffer the keys are a view of (none: the whole tensor).
    spare: usize,
}

fn check(c: &Case) -> Result<()> {
    let dev = Device::Cpu;
    let q = Tensor::randn(0f32, 1.0, (c.b, c.n_kv * c.group, c.t, c.d), &dev)?;
    let rows = c.s + c.spare;
    let k = (Tensor::randn(0f32, 1.0, (c.b, c.n_kv, rows, c.d), &dev)? * 2.0)?;
    let v = Tensor::randn(0f32, 1.0, (c.b, c.n_kv, rows, c.d), &dev)?;
    let ((kq, kf), (vq, vf)) = (q8(&k)?, q8(&v)?);
    // Keys `spare..` of the buffer: a view whose offset is whole rows of blocks.
    let view = |x: &Tensor| x.narrow(2, c.spare, c.s);
    let p = FlashParams {
        scale: 1.0 / (c.d as f32).sqrt(),
        softcap: c.softcap,
        causal: true,
        window: c.window,
        q_pos: c.s - c.t,
        k_pos: 0,
    };
    let got = flash_attn(&q, &view(&kq)?, &view(&vq)?, &p)?;
    let want = flash_attn(&q, &view(&kf)?, &view(&vf)?, &p)?;
    let d = max_diff(&got.out, &want.out)?;
    assert!(d <= 1e-6, "{c:?}: out differs by {d}");
    let l = max_diff(&got.lse, &want.lse)?;
    assert!(l <= 1e-5, "{c:?}: lse differs by {l}");
    Ok(())
}

#[test]
fn decode_rows_and_chunks_read_the_blocks_values() -> Result<()> {
    for c in [
        // Decode: one query row per head of a group, split-K over a long range.
        (1, 3, 3, 1, 4096, 64, None, None, 0),
        (1, 2, 4, 1, 700, 256, Some(512), Some(50.0), 3),
        // Chunks: gemm tiles, diagonal and window-edge tiles.
        (1, 3, 3, 70, 300, 64, None, None, 5),
        (2, 1, 2, 130, 600, 32, Some(200), None, 0),
    ] {
        let (b, n_kv, group, t, s, d, window, softcap, spare) = c;
        check(&Case {
            b,
            n_kv,
            group,
            t,
            s,
            d,
            window,
            softcap,
            spare,
        })?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn any_shape_reads_the_blocks_values(
        b in 1usize..3,
        n_kv in 1usize..4,
        group in 1usize..5,
        t in 1usize..40,
        extra in 0usize..600,
        blocks in 1usize..5,
        window in proptest::option::of(1usize..300),
        spare in 0usize..4,
    ) {
        let c = Case { b, n_kv, group, t, s: t + extra, d: blocks * Q8_VALUES, window, softcap: None, spare };
        check(&c).map_err(|e| TestCaseError::fail(e.to_string()))?;
    }
}

#[test]
fn views_that_cut_blocks_and_mismatched_widths_are_refused() -> Result<()> {
    let dev = Device::Cpu;
    let p = FlashParams {
        scale: 0.1,
        softcap: None,
        causal: false,
        window: None,
        q_pos: 4,
        k_pos: 0,
    };
    let q = Tensor::randn(0f32, 1.0, (1, 2, 1, 64), &dev)?;
    let k = Tensor::zeros((1, 2, 4, 2 * Q8_BYTES + 1), DType::U8, &dev)?;
    // A view that starts one byte into a block.
    let cut = k.narrow(3, 1, 2 * Q8_BYTES)?;
    let e = flash_attn(&q, &cut, &cut, &p).err().map(|e| e.to_string());
    assert!(e.as_deref().unwrap_or("").contains("whole blocks"), "{e:?}");
    // Rows of 3 blocks for queries of 2 blocks' width.
    let wide = Tensor::zeros((1, 2, 4, 3 * Q8_BYTES), DType::U8, &dev)?;
    assert!(flash_attn(&q, &wide, &wide, &p).is_err());
    // A head width that is not whole blocks.
    let q48 = Tensor::randn(0f32, 1.0, (1, 2, 1, 48), &dev)?;
    let e = flash_attn(&q48, &wide, &wide, &p)
        .err()
        .map(|e| e.to_string());
    assert!(
        e.as_deref().unwrap_or("").contains("multiple of 32"),
        "{e:?}"
    );
    Ok(())
}

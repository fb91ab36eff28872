//! The CPU reference of `HeadsInto` against straightforward tensor code: reshape the rows
//! into heads, rotate with candle's `rope` / `rope_i`, `slice_set` into the buffer.
use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use kvpolicy_kernels::{heads_into, Rotation};

fn max_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    Ok((a.to_dtype(DType::F32)? - b.to_dtype(DType::F32)?)?
        .abs()?
        .flatten_all()?
        .max(0)?
        .to_scalar::<f32>()?)
}

/// cos/sin `(t, d/2)` for positions `pos..pos+t`.
fn trig(pos: usize, t: usize, d: usize, dev: &Device) -> Result<(Tensor, Tensor)> {
    let half = d / 2;
    let mut c = Vec::new();
    let mut s = Vec::new();
    for p in pos..pos + t {
        for i in 0..half {
            let a = p as f32 / 10000f32.powf(2.0 * i as f32 / d as f32);
            c.push(a.cos());
            s.push(a.sin());
        }
    }
    Ok((
        Tensor::from_vec(c, (t, half), dev)?,
        Tensor::from_vec(s, (t, half), dev)?,
    ))
}

#[test]
fn writes_rotated_heads_into_a_token_range_as_tensor_code_does() -> Result<()> {
    let dev = Device::Cpu;
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for rotation in [Rotation::None, Rotation::Half, Rotation::Interleaved] {
            for (b, h, t, d, cap, at) in
                [(1, 2, 5, 8, 16, 3), (2, 3, 1, 4, 4, 3), (1, 1, 7, 2, 7, 0)]
            {
                let rows = Tensor::randn(0f32, 1.0, (b, t, h * d), &dev)?.to_dtype(dtype)?;
                let (cos, sin) = trig(at + 11, t, d, &dev)?;
                let (cos, sin) = (cos.to_dtype(dtype)?, sin.to_dtype(dtype)?);
                let fill = Tensor::full(7f32, (b, h, cap, d), &dev)?.to_dtype(dtype)?;
                // Tensor code.
                let heads = rows.reshape((b, t, h, d))?.transpose(1, 2)?.contiguous()?;
                let heads = match rotation {
                    Rotation::None => heads,
                    Rotation::Half => candle_nn::rotary_emb::rope(&heads, &cos, &sin)?,
                    Rotation::Interleaved => candle_nn::rotary_emb::rope_i(&heads, &cos, &sin)?,
                };
                let want = fill.copy()?;
                want.slice_set(&heads, 2, at)?;
                // The op, into a view of the buffer.
                let got = fill.copy()?;
                let rope = (rotation != Rotation::None).then_some((&cos, &sin, rotation));
                heads_into(&got.narrow(2, at, t)?, &rows, rope)?;
                let tol = if dtype == DType::F32 { 1e-6 } else { 2e-2 };
                let diff = max_diff(&got, &want)?;
                assert!(
                    diff <= tol,
                    "{dtype:?} {rotation:?} b{b} h{h} t{t} d{d} at {at}: {diff}"
                );
            }
        }
    }
    Ok(())
}

#[test]
fn mismatched_shapes_are_errors() -> Result<()> {
    let dev = Device::Cpu;
    let buf = Tensor::zeros((1, 2, 8, 4), DType::F32, &dev)?;
    let rows = Tensor::zeros((1, 3, 8), DType::F32, &dev)?;
    let (cos, sin) = trig(0, 3, 4, &dev)?;
    // Rows of the wrong width.
    let wide = Tensor::zeros((1, 3, 12), DType::F32, &dev)?;
    let e = heads_into(&buf.narrow(2, 0, 3)?, &wide, None)
        .err()
        .map(|e| e.to_string());
    assert!(e.unwrap_or_default().contains("heads_into"));
    // A table for the wrong number of tokens.
    let (c2, s2) = trig(0, 2, 4, &dev)?;
    let e = heads_into(
        &buf.narrow(2, 0, 3)?,
        &rows,
        Some((&c2, &s2, Rotation::Half)),
    )
    .err()
    .map(|e| e.to_string());
    assert!(e.unwrap_or_default().contains("cos|sin"));
    // Mixed dtypes.
    let e = heads_into(&buf.narrow(2, 0, 3)?, &rows.to_dtype(DType::F16)?, None)
        .err()
        .map(|e| e.to_string());
    assert!(e.is_some());
    // The right shapes work, and only the range is written.
    heads_into(
        &buf.narrow(2, 5, 3)?,
        &(rows + 1.0)?,
        Some((&cos, &sin, Rotation::Half)),
    )?;
    assert_eq!(
        buf.narrow(2, 0, 5)?.abs()?.sum_all()?.to_scalar::<f32>()?,
        0.0
    );
    Ok(())
}

//! `--dump-logits`: a 2-D float32 tensor as a NumPy `.npy` (format version 1.0: magic,
//! header dict padded to 64 bytes, little-endian data), written to any `Write` so that
//! outputs can be staged in memory or in an exclusive temporary (candle's `write_npy`
//! takes a path only).
use std::io::Write;

use anyhow::Result;
use candle_core::{DType, Tensor};

/// Writes `t` (any float dtype, 2-D) as a float32 `.npy`.
pub fn write_f32_npy(t: &Tensor, out: &mut dyn Write) -> Result<()> {
    let (rows, cols) = t.dims2()?;
    let mut header =
        format!("{{'descr': '<f4', 'fortran_order': False, 'shape': ({rows}, {cols}), }}");
    // magic (6) + version (2) + header length (2) + header, a multiple of 64, '\n'-ended.
    let unpadded = 10 + header.len() + 1;
    header.push_str(&" ".repeat(unpadded.next_multiple_of(64) - unpadded));
    header.push('\n');
    out.write_all(b"\x93NUMPY\x01\x00")?;
    out.write_all(&(header.len() as u16).to_le_bytes())?;
    out.write_all(header.as_bytes())?;
    for row in t.to_dtype(DType::F32)?.to_vec2::<f32>()? {
        let bytes: Vec<u8> = row.iter().flat_map(|x| x.to_le_bytes()).collect();
        out.write_all(&bytes)?;
    }
    Ok(())
}

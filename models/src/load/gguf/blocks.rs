//! A GGUF tensor read straight into the buffer the model keeps (CPU). candle's reader reads
//! a tensor's bytes into one buffer and copies them into a second of its block type, so
//! loading peaks at the model plus its largest tensor — Gemma 3 270M's 262,144-row
//! embedding table, ~137 MB of a 253 MB file — beside what llama.cpp, which maps the file,
//! holds. Here the block buffer is allocated once and the file's bytes are read into it.
use std::io::{Read, Seek, SeekFrom};

use candle_core::quantized::gguf_file::TensorInfo;
use candle_core::quantized::k_quants::{
    BlockQ2K, BlockQ3K, BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ5K, BlockQ5_0, BlockQ5_1, BlockQ6K,
    BlockQ8_0,
};
use candle_core::quantized::{GgmlDType, GgmlType, QStorage, QTensor};

/// Reads tensor `info` (its data at `data_offset + info.offset`) from `r` into a CPU
/// [`QTensor`], its blocks' final buffer filled in place. The caller has checked the
/// tensor's extent against the file ([`GgufFile::open`](super::file::GgufFile::open) does).
pub(crate) fn read_cpu<R: Read + Seek>(
    r: &mut R,
    info: &TensorInfo,
    data_offset: u64,
) -> candle_core::Result<QTensor> {
    let dtype = info.ggml_dtype;
    let n = whole_blocks(info)?;
    r.seek(SeekFrom::Start(data_offset + info.offset))?;
    let storage = match dtype {
        GgmlDType::F32 => blocks::<f32>(r, n, dtype)?,
        GgmlDType::F16 => blocks::<half::f16>(r, n, dtype)?,
        GgmlDType::BF16 => blocks::<half::bf16>(r, n, dtype)?,
        GgmlDType::Q4_0 => blocks::<BlockQ4_0>(r, n, dtype)?,
        GgmlDType::Q4_1 => blocks::<BlockQ4_1>(r, n, dtype)?,
        GgmlDType::Q5_0 => blocks::<BlockQ5_0>(r, n, dtype)?,
        GgmlDType::Q5_1 => blocks::<BlockQ5_1>(r, n, dtype)?,
        GgmlDType::Q8_0 => blocks::<BlockQ8_0>(r, n, dtype)?,
        GgmlDType::Q2K => blocks::<BlockQ2K>(r, n, dtype)?,
        GgmlDType::Q3K => blocks::<BlockQ3K>(r, n, dtype)?,
        GgmlDType::Q4K => blocks::<BlockQ4K>(r, n, dtype)?,
        GgmlDType::Q5K => blocks::<BlockQ5K>(r, n, dtype)?,
        GgmlDType::Q6K => blocks::<BlockQ6K>(r, n, dtype)?,
        // candle's reader does not take these either (they are activation formats).
        GgmlDType::Q8_1 | GgmlDType::Q8K => {
            candle_core::bail!("quantized type {dtype:?} is not supported yet")
        }
    };
    QTensor::new(storage, info.shape.clone())
}

/// The blocks tensor `info` holds: an error unless its values are whole blocks of its type.
fn whole_blocks(info: &TensorInfo) -> candle_core::Result<usize> {
    let (elems, block) = (info.shape.elem_count(), info.ggml_dtype.block_size());
    if !elems.is_multiple_of(block) {
        candle_core::bail!("{elems} values are not whole blocks of {block}");
    }
    Ok(elems / block)
}

/// Tensor `info`'s bytes read from `r` into one vector (for a kernel that rearranges them
/// where they lie, `QuantMatMul::interleave_owned`). Checked as [`read_cpu`] is.
pub(crate) fn read_bytes<R: Read + Seek>(
    r: &mut R,
    info: &TensorInfo,
    data_offset: u64,
) -> candle_core::Result<Vec<u8>> {
    let mut v = vec![0u8; whole_blocks(info)? * info.ggml_dtype.type_size()];
    r.seek(SeekFrom::Start(data_offset + info.offset))?;
    r.read_exact(&mut v)?;
    Ok(v)
}

/// `n` blocks of `T` read from `r` into their own vector.
fn blocks<T: GgmlType + 'static>(
    r: &mut impl Read,
    n: usize,
    dtype: GgmlDType,
) -> candle_core::Result<QStorage> {
    if std::mem::size_of::<T>() != dtype.type_size() {
        candle_core::bail!(
            "a {dtype:?} block is {} bytes in the file and {} in memory",
            dtype.type_size(),
            std::mem::size_of::<T>()
        );
    }
    let mut v = vec![T::zeros(); n];
    // SAFETY: `v` holds `n` initialised `T`s, `n · size_of::<T>()` bytes; candle's block
    // types are `repr(C)` plain data (integers, f16 scales) for which every byte pattern is
    // a value — what candle's own reader assumes when it reinterprets the file's bytes.
    let bytes = unsafe {
        std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<u8>(), n * std::mem::size_of::<T>())
    };
    r.read_exact(bytes)?;
    Ok(QStorage::Cpu(Box::new(v)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::gguf_file;
    use candle_core::{Device, Tensor};

    /// Every block type this reads gives the tensor candle's own reader gives, bit for bit.
    #[test]
    fn reads_what_candle_reads() -> candle_core::Result<()> {
        let x = Tensor::randn(0f32, 1., (4, 256), &Device::Cpu)?;
        let types = [
            GgmlDType::F32,
            GgmlDType::F16,
            GgmlDType::BF16,
            GgmlDType::Q4_0,
            GgmlDType::Q4_1,
            GgmlDType::Q5_0,
            GgmlDType::Q5_1,
            GgmlDType::Q8_0,
            GgmlDType::Q2K,
            GgmlDType::Q3K,
            GgmlDType::Q4K,
            GgmlDType::Q5K,
            GgmlDType::Q6K,
        ];
        let qs = types
            .iter()
            .map(|&t| QTensor::quantize(&x, t))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let names: Vec<String> = types.iter().map(|t| format!("{t:?}")).collect();
        let tensors: Vec<(&str, &QTensor)> =
            names.iter().map(String::as_str).zip(qs.iter()).collect();
        let mut file = std::io::Cursor::new(Vec::new());
        gguf_file::write(&mut file, &[], &tensors)?;
        file.set_position(0);
        let content = gguf_file::Content::read(&mut file)?;
        for (name, q) in &tensors {
            let info = &content.tensor_infos[*name];
            let ours = read_cpu(&mut file, info, content.tensor_data_offset)?;
            let theirs = content.tensor(&mut file, name, &Device::Cpu)?;
            assert_eq!(ours.dtype(), q.dtype());
            assert_eq!(ours.shape(), theirs.shape());
            assert_eq!(ours.data()?, theirs.data()?, "{name}");
        }
        Ok(())
    }
}

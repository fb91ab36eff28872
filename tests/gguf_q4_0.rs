//! A Q4_0 GGUF through the loader's interleaved path (Q4_0 weights read straight into the
//! decode kernel's eight-row layout, `quant::rows8`; a tied embedding table shared by the
//! head's kernel and the lookup) agrees with candle-transformers' quantized Llama on the
//! same file: a 40-token prompt (the integer GEMM, reassembling row-major blocks from the
//! interleaved bytes) and teacher-forced decode steps (the eight-row kernel).
//!
//! The file is the Llama fixture's GGUF (tests/fixtures/gguf/llama_gqa.gguf, f32) with every
//! matrix whose rows are whole 32-element blocks quantized to Q4_0 by candle (the MLP's
//! down projection, 112 wide, stays f32) and no `output.weight` (the head tied to the
//! embedding). Both sides quantize activations to Q8_0 the same way and sum each block
//! exactly; they differ in f32 summation order (and candle's attention repeats K/V heads),
//! which moves these logits by ~5e-7 here — held to 1e-3.
mod common;

use anyhow::Result;
use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::Device;
use candle_transformers::models::quantized_llama::ModelWeights;
use kvpolicy::models::GgufFile;
use kvpolicy::CausalLm;

/// Writes the Q4_0, tied version of the Llama fixture GGUF to `out`; the number of
/// tensors quantized.
fn write_q4_0(out: &std::path::Path) -> Result<usize> {
    let src = common::fixture("gguf").join("llama_gqa.gguf");
    let mut f = std::fs::File::open(&src)?;
    let content = gguf_file::Content::read(&mut f)?;
    let mut tensors = Vec::new();
    let mut quantized = 0;
    for name in content.tensor_infos.keys() {
        if name == "output.weight" {
            continue;
        }
        let t = content.tensor(&mut f, name, &Device::Cpu)?;
        let dims = t.shape().dims().to_vec();
        let t = if dims.len() == 2 && dims[1] % 32 == 0 {
            quantized += 1;
            // The loader interleaves exactly where this says so (`Tensors::interleaved`): on
            // an x86-64 CPU with AVX2 (CI's) every quantized matrix here takes that path.
            #[cfg(target_arch = "x86_64")]
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                anyhow::ensure!(
                    kvpolicy_kernels::quant::QuantMatMul::interleaves(
                        GgmlDType::Q4_0,
                        dims[0],
                        dims[1]
                    )
                    .is_some(),
                    "{name} {dims:?} would stay row-major"
                );
            }
            QTensor::quantize(&t.dequantize(&Device::Cpu)?, GgmlDType::Q4_0)?
        } else {
            t
        };
        tensors.push((name.clone(), t));
    }
    let meta: Vec<(&str, &gguf_file::Value)> = content
        .metadata
        .iter()
        .map(|(k, v)| (k.as_str(), v))
        .collect();
    let named: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    gguf_file::write(&mut std::fs::File::create(out)?, &meta, &named)?;
    Ok(quantized)
}

#[test]
fn interleaved_q4_0_model_matches_candle_quantized_llama() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("llama_gqa.q4_0.gguf");
    let quantized = write_q4_0(&path)?;
    // Embedding, and per layer q, k, v, o, gate, up (3 layers).
    assert_eq!(quantized, 1 + 3 * 6, "tensors quantized to Q4_0");
    let dev = Device::Cpu;
    let ours = kvpolicy::models::load::gguf::build::from_gguf(&GgufFile::open(&path)?, &dev)?;
    let mut file = std::fs::File::open(&path)?;
    let content = gguf_file::Content::read(&mut file)?;
    let mut stock = ModelWeights::from_gguf(content, &mut file, &dev)?;

    let vocab = ours.info().vocab_size as u32;
    let prompt: Vec<u32> = (0..40u32).map(|i| (i * 97 + 5) % vocab).collect();
    let decode: Vec<u32> = (0..8u32).map(|i| (i * 31 + 7) % vocab).collect();
    let worst = common::gap_to_stock_llama(&ours, &mut stock, &prompt, &decode)?;
    println!("max |ours - candle quantized_llama| = {worst:.2e}");
    assert!(
        worst < 1e-3,
        "Q4_0 logits differ from candle-transformers by {worst}"
    );
    Ok(())
}

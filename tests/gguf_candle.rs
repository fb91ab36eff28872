//! Our Llama on the default GGUF agrees with candle-transformers' own quantized Llama:
//! prompt logits and teacher-forced decode steps.
//!
//! Both models run with the GGUF weights dequantized to f32 (`CANDLE_DEQUANTIZE_ALL`):
//! with quantized matmuls, activations are rounded to Q8_1 and a one-ulp difference in a
//! reduction order (our grouped-query attention folds query heads into one matmul, candle
//! repeats K/V) can move this model's logits by ~1, which would make the comparison
//! meaningless. In f32 the two must agree to rounding.
mod common;

use anyhow::Result;
use candle_core::Device;
use candle_transformers::models::quantized_llama::ModelWeights;
use kvpolicy::models::GgufFile;

#[test]
fn logits_match_candle_quantized_llama() -> Result<()> {
    // Read once per thread by candle when the first QMatMul is built; this test owns its thread.
    std::env::set_var("CANDLE_DEQUANTIZE_ALL", "1");
    let path = common::default_gguf()?;
    let dev = Device::Cpu;
    let ours = kvpolicy::models::load::gguf::build::from_gguf(&GgufFile::open(&path)?, &dev)?;
    let mut file = std::fs::File::open(&path)?;
    let content = candle_core::quantized::gguf_file::Content::read(&mut file)?;
    let mut stock = ModelWeights::from_gguf(content, &mut file, &dev)?;

    let refs = common::llamacpp_refs()?;
    let g = &refs["greedy"][1];
    let prompt = common::ids_of(&g["prompt_ids"])?;
    let decode = common::ids_of(&g["generated_ids"])?;

    let worst =
        common::gap_to_stock_llama(&ours, &mut stock, &prompt, &decode[..24.min(decode.len())])?;
    println!("max |ours - candle quantized_llama| = {worst:.2e}");
    assert!(
        worst < 1e-3,
        "logits differ from candle-transformers by {worst}"
    );
    Ok(())
}

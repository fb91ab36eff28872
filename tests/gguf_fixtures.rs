//! GGUF for every architecture: the tiny HF fixtures written as GGUF the way llama.cpp's
//! converter writes them (`scripts/make_gguf_fixtures.py`: tensor names, permuted q/k for
//! `llama`, Gemma norms with their `+ 1`, biases, tied outputs, f32), loaded by us and by
//! llama.cpp, teacher-forced over the fixture's ids: every position's logits compared.
//!
//! Tolerance 1e-3 for every architecture (measured ≤ 1.5e-5). For the Gemma family the
//! reference is llama.cpp with its GeLU evaluated in f32 (`NAME.f32gelu.logits.npy`): its CPU
//! backend looks GeLU up in a table at f16-rounded inputs, with f16 outputs
//! (`GGML_GELU_FP16`), and that alone moves these logits by 2e-3 to 6.4e-3. Traced through
//! llama.cpp's eval callback: every tensor up to the first `ffn_geglu` agrees with HF (f64)
//! to 1e-7, that one by f16 rounding; with the `ffn_geglu` nodes recomputed in f64 from
//! llama.cpp's own gate and up tensors (the script), llama.cpp equals HF's `gemma` to 1.3e-5.
//! The stock files are still compared, at 1e-2, and the table's share of the gap asserted.
mod common;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use kvpolicy::models::engine::generate::DEFAULT_PREFILL_CHUNK;
use kvpolicy::models::load;
use kvpolicy::models::load::source::ModelFiles;
use kvpolicy::{build_policy, PolicyOptions};

/// Our teacher-forced logits of fixture `name`'s ids on its GGUF.
fn ours(name: &str) -> Result<Tensor> {
    let path = common::fixture("gguf").join(format!("{name}.gguf"));
    let loaded = load(&ModelFiles::Gguf(path), &Device::Cpu, DType::F32, None)?;
    let (prompt, decode) = common::fixture_ids(name)?;
    let mut policy = build_policy("full", &PolicyOptions::default())?;
    common::teacher_forced_logits(
        loaded.model.as_ref(),
        policy.as_mut(),
        &prompt,
        &decode,
        DEFAULT_PREFILL_CHUNK,
    )
}

/// llama.cpp's logits on fixture `name`'s GGUF: `variant` "" for stock, ".f32gelu" for the
/// run with GeLU evaluated in f32.
fn llamacpp(name: &str, variant: &str) -> Result<Tensor> {
    Ok(Tensor::read_npy(
        common::fixture("gguf").join(format!("{name}{variant}.logits.npy")),
    )?)
}

const GEMMAS: [(&str, &str); 3] = [
    ("gemma", "gemma"),
    ("gemma2", "gemma2"),
    ("gemma3", "gemma3"),
];

#[test]
fn every_architecture_from_gguf_matches_llamacpp() -> Result<()> {
    for (name, arch, variant) in [
        ("llama_gqa", "llama", ""),
        ("mistral", "llama", ""),
        ("qwen2", "qwen2", ""),
        ("gemma", "gemma", ".f32gelu"),
        ("gemma2", "gemma2", ".f32gelu"),
        ("gemma3", "gemma3", ".f32gelu"),
    ] {
        let got = ours(name)?;
        let want = llamacpp(name, variant)?;
        assert_eq!(got.dims(), want.dims(), "{name}");
        let d = common::max_abs_diff(&got, &want)?;
        println!("{name} ({arch}): max |ours − llama.cpp{variant}| = {d:.2e}");
        assert!(d <= 1e-3, "{name}: {d} > 1e-3");
    }
    Ok(())
}

#[test]
fn gemma_gap_to_stock_llamacpp_is_its_table_gelu() -> Result<()> {
    for (name, arch) in GEMMAS {
        let got = ours(name)?;
        let stock = llamacpp(name, "")?;
        let f32gelu = llamacpp(name, ".f32gelu")?;
        let to_stock = common::max_abs_diff(&got, &stock)?;
        let table = common::max_abs_diff(&stock, &f32gelu)?;
        let rest = common::max_abs_diff(&got, &f32gelu)?;
        println!(
            "{name} ({arch}): ours vs stock llama.cpp {to_stock:.2e}; its table GeLU moves it \
             {table:.2e}; ours vs llama.cpp with f32 GeLU {rest:.2e}"
        );
        assert!(to_stock <= 1e-2, "{name}: {to_stock} > 1e-2");
        assert!(
            rest <= 0.05 * to_stock,
            "{name}: the table GeLU no longer explains the gap ({rest} of {to_stock})"
        );
    }
    Ok(())
}

#[test]
fn gemma_gguf_equals_hf_where_llamacpp_rounds_its_gelu() -> Result<()> {
    let got = ours("gemma")?;
    let hf = common::fixture_logits("gemma")?;
    let to_hf = common::max_abs_diff(&got, &hf)?;
    let lc = common::max_abs_diff(&llamacpp("gemma", "")?, &hf)?;
    println!("gemma GGUF: ours vs HF {to_hf:.2e}, llama.cpp vs HF {lc:.2e}");
    assert!(to_hf <= 1e-4, "ours vs HF: {to_hf}");
    assert!(
        lc > 10.0 * to_hf,
        "llama.cpp is as exact as we are ({lc}); tighten the tolerance"
    );
    Ok(())
}

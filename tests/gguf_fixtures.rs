//! GGUF for every architecture: the tiny HF fixtures written as GGUF the way llama.cpp's
//! converter writes them (`scripts/make_gguf_fixtures.py`: tensor names, permuted q/k for
//! `llama`, Gemma norms with their `+ 1`, biases, tied outputs, f32), loaded by us and by
//! llama.cpp, teacher-forced over the fixture's ids: every position's logits compared.
//!
//! Tolerances: 1e-3 for the SiLU models (measured ≤ 1.5e-5). For the Gemma family
//! llama.cpp is 2e-3 to 6.4e-3 from us, and the difference is on llama.cpp's side: on
//! `gemma`, whose GGUF reads as exactly HF's model, we equal HF's logits within 1e-4
//! (measured 1.2e-5) while llama.cpp is as far from HF as from us (checked below). About half
//! of it is llama.cpp's CPU GeLU, evaluated through a table at f16-rounded inputs and outputs
//! (`GGML_GELU_FP16`): HF with that GeLU emulated is 3.5e-3 from llama.cpp instead of 6.4e-3;
//! the rest is not traced. The Gemma models are held to 1e-2 against llama.cpp (measured
//! 6.4e-3, 2.1e-3, 1.8e-3).
mod common;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use kvpolicy::models::generate::DEFAULT_PREFILL_CHUNK;
use kvpolicy::models::load;
use kvpolicy::models::source::ModelFiles;
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

fn llamacpp(name: &str) -> Result<Tensor> {
    Ok(Tensor::read_npy(
        common::fixture("gguf").join(format!("{name}.logits.npy")),
    )?)
}

#[test]
fn every_architecture_from_gguf_matches_llamacpp() -> Result<()> {
    for (name, arch, tol) in [
        ("llama_gqa", "llama", 1e-3),
        ("mistral", "llama", 1e-3),
        ("qwen2", "qwen2", 1e-3),
        ("gemma", "gemma", 1e-2),
        ("gemma2", "gemma2", 1e-2),
        ("gemma3", "gemma3", 1e-2),
    ] {
        let got = ours(name)?;
        let want = llamacpp(name)?;
        assert_eq!(got.dims(), want.dims(), "{name}");
        let d = common::max_abs_diff(&got, &want)?;
        println!("{name} ({arch}): max |ours − llama.cpp| = {d:.2e}");
        assert!(d <= tol, "{name}: {d} > {tol}");
    }
    Ok(())
}

#[test]
fn gemma_gguf_equals_hf_where_llamacpp_rounds_its_gelu() -> Result<()> {
    let got = ours("gemma")?;
    let hf = common::fixture_logits("gemma")?;
    let to_hf = common::max_abs_diff(&got, &hf)?;
    let lc = common::max_abs_diff(&llamacpp("gemma")?, &hf)?;
    println!("gemma GGUF: ours vs HF {to_hf:.2e}, llama.cpp vs HF {lc:.2e}");
    assert!(to_hf <= 1e-4, "ours vs HF: {to_hf}");
    assert!(
        lc > 10.0 * to_hf,
        "llama.cpp is as exact as we are ({lc}); tighten the tolerance"
    );
    Ok(())
}

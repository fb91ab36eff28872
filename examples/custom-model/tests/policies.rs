//! Every lossless policy plugged into a model kvpolicy does not ship gives `full`'s logits:
//! a prompt prefilled in chunks of 5, then decode steps, on random weights.
use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use kvpolicy::core::Checked;
use kvpolicy::{KvPolicy, PolicyOptions};
use kvpolicy_custom_model::{TinyConfig, TinyLm};

/// Prompt tokens, prefill chunk, decode steps.
const PROMPT: usize = 23;
const CHUNK: usize = 5;
const STEPS: usize = 6;

/// Logits of the prompt in chunks and the decode steps, every call checked against the
/// call protocol.
fn run(model: &TinyLm, policy: &mut dyn KvPolicy) -> Result<Tensor> {
    let mut policy = Checked::new(policy);
    policy.prepare(&model.kv_shape(PROMPT + STEPS, CHUNK))?;
    let vocab = model.config().vocab as u32;
    let prompt: Vec<u32> = (0..PROMPT as u32).map(|i| (i * 7 + 3) % vocab).collect();
    let mut rows = Vec::new();
    for (i, chunk) in prompt.chunks(CHUNK).enumerate() {
        rows.push(model.forward(chunk, i * CHUNK, &mut policy)?);
    }
    for step in 0..STEPS as u32 {
        let pos = prompt.len() + step as usize;
        rows.push(model.forward(&[(step * 11 + 1) % vocab], pos, &mut policy)?);
    }
    Ok(Tensor::cat(&rows, 0)?)
}

#[test]
fn every_lossless_policy_gives_fulls_logits() -> Result<()> {
    let vars = VarMap::new();
    let vb = VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu);
    let model = TinyLm::new(&TinyConfig::default(), vb)?;
    let opts = PolicyOptions {
        grow_tokens: 8,
        ..PolicyOptions::default()
    };
    let want = run(&model, kvpolicy::build_policy("full", &opts)?.as_mut())?;
    // `auto` with room for the two streaming buffers of a whole layer, a step's scratch
    // and one resident layer: 1 unit resident, 2 streamed.
    let shape = model.kv_shape(PROMPT + STEPS, CHUNK);
    let cap = (PROMPT + STEPS).div_ceil(opts.grow_tokens) * opts.grow_tokens;
    let unit = shape.kv_bytes(shape.n_kv_heads, cap);
    let budget = 3 * unit + shape.step_scratch_bytes(shape.n_kv_heads, cap, &Device::Cpu);
    let auto = format!("auto:budget={budget}");
    let specs = [
        "layer",
        "headwise:group=1",
        "headwise:group=2",
        &auto,
        "recompute",
        "recompute:split=7",
        "hybrid:block_size=4,kv_act_ratio=0.5",
        "hybrid:block_size=3,kv_act_ratio=0",
    ];
    for spec in specs {
        let mut p = kvpolicy::build_policy(spec, &opts)?;
        let got = run(&model, p.as_mut())?;
        let diff = (&got - &want)?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f32>()?;
        // Exact up to f32 reordering: the policies attend over pieces merged by their
        // log-sum-exp, or regenerate K/V with the same weights over other row counts (the
        // gemm sums in another order). 1e-4, the tolerance the workspace's recompute and
        // hybrid tests hold its own models to.
        assert!(diff <= 1e-4, "{spec}: max |Δ| = {diff}");
        if spec.starts_with("auto") {
            let st = p.stats();
            let units = (st.metric("resident_units"), st.metric("streamed_units"));
            assert_eq!(units, (Some(1.0), Some(2.0)), "{st:?}");
            assert!(st.device_kv_peak_bytes <= budget, "{st:?}");
        }
        if spec.starts_with("recompute:") {
            assert!(p.stats().recompute_tokens > 0, "{spec} recomputed nothing");
        }
    }
    Ok(())
}

//! The `sinks` policy, written on kvpolicy's public API: exact while nothing is evicted
//! (sinks + window cover the sequence), bounded device KV when they do not, and built by
//! name through a registry next to kvpolicy's own policies.
use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use kvpolicy::models::{generate, load, resolve, GenerateConfig, Loaded, ModelSpec};
use kvpolicy::{KvPolicy, PolicyOptions};
use kvpolicy_custom_policy::{registry, SinkWindow};

fn fixture() -> Result<(Loaded, Vec<u32>, Vec<u32>)> {
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/llama_gqa");
    let loaded = load(
        &resolve(&ModelSpec::Dir(dir.clone()))?,
        &Device::Cpu,
        DType::F32,
        None,
    )?;
    let ids: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("ids.json"))?)?;
    let p = serde_json::from_value(ids["prompt_ids"].clone())?;
    let d = serde_json::from_value(ids["decode_ids"].clone())?;
    Ok((loaded, p, d))
}

fn logits(
    l: &Loaded,
    p: &mut dyn KvPolicy,
    prompt: &[u32],
    decode: &[u32],
    chunk: usize,
) -> Result<Tensor> {
    let cfg = GenerateConfig {
        decode_ids: Some(decode.to_vec()),
        collect_logits: true,
        prefill_chunk: chunk,
        ..GenerateConfig::default()
    };
    let g = generate(l.model.as_ref(), p, prompt, &cfg, &mut |_| Ok(()))?;
    g.logits.ok_or_else(|| anyhow::anyhow!("no logits"))
}

fn max_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    Ok((a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?)
}

#[test]
fn exact_while_nothing_is_evicted_and_bounded_when_it_is() -> Result<()> {
    let (l, prompt, decode) = fixture()?;
    let total = prompt.len() + decode.len();
    let reg = registry();
    let want = logits(
        &l,
        reg.build("full", &PolicyOptions::default())?.as_mut(),
        &prompt,
        &decode,
        0,
    )?;
    // Built by name: 4 sinks + 1,020 recent tokens cover this short sequence.
    let mut by_name = reg.build("sinks", &PolicyOptions::default())?;
    let got = logits(&l, by_name.as_mut(), &prompt, &decode, 0)?;
    assert!(max_diff(&got, &want)? <= 1e-4);
    for chunk in [0, 1, 5] {
        // Sinks + window exactly the sequence: still exact, up to the f32 reordering of
        // merging two partial attentions by their log-sum-exp (measured 2e-5: held to 1e-4,
        // the fixtures' tolerance against HF).
        let mut p = SinkWindow::new(2, total - 2);
        let got = logits(&l, &mut p, &prompt, &decode, chunk)?;
        let d = max_diff(&got, &want)?;
        assert!(d <= 1e-4, "chunk {chunk}: {d}");
        // A window of 6: approximate, and the cache holds at most sinks + 2·window + a chunk.
        let mut p = SinkWindow::new(2, 6);
        let got = logits(&l, &mut p, &prompt, &decode, chunk)?;
        let d = max_diff(&got, &want)?;
        assert!(
            d > 1e-3,
            "chunk {chunk}: a 6-token window changed nothing ({d})"
        );
        let info = l.model.info();
        let per_token = (2 * info.n_kv_heads * info.head_dim * 4) as u64;
        let step = if chunk == 0 { prompt.len() } else { chunk };
        // The head buffer, and the tail's 256-token growth chunks holding ≤ 2·6 + a step.
        let bound =
            info.n_layers as u64 * per_token * (2 + (2 * 6 + step).div_ceil(256) as u64 * 256);
        assert!(
            p.stats().device_kv_peak_bytes <= bound,
            "chunk {chunk}: {:?}",
            p.stats()
        );
    }
    Ok(())
}

//! `auto` against `full` and its own budget: for a budget that holds `k` of a model's
//! (layer) units besides the streaming buffers and a step's scratch, exactly `k` units stay
//! resident, a decode step moves exactly the streamed units' history host→device and their
//! new entries back, the device never holds more than the budget, and the logits equal
//! `full`'s; without a budget nothing moves at all.
mod common;

use anyhow::Result;
use candle_core::{Device, Tensor};
use kvpolicy::models::generate::kv_shape;
use kvpolicy::models::prefill;
use kvpolicy::{build_policy, LogitsMode, PolicyOptions};

#[test]
fn streamed_units_move_exactly_their_history_and_logits_equal_full() -> Result<()> {
    let name = "llama_gqa";
    let loaded = common::load_fixture(name)?;
    let model = loaded.model.as_ref();
    let info = model.info().clone();
    let (prompt, decode) = common::fixture_ids(name)?;
    let total = prompt.len() + decode.len();
    let grow = 8;
    let shape = kv_shape(&info, 1, total, prompt.len());
    let cap = total.div_ceil(grow) * grow;
    let unit = shape.kv_bytes(info.n_kv_heads, cap);
    let streaming = 2 * unit + shape.step_scratch_bytes(info.n_kv_heads, cap, &Device::Cpu);
    // K+V of one layer, f32, per token.
    let per_token_layer = (info.n_kv_heads * info.head_dim * 2 * 4) as u64;
    let want = common::teacher_forced_logits(
        model,
        build_policy("full", &PolicyOptions::default())?.as_mut(),
        &prompt,
        &decode,
        0,
    )?;
    for k in 0..=info.n_layers {
        let opts = PolicyOptions {
            grow_tokens: grow,
            device_kv_budget: Some(streaming + k as u64 * unit),
            ..PolicyOptions::default()
        };
        let mut p = build_policy("auto", &opts)?;
        p.prepare(&shape)?;
        prefill(model, p.as_mut(), &prompt, 0, false)?;
        let streamed = (info.n_layers - k) as u64;
        for (pos, &tok) in (prompt.len()..).zip(decode.iter()) {
            let before = p.stats();
            let ids = Tensor::new(&[tok], &Device::Cpu)?.unsqueeze(0)?;
            model.forward(&ids, pos, p.as_mut(), LogitsMode::Last)?;
            let after = p.stats();
            assert_eq!(
                (after.resident_units, after.streamed_units, after.demotions),
                (k as u64, streamed, 0),
                "{k} resident: units"
            );
            assert_eq!(
                after.h2d_bytes - before.h2d_bytes,
                streamed * pos as u64 * per_token_layer,
                "{k} resident at {pos}: h2d"
            );
            assert_eq!(
                after.d2h_bytes - before.d2h_bytes,
                streamed * per_token_layer,
                "{k} resident at {pos}: d2h"
            );
            assert!(after.device_kv_peak_bytes <= streaming + k as u64 * unit);
        }
        let mut p = build_policy("auto", &opts)?;
        let got = common::teacher_forced_logits(model, p.as_mut(), &prompt, &decode, 0)?;
        let d = common::max_abs_diff(&got, &want)?;
        assert!(d <= 1e-5, "{k} resident: logits differ from full by {d}");
    }
    // Without a budget every unit is resident and nothing moves.
    let mut p = build_policy("auto", &PolicyOptions::default())?;
    let got = common::teacher_forced_logits(model, p.as_mut(), &prompt, &decode, 0)?;
    assert!(common::max_abs_diff(&got, &want)? <= 1e-5);
    let st = p.stats();
    assert_eq!(
        (st.streamed_units, st.h2d_bytes, st.d2h_bytes),
        (0, 0, 0),
        "{st:?}"
    );
    assert_eq!(st.resident_units, info.n_layers as u64);
    Ok(())
}

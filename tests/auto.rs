//! `auto` against `full` and its own budget: for a budget that holds `k` of a model's
//! (layer) units besides the streaming buffers and a step's scratch, exactly `k` units stay
//! resident, a decode step moves exactly the streamed units' history host→device and their
//! new entries back, the device never holds more than the budget, and the logits equal
//! `full`'s; without a budget nothing moves at all.
mod common;

use anyhow::Result;
use candle_core::{Device, Tensor};
use kvpolicy::models::engine::generate::kv_shape;
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
    let want = common::full_logits(model, &prompt, &decode, 0)?;
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
                (
                    common::metric(&after, "resident_units"),
                    common::metric(&after, "streamed_units"),
                    common::metric(&after, "demotions")
                ),
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
        (
            common::metric(&st, "streamed_units"),
            st.h2d_bytes,
            st.d2h_bytes
        ),
        (0, 0, 0),
        "{st:?}"
    );
    assert_eq!(common::metric(&st, "resident_units"), info.n_layers as u64);
    Ok(())
}

#[test]
fn windowed_layers_are_resident_first_in_window_sized_buffers() -> Result<()> {
    // Gemma 3 fixture: layers sliding, sliding, full, sliding (window 8), 2 KV heads.
    let name = "gemma3";
    let loaded = common::load_fixture(name)?;
    let model = loaded.model.as_ref();
    let info = model.info().clone();
    let (prompt, decode) = common::fixture_ids(name)?;
    let (total, chunk, grow) = (prompt.len() + decode.len(), 4, 4);
    let shape = kv_shape(&info, 1, total, chunk);
    let windowed: Vec<usize> = shape.windows.iter().filter_map(|w| *w).collect();
    let global = (info.n_layers - windowed.len()) as u64;
    assert!(!windowed.is_empty() && global > 0, "{:?}", shape.windows);
    let nkv = info.n_kv_heads;
    let cap = total.div_ceil(grow) * grow;
    let unit = shape.kv_bytes(nkv, cap);
    // A windowed unit holds its window and one step, not the context.
    let window_units: u64 = windowed
        .iter()
        .map(|w| shape.kv_bytes(nkv, ((w + chunk).div_ceil(grow) * grow).min(cap)))
        .sum();
    assert!(window_units < windowed.len() as u64 * unit);
    let streaming = 2 * unit + shape.step_scratch_bytes(nkv, cap, &Device::Cpu);
    let per_token_layer = (nkv * info.head_dim * 2 * 4) as u64;
    let want = common::full_logits(model, &prompt, &decode, chunk)?;
    // Room for every windowed unit, not for a global one: the windowed layers are resident
    // (taken in layer order, the first global layer would have used that room) and only the
    // global layers' history moves.
    for (budget, streamed) in [
        (streaming + window_units, global),
        (streaming + window_units + global * unit, 0),
    ] {
        let opts = PolicyOptions {
            grow_tokens: grow,
            device_kv_budget: Some(budget),
            ..PolicyOptions::default()
        };
        let mut p = build_policy("auto", &opts)?;
        p.prepare(&shape)?;
        prefill(model, p.as_mut(), &prompt, chunk, false)?;
        for (pos, &tok) in (prompt.len()..).zip(decode.iter()) {
            let before = p.stats();
            let ids = Tensor::new(&[tok], &Device::Cpu)?.unsqueeze(0)?;
            model.forward(&ids, pos, p.as_mut(), LogitsMode::Last)?;
            let after = p.stats();
            assert_eq!(
                (
                    common::metric(&after, "resident_units"),
                    common::metric(&after, "streamed_units"),
                    common::metric(&after, "demotions")
                ),
                (info.n_layers as u64 - streamed, streamed, 0),
                "budget {budget}: units"
            );
            assert_eq!(
                after.h2d_bytes - before.h2d_bytes,
                streamed * pos as u64 * per_token_layer,
                "budget {budget} at {pos}: h2d"
            );
            assert_eq!(
                after.d2h_bytes - before.d2h_bytes,
                streamed * per_token_layer
            );
            assert!(after.device_kv_peak_bytes <= budget, "{after:?}");
        }
        let mut p = build_policy("auto", &opts)?;
        let got = common::teacher_forced_logits(model, p.as_mut(), &prompt, &decode, chunk)?;
        let d = common::max_abs_diff(&got, &want)?;
        assert!(d <= 1e-5, "budget {budget}: logits differ from full by {d}");
    }
    Ok(())
}

/// Demotion on sliding-window models: `auto` planned for a run of 6 tokens meets a longer
/// one, so resident units are demoted mid-run — growing streaming buffers push them out, the
/// last-decided first, down to windowed units whose layer's host tier has already dropped
/// the tokens before its window; where the grown buffers no longer fit at the planned head
/// group, the group shrinks, every resident unit is demoted under the old numbering and
/// the rest of the run streams (before that fix a unit numbered under the old group was
/// written into another layer's heads: Δ up to 3 on gemma2/gemma3) — under budgets from
/// none to all units. Every decode step's logits equal `full`'s; some budget demotes on
/// each model.
#[test]
fn units_demoted_mid_run_on_windowed_models_keep_full_logits() -> Result<()> {
    let (chunk, grow) = (3, 2);
    for name in ["gemma2", "gemma3", "mistral"] {
        let loaded = common::load_fixture(name)?;
        let model = loaded.model.as_ref();
        let info = model.info().clone();
        assert!(
            info.windows.iter().any(Option::is_some),
            "{name}: no window"
        );
        let (prompt, decode) = common::fixture_ids(name)?;
        let opts = |budget: Option<u64>| PolicyOptions {
            grow_tokens: grow,
            device_kv_budget: budget,
            ..PolicyOptions::default()
        };
        let want = common::short_plan_logits(
            model,
            build_policy("full", &opts(None))?.as_mut(),
            &prompt,
            &decode,
        )?;
        let total = prompt.len() + decode.len();
        let shape = kv_shape(&info, 1, total, chunk);
        let cap = total.div_ceil(grow) * grow;
        // The streaming buffers of one KV head at the whole run's capacity and its scratch,
        // then room for k single-head units of the short plan's capacity.
        let small = shape.kv_bytes(1, 6usize.div_ceil(grow) * grow);
        let streaming = 2 * shape.kv_bytes(1, cap) + shape.step_scratch_bytes(1, cap, &Device::Cpu);
        let mut demoted = 0;
        for k in 0..=(info.n_layers * info.n_kv_heads) as u64 {
            let budget = streaming + k * small;
            let mut p = build_policy("auto", &opts(Some(budget)))?;
            let got = common::short_plan_logits(model, p.as_mut(), &prompt, &decode)?;
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                let d = common::max_abs_diff(g, w)?;
                assert!(d <= 1e-5, "{name} budget {budget} step {i}: max |Δ| = {d}");
            }
            demoted += common::metric(&p.stats(), "demotions");
        }
        assert!(demoted > 0, "{name}: no budget demoted a unit");
    }
    Ok(())
}

//! `helix` (KV-parallel decoding, Helix §3) with its ranks as threads of this process
//! (`ThreadGroup`): every rank's logits equal `full`'s on every fixture, with prefill chunks
//! straddling the shares' boundaries; each rank holds exactly its share; a decode token's
//! all-gather moves exactly `ranks × heads × (head_dim + 1)` f32 values per layer. The same
//! over MPI processes: `tests/helix_mpi.rs`.
mod common;

use std::sync::Arc;

use anyhow::{Context, Result};
use candle_core::{Device, Tensor};
use kvpolicy::helix::{decode_bytes_per_layer, HelixPolicy, Shares, ThreadGroup};
use kvpolicy::models::engine::generate::kv_shape;
use kvpolicy::{build_policy, KvPolicy, KvStats, PolicyOptions};

const TOL: f32 = 1e-5;

/// `TOL`, or for an MLKV model (its readers compound the merges' float noise over more
/// layers: 1.3e-5 seen on mlkv_llama at 3 ranks) the fixtures' tolerance against HF, 1e-4.
fn tol(info: &kvpolicy::ModelInfo) -> f32 {
    if info.shares_kv() {
        1e-4
    } else {
        TOL
    }
}

/// What one rank of a run saw.
struct RankRun {
    logits: Tensor,
    stats: KvStats,
    held: usize,
    shares: Shares,
}

/// Runs fixture `name` teacher-forced under `helix:local=LOCAL` on one thread per entry of
/// `opts` (rank `r` built with `opts[r]`).
fn run_ranks(
    name: &str,
    local: &str,
    opts: &[PolicyOptions],
    chunk: usize,
) -> Result<Vec<RankRun>> {
    let handles: Vec<_> = ThreadGroup::new(opts.len())
        .into_iter()
        .zip(opts.iter().cloned())
        .map(|(group, opts)| {
            let (name, local) = (name.to_string(), local.to_string());
            std::thread::spawn(move || -> Result<RankRun> {
                let loaded = common::load_fixture(&name)?;
                let (prompt, decode) = common::fixture_ids(&name)?;
                let mut p = HelixPolicy::new(build_policy(&local, &opts)?, Arc::new(group))?;
                let logits = common::teacher_forced_logits(
                    loaded.model.as_ref(),
                    &mut p,
                    &prompt,
                    &decode,
                    chunk,
                )?;
                Ok(RankRun {
                    logits,
                    stats: p.stats(),
                    held: p.held(),
                    shares: p.shares().context("prepared")?,
                })
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().map_err(|_| anyhow::anyhow!("a rank panicked"))?)
        .collect()
}

#[test]
fn every_rank_matches_full_on_every_fixture_with_chunks_straddling_shares() -> Result<()> {
    let opts = PolicyOptions {
        grow_tokens: 1,
        ..PolicyOptions::default()
    };
    for name in common::hf_fixtures() {
        let loaded = common::load_fixture(&name)?;
        let info = loaded.model.info().clone();
        let (prompt, decode) = common::fixture_ids(&name)?;
        let total = prompt.len() + decode.len();
        for ranks in [2, 3] {
            for chunk in [1, 5] {
                let want = common::full_logits(loaded.model.as_ref(), &prompt, &decode, chunk)?;
                let runs = run_ranks(&name, "full", &vec![opts.clone(); ranks], chunk)?;

                let shares = runs[0].shares;
                // The chunks of 5 straddle a boundary: 16 (2 ranks), 11 and 22 (3 ranks).
                assert!(shares.share_tokens() % 5 != 0);
                let mut held = 0;
                for (r, run) in runs.iter().enumerate() {
                    let d = common::max_abs_diff(&run.logits, &want)?;
                    assert!(
                        d <= tol(&info),
                        "{name} ranks {ranks} chunk {chunk} rank {r}: max |Δlogit| = {d}"
                    );
                    // Every rank merges the same partials in the same order.
                    assert_eq!(common::max_abs_diff(&run.logits, &runs[0].logits)?, 0.0);
                    assert_eq!(run.held, shares.held(r, total), "{name} rank {r}");
                    held += run.held;
                    assert_eq!(
                        common::metric(&run.stats, "share_tokens") as usize,
                        run.held
                    );
                    // KV per rank: exactly its share's K/V on every global KV layer (growth
                    // by 1 token: no slack); a sliding-window layer holds at most its share.
                    // An MLKV model stores its KV layers only.
                    let per_token = 2 * info.n_kv_heads * info.head_dim * 4;
                    let windows = info.kv_windows();
                    let global = windows.iter().filter(|w| w.is_none()).count();
                    let want_bytes = (global * run.held * per_token) as u64;
                    if global == windows.len() {
                        assert_eq!(run.stats.device_kv_bytes, want_bytes, "{name} rank {r}");
                    } else {
                        assert!(run.stats.device_kv_bytes >= want_bytes);
                        assert!(
                            run.stats.device_kv_bytes
                                <= (windows.len() * run.held * per_token) as u64
                        );
                    }
                    // One all-gather per layer and decode token of ranks × heads × (d + 1).
                    assert_eq!(
                        common::metric(&run.stats, "decode_bytes_per_layer_token"),
                        decode_bytes_per_layer(ranks, info.n_heads, info.head_dim),
                        "{name}"
                    );
                }
                assert_eq!(held, total);
                if chunk == 5 {
                    // The offload policies (host tier; rank 1's share alone on the disk tier)
                    // as the local policy: the same logits (chunks of 5, which straddle the
                    // shares), and each rank's host tier holds its share: growth chunks of 8
                    // tokens (8 × the device's 1) on every global layer.
                    let disk = tempfile::tempdir()?;
                    let on_disk = PolicyOptions {
                        host_kv_budget: Some(1),
                        disk_dir: Some(disk.path().to_path_buf()),
                        ..opts.clone()
                    };
                    let rank1_on_disk: Vec<PolicyOptions> = (0..ranks)
                        .map(|r| {
                            if r == 1 {
                                on_disk.clone()
                            } else {
                                opts.clone()
                            }
                        })
                        .collect();
                    let same = vec![opts.clone(); ranks];
                    for (local, o) in [
                        ("layer", &same),
                        ("headwise:1", &same),
                        ("headwise:1", &rank1_on_disk),
                    ] {
                        let runs = run_ranks(&name, local, o, chunk)?;
                        for (r, run) in runs.iter().enumerate() {
                            let d = common::max_abs_diff(&run.logits, &want)?;
                            assert!(
                                d <= tol(&info),
                                "{name} ranks {ranks} local {local} rank {r}: max |Δlogit| = {d}"
                            );
                            let per_token = 2 * info.n_kv_heads * info.head_dim * 4;
                            let on_disk = o[r].disk_dir.is_some();
                            assert_eq!(on_disk, run.stats.disk_kv_bytes > 0, "{name} rank {r}");
                            if !on_disk && info.windows.iter().all(Option::is_none) {
                                let want = info.kv_layers() * run.held.div_ceil(8) * 8 * per_token;
                                assert_eq!(
                                    run.stats.host_kv_bytes, want as u64,
                                    "{name} {local} rank {r}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

/// `auto` as the local policy: without a budget every unit of the share stays on the
/// device (its device KV is `full`'s for the share, nothing crosses the link); under a
/// budget holding the streaming buffers, a step's scratch and one unit, that unit stays and
/// the others stream from the host tier — the logits equal `full`'s on every fixture and
/// rank either way.
#[test]
fn auto_holds_a_share_resident_and_streamed() -> Result<()> {
    let opts = PolicyOptions {
        grow_tokens: 1,
        ..PolicyOptions::default()
    };
    let mut mixed = 0;
    for name in common::hf_fixtures() {
        let loaded = common::load_fixture(&name)?;
        let info = loaded.model.info().clone();
        let (prompt, decode) = common::fixture_ids(&name)?;
        let want = common::full_logits(loaded.model.as_ref(), &prompt, &decode, 5)?;
        let per_token = (2 * info.n_kv_heads * info.head_dim * 4) as u64;
        for ranks in [2, 3] {
            let share = Shares::for_run(prompt.len() + decode.len(), ranks).share_tokens();
            let shape = kv_shape(&info, 1, share, 5);
            let unit = shape.kv_bytes(info.n_kv_heads, share);
            let streaming =
                2 * unit + shape.step_scratch_bytes(info.n_kv_heads, share, &Device::Cpu);
            let one_resident = streaming + unit;
            for local in ["auto".to_string(), format!("auto:{one_resident}B")] {
                let runs = run_ranks(&name, &local, &vec![opts.clone(); ranks], 5)?;
                for (r, run) in runs.iter().enumerate() {
                    let d = common::max_abs_diff(&run.logits, &want)?;
                    assert!(
                        d <= tol(&info),
                        "{name} ranks {ranks} {local} rank {r}: max |Δlogit| = {d}"
                    );
                    let resident = common::metric(&run.stats, "resident_units");
                    let streamed = common::metric(&run.stats, "streamed_units");
                    if local == "auto" {
                        assert_eq!(streamed, 0, "{name} rank {r}: a unit streamed");
                        assert_eq!(run.stats.h2d_bytes, 0, "{name} rank {r}");
                        if info.kv_windows().iter().all(Option::is_none) {
                            let want = info.kv_layers() as u64 * run.held as u64 * per_token;
                            assert_eq!(run.stats.device_kv_bytes, want, "{name} rank {r}");
                        }
                    } else if resident > 0 && streamed > 0 {
                        mixed += 1;
                        assert!(run.stats.h2d_bytes > 0, "{name} rank {r}");
                    }
                }
            }
        }
    }
    assert!(mixed > 0, "no rank kept some units and streamed others");
    Ok(())
}

/// `auto` under `helix` demoting mid-run: prepared for 6 tokens, the run goes on, so the
/// last rank's share grows past what its plan sized — resident units are demoted to its
/// host tier at the share's own positions (and where the head group shrinks, all of them)
/// — under budgets from none to every unit resident; every rank's decode logits equal
/// `full`'s, and some budget demotes on each model.
#[test]
fn auto_shares_demote_mid_run_and_keep_full_logits() -> Result<()> {
    let opts = |budget: u64| PolicyOptions {
        grow_tokens: 2,
        device_kv_budget: Some(budget),
        ..PolicyOptions::default()
    };
    for name in ["llama_gqa", "gemma3", "mistral"] {
        let loaded = common::load_fixture(name)?;
        let info = loaded.model.info().clone();
        let (prompt, decode) = common::fixture_ids(name)?;
        let mut full = build_policy("full", &PolicyOptions::default())?;
        let want =
            common::short_plan_logits(loaded.model.as_ref(), full.as_mut(), &prompt, &decode)?;
        let total = prompt.len() + decode.len();
        let shape = kv_shape(&info, 1, total, 3);
        let streaming =
            2 * shape.kv_bytes(1, total) + shape.step_scratch_bytes(1, total, &Device::Cpu);
        let unit = shape.kv_bytes(1, 6);
        let mut demoted = 0;
        for k in 0..=(info.kv_layers() * info.n_kv_heads) as u64 {
            let budget = streaming + k * unit;
            let ranks: Vec<_> = ThreadGroup::new(2)
                .into_iter()
                .map(|group| {
                    let name = name.to_string();
                    std::thread::spawn(move || -> Result<(Vec<Tensor>, u64)> {
                        let loaded = common::load_fixture(&name)?;
                        let (prompt, decode) = common::fixture_ids(&name)?;
                        let local = build_policy("auto", &opts(budget))?;
                        let mut p = HelixPolicy::new(local, Arc::new(group))?;
                        let rows = common::short_plan_logits(
                            loaded.model.as_ref(),
                            &mut p,
                            &prompt,
                            &decode,
                        )?;
                        Ok((rows, common::metric(&p.stats(), "demotions")))
                    })
                })
                .collect();
            for (r, h) in ranks.into_iter().enumerate() {
                let (rows, demotions) =
                    h.join().map_err(|_| anyhow::anyhow!("a rank panicked"))??;
                for (i, (g, w)) in rows.iter().zip(&want).enumerate() {
                    let d = common::max_abs_diff(g, w)?;
                    assert!(
                        d <= TOL,
                        "{name} budget {budget} rank {r} step {i}: max |Δ| = {d}"
                    );
                }
                demoted += demotions;
            }
        }
        assert!(demoted > 0, "{name}: no budget demoted a unit");
    }
    Ok(())
}

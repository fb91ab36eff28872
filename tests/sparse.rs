//! The approximate page-selecting policies (`quest`, `flexicache`, `clo`) driven with
//! random attention steps: exact when the budget covers the context (global and
//! sliding-window layers, chunked prefill and decode), lossy and labeled so when it does
//! not, and the bytes each decode step moves equal the pages selected, exactly.
use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use kvpolicy::{build_policy, AttnSpec, AttnStep, KvPolicy, NoRegen, PolicyOptions};

/// Deterministic pseudo-random `(1, heads, t, d)` data for (step, layer, salt).
fn data(heads: usize, t: usize, d: usize, key: [u64; 4]) -> Result<Tensor> {
    let [step, layer, salt, seed] = key;
    let v: Vec<f32> = (0..heads * t * d)
        .map(|j| {
            let x = (j as u64 + 1) * 2654435761
                + seed * 97
                + step * 7919
                + layer * 104729
                + salt * 15485863;
            ((x % 20011) as f32 / 20011.0 - 0.5) * 4.0
        })
        .collect();
    Ok(Tensor::from_vec(v, (1, heads, t, d), &Device::Cpu)?)
}

/// Runs `chunks` through one layer per spec; returns every step's outputs, and after each
/// step the policy's host→device bytes.
fn drive(
    policy: &mut dyn KvPolicy,
    specs: &[AttnSpec],
    chunks: &[usize],
) -> Result<(Vec<Tensor>, Vec<u64>)> {
    let (mut outs, mut h2d, mut pos) = (Vec::new(), Vec::new(), 0);
    for (i, &t) in chunks.iter().enumerate() {
        for (layer, spec) in specs.iter().enumerate() {
            let d = spec.head_dim;
            let key = |salt| [i as u64, layer as u64, salt, 5];
            let q = data(spec.n_heads, t, d, key(1))?;
            let k = data(spec.n_kv_heads, t, d, key(2))?;
            let v = data(spec.n_kv_heads, t, d, key(3))?;
            let x = Tensor::zeros((1, t, 8), DType::F32, &Device::Cpu)?;
            let step = AttnStep {
                seq: 0,
                layer,
                q: &q,
                k: &k,
                v: &v,
                x: &x,
                pos,
                spec,
                regen: &NoRegen,
            };
            outs.push(policy.attend(&step)?);
        }
        h2d.push(policy.stats().h2d_bytes);
        pos += t;
    }
    Ok((outs, h2d))
}

fn specs(windowed: bool) -> Vec<AttnSpec> {
    (0..3)
        .map(|l| {
            let mut s = AttnSpec::new(6, 2, 8);
            if windowed && l == 1 {
                s.sliding_window = Some(24);
            }
            s
        })
        .collect()
}

fn max_diff(a: &[Tensor], b: &[Tensor]) -> Result<f32> {
    let mut m = 0f32;
    for (x, y) in a.iter().zip(b) {
        m = m.max((x - y)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?);
    }
    Ok(m)
}

/// Prefill in chunks, then decode steps: 30 + 40 + 25 + 30 single tokens.
fn chunks() -> Vec<usize> {
    let mut c = vec![30, 40, 25];
    c.extend(std::iter::repeat_n(1, 30));
    c
}

const POLICIES: [&str; 3] = ["quest", "flexicache", "clo"];

#[test]
fn every_one_equals_full_when_the_budget_covers_the_context() -> Result<()> {
    for windowed in [false, true] {
        let specs = specs(windowed);
        let mut full = build_policy("full", &PolicyOptions::default())?;
        let (want, _) = drive(full.as_mut(), &specs, &chunks())?;
        for name in POLICIES {
            let spec = format!("{name}:page=8,sinks=8,window=16,budget=4096");
            let mut p = build_policy(&spec, &PolicyOptions::default())?;
            let (got, _) = drive(p.as_mut(), &specs, &chunks())?;
            let diff = max_diff(&want, &got)?;
            assert!(diff <= 1e-5, "{spec} (windowed {windowed}): {diff}");
            assert!(p.stats().lossy, "{spec} is labeled lossy");
        }
    }
    Ok(())
}

#[test]
fn a_small_budget_is_approximate_and_says_so() -> Result<()> {
    let specs = specs(true);
    let mut full = build_policy("full", &PolicyOptions::default())?;
    let (want, _) = drive(full.as_mut(), &specs, &chunks())?;
    for name in POLICIES {
        let spec = format!("{name}:page=8,sinks=8,window=16,budget=16");
        let mut p = build_policy(&spec, &PolicyOptions::default())?;
        let (got, _) = drive(p.as_mut(), &specs, &chunks())?;
        assert!(max_diff(&want, &got)? > 1e-4, "{spec} differs from full");
        let st = p.stats();
        assert!(st.lossy);
        assert!(st.device_kv_peak_bytes > 0);
        let reg = kvpolicy::registry();
        let info = reg.info(name)?;
        assert!(info.description.starts_with("APPROXIMATE"), "{name}");
    }
    Ok(())
}

/// Bytes of one page of one KV head, K and V, f32.
const PAGE_BYTES: u64 = 2 * 8 * 8 * 4;

#[test]
fn quest_moves_exactly_the_selected_pages_each_decode_step() -> Result<()> {
    // Global layers only: every layer selects.
    let specs = specs(false);
    let (page, sinks, window, budget) = (8, 8, 16, 16);
    let spec = format!("quest:page={page},sinks={sinks},window={window},budget={budget}");
    let mut p = build_policy(&spec, &PolicyOptions::default())?;
    let chunks = chunks();
    let (_, h2d) = drive(p.as_mut(), &specs, &chunks)?;
    let mut pos = 0;
    let mut decoded = 0;
    for (i, &t) in chunks.iter().enumerate() {
        if t == 1 {
            // The window starts at the page boundary keeping `window` tokens of `pos`.
            let recent_start = ((pos - window) / page * page).max(sinks);
            let middle = (recent_start - sinks) / page;
            let pages = middle.min(budget / page) as u64;
            let per_step = specs.len() as u64 * 2 * pages * PAGE_BYTES;
            assert_eq!(h2d[i] - h2d[i - 1], per_step, "decode step at {pos}");
            decoded += 1;
        }
        pos += t;
    }
    assert_eq!(decoded, 30);
    let fetched = common_metric(&p.stats(), "fetched_pages");
    let attended = common_metric(&p.stats(), "attended_pages");
    assert_eq!(
        fetched, attended,
        "quest keeps nothing: every attended page is fetched"
    );
    Ok(())
}

fn common_metric(stats: &kvpolicy::KvStats, name: &str) -> u64 {
    stats
        .metric(name)
        .unwrap_or_else(|| panic!("no metric {name}")) as u64
}

#[test]
fn stable_heads_move_nothing_between_reranks() -> Result<()> {
    let specs = specs(false);
    // threshold 0: every head stable; re-ranks every 10 steps.
    let spec = "flexicache:page=8,sinks=8,window=16,budget=16,threshold=0,rerank=10";
    let mut p = build_policy(spec, &PolicyOptions::default())?;
    let chunks = chunks();
    let (_, h2d) = drive(p.as_mut(), &specs, &chunks)?;
    let first_decode = chunks.iter().position(|&t| t == 1).expect("decode steps");
    for (n, i) in (first_decode..chunks.len()).enumerate() {
        let moved = h2d[i] - h2d[i - 1];
        // The first decode step re-ranks, then every tenth.
        if n != 0 && (n + 1) % 10 != 0 {
            assert_eq!(moved, 0, "decode step {n} is no re-rank");
        }
        assert_eq!(moved % PAGE_BYTES, 0);
    }
    let st = p.stats();
    assert_eq!(common_metric(&st, "stable_heads"), 6);
    assert_eq!(common_metric(&st, "unstable_heads"), 0);
    assert_eq!(common_metric(&st, "reranks"), 3 * 4);
    assert_eq!(
        common_metric(&st, "stable_h2d_bytes"),
        common_metric(&st, "fetched_pages") * PAGE_BYTES
    );
    Ok(())
}

#[test]
fn unstable_heads_keep_every_page_and_then_move_nothing() -> Result<()> {
    let specs = specs(false);
    // threshold 1 with a small budget: no head is stable; every page is on the device after
    // the first decode step (which fetches those the last prefill chunk left behind).
    let spec = "flexicache:page=8,sinks=8,window=16,budget=8,threshold=1";
    let mut p = build_policy(spec, &PolicyOptions::default())?;
    let chunks = chunks();
    let (_, h2d) = drive(p.as_mut(), &specs, &chunks)?;
    let first_decode = chunks.iter().position(|&t| t == 1).expect("decode steps");
    assert_eq!(
        h2d[chunks.len() - 1],
        h2d[first_decode],
        "no later decode step moved a byte"
    );
    assert_eq!(common_metric(&p.stats(), "unstable_heads"), 6);
    Ok(())
}

#[test]
fn clo_reuses_while_the_threshold_allows_and_then_moves_nothing() -> Result<()> {
    let specs = specs(false);
    // similarity 0: the least important head (threshold -1) always reuses after its first selection.
    let spec = "clo:page=8,sinks=8,window=16,budget=16,similarity=0";
    let mut p = build_policy(spec, &PolicyOptions::default())?;
    let chunks = chunks();
    let (_, h2d) = drive(p.as_mut(), &specs, &chunks)?;
    let first_decode = chunks.iter().position(|&t| t == 1).expect("decode steps");
    let st = p.stats();
    let fresh = common_metric(&st, "fresh_selections");
    let reused = common_metric(&st, "reused_selections");
    assert_eq!(fresh + reused, 30 * 3 * 2);
    assert!(reused > 0, "the least important heads reuse");
    // Only fresh selections fetch; the bytes are the fetched pages.
    assert_eq!(
        h2d[chunks.len() - 1] - h2d[first_decode - 1],
        common_metric(&st, "fetched_pages") * PAGE_BYTES
    );
    Ok(())
}

#[test]
fn bad_settings_name_the_key() -> Result<()> {
    for (spec, key) in [
        ("quest:page=0", "page"),
        ("quest:budget=4,page=16", "budget"),
        ("quest:fraction=1.5", "fraction"),
        ("flexicache:threshold=2", "threshold"),
        ("clo:similarity=-0.5", "similarity"),
        ("clo:window=0", "window"),
    ] {
        let err = build_policy(spec, &PolicyOptions::default())
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains(key), "{spec}: {err}");
    }
    Ok(())
}

#[test]
fn pages_come_from_the_disk_tier_too() -> Result<()> {
    // Every layer's K/V in the disk tier's files: pages are read from disk, page-sized.
    let dir = tempfile::tempdir()?;
    let opts = PolicyOptions {
        disk_dir: Some(dir.path().to_path_buf()),
        ..PolicyOptions::default()
    };
    let specs = specs(true);
    let mut full = build_policy("full", &PolicyOptions::default())?;
    let (want, _) = drive(full.as_mut(), &specs, &chunks())?;
    for name in POLICIES {
        let spec = format!("{name}:page=8,sinks=8,window=16,budget=4096");
        let mut p = build_policy(&spec, &opts)?;
        let (got, _) = drive(p.as_mut(), &specs, &chunks())?;
        let diff = max_diff(&want, &got)?;
        assert!(diff <= 1e-5, "{spec} on disk: {diff}");
        let st = p.stats();
        assert!(st.disk_read_bytes > 0, "{spec}: {st:?}");
        assert_eq!(st.host_kv_bytes, 0, "{spec}: nothing in RAM");
    }
    Ok(())
}

#[test]
fn flexicache_reranking_every_step_attends_what_quest_does() -> Result<()> {
    // Re-ranked every step, a stable head attends its fresh top pages and an unstable one
    // its top pages among all: Quest's selection, through the persistent caches.
    let specs = specs(true);
    let base = "page=8,sinks=8,window=16,budget=16";
    let mut quest = build_policy(&format!("quest:{base}"), &PolicyOptions::default())?;
    let (want, _) = drive(quest.as_mut(), &specs, &chunks())?;
    for threshold in ["0", "1"] {
        let spec = format!("flexicache:{base},rerank=1,threshold={threshold}");
        let mut p = build_policy(&spec, &PolicyOptions::default())?;
        let (got, _) = drive(p.as_mut(), &specs, &chunks())?;
        let diff = max_diff(&want, &got)?;
        assert!(diff <= 1e-6, "{spec}: {diff}");
    }
    Ok(())
}

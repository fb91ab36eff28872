//! A full disk under the disk tier (issue "beyond host memory"): the growth that does not
//! fit is a clear error, the file is cut back to its previous size, and the cache goes on
//! at its previous length once there is room again — with `full`'s logits, exactly.
//!
//! A file-size limit (`RLIMIT_FSIZE`, its `SIGXFSZ` caught instead of fatal) stands in for
//! the full disk: writes past it fail with `EFBIG` as they would with `ENOSPC`. The limit
//! holds for the whole process, so this file holds one test.
mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::{Context, Result};
use candle_core::{Device, Tensor};
use kvpolicy::models::{prefill, ModelError};
use kvpolicy::{build_policy, CausalLm, KvError, KvPolicy, LogitsMode, PolicyOptions};
use rlimit::Resource;

/// The logits of token `id` at position `pos` `(vocab,)`.
fn step(
    model: &dyn CausalLm,
    p: &mut dyn KvPolicy,
    id: u32,
    pos: usize,
) -> std::result::Result<Tensor, ModelError> {
    let ids = Tensor::new(&[id], &Device::Cpu)?.unsqueeze(0)?;
    Ok(model
        .forward(&ids, pos, p, LogitsMode::Last)?
        .flatten_all()?)
}

/// The sizes of the disk tier's (unnamed) files in `dir`, sorted.
fn sizes(dir: &std::path::Path) -> Result<Vec<u64>> {
    let mut v = Vec::new();
    for link in common::unnamed_files("self", dir)? {
        v.push(std::fs::metadata(link)?.len());
    }
    v.sort();
    Ok(v)
}

#[test]
fn a_full_disk_is_an_error_and_the_cache_goes_on_at_its_length() -> Result<()> {
    let name = "llama_gqa";
    let loaded = common::load_fixture(name)?;
    let model = loaded.model.as_ref();
    let (prompt, decode) = common::fixture_ids(name)?;
    let p0 = prompt.len();
    let n = p0 + 48;
    let ids: Vec<u32> = prompt
        .iter()
        .chain(&decode)
        .copied()
        .cycle()
        .take(n)
        .collect();

    let mut full = build_policy("full", &PolicyOptions::default())?;
    prefill(model, full.as_mut(), &ids[..p0], 5, false)?;
    let want = (p0..n)
        .map(|pos| step(model, full.as_mut(), ids[pos], pos))
        .collect::<std::result::Result<Vec<_>, _>>()?;

    let dir = tempfile::tempdir()?;
    let opts = PolicyOptions {
        // Files grow 32 tokens at a time: the limit is met within the 48 steps.
        grow_tokens: 4,
        disk_dir: Some(dir.path().to_path_buf()),
        ..PolicyOptions::default()
    };
    let mut p = build_policy("headwise:1", &opts)?;
    prefill(model, p.as_mut(), &ids[..p0], 5, false)?;
    let before = sizes(dir.path())?;
    let limit = *before.last().context("no disk-tier file")?;

    let caught = Arc::new(AtomicBool::new(false));
    signal_hook::flag::register(signal_hook::consts::SIGXFSZ, caught.clone())?;
    let (soft, hard) = Resource::FSIZE.get()?;
    Resource::FSIZE.set(limit, hard)?;
    let mut pos = p0;
    let failed = loop {
        if pos == n {
            break None;
        }
        match step(model, p.as_mut(), ids[pos], pos) {
            Ok(got) => {
                assert!(common::max_abs_diff(&got, &want[pos - p0])? <= 1e-5);
                pos += 1;
            }
            Err(e) => break Some(e),
        }
    };
    let after = sizes(dir.path())?;
    Resource::FSIZE.set(soft, hard)?;

    match failed.context("no step met the file-size limit")? {
        ModelError::Policy(KvError::Disk { what, source }) => {
            assert!(what.contains("cannot grow"), "{what}");
            assert_eq!(source.raw_os_error(), Some(27), "{source}"); // EFBIG
        }
        other => anyhow::bail!("expected a disk error, got {other}"),
    }
    assert!(caught.load(Ordering::SeqCst), "no SIGXFSZ");
    // The failed growth was cut back; the cache holds what it held before the step.
    assert_eq!(after, before);
    assert_eq!(p.seq_len(), pos);
    // With room again, the same step and the rest give `full`'s logits.
    for at in pos..n {
        let got = step(model, p.as_mut(), ids[at], at)?;
        assert!(common::max_abs_diff(&got, &want[at - p0])? <= 1e-5, "{at}");
    }
    assert!(sizes(dir.path())?.iter().all(|&s| s > limit));
    drop(p);
    assert!(sizes(dir.path())?.is_empty());
    Ok(())
}

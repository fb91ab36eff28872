//! Two processes sharing one prefix-cache directory (issue "KV reuse across requests",
//! item 5): each stores and reads the same chunks over and over while the other writes,
//! replaces and evicts them under a budget smaller than the set. A read finds a whole chunk
//! with exactly the values stored under its key, or nothing — never a half-written file
//! (which would fail its checks and count as damaged) — and no temporary is left behind.
use std::path::Path;
use std::process::Command;

use anyhow::{ensure, Context, Result};
use candle_core::{Device, Tensor};
use kvpolicy_core::DiskIo;
use kvpolicy_prefix::disk::DiskTier;
use kvpolicy_prefix::{chunk_keys, ChunkKv, FingerprintBuilder, LayerKv};

/// Set in the children: the shared directory.
const CHILD_DIR: &str = "KVPOLICY_PREFIX_TEST_DIR";
const KEYS: usize = 12;
const ROUNDS: usize = 40;

/// Chunk `i`: 4 layers × 4 heads × 64 tokens × 64 (256 KiB of f32), values from `i`.
fn chunk(i: usize) -> Result<ChunkKv> {
    let layers = (0..4)
        .map(|l| -> Result<LayerKv> {
            let n = 4 * 64 * 64;
            let k = Tensor::arange(0u32, n as u32, &Device::Cpu)?
                .to_dtype(candle_core::DType::F32)?
                .affine(1e-3, (1000 * i + l) as f64)?
                .reshape((1, 4, 64, 64))?;
            Ok(LayerKv { v: k.neg()?, k })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(ChunkKv { layers })
}

fn equal(a: &ChunkKv, b: &ChunkKv) -> Result<bool> {
    for (x, y) in a.layers.iter().zip(&b.layers) {
        for (s, t) in [(&x.k, &y.k), (&x.v, &y.v)] {
            if s.flatten_all()?.to_vec1::<f32>()? != t.flatten_all()?.to_vec1::<f32>()? {
                return Ok(false);
            }
        }
    }
    Ok(a.layers.len() == b.layers.len())
}

/// One child's work: store and read every chunk, `ROUNDS` times, in an order of its own.
fn child(dir: &Path, me: usize) -> Result<()> {
    let fp = FingerprintBuilder::new().field("model", b"shared").finish();
    let keys = chunk_keys(&fp, &(0..KEYS as u32).collect::<Vec<_>>(), 1);
    let file = 256 << 10;
    // Room for a third of the chunks: both processes evict all the time.
    let mut disk = DiskTier::open(dir, (KEYS as u64 / 3) * (file + 8192), DiskIo::Direct)?;
    let (mut found, mut missed) = (0, 0);
    for round in 0..ROUNDS {
        for j in 0..KEYS {
            let i = (j * (me + 1) + round) % KEYS;
            if (round + me).is_multiple_of(2) {
                disk.put(&fp, &keys[i], &chunk(i)?)?;
            }
            match disk.get(&fp, &keys[i])? {
                Some(c) => {
                    ensure!(equal(&c, &chunk(i)?)?, "chunk {i} read with other values");
                    found += 1;
                }
                None => missed += 1,
            }
        }
    }
    let damaged = disk.counts().damaged;
    ensure!(
        damaged == 0,
        "{damaged} files failed their checks (half-written?)"
    );
    println!("child {me}: {found} found, {missed} missed");
    Ok(())
}

#[test]
fn two_processes_never_read_each_others_half_written_chunks() -> Result<()> {
    if let Some(dir) = std::env::var_os(CHILD_DIR) {
        let me: usize = std::env::var("KVPOLICY_PREFIX_TEST_ME")?.parse()?;
        return child(Path::new(&dir), me);
    }
    let dir = tempfile::tempdir()?;
    let exe = std::env::current_exe()?;
    let children = (0..2)
        .map(|me| {
            Command::new(&exe)
                .args([
                    "--exact",
                    "two_processes_never_read_each_others_half_written_chunks",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env(CHILD_DIR, dir.path())
                .env("KVPOLICY_PREFIX_TEST_ME", me.to_string())
                .spawn()
                .context("spawning a child")
        })
        .collect::<Result<Vec<_>>>()?;
    for c in children {
        let out = c.wait_with_output()?;
        ensure!(out.status.success(), "a child failed: {:?}", out.status);
    }
    // Only whole chunk files remain: no temporary of either process.
    for e in std::fs::read_dir(dir.path())? {
        let name = e?.file_name().to_string_lossy().into_owned();
        ensure!(
            name.ends_with(".kvc") && !name.starts_with('.'),
            "left behind: {name}"
        );
    }
    Ok(())
}

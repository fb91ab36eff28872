//! The prefix cache's tiers on synthetic chunks: bytes counted exactly and never above a
//! budget, least recently used evicted first, damaged, truncated, foreign or linked files
//! never read as K/V, files written whole with the process's umask.
use std::os::unix::fs::PermissionsExt;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use kvpolicy_core::DiskIo;
use kvpolicy_prefix::chunk::{self, round_up};
use kvpolicy_prefix::disk::DiskTier;
use kvpolicy_prefix::ram::RamTier;
use kvpolicy_prefix::{
    chunk_keys, ChunkKey, ChunkKv, FingerprintBuilder, LayerKv, PrefixCache, PrefixConfig, Tier,
};
use proptest::prelude::*;

const LAYERS: usize = 3;

/// A chunk of `tokens` tokens whose values encode `seed`.
fn chunk(tokens: usize, seed: f32) -> Result<ChunkKv> {
    let layers = (0..LAYERS)
        .map(|l| -> Result<LayerKv> {
            let n = 2 * tokens * 4;
            let base = seed * 100.0 + l as f32;
            let k = Tensor::arange(0f32, n as f32, &Device::Cpu)?
                .affine(0.5, base as f64)?
                .reshape((1, 2, tokens, 4))?;
            Ok(LayerKv {
                v: (k.clone() * -1.0)?,
                k,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(ChunkKv { layers })
}

fn same(a: &ChunkKv, b: &ChunkKv) -> Result<bool> {
    for (x, y) in a.layers.iter().zip(&b.layers) {
        for (s, t) in [(&x.k, &y.k), (&x.v, &y.v)] {
            let d = (s - t)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
            if d != 0.0 {
                return Ok(false);
            }
        }
    }
    Ok(a.layers.len() == b.layers.len())
}

fn keys(n: usize) -> Vec<ChunkKey> {
    let fp = FingerprintBuilder::new().field("m", b"1").finish();
    chunk_keys(&fp, &(0..n as u32).collect::<Vec<_>>(), 1)
}

fn file_len(c: &ChunkKv) -> Result<u64> {
    let fp = FingerprintBuilder::new().finish();
    Ok(chunk::encode(&fp, &keys(1)[0], c)?.len() as u64)
}

#[test]
fn ram_evicts_the_least_recently_used_and_counts_bytes_exactly() -> Result<()> {
    let one = chunk(4, 0.0)?.bytes();
    assert_eq!(one, (LAYERS * 2 * 2 * 4 * 4 * 4) as u64);
    let mut ram = RamTier::new(2 * one + one / 2);
    let k = keys(4);
    for (i, key) in k.iter().enumerate() {
        assert!(ram.put(*key, chunk(4, i as f32)?));
        assert!(ram.bytes() <= 2 * one + one / 2);
    }
    // The two newest remain.
    assert!(!ram.contains(&k[0]) && !ram.contains(&k[1]));
    assert!(ram.contains(&k[2]) && ram.contains(&k[3]));
    assert_eq!((ram.bytes(), ram.len(), ram.evictions()), (2 * one, 2, 2));
    // A use makes a chunk the newest: the other one goes next.
    assert!(ram.get(&k[2]).is_some());
    ram.put(k[0], chunk(4, 0.0)?);
    assert!(ram.contains(&k[2]) && !ram.contains(&k[3]));
    // Larger than the whole budget: not kept, nothing evicted for it.
    assert!(!ram.put(k[1], chunk(16, 1.0)?));
    assert_eq!(ram.len(), 2);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn ram_bytes_never_exceed_the_budget(
        budget in 0u64..4000,
        ops in prop::collection::vec((0usize..6, 1usize..6, any::<bool>()), 1..40),
    ) {
        let k = keys(6);
        let mut ram = RamTier::new(budget);
        let mut sizes = std::collections::HashMap::new();
        for (key, tokens, get) in ops {
            if get {
                ram.get(&k[key]);
            } else {
                let c = chunk(tokens, 0.0).map_err(|e| TestCaseError::fail(e.to_string()))?;
                let bytes = c.bytes();
                // A chunk larger than the budget is not kept (what the key held stays).
                if ram.put(k[key], c) {
                    sizes.insert(key, bytes);
                }
            }
            prop_assert!(ram.bytes() <= budget);
            let held: u64 = (0..6).filter(|&i| ram.contains(&k[i])).map(|i| sizes[&i]).sum();
            prop_assert_eq!(held, ram.bytes());
        }
    }
}

#[test]
fn files_round_trip_and_evict_oldest_first() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let fp = FingerprintBuilder::new().field("m", b"1").finish();
    let len = file_len(&chunk(4, 0.0)?)?;
    assert_eq!(len % 4096, 0);
    let k = keys(4);
    let mut disk = DiskTier::open(dir.path(), 2 * len + 1, DiskIo::Direct)?;
    for (i, key) in k.iter().enumerate() {
        assert!(disk.put(&fp, key, &chunk(4, i as f32)?)?);
    }
    let c = disk.counts();
    assert_eq!((c.bytes, c.files, c.evictions), (2 * len, 2, 2));
    assert!(disk.get(&fp, &k[0])?.is_none());
    let got = disk
        .get(&fp, &k[3])?
        .ok_or_else(|| anyhow::anyhow!("chunk 3 missing"))?;
    assert!(same(&got, &chunk(4, 3.0)?)?);
    // The directory holds exactly the two files counted: no temporaries left.
    let names: Vec<String> = std::fs::read_dir(dir.path())?
        .map(|e| Ok(e?.file_name().to_string_lossy().into_owned()))
        .collect::<Result<_>>()?;
    assert_eq!(names.len(), 2, "{names:?}");
    // Reopened, the index is rebuilt from the files.
    let again = DiskTier::open(dir.path(), 2 * len + 1, DiskIo::Buffered)?;
    assert_eq!(again.counts().bytes, 2 * len);
    Ok(())
}

#[test]
fn damaged_truncated_and_foreign_files_are_misses_and_removed() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let fp = FingerprintBuilder::new().field("m", b"1").finish();
    let other = FingerprintBuilder::new().field("m", b"2").finish();
    let k = keys(3);
    let mut disk = DiskTier::open(dir.path(), u64::MAX, DiskIo::Direct)?;
    for key in &k {
        disk.put(&fp, key, &chunk(4, 1.0)?)?;
    }
    let path = |key: &ChunkKey| dir.path().join(format!("{}.kvc", key.hex()));
    // One flipped byte in the payload.
    let mut bytes = std::fs::read(path(&k[0]))?;
    let at = round_up(200) + 17;
    bytes[at] ^= 1;
    std::fs::write(path(&k[0]), &bytes)?;
    // Truncated by a page.
    let f = std::fs::OpenOptions::new().write(true).open(path(&k[1]))?;
    f.set_len(f.metadata()?.len() - 4096)?;
    for key in &k[..2] {
        assert!(disk.get(&fp, key)?.is_none());
        assert!(!path(key).exists(), "a damaged file stays");
    }
    // Read as another model's: its fingerprint does not match.
    assert!(disk.get(&other, &k[2])?.is_none());
    assert!(!path(&k[2]).exists());
    assert_eq!(disk.counts().damaged, 3);
    assert_eq!(disk.counts().files, 0);
    Ok(())
}

#[test]
fn links_are_not_followed_out_of_the_directory() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let outside = tempfile::tempdir()?;
    let fp = FingerprintBuilder::new().field("m", b"1").finish();
    let k = keys(1);
    // A valid chunk file outside, linked in under the chunk's name.
    let mut elsewhere = DiskTier::open(outside.path(), u64::MAX, DiskIo::Buffered)?;
    elsewhere.put(&fp, &k[0], &chunk(4, 1.0)?)?;
    let target = outside.path().join(format!("{}.kvc", k[0].hex()));
    std::os::unix::fs::symlink(&target, dir.path().join(format!("{}.kvc", k[0].hex())))?;
    let mut disk = DiskTier::open(dir.path(), u64::MAX, DiskIo::Direct)?;
    assert_eq!(disk.counts().files, 0, "a link is not indexed");
    assert!(disk.get(&fp, &k[0])?.is_none(), "a link is not read");
    assert!(target.exists(), "the target is not touched");
    Ok(())
}

#[test]
fn files_take_the_process_umask() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let fp = FingerprintBuilder::new().finish();
    let k = keys(1);
    // A mask whose result is neither tempfile's 0600 nor a fixed 0644: 0666 & !027 = 0640.
    // SAFETY: umask only swaps the process's mask; the old one is put back below.
    let c = chunk(2, 0.0)?;
    let old = unsafe { libc::umask(0o027) };
    let put = DiskTier::open(dir.path(), u64::MAX, DiskIo::Direct)
        .and_then(|mut d| d.put(&fp, &k[0], &c));
    // SAFETY: as above.
    unsafe { libc::umask(old) };
    put?;
    let mode = std::fs::metadata(dir.path().join(format!("{}.kvc", k[0].hex())))?
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(mode, 0o640);
    Ok(())
}

#[test]
fn the_cache_restores_from_ram_then_from_files() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let fp = FingerprintBuilder::new().field("m", b"1").finish();
    let cfg = PrefixConfig {
        chunk_tokens: 4,
        ram_bytes: chunk(4, 0.0)?.bytes(),
        dir: Some(dir.path().to_path_buf()),
        ..PrefixConfig::default()
    };
    let mut cache = PrefixCache::open(&cfg, fp)?;
    let k = cache.keys(&[1, 2, 3, 4, 5, 6, 7, 8]);
    cache.put(k[0], chunk(4, 0.0)?)?;
    cache.put(k[1], chunk(4, 1.0)?)?;
    // RAM holds one chunk: the newest. The older comes from its file (and then RAM).
    let (c1, t1) = cache.get(&k[1])?.ok_or_else(|| anyhow::anyhow!("miss"))?;
    let (c0, t0) = cache.get(&k[0])?.ok_or_else(|| anyhow::anyhow!("miss"))?;
    assert_eq!((t1, t0), (Tier::Ram, Tier::Disk));
    assert!(same(&c0, &chunk(4, 0.0)?)? && same(&c1, &chunk(4, 1.0)?)?);
    let s = cache.stats();
    // Tokens count when a request restores them (restore_prefix), not on a lookup.
    assert_eq!(
        (s.hits, s.misses, s.tokens_from_ram, s.tokens_from_disk),
        (2, 0, 0, 0)
    );
    assert_eq!(s.ram_bytes, chunk(4, 0.0)?.bytes());
    assert_eq!(s.disk_bytes, 2 * file_len(&chunk(4, 0.0)?)?);
    // A chunk of another size is refused.
    assert!(cache.put(k[1], chunk(3, 0.0)?).is_err());
    let _ = DType::F32;
    Ok(())
}

//! What a chunk or session file must be before it is read (issue #53, items 11, 12 and 16):
//! its header is checked first — magic, version, the model, the key, every dimension
//! against what the cache expects, its length against the file's — and only then is its
//! payload read; a chunk of another shape is a miss and its file removed; opening a cache
//! removes only its own stale temporaries.
mod common;

use std::time::{Duration, SystemTime};

use anyhow::{ensure, Context, Result};
use candle_core::DType;
use common::{chunk, chunk_of, chunk_path, fp, specs, DIM, HEADS, LAYERS};
use kvpolicy_core::DiskIo;
use kvpolicy_prefix::chunk::{self, ALIGN};
use kvpolicy_prefix::disk::DiskTier;
use kvpolicy_prefix::{chunk_keys, PrefixCache, PrefixConfig, PrefixError, Session};

/// Grows `path` by `extra` bytes of zeros (a hole: no block is written).
fn grow(path: &std::path::Path, extra: u64) -> Result<()> {
    let f = std::fs::OpenOptions::new().write(true).open(path)?;
    f.set_len(f.metadata()?.len() + extra)?;
    Ok(())
}

fn cfg(dir: &std::path::Path) -> PrefixConfig {
    PrefixConfig {
        chunk_tokens: 4,
        ram_bytes: 0,
        dir: Some(dir.to_path_buf()),
        disk_bytes: u64::MAX,
        disk_io: DiskIo::Direct,
    }
}

#[test]
fn a_chunk_file_is_refused_by_its_header_before_its_payload_is_read() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let fp = fp();
    let k = chunk_keys(&fp, &[1, 2, 3], 1);
    let mut disk = DiskTier::open(dir.path(), u64::MAX, DiskIo::Direct)?;
    for key in &k {
        disk.put(&fp, key, &chunk(4, 1.0)?)?;
    }
    // A whole chunk followed by 8 GiB of zeros (sparse): its header says how long it is.
    grow(&chunk_path(dir.path(), &k[0]), 8 << 30)?;
    // A header whose dimensions claim far more payload than the file holds.
    let mut bytes = std::fs::read(chunk_path(dir.path(), &k[1]))?;
    bytes[72..76].copy_from_slice(&(1u32 << 30).to_le_bytes());
    std::fs::write(chunk_path(dir.path(), &k[1]), &bytes)?;
    let mut disk = DiskTier::open(dir.path(), u64::MAX, DiskIo::Direct)?;
    for key in &k[..2] {
        ensure!(
            disk.get(&fp, key)?.is_none(),
            "a file its header refuses was read"
        );
        ensure!(
            !chunk_path(dir.path(), key).exists(),
            "a refused file stays"
        );
    }
    ensure!(disk.counts().damaged == 2);
    // Neither payload was read: only their header pages.
    ensure!(
        disk.counts().read_bytes <= 2 * ALIGN as u64,
        "{} bytes read for two refused headers",
        disk.counts().read_bytes
    );
    // The whole file next to them reads.
    ensure!(disk.get(&fp, &k[2])?.is_some());
    Ok(())
}

#[test]
fn a_session_file_is_refused_by_its_header_before_its_payload_is_read() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let fp = fp();
    let s = Session {
        fingerprint: fp,
        ids: vec![1, 2, 3, 4, 5],
        kv: chunk(4, 1.0)?,
    };
    // 32 GiB of zeros (sparse) after a whole session: refused by the lengths its headers
    // give, not read (a read of it would not fit this process).
    let long = dir.path().join("long.kvs");
    s.save(&long)?;
    grow(&long, 32 << 30)?;
    // A header claiming 2^40 token ids in a file of a few pages.
    let many = dir.path().join("many.kvs");
    s.save(&many)?;
    let mut bytes = std::fs::read(&many)?;
    bytes[40..48].copy_from_slice(&(1u64 << 40).to_le_bytes());
    std::fs::write(&many, &bytes)?;
    for path in [&long, &many] {
        match Session::load(path, &fp) {
            Err(PrefixError::Session { why, .. }) => ensure!(
                why.contains("length") || why.contains("truncated"),
                "{}: {why}",
                path.display()
            ),
            other => anyhow::bail!("{}: expected a refusal, got {other:?}", path.display()),
        }
    }
    // The same session, whole, loads.
    let good = dir.path().join("good.kvs");
    s.save(&good)?;
    let back = Session::load(&good, &fp)?;
    ensure!(back.ids == s.ids && common::same(&back.kv, &s.kv)?);
    Ok(())
}

#[test]
fn a_chunk_of_another_shape_is_a_miss_and_its_file_is_removed() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let fp = fp();
    let wrong = [
        ("tokens", chunk_of(LAYERS, HEADS, 3, DIM, 1.0)?),
        ("KV heads", chunk_of(LAYERS, 1, 4, DIM, 1.0)?),
        ("head width", chunk_of(LAYERS, HEADS, 4, 2 * DIM, 1.0)?),
        ("layers", chunk_of(LAYERS - 1, HEADS, 4, DIM, 1.0)?),
        ("dtype", common::cast(&chunk(4, 1.0)?, DType::F16)?),
    ];
    let ids: Vec<u32> = (0..4 * (wrong.len() as u32 + 1)).collect();
    let mut cache = PrefixCache::open(&cfg(dir.path()), fp)?;
    cache.expect_layers(&specs());
    let keys = cache.keys(&ids);
    for ((what, c), key) in wrong.iter().zip(&keys) {
        // A well-formed file with a right checksum, the model's fingerprint and the key.
        std::fs::write(chunk_path(dir.path(), key), chunk::encode(&fp, key, c)?)?;
        ensure!(
            cache.get(key)?.is_none(),
            "a chunk of other {what} was found"
        );
        ensure!(
            !chunk_path(dir.path(), key).exists(),
            "a chunk of other {what} stays"
        );
    }
    ensure!(cache.stats().damaged == wrong.len() as u64);
    // One of the model's shape is found.
    let key = keys[wrong.len()];
    std::fs::write(
        chunk_path(dir.path(), &key),
        chunk::encode(&fp, &key, &chunk(4, 2.0)?)?,
    )?;
    ensure!(cache.get(&key)?.is_some());
    Ok(())
}

#[test]
fn a_chunk_of_other_tokens_is_a_miss_without_the_layers_known() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let fp = fp();
    let mut cache = PrefixCache::open(&cfg(dir.path()), fp)?;
    let key = cache.keys(&[1, 2, 3, 4])[0];
    std::fs::write(
        chunk_path(dir.path(), &key),
        chunk::encode(&fp, &key, &chunk(3, 1.0)?)?,
    )?;
    ensure!(
        cache.get(&key)?.is_none(),
        "a 3-token chunk in a 4-token cache"
    );
    ensure!(!chunk_path(dir.path(), &key).exists());
    Ok(())
}

#[test]
fn opening_a_cache_removes_only_its_own_stale_temporaries() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let old = SystemTime::now() - Duration::from_secs(2 * 3600);
    let names = [".kvc-notmine", ".kvc-notes.txt", ".kvc-abc.part"];
    for name in names {
        let f = std::fs::File::create(dir.path().join(name))?;
        f.set_modified(old)?;
    }
    // A temporary of ours, left two hours ago by a process that died writing it.
    let ours = dir
        .path()
        .join(format!(".kvc-tmp-{}-Ab3dE9xZ.part", std::process::id()));
    std::fs::File::create(&ours)?.set_modified(old)?;
    PrefixCache::open(&cfg(dir.path()), fp())?;
    for name in names {
        ensure!(dir.path().join(name).exists(), "{name} was removed");
    }
    ensure!(!ours.exists(), "a stale temporary of ours stays");
    // What the cache writes now is a temporary it recognises, then a chunk file.
    let mut cache = PrefixCache::open(&cfg(dir.path()), fp())?;
    let key = cache.keys(&[1, 2, 3, 4])[0];
    cache.put(key, chunk(4, 1.0)?)?;
    let left: Vec<String> = std::fs::read_dir(dir.path())?
        .map(|e| Ok(e?.file_name().to_string_lossy().into_owned()))
        .collect::<Result<_>>()?;
    ensure!(left.len() == names.len() + 1, "{left:?}");
    std::fs::metadata(chunk_path(dir.path(), &key)).context("the chunk file")?;
    Ok(())
}

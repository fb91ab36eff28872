//! A disk or RAM budget smaller than a prompt's chunks (issue #53, item 14): restores start
//! at a prompt's first chunk, so what a budget keeps must be a prefix — a chunk that does
//! not fit never evicts the chunks before it, and eviction takes a chain's later chunks
//! before its earlier ones.
mod common;

use anyhow::{ensure, Context, Result};
use common::{chunk, fp, same};
use kvpolicy_core::DiskIo;
use kvpolicy_prefix::chunk;
use kvpolicy_prefix::{store_new, PrefixCache, PrefixConfig};

/// Bytes of one 4-token chunk's file.
fn file_len() -> Result<u64> {
    let key = kvpolicy_prefix::chunk_keys(&fp(), &[0], 1)[0];
    Ok(chunk::encode(&fp(), &key, &chunk(4, 0.0)?)?.len() as u64)
}

/// A cache of 4-token chunks with room for `n` chunks in RAM (no directory) or on disk
/// (no RAM).
fn caches(dir: &std::path::Path, n: u64) -> Result<Vec<(&'static str, PrefixCache)>> {
    let on_disk = PrefixConfig {
        chunk_tokens: 4,
        ram_bytes: 0,
        dir: Some(dir.to_path_buf()),
        disk_bytes: n * file_len()? + 100,
        disk_io: DiskIo::Buffered,
    };
    let in_ram = PrefixConfig {
        chunk_tokens: 4,
        ram_bytes: n * chunk(4, 0.0)?.bytes() + 100,
        dir: None,
        ..PrefixConfig::default()
    };
    Ok(vec![
        ("disk", PrefixCache::open(&on_disk, fp())?),
        ("ram", PrefixCache::open(&in_ram, fp())?),
    ])
}

#[test]
fn a_budget_of_two_chunks_keeps_a_prompts_first_two() -> Result<()> {
    let dir = tempfile::tempdir()?;
    // Five whole chunks and one token more.
    let prompt: Vec<u32> = (100..121).collect();
    let kv = chunk(20, 1.0)?;
    for (tier, mut cache) in caches(dir.path(), 2)? {
        let stored = store_new(&mut cache, &prompt, 0, &kv)?;
        ensure!(stored == 2, "{tier}: {stored} chunks stored");
        let keys = cache.keys(&prompt);
        for (i, key) in keys.iter().enumerate() {
            ensure!(cache.contains(key) == (i < 2), "{tier}: chunk {i}");
        }
        // They restore: the values of the prompt's first two chunks.
        for (i, key) in keys[..2].iter().enumerate() {
            let (got, _) = cache
                .get(key)?
                .ok_or_else(|| anyhow::anyhow!("{tier}: chunk {i} missing"))?;
            ensure!(
                same(&got, &kv.narrow(4 * i, 4)?)?,
                "{tier}: chunk {i} values"
            );
        }
    }
    Ok(())
}

#[test]
fn eviction_takes_a_chains_last_chunks_first() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let (a, b): (Vec<u32>, Vec<u32>) = ((0..9).collect(), (50..59).collect());
    for (tier, mut cache) in caches(dir.path(), 3)? {
        // Prompt a's two chunks, then b's: the third chunk stored evicts one of a's — its
        // second, so that a still restores its first.
        store_new(&mut cache, &a, 0, &chunk(8, 1.0)?)?;
        store_new(&mut cache, &b, 0, &chunk(8, 2.0)?)?;
        let (ka, kb) = (cache.keys(&a), cache.keys(&b));
        ensure!(
            cache.contains(&ka[0]),
            "{tier}: a's first chunk was evicted"
        );
        ensure!(!cache.contains(&ka[1]), "{tier}: a's second chunk stays");
        ensure!(
            cache.contains(&kb[0]) && cache.contains(&kb[1]),
            "{tier}: b"
        );
    }
    Ok(())
}

/// In a server's pool (`PrefixCache::pooled`) the RAM tier's bytes are the pool ledger's:
/// a chunk is kept only where the pool has room beside what the live sequences hold,
/// evicting older unleased chunks for it; a live sequence gets the room back
/// (`evict_for`), never from a leased chunk; a dropped cache gives its bytes back.
#[test]
fn in_a_pool_the_cache_shares_one_budget_with_live_sequences() -> Result<()> {
    use kvpolicy_core::{KvPool, PoolTier};
    let per_chunk = chunk(4, 0.0)?.bytes();
    let pool = KvPool::new(Some(4 * per_chunk), None);
    let cfg = PrefixConfig {
        chunk_tokens: 4,
        ram_bytes: 100 * per_chunk,
        dir: None,
        ..PrefixConfig::default()
    };
    let mut cache = PrefixCache::open(&cfg, fp())?.pooled(pool.clone(), PoolTier::Device);
    // A live sequence holds two chunks' worth of the pool.
    pool.device.add(2 * per_chunk);
    let (a, b): (Vec<u32>, Vec<u32>) = ((0..9).collect(), (50..59).collect());
    store_new(&mut cache, &a, 0, &chunk(8, 1.0)?)?;
    ensure!(
        pool.device.used() == 4 * per_chunk,
        "{}",
        pool.device.used()
    );
    // b's chunks fit only by evicting a's (its later one first); a's first is leased.
    let lease = cache
        .leased(&cache.keys(&a)[0])
        .context("a's first chunk")?;
    store_new(&mut cache, &b, 0, &chunk(8, 2.0)?)?;
    ensure!(
        cache.contains(&cache.keys(&a)[0]),
        "a leased chunk was evicted"
    );
    ensure!(!cache.contains(&cache.keys(&a)[1]));
    ensure!(pool.device.used() <= 4 * per_chunk);
    // The live sequence needs two more chunks' room: only unleased chunks go (b's), not
    // enough while a's first is leased; once it is not, it goes too.
    ensure!(!cache.evict_for(2 * per_chunk));
    ensure!(cache.contains(&cache.keys(&a)[0]) && !cache.contains(&cache.keys(&b)[0]));
    drop(lease);
    ensure!(cache.evict_for(2 * per_chunk));
    ensure!(!cache.contains(&cache.keys(&a)[0]));
    ensure!(cache.stats().ram_bytes == 0);
    store_new(&mut cache, &a, 0, &chunk(8, 1.0)?)?;
    ensure!(pool.device.used() == 4 * per_chunk);
    drop(cache);
    ensure!(
        pool.device.used() == 2 * per_chunk,
        "{}",
        pool.device.used()
    );
    Ok(())
}

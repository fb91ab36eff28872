//! Who may write what the cache reads (issue #53, items 13 and 15): a cache directory or a
//! session file that another user can write is refused with a clear error (as ssh refuses
//! such a `~/.ssh`), since planted K/V with a valid checksum would change outputs; a write
//! that fails (the directory removed, a full disk) is counted by kind and logged once.
mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;

use anyhow::{bail, ensure, Context, Result};
use common::{chmod, chunk, chunk_path, fp};
use kvpolicy_core::DiskIo;
use kvpolicy_prefix::{PrefixCache, PrefixConfig, PrefixError, Session};

fn cfg(dir: &Path) -> PrefixConfig {
    PrefixConfig {
        chunk_tokens: 4,
        ram_bytes: 1 << 20,
        dir: Some(dir.to_path_buf()),
        disk_bytes: u64::MAX,
        disk_io: DiskIo::Buffered,
    }
}

fn mode(path: &Path) -> Result<u32> {
    Ok(std::fs::metadata(path)?.permissions().mode() & 0o777)
}

#[test]
fn a_cache_directory_others_can_write_is_refused() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let dir = tmp.path().join("cache");
    std::fs::create_dir(&dir)?;
    for bad in [0o777, 0o770, 0o702] {
        chmod(&dir, bad)?;
        match PrefixCache::open(&cfg(&dir), fp()) {
            Err(e @ PrefixError::Untrusted { .. }) => {
                let msg = e.to_string();
                ensure!(
                    msg.contains(&dir.display().to_string()) && msg.contains("chmod go-w"),
                    "{bad:o}: {msg}"
                );
            }
            Err(e) => bail!("{bad:o}: another error: {e}"),
            Ok(_) => bail!("a directory of mode {bad:o} was opened"),
        }
    }
    for good in [0o700, 0o755] {
        chmod(&dir, good)?;
        PrefixCache::open(&cfg(&dir), fp()).with_context(|| format!("mode {good:o}"))?;
    }
    Ok(())
}

#[test]
fn a_new_cache_directory_is_private() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let dir = tmp.path().join("a/b");
    PrefixCache::open(&cfg(&dir), fp())?;
    ensure!(mode(&dir)? == 0o700, "mode {:o}", mode(&dir)?);
    Ok(())
}

#[test]
fn a_chunk_file_others_can_write_is_not_read() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let mut cache = PrefixCache::open(&cfg(tmp.path()), fp())?;
    let key = cache.keys(&[1, 2, 3, 4])[0];
    cache.put(key, chunk(4, 1.0)?)?;
    let path = chunk_path(tmp.path(), &key);
    ensure!(mode(&path)? & 0o022 == 0, "written as {:o}", mode(&path)?);
    chmod(&path, 0o666)?;
    // A fresh cache (nothing in RAM) finds only the file.
    let mut cache = PrefixCache::open(&cfg(tmp.path()), fp())?;
    ensure!(
        cache.get(&key)?.is_none(),
        "a file others can write was read"
    );
    ensure!(!path.exists());
    Ok(())
}

#[test]
fn a_session_file_others_can_write_is_refused() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let path = tmp.path().join("chat.kvs");
    let s = Session {
        fingerprint: fp(),
        ids: vec![1, 2, 3, 4, 5],
        kv: chunk(4, 1.0)?,
    };
    // Saved under a permissive umask, it is still private enough to load.
    // SAFETY: umask swaps the process's mask; the old one is put back below.
    let old = unsafe { libc::umask(0o002) };
    let saved = s.save(&path);
    // SAFETY: as above.
    unsafe { libc::umask(old) };
    saved?;
    ensure!(mode(&path)? & 0o022 == 0, "saved as {:o}", mode(&path)?);
    Session::load(&path, &fp())?;
    chmod(&path, 0o666)?;
    match Session::load(&path, &fp()) {
        Err(e @ PrefixError::Untrusted { .. }) => {
            let msg = e.to_string();
            ensure!(
                msg.contains("chat.kvs") && msg.contains("chmod go-w"),
                "{msg}"
            );
        }
        other => bail!("expected a refusal, got {other:?}"),
    }
    Ok(())
}

/// Set in the child of `the_first_write_error_of_each_kind_is_logged_once`.
const CHILD: &str = "KVPOLICY_PREFIX_TEST_WRITE_ERRORS";

/// Opens a cache, removes its directory, stores three chunks.
fn lose_the_directory(tmp: &Path) -> Result<kvpolicy_prefix::PrefixStats> {
    let dir = tmp.join("cache");
    let mut cache = PrefixCache::open(&cfg(&dir), fp())?;
    std::fs::remove_dir_all(&dir)?;
    let keys = cache.keys(&(0..12).collect::<Vec<_>>());
    let mut kept = Vec::new();
    for key in keys {
        kept.push(cache.put(key, chunk(4, 1.0)?)?);
    }
    // Kept in RAM all the same.
    ensure!(kept == [true; 3], "{kept:?}");
    Ok(cache.stats())
}

#[test]
fn a_vanished_directory_is_counted_as_a_write_error() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let s = lose_the_directory(tmp.path())?;
    ensure!(s.write_errors == 3, "{s:?}");
    ensure!(s.write_error_kinds.dir_missing == 3, "{s:?}");
    ensure!(s.write_error_kinds.no_space + s.write_error_kinds.other == 0);
    ensure!(s.stored == 3);
    Ok(())
}

#[test]
fn the_first_write_error_of_each_kind_is_logged_once() -> Result<()> {
    const NAME: &str = "the_first_write_error_of_each_kind_is_logged_once";
    if let Some(dir) = std::env::var_os(CHILD) {
        lose_the_directory(Path::new(&dir))?;
        return Ok(());
    }
    let tmp = tempfile::tempdir()?;
    let out = Command::new(std::env::current_exe()?)
        .args(["--exact", NAME, "--nocapture", "--test-threads=1"])
        .env(CHILD, tmp.path())
        .output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    ensure!(out.status.success(), "the child failed: {err}");
    let lines: Vec<&str> = err
        .lines()
        .filter(|l| l.contains("cannot write chunk files"))
        .collect();
    ensure!(lines.len() == 1, "{} lines logged: {err}", lines.len());
    let cache = tmp.path().join("cache");
    ensure!(
        lines[0].contains(&cache.display().to_string()) && lines[0].contains("dir_missing"),
        "{}",
        lines[0]
    );
    Ok(())
}

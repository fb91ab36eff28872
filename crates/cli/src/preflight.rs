//! Checks made before any work, for what would otherwise fail after it: the disk tier's
//! room (free bytes under `--disk-dir` against the K/V that must go there), descriptors
//! (one open file per layer on disk per request, against the open-file limit, raised to
//! its hard limit first as a server would) and a `--random-prompt` that memory cannot hold.
use anyhow::{bail, Result};
use kvpolicy::core::format_bytes;
use kvpolicy::tiered::free_disk_bytes;
use kvpolicy::{ModelInfo, PolicyOption};

use crate::args::Args;
use crate::registry;

/// Whether `args.kv.policy` puts layers on the disk tier (it reads `--disk-dir`, and one is
/// given).
fn uses_disk(args: &Args) -> bool {
    args.kv.disk_dir.is_some()
        && registry::registry()
            .reads(args.kv.policy_name())
            .is_ok_and(|r| r.contains(&PolicyOption::DiskDir))
}

/// Raises the soft open-file limit to the hard one and checks that requests of
/// `prompt_lens` tokens fit under it: one descriptor per layer that can go to disk (those
/// `--host-kv-budget` cannot hold at the request's final length, each request having its
/// own host tier), plus reads in flight.
pub fn check_descriptors(args: &Args, info: &ModelInfo, prompt_lens: &[usize]) -> Result<()> {
    if !uses_disk(args) {
        return Ok(());
    }
    let limit = rlimit::increase_nofile_limit(u64::MAX).unwrap_or(0);
    let reads_in_flight = (kvpolicy::tiered::READ_AHEAD + 1) as u64;
    let budget = args.kv.host_kv_budget.unwrap_or(0);
    let mut on_disk = 0u64;
    for &p in prompt_lens {
        // Host buffers grow in chunks: a layer may hold up to a few thousand tokens more
        // than the request's length, so fewer layers fit than the length alone says.
        let bytes = layer_bytes(args, info, final_len(args, info, p).saturating_add(4096));
        let widest = bytes.iter().copied().max().unwrap_or(0).max(1);
        let in_ram = (budget / widest).min(info.kv_layers() as u64);
        let files = info.kv_layers() as u64 - in_ram;
        if files > 0 {
            on_disk = on_disk.saturating_add(files + reads_in_flight);
        }
    }
    let needed = on_disk.saturating_add(64);
    if limit > 0 && needed > limit {
        bail!(
            "the disk tier may hold up to {needed} files open ({} requests, up to {} layers each past --host-kv-budget, and reads in flight) but the open-file limit is {limit}; raise it (`ulimit -n {needed}`), pass fewer prompts, or raise --host-kv-budget",
            prompt_lens.len(),
            info.kv_layers()
        );
    }
    Ok(())
}

/// Tokens a request of `prompt` tokens reaches.
fn final_len(args: &Args, info: &ModelInfo, prompt: usize) -> usize {
    prompt
        .saturating_add(args.max_new_tokens)
        .min(info.max_positions)
}

/// Each layer's K/V bytes at `t` tokens in the form the host tier stores (windowed layers
/// at their window).
fn layer_bytes(args: &Args, info: &ModelInfo, t: usize) -> Vec<u64> {
    let row = args.kv.host_codec().row_bytes(info.dtype, info.head_dim);
    let per_token = 2u64
        .saturating_mul(info.n_kv_heads as u64)
        .saturating_mul(row);
    let windows = info.kv_windows();
    (0..info.kv_layers())
        .map(|l| {
            let seen = match windows.get(l).copied().flatten() {
                Some(w) => t.min(w),
                None => t,
            };
            per_token.saturating_mul(seen as u64)
        })
        .collect()
}

/// Bytes of K/V the disk tier must hold for requests of `prompt_lens` tokens past
/// `--host-kv-budget`: a lower bound (windowed layers counted at their window, no block
/// padding), so that a refusal is certain to be right.
fn disk_bytes_needed(args: &Args, info: &ModelInfo, prompt_lens: &[usize]) -> u64 {
    let total = prompt_lens
        .iter()
        .map(|&p| {
            layer_bytes(args, info, final_len(args, info, p))
                .into_iter()
                .fold(0u64, u64::saturating_add)
        })
        .fold(0u64, u64::saturating_add);
    total.saturating_sub(args.kv.host_kv_budget.unwrap_or(0))
}

/// Checks that the file system under `--disk-dir` has room for the K/V that must go there
/// for requests of `prompt_lens` tokens (each growing by `--max-new-tokens`).
pub fn check_disk_room(args: &Args, info: &ModelInfo, prompt_lens: &[usize]) -> Result<()> {
    let (true, Some(dir)) = (uses_disk(args), &args.kv.disk_dir) else {
        return Ok(());
    };
    let needed = disk_bytes_needed(args, info, prompt_lens);
    let free = free_disk_bytes(dir).map_err(|e| {
        anyhow::anyhow!(
            "--disk-dir {}: cannot query its free space: {e}",
            dir.display()
        )
    })?;
    if needed > free {
        let tokens: usize = prompt_lens
            .iter()
            .map(|&p| final_len(args, info, p))
            .fold(0usize, usize::saturating_add);
        bail!(
            "--disk-dir {} has {} free, but the disk tier needs at least {} for {tokens} tokens past --host-kv-budget; free space there, raise --host-kv-budget, or point --disk-dir at a larger file system",
            dir.display(),
            format_bytes(free),
            format_bytes(needed),
        );
    }
    Ok(())
}

/// Checks that `--random-prompt N`'s ids (4 bytes each) take at most half the memory this
/// process can still get, before they are drawn.
pub fn check_random_prompt(n: usize) -> Result<()> {
    let ids = (n as u64).saturating_mul(4);
    if let Some(avail) = kvpolicy::models::load::sizes::available_bytes() {
        if ids > avail / 2 {
            bail!(
                "--random-prompt {n} needs {} for its ids alone, more than half the {} this machine has available; ask for fewer tokens",
                format_bytes(ids),
                format_bytes(avail)
            );
        }
    }
    Ok(())
}

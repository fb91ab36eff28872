//! Running as one rank of `mpirun` (the `helix` policy: KV-parallel decoding, Helix §3).
//! Every rank runs the model on the same tokens and holds a share of the KV; rank 0 alone
//! prints the text and the summary and writes the output files. Rank 0's sampled token is
//! broadcast and every rank goes on with it (every rank's own choice is the same on one kind
//! of machine: every rank merges the same partials in the same order). An error on one rank
//! ends them all (MPI's abort) instead of leaving the others waiting in a collective.
use anyhow::{bail, Result};
use kvpolicy::helix::world;
use kvpolicy::KvStats;
use serde::Serialize;

use crate::args::Args;

/// This process's place among the ranks `mpirun` launched (rank 0 of 1 outside it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ranks {
    /// This process's rank.
    pub rank: usize,
    /// Ranks launched.
    pub size: usize,
}

/// What one rank held at the end of a run (`--stats-out`'s `"ranks"`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RankKv {
    /// The rank.
    pub rank: usize,
    /// Tokens of the sequence in its share.
    pub share_tokens: u64,
    /// Its device-tier KV bytes.
    pub device_kv_bytes: u64,
    /// Its host-tier KV bytes.
    pub host_kv_bytes: u64,
    /// Its disk-tier KV bytes.
    pub disk_kv_bytes: u64,
}

impl Ranks {
    /// From the launcher's environment (before MPI starts).
    pub fn launched() -> Self {
        Self {
            rank: world::launched_rank(),
            size: world::launched_ranks().unwrap_or(1).max(1),
        }
    }

    /// Whether this rank prints and writes (rank 0).
    pub fn speaks(&self) -> bool {
        self.rank == 0
    }

    /// Whether several ranks share the run.
    pub fn shared(&self) -> bool {
        self.size > 1
    }

    /// Refuses a launch by `mpirun` as several ranks of `tool`, a tool that runs as one
    /// process (kvbench, the server): every rank would run all of it, each on its own.
    /// There `helix` is one rank (its `Collective` is `Solo`).
    pub fn refuse_for(&self, tool: &str, instead: &str) -> Result<()> {
        if self.shared() {
            bail!(
                "{tool} runs as one process, but mpirun launched {} of it (every rank would run all of it on its own); run it without mpirun ({tool}'s `helix` is then one rank){instead}",
                self.size
            );
        }
        Ok(())
    }

    /// Refuses what several ranks cannot share: a policy other than `helix` (every rank
    /// would run the whole job), a prompts file, a prefix cache or a session.
    pub fn check(&self, policy: &str, args: &Args) -> Result<()> {
        if !self.shared() {
            return Ok(());
        }
        if policy != "helix" {
            bail!(
                "launched by mpirun as {} ranks, but --policy {policy} runs the whole job on every rank; split the KV across them with --policy helix:local={policy}",
                self.size
            );
        }
        if args.prompts_file.is_some() || crate::reuse::wanted(args) {
            bail!(
                "--policy helix across {} ranks runs one prompt at a time; drop --prompts-file and the prefix-cache and session flags",
                self.size
            );
        }
        Ok(())
    }

    /// The token every rank goes on with: rank 0's, broadcast (Helix: rank 0 samples).
    /// Every rank merges the same partials in the same order, so on one kind of machine
    /// `token` (this rank's own choice) is rank 0's already; where it is not (ranks on
    /// different hardware rounding differently), this rank adopts rank 0's.
    pub fn adopt(&self, token: u32) -> Result<u32> {
        if !self.shared() {
            return Ok(token);
        }
        let comm = world::world()?;
        let mut chosen = [token];
        comm.broadcast_u32(&mut chosen, 0)?;
        Ok(chosen[0])
    }

    /// Every rank's KV at the end of the run (a collective: every rank calls it).
    pub fn kv(&self, stats: &KvStats) -> Result<Option<Vec<RankKv>>> {
        if !self.shared() {
            return Ok(None);
        }
        let mine = [
            stats.metric("share_tokens").unwrap_or(0.0) as u64,
            stats.device_kv_bytes,
            stats.host_kv_bytes,
            stats.disk_kv_bytes,
        ];
        let all = world::world()?.all_gather_u64(&mine)?;
        Ok(Some(
            all.chunks_exact(mine.len())
                .enumerate()
                .map(|(rank, v)| RankKv {
                    rank,
                    share_tokens: v[0],
                    device_kv_bytes: v[1],
                    host_kv_bytes: v[2],
                    disk_kv_bytes: v[3],
                })
                .collect(),
        ))
    }
}

/// One line per rank for the summary.
pub fn summary(ranks: &[RankKv]) -> String {
    ranks
        .iter()
        .map(|r| {
            format!(
                "rank {}: {} tokens, device KV {}, host KV {}, disk KV {}",
                r.rank,
                r.share_tokens,
                kvpolicy::core::format_bytes(r.device_kv_bytes),
                kvpolicy::core::format_bytes(r.host_kv_bytes),
                kvpolicy::core::format_bytes(r.disk_kv_bytes)
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

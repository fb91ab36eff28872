//! `helix` across processes: the examples launched by `mpirun` (Open MPI, shared memory on
//! this machine; the examples built with `--features mpi`, as the README's test command
//! builds them). Rank 0's logits equal `full`'s on every fixture, with prefill chunks
//! straddling the shares, under several local policies; each rank holds exactly its share;
//! a decode token's all-gather moves exactly `ranks × heads × (head_dim + 1)` f32 values per
//! layer; only rank 0 prints and writes; a killed rank ends the job within 30 s, named.
mod common;

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use candle_core::Tensor;
use kvpolicy::helix::decode_bytes_per_layer;

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

/// The example that runs fixture `name` (`mlkv_mistral` is a Mistral model).
fn example(name: &str) -> &'static str {
    match name {
        n if n.starts_with("gemma") => "gemma",
        n if n.ends_with("mistral") => "mistral",
        n if n.ends_with("qwen2") => "qwen",
        "opt" => "opt",
        _ => "llama",
    }
}

fn ids(v: &[u32]) -> String {
    v.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

/// `mpirun -np RANKS EXAMPLE ARGS` (or the example alone with `ranks` 0).
fn launch(ranks: usize, example: &str, args: &[&str]) -> Command {
    let bin = common::example_bin(example);
    let mut cmd = if ranks == 0 {
        Command::new(bin)
    } else {
        let mut c = Command::new("mpirun");
        c.args(["--allow-run-as-root", "--oversubscribe", "-np"])
            .arg(ranks.to_string())
            .arg(bin);
        c
    };
    cmd.args(args).env("HF_HUB_OFFLINE", "1");
    cmd
}

fn run(ranks: usize, example: &str, args: &[&str]) -> Result<Output> {
    let o = launch(ranks, example, args)
        .output()
        .context("mpirun (Open MPI: apt-get install openmpi-bin libopenmpi-dev)")?;
    ensure!(
        o.status.success(),
        "{ranks} ranks {args:?} failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    Ok(o)
}

/// Teacher-forced logits and stats of fixture `name` under `policy` on `ranks` ranks.
fn logits(
    name: &str,
    policy: &str,
    ranks: usize,
    dir: &Path,
    extra: &[&str],
) -> Result<(Tensor, serde_json::Value, Output)> {
    let (prompt, decode) = common::fixture_ids(name)?;
    let (npy, stats) = (
        dir.join(format!("{policy}-{ranks}.npy")),
        dir.join(format!("{policy}-{ranks}.json")),
    );
    let model = common::fixture(name);
    let (model, prompt, decode) = (model.to_string_lossy(), ids(&prompt), ids(&decode));
    let (npy_s, stats_s) = (npy.to_string_lossy(), stats.to_string_lossy());
    let mut args = vec![
        "--model-dir",
        &model,
        "--policy",
        policy,
        "--prompt-ids",
        &prompt,
        "--decode-ids",
        &decode,
        "--prefill-chunk",
        "5",
        "--dump-logits",
        &npy_s,
        "--stats-out",
        &stats_s,
    ];
    args.extend_from_slice(extra);
    let o = run(ranks, example(name), &args)?;
    let s: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&stats)?)?;
    Ok((Tensor::read_npy(&npy)?, s, o))
}

#[test]
fn rank_zero_matches_full_on_every_fixture_and_each_rank_holds_its_share() -> Result<()> {
    for name in common::hf_fixtures() {
        let info = common::load_fixture(&name)?.model.info().clone();
        let dir = tempfile::tempdir()?;
        let (want, _, _) = logits(&name, "full", 0, dir.path(), &[])?;
        let disk = tempfile::tempdir()?;
        let disk_s = disk.path().to_string_lossy().into_owned();
        let on_disk = ["--host-kv-budget", "1", "--disk-dir", disk_s.as_str()];
        let (prompt, decode) = common::fixture_ids(&name)?;
        let total = (prompt.len() + decode.len()) as u64;
        for ranks in [2usize, 3] {
            for (local, extra) in [
                ("full", &[][..]),
                ("headwise:1", &[][..]),
                ("headwise:1", &on_disk[..]),
                ("auto", &[][..]),
            ] {
                let policy = format!("helix:local={local}");
                let (got, stats, out) = logits(&name, &policy, ranks, dir.path(), extra)?;
                if !extra.is_empty() {
                    // Every rank's share on the disk tier.
                    for r in stats["ranks"].as_array().context("ranks")? {
                        assert!(r["disk_kv_bytes"].as_u64() > Some(0), "{name}: {stats}");
                    }
                }
                let d = common::max_abs_diff(&got, &want)?;
                assert!(
                    d <= tol(&info),
                    "{name} {ranks} ranks local={local}: max |Δlogit| = {d}"
                );
                let shares = stats["ranks"]
                    .as_array()
                    .context("per-rank KV in --stats-out")?;
                assert_eq!(shares.len(), ranks);
                // Shares of ⌈(prompt + decode) / ranks⌉ tokens (teacher-forced: every decode
                // token is a step, so every one is stored).
                let share = total.div_ceil(ranks as u64);
                let held: Vec<u64> = shares
                    .iter()
                    .map(|r| r["share_tokens"].as_u64().unwrap_or(0))
                    .collect();
                for (r, &h) in held.iter().enumerate() {
                    let from = share * r as u64;
                    let to = if r + 1 == ranks {
                        total
                    } else {
                        (from + share).min(total)
                    };
                    assert_eq!(h, to.saturating_sub(from), "{name} rank {r}: {held:?}");
                    // `full`'s KV per rank: exactly its share's K/V in growth steps of 256
                    // tokens on every layer (fixtures without sliding windows).
                    if local == "full" && info.windows.iter().all(Option::is_none) {
                        let per_token = (2 * info.n_kv_heads * info.head_dim * 4) as u64;
                        let want = info.kv_layers() as u64 * h.div_ceil(256) * 256 * per_token;
                        assert_eq!(
                            shares[r]["device_kv_bytes"].as_u64(),
                            Some(want),
                            "{name} rank {r}"
                        );
                    }
                }
                assert_eq!(
                    stats["policy_metrics"]["decode_bytes_per_layer_token"]["value"].as_u64(),
                    Some(decode_bytes_per_layer(ranks, info.n_heads, info.head_dim)),
                    "{name}"
                );
                // One summary (rank 0's), naming every rank.
                let err = String::from_utf8_lossy(&out.stderr);
                assert_eq!(err.matches("prompt tokens in").count(), 1, "{err}");
                for r in 0..ranks {
                    assert!(err.contains(&format!("rank {r}: ")), "{err}");
                }
            }
        }
    }
    Ok(())
}

#[test]
fn what_several_ranks_cannot_share_is_refused_under_mpirun() -> Result<()> {
    let model = common::fixture("llama_gqa").to_string_lossy().into_owned();
    let dir = tempfile::tempdir()?;
    let prompts = dir.path().join("prompts.txt");
    std::fs::write(&prompts, "one\ntwo\n")?;
    let prompts = prompts.to_string_lossy().into_owned();
    for (extra, needle) in [
        // A policy that does not split: every rank would run the whole job.
        (
            &["--policy", "full", "--prompt-ids", "1,2,3"][..],
            "--policy helix:local=full",
        ),
        // A local policy that cannot hold a share; helix inside helix.
        (
            &["--policy", "helix:local=recompute", "--prompt-ids", "1,2,3"][..],
            "`recompute` cannot",
        ),
        (
            &["--policy", "helix:local=helix", "--prompt-ids", "1,2,3"][..],
            "its own local policy",
        ),
        // Several prompts at once.
        (
            &["--policy", "helix", "--prompts-file", prompts.as_str()][..],
            "one prompt at a time",
        ),
    ] {
        let mut args = vec!["--model-dir", model.as_str()];
        args.extend_from_slice(extra);
        let o = launch(2, "llama", &args).output()?;
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{extra:?}: {err}");
        assert!(err.contains(needle), "{extra:?}: {err}");
        assert!(!err.contains("panicked"), "{extra:?}: {err}");
    }
    Ok(())
}

/// kvbench runs as one process: launched by `mpirun` as 2 ranks it refuses, naming the
/// script that measures `helix` across ranks, instead of running the sweep once per rank.
#[test]
fn kvbench_refuses_several_ranks() -> Result<()> {
    let model = common::fixture("llama_gqa").to_string_lossy().into_owned();
    let args = [
        "--model-dir",
        model.as_str(),
        "--quick",
        "--policies",
        "helix",
    ];
    let o = launch(2, "kvbench", &args).output()?;
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(
        err.contains("mpirun launched 2") && err.contains("helix_bench.py"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    Ok(())
}

#[test]
fn a_killed_rank_ends_the_job_within_30_s_naming_it() -> Result<()> {
    // A run long enough to be killed in the middle of: the default model (SmolLM2-135M)
    // teacher-forced through a few thousand tokens.
    let decode = ids(&(0..2000u32).map(|i| 100 + i % 5000).collect::<Vec<_>>());
    let mut child = launch(
        3,
        "llama",
        &[
            "--policy",
            "helix:local=full",
            "--random-prompt",
            "2000",
            "--decode-ids",
            &decode,
        ],
    )
    .stdout(Stdio::null())
    .stderr(Stdio::piped())
    .spawn()?;
    // Rank 1's process, found by the rank Open MPI put in its environment.
    let started = Instant::now();
    let victim = loop {
        ensure!(
            started.elapsed() < Duration::from_secs(60),
            "rank 1 never started"
        );
        if let Some(pid) = rank_pid(child.id(), 1)? {
            break pid;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    std::thread::sleep(Duration::from_secs(2));
    ensure!(child.try_wait()?.is_none(), "the job ended before the kill");
    // SAFETY: a plain signal to a process id this test found.
    unsafe {
        libc::kill(victim as i32, libc::SIGKILL);
    }
    let killed = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait()? {
            break s;
        }
        ensure!(
            killed.elapsed() < Duration::from_secs(30),
            "the job still runs 30 s after rank 1 was killed"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().context("stderr")?, &mut err)?;
    assert!(!status.success());
    assert!(err.contains("rank 1"), "no message names rank 1: {err}");
    Ok(())
}

/// The pid of rank `rank` among the descendants of `root` (by `OMPI_COMM_WORLD_RANK`).
fn rank_pid(root: u32, rank: usize) -> Result<Option<u32>> {
    let want = format!("OMPI_COMM_WORLD_RANK={rank}");
    for e in std::fs::read_dir("/proc")? {
        let Ok(pid) = e?.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        if !descends_from(pid, root) {
            continue;
        }
        let Ok(env) = std::fs::read(format!("/proc/{pid}/environ")) else {
            continue;
        };
        if env.split(|&b| b == 0).any(|v| v == want.as_bytes()) {
            return Ok(Some(pid));
        }
    }
    Ok(None)
}

fn descends_from(mut pid: u32, root: u32) -> bool {
    for _ in 0..8 {
        if pid == root {
            return true;
        }
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            return false;
        };
        // `pid (comm) state ppid …`; comm may hold spaces, so split after the last ')'.
        let Some(ppid) = stat
            .rsplit(')')
            .next()
            .and_then(|s| s.split_whitespace().nth(1))
        else {
            return false;
        };
        match ppid.parse() {
            Ok(p) if p != 0 => pid = p,
            _ => return false,
        }
    }
    false
}

/// Rank 0 samples and every rank goes on with its token: launched with another `--seed` on
/// rank 1 (Open MPI's MPMD form, `A : B`), rank 1 samples other tokens, says so once, and
/// adopts rank 0's — rank 0's tokens are those of a run where both ranks have its seed.
#[test]
fn every_rank_goes_on_with_rank_zeros_token() -> Result<()> {
    let model = common::fixture("llama_gqa").to_string_lossy().into_owned();
    let dir = tempfile::tempdir()?;
    let bin = common::example_bin("llama");
    let generated = |seeds: [&str; 2], out: &str| -> Result<(serde_json::Value, String)> {
        let path = dir.path().join(out);
        let path_s = path.to_string_lossy().into_owned();
        let mut cmd = Command::new("mpirun");
        cmd.args(["--allow-run-as-root", "--oversubscribe"]);
        for (i, seed) in seeds.iter().enumerate() {
            if i > 0 {
                cmd.arg(":");
            }
            cmd.args(["-np", "1"]).arg(&bin).args([
                "--model-dir",
                &model,
                "--policy",
                "helix:local=full",
                "--prompt-ids",
                "1,2,3,4,5",
                "--max-new-tokens",
                "16",
                "--temperature",
                "1.0",
                "--seed",
                seed,
                "--ids-out",
                &path_s,
            ]);
        }
        let o = cmd.env("HF_HUB_OFFLINE", "1").output()?;
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        ensure!(o.status.success(), "{seeds:?}: {err}");
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path)?)?;
        Ok((v["generated_ids"].clone(), err))
    };
    let (same, err_same) = generated(["1", "1"], "same.json")?;
    let (mixed, err_mixed) = generated(["1", "2"], "mixed.json")?;
    assert_eq!(same.as_array().map(Vec::len), Some(16), "{same}");
    assert_eq!(mixed, same, "rank 0's tokens changed with rank 1's seed");
    assert!(!err_same.contains("warning (rank"), "{err_same}");
    assert_eq!(
        err_mixed.matches("warning (rank 1)").count(),
        1,
        "rank 1 should say once that it adopted rank 0's token: {err_mixed}"
    );
    Ok(())
}

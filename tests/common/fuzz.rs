//! The harness the process-level fuzzers share (`tests/cli_fuzz.rs`,
//! `tests/model_dir_fuzz.rs`): cases numbered from 0, each with its own RNG from the seed
//! and its number (so any case replays alone), run on two worker threads for a number of
//! cases or of seconds; exit codes counted, failures collected and reported together.
//! `PREFIX_SECS`, `PREFIX_SEED` and `PREFIX_CASES=3,17` (replay) come from the environment.
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Result};

use super::Rng;

/// What one case reports.
pub struct CaseReport {
    /// The run's exit code (none when it was killed).
    pub code: Option<i32>,
    /// What went wrong, with what the case ran, if anything.
    pub failure: Option<String>,
}

/// Runs `case(number, rng)` for `cases` cases (or the environment's seconds or list), on two
/// workers; prints the counts as `name: …` and fails with every failure.
pub fn run(
    name: &str,
    prefix: &str,
    default_seed: u64,
    cases: usize,
    case: impl Fn(usize, &mut Rng) -> Result<CaseReport> + Sync,
) -> Result<()> {
    let env = |k: &str| std::env::var(format!("{prefix}_{k}")).ok();
    let secs: Option<u64> = env("SECS").and_then(|v| v.parse().ok());
    let seed: u64 = env("SEED")
        .and_then(|v| v.parse().ok())
        .unwrap_or(default_seed);
    let only: Option<Vec<usize>> =
        env("CASES").map(|v| v.split(',').filter_map(|c| c.trim().parse().ok()).collect());
    let start = Instant::now();
    let more = |i: usize| match (&only, secs) {
        (Some(list), _) => i < list.len(),
        (None, Some(s)) => start.elapsed() < Duration::from_secs(s),
        (None, None) => i < cases,
    };
    let (next, done) = (AtomicUsize::new(0), AtomicUsize::new(0));
    let codes = Mutex::new([0usize; 3]);
    let failures = Mutex::new(Vec::<String>::new());
    let poisoned = || anyhow!("a fuzz worker panicked");
    std::thread::scope(|scope| -> Result<()> {
        let workers: Vec<_> = (0..2)
            .map(|_| {
                scope.spawn(|| -> Result<()> {
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if !more(i) {
                            return Ok(());
                        }
                        let i = only.as_ref().map_or(i, |list| list[i]);
                        let mut rng =
                            Rng((seed ^ (i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)) | 1);
                        let report = case(i, &mut rng)?;
                        if let Some(f) = report.failure {
                            failures
                                .lock()
                                .map_err(|_| poisoned())?
                                .push(format!("case {i}: {f}"));
                        }
                        if let Some(c @ 0..=2) = report.code {
                            codes.lock().map_err(|_| poisoned())?[c as usize] += 1;
                        }
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        for w in workers {
            w.join().map_err(|_| poisoned())??;
        }
        Ok(())
    })?;
    let failures = failures.into_inner().map_err(|_| poisoned())?;
    let codes = codes.into_inner().map_err(|_| poisoned())?;
    eprintln!(
        "{name}: {} cases in {:.0}s (seed {seed:#x}): {} succeeded, {} run errors, {} usage errors, {} failing",
        done.load(Ordering::Relaxed),
        start.elapsed().as_secs_f64(),
        codes[0],
        codes[1],
        codes[2],
        failures.len()
    );
    anyhow::ensure!(failures.is_empty(), "{}", failures.join("\n"));
    Ok(())
}

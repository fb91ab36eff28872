//! Running the example CLI from tests: its output, and the checks every failing run must
//! pass (message, exit code, no panic, nothing left behind).
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use anyhow::{ensure, Result};

/// Runs the `llama` example with `args` (offline).
pub fn llama(args: &[&str]) -> Result<Output> {
    let bin = super::example_bin("llama");
    anyhow::ensure!(bin.is_file(), "example binary missing at {}", bin.display());
    Ok(Command::new(bin)
        .args(args)
        .env("HF_HUB_OFFLINE", "1")
        .output()?)
}

/// Runs, expects failure with `needle` in stderr, no panic, and `out` not written.
pub fn fails_with(args: &[&str], needle: &str) -> Result<()> {
    let dir = tempfile::tempdir()?;
    let out = dir.path().join("ids.json");
    let mut all: Vec<&str> = args.to_vec();
    let out_s = out.to_string_lossy().into_owned();
    all.extend(["--ids-out", &out_s]);
    let o = llama(&all)?;
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{args:?} succeeded; stderr: {err}");
    // 1 for errors of the run, 2 for clap's usage errors (its convention).
    assert!(
        matches!(o.status.code(), Some(1) | Some(2)),
        "{args:?}: exit code {:?}; stderr: {err}",
        o.status.code()
    );
    assert!(
        err.contains(needle),
        "{args:?}: stderr lacks {needle:?}:\n{err}"
    );
    assert!(!err.contains("panicked"), "{args:?} panicked:\n{err}");
    assert!(!out.exists(), "{args:?} left an output file behind");
    assert_eq!(
        std::fs::read_dir(dir.path())?.count(),
        0,
        "{args:?} left files behind"
    );
    Ok(())
}

/// Exit code 1 with a one-line error holding every needle, and no panic; with `no_work`,
/// nothing on stdout either (the run stopped before generating).
pub fn one_line_error(o: &Output, no_work: bool, needles: &[&str]) -> Result<()> {
    let err = String::from_utf8_lossy(&o.stderr);
    let code = o.status.code();
    ensure!(code == Some(1), "exit {code:?}: {err}");
    for n in needles {
        ensure!(err.contains(n), "stderr lacks {n:?}: {err}");
    }
    ensure!(!err.contains("panicked"), "{err}");
    ensure!(err.lines().count() == 1, "not one line: {err}");
    let out = String::from_utf8_lossy(&o.stdout);
    ensure!(!no_work || out.is_empty(), "work was done: {out}");
    Ok(())
}

/// Runs `cmd` with stdout and stderr captured, killed after `limit` (an error then: a run
/// blocked on a FIFO, or looping).
pub fn output_within(cmd: &mut Command, limit: Duration) -> Result<Output> {
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn()?;
    let start = Instant::now();
    while child.try_wait()?.is_none() {
        if start.elapsed() > limit {
            child.kill()?;
            child.wait()?;
            anyhow::bail!("{cmd:?} still running after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(child.wait_with_output()?)
}

//! Running the example CLI from tests: its output, and the checks every failing run must
//! pass (message, exit code, no panic, nothing left behind).
use std::process::{Command, Output};

use anyhow::Result;

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

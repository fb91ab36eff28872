//! `--out` is checked before any work (issue #53, item 17): a symbolic link given with a
//! trailing slash (`LINK/`, to a directory or dangling), a parent that is a file or that
//! cannot be written are refused at once — before calibration — with one clear message that
//! says what is wrong, not repeated.
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{ensure, Result};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

/// Runs a conversion that calibrates (`svd`, the default) into `out`; its exit code and
/// stderr.
fn convert_to(out: &str) -> Result<(Option<i32>, String)> {
    let src = fixture("llama_gqa");
    let o = Command::new(env!("CARGO_BIN_EXE_kvpolicy-compress"))
        .args(["--model-dir", &src.to_string_lossy(), "--kv-heads", "1"])
        .args(["--out", out])
        .output()?;
    Ok((
        o.status.code(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    ))
}

/// Whether this process can create a file in `dir` (root can, whatever its mode).
fn can_write(dir: &Path) -> bool {
    tempfile::tempfile_in(dir).is_ok()
}

#[test]
fn a_bad_out_is_refused_before_any_work_with_one_message() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let t = tmp.path();
    let target = t.join("target");
    std::fs::create_dir(&target)?;
    std::os::unix::fs::symlink(&target, t.join("to-dir"))?;
    std::os::unix::fs::symlink(t.join("nowhere"), t.join("dangling"))?;
    std::fs::write(t.join("file"), "mine")?;
    let ro = t.join("ro");
    std::fs::create_dir(&ro)?;
    std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o555))?;
    let s = |p: PathBuf| p.to_string_lossy().into_owned();
    let mut cases = vec![
        (format!("{}/", s(t.join("to-dir"))), "symbolic link"),
        (format!("{}/", s(t.join("dangling"))), "symbolic link"),
        (s(t.join("dangling")), "symbolic link"),
        (s(t.join("file/out")), "not a directory"),
    ];
    if can_write(&ro) {
        eprintln!("running as a user who can write a 0555 directory (root): its case is skipped");
    } else {
        cases.push((s(ro.join("out")), "cannot be written"));
    }
    for (out, want) in cases {
        let (code, err) = convert_to(&out)?;
        ensure!(code == Some(1), "{out}: exit {code:?}, stderr {err}");
        ensure!(err.contains(want), "{out}: stderr lacks `{want}`: {err}");
        ensure!(
            !err.contains("calibrated"),
            "{out}: refused only after the work: {err}"
        );
        ensure!(
            err.matches(want).count() == 1 && err.matches("os error").count() <= 1,
            "{out}: the message is repeated: {err}"
        );
        ensure!(err.lines().count() == 1, "{out}: more than one line: {err}");
    }
    // Nothing was written through the links, nothing left beside them.
    ensure!(std::fs::read_dir(&target)?.next().is_none());
    ensure!(!t.join("nowhere").exists());
    let left: Vec<_> = std::fs::read_dir(t)?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".kvpolicy-compress-"))
        .collect();
    ensure!(left.is_empty(), "left {left:?}");
    std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o755))?;
    Ok(())
}

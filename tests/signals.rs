//! SIGINT and SIGTERM while the outputs are being written (issue 16, item 7): the run
//! stops with exit code 130 and leaves no temporary and no output behind. The child is
//! held at a known point of its final write — its `--stats-out` is a FIFO nobody reads, so
//! putting the outputs in place blocks while `--ids-out`'s temporary exists — and the signal
//! arrives there. With a disk tier, its files (alive until the run ends, unnamed from the
//! start) leave nothing either — under SIGKILL too, which no handler sees.
mod common;

use std::os::unix::fs::FileTypeExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{ensure, Result};

/// Files in `dir` whose names end with `.partial`.
fn temporaries(dir: &Path) -> Result<Vec<String>> {
    let mut v = Vec::new();
    for e in std::fs::read_dir(dir)? {
        let name = e?.file_name().to_string_lossy().into_owned();
        if name.ends_with(".partial") {
            v.push(name);
        }
    }
    Ok(v)
}

/// Files in `dir`.
fn files(dir: &Path) -> Result<usize> {
    Ok(std::fs::read_dir(dir)?.count())
}

fn interrupted_while_writing(signal: &str, disk: bool) -> Result<()> {
    let dir = tempfile::tempdir()?;
    let disk_dir = dir.path().join("disk");
    std::fs::create_dir(&disk_dir)?;
    let disk_args: Vec<String> = if disk {
        vec![
            "--policy".into(),
            "headwise".into(),
            "--disk-dir".into(),
            disk_dir.to_string_lossy().into_owned(),
        ]
    } else {
        Vec::new()
    };
    let fifo = dir.path().join("stats.fifo");
    ensure!(
        Command::new("mkfifo").arg(&fifo).status()?.success(),
        "mkfifo failed"
    );
    let ids = dir.path().join("ids.json");
    let mut child = Command::new(common::example_bin("llama"))
        .args([
            "--model-dir",
            &common::fixture("llama_gqa").to_string_lossy(),
        ])
        .args(["--prompt-ids", "1,2,3", "--max-new-tokens", "2"])
        .args(&disk_args)
        .arg("--ids-out")
        .arg(&ids)
        .arg("--stats-out")
        .arg(&fifo)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()?;
    // Until the signal, a failed check kills the child: it must not stay blocked on its
    // FIFO after the test.
    let held = (|| -> Result<()> {
        // Wait until the child holds its temporaries (blocked opening the FIFO).
        let start = Instant::now();
        while temporaries(dir.path())?.is_empty() {
            ensure!(
                start.elapsed() < Duration::from_secs(60),
                "the child never staged its outputs"
            );
            if let Some(st) = child.try_wait()? {
                anyhow::bail!("the child ended early: {st}");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        std::thread::sleep(Duration::from_millis(50));
        if disk {
            // The policy is alive while the outputs are written: its layers' files are open,
            // and have no name.
            let open = common::unnamed_files(&child.id().to_string(), &disk_dir)?;
            ensure!(
                !open.is_empty(),
                "no disk-tier file while the run holds its cache"
            );
            ensure!(files(&disk_dir)? == 0, "a disk-tier file has a name");
            use std::os::unix::fs::PermissionsExt;
            for link in open {
                let mode = std::fs::metadata(link)?.permissions().mode() & 0o777;
                ensure!(mode == 0o600, "a disk-tier file of mode {mode:o}, not 600");
            }
        }
        Ok(())
    })();
    if let Err(e) = held {
        let _ = child.kill();
        let _ = child.wait();
        return Err(e);
    }
    let sent = Command::new("kill")
        .args([signal, &child.id().to_string()])
        .status()?;
    ensure!(sent.success(), "kill {signal} failed");
    let out = child.wait_with_output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    if signal == "-KILL" {
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(out.status.signal(), Some(9), "{err}");
    } else {
        assert_eq!(out.status.code(), Some(130), "{signal}: {err}");
        assert!(err.contains("interrupted"), "{err}");
        assert!(
            temporaries(dir.path())?.is_empty(),
            "{signal}: temporaries left beside the outputs"
        );
    }
    assert!(
        !ids.exists(),
        "{signal}: --ids-out was put in place by an interrupted run"
    );
    assert!(std::fs::symlink_metadata(&fifo)?.file_type().is_fifo());
    assert_eq!(
        files(&disk_dir)?,
        0,
        "{signal}: disk-tier files left behind"
    );
    Ok(())
}

#[test]
fn sigint_while_writing_leaves_nothing_behind() -> Result<()> {
    interrupted_while_writing("-INT", false)
}

#[test]
fn sigterm_while_writing_leaves_nothing_behind() -> Result<()> {
    interrupted_while_writing("-TERM", false)
}

#[test]
fn sigint_removes_the_disk_tiers_files() -> Result<()> {
    interrupted_while_writing("-INT", true)
}

#[test]
fn sigkill_leaves_no_disk_tier_file() -> Result<()> {
    interrupted_while_writing("-KILL", true)
}

//! The CLI fuzz's hostile dimensions (issue "Hardening II"): output paths that are
//! streams, devices, FIFOs, descriptors or links; input files that are devices, FIFOs or
//! directories; the disk tier's flags over directories that are missing, files or take no
//! files; and an environment whose `TMPDIR` or `KVPOLICY_CACHE` is missing, empty or a
//! file. A victim file outside the case's paths, with links to it planted at names like
//! those temporaries once took (the exact hijack, with the child's own PID, is
//! `tests/outputs.rs`'s), must never change, and the disk directory must hold no file after
//! a run.
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use anyhow::Result;

use crate::common::Rng;

/// A case's hostile surroundings: the victim outside its paths, the planted links, the
/// disk-tier directory, and a FIFO output's reader.
pub struct Hostile {
    /// Holds the victim (outside every path a case names).
    outside: tempfile::TempDir,
    /// The disk-tier directory the case may name.
    pub disk: PathBuf,
    /// A `cat` reading the case's FIFO output, if it has one.
    reader: Option<Child>,
}

const VICTIM: &str = "PRECIOUS\n";

impl Hostile {
    /// Plants links to a victim in `dir` under names temporaries once took or might take,
    /// and makes the disk-tier directory.
    pub fn new(dir: &Path) -> Result<Self> {
        let outside = tempfile::tempdir()?;
        let victim = outside.path().join("victim");
        std::fs::write(&victim, VICTIM)?;
        for name in [
            ".ids.json.1-0.partial",
            ".stats.json.1-1.partial",
            ".logits.npy.1-2.partial",
            "ids.json.partial",
            "kvpolicy-1-0.partial",
        ] {
            std::os::unix::fs::symlink(&victim, dir.join(name))?;
        }
        let disk = dir.join("disk");
        std::fs::create_dir(&disk)?;
        Ok(Self {
            outside,
            disk,
            reader: None,
        })
    }

    /// An output path beyond a plain file: a stream, a device, a descriptor, a FIFO being
    /// read, a link inside the case's directory; `None` for a plain path.
    pub fn output(&mut self, rng: &mut Rng, dir: &Path, name: &str) -> Result<Option<String>> {
        Ok(Some(match rng.below(12) {
            0 => "/dev/null".into(),
            1 => "/dev/full".into(),
            2 => "/dev/stdout".into(),
            3 => "/dev/stderr".into(),
            4 => "/proc/self/fd/1".into(),
            5 => "/dev/fd/9".into(),
            6 => "/dev/stdin".into(),
            7 if self.reader.is_none() => {
                let fifo = dir.join(format!("{name}.fifo"));
                mkfifo(&fifo)?;
                self.reader = Some(
                    Command::new("sh")
                        .arg("-c")
                        .arg("exec cat \"$1\" >/dev/null")
                        .arg("sh")
                        .arg(&fifo)
                        .spawn()?,
                );
                fifo.to_string_lossy().into_owned()
            }
            8 => {
                // A link the user named: written through, to its target inside the case.
                let link = dir.join(format!("link-{name}"));
                let _ = std::os::unix::fs::symlink(dir.join(format!("target-{name}")), &link);
                link.to_string_lossy().into_owned()
            }
            _ => return Ok(None),
        }))
    }

    /// An input file beyond a plain one, one time in four: a device, a FIFO nobody writes,
    /// a directory.
    pub fn input(&self, rng: &mut Rng, dir: &Path) -> Result<Option<String>> {
        if !rng.chance(4) {
            return Ok(None);
        }
        Ok(Some(match rng.below(4) {
            0 => "/dev/zero".into(),
            1 => "/dev/null".into(),
            2 => {
                let fifo = dir.join(format!("in{}.fifo", rng.below(1000)));
                mkfifo(&fifo)?;
                fifo.to_string_lossy().into_owned()
            }
            _ => self.disk.to_string_lossy().into_owned(),
        }))
    }

    /// A `--disk-dir` value: the case's, a missing one, a file, one taking no files.
    pub fn disk_dir(&self, rng: &mut Rng, dir: &Path) -> Result<String> {
        Ok(match rng.below(6) {
            0 => dir.join("missing").to_string_lossy().into_owned(),
            1 => {
                std::fs::write(dir.join("afile"), "x")?;
                dir.join("afile").to_string_lossy().into_owned()
            }
            2 => "/proc".into(),
            3 => "/dev/null".into(),
            _ => self.disk.to_string_lossy().into_owned(),
        })
    }

    /// What the run broke, if anything: the victim changed, a file named in the disk
    /// directory. Stops the FIFO's reader.
    pub fn broken(&mut self) -> Result<Option<String>> {
        if let Some(mut r) = self.reader.take() {
            let _ = r.kill();
            let _ = r.wait();
        }
        let victim = std::fs::read_to_string(self.outside.path().join("victim"))?;
        if victim != VICTIM {
            return Ok(Some(format!(
                "a planted link was followed: victim holds {victim:?}"
            )));
        }
        let left: Vec<String> = std::fs::read_dir(&self.disk)?
            .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
            .collect();
        if !left.is_empty() {
            return Ok(Some(format!("disk-tier files left with names: {left:?}")));
        }
        Ok(None)
    }
}

/// Sets a random hostile environment on `cmd`.
pub fn environment(rng: &mut Rng, dir: &Path, cmd: &mut Command) -> Result<()> {
    match rng.below(5) {
        0 => {
            cmd.env("TMPDIR", dir.join("no-tmp"));
        }
        1 => {
            std::fs::write(dir.join("tmpfile"), "x")?;
            cmd.env("TMPDIR", dir.join("tmpfile"));
        }
        2 => {
            cmd.env("TMPDIR", "");
        }
        _ => {}
    }
    match rng.below(6) {
        0 => {
            cmd.env("KVPOLICY_CACHE", "");
        }
        1 => {
            cmd.env("KVPOLICY_CACHE", dir.join("no-cache"));
        }
        2 => {
            cmd.env("KVPOLICY_CACHE", "/dev/null");
        }
        _ => {}
    }
    cmd.stdin(Stdio::null());
    Ok(())
}

fn mkfifo(p: &Path) -> Result<()> {
    anyhow::ensure!(
        Command::new("mkfifo").arg(p).status()?.success(),
        "mkfifo failed"
    );
    Ok(())
}

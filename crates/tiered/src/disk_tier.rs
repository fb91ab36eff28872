//! Where host-tier layers go once host memory is spent ([`DiskTier`]): the directory of the
//! disk tier's files, the host budget before it, and how its files are read — built from
//! the shared options and checked before any work.
use std::path::PathBuf;

use kvpolicy_core::{DiskIo, Knob, KvError, PolicyOption, PolicyOptions, Result};

/// Where host-tier layers go once host memory is spent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskTier {
    /// The directory the files are made in.
    pub dir: PathBuf,
    /// Host bytes of K/V kept in RAM; layers beyond it go to disk.
    pub host_budget: u64,
    /// How the files are read.
    pub io: DiskIo,
}

impl DiskTier {
    /// The disk tier `opts` ask for: `disk_dir` (an existing directory where a file can be
    /// created: probed now, so a read-only one fails before any work) with
    /// `host_kv_budget` bytes of RAM first (0 without one); `None` without `disk_dir`. A
    /// host budget without a directory is an error naming `policy`.
    pub fn from_options(opts: &PolicyOptions, policy: &str) -> Result<Option<Self>> {
        let bad = |option, message: String| KvError::InvalidOption {
            policy: policy.to_string(),
            option: Knob::Option(option),
            message,
        };
        match (&opts.disk_dir, opts.host_kv_budget) {
            (None, None) => Ok(None),
            (None, Some(b)) => Err(bad(
                PolicyOption::HostKvBudget,
                format!("{b} needs a disk directory (`disk_dir`) for the layers past it"),
            )),
            (Some(dir), _) if !dir.is_dir() => Err(bad(
                PolicyOption::DiskDir,
                format!(
                    "{} is not an existing directory; create it first (`mkdir -p {}`) or give one that exists",
                    dir.display(),
                    dir.display()
                ),
            )),
            (Some(dir), budget) => {
                crate::disk_fs::probe_disk_dir(dir).map_err(|e| {
                    bad(
                        PolicyOption::DiskDir,
                        format!(
                            "{} cannot hold the disk tier's files ({e}); give a writable directory",
                            dir.display()
                        ),
                    )
                })?;
                Ok(Some(Self {
                    dir: dir.clone(),
                    host_budget: budget.unwrap_or(0),
                    io: opts.disk_io,
                }))
            }
        }
    }
}

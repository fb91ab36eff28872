//! The disk tier (issue "beyond host memory"): `layer`, `headwise` and `auto` with layers
//! past `--host-kv-budget` in files under `--disk-dir` give `full`'s logits exactly —
//! with budgets that put every layer, some layers or none on disk — and leave no file
//! behind; a damaged file is an error, after which `reset()` recovers; a full disk from the
//! command line is a clear error that leaves no file (`tests/full_disk.rs`: mid-decode).
mod common;

use anyhow::Result;
use kvpolicy::models::engine::generate::kv_shape;
use kvpolicy::models::prefill;
use kvpolicy::{build_policy, HeadGroup, KvError, PolicyOptions};

fn opts(dir: &std::path::Path, host: Option<u64>, device: Option<u64>) -> PolicyOptions {
    PolicyOptions {
        grow_tokens: 4,
        disk_dir: Some(dir.to_path_buf()),
        host_kv_budget: host,
        device_kv_budget: device,
        ..PolicyOptions::default()
    }
}

/// The disk tier's files in `dir`: unnamed, held open by this process; and nothing named
/// there either.
fn files(dir: &std::path::Path) -> Result<usize> {
    anyhow::ensure!(
        std::fs::read_dir(dir)?.count() == 0,
        "a named file in {}",
        dir.display()
    );
    Ok(common::unnamed_files("self", dir)?.len())
}

#[test]
fn disk_tier_logits_equal_full_and_leave_no_file() -> Result<()> {
    let dir = tempfile::tempdir()?;
    for name in common::hf_fixtures() {
        let loaded = common::load_fixture(&name)?;
        let model = loaded.model.as_ref();
        let info = model.info().clone();
        let (prompt, decode) = common::fixture_ids(&name)?;
        let total = prompt.len() + decode.len();
        let want = common::full_logits(model, &prompt, &decode, 5)?;
        // One layer's host buffers (host storage grows in chunks of 8 × 4 tokens).
        let shape = kv_shape(&info, 1, total, 5);
        let one_layer = shape.kv_bytes(info.n_kv_heads, total.div_ceil(32) * 32);
        // All layers on disk, all but the first, none.
        for (host, on_disk) in [
            (Some(0), true),
            (Some(one_layer), true),
            (None, true),
            (Some(u64::MAX), false),
        ] {
            for policy in ["layer", "headwise", "auto"] {
                let device = (policy == "auto").then_some(u64::MAX / 2);
                let mut p = build_policy(
                    &common::spec(policy, HeadGroup::Fixed(1)),
                    &opts(dir.path(), host, device),
                )?;
                let got = common::teacher_forced_logits(model, p.as_mut(), &prompt, &decode, 5)?;
                let d = common::max_abs_diff(&got, &want)?;
                assert!(d <= 1e-5, "{name} {policy} host {host:?}: max |Δ| = {d}");
                let st = p.stats();
                if on_disk && policy != "auto" {
                    assert!(
                        st.disk_kv_bytes > 0 && st.disk_read_bytes > 0 && st.disk_write_bytes > 0,
                        "{name} {policy} {host:?}: {st:?}"
                    );
                    assert!(files(dir.path())? > 0);
                    // Disk reads ran ahead of their use, on their own threads (a model of
                    // two KV layers, one in RAM, has no disk unit to read ahead of).
                    assert!(
                        common::metric(&st, "disk_read_aheads") > 0 || model.info().kv_layers() < 3,
                        "{name} {policy} {host:?}: {st:?}"
                    );
                } else if !on_disk {
                    assert_eq!(
                        (st.disk_kv_bytes, files(dir.path())?),
                        (0, 0),
                        "{name} {policy}"
                    );
                }
                p.reset();
                assert_eq!(
                    files(dir.path())?,
                    0,
                    "{name} {policy}: files left after reset"
                );
            }
        }
    }
    Ok(())
}

#[test]
fn a_damaged_file_is_an_error_and_reset_recovers() -> Result<()> {
    use std::os::unix::fs::FileExt;
    let name = "llama_gqa";
    let loaded = common::load_fixture(name)?;
    let model = loaded.model.as_ref();
    let (prompt, decode) = common::fixture_ids(name)?;
    let dir = tempfile::tempdir()?;
    let mut p = build_policy("headwise:1", &opts(dir.path(), Some(0), None))?;
    prefill(model, p.as_mut(), &prompt, 5, false)?;
    // Damage every file's first block header (its recorded token range).
    // (A direct read's own descriptor may close between the listing and the open.)
    let mut damaged = 0;
    for link in common::unnamed_files("self", dir.path())? {
        if let Ok(f) = std::fs::OpenOptions::new().write(true).open(link) {
            f.write_all_at(&[0xff, 0xff, 0, 0], 4)?;
            damaged += 1;
        }
    }
    anyhow::ensure!(damaged > 0, "no disk-tier file to damage");
    let ids = candle_core::Tensor::new(&decode[..1], &candle_core::Device::Cpu)?.unsqueeze(0)?;
    match model.forward(&ids, prompt.len(), p.as_mut(), kvpolicy::LogitsMode::Last) {
        Err(kvpolicy::models::ModelError::Policy(KvError::Disk { what, .. })) => {
            assert!(what.contains("records tokens"), "{what}")
        }
        other => anyhow::bail!("expected a disk error, got {:?}", other.map(|_| ())),
    }
    p.reset();
    assert_eq!(files(dir.path())?, 0);
    let want = common::full_logits(model, &prompt, &decode, 5)?;
    let got = common::teacher_forced_logits(model, p.as_mut(), &prompt, &decode, 5)?;
    assert!(common::max_abs_diff(&got, &want)? <= 1e-5);
    drop(p);
    assert_eq!(files(dir.path())?, 0);
    // A host budget without a directory, and a directory that is not one, are named.
    let mut o = opts(dir.path(), Some(1), None);
    o.disk_dir = None;
    let e = build_policy("layer", &o)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        e.contains("`host_kv_budget` 1 needs a disk directory (`disk_dir`)"),
        "{e}"
    );
    let o = opts(&dir.path().join("missing"), None, None);
    let e = build_policy("layer", &o)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(e.contains("is not an existing directory"), "{e}");
    // The fix, in one line: the command that makes it.
    assert!(e.contains("create it first (`mkdir -p "), "{e}");
    Ok(())
}

#[test]
fn the_disk_and_compressed_flags_work_from_the_command_line() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let d = dir.path().to_string_lossy().into_owned();
    let fixture = common::fixture("llama_gqa").to_string_lossy().into_owned();
    let base = [
        "--model-dir",
        fixture.as_str(),
        "--prompt-ids",
        "1,2,3,4,5",
        "--max-new-tokens",
        "3",
    ];
    let llama = |extra: &[&str]| -> Result<std::process::Output> {
        let mut a = base.to_vec();
        a.extend(extra);
        common::cli::llama(&a)
    };
    // Layers past 1 KiB of host memory on disk, stored as f16: the summary says both.
    let o = llama(&[
        "--policy",
        "headwise",
        "--disk-dir",
        &d,
        "--host-kv-budget",
        "1KiB",
        "--host-kv-dtype",
        "f16",
    ])?;
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("; disk tier ") && err.contains("LOSSY"),
        "{err}"
    );
    assert_eq!(files(dir.path())?, 0, "files left after the run");
    // A form the host tier does not store, a budget without a directory: clear errors.
    let o = llama(&["--policy", "headwise", "--host-kv-dtype", "f8"])?;
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("`f8`: use f16, bf16 or q8_0"),
        "{err}"
    );
    let o = llama(&["--policy", "headwise", "--host-kv-budget", "1KiB"])?;
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("--disk-dir"), "{err}");
    // q8_0 needs heads 32 wide; this fixture's are 16: the flag names the problem.
    let o = llama(&["--policy", "headwise", "--host-kv-dtype", "q8_0"])?;
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("multiple of 32"),
        "{err}"
    );
    // Reads through the page cache: the summary and --stats-out say so.
    let stats = dir.path().join("stats");
    std::fs::create_dir(&stats)?;
    let out = stats.join("s.json");
    let o = llama(&[
        "--policy",
        "headwise",
        "--disk-dir",
        &d,
        "--disk-io",
        "buffered",
        "--stats-out",
        &out.to_string_lossy(),
    ])?;
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        o.status.success() && err.contains("buffered reads"),
        "{err}"
    );
    let s: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out)?)?;
    assert_eq!(s["disk_direct_io"], false, "{s}");
    assert_eq!(
        std::fs::read_dir(dir.path())?.count(),
        1,
        "only the stats directory is left"
    );
    // An unknown mode, and a mode without a directory, are clear errors.
    let o = llama(&[
        "--policy",
        "headwise",
        "--disk-dir",
        &d,
        "--disk-io",
        "mmap",
    ])?;
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("use `direct` or `buffered`"),
        "{err}"
    );
    let o = llama(&["--policy", "headwise", "--disk-io", "buffered"])?;
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("--disk-dir"), "{err}");
    Ok(())
}

#[test]
fn a_full_disk_from_the_command_line_is_a_clear_error_leaving_no_file() -> Result<()> {
    // A file-size limit of 8 blocks (its SIGXFSZ ignored) stands in for a full disk: the
    // disk tier's first growth fails.
    let dir = tempfile::tempdir()?;
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg(r#"trap "" XFSZ; ulimit -f 8; exec "$@""#)
        .arg("sh")
        .arg(common::example_bin("llama"))
        .args([
            "--model-dir",
            &common::fixture("llama_gqa").to_string_lossy(),
        ])
        .args(["--prompt-ids", "1,2,3", "--max-new-tokens", "4"])
        .args(["--policy", "headwise", "--disk-dir"])
        .arg(dir.path())
        .output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("is the disk full?")
            && err.contains("--disk-dir")
            && err.contains("os error 27"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(files(dir.path())?, 0);
    Ok(())
}

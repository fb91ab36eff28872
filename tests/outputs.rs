//! Output paths a hostile or careless user gives (issue "Hardening II", items 1–3): a link
//! planted at the name a temporary used to take is never followed, a stream named as an
//! output (`/dev/stdout`, `/dev/fd/N`, `/proc/self/fd/N`, process substitution) gets the
//! output through its descriptor — a redirected file keeps its contents, a pipe gets the
//! JSON — and outputs never depend on `TMPDIR`.
mod common;

use std::path::Path;
use std::process::{Command, Output};

use anyhow::Result;

fn fixture() -> String {
    common::fixture("llama_gqa").to_string_lossy().into_owned()
}

/// Runs `script` under `sh -c` with `$LLAMA` and `$FIXTURE` set; `$@` is `args`.
fn sh(script: &str, args: &[&str]) -> Result<Output> {
    Ok(Command::new("sh")
        .arg("-c")
        .arg(script)
        .arg("sh")
        .args(args)
        .env("LLAMA", common::example_bin("llama"))
        .env("FIXTURE", fixture())
        .env("HF_HUB_OFFLINE", "1")
        .output()?)
}

const RUN: &str = r#""$LLAMA" --model-dir "$FIXTURE" --prompt-ids 1,2,3 --max-new-tokens 4"#;

/// The ids JSON of a run of the fixture.
fn ids_json(text: &str) -> Result<serde_json::Value> {
    let at = text.find('{').unwrap_or(text.len());
    Ok(serde_json::from_str(&text[at..])?)
}

#[test]
fn a_link_planted_at_a_temporary_name_is_not_followed() -> Result<()> {
    let d = tempfile::tempdir()?;
    let out = d.path().join("out");
    std::fs::create_dir(&out)?;
    let victim = d.path().join("victim");
    std::fs::write(&victim, "PRECIOUS\n")?;
    // The names the temporaries took before (`.NAME.PID-N.partial` beside the target),
    // planted for the PID the run will have (the shell's, which `exec` keeps), for the first
    // few outputs.
    let script = format!(
        r#"for n in 0 1 2; do for f in ids.json stats.json; do ln -s "$1" "$2/.$f.$$-$n.partial"; done; done
exec {RUN} --ids-out "$2/ids.json" --stats-out "$2/stats.json""#
    );
    let o = sh(
        &script,
        &[&victim.to_string_lossy(), &out.to_string_lossy()],
    )?;
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert_eq!(std::fs::read_to_string(&victim)?, "PRECIOUS\n");
    let ids = ids_json(&std::fs::read_to_string(out.join("ids.json"))?)?;
    assert_eq!(ids["prompt_ids"], serde_json::json!([1, 2, 3]));
    assert!(!std::fs::symlink_metadata(out.join("ids.json"))?
        .file_type()
        .is_symlink());
    // The planted links are untouched (still links to the victim), and no temporary is left.
    let mut links = 0;
    for e in std::fs::read_dir(&out)? {
        let e = e?;
        let name = e.file_name().to_string_lossy().into_owned();
        if e.file_type()?.is_symlink() {
            assert_eq!(std::fs::read_link(e.path())?, victim);
            links += 1;
        } else {
            assert!(!name.ends_with(".partial"), "temporary left: {name}");
        }
    }
    assert_eq!(links, 6);
    Ok(())
}

#[test]
fn a_new_output_gets_the_usual_permissions() -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let d = tempfile::tempdir()?;
    let out = d.path().join("ids.json");
    let o = sh(
        &format!("umask 022; exec {RUN} --ids-out \"$1\""),
        &[&out.to_string_lossy()],
    )?;
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(std::fs::metadata(&out)?.permissions().mode() & 0o777, 0o644);
    // An existing file keeps its mode.
    std::fs::set_permissions(&out, std::fs::Permissions::from_mode(0o600))?;
    let o = sh(
        &format!("exec {RUN} --ids-out \"$1\""),
        &[&out.to_string_lossy()],
    )?;
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(std::fs::metadata(&out)?.permissions().mode() & 0o777, 0o600);
    Ok(())
}

#[test]
fn stdout_redirected_to_a_file_keeps_its_contents_and_gets_the_output() -> Result<()> {
    let d = tempfile::tempdir()?;
    let res = d.path().join("res.txt");
    std::fs::write(&res, "earlier\n")?;
    for path in [
        "/dev/stdout",
        "/proc/self/fd/1",
        "/dev/fd/1",
        "/proc/self/task/$$/fd/1",
    ] {
        let o = sh(
            &format!("exec {RUN} --ids-out {path} >>\"$1\""),
            &[&res.to_string_lossy()],
        )?;
        assert!(
            o.status.success(),
            "{path}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let text = std::fs::read_to_string(&res)?;
        assert!(text.starts_with("earlier\n"), "{path}: {text}");
        // The generated text, then the JSON, after it.
        let last = text.lines().last().unwrap_or_default();
        let ids = ids_json(last)?;
        assert_eq!(ids["prompt_ids"], serde_json::json!([1, 2, 3]), "{path}");
        assert!(!std::fs::symlink_metadata(&res)?.file_type().is_symlink());
        std::fs::write(&res, "earlier\n")?;
    }
    // stderr likewise, truncated by `2>` but not replaced.
    let o = sh(
        &format!("exec {RUN} --stats-out /dev/stderr 2>\"$1\""),
        &[&res.to_string_lossy()],
    )?;
    assert!(o.status.success());
    let text = std::fs::read_to_string(&res)?;
    assert!(
        text.contains("prompt tokens in") && text.contains("\"policy\": \"full\""),
        "{text}"
    );
    Ok(())
}

#[test]
fn a_pipe_or_process_substitution_gets_the_output() -> Result<()> {
    // `--ids-out /dev/stdout | cat`: the JSON arrives through the pipe after the text.
    let o = sh(&format!("{RUN} --ids-out /dev/stdout | cat"), &[])?;
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = String::from_utf8_lossy(&o.stdout);
    let ids = ids_json(out.lines().last().unwrap_or_default())?;
    assert_eq!(ids["prompt_ids"], serde_json::json!([1, 2, 3]));
    // An extra descriptor (`3>FILE`), as a process substitution gives one.
    let d = tempfile::tempdir()?;
    let file = d.path().join("fd3.json");
    let o = sh(
        &format!("exec 3>\"$1\"; {RUN} --ids-out /dev/fd/3 --stats-out /proc/self/fd/3"),
        &[&file.to_string_lossy()],
    )?;
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = std::fs::read_to_string(&file)?;
    assert!(
        text.starts_with("{\"prompt_ids\"") && text.contains("\"policy\""),
        "{text}"
    );
    Ok(())
}

#[test]
fn a_descriptor_not_open_for_writing_fails_before_any_work() -> Result<()> {
    for (script, needle) in [
        (
            format!("exec {RUN} --ids-out /dev/fd/9"),
            "descriptor 9, which is not open",
        ),
        (
            format!("exec {RUN} --stats-out /dev/stdin </dev/null"),
            "open for reading only",
        ),
    ] {
        let o = sh(&script, &[])?;
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{err}");
        assert!(err.contains(needle), "{err}");
        // Nothing ran: no generated text, no summary.
        assert!(
            o.stdout.is_empty() && !err.contains("prompt tokens in"),
            "{err}"
        );
        assert_eq!(err.lines().count(), 1, "{err}");
    }
    Ok(())
}

#[test]
fn outputs_do_not_need_a_temporary_directory() -> Result<()> {
    let d = tempfile::tempdir()?;
    let stats = d.path().join("stats.json");
    let missing = d.path().join("no-such-tmp");
    let o = Command::new(common::example_bin("llama"))
        .args([
            "--model-dir",
            &fixture(),
            "--prompt-ids",
            "1,2,3",
            "--max-new-tokens",
            "2",
        ])
        .args(["--ids-out", "/dev/null", "--stats-out"])
        .arg(&stats)
        .env("TMPDIR", &missing)
        .output()?;
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(stats.is_file());
    assert!(!Path::new(&missing).exists());
    Ok(())
}

use kvpolicy_cli::outpath;

#[test]
fn descriptor_paths_are_recognised_lexically() {
    let me = std::process::id();
    for (p, fd) in [
        ("/dev/stdout".to_string(), Some(1)),
        ("/dev//stderr".to_string(), Some(2)),
        ("/dev/./fd/63".to_string(), Some(63)),
        ("/proc/self/fd/4".to_string(), Some(4)),
        ("/proc/thread-self/fd/4".to_string(), Some(4)),
        ("/proc/self/task/77/fd/1".to_string(), Some(1)),
        (format!("/proc/{me}/task/{me}/fd/2"), Some(2)),
        ("/proc/1/task/1/fd/2".to_string(), None),
        (format!("/proc/{me}/fd/5"), Some(5)),
        ("/proc/1/fd/5".to_string(), None),
        ("/proc/self/fdinfo/5".to_string(), None),
        ("/dev/fd/x".to_string(), None),
        ("/tmp/stdout".to_string(), None),
        ("dev/stdout".to_string(), None),
    ] {
        assert_eq!(outpath::descriptor_of(Path::new(&p)), fd, "{p}");
    }
    // Another process's descriptor is written in place, never renamed over.
    assert!(matches!(
        outpath::target(Path::new("/proc/1/fd/1")),
        Ok(outpath::Target::Special(_)) | Err(_)
    ));
}

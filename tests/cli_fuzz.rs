//! CLI fuzzing (issue 16): random argument vectors — any of `llama`'s flags, in any order,
//! repeated or missing their value, with values chosen to break things (zero, huge,
//! negative, NaN, past 64 bits, empty, garbage, paths that are directories or do not
//! exist, configs with one field made absurd) — on the test fixtures, each run as a child
//! process; and the hostile dimensions of `cli_fuzz/hostile.rs`: outputs that are streams,
//! devices, descriptors, FIFOs and links, inputs that are devices, FIFOs and directories,
//! the disk tier's flags, a broken `TMPDIR` or `KVPOLICY_CACHE`. Every run must exit 0, 1
//! (an error of the run) or 2 (clap's usage error), never panic, abort or hang, print
//! `error:` when it fails, leave no temporary behind, leave the victim that planted links
//! point to untouched, and leave no named file in the disk tier's directory.
//!
//! `cargo test --release --test cli_fuzz` runs a fixed number of cases from a fixed seed;
//! `KVPOLICY_CLI_FUZZ_SECS=600` runs for that long instead, `KVPOLICY_CLI_FUZZ_SEED` picks
//! another seed, and `KVPOLICY_CLI_FUZZ_SHOW=1` prints every run's exit code, time and first
//! line of stderr. A failure prints its case number and argument vector;
//! `KVPOLICY_CLI_FUZZ_CASES=674,1210` (with the same seed) replays just those cases.
mod common;
#[path = "cli_fuzz/hostile.rs"]
mod hostile;
#[path = "cli_fuzz/values.rs"]
mod values;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Result;

/// Cases in the test suite's run.
const CASES: usize = 100;
/// A run that takes longer hangs (the slowest legitimate case, the default model's 1,000
/// prompt tokens, takes a few seconds).
const HANG: Duration = Duration::from_secs(90);

use common::Rng;
use hostile::Hostile;
use values::*;

/// One of `v`, or one time in ten a value no flag accepts.
fn value(rng: &mut Rng, v: &[&str]) -> String {
    if rng.chance(10) {
        rng.pick(BAD).into()
    } else {
        rng.pick(v).into()
    }
}

/// One case's working directory: the files its paths may name.
struct Scratch {
    dir: tempfile::TempDir,
}

impl Scratch {
    fn path(&self, name: &str) -> String {
        self.dir.path().join(name).to_string_lossy().into_owned()
    }

    /// An output path: new, an existing file, a directory, or in a missing directory.
    fn output(&self, rng: &mut Rng, name: &str) -> Result<String> {
        Ok(match rng.below(6) {
            0 => self.dir.path().to_string_lossy().into_owned(),
            1 => self.path(&format!("missing/{name}")),
            2 => {
                std::fs::write(self.dir.path().join(name), "old")?;
                self.path(name)
            }
            _ => self.path(name),
        })
    }

    /// A config.json: the fixture's, or the fixture's with one field made absurd.
    fn config(&self, rng: &mut Rng) -> Result<String> {
        let src = common::fixture("llama_gqa").join("config.json");
        let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(src)?)?;
        if !rng.chance(3) {
            let values = [
                serde_json::json!(0),
                serde_json::json!(-1),
                serde_json::json!(1_000_000_000u64),
                serde_json::json!(1u64 << 40),
                serde_json::json!(u64::MAX),
                serde_json::json!(1.5),
                serde_json::json!(-1e-5),
                serde_json::json!("text"),
                serde_json::json!(null),
                serde_json::json!([1, 2]),
                serde_json::json!({"type": "llama3", "factor": 0}),
            ];
            let field = rng.pick(FIELDS);
            cfg[field] = values[rng.below(values.len())].clone();
        }
        let path = self
            .dir
            .path()
            .join(format!("config{}.json", rng.below(1000)));
        std::fs::write(&path, cfg.to_string())?;
        Ok(path.to_string_lossy().into_owned())
    }

    /// A prompts file of random lines (text or token-id arrays).
    fn prompts(&self, rng: &mut Rng) -> Result<String> {
        let jsonl = rng.chance(2);
        let lines: Vec<String> = (0..rng.below(4))
            .map(|_| match (jsonl, rng.below(4)) {
                (true, 0) => "[]".into(),
                (true, 1) => "[1, 2, \"x\"]".into(),
                (true, _) => format!("[{}]", rng.pick(IDS)),
                (false, 0) => "a\0b".into(),
                (false, _) => rng.pick(TEXTS).replace('\n', " "),
            })
            .collect();
        let name = if jsonl {
            "prompts.jsonl"
        } else {
            "prompts.txt"
        };
        std::fs::write(self.dir.path().join(name), lines.join("\n"))?;
        Ok(self.path(name))
    }
}

/// A random argument vector for `llama`, using `s` for its files and `h` for the hostile
/// ones.
fn argv(rng: &mut Rng, s: &Scratch, h: &mut Hostile) -> Result<Vec<String>> {
    let dir = s.dir.path().to_path_buf();
    let mut a: Vec<String> = Vec::new();
    let push = |a: &mut Vec<String>, flag: &str, value: String| {
        a.push(flag.to_string());
        a.push(value);
    };
    // A model source (without one, the default model loads — allowed, but rarely).
    let gqa = common::fixture("llama_gqa").to_string_lossy().into_owned();
    match rng.below(24) {
        0 => {}
        1 => push(
            &mut a,
            "--gguf",
            common::default_gguf()?.to_string_lossy().into_owned(),
        ),
        2 => {
            let v = match h.input(rng, &dir)? {
                Some(p) => p,
                None => s.config(rng)?,
            };
            push(&mut a, "--gguf", v)
        }
        3 => push(&mut a, "--model-dir", s.path("")),
        4 => push(&mut a, "--model-id", "nobody/nothing".into()),
        5..=9 => {
            a.push("--random-weights".into());
            let v = match h.input(rng, &dir)? {
                Some(p) => p,
                None => s.config(rng)?,
            };
            push(&mut a, "--config", v);
        }
        10 | 11 => push(
            &mut a,
            "--model-dir",
            common::fixture("mistral").to_string_lossy().into_owned(),
        ),
        _ => push(&mut a, "--model-dir", gqa),
    }
    if !rng.chance(4) {
        push(&mut a, "--prompt-ids", rng.pick(IDS).into());
    }
    for _ in 0..rng.below(9) {
        let flag = rng.pick(&[
            "--policy",
            "--prompt",
            "--chat",
            "--prompt-ids",
            "--random-prompt",
            "--prompts-file",
            "--max-new-tokens",
            "--temperature",
            "--top-p",
            "--seed",
            "--tokenizer",
            "--dtype",
            "--head-group",
            "--device-kv-budget",
            "--profile",
            "--recompute-split",
            "--block-size",
            "--kv-act-ratio",
            "--link-bandwidth",
            "--cpu",
            "--prefill-chunk",
            "--decode-ids",
            "--ids-out",
            "--dump-logits",
            "--stats-out",
            "--revision",
            "--disk-dir",
            "--disk-dir",
            "--host-kv-budget",
            "--host-kv-dtype",
            "--disk-io",
            "--bogus",
        ]);
        // A flag given twice is a usage error: now and then, not most of the time.
        if a.iter().any(|x| x == flag) && !rng.chance(10) {
            continue;
        }
        let value = match flag {
            "--policy" => rng.pick(POLICIES).into(),
            "--prompt" => rng.pick(TEXTS).into(),
            "--chat" | "--cpu" => {
                a.push(flag.into());
                continue;
            }
            "--prompt-ids" | "--decode-ids" => value(rng, IDS),
            "--random-prompt" | "--max-new-tokens" | "--seed" | "--recompute-split"
            | "--block-size" | "--prefill-chunk" => value(rng, COUNTS),
            "--prompts-file" => match h.input(rng, &dir)? {
                Some(p) => p,
                None => s.prompts(rng)?,
            },
            "--temperature" | "--top-p" | "--kv-act-ratio" => value(rng, FLOATS),
            "--tokenizer" | "--profile" => match (h.input(rng, &dir)?, rng.below(3)) {
                (Some(p), _) => p,
                (None, 0) => s.path("none.json"),
                (None, 1) => s.config(rng)?,
                (None, _) => s.path(""),
            },
            "--dtype" => rng.pick(DTYPES).into(),
            "--head-group" => value(rng, GROUPS),
            "--device-kv-budget" => value(rng, SIZES),
            "--link-bandwidth" => value(rng, LINKS),
            "--ids-out" | "--dump-logits" | "--stats-out" => {
                let name = match flag {
                    "--ids-out" => "ids.json",
                    "--dump-logits" => "logits.npy",
                    _ => "stats.json",
                };
                match h.output(rng, &dir, name)? {
                    Some(p) if rng.chance(2) => p,
                    _ => s.output(rng, name)?,
                }
            }
            "--disk-dir" => h.disk_dir(rng, &dir)?,
            "--host-kv-budget" => value(rng, SIZES),
            "--host-kv-dtype" => rng.pick(&["f16", "bf16", "q8_0", "f8", ""]).into(),
            "--disk-io" => rng.pick(&["direct", "buffered", "mmap"]).into(),
            _ => rng.pick(COUNTS).into(),
        };
        // Now and then a flag without its value.
        if rng.chance(20) {
            a.push(flag.into());
        } else {
            push(&mut a, flag, value);
        }
    }
    Ok(a)
}

/// Runs one argument vector in the environment `env` set up; returns its exit code and
/// what is wrong with the run, if anything.
fn check(
    a: &[String],
    s: &Scratch,
    h: &mut Hostile,
    env: impl FnOnce(&mut Command) -> Result<()>,
) -> Result<(Option<i32>, Option<String>)> {
    let mut cmd = Command::new(common::example_bin("llama"));
    cmd.args(a)
        .env("HF_HUB_OFFLINE", "1")
        .env("RUST_BACKTRACE", "0")
        // Two workers on this 2-core machine: one compute thread each, or a long real-model
        // run of one case, slowed ten-fold by the other's threads, reads as a hang.
        .env("RAYON_NUM_THREADS", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    env(&mut cmd)?;
    let before: Vec<_> = std::fs::read_dir(s.dir.path())?
        .filter_map(|e| e.ok().map(|e| e.file_name()))
        .collect();
    let mut child = cmd.spawn()?;
    // stdout is a pipe (outputs named /dev/stdout go through it), drained meanwhile.
    let stdout = child.stdout.take();
    let drain = std::thread::spawn(move || {
        if let Some(mut o) = stdout {
            let _ = std::io::copy(&mut o, &mut std::io::sink());
        }
    });
    let stderr = child.stderr.take();
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        if let Some(mut e) = stderr {
            let _ = std::io::Read::read_to_string(&mut e, &mut text);
        }
        text
    });
    let start = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait()? {
            break Some(st);
        }
        if start.elapsed() > HANG {
            child.kill()?;
            child.wait()?;
            break None;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let err = reader.join().unwrap_or_default();
    let _ = drain.join();
    let broken = h.broken()?;
    let Some(status) = status else {
        return Ok((None, Some(format!("hung for {HANG:?}"))));
    };
    let tail: String = err
        .chars()
        .rev()
        .take(600)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    let problem = match status.code() {
        None => Some(format!("killed by a signal ({status})")),
        Some(c) if !matches!(c, 0..=2) => Some(format!("exit code {c}")),
        _ if err.contains("panicked") => Some("panicked".into()),
        Some(1 | 2) if !err.contains("error:") => Some("failed without `error:`".into()),
        _ => None,
    };
    let problem = problem.or(broken);
    if problem.is_some() {
        return Ok((
            status.code(),
            problem.map(|p| format!("{p}; stderr: {tail}")),
        ));
    }
    // No temporaries; a failed run adds no file at all.
    for e in std::fs::read_dir(s.dir.path())? {
        let e = e?;
        let name = e.file_name();
        let n = name.to_string_lossy();
        // (The links planted at old temporaries' names are the hostile setup's.)
        if n.ends_with(".partial") && !e.file_type()?.is_symlink() {
            return Ok((status.code(), Some(format!("left the temporary {n}"))));
        }
        if !status.success() && !before.contains(&name) {
            return Ok((
                status.code(),
                Some(format!("failed but wrote {n}; stderr: {tail}")),
            ));
        }
    }
    if std::env::var_os("KVPOLICY_CLI_FUZZ_SHOW").is_some() {
        eprintln!(
            "{:?} in {:.2}s: {}",
            status.code(),
            start.elapsed().as_secs_f64(),
            err.lines().next().unwrap_or("")
        );
        if start.elapsed() > Duration::from_secs(3) {
            eprintln!("  slow: llama {}", quoted(a));
        }
    }
    Ok((status.code(), None))
}

fn quoted(a: &[String]) -> String {
    a.iter()
        .map(|s| format!("'{}'", s.replace('\'', "'\\''")))
        .collect::<Vec<_>>()
        .join(" ")
}

#[test]
fn random_argument_vectors_never_panic_abort_or_hang() -> Result<()> {
    common::fuzz::run(
        "cli fuzz",
        "KVPOLICY_CLI_FUZZ",
        0x5EED_C11F,
        CASES,
        |_, rng| {
            let s = Scratch {
                dir: tempfile::tempdir()?,
            };
            let mut h = Hostile::new(s.dir.path())?;
            let a = argv(rng, &s, &mut h)?;
            let dir = s.dir.path().to_path_buf();
            let (code, problem) =
                check(&a, &s, &mut h, |cmd| hostile::environment(rng, &dir, cmd))?;
            Ok(common::fuzz::CaseReport {
                code,
                failure: problem.map(|p| format!("{p}\n  llama {}", quoted(&a))),
            })
        },
    )
}

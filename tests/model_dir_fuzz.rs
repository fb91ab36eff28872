//! Model-directory fuzzing (issue "Hardening III"): directories generated from the test
//! fixtures — config × weights × tokenizer × chat template, each axis left alone or made
//! hostile by `model_dir_fuzz/gen.rs` (absurd numbers, non-finite or duplicated or integer
//! or missing tensors, truncated files, expanding normalizers, backtracking or broken
//! regexes, nested-loop and recursive templates) — each run by its architecture's example
//! as a child process with a random policy, prompt (text, ids, `--chat`) and length.
//! Every run must exit 0, 1 or 2, never panic, abort or hang; a failure is one line
//! starting `error:`; and a directory with a non-finite, duplicated or integer weight, or
//! an untied model without its head, never exits 0.
//!
//! `cargo test --release --test model_dir_fuzz` runs a fixed number of cases from a fixed
//! seed; `KVPOLICY_DIR_FUZZ_SECS=600` runs for that long, `KVPOLICY_DIR_FUZZ_SEED` picks
//! another seed, `KVPOLICY_DIR_FUZZ_CASES=3,17` replays cases of that seed.
mod common;
#[path = "model_dir_fuzz/gen.rs"]
mod gen;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Result;
use common::Rng;
use gen::WeightChange;

/// Cases in the test suite's run.
const CASES: usize = 40;
/// A run that takes longer hangs (fixtures decode in milliseconds; the slowest refusals
/// take a second).
const HANG: Duration = Duration::from_secs(60);

/// What one case generated and how its run went.
struct Outcome {
    /// The fixture and what was done to it.
    what: String,
    /// The example's arguments.
    argv: Vec<String>,
    /// The exit code (none when killed).
    code: Option<i32>,
    /// What is wrong with the run, if anything.
    problem: Option<String>,
}

/// One generated case, run.
fn case(rng: &mut Rng) -> Result<Outcome> {
    let (fixture, example) = gen::FIXTURES[rng.below(gen::FIXTURES.len())];
    let d = common::copy_fixture(fixture)?;
    gen::config(rng, d.path())?;
    let change = gen::weights(rng, d.path())?;
    let has_tokenizer = gen::tokenizer(rng, d.path())?;
    gen::template(rng, d.path())?;
    let mut a: Vec<String> = vec!["--model-dir".into(), d.path().to_string_lossy().into()];
    let text = [
        "hi a",
        "the capital b",
        "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaac",
        "",
    ];
    match (has_tokenizer, rng.below(3)) {
        (true, 0) => a.extend(["--prompt".into(), rng.pick(&text).into(), "--chat".into()]),
        (true, 1) => a.extend(["--prompt".into(), rng.pick(&text).into()]),
        _ => a.extend([
            "--prompt-ids".into(),
            rng.pick(&["1,2,3", "0", "5,4,3,2,1"]).into(),
        ]),
    }
    let policy = rng.pick(&["full", "layer", "headwise", "recompute", "hybrid", "auto"]);
    a.extend(["--policy".into(), policy.into()]);
    a.extend([
        "--max-new-tokens".into(),
        rng.pick(&["1", "4", "16"]).into(),
    ]);
    let what = format!("{fixture}, weights {change:?}, tokenizer {has_tokenizer}");

    let mut child = Command::new(common::example_bin(example))
        .args(&a)
        .env("HF_HUB_OFFLINE", "1")
        .env("RUST_BACKTRACE", "0")
        .env("RAYON_NUM_THREADS", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()?;
    let stderr = child.stderr.take();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        if let Some(mut e) = stderr {
            let _ = std::io::Read::read_to_string(&mut e, &mut s);
        }
        s
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
    let errors: Vec<&str> = err.lines().filter(|l| !l.starts_with("warning:")).collect();
    let problem = match status.map(|s| s.code()) {
        None => Some(format!("hung for {HANG:?}")),
        Some(None) => Some("killed by a signal".into()),
        Some(Some(c)) if !matches!(c, 0..=2) => Some(format!("exit code {c}")),
        _ if err.contains("panicked") => Some("panicked".into()),
        Some(Some(1)) if errors.len() != 1 || !errors[0].starts_with("error:") => {
            Some("failed without a one-line `error:`".into())
        }
        Some(Some(0)) => match &change {
            WeightChange::NonFinite(t) => Some(format!("succeeded with non-finite {t}")),
            WeightChange::Refused(t) => Some(format!("succeeded with {t}")),
            _ => None,
        },
        _ => None,
    };
    let tail: String = err.chars().take(400).collect();
    Ok(Outcome {
        what,
        argv: a,
        code: status.and_then(|s| s.code()),
        problem: problem.map(|p| format!("{p}; stderr: {tail}")),
    })
}

#[test]
fn generated_model_directories_never_panic_abort_hang_or_pass_bad_weights() -> Result<()> {
    common::fuzz::run(
        "model-dir fuzz",
        "KVPOLICY_DIR_FUZZ",
        0xD1E5_F022,
        CASES,
        |_, rng| {
            let o = case(rng)?;
            Ok(common::fuzz::CaseReport {
                code: o.code,
                failure: o
                    .problem
                    .map(|p| format!("({}): {p}\n  {}", o.what, o.argv.join(" "))),
            })
        },
    )
}

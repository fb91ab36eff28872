//! Batch mode of the example CLI (`--prompts-file`) and the `hybrid` flags: the ids file
//! holds one object per prompt in input order, equal to running each prompt alone with
//! `full`; bad files and option values are clear errors.
mod common;

use anyhow::Result;
use common::cli::{fails_with, llama};

fn ids_out(args: &[&str]) -> Result<serde_json::Value> {
    let dir = tempfile::tempdir()?;
    let out = dir.path().join("ids.json");
    let mut all = args.to_vec();
    let o = out.to_string_lossy().into_owned();
    all.extend(["--ids-out", &o]);
    let run = llama(&all)?;
    anyhow::ensure!(
        run.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&run.stderr)
    );
    Ok(serde_json::from_str(&std::fs::read_to_string(&out)?)?)
}

#[test]
fn a_jsonl_batch_equals_each_prompt_alone() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("prompts.jsonl");
    let prompts: Vec<Vec<u32>> = vec![
        vec![5, 9, 2, 7],
        vec![1],
        vec![3, 3, 8, 1, 4, 4, 2, 6, 9],
        vec![11, 12],
    ];
    let lines: Vec<String> = prompts
        .iter()
        .map(serde_json::to_string)
        .collect::<std::result::Result<_, _>>()?;
    // A blank line in between is skipped.
    std::fs::write(
        &file,
        format!("{}\n\n{}\n", lines[..2].join("\n"), lines[2..].join("\n")),
    )?;
    let model = common::fixture("llama_mha").to_string_lossy().into_owned();
    let f = file.to_string_lossy().into_owned();
    let base = ["--model-dir", &model, "--max-new-tokens", "5", "--cpu"];
    let mut want = Vec::new();
    for p in &prompts {
        let ids = p.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
        let mut a = base.to_vec();
        a.extend(["--policy", "full", "--prompt-ids", &ids]);
        want.push(ids_out(&a)?);
    }
    for policy in [
        vec!["--policy", "full"],
        vec![
            "--policy",
            "hybrid",
            "--block-size",
            "2",
            "--kv-act-ratio",
            "0.5",
        ],
        vec!["--policy", "hybrid", "--prefill-chunk", "3"],
        vec!["--policy", "recompute", "--recompute-split", "2"],
        vec!["--policy", "headwise"],
    ] {
        let mut a = base.to_vec();
        a.extend(["--prompts-file", &f]);
        a.extend(&policy);
        let got = ids_out(&a)?;
        let got = got.as_array().cloned().unwrap_or_default();
        assert_eq!(got.len(), prompts.len(), "{policy:?}");
        for (g, w) in got.iter().zip(&want) {
            assert_eq!(g, w, "{policy:?}");
        }
    }
    Ok(())
}

#[test]
fn stats_out_has_per_step_block_counts() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("p.jsonl");
    std::fs::write(&file, "[1, 2, 3]\n[4]\n[5, 6, 7, 8, 9, 10]\n")?;
    let stats = dir.path().join("stats.json");
    let model = common::fixture("llama_mha").to_string_lossy().into_owned();
    let (f, s) = (
        file.to_string_lossy().into_owned(),
        stats.to_string_lossy().into_owned(),
    );
    let o = llama(&[
        "--model-dir",
        &model,
        "--prompts-file",
        &f,
        "--policy",
        "hybrid",
        "--block-size",
        "2",
        "--kv-act-ratio",
        "0.5",
        "--max-new-tokens",
        "4",
        "--stats-out",
        &s,
        "--cpu",
    ])?;
    anyhow::ensure!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&stats)?)?;
    let steps = v["steps"].as_array().cloned().unwrap_or_default();
    assert_eq!(steps.len(), 4, "one prefill step and three decode steps");
    // After the prefill step: 3 sequences, blocks of 2 tokens over 3+1+6 (+1 sampled each
    // is not cached yet) tokens = 2+1+3 blocks, half of them K/V.
    let first = &steps[0];
    assert_eq!(first["sequences"], 3);
    let metric = |name: &str| first["policy_metrics"][name]["value"].as_u64().unwrap_or(0);
    let blocks = metric("act_blocks") + metric("kv_blocks");
    assert_eq!(blocks, 6);
    assert!(first["recompute_tokens"].is_u64());
    assert_eq!(steps[3]["sequences"], 0, "finished requests are released");
    assert_eq!(v["policy"], "hybrid");
    Ok(())
}

#[test]
fn batch_and_hybrid_errors() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let model = common::fixture("llama_mha").to_string_lossy().into_owned();
    let write = |name: &str, text: &str| -> Result<String> {
        let p = dir.path().join(name);
        std::fs::write(&p, text)?;
        Ok(p.to_string_lossy().into_owned())
    };
    let empty = write("empty.txt", "\n  \n")?;
    let bad_json = write("bad.jsonl", "[1, 2]\n{\"ids\": [3]}\n")?;
    let negative = write("neg.jsonl", "[1, -2]\n")?;
    let empty_ids = write("e.jsonl", "[1]\n[]\n")?;
    let out_of_vocab = write("v.jsonl", "[1]\n[2, 99999]\n")?;
    let text = write("t.txt", "hello\n")?;
    let run = |extra: &[&str], needle: &str| -> Result<()> {
        let mut a = vec!["--model-dir", model.as_str(), "--cpu"];
        a.extend(extra);
        fails_with(&a, needle)
    };
    run(&["--prompts-file", &empty], "holds no prompts")?;
    run(
        &["--prompts-file", "/nonexistent/p.txt"],
        "cannot read --prompts-file",
    )?;
    run(
        &["--prompts-file", &bad_json],
        "line 2 is not a JSON array of token ids",
    )?;
    run(
        &["--prompts-file", &negative],
        "line 1 is not a JSON array of token ids",
    )?;
    run(&["--prompts-file", &empty_ids], "line 2 is an empty prompt")?;
    run(&["--prompts-file", &out_of_vocab], "prompt 2 of the batch")?;
    run(&["--prompts-file", &text], "this model has no tokenizer")?;
    run(
        &["--prompts-file", &empty_ids, "--prompt-ids", "1"],
        "cannot be used with",
    )?;
    run(
        &["--prompts-file", &text, "--decode-ids", "1"],
        "cannot be used with",
    )?;
    run(
        &[
            "--policy",
            "hybrid",
            "--block-size",
            "0",
            "--prompt-ids",
            "1",
        ],
        "--block-size 0",
    )?;
    for r in ["1.5", "-0.25"] {
        run(
            &[
                "--policy",
                "hybrid",
                "--kv-act-ratio",
                r,
                "--prompt-ids",
                "1",
            ],
            "outside [0, 1]",
        )?;
    }
    run(
        &[
            "--policy",
            "hybrid",
            "--kv-act-ratio",
            "half",
            "--prompt-ids",
            "1",
        ],
        "invalid value 'half'",
    )?;
    Ok(())
}

#[test]
fn output_paths_that_cannot_be_written() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("p.jsonl");
    std::fs::write(&file, "[1, 2]\n[3]\n")?;
    let f = file.to_string_lossy().into_owned();
    let model = common::fixture("llama_mha").to_string_lossy().into_owned();
    let missing = dir.path().join("no/such/dir/out.json");
    let m = missing.to_string_lossy().into_owned();
    for input in [["--prompt-ids", "1,2"], ["--prompts-file", f.as_str()]] {
        for (flag, path, needle) in [
            // Checked before the model loads: the message names the flag and the problem.
            (
                "--ids-out",
                m.as_str(),
                format!("--ids-out {m}: the directory"),
            ),
            (
                "--stats-out",
                m.as_str(),
                format!("--stats-out {m}: the directory"),
            ),
            ("--stats-out", "/", "/ is a directory".to_string()),
        ] {
            let mut a = vec![
                "--model-dir",
                model.as_str(),
                "--cpu",
                "--max-new-tokens",
                "2",
            ];
            a.extend(input);
            a.extend([flag, path]);
            let o = llama(&a)?;
            let err = String::from_utf8_lossy(&o.stderr);
            assert_eq!(o.status.code(), Some(1), "{a:?}: {err}");
            assert!(err.contains(&needle), "{a:?}: {err}");
            assert!(!err.contains("panicked"), "{a:?}: {err}");
        }
    }
    assert!(!missing.exists());
    Ok(())
}

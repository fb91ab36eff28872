//! KV reuse in the example CLI (issue "KV reuse across requests", items 3–5): a second run
//! over the same `--prefix-cache` directory restores the prompt from disk and generates the
//! same tokens; `--prefix-cache-disk` bounds the files (evicting the oldest); a prompts file
//! sharing a document restores it from RAM for every prompt after the first;
//! `--save-session` / `--load-session` continue a conversation as if its history had been
//! prefilled; bad combinations and foreign sessions are one-line errors that write nothing.
mod common;

use std::path::Path;

use anyhow::{ensure, Result};
use common::cli::{llama, one_line_error};
use serde_json::Value;

fn model() -> String {
    common::fixture("llama_mha").to_string_lossy().into_owned()
}

fn ids_csv(ids: &[u32]) -> String {
    ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

/// A 30-token prompt: the fixture's ids and more.
fn prompt() -> Result<Vec<u32>> {
    let (p, d) = common::fixture_ids("llama_mha")?;
    Ok([p, d].concat()[..30].to_vec())
}

/// Runs the llama example with `args` plus `--ids-out` and `--stats-out` under `dir`;
/// returns (ids, stats).
fn run(dir: &Path, tag: &str, args: &[&str]) -> Result<(Value, Value)> {
    let ids = dir.join(format!("{tag}.ids.json"));
    let stats = dir.join(format!("{tag}.stats.json"));
    let (i, s) = (ids.to_string_lossy(), stats.to_string_lossy());
    let m = model();
    let mut all = vec!["--model-dir", &m, "--cpu", "--max-new-tokens", "6"];
    all.extend(args);
    all.extend(["--ids-out", &i, "--stats-out", &s]);
    let o = llama(&all)?;
    ensure!(
        o.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let read =
        |p: &Path| -> Result<Value> { Ok(serde_json::from_str(&std::fs::read_to_string(p)?)?) };
    Ok((read(&ids)?, read(&stats)?))
}

#[test]
fn a_second_run_restores_the_prompt_from_the_directory() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let p = ids_csv(&prompt()?);
    let (fresh, _) = run(dir.path(), "fresh", &["--prompt-ids", &p])?;
    for policy in ["full", "headwise", "auto"] {
        // A directory of its own: the first run is cold.
        let c = dir.path().join(policy).to_string_lossy().into_owned();
        let flags = [
            "--prompt-ids",
            &p,
            "--policy",
            policy,
            "--prefix-cache",
            &c,
            "--prefix-cache-chunk",
            "4",
        ];
        let (cold, s1) = run(dir.path(), "cold", &flags)?;
        let (warm, s2) = run(dir.path(), "warm", &flags)?;
        assert_eq!(cold, fresh, "{policy}");
        assert_eq!(warm, fresh, "{policy}");
        let req = |s: &Value| s["prefix_cache"]["requests"][0].clone();
        assert_eq!(req(&s1)["restored_tokens"], 0, "{policy}");
        assert_eq!(req(&s1)["stored_chunks"], 7, "{policy}");
        // 28 tokens (7 chunks of 4) restored from files, 2 prefilled.
        assert_eq!(req(&s2)["from_disk_tokens"], 28, "{policy}");
        assert_eq!(s2["prefill_tokens"], 2, "{policy}");
        assert_eq!(s2["prefix_cache"]["damaged_files"], 0);
    }
    Ok(())
}

#[test]
fn the_disk_budget_keeps_a_prompts_first_chunks() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let cache = dir.path().join("cache");
    let c = cache.to_string_lossy().into_owned();
    let p = ids_csv(&prompt()?);
    // One chunk file: a header page and 4 tokens × 4 layers × 2 (K, V) × 4 heads × 16 × f32
    // = 8 KiB of payload, two pages. Room for three.
    let budget = (3 * 3 * 4096).to_string();
    let (_, s) = run(
        dir.path(),
        "small",
        &[
            "--prompt-ids",
            &p,
            "--prefix-cache",
            &c,
            "--prefix-cache-chunk",
            "4",
            "--prefix-cache-disk",
            &budget,
        ],
    )?;
    let pc = &s["prefix_cache"];
    assert_eq!(pc["disk_bytes"], 3 * 3 * 4096, "{pc}");
    // The prompt's later chunks do not push its first ones out (issue "Hardening IV",
    // class 14): what stays is a prefix a later run can restore.
    assert_eq!(pc["disk_evictions"], 0, "{pc}");
    assert_eq!(std::fs::read_dir(&cache)?.count(), 3);
    let (_, s) = run(
        dir.path(),
        "again",
        &[
            "--prompt-ids",
            &p,
            "--prefix-cache",
            &c,
            "--prefix-cache-chunk",
            "4",
            "--prefix-cache-disk",
            &budget,
        ],
    )?;
    let req = &s["prefix_cache"]["requests"][0];
    assert_eq!(req["restored_tokens"], 12, "{req}");
    assert_eq!(req["from_disk_tokens"], 12, "{req}");
    Ok(())
}

#[test]
fn a_prompts_file_sharing_a_document_restores_it_from_ram() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let doc = prompt()?[..24].to_vec();
    let prompts: Vec<Vec<u32>> = [[7u32, 3].as_slice(), &[9], &[1, 2, 4]]
        .iter()
        .map(|q| [doc.as_slice(), q].concat())
        .collect();
    let file = dir.path().join("p.jsonl");
    let lines: Vec<String> = prompts
        .iter()
        .map(serde_json::to_string)
        .collect::<Result<_, _>>()?;
    std::fs::write(&file, lines.join("\n"))?;
    let f = file.to_string_lossy().into_owned();
    let (ids, s) = run(
        dir.path(),
        "batch",
        &[
            "--prompts-file",
            &f,
            "--prefix-cache-ram",
            "1MiB",
            "--prefix-cache-chunk",
            "4",
        ],
    )?;
    let reqs = s["prefix_cache"]["requests"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(reqs.len(), 3);
    assert_eq!(reqs[0]["restored_tokens"], 0);
    for r in &reqs[1..] {
        assert_eq!(r["from_ram_tokens"], 24, "{r}");
    }
    for (i, p) in prompts.iter().enumerate() {
        let (alone, _) = run(dir.path(), "alone", &["--prompt-ids", &ids_csv(p)])?;
        assert_eq!(ids[i], alone, "prompt {i}");
    }
    Ok(())
}

#[test]
fn a_loaded_session_continues_the_conversation() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let all = prompt()?;
    let (turn1, turn2) = all.split_at(17);
    let session = dir.path().join("chat.kvs");
    let s = session.to_string_lossy().into_owned();
    let (first, _) = run(
        dir.path(),
        "t1",
        &["--prompt-ids", &ids_csv(turn1), "--save-session", &s],
    )?;
    let (second, stats) = run(
        dir.path(),
        "t2",
        &["--prompt-ids", &ids_csv(turn2), "--load-session", &s],
    )?;
    let reply: Vec<u32> = serde_json::from_value(first["generated_ids"].clone())?;
    let history = [turn1, reply.as_slice(), turn2].concat();
    let (fresh, _) = run(dir.path(), "fresh", &["--prompt-ids", &ids_csv(&history)])?;
    assert_eq!(second, fresh);
    // Every token of the first run but its last reply token (no step ran on it).
    let restored = turn1.len() + reply.len() - 1;
    assert_eq!(
        stats["prefix_cache"]["requests"][0]["from_session_tokens"],
        restored
    );
    Ok(())
}

#[test]
fn reuse_errors_are_one_line_and_write_nothing() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let p = ids_csv(&prompt()?);
    let m = model();
    // A session saved by another model.
    let session = dir.path().join("gqa.kvs");
    let s = session.to_string_lossy().into_owned();
    let gqa = common::fixture("llama_gqa").to_string_lossy().into_owned();
    let o = llama(&[
        "--model-dir",
        &gqa,
        "--cpu",
        "--prompt-ids",
        &p,
        "--max-new-tokens",
        "2",
        "--save-session",
        &s,
    ])?;
    ensure!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let not_a_session = dir.path().join("not.kvs");
    std::fs::write(&not_a_session, "hello")?;
    let n = not_a_session.to_string_lossy().into_owned();
    let a_file = not_a_session.to_string_lossy().into_owned();
    let out = dir.path().join("out.json");
    let o_s = out.to_string_lossy().into_owned();
    let cases: Vec<(Vec<&str>, Vec<&str>)> = vec![
        (
            vec!["--load-session", &s],
            vec!["another model", "--load-session"],
        ),
        (
            vec!["--load-session", &n],
            vec!["not a kvpolicy session file"],
        ),
        (
            vec!["--prefix-cache", &a_file],
            vec!["prefix cache directory"],
        ),
        (
            vec!["--prefix-cache-ram", "1MiB", "--policy", "recompute"],
            vec!["recompute", "cannot take restored K/V"],
        ),
        (
            vec!["--prefix-cache-ram", "1MiB", "--prefix-cache-chunk", "0"],
            vec!["--prefix-cache-chunk 0"],
        ),
        (
            vec!["--prefix-cache-ram", "1MiB", "--dump-logits", &o_s],
            vec!["--decode-logits-only"],
        ),
    ];
    for (extra, needles) in cases {
        let mut args = vec![
            "--model-dir",
            &m,
            "--cpu",
            "--prompt-ids",
            &p,
            "--stats-out",
            &o_s,
        ];
        args.extend(&extra);
        let o = llama(&args)?;
        one_line_error(&o, true, &needles)?;
        ensure!(!out.exists(), "{extra:?} wrote an output");
    }
    Ok(())
}

#[test]
fn the_ram_budget_holds_end_to_end() -> Result<()> {
    let dir = tempfile::tempdir()?;
    // Three documents of 12 tokens (3 chunks of 4), each asked twice, in RAM for 4 chunks:
    // every second question finds its document's chunks (used last), the oldest go first.
    let all = prompt()?;
    let docs: Vec<&[u32]> = vec![&all[..12], &all[12..24], &all[6..18]];
    let mut prompts = Vec::new();
    for d in &docs {
        prompts.push([*d, &[5]].concat());
        prompts.push([*d, &[9, 1]].concat());
    }
    let file = dir.path().join("p.jsonl");
    let lines: Vec<String> = prompts
        .iter()
        .map(serde_json::to_string)
        .collect::<Result<_, _>>()?;
    std::fs::write(&file, lines.join("\n"))?;
    let f = file.to_string_lossy().into_owned();
    let cfg: Value = serde_json::from_str(&std::fs::read_to_string(
        common::fixture("llama_mha").join("config.json"),
    )?)?;
    let n = |k: &str| cfg[k].as_u64().unwrap_or(0);
    // 4 tokens × layers × (K, V) × KV heads × head width × f32.
    let chunk = 4 * n("num_hidden_layers") * 2 * n("num_key_value_heads") * n("head_dim") * 4;
    assert!(chunk > 0);
    let budget = 4 * chunk;
    let b = budget.to_string();
    let (_, s) = run(
        dir.path(),
        "ram",
        &[
            "--prompts-file",
            &f,
            "--prefix-cache-ram",
            &b,
            "--prefix-cache-chunk",
            "4",
        ],
    )?;
    let pc = &s["prefix_cache"];
    assert!(
        pc["ram_bytes"].as_u64().unwrap_or(u64::MAX) <= budget,
        "{pc}"
    );
    // Held at the end: the last document's three chunks and the second's last one.
    assert_eq!(pc["ram_bytes"], budget, "{pc}");
    assert_eq!(pc["ram_evictions"], 5, "{pc}");
    let restored: Vec<u64> = (0..6)
        .map(|i| pc["requests"][i]["from_ram_tokens"].as_u64().unwrap_or(99))
        .collect();
    assert_eq!(restored, vec![0, 12, 0, 12, 0, 12], "{pc}");
    Ok(())
}

#[test]
fn saving_a_session_needs_no_restoring_policy() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let session = dir.path().join("s.kvs");
    let s = session.to_string_lossy().into_owned();
    let p = ids_csv(&prompt()?);
    for policy in ["recompute", "hybrid"] {
        let (ids, _) = run(
            dir.path(),
            policy,
            &["--prompt-ids", &p, "--policy", policy, "--save-session", &s],
        )?;
        let (fresh, _) = run(
            dir.path(),
            "fresh",
            &["--prompt-ids", &p, "--policy", policy],
        )?;
        assert_eq!(ids, fresh, "{policy}");
        assert!(session.is_file());
    }
    // And the session it saved continues under full.
    run(
        dir.path(),
        "more",
        &["--prompt-ids", "4,5", "--load-session", &s],
    )?;
    Ok(())
}

//! `--help` reads well: the examples' and kvbench's flags are grouped under headings, in a
//! fixed order, with no flag left under clap's catch-all `Options` but `--help` itself (the
//! server's: `crates/server/tests/reference.rs`). The text itself is the book's flags
//! reference (`tests/book.rs`).
mod common;

use std::process::Command;

use anyhow::{ensure, Context, Result};

/// `name --help`'s sections: each heading with the long flags under it, in order.
fn sections(name: &str) -> Result<Vec<(String, Vec<String>)>> {
    let out = Command::new(common::example_bin(name))
        .arg("--help")
        .output()
        .with_context(|| format!("running {name} --help"))?;
    ensure!(out.status.success(), "{name} --help failed");
    let mut sections: Vec<(String, Vec<String>)> = Vec::new();
    for line in String::from_utf8(out.stdout)?.lines() {
        if let Some(heading) = line.strip_suffix(':').filter(|_| !line.starts_with(' ')) {
            sections.push((heading.to_string(), Vec::new()));
        } else if let Some(flag) = line
            .split_whitespace()
            .find(|w| w.starts_with("--"))
            .filter(|_| line.trim_start().starts_with('-'))
        {
            let (_, flags) = sections
                .last_mut()
                .with_context(|| format!("{name} --help: {flag} before any heading"))?;
            flags.push(flag.trim_end_matches(',').to_string());
        }
    }
    Ok(sections)
}

/// The headings of `name --help` are `want`, in order, after `Options` (which holds only
/// `--help`), and each flag of `placed` is under its heading.
fn check(name: &str, want: &[&str], placed: &[(&str, &str)]) -> Result<()> {
    let got = sections(name)?;
    let headings: Vec<&str> = got.iter().map(|(h, _)| h.as_str()).collect();
    let mut all = vec!["Options"];
    all.extend(want);
    ensure!(
        headings == all,
        "{name} --help's headings: {headings:?}, want {all:?}"
    );
    ensure!(
        got[0].1 == ["--help"],
        "{name} --help: flags without a heading: {:?}",
        got[0].1
    );
    for (flag, heading) in placed {
        let under = got
            .iter()
            .find(|(_, flags)| flags.iter().any(|f| f == flag))
            .map(|(h, _)| h.as_str());
        ensure!(
            under == Some(*heading),
            "{name} --help: {flag} is under {under:?}, want {heading}"
        );
    }
    Ok(())
}

#[test]
fn the_examples_flags_are_grouped_under_headings_in_order() -> Result<()> {
    let placed = [
        ("--model-dir", "Model"),
        ("--cpu", "Model"),
        ("--prompt", "Prompt"),
        ("--decode-ids", "Prompt"),
        ("--policy", "Policy"),
        ("--profile", "Policy"),
        ("--device-kv-budget", "Tiers"),
        ("--link-bandwidth", "Tiers"),
        ("--prefix-cache", "Prefix cache and sessions"),
        ("--load-session", "Prefix cache and sessions"),
        ("--max-new-tokens", "Sampling"),
        ("--prefill-chunk", "Sampling"),
        ("--ids-out", "Output"),
        ("--stats-out", "Output"),
    ];
    let want = [
        "Model",
        "Prompt",
        "Policy",
        "Tiers",
        "Prefix cache and sessions",
        "Sampling",
        "Output",
    ];
    for name in ["llama", "gemma", "mistral", "qwen", "opt"] {
        check(name, &want, &placed)?;
    }
    Ok(())
}

#[test]
fn kvbenchs_flags_are_grouped_under_headings_in_order() -> Result<()> {
    check(
        "kvbench",
        &["Model", "Runs", "Tiers", "Output", "Peers"],
        &[
            ("--gguf", "Model"),
            ("--context", "Runs"),
            ("--policies", "Runs"),
            ("--quick", "Runs"),
            ("--kv-dtype", "Tiers"),
            ("--link-bandwidth", "Tiers"),
            ("--csv", "Output"),
            ("--plot", "Output"),
            ("--no-stock", "Peers"),
            ("--llamacpp", "Peers"),
        ],
    )
}

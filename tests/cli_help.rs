//! `--help` reads well: the examples' and kvbench's flags are grouped under headings, in a
//! fixed order, with no flag left under clap's catch-all `Options` but `--help` itself (the
//! server's: `crates/server/tests/reference.rs`). The text itself is the book's flags
//! reference (`tests/book.rs`).
mod common;

use std::process::Command;

use anyhow::{ensure, Context, Result};

/// The headings of `name --help` are `want`, in order, and each flag of `placed` is under its
/// heading (`common::help::check_grouped`).
fn check(name: &str, want: &[&str], placed: &[(&str, &str)]) -> Result<()> {
    let out = Command::new(common::example_bin(name))
        .arg("--help")
        .output()
        .with_context(|| format!("running {name} --help"))?;
    ensure!(out.status.success(), "{name} --help failed");
    common::help::check_grouped(name, &String::from_utf8(out.stdout)?, want, placed)
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

//! The book's server references stay what the server prints: `kvpolicy-server --help` and the
//! metric families of a fresh `/metrics` (`docs/reference/help/*.txt`, included by
//! `docs/reference/{flags,metrics}.md`; `UPDATE_EXPECT=1 cargo test --release -p
//! kvpolicy-server --test reference` rewrites them after a flag or a metric changes).
use std::process::Command;

use anyhow::{ensure, Result};
use expect_test::expect_file;
use kvpolicy_server::metrics::Metrics;

#[test]
fn the_flags_reference_is_the_servers_help() -> Result<()> {
    let out = Command::new(env!("CARGO_BIN_EXE_kvpolicy-server"))
        .arg("--help")
        .output()?;
    ensure!(out.status.success(), "kvpolicy-server --help failed");
    expect_file!["../../../docs/reference/help/kvpolicy-server.txt"]
        .assert_eq(&String::from_utf8(out.stdout)?);
    Ok(())
}

#[test]
fn the_metrics_reference_is_the_registry() {
    // Only the families' HELP and TYPE lines: samples are values of a moment.
    let families: String = Metrics::new()
        .render()
        .lines()
        .filter(|l| l.starts_with("# HELP") || l.starts_with("# TYPE"))
        .map(|l| format!("{l}\n"))
        .collect();
    expect_file!["../../../docs/reference/help/metrics.txt"].assert_eq(&families);
}

#[test]
fn the_servers_flags_are_grouped_under_headings_in_order() -> Result<()> {
    let out = Command::new(env!("CARGO_BIN_EXE_kvpolicy-server"))
        .arg("--help")
        .output()?;
    ensure!(out.status.success(), "kvpolicy-server --help failed");
    // Each heading with the long flags under it, in order.
    let mut sections: Vec<(String, Vec<String>)> = Vec::new();
    for line in String::from_utf8(out.stdout)?.lines() {
        if let Some(heading) = line.strip_suffix(':').filter(|_| !line.starts_with(' ')) {
            sections.push((heading.to_string(), Vec::new()));
        } else if let Some(flag) = line
            .split_whitespace()
            .find(|w| w.starts_with("--"))
            .filter(|_| line.trim_start().starts_with('-'))
        {
            if let Some((_, flags)) = sections.last_mut() {
                flags.push(flag.trim_end_matches(',').to_string());
            }
        }
    }
    let headings: Vec<&str> = sections.iter().map(|(h, _)| h.as_str()).collect();
    ensure!(
        headings
            == [
                "Options",
                "Model",
                "Policy",
                "Tiers",
                "Prefix cache",
                "Server"
            ],
        "kvpolicy-server --help's headings: {headings:?}"
    );
    ensure!(
        sections[0].1 == ["--help"],
        "kvpolicy-server --help: flags without a heading: {:?}",
        sections[0].1
    );
    for (flag, heading) in [
        ("--model-dir", "Model"),
        ("--seed", "Model"),
        ("--policy", "Policy"),
        ("--device-kv-budget", "Tiers"),
        ("--prefix-cache", "Prefix cache"),
        ("--host", "Server"),
        ("--max-batch", "Server"),
        ("--prefill-chunk", "Server"),
        ("--shutdown-timeout", "Server"),
    ] {
        let under = sections
            .iter()
            .find(|(_, flags)| flags.iter().any(|f| f == flag))
            .map(|(h, _)| h.as_str());
        ensure!(
            under == Some(heading),
            "kvpolicy-server --help: {flag} is under {under:?}, want {heading}"
        );
    }
    Ok(())
}

//! The book's server references stay what the server prints: `kvpolicy-server --help` and the
//! metric families of a fresh `/metrics` (`docs/reference/help/*.txt`, included by
//! `docs/reference/{flags,metrics}.md`; `UPDATE_EXPECT=1 cargo test --release -p
//! kvpolicy-server --test reference` rewrites them after a flag or a metric changes).
use std::process::Command;

use anyhow::{ensure, Result};
use expect_test::expect_file;
use kvpolicy_server::metrics::Metrics;

/// The `--help` sections and their check, shared with the examples' (`tests/cli_help.rs`).
#[path = "../../../tests/common/help.rs"]
mod help;

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
    // Only the families' HELP and TYPE lines: samples are values of a moment. A family
    // with labels renders once it has a sample: one of each is made.
    let m = Metrics::new();
    m.answered("/v1/completions", 200);
    m.set_kv(&kvpolicy::KvStats::default());
    m.set_pool(&kvpolicy::KvPool::new(Some(1), Some(1)));
    m.preempted("recompute");
    m.set_prefix(&kvpolicy::prefix::PrefixStats::default());
    m.prefix_write_errors
        .get_or_create(&kvpolicy_server::metrics::KindLabels {
            kind: "other".into(),
        })
        .inc();
    let families: String = m
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
    help::check_grouped(
        "kvpolicy-server",
        &String::from_utf8(out.stdout)?,
        &["Model", "Policy", "Tiers", "Prefix cache", "Server"],
        &[
            ("--model-dir", "Model"),
            ("--seed", "Model"),
            ("--policy", "Policy"),
            ("--device-kv-budget", "Tiers"),
            ("--prefix-cache", "Prefix cache"),
            ("--host", "Server"),
            ("--max-batch", "Server"),
            ("--prefill-chunk", "Server"),
            ("--shutdown-timeout", "Server"),
        ],
    )
}

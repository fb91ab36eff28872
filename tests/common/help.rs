//! A program's `--help` as clap prints it with headings: its sections, and the check that the
//! headings come in a fixed order with each flag under its own (issue 55's "`--help` that
//! reads well"). Shared by `tests/cli_help.rs` (the examples, kvbench) and
//! `crates/server/tests/reference.rs` (the server, which includes this file by path).
use anyhow::{ensure, Context, Result};

/// One heading of a `--help` text with the long flags under it, in order.
pub struct HelpSection {
    /// The heading, without its colon (`Options` is clap's catch-all).
    pub heading: String,
    /// The long flags under it.
    pub flags: Vec<String>,
}

/// The sections of `help`, in order; a flag before any heading is an error.
pub fn sections(help: &str) -> Result<Vec<HelpSection>> {
    let mut out: Vec<HelpSection> = Vec::new();
    for line in help.lines() {
        if let Some(heading) = line.strip_suffix(':').filter(|_| !line.starts_with(' ')) {
            out.push(HelpSection {
                heading: heading.to_string(),
                flags: Vec::new(),
            });
        } else if let Some(flag) = line
            .split_whitespace()
            .find(|w| w.starts_with("--"))
            .filter(|_| line.trim_start().starts_with('-'))
        {
            let section = out
                .last_mut()
                .with_context(|| format!("{flag} before any heading"))?;
            section.flags.push(flag.trim_end_matches(',').to_string());
        }
    }
    Ok(out)
}

/// `name`'s `help` has the headings `want`, in order, after `Options` (which holds only
/// `--help`), and each flag of `placed` is under its heading.
pub fn check_grouped(name: &str, help: &str, want: &[&str], placed: &[(&str, &str)]) -> Result<()> {
    let got = sections(help).with_context(|| format!("{name} --help"))?;
    let headings: Vec<&str> = got.iter().map(|s| s.heading.as_str()).collect();
    let mut all = vec!["Options"];
    all.extend(want);
    ensure!(
        headings == all,
        "{name} --help's headings: {headings:?}, want {all:?}"
    );
    ensure!(
        got[0].flags == ["--help"],
        "{name} --help: flags without a heading: {:?}",
        got[0].flags
    );
    for (flag, heading) in placed {
        let under = got
            .iter()
            .find(|s| s.flags.iter().any(|f| f == flag))
            .map(|s| s.heading.as_str());
        ensure!(
            under == Some(*heading),
            "{name} --help: {flag} is under {under:?}, want {heading}"
        );
    }
    Ok(())
}

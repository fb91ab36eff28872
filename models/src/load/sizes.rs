//! Sizes a config implies, checked before anything is allocated from them: the layer count
//! against the weights actually present, and the weight bytes of a random-weight model
//! against the memory the machine has. A config with `num_hidden_layers: 1e9` or a
//! `head_dim` of 2^40 is an error naming the field, never an allocation the OS kills.
use candle_core::DType;
use candle_nn::VarBuilder;

use crate::config::{LlamaConfig, ModelConfig, OptConfig};
use crate::error::{ModelError, Result};

impl ModelConfig {
    fn llama(&self) -> Option<&LlamaConfig> {
        match self {
            ModelConfig::Llama(c)
            | ModelConfig::Mistral(c)
            | ModelConfig::Qwen2(c)
            | ModelConfig::Gemma(c)
            | ModelConfig::Gemma2(c)
            | ModelConfig::Gemma3(c) => Some(c),
            ModelConfig::Opt(_) => None,
        }
    }

    /// The architecture's own checks (field values, head counts), run before anything is
    /// built from the config.
    pub fn validate_sizes(&self) -> Result<()> {
        match self {
            ModelConfig::Opt(c) => c.validate(),
            _ => self.llama().map_or(Ok(()), LlamaConfig::validate),
        }
    }

    /// Decoder layers the config declares.
    pub fn num_layers(&self) -> usize {
        match self {
            ModelConfig::Opt(c) => c.num_hidden_layers,
            _ => self.llama().map_or(0, |c| c.num_hidden_layers),
        }
    }

    /// The name of layer `i`'s query projection weight.
    fn layer_probe(&self, i: usize) -> String {
        match self {
            ModelConfig::Opt(_) => format!("model.decoder.layers.{i}.self_attn.q_proj.weight"),
            _ => format!("model.layers.{i}.self_attn.q_proj.weight"),
        }
    }

    /// Weight values the config implies (`None` when the count overflows).
    pub fn weight_values(&self) -> Option<u64> {
        let m = |a: usize, b: usize| (a as u64).checked_mul(b as u64);
        let per_layer_and_rest = |per_layer: Option<u64>, rest: Option<u64>| {
            per_layer?
                .checked_mul(self.num_layers() as u64)?
                .checked_add(rest?)
        };
        match self {
            ModelConfig::Opt(OptConfig {
                hidden_size: h,
                ffn_dim: f,
                vocab_size: v,
                max_position_embeddings: p,
                ..
            }) => per_layer_and_rest(
                m(*h, *h)?
                    .checked_mul(4)?
                    .checked_add(m(*h, *f)?.checked_mul(2)?),
                m(*v, *h)?.checked_add(m(p.saturating_add(2), *h)?),
            ),
            _ => {
                let c = self.llama()?;
                let (h, d) = (c.hidden_size, c.head_dim());
                let q = m(c.num_attention_heads, d)?;
                let kv = m(c.n_kv_heads(), d)?;
                let attn = q.checked_add(kv)?.checked_mul(2)?.checked_mul(h as u64)?;
                let mlp = m(h, c.intermediate_size)?.checked_mul(3)?;
                per_layer_and_rest(attn.checked_add(mlp), m(c.vocab_size, h)?.checked_mul(2))
            }
        }
    }
}

/// Checks that the weights hold exactly the config's layers: layer `n - 1` present, layer
/// `n` absent.
pub fn check_layers_present(
    cfg: &ModelConfig,
    vb: &VarBuilder,
    path: &std::path::Path,
) -> Result<()> {
    let n = cfg.num_layers();
    let bad = |message: String| ModelError::Weights {
        path: path.to_path_buf(),
        message: message.into(),
    };
    if n > 0 && !vb.contains_tensor(&cfg.layer_probe(n - 1)) {
        return Err(bad(format!(
            "hold no {} although config.json says num_hidden_layers = {n}; the config does not match the weights",
            cfg.layer_probe(n - 1)
        )));
    }
    if vb.contains_tensor(&cfg.layer_probe(n)) {
        return Err(bad(format!(
            "hold {} although config.json says num_hidden_layers = {n}; the config does not match the weights",
            cfg.layer_probe(n)
        )));
    }
    Ok(())
}

/// Memory this process can still get: the machine's (Linux `MemAvailable`), or less
/// under an address-space limit (`ulimit -v`, `RLIMIT_AS`), if either is known.
pub fn available_bytes() -> Option<u64> {
    let machine = (|| {
        let info = std::fs::read_to_string("/proc/meminfo").ok()?;
        let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
        let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        kib.checked_mul(1024)
    })();
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit fills the struct it is given.
    let limited = (unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut lim) } == 0
        && lim.rlim_cur != libc::RLIM_INFINITY)
        .then_some(lim.rlim_cur);
    match (machine, limited) {
        (Some(m), Some(l)) => Some(m.min(l)),
        (m, l) => m.or(l),
    }
}

/// Bytes a decoder layer costs beyond its weight values (bounded above).
const LAYER_OVERHEAD_BYTES: u64 = 4096;

/// Checks that random weights for `cfg` in `dtype` fit in memory before drawing them,
/// counting `LAYER_OVERHEAD_BYTES` per layer besides the values.
pub fn check_random_fits(cfg: &ModelConfig, dtype: DType) -> Result<()> {
    // Each layer costs more than its values: a dozen tensors, their storage and the
    // layer's own structures (measured ~750 bytes on a model of 10^7 one-wide layers).
    let overhead = (cfg.num_layers() as u64).checked_mul(LAYER_OVERHEAD_BYTES);
    let bytes = cfg
        .weight_values()
        .and_then(|v| v.checked_mul(dtype.size_in_bytes() as u64))
        .and_then(|b| b.checked_add(overhead?));
    let avail = available_bytes();
    match (bytes, avail) {
        (Some(b), Some(a)) if b <= a => Ok(()),
        (Some(_), None) => Ok(()),
        (b, a) => Err(ModelError::config(
            "num_hidden_layers",
            format!(
                "with hidden_size, intermediate_size, head_dim and vocab_size this config's weights need {}, more than the {} this machine has available; check those fields",
                b.map_or("more than 2^64 bytes".into(), kvpolicy_core::format_bytes),
                a.map_or("?".into(), kvpolicy_core::format_bytes)
            ),
        )),
    }
}

//! What config.json says of the model-side KV reductions (issue 35): MLKV's
//! `num_key_value_layers` (arXiv 2406.09297 §3: which layers project K/V, which read another's
//! cache) and the label `kvpolicy-compress` writes on a converted, LOSSY checkpoint.
use crate::config::LlamaConfig;
use crate::error::{ModelError, Result};

impl LlamaConfig {
    /// Per layer, the layer whose K/V it attends over: itself for a KV layer. MLKV's
    /// placement (its reference code): with `m` KV layers of `L`, layers `0` and
    /// `⌊(i + 1) · L / m⌋` for `i < m - 1` project K/V, and each other layer reads the
    /// nearest KV layer below it.
    pub fn kv_sources(&self) -> Result<Vec<usize>> {
        let l = self.num_hidden_layers;
        let m = self.num_key_value_layers.unwrap_or(l);
        if m == 0 || m > l {
            return Err(ModelError::config(
                "num_key_value_layers",
                format!("is {m}; it must be between 1 and num_hidden_layers = {l}"),
            ));
        }
        let mut kv = vec![false; l];
        kv[0] = true;
        for i in 0..m - 1 {
            kv[(i + 1) * l / m] = true;
        }
        let mut owner = 0;
        Ok((0..l)
            .map(|i| {
                if kv[i] {
                    owner = i;
                }
                owner
            })
            .collect())
    }

    /// A lossy conversion the checkpoint declares (`kvpolicy_conversion` with `"lossy":
    /// true`), described in a few words for summaries; `None` for an unconverted model or
    /// one whose conversion changed nothing.
    pub fn lossy_conversion(&self) -> Option<String> {
        let c = self.kvpolicy_conversion.as_ref()?;
        if c.get("lossy").and_then(serde_json::Value::as_bool) != Some(true) {
            return None;
        }
        let mut parts = Vec::new();
        if let Some(h) = c.get("kv_heads") {
            if let (Some(a), Some(b)) = (h.get("from"), h.get("to")) {
                if a != b {
                    parts.push(format!("KV heads {a}→{b}"));
                }
            }
        }
        if let Some(l) = c.get("kv_layers") {
            if let (Some(a), Some(b)) = (l.get("from"), l.get("to")) {
                if a != b {
                    parts.push(format!("KV layers {a}→{b}"));
                }
            }
        }
        if let Some(m) = c.get("method").and_then(serde_json::Value::as_str) {
            parts.push(format!("by {m}"));
        }
        Some(format!(
            "converted by kvpolicy-compress: {}",
            parts.join(" ")
        ))
    }
}

//! A synthetic history (`--synthetic-history`): random K/V stored with
//! [`KvRestore::append_kv`](kvpolicy::core::KvRestore::append_kv) chunk by chunk and layer by layer, as a prefill would store them,
//! but without computing attention — so that decode can be timed at contexts whose prefill
//! would take hours here (512K tokens: the attention of a chunked prefill grows with the
//! square of the context). Decode's cost does not depend on the values; its logits mean
//! nothing.
use anyhow::Result;
use candle_core::Tensor;
use kvpolicy::models::layer_specs;
use kvpolicy::prefix::{restore_kv, ChunkKv, LayerKv};
use kvpolicy::{CausalLm, KvPolicy};

/// Stores `context` tokens of random K/V (standard normal, the model's dtype) in `policy`,
/// `chunk` tokens per step (through the prefix cache's [`restore_kv`], as a restored prefix).
pub fn fill(
    model: &dyn CausalLm,
    policy: &mut dyn KvPolicy,
    context: usize,
    chunk: usize,
) -> Result<()> {
    let info = model.info();
    let (dev, chunk) = (&info.device, chunk.max(1));
    let layers = layer_specs(info);
    let mut start = 0;
    while start < context {
        let t = chunk.min(context - start);
        let dims = (1, info.n_kv_heads, t, info.head_dim);
        let random =
            || -> Result<Tensor> { Ok(Tensor::randn(0f32, 1.0, dims, dev)?.to_dtype(info.dtype)?) };
        let kv = ChunkKv {
            layers: (0..info.kv_layers())
                .map(|_| {
                    Ok(LayerKv {
                        k: random()?,
                        v: random()?,
                    })
                })
                .collect::<Result<_>>()?,
        };
        let at = kvpolicy::prefix::Placement {
            seq: 0,
            pos: start,
            piece: 0,
        };
        restore_kv(policy, &kv, at, &layers)?;
        start += t;
    }
    Ok(())
}

/// Writes out the dirty pages of the disk tier's files (just filled; other files under
/// `--disk-dir` are not touched): a prefill's minutes would have written them back long
/// before decode, while right after a fill of seconds the first direct reads would wait for
/// that writeback.
pub fn settle() -> Result<()> {
    Ok(kvpolicy::tiered::sync_disk_files()?)
}

/// Checks, before any variant is measured, that `policy` (the variant `label`) takes a
/// synthetic history (one token stored through `append_kv`): one that cannot fails the
/// sweep before the others' results are computed and lost.
pub fn check(model: &dyn CausalLm, policy: &mut dyn KvPolicy, label: &str) -> Result<()> {
    fill(model, policy, 1, 1).map_err(|e| e.context(format!("--synthetic-history with `{label}`")))
}

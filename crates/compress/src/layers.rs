//! Fewer KV layers: MLKV (Zuhri et al., arXiv 2406.09297 §3). Only `m` of the `L` layers
//! keep K/V projections — layers 0 and `⌊(i + 1) · L / m⌋` for `i < m - 1`, the placement of
//! MLKV's reference code, which the models read back from `num_key_value_layers` — and every
//! other layer attends over the cache of the nearest KV layer below it.
//!
//! The owner's projections become the mean of its group's (itself and the layers that will
//! read it). MLKV's converter averages them pairwise as it walks the layers (each later
//! layer weighs as much as everything before it); a group's plain mean weighs every layer
//! alike. Either way it is only a starting point: MLKV then uptrains, which this converter
//! does not (training-free, so LOSSY: see docs/model-reductions.md).
use candle_core::Tensor;
use serde_json::json;

use crate::checkpoint::{AttnShape, Checkpoint};
use crate::error::{CompressError, Result};

/// Per layer, the KV layer whose cache it reads (itself for a KV layer), for `m` of `l`.
pub fn owners(l: usize, m: usize) -> Vec<usize> {
    let mut kv = vec![false; l];
    kv[0] = true;
    for i in 0..m.saturating_sub(1) {
        kv[(i + 1) * l / m] = true;
    }
    let mut owner = 0;
    (0..l)
        .map(|i| {
            if kv[i] {
                owner = i;
            }
            owner
        })
        .collect()
}

/// Checks `m` against the model before any work.
pub fn check_target(ck: &Checkpoint, shape: &AttnShape, m: usize) -> Result<()> {
    if m == 0 || m > shape.layers {
        return Err(CompressError::Setting(format!(
            "--kv-layers {m} is not between 1 and the model's {} layers",
            shape.layers
        )));
    }
    if let Some(v) = ck.config.get("num_key_value_layers") {
        if v.as_u64() != Some(shape.layers as u64) {
            return Err(CompressError::Setting(format!(
                "the model already shares K/V across layers (num_key_value_layers = {v}); convert the original model instead"
            )));
        }
    }
    Ok(())
}

/// Keeps K/V projections in `m` layers (see the module docs); `m` equal to the layer count
/// leaves every tensor as it is.
pub fn share_layers(ck: &mut Checkpoint, m: usize) -> Result<()> {
    let shape = ck.shape()?;
    check_target(ck, &shape, m)?;
    if m == shape.layers {
        return Ok(());
    }
    let owner_of = owners(shape.layers, m);
    let name = |i: usize, p: &str, t: &str| format!("model.layers.{i}.self_attn.{p}.{t}");
    for o in 0..shape.layers {
        let group: Vec<usize> = (0..shape.layers).filter(|&i| owner_of[i] == o).collect();
        if group.first() != Some(&o) || group.len() == 1 {
            continue;
        }
        for p in ["k_proj", "v_proj"] {
            for t in ["weight", "bias"] {
                if !ck.tensors.contains_key(&name(o, p, t)) {
                    continue;
                }
                let parts = group
                    .iter()
                    .map(|&i| {
                        Ok(ck
                            .tensor(&name(i, p, t))?
                            .to_dtype(candle_core::DType::F32)?)
                    })
                    .collect::<Result<Vec<Tensor>>>()?;
                let dtype = ck.tensor(&name(o, p, t))?.dtype();
                let mean =
                    (Tensor::stack(&parts, 0)?.sum(0)? / group.len() as f64)?.to_dtype(dtype)?;
                ck.tensors.insert(name(o, p, t), mean);
                for &i in &group[1..] {
                    ck.tensors.remove(&name(i, p, t));
                }
            }
        }
    }
    ck.config.insert("num_key_value_layers".into(), json!(m));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placement_follows_mlkv() {
        // pythia-mlkv: [0] + [int((i + 1) * (L / m)) for i in range(m - 1)].
        assert_eq!(owners(5, 2), vec![0, 0, 2, 2, 2]);
        assert_eq!(owners(5, 3), vec![0, 1, 1, 3, 3]);
        assert_eq!(owners(30, 15)[..4], [0, 0, 2, 2]);
        assert_eq!(owners(30, 6).iter().filter(|&&o| o == 25).count(), 5);
        assert_eq!(owners(4, 4), vec![0, 1, 2, 3]);
        assert_eq!(owners(4, 1), vec![0; 4]);
    }
}

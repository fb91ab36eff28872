//! The cost probe (HybridServe §4.2, "profiling"): the linear cost models of transfer and
//! recompute time the KV:ACT ratio and the mini-batch packing are computed from — read off a
//! given profile (lines through the origin), or measured by transferring and regenerating
//! 16, 64 and 256 tokens on the run's device and link and fitting lines.
use candle_core::Device;
use kvpolicy_core::{KvRegen, KvShape, Profile, Result};
use kvpolicy_tiered::{Probe, TransferEngine};

use crate::ratio::{Costs, LinearCost};

/// Token counts the profiler probes to fit the linear cost models.
pub const PROBE_TOKENS: [usize; 3] = [16, 64, 256];

/// Bytes of one token's K and V row.
pub fn kv_row_bytes(shape: &KvShape) -> u64 {
    (2 * shape.n_kv_heads * shape.head_dim * shape.dtype.size_in_bytes()) as u64
}

/// Bytes of one token's layer input row.
pub fn x_row_bytes(shape: &KvShape) -> u64 {
    (shape.hidden * shape.dtype.size_in_bytes()) as u64
}

/// Where the costs are measured.
pub struct ProbeSite<'a> {
    /// The device tier.
    pub device: &'a Device,
    /// The simulated link, if any.
    pub link: Option<f64>,
    /// The engine the run copies with.
    pub engine: &'a mut dyn TransferEngine,
    /// The model's regeneration.
    pub regen: &'a dyn KvRegen,
}

/// The cost models for `shape` — from `given`, else measured at `site` — and the profile
/// that reports them.
pub fn fit_costs(
    given: Option<&Profile>,
    shape: &KvShape,
    site: ProbeSite<'_>,
) -> Result<(Costs, Profile)> {
    let (kvb, xb) = (kv_row_bytes(shape), x_row_bytes(shape));
    let costs = match given {
        Some(p) => Costs::from_profile(p, kvb, xb),
        None => {
            let (mut tp, mut rp) = (Vec::new(), Vec::new());
            for tokens in PROBE_TOKENS {
                let probe = Probe {
                    device: site.device,
                    batch: 1,
                    hidden: shape.hidden,
                    dtype: shape.dtype,
                    transfer_bytes: tokens * kvb as usize,
                    tokens,
                    link: site.link,
                };
                let p =
                    kvpolicy_tiered::probe::measure_cached(&probe, &mut *site.engine, site.regen)?;
                tp.push((tokens as f64, p.transfer_s((tokens as u64 * kvb) as f64)));
                rp.push((tokens as f64, p.recompute_s(tokens as f64)));
            }
            Costs {
                kv_bytes: kvb,
                x_bytes: xb,
                transfer: LinearCost::fit_or_rate(&tp),
                recompute: LinearCost::fit_or_rate(&rp),
            }
        }
    };
    let profile = Profile {
        h2d_bytes_per_s: kvb as f64 / costs.transfer.per_token_s,
        recompute_tokens_per_s: 1.0 / costs.recompute.per_token_s,
        device: Some(format!("{:?}", site.device.location())),
        shape: Some(format!(
            "hybrid: transfer {:.3e} s + {:.3e} s/token, recompute {:.3e} s + {:.3e} s/token",
            costs.transfer.fixed_s,
            costs.transfer.per_token_s,
            costs.recompute.fixed_s,
            costs.recompute.per_token_s
        )),
    };
    Ok((costs, profile))
}

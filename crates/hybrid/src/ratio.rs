//! The KV:ACT ratio (HybridServe §4.2): linear cost models of transfer and recompute time
//! against tokens, fitted to profiled points, and the share of blocks stored as K/V that
//! makes the two equal.
//!
//! Per layer and step, a request of `s` cached tokens whose blocks are a share `k` K/V
//! (on the host, transferred) and `1 − k` activations (on the device, regenerated) costs
//! `T(k) = t₀ + t₁·k·s` of transfer and `R(k) = r₀ + r₁·(1 − k)·s` of recompute, which
//! overlap: the step takes `max(T, R)`. `T` rises and `R` falls with `k`, so the minimum
//! sits where they cross, `k* = (r₀ − t₀ + r₁·s) / (s·(t₁ + r₁))`, clamped to [0, 1] and
//! rounded to whole blocks by comparing the two neighbours (and the two ends, which each
//! save one fixed cost).
//!
//! An activation block is only worth keeping when one token's layer input is smaller than
//! its K and V: otherwise storing K/V is cheaper in memory *and* needs no recompute. For
//! grouped-query models (X = hidden > 2·kv_heads·head_dim) the ratio is therefore all-KV —
//! derived from the byte sizes, not assumed.
use kvpolicy_core::{Knob, KvError, Profile, Result};

/// Seconds as an affine function of tokens: `fixed_s + per_token_s · tokens`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinearCost {
    /// Seconds at zero tokens (launch and latency overhead).
    pub fixed_s: f64,
    /// Seconds per token.
    pub per_token_s: f64,
}

impl LinearCost {
    /// Seconds for `tokens` tokens.
    pub fn at(&self, tokens: f64) -> f64 {
        self.fixed_s + self.per_token_s * tokens
    }

    /// Least-squares line through `(tokens, seconds)` points. Needs two distinct token
    /// counts; a negative intercept (measurement noise) is clamped to 0 and the slope refit
    /// through the origin, and the slope must come out positive.
    pub fn fit(points: &[(f64, f64)]) -> Result<Self> {
        let bad = |why: &str| KvError::invariant(format!("cannot fit a cost line: {why}"));
        if points
            .iter()
            .any(|&(x, y)| !(x.is_finite() && y.is_finite()) || x < 0.0 || y < 0.0)
        {
            return Err(bad("a point is negative or not finite"));
        }
        let n = points.len() as f64;
        let mx = points.iter().map(|p| p.0).sum::<f64>() / n;
        let my = points.iter().map(|p| p.1).sum::<f64>() / n;
        let sxx: f64 = points.iter().map(|p| (p.0 - mx) * (p.0 - mx)).sum();
        if points.len() < 2 || sxx <= 0.0 {
            return Err(bad("fitting a line needs two different token counts"));
        }
        let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
        let mut slope = sxy / sxx;
        let mut fixed = my - slope * mx;
        if fixed < 0.0 {
            fixed = 0.0;
            let sx2: f64 = points.iter().map(|p| p.0 * p.0).sum();
            slope = points.iter().map(|p| p.0 * p.1).sum::<f64>() / sx2;
        }
        if !(slope > 0.0 && slope.is_finite()) {
            return Err(bad("the cost does not grow with the token count"));
        }
        Ok(Self {
            fixed_s: fixed,
            per_token_s: slope,
        })
    }
}

impl LinearCost {
    /// [`LinearCost::fit`], or — when timing noise defeats the fit (tiny copies on a CPU) —
    /// the line through the origin and the point of most tokens.
    pub fn fit_or_rate(points: &[(f64, f64)]) -> Self {
        Self::fit(points).unwrap_or_else(|_| {
            let (x, y) = points
                .iter()
                .copied()
                .fold((0.0, 0.0), |a, p| if p.0 > a.0 { p } else { a });
            Self {
                fixed_s: 0.0,
                per_token_s: if x > 0.0 && y > 0.0 {
                    y / x
                } else {
                    f64::MIN_POSITIVE
                },
            }
        })
    }
}

/// What one layer of one request costs, per token and overall.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Costs {
    /// Bytes of one token's K and V (one layer).
    pub kv_bytes: u64,
    /// Bytes of one token's layer input X (one layer).
    pub x_bytes: u64,
    /// Host→device transfer of K/V, against tokens.
    pub transfer: LinearCost,
    /// Regeneration of K/V from X on the device, against tokens.
    pub recompute: LinearCost,
}

impl Costs {
    /// Lines through the origin from a profile's rates.
    pub fn from_profile(p: &Profile, kv_bytes: u64, x_bytes: u64) -> Self {
        Self {
            kv_bytes,
            x_bytes,
            transfer: LinearCost {
                fixed_s: 0.0,
                per_token_s: kv_bytes as f64 / p.h2d_bytes_per_s,
            },
            recompute: LinearCost {
                fixed_s: 0.0,
                per_token_s: 1.0 / p.recompute_tokens_per_s,
            },
        }
    }

    /// Whether activation blocks can ever pay off: X smaller than K+V.
    pub fn act_worthwhile(&self) -> bool {
        self.x_bytes < self.kv_bytes
    }

    /// Seconds one layer step takes with `kv_blocks` of `blocks` blocks (of `block`
    /// tokens) stored as K/V: transfer and recompute overlap.
    pub fn step_s(&self, kv_blocks: usize, blocks: usize, block: usize) -> f64 {
        let kv = (kv_blocks * block) as f64;
        let act = ((blocks - kv_blocks.min(blocks)) * block) as f64;
        let t = if kv > 0.0 { self.transfer.at(kv) } else { 0.0 };
        let r = if act > 0.0 {
            self.recompute.at(act)
        } else {
            0.0
        };
        t.max(r)
    }

    /// K/V blocks out of `blocks` that balance transfer against recompute: all of them
    /// when activations do not pay off, else the crossing point rounded to the better
    /// neighbour.
    pub fn balanced_kv_blocks(&self, blocks: usize, block: usize) -> usize {
        if !self.act_worthwhile() || blocks == 0 {
            return blocks;
        }
        let s = (blocks * block) as f64;
        let (t, r) = (self.transfer, self.recompute);
        let k = ((r.fixed_s - t.fixed_s + r.per_token_s * s)
            / (s * (t.per_token_s + r.per_token_s)))
            .clamp(0.0, 1.0);
        let lo = ((k * blocks as f64).floor() as usize).min(blocks);
        // Between the ends the cost is convex (a rising and a falling line), so the best
        // interior count neighbours the crossing; the ends drop one fixed cost each.
        [lo, (lo + 1).min(blocks), 0, blocks]
            .into_iter()
            .fold((blocks, f64::INFINITY), |best, n| {
                let t = self.step_s(n, blocks, block);
                if t < best.1 {
                    (n, t)
                } else {
                    best
                }
            })
            .0
    }

    /// The balanced share of K/V blocks for a request of `tokens` tokens.
    pub fn balanced_share(&self, tokens: usize, block: usize) -> f64 {
        let blocks = tokens.div_ceil(block.max(1)).max(1);
        self.balanced_kv_blocks(blocks, block) as f64 / blocks as f64
    }
}

/// Checks a forced KV share (`kv_act_ratio`).
pub fn check_share(share: f64) -> Result<f64> {
    if share.is_finite() && (0.0..=1.0).contains(&share) {
        Ok(share)
    } else {
        Err(KvError::InvalidOption {
            policy: "hybrid".into(),
            option: Knob::Setting("kv_act_ratio"),
            message: format!(
                "{share} is outside [0, 1]: it is the share of blocks stored as K/V (1 = all KV, 0.5 = 1:1, 0 = all activations)"
            ),
        })
    }
}

/// Whether block `index` (from 0) of a request kept at `share` K/V is a K/V block: the
/// K/V blocks are spread evenly, so the first `i` blocks always hold `⌊share·i⌋` of them
/// (up to rounding) and every new block keeps the request at its ratio.
pub fn is_kv_block(index: usize, share: f64) -> bool {
    let before = (share * index as f64 + 1e-9).floor();
    let after = (share * (index + 1) as f64 + 1e-9).floor();
    after > before
}

#[cfg(test)]
mod tests {
    use super::*;

    fn brute(c: &Costs, blocks: usize, block: usize) -> f64 {
        (0..=blocks)
            .map(|k| c.step_s(k, blocks, block))
            .fold(f64::INFINITY, f64::min)
    }

    #[test]
    fn balanced_ratio_matches_a_brute_force_search() {
        for (kv, x) in [(8192u64, 4096u64), (2048, 1024), (1024, 1000)] {
            for bw in [1e8, 1e9, 1.6e10, 5e10] {
                for rate in [1e3, 1e4, 1e5, 1e6] {
                    for (tf, rf) in [(0.0, 0.0), (1e-4, 0.0), (0.0, 2e-4), (5e-5, 5e-5)] {
                        let c = Costs {
                            kv_bytes: kv,
                            x_bytes: x,
                            transfer: LinearCost {
                                fixed_s: tf,
                                per_token_s: kv as f64 / bw,
                            },
                            recompute: LinearCost {
                                fixed_s: rf,
                                per_token_s: 1.0 / rate,
                            },
                        };
                        for blocks in [1, 2, 3, 7, 16, 64, 257] {
                            for block in [1, 4, 16] {
                                let k = c.balanced_kv_blocks(blocks, block);
                                let got = c.step_s(k, blocks, block);
                                let want = brute(&c, blocks, block);
                                assert!(
                                    got <= want * (1.0 + 1e-12),
                                    "kv {kv} bw {bw} rate {rate} blocks {blocks}: {got} > {want}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn gqa_shapes_are_all_kv() {
        // Llama-3-8B: hidden 4096, 8 KV heads of 128 → K+V = 2048 values < X = 4096.
        // SmolLM2-135M: hidden 576, 3 KV heads of 64 → 384 < 576.
        for (hidden, kv_heads, head_dim) in [(4096u64, 8u64, 128u64), (576, 3, 64), (2048, 4, 64)] {
            let c = Costs {
                kv_bytes: 2 * kv_heads * head_dim * 2,
                x_bytes: hidden * 2,
                transfer: LinearCost {
                    fixed_s: 0.0,
                    per_token_s: 1.0,
                },
                recompute: LinearCost {
                    fixed_s: 0.0,
                    per_token_s: 1e-9,
                },
            };
            for blocks in [1, 5, 100] {
                assert_eq!(c.balanced_kv_blocks(blocks, 16), blocks);
            }
        }
    }

    #[test]
    fn fit_recovers_a_line_and_rejects_nonsense() -> Result<()> {
        let pts: Vec<(f64, f64)> = [16.0, 64.0, 256.0]
            .iter()
            .map(|&x| (x, 2e-4 + 3e-6 * x))
            .collect();
        let l = LinearCost::fit(&pts)?;
        assert!((l.fixed_s - 2e-4).abs() < 1e-12 && (l.per_token_s - 3e-6).abs() < 1e-15);
        // A negative intercept is clamped to zero, the slope refit through the origin.
        let l = LinearCost::fit(&[(10.0, 0.5), (20.0, 2.0)])?;
        assert_eq!(l.fixed_s, 0.0);
        assert!(l.per_token_s > 0.0);
        assert!(LinearCost::fit(&[(10.0, 1.0)]).is_err());
        assert!(LinearCost::fit(&[(10.0, 1.0), (10.0, 2.0)]).is_err());
        assert!(LinearCost::fit(&[(10.0, 2.0), (20.0, 1.0)]).is_err());
        assert!(LinearCost::fit(&[(10.0, f64::NAN), (20.0, 1.0)]).is_err());
        Ok(())
    }

    #[test]
    fn kv_blocks_are_spread_at_the_share() {
        for share in [0.0, 0.25, 1.0 / 3.0, 0.5, 0.75, 1.0] {
            for n in 1..50 {
                let kv = (0..n).filter(|&i| is_kv_block(i, share)).count();
                assert_eq!(
                    kv,
                    (share * n as f64 + 1e-9).floor() as usize,
                    "{share} {n}"
                );
            }
        }
        assert!(check_share(-0.1).is_err() && check_share(1.5).is_err());
        assert!(check_share(f64::NAN).is_err() && check_share(0.5).is_ok());
    }
}

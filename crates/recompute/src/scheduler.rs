//! The split scheduler of partial recompute (KVPR §3.3, the latency-oriented row-by-row
//! schedule).
//!
//! For one layer of one decode step with `s` cached tokens, recomputing the first `l`
//! tokens costs
//!
//! ```text
//! t(l) = l·x/B + max(l·r, (s − l)·kv/B)
//! ```
//!
//! where `x` and `kv` are the bytes of one token's layer input and of its K and V, `B` the
//! host→device bandwidth and `r` the seconds to regenerate one token: X[0:l) crosses the
//! link first, then K/V[l:s) crosses while the device regenerates K/V[0:l).
//!
//! `t` is convex and piecewise linear. Below the balance point
//! `l* = s·kv / (B·r + kv)` (where recompute and the remaining transfer finish together)
//! its slope is `(x − kv)/B`; above it, `x/B + r > 0`. Hence:
//!
//! * if `x ≥ kv` — every grouped-query model whose query heads are at least twice its KV
//!   heads (Llama 3, Mistral, Qwen2, Gemma: X is larger than K+V) — `t` never decreases and
//!   `l = 0` is optimal: recompute degenerates to layer-wise offload;
//! * otherwise (multi-head attention: x = kv/2) the optimum is `⌊l*⌋` or `⌈l*⌉`.
//!
//! The crossover: `l > 0` beats `l = 0` exactly when `x < kv` and `x/B + r < s·kv/B`, i.e.
//! `r < (s·kv − x)/B`. In particular, for MHA, whenever regenerating a token is faster than
//! transferring its K/V (`r < kv/B`), any step with `s ≥ 2` recomputes something.
use kvpolicy_core::Profile;

/// Per-layer costs of one step, for all sequences of the batch together.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SplitCosts {
    /// Bytes of one token's layer input X.
    pub x_bytes: u64,
    /// Bytes of one token's K and V.
    pub kv_bytes: u64,
    /// Host→device bytes per second.
    pub bandwidth: f64,
    /// Seconds to regenerate one token's K and V.
    pub recompute_s: f64,
}

impl SplitCosts {
    /// Costs of a layer with input width `hidden` and `n_kv_heads × head_dim` K/V, for
    /// `batch` sequences of `dtype_bytes`-byte elements, under `profile`.
    pub fn new(
        profile: &Profile,
        batch: usize,
        hidden: usize,
        n_kv_heads: usize,
        head_dim: usize,
        dtype_bytes: usize,
    ) -> Self {
        Self {
            x_bytes: (batch * hidden * dtype_bytes) as u64,
            kv_bytes: (batch * 2 * n_kv_heads * head_dim * dtype_bytes) as u64,
            bandwidth: profile.h2d_bytes_per_s,
            recompute_s: batch as f64 / profile.recompute_tokens_per_s,
        }
    }

    /// `t(l)` for `s` cached tokens, in seconds (`l` is clamped to `s`).
    pub fn time(&self, l: usize, s: usize) -> f64 {
        let l = l.min(s);
        let (lf, rest) = (l as f64, (s - l) as f64);
        let link = |bytes: u64, n: f64| n * bytes as f64 / self.bandwidth;
        link(self.x_bytes, lf) + (lf * self.recompute_s).max(link(self.kv_bytes, rest))
    }

    /// The balance point `l* = s·kv / (B·r + kv)`.
    pub fn balance_point(&self, s: usize) -> f64 {
        let kv = self.kv_bytes as f64;
        s as f64 * kv / (self.bandwidth * self.recompute_s + kv)
    }

    /// The `l` in `0..=s` minimising [`SplitCosts::time`] (the smallest one on ties).
    pub fn best_split(&self, s: usize) -> usize {
        if s == 0 || self.x_bytes >= self.kv_bytes {
            return 0;
        }
        let star = self.balance_point(s);
        let lo = (star.floor() as usize).min(s);
        let hi = (star.ceil() as usize).min(s);
        let mut best = 0;
        for l in [lo, hi] {
            if self.time(l, s) < self.time(best, s) {
                best = l;
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn profile(bw: f64, tok: f64) -> Profile {
        Profile {
            h2d_bytes_per_s: bw,
            recompute_tokens_per_s: tok,
            device: None,
            shape: None,
        }
    }

    fn brute(c: &SplitCosts, s: usize) -> (usize, f64) {
        let mut best = (0, c.time(0, s));
        for l in 1..=s {
            let t = c.time(l, s);
            if t < best.1 {
                best = (l, t);
            }
        }
        best
    }

    /// (n_heads, n_kv_heads, head_dim) of common layer shapes.
    const SHAPES: [(usize, usize, usize); 6] = [
        (32, 32, 128), // OPT-6.7B / Llama 2 7B (MHA)
        (32, 8, 128),  // Llama 3 8B
        (32, 8, 128),  // Mistral 7B
        (28, 4, 128),  // Qwen2 7B
        (8, 1, 256),   // Gemma 2B (MQA)
        (16, 8, 128),  // a 2:1 grouping (x = kv exactly)
    ];

    #[test]
    fn closed_form_matches_brute_force() {
        for &(nh, nkv, d) in &SHAPES {
            for bw in [1e8, 3e9, 2.5e10, 6e10] {
                for tok in [1e3, 1e5, 1e6, 1e7, 1e8] {
                    for batch in [1, 4] {
                        let c = SplitCosts::new(&profile(bw, tok), batch, nh * d, nkv, d, 2);
                        for s in [0, 1, 2, 3, 17, 100, 1000, 4096] {
                            let got = c.best_split(s);
                            let (_, tmin) = brute(&c, s);
                            let t = c.time(got, s);
                            assert!(
                                t <= tmin * (1.0 + 1e-12),
                                "{nh}/{nkv} bw {bw} tok {tok} s {s}: l {got} t {t} > {tmin}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn grouped_query_models_never_recompute() {
        for &(nh, nkv, d) in SHAPES.iter().filter(|s| s.0 >= 2 * s.1) {
            for tok in [1e3, 1e6, 1e12] {
                let c = SplitCosts::new(&profile(1e6, tok), 1, nh * d, nkv, d, 2);
                assert!(c.x_bytes >= c.kv_bytes);
                for s in [1, 10, 100_000] {
                    assert_eq!(c.best_split(s), 0, "{nh}/{nkv} s {s}");
                }
            }
        }
    }

    #[test]
    fn mha_recomputes_when_faster_than_transfer() {
        let (nh, d) = (32, 128);
        for bw in [1e9, 2.5e10] {
            // kv/B seconds per token transferred; recompute at 0.9× and 0.1× of that.
            let kv = (2 * nh * d * 2) as f64;
            for frac in [0.9, 0.5, 0.1] {
                let tok = bw / kv / frac;
                let c = SplitCosts::new(&profile(bw, tok), 1, nh * d, nh, d, 2);
                for s in [2, 3, 64, 4096] {
                    let l = c.best_split(s);
                    assert!(l > 0, "frac {frac} s {s}");
                    assert_eq!(c.time(l, s), brute(&c, s).1);
                }
            }
            // Much slower recompute: the crossover r < (s·kv − x)/B decides.
            let tok = bw / kv / 100.0;
            let c = SplitCosts::new(&profile(bw, tok), 1, nh * d, nh, d, 2);
            let r = c.recompute_s;
            for s in [2, 50, 99, 100, 101, 200, 1000] {
                let x = c.x_bytes as f64;
                let crosses = r < (s as f64 * kv - x) / bw;
                assert_eq!(c.best_split(s) > 0, crosses, "s {s}");
            }
        }
    }
}

//! Page summaries (Quest §3.2): per layer, KV head and page of `P` tokens, the channel-wise
//! minimum and maximum of the page's keys, kept on the device next to the policy's buffers
//! and updated as pages fill. A page's score against a query `q` is
//! `Σ_c max(q_c · min_c, q_c · max_c)`, an upper bound of `q · k` over the page's keys;
//! under grouped-query attention a KV head's score is the largest over its group's query
//! heads (a page that may matter to any of them ranks high).
use candle_core::{DType, Tensor, D};
use kvpolicy_core::{KvError, Result};

/// One layer's page summaries: `(b, kv_heads, pages, head_dim)` minima and maxima in f32.
#[derive(Debug, Default)]
pub struct PageSummaries {
    min: Option<Tensor>,
    max: Option<Tensor>,
    /// Pages the buffers hold room for.
    cap: usize,
    /// Tokens summarized so far.
    tokens: usize,
}

impl PageSummaries {
    /// Tokens summarized so far.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// Device bytes of the summaries.
    pub fn bytes(&self) -> u64 {
        [&self.min, &self.max]
            .iter()
            .map(|t| t.as_ref().map_or(0, |t| t.elem_count() as u64 * 4))
            .sum()
    }

    /// Folds keys `k` `(b, kv_heads, t, d)` of tokens `pos..pos + t` into the summaries of
    /// the pages they fall in (`pos` must be the tokens summarized so far).
    pub fn update(&mut self, k: &Tensor, pos: usize, page: usize) -> Result<()> {
        if pos != self.tokens {
            return Err(KvError::invariant(format!(
                "page summaries hold {} tokens, a step brings tokens from {pos}",
                self.tokens
            )));
        }
        let (b, h, t, d) = k.dims4()?;
        if t == 0 {
            return Ok(());
        }
        self.reserve((pos + t).div_ceil(page), (b, h, d), k)?;
        let k = k.to_dtype(DType::F32)?;
        let mut at = 0;
        // A partly filled first page merges with what it holds.
        if !pos.is_multiple_of(page) {
            let n = (page - pos % page).min(t);
            self.merge_row(&k.narrow(2, 0, n)?, pos / page, true)?;
            at = n;
        }
        let whole = (t - at) / page;
        if whole > 0 {
            let run = k
                .narrow(2, at, whole * page)?
                .reshape((b, h, whole, page, d))?;
            let (mn, mx) = (run.min(3)?, run.max(3)?);
            self.set_rows(&mn, &mx, (pos + at) / page)?;
            at += whole * page;
        }
        if at < t {
            self.merge_row(&k.narrow(2, at, t - at)?, (pos + at) / page, false)?;
        }
        self.tokens = pos + t;
        Ok(())
    }

    /// Room for `pages` pages (doubling), the summaries held copied over.
    fn reserve(
        &mut self,
        pages: usize,
        (b, h, d): (usize, usize, usize),
        k: &Tensor,
    ) -> Result<()> {
        if pages <= self.cap {
            return Ok(());
        }
        let cap = pages.max(2 * self.cap).max(16);
        let grow = |old: &Option<Tensor>| -> Result<Tensor> {
            let t = Tensor::zeros((b, h, cap, d), DType::F32, k.device())?;
            if let Some(o) = old {
                t.slice_set(o, 2, 0)?;
            }
            Ok(t)
        };
        self.min = Some(grow(&self.min)?);
        self.max = Some(grow(&self.max)?);
        self.cap = cap;
        Ok(())
    }

    fn buffers(&self) -> Result<(&Tensor, &Tensor)> {
        match (&self.min, &self.max) {
            (Some(a), Some(b)) => Ok((a, b)),
            _ => Err(KvError::invariant("page summaries read before any key")),
        }
    }

    /// Writes rows `first..` with `mn`, `mx` `(b, h, n, d)`.
    fn set_rows(&self, mn: &Tensor, mx: &Tensor, first: usize) -> Result<()> {
        let (min, max) = self.buffers()?;
        min.slice_set(&mn.contiguous()?, 2, first)?;
        max.slice_set(&mx.contiguous()?, 2, first)?;
        Ok(())
    }

    /// Folds keys `k` `(b, h, n, d)` (all in page `row`) into that page's row; `merge`:
    /// the row already holds keys of the page.
    fn merge_row(&self, k: &Tensor, row: usize, merge: bool) -> Result<()> {
        let (mut mn, mut mx) = (k.min_keepdim(2)?, k.max_keepdim(2)?);
        if merge {
            let (min, max) = self.buffers()?;
            mn = mn.minimum(&min.narrow(2, row, 1)?)?;
            mx = mx.maximum(&max.narrow(2, row, 1)?)?;
        }
        self.set_rows(&mn, &mx, row)
    }

    /// The summaries of pages `first..first + n` as `(min, max)`, `(b, h, n, d)` f32.
    pub fn rows(&self, first: usize, n: usize) -> Result<(Tensor, Tensor)> {
        let (min, max) = self.buffers()?;
        Ok((min.narrow(2, first, n)?, max.narrow(2, first, n)?))
    }

    /// Scores of pages `first..first + n` against query rows `q` `(b, n_heads, r, d)`:
    /// `(b, kv_heads, r, n)` f32, each KV head's the largest over its group (module docs).
    pub fn scores(&self, q: &Tensor, first: usize, n: usize) -> Result<Tensor> {
        let (b, nh, r, d) = q.dims4()?;
        let (min, max) = self.rows(first, n)?;
        let nkv = min.dim(1)?;
        if nkv == 0 || nh % nkv != 0 {
            return Err(KvError::Shape(format!(
                "{nh} query heads cannot be grouped over {nkv} KV heads"
            )));
        }
        let g = nh / nkv;
        let q = q.to_dtype(DType::F32)?.reshape((b, nkv, g * r, 1, d))?;
        let (min, max) = (min.unsqueeze(2)?, max.unsqueeze(2)?);
        let lo = q.broadcast_mul(&min)?;
        let hi = q.broadcast_mul(&max)?;
        let s = lo.maximum(&hi)?.sum(D::Minus1)?;
        Ok(s.reshape((b, nkv, g, r, n))?.max(2)?)
    }

    /// Forgets every page (the buffers stay allocated for the next sequence).
    pub fn clear(&mut self) {
        self.tokens = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use proptest::prelude::*;

    /// The summaries recomputed from all keys at once, page by page.
    fn brute(k: &[f32], (h, t, d): (usize, usize, usize), page: usize) -> Vec<f32> {
        let pages = t.div_ceil(page);
        let mut out = vec![0f32; 2 * h * pages * d];
        for hh in 0..h {
            for p in 0..pages {
                for c in 0..d {
                    let vals = (p * page..((p + 1) * page).min(t)).map(|i| k[(hh * t + i) * d + c]);
                    let (lo, hi) = vals.fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), x| {
                        (a.min(x), b.max(x))
                    });
                    out[(hh * pages + p) * d + c] = lo;
                    out[h * pages * d + (hh * pages + p) * d + c] = hi;
                }
            }
        }
        out
    }

    /// The summaries of `k` `(1, h, t, d)` built step by step over `chunks`.
    fn incremental(
        k: &[f32],
        (h, t, d): (usize, usize, usize),
        chunks: &[usize],
        page: usize,
    ) -> anyhow::Result<Vec<f32>> {
        let all = Tensor::from_vec(k.to_vec(), (1, h, t, d), &Device::Cpu)?;
        let mut s = PageSummaries::default();
        let mut pos = 0;
        for &c in chunks {
            s.update(&all.narrow(2, pos, c)?, pos, page)?;
            pos += c;
        }
        let (mn, mx) = s.rows(0, t.div_ceil(page))?;
        Ok(Tensor::cat(&[mn, mx], 0)?.flatten_all()?.to_vec1()?)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        /// However the tokens arrive (chunks of any size, pages of any size), the summaries
        /// equal a recomputation over all keys.
        #[test]
        fn summaries_equal_a_brute_force_recomputation(
            chunks in proptest::collection::vec(1usize..40, 1..8),
            page in 1usize..20,
            h in 1usize..4,
            seed in 0u64..1000,
        ) {
            let d = 5;
            let t: usize = chunks.iter().sum();
            let mut x = seed;
            let k: Vec<f32> = (0..h * t * d).map(|_| {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((x >> 33) as f32 / (1u64 << 31) as f32) - 0.5
            }).collect();
            let got = incremental(&k, (h, t, d), &chunks, page)
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(got, brute(&k, (h, t, d), page));
        }
    }

    #[test]
    fn a_score_bounds_every_key_of_its_page() -> anyhow::Result<()> {
        let dev = Device::Cpu;
        let (nh, nkv, t, d, page) = (4, 2, 40, 8, 8);
        let k = Tensor::randn(0f32, 1.0, (1, nkv, t, d), &dev)?;
        let q = Tensor::randn(0f32, 1.0, (1, nh, 1, d), &dev)?;
        let mut s = PageSummaries::default();
        s.update(&k, 0, page)?;
        let scores: Vec<f32> = s.scores(&q, 0, t / page)?.flatten_all()?.to_vec1()?;
        let g = nh / nkv;
        for h in 0..nkv {
            for qh in h * g..(h + 1) * g {
                let dots: Vec<f32> = q
                    .narrow(1, qh, 1)?
                    .matmul(&k.narrow(1, h, 1)?.t()?)?
                    .flatten_all()?
                    .to_vec1()?;
                for (i, dot) in dots.iter().enumerate() {
                    assert!(scores[h * (t / page) + i / page] >= dot - 1e-4);
                }
            }
        }
        Ok(())
    }
}

//! A request's next token: the model's logits shaped as OpenAI's API defines —
//! `logit_bias` added, then the presence and frequency penalties subtracted for the tokens
//! generated so far (OpenAI API reference, "Parameter details": `mu[j] -> mu[j] - c[j] *
//! alpha_frequency - float(c[j] > 0) * alpha_presence`) — then sampled by the models'
//! [`Sampler`] (greedy, temperature, top-p; tiny values as their limit).
use std::collections::HashMap;

use candle_core::{DType, Tensor};
use kvpolicy::models::Sampler;

use crate::api::{Params, Shaping};

/// One choice's sampler and what it generated.
pub struct Chooser {
    sampler: Sampler,
    shaping: Shaping,
    /// Times each token was generated (for the penalties).
    counts: HashMap<u32, u32>,
}

impl Chooser {
    /// The sampler `params` ask for, seeded with `seed`.
    pub fn new(params: &Params, seed: u64) -> Self {
        Self {
            sampler: Sampler::new(params.temperature, params.top_p, seed),
            shaping: params.shaping.clone(),
            counts: HashMap::new(),
        }
    }

    /// The next token after the logits `row`; counted for the penalties.
    pub fn choose(&mut self, row: &Tensor) -> anyhow::Result<u32> {
        let tok = if self.shaping.is_none() {
            self.sampler.sample(row)?
        } else {
            let shaped = self.shape(row.to_dtype(DType::F32)?.to_vec1()?);
            self.sampler.sample(&Tensor::from_vec(
                shaped.clone(),
                shaped.len(),
                row.device(),
            )?)?
        };
        *self.counts.entry(tok).or_default() += 1;
        Ok(tok)
    }

    /// `logits` with the bias added and the penalties subtracted.
    fn shape(&self, mut logits: Vec<f32>) -> Vec<f32> {
        for &(id, b) in &self.shaping.bias {
            if let Some(l) = logits.get_mut(id as usize) {
                *l += b;
            }
        }
        let s = &self.shaping;
        if s.presence != 0.0 || s.frequency != 0.0 {
            for (&id, &c) in &self.counts {
                if let Some(l) = logits.get_mut(id as usize) {
                    *l -= c as f32 * s.frequency + s.presence;
                }
            }
        }
        logits
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f64, shaping: Shaping) -> Params {
        Params {
            max_tokens: None,
            temperature,
            top_p: None,
            seed: 1,
            stop: Vec::new(),
            logprobs: None,
            stream: false,
            include_usage: false,
            n: 1,
            shaping,
        }
    }

    fn row(v: &[f32]) -> anyhow::Result<Tensor> {
        Ok(Tensor::new(v, &candle_core::Device::Cpu)?)
    }

    #[test]
    fn a_bias_moves_the_greedy_choice() -> anyhow::Result<()> {
        let logits = [3.0, 1.0, 2.0];
        let mut plain = Chooser::new(&params(0.0, Shaping::default()), 1);
        assert_eq!(plain.choose(&row(&logits)?)?, 0);
        let up = Shaping {
            bias: vec![(2, 5.0)],
            ..Shaping::default()
        };
        assert_eq!(Chooser::new(&params(0.0, up), 1).choose(&row(&logits)?)?, 2);
        // -100 bans a token even when sampling.
        let ban = Shaping {
            bias: vec![(0, -100.0), (2, -100.0)],
            ..Shaping::default()
        };
        let mut c = Chooser::new(&params(1.0, ban), 1);
        for _ in 0..20 {
            assert_eq!(c.choose(&row(&logits)?)?, 1);
        }
        Ok(())
    }

    #[test]
    fn penalties_count_what_was_generated() -> anyhow::Result<()> {
        let logits = [3.0, 2.5, 0.0];
        // Frequency: 0 once (3 - 1 = 2 < 2.5), then 1 (2.5 - 1 = 1.5 < 2), then 0 again.
        let freq = Shaping {
            frequency: 1.0,
            ..Shaping::default()
        };
        let mut c = Chooser::new(&params(0.0, freq), 1);
        let picks: Vec<u32> = (0..4)
            .map(|_| c.choose(&row(&logits)?))
            .collect::<anyhow::Result<_>>()?;
        assert_eq!(picks, [0, 1, 0, 1]);
        // Presence: each generated token once down by 2, however often.
        let pres = Shaping {
            presence: 2.0,
            ..Shaping::default()
        };
        let mut c = Chooser::new(&params(0.0, pres), 1);
        let picks: Vec<u32> = (0..4)
            .map(|_| c.choose(&row(&logits)?))
            .collect::<anyhow::Result<_>>()?;
        assert_eq!(picks, [0, 1, 0, 0]);
        Ok(())
    }
}

//! The next token from a row of logits: greedy at temperature 0, else softmax sampling at a
//! temperature, optionally nucleus (top-p) sampling (Holtzman et al., ICLR 2020, §3.1) —
//! candle's `LogitsProcessor`, guarded where it breaks on values inside the documented
//! ranges. A tiny temperature makes `logits / T` overflow f32 (softmax then gives NaN and
//! candle's weighted draw fails), and a tiny `top_p` rounds to 0 in f32 (every weight
//! cleared): both are the limit of their distribution, the most likely token, so they are
//! sampled as greedy (HF transformers and llama.cpp give the top token there too).
use candle_core::{DType, Tensor};
use candle_transformers::generation::{LogitsProcessor, Sampling};

use crate::engine::generate::{sampling, GenerateConfig};
use crate::error::Result;

/// A seeded sampler for one sequence.
pub struct Sampler {
    inner: LogitsProcessor,
    /// The temperature when sampling (`None`: greedy).
    temperature: Option<f64>,
}

impl Sampler {
    /// The sampler `cfg` asks for (its temperature, `top_p` and seed).
    pub fn new(cfg: &GenerateConfig) -> Self {
        let mut s = sampling(cfg);
        // A nucleus that rounds to no mass keeps only the most likely token.
        if let Sampling::TopP { p, .. } = s {
            if (p as f32) <= 0.0 {
                s = Sampling::ArgMax;
            }
        }
        let temperature = match s {
            Sampling::All { temperature } | Sampling::TopP { temperature, .. } => Some(temperature),
            _ => None,
        };
        Self {
            inner: LogitsProcessor::from_sampling(cfg.seed, s),
            temperature,
        }
    }

    /// The next token after the logits `row` (one dimension, the vocabulary).
    pub fn sample(&mut self, row: &Tensor) -> Result<u32> {
        if let Some(t) = self.temperature {
            let v: Vec<f32> = row.to_dtype(DType::F32)?.to_vec1()?;
            if overflows(&v, t) {
                return Ok(argmax(&v));
            }
        }
        Ok(self.inner.sample(row)?)
    }
}

/// Whether some finite logit divided by `temperature` leaves f32's range.
pub fn overflows(logits: &[f32], temperature: f64) -> bool {
    let most = logits
        .iter()
        .filter(|x| x.is_finite())
        .fold(0f64, |m, &x| m.max(f64::from(x).abs()));
    let scaled = most / temperature;
    scaled.is_nan() || scaled > f64::from(f32::MAX)
}

/// The index of the largest logit (the first of equals; NaN never wins).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, &x) in logits.iter().enumerate() {
        if x > logits[best] || logits[best].is_nan() {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(temperature: f64, top_p: Option<f64>) -> GenerateConfig {
        GenerateConfig {
            temperature,
            top_p,
            seed: 7,
            ..GenerateConfig::default()
        }
    }

    fn row() -> Result<Tensor> {
        Ok(Tensor::new(
            &[1.5f32, -3.0, 9.25, 9.0, f32::NEG_INFINITY],
            &candle_core::Device::Cpu,
        )?)
    }

    #[test]
    fn tiny_temperatures_and_nuclei_give_the_top_token() -> Result<()> {
        // Every value here failed in candle's sampler (NaN weights, or all weights zero).
        for (t, p) in [
            (1e-300, None),
            (f64::MIN_POSITIVE, None),
            (1e-38, Some(0.9)),
            (0.7, Some(1e-300)),
            (1e-300, Some(1e-300)),
        ] {
            let mut s = Sampler::new(&cfg(t, p));
            for _ in 0..5 {
                assert_eq!(s.sample(&row()?)?, 2, "temperature {t}, top_p {p:?}");
            }
        }
        Ok(())
    }

    #[test]
    fn ordinary_values_sample_as_candle_does() -> Result<()> {
        let c = cfg(0.8, Some(0.95));
        let mut ours = Sampler::new(&c);
        let mut theirs = LogitsProcessor::from_sampling(c.seed, sampling(&c));
        for _ in 0..50 {
            assert_eq!(ours.sample(&row()?)?, theirs.sample(&row()?)?);
        }
        Ok(())
    }

    #[test]
    fn overflow_is_judged_on_the_finite_logits() {
        assert!(!overflows(&[1.0, f32::NEG_INFINITY], 1e-30));
        assert!(overflows(&[10.0, -1.0], 1e-38));
        assert!(!overflows(&[10.0, -1.0], 1e-30));
        assert_eq!(argmax(&[f32::NAN, 1.0, 3.0, 3.0]), 2);
    }
}

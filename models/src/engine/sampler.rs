//! The next token from a row of logits: greedy at temperature 0, else softmax sampling at a
//! temperature, optionally nucleus (top-p) sampling (Holtzman et al., ICLR 2020, §3.1) —
//! candle's `LogitsProcessor`, guarded where it breaks on values inside the documented
//! ranges. A tiny temperature makes `logits / T` overflow f32 (softmax then gives NaN and
//! candle's weighted draw fails), and a tiny `top_p` rounds to 0 in f32 (every weight
//! cleared): both are the limit of their distribution, the most likely token, so they are
//! sampled as greedy (HF transformers and llama.cpp give the top token there too).
use candle_core::{DType, Tensor};
use candle_transformers::generation::{LogitsProcessor, Sampling};

use crate::error::Result;

/// The sampling a temperature and nucleus ask for: greedy at temperature 0 (or below),
/// else nucleus (`top_p`) or full sampling.
pub fn sampling_of(temperature: f64, top_p: Option<f64>) -> Sampling {
    if temperature <= 0.0 {
        Sampling::ArgMax
    } else if let Some(p) = top_p {
        Sampling::TopP { p, temperature }
    } else {
        Sampling::All { temperature }
    }
}

/// A seeded sampler for one sequence.
pub struct Sampler {
    inner: LogitsProcessor,
    /// The temperature when sampling (`None`: greedy).
    temperature: Option<f64>,
}

impl Sampler {
    /// Sampling at `temperature` (0: greedy) within the nucleus `top_p`, seeded.
    pub fn new(temperature: f64, top_p: Option<f64>, seed: u64) -> Self {
        let mut s = sampling_of(temperature, top_p);
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
            inner: LogitsProcessor::from_sampling(seed, s),
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
            let mut s = Sampler::new(t, p, 7);
            for _ in 0..5 {
                assert_eq!(s.sample(&row()?)?, 2, "temperature {t}, top_p {p:?}");
            }
        }
        Ok(())
    }

    #[test]
    fn ordinary_values_sample_as_candle_does() -> Result<()> {
        let mut ours = Sampler::new(0.8, Some(0.95), 7);
        let mut theirs = LogitsProcessor::from_sampling(7, sampling_of(0.8, Some(0.95)));
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

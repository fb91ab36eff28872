//! Calibration: the second moment of every layer's attention input over calibration tokens,
//! `S = Σ_t [x_t; 1] [x_t; 1]ᵀ`. Every projection `y = W x + b` the converter fits has its
//! covariance in closed form from it (`[W b] S [W b]ᵀ`), so one pass of the original model
//! (under `full`, through a policy that records each layer's input as it passes) is all the
//! data the SVD method needs.
use candle_core::{DType, Tensor};
use kvpolicy_baseline::FullPolicy;
use kvpolicy_core::{AttnStep, KvPolicy, KvStats, PolicyOptions};
use kvpolicy_models::{CausalLm, LogitsMode};

use crate::error::{CompressError, Result};

/// Tokens per forward pass of the calibration prefill.
pub const CHUNK: usize = 256;

/// Calibration tokens when none are given: this many ids drawn deterministically.
pub const DEFAULT_TOKENS: usize = 512;

/// Per layer, `Σ [x; 1][x; 1]ᵀ` over the calibration tokens (row-major, `dim × dim`).
#[derive(Clone, Debug)]
pub struct Moments {
    /// `hidden + 1`.
    pub dim: usize,
    /// One matrix per layer.
    pub layers: Vec<Vec<f64>>,
    /// Tokens summed.
    pub tokens: usize,
}

/// `full`, recording each layer's attention input.
struct Recorder {
    inner: FullPolicy,
    moments: Vec<Vec<f64>>,
    dim: usize,
}

impl Recorder {
    fn record(&mut self, step: &AttnStep<'_>) -> kvpolicy_core::Result<()> {
        let x = step.x.to_dtype(DType::F32)?;
        let (b, t, h) = x.dims3()?;
        let rows = x.reshape((b * t, h))?;
        let ones = Tensor::ones((b * t, 1), DType::F32, x.device())?;
        let xa = Tensor::cat(&[rows, ones], 1)?;
        let m = xa.t()?.matmul(&xa)?.flatten_all()?.to_vec1::<f32>()?;
        while self.moments.len() <= step.layer {
            self.moments.push(vec![0.0; self.dim * self.dim]);
        }
        for (acc, v) in self.moments[step.layer].iter_mut().zip(m) {
            *acc += f64::from(v);
        }
        Ok(())
    }
}

impl KvPolicy for Recorder {
    fn name(&self) -> &str {
        "full"
    }

    fn attend(&mut self, step: &AttnStep<'_>) -> kvpolicy_core::Result<Tensor> {
        self.record(step)?;
        self.inner.attend(step)
    }

    fn seq_len(&self) -> usize {
        self.inner.seq_len()
    }

    fn reset(&mut self) {
        self.inner.reset();
    }

    fn stats(&self) -> KvStats {
        self.inner.stats()
    }
}

/// Deterministic calibration ids when none are given: a fixed xorshift sequence over the
/// vocabulary (the same for every run of the same model).
pub fn default_ids(vocab: usize, n: usize) -> Vec<u32> {
    let mut s: u64 = 0x9E37_79B9_7F4A_7C15;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % vocab.max(1) as u64) as u32
        })
        .collect()
}

/// Runs `model` over `ids` (a prefill in chunks of [`CHUNK`]) and returns every layer's
/// input moments.
pub fn calibrate(model: &dyn CausalLm, ids: &[u32]) -> Result<Moments> {
    let info = model.info();
    if ids.is_empty() {
        return Err(CompressError::Setting(
            "the calibration text tokenized to no tokens; give a longer --calibration file".into(),
        ));
    }
    if let Some(bad) = ids.iter().find(|&&i| i as usize >= info.vocab_size) {
        return Err(CompressError::Setting(format!(
            "calibration id {bad} is outside the model's vocabulary of {} tokens",
            info.vocab_size
        )));
    }
    let ids = &ids[..ids.len().min(info.max_positions)];
    let dim = info.hidden + 1;
    let mut rec = Recorder {
        inner: FullPolicy::new(&PolicyOptions::default())?,
        moments: Vec::new(),
        dim,
    };
    for (i, chunk) in ids.chunks(CHUNK).enumerate() {
        let t = Tensor::new(chunk, &info.device)?.unsqueeze(0)?;
        model.forward(&t, i * CHUNK, &mut rec, LogitsMode::Last)?;
    }
    Ok(Moments {
        dim,
        layers: rec.moments,
        tokens: ids.len(),
    })
}

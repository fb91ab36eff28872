//! candle-transformers' own quantized Llama on the same GGUF: the anchor that says whether
//! `full` itself is a fair baseline.
use std::path::Path;
use std::time::Instant;

use anyhow::Result;
use candle_core::{Device, Tensor};
use candle_transformers::models::quantized_llama::ModelWeights;

use crate::sweep::{ids, median, Row};

/// The stock model.
pub struct Stock {
    model: ModelWeights,
    vocab: usize,
    device: Device,
}

/// Positions candle's stock quantized Llama supports.
pub const STOCK_MAX_POSITIONS: usize = 4096;

impl Stock {
    /// Loads `path` (a GGUF of architecture llama).
    pub fn load(path: &Path, device: &Device, vocab: usize) -> Result<Self> {
        let mut file = std::fs::File::open(path)?;
        let content = candle_core::quantized::gguf_file::Content::read(&mut file)?;
        let model = ModelWeights::from_gguf(content, &mut file, device)?;
        Ok(Self {
            model,
            vocab,
            device: device.clone(),
        })
    }

    /// Same protocol as [`crate::sweep::measure`]: prefill `context` ids, time `steps`.
    pub fn measure(
        &mut self,
        context: usize,
        steps: usize,
        repeats: usize,
        tick: &mut dyn FnMut(),
    ) -> Result<Row> {
        anyhow::ensure!(
            context + steps <= STOCK_MAX_POSITIONS,
            "candle's stock model supports {STOCK_MAX_POSITIONS} positions"
        );
        let dev = self.device.clone();
        let prompt = ids(context, 0, self.vocab);
        let (mut pre, mut dec) = (Vec::new(), Vec::new());
        for _ in 0..repeats.max(1) {
            let t = Instant::now();
            // The stock model resets its cache at position 0.
            self.model
                .forward(&Tensor::new(prompt.as_slice(), &dev)?.unsqueeze(0)?, 0)?;
            pre.push(context as f64 / t.elapsed().as_secs_f64());
            let t = Instant::now();
            for (i, &tok) in ids(steps, context, self.vocab).iter().enumerate() {
                let x = Tensor::new(&[tok], &dev)?.unsqueeze(0)?;
                self.model.forward(&x, context + i)?;
            }
            dec.push(steps as f64 / t.elapsed().as_secs_f64());
            tick();
        }
        Ok(Row::peer(context, "stock", median(pre), median(dec)))
    }
}

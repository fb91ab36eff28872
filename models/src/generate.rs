//! The generation loop: chunked prefill, then one decode step per token, either sampled
//! (greedy at temperature 0) or teacher-forced from given ids. Every request is checked
//! before any work: an empty prompt, an id outside the vocabulary, or a sequence longer
//! than the model's positions is an error, not a crash mid-way.
use std::time::Instant;

use candle_core::Tensor;
use candle_transformers::generation::{LogitsProcessor, Sampling};
use kvpolicy_core::{KvPolicy, KvShape};

use crate::error::{ModelError, Result};
use crate::model::{CausalLm, LogitsMode, ModelInfo};

/// How to generate.
#[derive(Clone, Debug)]
pub struct GenerateConfig {
    /// Prompt tokens per prefill forward pass (0 = the whole prompt at once).
    pub prefill_chunk: usize,
    /// Tokens to sample after the prompt (ignored when `decode_ids` is set).
    pub max_new_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    pub temperature: f64,
    /// Nucleus sampling threshold.
    pub top_p: Option<f64>,
    /// Sampling seed.
    pub seed: u64,
    /// Teacher forcing: feed exactly these tokens one decode step at a time.
    pub decode_ids: Option<Vec<u32>>,
    /// Keep the logits of every prompt position and decode step.
    pub collect_logits: bool,
    /// Stop sampling at an end-of-sequence token.
    pub stop_at_eos: bool,
}

impl Default for GenerateConfig {
    fn default() -> Self {
        Self {
            prefill_chunk: 0,
            max_new_tokens: 32,
            temperature: 0.0,
            top_p: None,
            seed: 299_792_458,
            decode_ids: None,
            collect_logits: false,
            stop_at_eos: true,
        }
    }
}

/// What a generation produced.
#[derive(Debug)]
pub struct Generation {
    /// The prompt.
    pub prompt_ids: Vec<u32>,
    /// Sampled tokens, or the teacher-forced ids.
    pub generated_ids: Vec<u32>,
    /// `(rows, vocab)` f32: one row per prompt position, then one per decode step
    /// (row `i` predicts token `i + 1` of prompt + generated).
    pub logits: Option<Tensor>,
    /// Prompt tokens processed.
    pub prefill_tokens: usize,
    /// Seconds spent in prefill.
    pub prefill_s: f64,
    /// Decode steps run.
    pub decode_tokens: usize,
    /// Seconds spent in decode steps.
    pub decode_s: f64,
}

/// Checks a request against the model before running it.
pub fn validate_request(info: &ModelInfo, prompt: &[u32], cfg: &GenerateConfig) -> Result<()> {
    if prompt.is_empty() {
        return Err(ModelError::Input(
            "the prompt is empty; give --prompt TEXT or --prompt-ids with at least one token"
                .into(),
        ));
    }
    let check = |ids: &[u32], what: &str| -> Result<()> {
        if let Some((i, id)) = ids
            .iter()
            .enumerate()
            .find(|(_, &id)| id as usize >= info.vocab_size)
        {
            return Err(ModelError::Input(format!(
                "{what} token {i} is id {id}, but the vocabulary has {} tokens (ids 0..{})",
                info.vocab_size,
                info.vocab_size - 1
            )));
        }
        Ok(())
    };
    check(prompt, "prompt")?;
    let new = match &cfg.decode_ids {
        Some(d) => {
            check(d, "decode")?;
            d.len()
        }
        None => cfg.max_new_tokens,
    };
    let total = prompt.len() + new;
    if total > info.max_positions {
        return Err(ModelError::Input(format!(
            "prompt ({} tokens) + generation ({new} tokens) = {total} exceeds the model's {} positions; shorten the prompt or lower --max-new-tokens",
            prompt.len(),
            info.max_positions
        )));
    }
    let temperature_ok = cfg.temperature.is_finite() && cfg.temperature >= 0.0;
    let top_p_ok = cfg.top_p.is_none_or(|p| p > 0.0 && p <= 1.0);
    if !temperature_ok || !top_p_ok {
        return Err(ModelError::Input(
            "--temperature must be ≥ 0 and --top-p in (0, 1]".into(),
        ));
    }
    Ok(())
}

/// The cache shape `info`'s model needs for `batch` sequences of up to `max_tokens` tokens.
pub fn kv_shape(info: &ModelInfo, batch: usize, max_tokens: usize) -> KvShape {
    KvShape {
        n_layers: info.n_layers,
        n_heads: info.n_heads,
        n_kv_heads: info.n_kv_heads,
        head_dim: info.head_dim,
        batch,
        dtype: info.dtype,
        max_tokens,
    }
}

fn ids_tensor(ids: &[u32], info: &ModelInfo) -> Result<Tensor> {
    Ok(Tensor::new(ids, &info.device)?.unsqueeze(0)?)
}

/// Runs the prompt through the model in chunks; returns the last position's logits
/// `(vocab,)` and, when `collect`, the logits of every position `(t, vocab)`.
pub fn prefill(
    model: &dyn CausalLm,
    policy: &mut dyn KvPolicy,
    prompt: &[u32],
    chunk: usize,
    collect: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    let info = model.info();
    let chunk = if chunk == 0 { prompt.len() } else { chunk };
    let mode = if collect {
        LogitsMode::All
    } else {
        LogitsMode::Last
    };
    let mut rows = Vec::new();
    let mut last = None;
    let mut pos = 0;
    for piece in prompt.chunks(chunk) {
        let logits = model.forward(&ids_tensor(piece, info)?, pos, policy, mode)?;
        let logits = logits.squeeze(0)?;
        let n = logits.dim(0)?;
        last = Some(logits.get(n - 1)?);
        if collect {
            rows.push(logits);
        }
        pos += piece.len();
    }
    let last = last.ok_or_else(|| ModelError::Input("the prompt is empty".into()))?;
    let all = if collect {
        Some(Tensor::cat(&rows, 0)?)
    } else {
        None
    };
    Ok((last, all))
}

/// Generates after `prompt`; `on_token` sees each new token as it is chosen.
pub fn generate(
    model: &dyn CausalLm,
    policy: &mut dyn KvPolicy,
    prompt: &[u32],
    cfg: &GenerateConfig,
    on_token: &mut dyn FnMut(u32) -> Result<()>,
) -> Result<Generation> {
    let info = model.info().clone();
    validate_request(&info, prompt, cfg)?;
    let new = cfg.decode_ids.as_ref().map_or(cfg.max_new_tokens, Vec::len);
    policy.prepare(&kv_shape(&info, 1, prompt.len() + new))?;
    let start = Instant::now();
    let (mut last, prompt_rows) =
        prefill(model, policy, prompt, cfg.prefill_chunk, cfg.collect_logits)?;
    let prefill_s = start.elapsed().as_secs_f64();
    let mut rows: Vec<Tensor> = prompt_rows.into_iter().collect();
    let mut generated = Vec::new();
    let mut decode_tokens = 0;
    let start = Instant::now();
    let mut step = |tok: u32, pos: usize, rows: &mut Vec<Tensor>| -> Result<Tensor> {
        let logits = model.forward(&ids_tensor(&[tok], &info)?, pos, policy, LogitsMode::Last)?;
        let row = logits.squeeze(0)?;
        if cfg.collect_logits {
            rows.push(row.clone());
        }
        Ok(row.squeeze(0)?)
    };
    match &cfg.decode_ids {
        Some(ids) => {
            for (i, &tok) in ids.iter().enumerate() {
                on_token(tok)?;
                generated.push(tok);
                step(tok, prompt.len() + i, &mut rows)?;
                decode_tokens += 1;
            }
        }
        None => {
            let sampling = if cfg.temperature <= 0.0 {
                Sampling::ArgMax
            } else if let Some(p) = cfg.top_p {
                Sampling::TopP {
                    p,
                    temperature: cfg.temperature,
                }
            } else {
                Sampling::All {
                    temperature: cfg.temperature,
                }
            };
            let mut sampler = LogitsProcessor::from_sampling(cfg.seed, sampling);
            for i in 0..cfg.max_new_tokens {
                let tok = sampler.sample(&last)?;
                on_token(tok)?;
                generated.push(tok);
                if (cfg.stop_at_eos && info.eos.contains(&tok)) || i + 1 == cfg.max_new_tokens {
                    break;
                }
                last = step(tok, prompt.len() + i, &mut rows)?;
                decode_tokens += 1;
            }
        }
    }
    let decode_s = start.elapsed().as_secs_f64();
    let logits = if cfg.collect_logits {
        Some(Tensor::cat(&rows, 0)?)
    } else {
        None
    };
    Ok(Generation {
        prompt_ids: prompt.to_vec(),
        generated_ids: generated,
        logits,
        prefill_tokens: prompt.len(),
        prefill_s,
        decode_tokens,
        decode_s,
    })
}

//! The generation loop: chunked prefill, then one decode step per token, either sampled
//! (greedy at temperature 0) or teacher-forced from given ids. Every request is checked
//! before any work: an empty prompt, an id outside the vocabulary, or a sequence longer
//! than the model's positions is an error, not a crash mid-way.
use std::time::Instant;

use candle_core::Tensor;
use candle_transformers::generation::Sampling;
use kvpolicy_core::{KvPolicy, KvShape, KvStats};

use crate::error::{Message, ModelError, ModelInput, Result};
use crate::model::{CausalLm, LogitsMode, ModelInfo};

/// Prompt tokens per prefill pass by default: long prompts run in chunks, so a step's
/// activations and attention scratch stay small whatever the prompt's length (HeadInfer
/// §3.3's chunked prefill); shorter prompts run in one pass.
pub const DEFAULT_PREFILL_CHUNK: usize = 2048;

/// How to generate.
#[derive(Clone, Debug)]
pub struct GenerateConfig {
    /// Prompt tokens per prefill forward pass (0 = the whole prompt at once; default
    /// [`DEFAULT_PREFILL_CHUNK`]).
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
    /// With `collect_logits`, keep only the rows that predict generated tokens: the
    /// prompt's last position, then each decode step (a long prompt's every row would not
    /// fit in memory; teacher-forced comparisons need only these).
    pub decode_logits_only: bool,
    /// Stop sampling at an end-of-sequence token.
    pub stop_at_eos: bool,
    /// Show a progress bar on stderr while prefilling prompts of at least
    /// [`PROGRESS_MIN_PROMPT`] tokens (hidden when stderr is not a terminal).
    pub progress: bool,
}

/// Prompts this long or longer get a prefill progress bar when [`GenerateConfig::progress`]
/// is on.
pub const PROGRESS_MIN_PROMPT: usize = 4096;

impl Default for GenerateConfig {
    fn default() -> Self {
        Self {
            prefill_chunk: DEFAULT_PREFILL_CHUNK,
            max_new_tokens: 32,
            temperature: 0.0,
            top_p: None,
            seed: 299_792_458,
            decode_ids: None,
            collect_logits: false,
            decode_logits_only: false,
            stop_at_eos: true,
            progress: false,
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
    /// The policy's stats when prefill ended (`None` in ragged batches, where requests'
    /// prefill and decode interleave): with the final stats, what decode alone moved.
    pub prefill_stats: Option<KvStats>,
}

/// Checks a request against the model before running it.
pub fn validate_request(info: &ModelInfo, prompt: &[u32], cfg: &GenerateConfig) -> Result<()> {
    if prompt.is_empty() {
        return Err(ModelError::Input(
            Message::from("the prompt is empty; give ")
                .input(ModelInput::Prompt)
                .text(" with at least one token"),
        ));
    }
    let check = |ids: &[u32], what: &str| -> Result<()> {
        if let Some((i, id)) = ids
            .iter()
            .enumerate()
            .find(|(_, &id)| id as usize >= info.vocab_size)
        {
            return Err(ModelError::Input(
                format!(
                    "{what} token {i} is id {id}, but the vocabulary has {} tokens (ids 0..{})",
                    info.vocab_size,
                    info.vocab_size - 1
                )
                .into(),
            ));
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
    // In u128: a huge --max-new-tokens must not wrap around below the model's positions.
    let total = prompt.len() as u128 + new as u128;
    if total > info.max_positions as u128 {
        let (max, p) = (info.max_positions, prompt.len());
        let head = Message::from(format!(
            "prompt ({p} tokens) + generation ({new} tokens) = {total} exceeds the model's {max} positions; "
        ));
        // The fix in numbers: what to cut to, or, when the prompt alone fills the model,
        // that the prompt must be shorter (a model with more positions holds it).
        let fix = match (p < max, &cfg.decode_ids) {
            (true, None) => head
                .text("shorten the prompt, or lower ")
                .input(ModelInput::MaxNewTokens)
                .text(format!(" to at most {}", max - p)),
            (true, Some(_)) => head
                .text(format!(
                    "shorten the prompt, or give at most {} ids in ",
                    max - p
                ))
                .input(ModelInput::DecodeIds),
            (false, _) => head.text(format!(
                "shorten the prompt to fewer than {max} tokens, or use a model with more positions"
            )),
        };
        return Err(ModelError::Input(fix));
    }
    if !(cfg.temperature.is_finite() && cfg.temperature >= 0.0) {
        return Err(ModelError::Input(
            Message::default()
                .input(ModelInput::Temperature)
                .text(format!(
                    " {} must be a finite number ≥ 0 (0 is greedy)",
                    cfg.temperature
                )),
        ));
    }
    if let Some(p) = cfg.top_p.filter(|&p| !(p > 0.0 && p <= 1.0)) {
        return Err(ModelError::Input(
            Message::default()
                .input(ModelInput::TopP)
                .text(format!(" {p} must be in (0, 1]")),
        ));
    }
    Ok(())
}

/// The cache shape `info`'s model needs for `batch` sequences of up to `max_tokens` tokens,
/// run in steps of at most `step_tokens` tokens (the prefill chunk; 0 = all at once).
pub fn kv_shape(info: &ModelInfo, batch: usize, max_tokens: usize, step_tokens: usize) -> KvShape {
    KvShape {
        n_layers: info.kv_layers(),
        n_heads: info.n_heads,
        n_kv_heads: info.n_kv_heads,
        head_dim: info.head_dim,
        hidden: info.hidden,
        batch,
        dtype: info.dtype,
        max_tokens,
        step_tokens,
        activation_bytes_per_token: info.activation_bytes_per_token(),
        windows: info.kv_windows(),
        readers: info.kv_readers(),
    }
}

/// Tokens per prefill pass for a prompt of `prompt` tokens: `chunk`, or the whole prompt
/// when `chunk` is 0 or longer.
pub fn chunk_len(chunk: usize, prompt: usize) -> usize {
    match chunk {
        0 => prompt,
        c => c.min(prompt),
    }
    .max(1)
}

/// Fails on a logits row holding NaN or infinity: greedy decoding would silently emit
/// token 0 from it.
pub(crate) fn check_finite(row: &Tensor, pos: usize) -> Result<()> {
    let sum = row
        .sum_all()?
        .to_dtype(candle_core::DType::F32)?
        .to_scalar::<f32>()?;
    if sum.is_finite() {
        Ok(())
    } else {
        Err(ModelError::Input(format!(
            "the model produced non-finite logits (NaN or infinity) at position {pos}; its weights or its config's numbers (rope_theta, rms_norm_eps, …) are likely broken"
        ).into()))
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
    prefill_with(model, policy, prompt, chunk, collect, &mut |_| {})
}

/// A prefill progress bar on stderr: tokens, tokens/s and time left; hidden when stderr is
/// not a terminal.
fn progress_bar(total: usize) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::with_draw_target(
        Some(total as u64),
        indicatif::ProgressDrawTarget::stderr(),
    );
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "prefill [{bar:30}] {pos}/{len} tokens, {per_sec}, ETA {eta}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar
}

/// [`prefill`], calling `on_chunk` with the prompt tokens done after every chunk.
pub fn prefill_with(
    model: &dyn CausalLm,
    policy: &mut dyn KvPolicy,
    prompt: &[u32],
    chunk: usize,
    collect: bool,
    on_chunk: &mut dyn FnMut(usize),
) -> Result<(Tensor, Option<Tensor>)> {
    prefill_from(model, policy, prompt, 0, chunk, collect, on_chunk)
}

/// [`prefill_with`] of `prompt[from..]`: the first `from` tokens are already in `policy`
/// (restored from a prefix cache or a session); the logits rows start at `from`. The passes
/// end where a prefill from 0 would end them (at multiples of `chunk`), so that each token
/// shares its pass with the tokens it would share it with in a fresh prefill, save those
/// before `from`.
pub fn prefill_from(
    model: &dyn CausalLm,
    policy: &mut dyn KvPolicy,
    prompt: &[u32],
    from: usize,
    chunk: usize,
    collect: bool,
    on_chunk: &mut dyn FnMut(usize),
) -> Result<(Tensor, Option<Tensor>)> {
    let info = model.info();
    let chunk = chunk_len(chunk, prompt.len());
    let mode = if collect {
        LogitsMode::All
    } else {
        LogitsMode::Last
    };
    let mut rows = Vec::new();
    let mut last = None;
    let mut pos = from;
    while pos < prompt.len() {
        let piece = &prompt[pos..((pos / chunk + 1) * chunk).min(prompt.len())];
        let _span = tracing::info_span!("prefill_chunk", pos, tokens = piece.len()).entered();
        let logits = model.forward(&ids_tensor(piece, info)?, pos, policy, mode)?;
        let logits = logits.squeeze(0)?;
        let n = logits.dim(0)?;
        last = Some(logits.get(n - 1)?);
        if collect {
            rows.push(logits);
        }
        pos += piece.len();
        on_chunk(pos);
    }
    let last = last.ok_or_else(|| ModelError::Input("the prompt is empty".into()))?;
    let all = if collect {
        Some(Tensor::cat(&rows, 0)?)
    } else {
        None
    };
    Ok((last, all))
}

/// The sampling `cfg` asks for: greedy at temperature 0, else nucleus or full sampling.
pub fn sampling(cfg: &GenerateConfig) -> Sampling {
    crate::engine::sampler::sampling_of(cfg.temperature, cfg.top_p)
}

/// Generates after `prompt`; `on_token` sees each new token as it is chosen.
pub fn generate(
    model: &dyn CausalLm,
    policy: &mut dyn KvPolicy,
    prompt: &[u32],
    cfg: &GenerateConfig,
    on_token: &mut dyn FnMut(u32) -> Result<()>,
) -> Result<Generation> {
    generate_settling(model, policy, prompt, cfg, &mut Ok, on_token)
}

/// [`generate`], with each sampled token passed through `settle` before it is used: the
/// token the run goes on with is what `settle` returns. Under `helix` across ranks every
/// rank samples, and `settle` hands every rank rank 0's token (a broadcast), so that the
/// ranks go on with one sequence whatever their floats did. Teacher-forced tokens
/// (`decode_ids`) are not settled: every caller has them already.
pub fn generate_settling(
    model: &dyn CausalLm,
    policy: &mut dyn KvPolicy,
    prompt: &[u32],
    cfg: &GenerateConfig,
    settle: &mut dyn FnMut(u32) -> Result<u32>,
    on_token: &mut dyn FnMut(u32) -> Result<()>,
) -> Result<Generation> {
    begin(model, policy, prompt, cfg)?;
    let prefilled = prefill_phase(model, policy, prompt, 0, cfg)?;
    let emit = EmitTokens { settle, on_token };
    decode_phase(model, policy, prompt, cfg, prefilled, emit)
}

/// What [`decode_phase`] does with each chosen token: settles a sampled one, then shows it.
pub(crate) struct EmitTokens<'a> {
    /// Settles a sampled token ([`generate_settling`]).
    pub(crate) settle: &'a mut dyn FnMut(u32) -> Result<u32>,
    /// Sees every token as it is chosen.
    pub(crate) on_token: &'a mut dyn FnMut(u32) -> Result<()>,
}

/// Checks the request and prepares `policy` for it (the first step of [`generate`]).
pub(crate) fn begin(
    model: &dyn CausalLm,
    policy: &mut dyn KvPolicy,
    prompt: &[u32],
    cfg: &GenerateConfig,
) -> Result<()> {
    let info = model.info();
    validate_request(info, prompt, cfg)?;
    let new = cfg.decode_ids.as_ref().map_or(cfg.max_new_tokens, Vec::len);
    let step = chunk_len(cfg.prefill_chunk, prompt.len());
    policy.prepare(&kv_shape(info, 1, prompt.len() + new, step))?;
    Ok(())
}

/// What a prefill leaves for decoding.
pub(crate) struct Prefilled {
    /// The last prompt position's logits `(vocab,)`.
    pub last: Tensor,
    /// The logits rows kept so far.
    pub rows: Vec<Tensor>,
    /// Prompt tokens computed.
    pub tokens: usize,
    /// Seconds it took.
    pub seconds: f64,
}

/// Prefills `prompt[from..]` (the first `from` tokens are already in `policy`).
pub(crate) fn prefill_phase(
    model: &dyn CausalLm,
    policy: &mut dyn KvPolicy,
    prompt: &[u32],
    from: usize,
    cfg: &GenerateConfig,
) -> Result<Prefilled> {
    let start = Instant::now();
    let rest = prompt.len() - from;
    let bar = (cfg.progress && rest >= PROGRESS_MIN_PROMPT).then(|| progress_bar(rest));
    let (last, prompt_rows) = prefill_from(
        model,
        policy,
        prompt,
        from,
        cfg.prefill_chunk,
        cfg.collect_logits && !cfg.decode_logits_only,
        &mut |done| {
            if let Some(b) = &bar {
                b.set_position((done - from) as u64);
            }
        },
    )?;
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    check_finite(&last, prompt.len() - 1)?;
    let mut rows: Vec<Tensor> = prompt_rows.into_iter().collect();
    if cfg.collect_logits && cfg.decode_logits_only {
        rows.push(last.unsqueeze(0)?);
    }
    Ok(Prefilled {
        last,
        rows,
        tokens: rest,
        seconds: start.elapsed().as_secs_f64(),
    })
}

/// Decodes after a prefill (the last step of [`generate`]).
pub(crate) fn decode_phase(
    model: &dyn CausalLm,
    policy: &mut dyn KvPolicy,
    prompt: &[u32],
    cfg: &GenerateConfig,
    prefilled: Prefilled,
    emit: EmitTokens<'_>,
) -> Result<Generation> {
    let EmitTokens { settle, on_token } = emit;
    let info = model.info().clone();
    let prefill_stats = policy.stats();
    let Prefilled {
        mut last,
        mut rows,
        tokens: prefill_tokens,
        seconds: prefill_s,
    } = prefilled;
    let mut generated = Vec::new();
    let mut decode_tokens = 0;
    let start = Instant::now();
    let mut step = |tok: u32, pos: usize, rows: &mut Vec<Tensor>| -> Result<Tensor> {
        let _span = tracing::debug_span!("decode_step", pos).entered();
        let logits = model.forward(&ids_tensor(&[tok], &info)?, pos, policy, LogitsMode::Last)?;
        let row = logits.squeeze(0)?;
        check_finite(&row, pos)?;
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
            let mut sampler =
                crate::engine::sampler::Sampler::new(cfg.temperature, cfg.top_p, cfg.seed);
            for i in 0..cfg.max_new_tokens {
                let tok = settle(sampler.sample(&last)?)?;
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
        prefill_tokens,
        prefill_s,
        decode_tokens,
        decode_s,
        prefill_stats: Some(prefill_stats),
    })
}

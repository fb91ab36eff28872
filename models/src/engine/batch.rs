//! Ragged batches: requests of different lengths decoded together, each under its own
//! cache in one batched policy ([`kvpolicy_core::Batched`]), mini-batches planned by the
//! policy and run layer by layer across them (HybridServe §4.2's column-by-column schedule).
use std::time::Instant;

use candle_core::Tensor;
use kvpolicy_core::{KvPolicy, SeqLoad};

use crate::engine::generate::{
    check_finite, chunk_len, kv_shape, validate_request, GenerateConfig, Generation,
};
use crate::error::{Message, ModelError, ModelInput, Result};
use crate::model::{CausalLm, LogitsMode, SeqChunk};

/// Runs one ragged step: asks the policy for its mini-batches ([`Batched::plan`](kvpolicy_core::Batched::plan)), checks
/// that they hold every chunk once, and runs them through [`CausalLm::forward_batch`].
/// Returns the chunks in the order run and their logits, one tensor each.
pub fn batch_step(
    model: &dyn CausalLm,
    policy: &mut dyn KvPolicy,
    chunks: &[SeqChunk],
    mode: LogitsMode,
) -> Result<(Vec<SeqChunk>, Vec<Tensor>)> {
    let loads: Vec<SeqLoad> = chunks
        .iter()
        .map(|c| SeqLoad {
            seq: c.seq,
            cached: c.pos,
            new: c.ids.len(),
        })
        .collect();
    let plan = match policy.as_batched() {
        Some(b) => b.plan(&loads)?,
        None => vec![(0..loads.len()).collect()],
    };
    let mut seen = vec![false; chunks.len()];
    for &i in plan.iter().flatten() {
        match seen.get_mut(i) {
            Some(s) if !*s => *s = true,
            _ => {
                return Err(ModelError::Input(
                    format!(
                        "policy `{}` planned mini-batches that do not hold each sequence once",
                        policy.name()
                    )
                    .into(),
                ))
            }
        }
    }
    if seen.iter().any(|s| !s) {
        return Err(ModelError::Input(
            format!(
                "policy `{}` left a sequence out of its mini-batches",
                policy.name()
            )
            .into(),
        ));
    }
    let groups: Vec<Vec<SeqChunk>> = plan
        .iter()
        .map(|g| g.iter().filter_map(|&i| chunks.get(i).cloned()).collect())
        .collect();
    let logits = model.forward_batch(&groups, policy, mode)?;
    Ok((groups.into_iter().flatten().collect(), logits))
}

/// What a batch generation produced.
#[derive(Debug)]
pub struct BatchGeneration {
    /// One generation per prompt, in input order (timings are the whole batch's share:
    /// `prefill_s`/`decode_s` of each are the batch's).
    pub requests: Vec<Generation>,
    /// The policy's stats after every step.
    pub step_stats: Vec<kvpolicy_core::KvStats>,
    /// Seconds spent in steps that carried prompt tokens.
    pub prefill_s: f64,
    /// Seconds spent in steps that carried only decode tokens.
    pub decode_s: f64,
    /// Decode tokens over all requests.
    pub decode_tokens: usize,
}

/// One request's progress in [`generate_batch`].
struct Active {
    prompt: Vec<u32>,
    pos: usize,
    generated: Vec<u32>,
    rows: Vec<Tensor>,
    sampler: crate::engine::sampler::Sampler,
    decode_tokens: usize,
    done: bool,
}

/// Generates after each of `prompts` in one ragged batch: every step carries each unfinished
/// request's next prompt piece (`cfg.prefill_chunk` tokens, 0 = all) or its last sampled
/// token, split into mini-batches by [`Batched::plan`](kvpolicy_core::Batched::plan) and run through
/// [`CausalLm::forward_batch`]. A request that finishes (end-of-sequence or
/// `max_new_tokens`) is released from the policy while the others go on. Sequence slots are
/// the prompts' indices. Teacher forcing (`decode_ids`) is not supported here.
pub fn generate_batch(
    model: &dyn CausalLm,
    policy: &mut dyn KvPolicy,
    prompts: &[Vec<u32>],
    cfg: &GenerateConfig,
) -> Result<BatchGeneration> {
    let info = model.info().clone();
    if prompts.is_empty() {
        return Err(ModelError::Input("the batch has no prompts".into()));
    }
    if cfg.decode_ids.is_some() {
        return Err(ModelError::Input(
            Message::from("teacher forcing (")
                .input(ModelInput::DecodeIds)
                .text(") runs one prompt at a time, not a batch"),
        ));
    }
    for (i, p) in prompts.iter().enumerate() {
        validate_request(&info, p, cfg).map_err(|e| match e {
            ModelError::Input(why) => {
                ModelError::Input(format!("prompt {} of the batch: {why}", i + 1).into())
            }
            e => e,
        })?;
    }
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    policy.prepare(&kv_shape(
        &info,
        prompts.len(),
        longest + cfg.max_new_tokens,
        chunk_len(cfg.prefill_chunk, longest),
    ))?;
    let mut reqs: Vec<Active> = prompts
        .iter()
        .map(|p| Active {
            prompt: p.clone(),
            pos: 0,
            generated: Vec::new(),
            rows: Vec::new(),
            sampler: crate::engine::sampler::Sampler::new(cfg.temperature, cfg.top_p, cfg.seed),
            decode_tokens: 0,
            done: false,
        })
        .collect();
    let mode = if cfg.collect_logits {
        LogitsMode::All
    } else {
        LogitsMode::Last
    };
    let (mut prefill_s, mut decode_s) = (0.0, 0.0);
    let mut step_stats = Vec::new();
    loop {
        let mut chunks = Vec::new();
        for (i, r) in reqs.iter().enumerate().filter(|(_, r)| !r.done) {
            let ids = if r.pos < r.prompt.len() {
                let n = match cfg.prefill_chunk {
                    0 => r.prompt.len(),
                    c => c,
                };
                r.prompt[r.pos..(r.pos + n).min(r.prompt.len())].to_vec()
            } else {
                r.generated.last().copied().into_iter().collect()
            };
            chunks.push(SeqChunk {
                seq: i,
                pos: r.pos,
                ids,
            });
        }
        if chunks.is_empty() {
            break;
        }
        let prefilling = chunks.iter().any(|c| c.pos < reqs[c.seq].prompt.len());
        let start = Instant::now();
        let (groups, logits) = batch_step(model, policy, &chunks, mode)?;
        for (chunk, rows) in groups.iter().zip(logits) {
            let r = &mut reqs[chunk.seq];
            let was_decode = r.pos >= r.prompt.len();
            r.pos += chunk.ids.len();
            if was_decode {
                r.decode_tokens += 1;
            }
            let n = rows.dim(0)?;
            let last = rows.get(n - 1)?;
            check_finite(&last, r.pos - 1)?;
            if cfg.collect_logits {
                r.rows.push(rows);
            }
            if r.pos < r.prompt.len() {
                continue;
            }
            if r.generated.len() == cfg.max_new_tokens {
                r.done = true;
            } else {
                let tok = r.sampler.sample(&last)?;
                r.generated.push(tok);
                r.done = (cfg.stop_at_eos && info.eos.contains(&tok))
                    || r.generated.len() == cfg.max_new_tokens;
            }
            if r.done {
                if let Some(b) = policy.as_batched() {
                    b.release(chunk.seq);
                }
            }
        }
        let took = start.elapsed().as_secs_f64();
        if prefilling {
            prefill_s += took;
        } else {
            decode_s += took;
        }
        step_stats.push(policy.stats());
    }
    let decode_tokens = reqs.iter().map(|r| r.decode_tokens).sum();
    let requests = reqs
        .into_iter()
        .map(|r| {
            let logits = if cfg.collect_logits {
                Some(Tensor::cat(&r.rows, 0)?)
            } else {
                None
            };
            Ok(Generation {
                prefill_tokens: r.prompt.len(),
                prompt_ids: r.prompt,
                generated_ids: r.generated,
                logits,
                prefill_s,
                decode_tokens: r.decode_tokens,
                decode_s,
                prefill_stats: None,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(BatchGeneration {
        requests,
        step_stats,
        prefill_s,
        decode_s,
        decode_tokens,
    })
}

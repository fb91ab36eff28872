//! Batch mode (`--prompts-file`): reads the prompts, generates them together as one ragged
//! batch (`generate_batch`) — or, with a prefix cache, one after another, each reusing the
//! chunks the earlier ones stored ([`crate::reuse::run_prompts`]) — prints each completion
//! and writes `--ids-out` / `--stats-out`.
use std::io::Write;
use std::path::Path;

use anyhow::{bail, Context, Result};
use kvpolicy::models::{generate_batch, TextTokenizer};
use kvpolicy::{CausalLm, KvPolicy, KvStats};

use crate::applies::warn_slow_link;
use crate::args::Args;
use crate::atomic::Staged;
use crate::reuse::{PrefixOut, RequestReuse, Reusing};
use crate::stats_out::{peak_rss_bytes, StatsOut};

/// What a batch generated, however it ran.
struct Outcome {
    /// Per prompt, in input order: prompt and generated ids.
    requests: Vec<(Vec<u32>, Vec<u32>)>,
    prefill_s: f64,
    decode_s: f64,
    decode_tokens: usize,
    /// Tokens prefilled (not restored).
    prefill_tokens: usize,
    /// Stats after every step (a ragged batch).
    steps: Option<Vec<KvStats>>,
    /// What came from the prefix cache (run one after another).
    prefix: Option<PrefixOut>,
}

/// The prompts of a file: text lines, or token ids from a `.jsonl` file.
pub enum Prompts {
    /// One prompt per line, to tokenize.
    Text(Vec<String>),
    /// One JSON array of token ids per line.
    Ids(Vec<Vec<u32>>),
}

/// The most bytes read of a prompts file (or a `--prompt-file`) (a 512K-token prompt is a few MiB of text).
pub const PROMPTS_CAP: u64 = 256 << 20;

/// Reads `path` (a regular file of at most [`PROMPTS_CAP`] bytes): `.jsonl` → one JSON array of token ids per line, else plain text, one
/// prompt per line; blank lines are skipped; no prompt at all is an error.
pub fn read(path: &Path) -> Result<Prompts> {
    let text =
        kvpolicy::models::load::files::read_text_capped(path, "--prompts-file", PROMPTS_CAP)?;
    let lines: Vec<(usize, &str)> = text
        .lines()
        .enumerate()
        .map(|(i, l)| (i + 1, l.trim_end_matches('\r')))
        .filter(|(_, l)| !l.trim().is_empty())
        .collect();
    if lines.is_empty() {
        bail!(
            "--prompts-file {} holds no prompts; write one prompt per line (or, in a .jsonl file, one JSON array of token ids per line)",
            path.display()
        );
    }
    let jsonl = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("jsonl"));
    if !jsonl {
        return Ok(Prompts::Text(
            lines.into_iter().map(|(_, l)| l.to_string()).collect(),
        ));
    }
    let mut out = Vec::with_capacity(lines.len());
    for (n, line) in lines {
        let ids: Vec<u32> = serde_json::from_str(line).with_context(|| {
            format!(
                "{} line {n} is not a JSON array of token ids (e.g. [1, 2, 3]): `{}`",
                path.display(),
                line.chars().take(60).collect::<String>()
            )
        })?;
        if ids.is_empty() {
            bail!(
                "{} line {n} is an empty prompt; give at least one token id",
                path.display()
            );
        }
        out.push(ids);
    }
    Ok(Prompts::Ids(out))
}

/// Generates every prompt of the batch and writes the outputs.
pub fn run(
    args: &Args,
    model: &dyn CausalLm,
    tok: Option<&TextTokenizer>,
    policy: &mut dyn KvPolicy,
    prompts: Prompts,
    reusing: Option<&mut Reusing>,
) -> Result<()> {
    let ids: Vec<Vec<u32>> = match prompts {
        Prompts::Ids(ids) => ids,
        Prompts::Text(lines) => {
            let tok = tok.context(
                "this model has no tokenizer; give the prompts as token ids in a .jsonl file, or pass --tokenizer tokenizer.json",
            )?;
            lines
                .iter()
                .map(|l| tok.encode(l))
                .collect::<std::result::Result<_, _>>()?
        }
    };
    let longest = ids.iter().map(Vec::len).max().unwrap_or(0);
    warn_slow_link(args, model.info(), longest);
    let lens: Vec<usize> = ids.iter().map(Vec::len).collect();
    crate::preflight::check_descriptors(args, model.info(), &lens)?;
    crate::preflight::check_disk_room(args, model.info(), &lens)?;
    let out = match reusing {
        Some(r) => one_by_one(args, r, model, tok, policy, &ids)?,
        None => together(args, model, tok, policy, &ids)?,
    };
    write_outputs(args, model, policy, &ids, out)
}

/// The prompts as one ragged batch; prints the completions.
fn together(
    args: &Args,
    model: &dyn CausalLm,
    tok: Option<&TextTokenizer>,
    policy: &mut dyn KvPolicy,
    ids: &[Vec<u32>],
) -> Result<Outcome> {
    let cfg = args.generate_config();
    let out = generate_batch(model, policy, ids, &cfg)?;
    let mut stdout = std::io::stdout().lock();
    for (i, g) in out.requests.iter().enumerate() {
        let text = match tok {
            Some(t) => t.decode(&g.generated_ids)?,
            None => g
                .generated_ids
                .iter()
                .map(|t| t.to_string())
                .collect::<Vec<_>>()
                .join(" "),
        };
        // A closed stdout (a pipe whose reader left) ends the text, not the run: the output
        // files below are still written.
        if writeln!(stdout, "[{}] {}", i + 1, text.replace('\n', "\\n")).is_err() {
            break;
        }
    }
    Ok(Outcome {
        requests: out
            .requests
            .iter()
            .map(|g| (g.prompt_ids.clone(), g.generated_ids.clone()))
            .collect(),
        prefill_s: out.prefill_s,
        decode_s: out.decode_s,
        decode_tokens: out.decode_tokens,
        prefill_tokens: ids.iter().map(Vec::len).sum(),
        steps: Some(out.step_stats),
        prefix: None,
    })
}

/// The prompts one after another through the prefix cache.
fn one_by_one(
    args: &Args,
    reusing: &mut Reusing,
    model: &dyn CausalLm,
    tok: Option<&TextTokenizer>,
    policy: &mut dyn KvPolicy,
    ids: &[Vec<u32>],
) -> Result<Outcome> {
    let gens = crate::reuse::run_prompts(args, reusing, model, tok, policy, ids)?;
    let sum = |f: &dyn Fn(&kvpolicy::models::Generation) -> f64| {
        gens.iter().map(|g| f(&g.generation)).sum::<f64>()
    };
    Ok(Outcome {
        prefill_s: sum(&|g| g.prefill_s),
        decode_s: sum(&|g| g.decode_s),
        decode_tokens: gens.iter().map(|g| g.generation.decode_tokens).sum(),
        prefill_tokens: gens.iter().map(|g| g.generation.prefill_tokens).sum(),
        steps: None,
        prefix: Some(PrefixOut::new(
            gens.iter().map(RequestReuse::of).collect(),
            reusing.cache_stats(),
        )),
        requests: gens
            .into_iter()
            .map(|g| (g.generation.prompt_ids, g.generation.generated_ids))
            .collect(),
    })
}

/// The batch's summary on stderr, then `--ids-out` and `--stats-out`.
fn write_outputs(
    args: &Args,
    model: &dyn CausalLm,
    policy: &mut dyn KvPolicy,
    ids: &[Vec<u32>],
    out: Outcome,
) -> Result<()> {
    let stats = policy.stats();
    let prefill_tokens = out.prefill_tokens;
    let total_s = out.prefill_s + out.decode_s;
    let _ = writeln!(
        std::io::stderr(),
        "{} prompts, {prefill_tokens} prompt tokens and {} decode tokens in {:.2}s ({:.1} decode tok/s over the batch); policy {}; device KV peak {}; recomputed {} tokens",
        ids.len(),
        out.decode_tokens,
        total_s,
        out.decode_tokens as f64 / out.decode_s.max(1e-9),
        policy.name(),
        kvpolicy::core::format_bytes(stats.device_kv_peak_bytes),
        stats.recompute_tokens,
    );
    if !stats.policy_metrics.is_empty() {
        let _ = writeln!(
            std::io::stderr(),
            "{}: {}",
            policy.name(),
            crate::summary::metrics_text(&stats)
        );
    }
    if stats.lossy {
        let _ = writeln!(
            std::io::stderr(),
            "LOSSY: logits differ from full ({})",
            match args.kv.smaller_storage() {
                Some(flag) => format!("K/V stored in the smaller {flag}"),
                None => "an approximate policy".into(),
            }
        );
    }
    if let Some(c) = &model.info().conversion {
        let _ = writeln!(
            std::io::stderr(),
            "LOSSY model: {c}; its logits differ from the original model's"
        );
    }
    let mut staged = Staged::new();
    if let Some(path) = &args.ids_out {
        let v: Vec<_> = out
            .requests
            .iter()
            .map(|(p, g)| serde_json::json!({"prompt_ids": p, "generated_ids": g}))
            .collect();
        staged.add(path, |w| Ok(serde_json::to_writer(w, &v)?))?;
    }
    if let Some(path) = &args.stats_out {
        let info = model.info();
        let mut stats = stats;
        stats.lossy |= info.conversion.is_some();
        let st = StatsOut {
            stats,
            model_conversion: info.conversion.as_deref(),
            policy: policy.name(),
            model: &info.source,
            prefill_tokens,
            prefill_s: out.prefill_s,
            decode_tokens: out.decode_tokens,
            decode_s: out.decode_s,
            link: None,
            peak_rss_bytes: peak_rss_bytes(),
            steps: out.steps,
            prefix_cache: out.prefix,
            ranks: None,
        };
        staged.add(path, |w| Ok(serde_json::to_writer_pretty(w, &st)?))?;
    }
    staged.commit()
}

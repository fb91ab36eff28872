//! The runner every example shares: flags ([`Args`]), model loading, policy construction,
//! generation, the summary and the output files.
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{CommandFactory, FromArgMatches};
use kvpolicy::models::{generate_settling, load, resolve, ModelSpec};
use kvpolicy::PolicySpec;

use crate::applies::warn_slow_link;
use crate::args::Args;
use crate::atomic::{self, Staged};
use crate::printer::Printer;
use crate::ranks::{self, Ranks};
use crate::stats_out::{peak_rss_bytes, DecodeLink, StatsOut};
use crate::{batch, errors, flags, npy, preflight, registry, reuse, summary, threads};

/// `n` token ids drawn uniformly from `0..vocab` with `seed` (the `--random-prompt` prompt).
fn random_prompt(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    // SplitMix64: a fixed, documented sequence for a seed, independent of crate versions.
    let mut x = seed;
    (0..n)
        .map(|_| {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            ((z ^ (z >> 31)) % vocab.max(1) as u64) as u32
        })
        .collect()
}

/// Parses the flags, runs, and maps errors to a message and exit code 1. `example` is the
/// example's name, `archs` the architectures (`ModelInfo::architecture`) it runs and
/// `default` the model it loads when no model flag is given; `policies` the registry it
/// builds `--policy` from (kvpolicy's own, plus a crate's own policies).
pub fn main(
    example: &str,
    archs: &[&str],
    default: Option<ModelSpec>,
    policies: kvpolicy::PolicyRegistry,
) -> ExitCode {
    threads::settle();
    registry::install(policies);
    let matches = Args::command().get_matches();
    let args = Args::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    init_tracing();
    let reg = registry::registry();
    if args.kv.list_policies {
        println!("{}", flags::list_policies(&reg, true));
        return ExitCode::SUCCESS;
    }
    let fail = |e: anyhow::Error| {
        eprintln!("error: {}", errors::for_cli(&e, errors::Frontend::Runner));
        ExitCode::FAILURE
    };
    let spec = match flags::run_spec(&reg, &matches, &args.kv.policy, &[]) {
        Ok((spec, warnings)) => {
            for warning in warnings {
                eprintln!("{warning}");
            }
            spec
        }
        Err(e) => return fail(e),
    };
    atomic::on_signals();
    let ranks = Ranks::launched();
    let code = match run(&args, &reg, &spec, example, archs, default, ranks) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if ranks.shared() => {
            eprintln!(
                "error (rank {} of {}): {}",
                ranks.rank,
                ranks.size,
                errors::for_cli(&e, errors::Frontend::Runner)
            );
            // The other ranks would wait forever in the next collective.
            kvpolicy::helix::world::abort(1);
            ExitCode::FAILURE
        }
        Err(e) => fail(e),
    };
    kvpolicy::helix::finish();
    code
}

/// With `RUST_LOG` set (e.g. `RUST_LOG=kvpolicy_models=debug`), the `load`,
/// `prefill_chunk` and `decode_step` spans print on stderr with their durations.
fn init_tracing() {
    if std::env::var_os("RUST_LOG").is_none() {
        return;
    }
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_span_events(tracing_subscriber::fmt::format::FmtSpan::CLOSE)
        .with_writer(std::io::stderr)
        .try_init();
}

/// The example that runs `arch`.
fn example_for(arch: &str) -> &'static str {
    match arch {
        "mistral" => "mistral",
        "qwen2" => "qwen",
        "gemma" | "gemma2" | "gemma3" => "gemma",
        "opt" => "opt",
        _ => "llama",
    }
}

fn run(
    args: &Args,
    reg: &kvpolicy::PolicyRegistry,
    spec: &PolicySpec,
    example: &str,
    archs: &[&str],
    default: Option<ModelSpec>,
    ranks: Ranks,
) -> Result<()> {
    ranks.check(&spec.name, args)?;
    let default = match default {
        Some(d) => d,
        None if args.model.explicit() => ModelSpec::Default,
        None => anyhow::bail!(
            "the `{example}` example needs a model: pass --model-dir DIR, --gguf FILE, --model-id ID or --random-weights --config FILE (`--example llama` and `--example gemma` have built-in default models)"
        ),
    };
    let device = args.model.device().map_err(errors::no_gpu)?;
    let dtype = args.model.dtype(&device)?;
    // Fail on a bad policy name before loading anything.
    let opts = args.kv.options(&device)?;
    reuse::check_flags(args)?;
    // With a prefix cache a prompts file runs one prompt after another (each reusing the
    // earlier ones' chunks) under one policy, reset between them.
    let mut policy = if args.prompts_file.is_some() && !reuse::wanted(args) {
        reg.build_batched_spec(spec, &opts)?
    } else {
        reg.build_spec(spec, &opts)?
    };
    if reuse::wanted(args) {
        reuse::check_policy(args, policy.as_mut())?;
    }
    // Output paths that cannot be written fail before any work.
    for (path, flag) in [
        (&args.ids_out, "--ids-out"),
        (&args.dump_logits, "--dump-logits"),
        (&args.stats_out, "--stats-out"),
        (&args.save_session, "--save-session"),
    ] {
        if let Some(p) = path {
            atomic::check_output(p, flag)?;
        }
    }
    // A prompts file that cannot be read fails before the model loads.
    let batch = args.prompts_file.as_deref().map(batch::read).transpose()?;

    let spec = args.model.spec(default, args.seed)?;
    let files = resolve(&spec)?;
    let loaded = load(&files, &device, dtype, args.model.tokenizer.as_deref())?;
    let model = loaded.model;
    let tok = loaded.tokenizer;
    let arch = model.info().architecture.clone();
    if !archs.contains(&arch.as_str()) {
        anyhow::bail!(
            "the `{example}` example runs {} models, but {} is a `{arch}` model; run `--example {}` (every example takes the same flags)",
            archs.join("/"),
            model.info().source,
            example_for(&arch)
        );
    }

    let mut reusing = if reuse::wanted(args) {
        Some(reuse::Reusing::open(args, &files, model.as_ref())?)
    } else {
        None
    };
    if let Some(prompts) = batch {
        return batch::run(
            args,
            model.as_ref(),
            tok.as_ref(),
            policy.as_mut(),
            prompts,
            reusing.as_mut(),
        );
    }

    let prompt_ids = match (&args.prompt_ids, &args.prompt, args.random_prompt) {
        (_, _, Some(n)) => {
            // Checked before the ids are drawn: N sizes the prompt.
            let positions = model.info().max_positions;
            if n > positions {
                // The generation needs room too: name a prompt that leaves it.
                let room = positions.saturating_sub(args.max_new_tokens);
                anyhow::bail!(
                    "--random-prompt {n} exceeds the model's {positions} positions; ask for at most {room} tokens with --max-new-tokens {} (prompt + generation ≤ {positions}), or lower --max-new-tokens",
                    args.max_new_tokens
                );
            }
            preflight::check_random_prompt(n)?;
            random_prompt(n, model.info().vocab_size, args.seed)
        }
        (Some(ids), _, _) => ids.clone(),
        (None, p, None) => {
            // Read first: a bad file is named before a missing tokenizer.
            let from_file = match &args.prompt_file {
                Some(path) => Some(kvpolicy::models::load::files::read_text_capped(
                    path,
                    "--prompt-file",
                    crate::batch::PROMPTS_CAP,
                )?),
                None => None,
            };
            let tok = tok.as_ref().context(
                "this model has no tokenizer; pass --prompt-ids, or --tokenizer tokenizer.json",
            )?;
            let text = from_file
                .as_deref()
                .or(p.as_deref())
                .unwrap_or("The capital of France is");
            if args.chat {
                // The text is a user's turn: control tokens it spells stay text.
                tok.encode_chat(
                    &[kvpolicy::models::ChatMessage {
                        role: "user".into(),
                        content: text.into(),
                    }],
                    usize::MAX,
                )?
            } else {
                tok.encode(text)?
            }
        }
    };

    warn_slow_link(args, model.info(), prompt_ids.len());
    preflight::check_descriptors(args, model.info(), &[prompt_ids.len()])?;
    preflight::check_disk_room(args, model.info(), &[prompt_ids.len()])?;
    let cfg = args.generate_config();
    let mut printer = Printer::new(tok.as_ref());
    if !ranks.speaks() {
        printer = printer.silent();
    }
    let mut on_token = |t| {
        printer.push(t);
        Ok(())
    };
    // Under `helix` across ranks every rank goes on with rank 0's token (said once where
    // this rank's own choice differed).
    let mut diverged = false;
    let mut settle = |t| {
        let chosen = ranks
            .adopt(t)
            .map_err(|e| kvpolicy::ModelError::from(kvpolicy::KvError::invariant(e.to_string())))?;
        if chosen != t && !diverged {
            diverged = true;
            eprintln!(
                "warning (rank {}): it chose token {t} where rank 0 chose {chosen}; going on with rank 0's",
                ranks.rank
            );
        }
        Ok(chosen)
    };
    let (gen, reused) = match reusing.as_mut() {
        Some(r) => {
            let c = r.generate(
                args,
                model.as_ref(),
                policy.as_mut(),
                &prompt_ids,
                &cfg,
                &mut on_token,
            )?;
            let req = reuse::RequestReuse::of(&c);
            (c.generation, Some((req, c.session)))
        }
        None => (
            generate_settling(
                model.as_ref(),
                policy.as_mut(),
                &prompt_ids,
                &cfg,
                &mut settle,
                &mut on_token,
            )?,
            None,
        ),
    };
    printer.finish();

    let info = model.info();
    let stats = policy.stats();
    let rank_kv = ranks.kv(&stats)?;
    if !ranks.speaks() {
        return Ok(());
    }
    summary::print(&gen, &stats, policy.name(), args.kv.smaller_storage());
    if let Some(c) = &info.conversion {
        eprintln!("LOSSY model: {c}; its logits differ from the original model's");
    }
    if let Some(r) = &rank_kv {
        eprintln!("{}", ranks::summary(r));
    }
    let cache_stats = reusing.as_ref().and_then(reuse::Reusing::cache_stats);
    let (prefix_out, session) = match reused {
        Some((req, session)) => {
            eprintln!("{}", reuse::summary(&req, cache_stats.as_ref()));
            (Some(reuse::PrefixOut::new(vec![req], cache_stats)), session)
        }
        None => (None, None),
    };
    // Every output is written before any is put in place: one failing leaves none.
    let mut staged = Staged::new();
    if let Some(path) = &args.ids_out {
        let v =
            serde_json::json!({"prompt_ids": gen.prompt_ids, "generated_ids": gen.generated_ids});
        staged.add(path, |w| Ok(serde_json::to_writer(w, &v)?))?;
    }
    if let (Some(path), Some(logits)) = (&args.dump_logits, &gen.logits) {
        staged.add(path, |w| npy::write_f32_npy(logits, w))?;
    }
    if let (Some(path), Some(session)) = (&args.save_session, &session) {
        let bytes = session.encode()?;
        staged.add(path, |w| Ok(w.write_all(&bytes)?))?;
    }
    if let Some(path) = &args.stats_out {
        let out_stats = stats.clone();
        let mut stats = stats;
        stats.lossy |= info.conversion.is_some();
        let out = StatsOut {
            stats,
            model_conversion: info.conversion.as_deref(),
            policy: policy.name(),
            model: &info.source,
            prefill_tokens: gen.prefill_tokens,
            prefill_s: gen.prefill_s,
            decode_tokens: gen.decode_tokens,
            decode_s: gen.decode_s,
            link: DecodeLink::of(&gen, &out_stats),
            peak_rss_bytes: peak_rss_bytes(),
            steps: None,
            prefix_cache: prefix_out,
            ranks: rank_kv,
        };
        staged.add(path, |w| Ok(serde_json::to_writer_pretty(w, &out)?))?;
    }
    staged.commit()
}

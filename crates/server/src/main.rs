//! `kvpolicy-server`: an OpenAI-compatible HTTP server over one model under one KV policy,
//! chosen at start-up with the examples' own flags (`--policy headwise:group=1`, budgets,
//! the disk tier), serving every request through one continuously batched engine
//! (`engine`).
//!
//! ```sh
//! cargo run --release -p kvpolicy-server -- --gguf model.gguf --policy headwise --port 8080
//! ```
//!
//! It listens on 127.0.0.1 unless `--host` says otherwise; SIGTERM or Ctrl-C stops
//! accepting, lets in-flight requests finish for `--shutdown-timeout` seconds, cancels the
//! rest, frees the policy (its disk-tier files go with it) and exits 0.
#![deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod api;
mod detok;
mod engine;
mod error;
mod events;
mod metrics;
mod passes;
mod reply;
mod reuse;
mod routes;

use std::io::Write;
use std::net::{IpAddr, SocketAddr};
use std::process::ExitCode;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{CommandFactory, FromArgMatches, Parser};
use kvpolicy::models::engine::generate::kv_shape;
use kvpolicy::models::{fingerprint, layer_specs, load, resolve, CausalLm, ModelSpec};
use kvpolicy_cli::args::{parse_budget, ModelArgs, PolicyArgs, PrefixArgs};
use kvpolicy_cli::reuse::refuse_unrestorable;
use kvpolicy_cli::{errors, flags, threads};

use crate::engine::EngineConfig;
use crate::metrics::Metrics;
use crate::reuse::Reuse;
use crate::routes::AppState;

/// The server's flags: the examples' model and policy flags, and its own.
#[derive(Parser, Debug)]
#[command(
    name = "kvpolicy-server",
    about = "An OpenAI-compatible server over one model under a KV policy"
)]
struct ServerArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    kv: PolicyArgs,
    #[command(flatten)]
    prefix: PrefixArgs,
    /// Address to listen on (loopback unless told otherwise).
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    /// Port to listen on (0: a free one; the address is printed at start-up).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Requests decoding together at most (the ragged batch's size).
    #[arg(long, default_value_t = 8)]
    max_batch: usize,
    /// Requests waiting for a slot at most; past it a request gets 429 with Retry-After.
    #[arg(long, default_value_t = 64)]
    max_queue: usize,
    /// Prompt tokens per engine step, shared by the requests being prefilled, so the
    /// running ones keep decoding between a newcomer's pieces.
    #[arg(long, default_value_t = 256)]
    prefill_chunk: usize,
    /// Largest request body, e.g. 4MiB (413 past it).
    #[arg(long, default_value = "4MiB", value_parser = parse_budget)]
    max_body: u64,
    /// Prompt plus generated tokens per request at most (default: the model's positions).
    #[arg(long, value_name = "N")]
    ctx_size: Option<usize>,
    /// Prompt tokens per request at most, below the context (413 past it; default: no
    /// limit but the context, past which a prompt is a 400).
    #[arg(long, value_name = "N")]
    max_prompt_tokens: Option<usize>,
    /// Require `Authorization: Bearer KEY` on the /v1/ routes (401 without it).
    #[arg(long, value_name = "KEY")]
    api_key: Option<String>,
    /// The model's name in responses and /v1/models (default: the model's source).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Seconds in-flight requests may take to finish after SIGTERM or Ctrl-C before they
    /// are cancelled.
    #[arg(long, default_value_t = 10.0)]
    shutdown_timeout: f64,
    /// A request's tokens do not depend on what it is batched with: each prompt piece runs
    /// in a pass of its own and decode tokens in passes that take the kernel one token
    /// takes alone (slower with many requests; greedy output then equals the request run
    /// alone).
    #[arg(long)]
    batch_invariant: bool,
    /// Seed of --random-weights.
    #[arg(long, default_value_t = 299_792_458)]
    seed: u64,
}

fn main() -> ExitCode {
    threads::settle();
    let matches = ServerArgs::command().get_matches();
    let args = ServerArgs::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    let reg = kvpolicy::registry();
    if args.kv.list_policies {
        println!("{}", flags::list_policies(&reg, true));
        return ExitCode::SUCCESS;
    }
    match run(&args, &reg, &matches) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", errors::for_cli(&e, errors::Frontend::Runner));
            ExitCode::FAILURE
        }
    }
}

fn run(
    args: &ServerArgs,
    reg: &kvpolicy::PolicyRegistry,
    matches: &clap::ArgMatches,
) -> Result<()> {
    kvpolicy_cli::ranks::Ranks::launched().refuse_for("kvpolicy-server", "")?;
    for (n, flag) in [
        (args.max_batch, "--max-batch"),
        (args.prefill_chunk, "--prefill-chunk"),
    ] {
        anyhow::ensure!(n > 0, "{flag} 0: give at least 1");
    }
    anyhow::ensure!(
        args.shutdown_timeout.is_finite() && args.shutdown_timeout >= 0.0,
        "--shutdown-timeout {}: give a number of seconds ≥ 0",
        args.shutdown_timeout
    );
    args.prefix.check()?;
    let (spec, warnings) = flags::run_spec(reg, matches, &args.kv.policy)?;
    for w in warnings {
        eprintln!("{w}");
    }
    let device = args.model.device()?;
    let dtype = args.model.dtype(&device)?;
    let opts = args.kv.options(&device)?;
    // A bad policy fails before the model loads.
    let mut policy = reg.build_batched_spec(&spec, &opts)?;
    if let Some(flag) = args.prefix.flag() {
        // The batched wrapper takes any restore; one request's policy says whether it can.
        refuse_unrestorable(reg.build_spec(&spec, &opts)?.as_mut(), flag)?;
    }
    let files = resolve(&args.model.spec(ModelSpec::Default, args.seed)?)?;
    let loaded = load(&files, &device, dtype, args.model.tokenizer.as_deref())?;
    let tok = Arc::new(
        loaded
            .tokenizer
            .context("this model has no tokenizer; pass --tokenizer tokenizer.json")?,
    );
    let model: Arc<dyn CausalLm> = Arc::from(loaded.model);
    let info = model.info().clone();
    let context = match args.ctx_size {
        Some(n) if n == 0 || n > info.max_positions => anyhow::bail!(
            "--ctx-size {n}: this model has {} positions; give 1 to {}",
            info.max_positions,
            info.max_positions
        ),
        Some(n) => n,
        None => info.max_positions,
    };
    policy.prepare(&kv_shape(
        &info,
        args.max_batch,
        context,
        args.prefill_chunk,
    ))?;
    // A LOSSY policy, or a model a conversion made LOSSY (kvpolicy-compress).
    let lossy = policy.stats().lossy || info.conversion.is_some();
    if let Some(c) = &info.conversion {
        eprintln!("LOSSY model: {c}; its logits differ from the original model's");
    }
    // The fingerprint hashes the weights: only when a cache is asked for.
    let reuse = if args.prefix.wanted() {
        args.prefix
            .open(fingerprint(&files, &info)?)?
            .map(|cache| Reuse::new(cache, layer_specs(&info)))
    } else {
        None
    };
    let metrics = Arc::new(Metrics::new());
    let (handle, engine) = engine::start(
        model,
        tok.clone(),
        policy,
        EngineConfig {
            max_batch: args.max_batch,
            max_queue: args.max_queue,
            prefill_chunk: args.prefill_chunk,
            batch_invariant: args.batch_invariant,
        },
        metrics.clone(),
        reuse,
    )?;
    let state = Arc::new(AppState {
        engine: handle.clone(),
        tok,
        model_name: args
            .served_model_name
            .clone()
            .unwrap_or_else(|| info.source.clone()),
        vocab: info.vocab_size,
        context,
        max_prompt: args.max_prompt_tokens,
        metrics,
        api_key: args.api_key.clone(),
        created: routes::unix_now(),
        next_id: AtomicU64::new(1),
    });
    let app = routes::router(state, usize::try_from(args.max_body).unwrap_or(usize::MAX));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let cancel = handle.clone();
    rt.block_on(async move {
        let addr = SocketAddr::new(args.host, args.port);
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("cannot listen on {addr}"))?;
        let bound = listener.local_addr()?;
        println!(
            "kvpolicy-server listening on http://{bound} ({} under `{}`{})",
            info.source,
            args.kv.policy,
            if lossy { ", LOSSY" } else { "" }
        );
        std::io::stdout().flush()?;
        let deadline = Duration::from_secs_f64(args.shutdown_timeout);
        axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                stop_signal().await;
                eprintln!("shutting down: finishing in-flight requests (at most {deadline:?})");
                tokio::spawn(async move {
                    tokio::time::sleep(deadline).await;
                    cancel.cancel_all();
                });
            })
            .await?;
        anyhow::Ok(())
    })?;
    // The last handle gone, the engine finishes and drops the policy (and its files).
    drop(handle);
    rt.shutdown_timeout(Duration::from_secs(1));
    engine
        .join()
        .map_err(|_| anyhow::anyhow!("the engine thread panicked"))?;
    eprintln!("stopped");
    Ok(())
}

/// SIGTERM or Ctrl-C.
async fn stop_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {},
            _ = term.recv() => {},
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}

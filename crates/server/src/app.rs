//! The server assembled from its flags, ready to be served: the model loaded, the policy
//! built and prepared for `--max-batch` sequences, the engine thread started, and the
//! router over them. The binary serves it on a socket ([`crate::listen`]); the HTTP fuzz
//! target ([`crate::fuzzing`]) drives the same router in-process.
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::thread::JoinHandle;

use anyhow::{Context, Result};
use axum::Router;
use kvpolicy::core::PoolTier;
use kvpolicy::models::engine::generate::kv_shape;
use kvpolicy::models::{fingerprint, layer_specs, load, resolve, CausalLm, ModelSpec};
use kvpolicy::{KvPool, PolicyOption};
use kvpolicy_cli::flags as cli_flags;
use kvpolicy_cli::reuse::refuse_unrestorable;

use crate::api;
use crate::engine::{self, EngineConfig, EngineHandle, MemoryRules};
use crate::flags::{seconds, ServerArgs};
use crate::guard::Access;
use crate::intake::Intake;
use crate::memory::Governor;
use crate::metrics::Metrics;
use crate::reuse::Reuse;
use crate::routes::{self, AppState};
use crate::swap::{PreemptionMode, SwapSpace};

/// A server ready to serve.
pub struct App {
    /// The routes over the engine.
    pub router: Router,
    /// The engine (cancel it to end every request).
    pub engine: EngineHandle,
    /// The engine's thread: it ends once every handle is gone.
    pub thread: JoinHandle<()>,
    /// The metrics `/metrics` renders.
    pub metrics: Arc<Metrics>,
    /// The access rules (the binary warns when they expose the model).
    pub access: Access,
    /// What serves: the model's source, the policy, LOSSY when it is.
    pub banner: String,
}

/// Builds the server `args` describe (`matches`: the same flags as clap matched them).
pub fn build(
    args: &ServerArgs,
    reg: &kvpolicy::PolicyRegistry,
    matches: &clap::ArgMatches,
) -> Result<App> {
    kvpolicy_cli::ranks::Ranks::launched().refuse_for("kvpolicy-server", "")?;
    args.check()?;
    args.prefix.check()?;
    let access = Access::new(args.host, args.api_key.clone(), args.allowed_hosts.clone());
    let swap = swap_space(args)?;
    // With a swap space the server reads --disk-dir itself, whatever the policy reads.
    let ours: &[PolicyOption] = match swap {
        Some(_) => &[PolicyOption::DiskDir],
        None => &[],
    };
    let (spec, warnings) = cli_flags::run_spec(reg, matches, &args.kv.policy, ours)?;
    for w in warnings {
        eprintln!("{w}");
    }
    let device = args.model.device().map_err(kvpolicy_cli::errors::no_gpu)?;
    let dtype = args.model.dtype(&device)?;
    let mut opts = args.kv.options(&device)?;
    // One pool per tier for every request: the budgets bound their sum.
    let pool = KvPool::shared_by(opts.device_kv_budget, opts.host_kv_budget, args.max_batch);
    opts.pool = Some(pool.clone());
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
    args.check_against(context)?;
    // No piece is longer than a request can be.
    let prefill_chunk = args.prefill_chunk.min(context);
    let shape = kv_shape(&info, args.max_batch, context, prefill_chunk);
    policy.prepare(&shape)?;
    if swap.is_some() && policy.as_restore().is_none() {
        eprintln!(
            "warning: `{}` cannot hand a preempted request's K/V back; preempted requests are \
             recomputed (--preemption-mode swap: full, layer, headwise, auto)",
            args.kv.policy
        );
    }
    // One sequence's whole K/V per token (the memory rules' rate before any is measured).
    let kv_per_token = (shape.kv_bytes(shape.n_kv_heads, 1) / shape.batch.max(1) as u64)
        .saturating_mul(shape.n_layers as u64);
    // A LOSSY policy, or a model a conversion made LOSSY (kvpolicy-compress).
    let lossy = policy.stats().lossy || info.conversion.is_some();
    if let Some(c) = &info.conversion {
        eprintln!("LOSSY model: {c}; its logits differ from the original model's");
    }
    // The fingerprint hashes the weights: only when a cache is asked for.
    let reuse = if args.prefix.wanted() {
        args.prefix
            .open(fingerprint(&files, &info)?)?
            // One pool with the requests' K/V: the ledger of the memory its chunks are read
            // from (the CPU is the device; on a GPU they are host RAM).
            .map(|cache| {
                // (Where the policy holds shared chunks, when it does.)
                let fallback = match opts.device.is_cpu() {
                    true => PoolTier::Device,
                    false => PoolTier::Host,
                };
                let tier = policy
                    .as_restore()
                    .and_then(|r| r.attach_tier())
                    .unwrap_or(fallback);
                Reuse::new(cache.pooled(pool.clone(), tier), layer_specs(&info), tier)
            })
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
            prefill_chunk,
            batch_invariant: args.batch_invariant,
        },
        metrics.clone(),
        reuse,
        MemoryRules {
            governor: Some(Governor::new(
                pool,
                opts.grow_tokens,
                shape.n_layers,
                kv_per_token,
            )),
            swap,
        },
    )?;
    let body_timeout = seconds("--body-timeout", args.body_timeout, false)?;
    let state = Arc::new(AppState {
        engine: handle.clone(),
        intake: Intake::new(
            tok,
            args.tokenizer_threads,
            body_timeout,
            usize::try_from(args.max_body).unwrap_or(usize::MAX),
            args.parse_special,
        ),
        model_name: args
            .served_model_name
            .clone()
            .unwrap_or_else(|| info.source.clone()),
        vocab: info.vocab_size,
        context,
        max_prompt: args.max_prompt_tokens,
        max_choices: (args.max_batch + args.max_queue).clamp(1, api::MAX_CHOICES),
        metrics: metrics.clone(),
        access: access.clone(),
        created: routes::unix_now(),
        next_id: AtomicU64::new(1),
    });
    Ok(App {
        router: routes::router(state),
        engine: handle,
        thread: engine,
        metrics,
        access,
        banner: format!(
            "{} under `{}`{}",
            info.source,
            args.kv.policy,
            if lossy { ", LOSSY" } else { "" }
        ),
    })
}

/// Where preempted requests' K/V are swapped to (`--preemption-mode`; `None`: they are
/// recomputed).
fn swap_space(args: &ServerArgs) -> Result<Option<SwapSpace>> {
    let dir = args.kv.disk_dir.as_deref();
    let mode = args.preemption_mode.unwrap_or(PreemptionMode::Recompute);
    match (mode, dir) {
        (PreemptionMode::Recompute, _) => Ok(None),
        (PreemptionMode::Swap, Some(dir)) => Ok(Some(SwapSpace::new(dir)?)),
        (PreemptionMode::Swap, None) => anyhow::bail!(
            "--preemption-mode swap writes preempted requests' K/V to the disk tier: give --disk-dir DIR, or --preemption-mode recompute"
        ),
    }
}

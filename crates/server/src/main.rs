//! `kvpolicy-server`: an OpenAI-compatible HTTP server over one model under one KV policy,
//! chosen at start-up with the examples' own flags (`--policy headwise:group=1`, budgets,
//! the disk tier), serving every request through one continuously batched engine
//! (`engine`).
//!
//! ```sh
//! cargo run --release -p kvpolicy-server -- --gguf model.gguf --policy headwise --port 8080
//! ```
//!
//! It listens on 127.0.0.1 unless `--host` says otherwise, within the bounds of
//! [`listen`](kvpolicy_server::listen) (connections, header and idle time) and [`intake`](kvpolicy_server::intake) (body time, parsing and
//! tokenizing off the I/O threads). SIGTERM, SIGHUP or Ctrl-C stops accepting, lets
//! in-flight requests finish within `--shutdown-timeout` seconds (the whole shutdown), cancels
//! the rest, frees the policy (its disk-tier files go with it) and exits 0; a second signal
//! ends the wait at once.
#![deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::Write;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{CommandFactory, FromArgMatches};
use kvpolicy_cli::{errors, flags as cli_flags, threads};
use kvpolicy_server::app::{self, App};
use kvpolicy_server::flags::{seconds, ServerArgs};
use kvpolicy_server::listen::{self, fit_open_files, Limits};
use kvpolicy_server::shutdown::Signals;

fn main() -> ExitCode {
    threads::settle();
    let matches = ServerArgs::command().get_matches();
    let args = ServerArgs::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    let reg = kvpolicy::registry();
    if args.kv.list_policies {
        println!("{}", cli_flags::list_policies(&reg, true));
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
    // Every other flag is checked by `app::build`, before the model loads.
    fit_open_files(args.max_connections)?;
    let header_timeout = seconds("--header-timeout", args.header_timeout, false)?;
    let send_timeout = seconds("--send-timeout", args.send_timeout, false)?;
    let deadline = seconds("--shutdown-timeout", args.shutdown_timeout, true)?;
    // The port is taken before the model loads: a port in use is refused at once, not after
    // minutes of loading. Connections that arrive meanwhile wait in the kernel's backlog
    // until the server is ready (and says so on stdout).
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let addr = SocketAddr::new(args.host, args.port);
    let listener = rt
        .block_on(tokio::net::TcpListener::bind(addr))
        .map_err(|e| anyhow::anyhow!(listen::bind_error(addr, &e)))?;
    let App {
        router: app,
        engine: handle,
        thread: engine,
        metrics,
        access,
        banner,
    } = app::build(args, reg, matches)?;
    if access.exposed_without_key() {
        eprintln!(
            "WARNING: listening on {} without --api-key: anyone who can reach this address can run the model; give --api-key KEY",
            args.host
        );
    }
    let cancel = handle.clone();
    let limits = Limits {
        max_connections: args.max_connections,
        header_timeout,
        send_timeout,
    };
    let (at_once, since) = rt.block_on(async move {
        let mut signals = Signals::listen()?;
        let bound = listener.local_addr()?;
        println!("kvpolicy-server listening on http://{bound} ({banner})");
        std::io::stdout().flush()?;
        let (tx, rx) = tokio::sync::oneshot::channel();
        let until = async move {
            let name = signals.next().await;
            let _ = tx.send(signals);
            eprintln!("{name}: shutting down, finishing in-flight requests (at most {deadline:?}; a second signal stops at once)");
        };
        let conns = listen::serve(listener, app, limits, metrics, until).await;
        conns.close_all();
        let mut signals = rx.await.context("the signal listener stopped")?;
        let since = std::time::Instant::now();
        let at_once = tokio::select! {
            () = conns.drained() => false,
            () = tokio::time::sleep(deadline) => {
                eprintln!("--shutdown-timeout reached: cancelling what is left");
                false
            }
            name = signals.next() => {
                eprintln!("{name} again: stopping now");
                true
            }
        };
        cancel.cancel_all();
        anyhow::Ok((at_once, since))
    })?;
    // The runtime's signal handlers go with it: from here on a signal ends the process.
    #[cfg(unix)]
    for sig in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
        // SAFETY: restoring a signal's default disposition, nothing else.
        unsafe {
            libc::signal(sig, libc::SIG_DFL);
        }
    }
    // The last handle gone, the engine finishes and drops the policy (and its files).
    drop(handle);
    rt.shutdown_timeout(Duration::from_millis(if at_once { 100 } else { 1000 }));
    // The engine ends its current step, then frees the policy (its disk-tier files with it):
    // within what is left of the deadline, at least a step's time.
    let step = Duration::from_secs(2);
    let wait = if at_once {
        step
    } else {
        deadline.saturating_sub(since.elapsed()).max(step)
    };
    let start = std::time::Instant::now();
    while !engine.is_finished() && start.elapsed() < wait {
        std::thread::sleep(Duration::from_millis(10));
    }
    if !engine.is_finished() {
        eprintln!("the engine did not stop within {wait:?}; exiting without it");
        return Ok(());
    }
    engine
        .join()
        .map_err(|_| anyhow::anyhow!("the engine thread panicked"))?;
    eprintln!("stopped");
    Ok(())
}

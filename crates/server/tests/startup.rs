//! Start-up: flags the server refuses (one line naming the flag, a non-zero exit, nothing
//! served), and `--served-model-name` in `/v1/models` and responses.
mod common;

use std::process::Command;

use anyhow::{ensure, Result};
use common::{agent, completion_text, get, Server};
use serde_json::{json, Value};

#[test]
fn bad_flags_are_refused_naming_the_flag() -> Result<()> {
    for (flags, want) in [
        (&["--max-batch", "0"][..], "--max-batch 0"),
        (&["--prefill-chunk", "0"][..], "--prefill-chunk 0"),
        (&["--shutdown-timeout=-1"][..], "--shutdown-timeout -1"),
        (&["--ctx-size", "99999999"][..], "--ctx-size 99999999"),
        (&["--policy", "nonesuch"][..], "nonesuch"),
        // Numbers past what the server can hold: one line each, not an abort or a panic.
        (
            &["--max-batch", "100000000000"][..],
            "--max-batch 100000000000",
        ),
        (
            &["--max-queue", "100000000000"][..],
            "--max-queue 100000000000",
        ),
        (&["--shutdown-timeout", "1e300"][..], "--shutdown-timeout"),
        (&["--header-timeout", "0"][..], "--header-timeout 0"),
        (&["--body-timeout", "inf"][..], "--body-timeout inf"),
        (&["--max-connections", "0"][..], "--max-connections 0"),
        (
            &["--max-connections", "100000000000"][..],
            "--max-connections 100000000000",
        ),
        (
            &["--tokenizer-threads", "100000"][..],
            "--tokenizer-threads 100000",
        ),
        (&["--max-body", "1TiB"][..], "--max-body"),
        (&["--max-prompt-tokens", "0"][..], "--max-prompt-tokens 0"),
        (&["--api-key", ""][..], "--api-key is empty"),
        (&["--allowed-hosts", "a,,b"][..], "--allowed-hosts"),
        (
            &["--allowed-hosts", "api.example:8080"][..],
            "--allowed-hosts api.example:8080",
        ),
        (&["--send-timeout", "0"][..], "--send-timeout 0"),
        // Swapping needs a directory, one that exists.
        (&["--preemption-mode", "swap"][..], "--preemption-mode swap"),
        (&["--preemption-mode", "evict"][..], "--preemption-mode"),
        (
            &[
                "--preemption-mode",
                "swap",
                "--disk-dir",
                "/nonexistent/kvpolicy-swap",
            ][..],
            "--disk-dir /nonexistent/kvpolicy-swap",
        ),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_kvpolicy-server"))
            .args(["--cpu", "--port", "0"])
            .args(flags)
            .output()?;
        let err = String::from_utf8_lossy(&out.stderr);
        ensure!(!out.status.success(), "{flags:?} started: {err}");
        ensure!(err.contains(want), "{flags:?}: {err}");
        ensure!(out.stdout.is_empty(), "{flags:?} printed an address");
    }
    Ok(())
}

/// A port already taken: a non-zero exit, nothing served, and one line naming the port
/// and the way out (another `--port`, or stopping what holds it).
#[test]
fn a_port_in_use_names_the_port_and_the_fix() -> Result<()> {
    let taken = std::net::TcpListener::bind("127.0.0.1:0")?;
    let port = taken.local_addr()?.port().to_string();
    let out = Command::new(env!("CARGO_BIN_EXE_kvpolicy-server"))
        .args(["--cpu", "--port", &port])
        .output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    ensure!(!out.status.success(), "started: {err}");
    ensure!(out.stdout.is_empty(), "printed an address: {err}");
    ensure!(!err.contains("panicked"), "{err}");
    let last = err.lines().last().unwrap_or_default();
    ensure!(
        last.starts_with(&format!("error: cannot listen on 127.0.0.1:{port}: ")),
        "{err}"
    );
    ensure!(
        last.contains(&format!("port {port} is already taken")),
        "{err}"
    );
    ensure!(
        last.contains("or choose another port with --port N (--port 0 picks a free one)"),
        "{err}"
    );
    drop(taken);
    Ok(())
}

/// Launched by `mpirun` as several ranks (its environment says so: Open MPI's
/// `OMPI_COMM_WORLD_SIZE`), the server refuses to start instead of serving once per rank.
#[test]
fn several_mpirun_ranks_are_refused() -> Result<()> {
    let out = Command::new(env!("CARGO_BIN_EXE_kvpolicy-server"))
        .args(["--cpu", "--port", "0", "--policy", "helix"])
        .env("OMPI_COMM_WORLD_SIZE", "2")
        .env("OMPI_COMM_WORLD_RANK", "0")
        .output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    ensure!(!out.status.success(), "started: {err}");
    ensure!(err.contains("mpirun launched 2"), "{err}");
    ensure!(out.stdout.is_empty(), "printed an address");
    Ok(())
}

#[test]
fn the_served_model_name_is_what_clients_see() -> Result<()> {
    let server = Server::start(&["--served-model-name", "smol"])?;
    let a = agent();
    let (status, text) = get(&a, &server.url("/v1/models"))?;
    ensure!(status == 200, "{text}");
    let v: Value = serde_json::from_str(&text)?;
    ensure!(v["data"][0]["id"] == "smol", "{text}");
    let body = json!({"prompt": "Hi", "max_tokens": 1});
    completion_text(&a, &server.url("/v1/completions"), &body)?;
    Ok(())
}

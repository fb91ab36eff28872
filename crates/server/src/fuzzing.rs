//! The HTTP fuzz target's body (`fuzz/fuzz_targets/http.rs`; replayed over seeds and
//! mutations by `tests/http_fuzz.rs`): arbitrary bytes are what one client sends on one
//! connection — request lines, headers, bodies, JSON, several pipelined — served by the
//! real router of [`crate::app::build`] (the default model, a 64-token context) in-process.
//!
//! It returns normally, or panics (which the fuzzer reports) when the server answers a 5xx
//! or a streamed error, leaves the client without an answer for [`PATIENCE`], or sends
//! text that betrays its internals (a panic message, a backtrace) that the input did not
//! hold itself.
use std::sync::OnceLock;
use std::time::Duration;

use axum::Router;
use clap::{CommandFactory, FromArgMatches};
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::app;
use crate::flags::ServerArgs;

/// How long one input may take to be answered in full.
pub const PATIENCE: Duration = Duration::from_secs(60);

/// The flags of the served model: small enough that any generation ends quickly.
pub const FLAGS: &[&str] = &[
    "kvpolicy-server",
    "--cpu",
    "--ctx-size",
    "64",
    "--max-batch",
    "4",
    "--max-queue",
    "8",
    "--max-body",
    "64KiB",
    "--body-timeout",
    "2",
];

/// Texts that only a server's internals would write.
const INTERNALS: &[&str] = &[
    "panicked at",
    "stack backtrace",
    "RUST_BACKTRACE",
    "src/main.rs",
];

struct Harness {
    rt: tokio::runtime::Runtime,
    router: Router,
}

fn harness() -> &'static Harness {
    static H: OnceLock<Harness> = OnceLock::new();
    H.get_or_init(|| {
        let matches = ServerArgs::command().get_matches_from(FLAGS);
        let args = ServerArgs::from_arg_matches(&matches)
            .unwrap_or_else(|e| panic!("the harness's flags: {e}"));
        let reg = kvpolicy::registry();
        let built = app::build(&args, &reg, &matches)
            .unwrap_or_else(|e| panic!("the harness's server: {e:#}"));
        // The engine thread runs for the process's life.
        std::mem::forget(built.thread);
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap_or_else(|e| panic!("a runtime: {e}"));
        Harness {
            rt,
            router: built.router,
        }
    })
}

/// `data` as one connection's bytes; the server's answers checked (see the module).
pub fn http(data: &[u8]) {
    let h = harness();
    let router = h.router.clone();
    let answer = h.rt.block_on(async move {
        let (mut client, server) = tokio::io::duplex(1 << 16);
        tokio::spawn(async move {
            let mut b = http1::Builder::new();
            b.timer(TokioTimer::new())
                .header_read_timeout(Duration::from_secs(2))
                .half_close(true);
            let _ = b
                .serve_connection(TokioIo::new(server), TowerToHyperService::new(router))
                .await;
        });
        let exchange = async {
            // The client writes while the server answers (pipelined requests).
            let (mut rd, mut wr) = tokio::io::split(&mut client);
            let send = async {
                let _ = wr.write_all(data).await;
                let _ = wr.shutdown().await;
            };
            let mut out = Vec::new();
            let read = rd.read_to_end(&mut out);
            let (_, _) = tokio::join!(send, read);
            out
        };
        tokio::time::timeout(PATIENCE, exchange).await
    });
    let Ok(answer) = answer else {
        panic!("no whole answer within {PATIENCE:?}");
    };
    check(data, &answer);
}

/// The server's answers to `data`: no 5xx, no streamed error, no internals.
pub fn check(data: &[u8], answer: &[u8]) {
    let text = String::from_utf8_lossy(answer);
    let input = String::from_utf8_lossy(data);
    for line in text.split("\r\n") {
        if let Some(code) = line.strip_prefix("HTTP/1.1 ") {
            assert!(
                !code.starts_with('5'),
                "the server answered {line}:\n{text}"
            );
        }
    }
    assert!(
        !text.contains("\"server_error\""),
        "a streamed error event:\n{text}"
    );
    for s in INTERNALS {
        assert!(
            !text.contains(s) || input.contains(s),
            "the answer carries `{s}`:\n{text}"
        );
    }
}

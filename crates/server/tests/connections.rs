//! Connections as a resource a hostile client holds (issue "Hardening IV", classes 1–3):
//! silent, slow and idle clients are closed; a flood of connections cannot lock others out;
//! shutdown is bounded however clients behave. The time bounds below only keep a failing
//! test from hanging: each waits many times the server's own timeout.
mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use common::{agent, get, metric, Server};
use serde_json::json;

/// Long enough for any timeout below to have fired several times over.
const PATIENCE: Duration = Duration::from_secs(30);

fn connect(server: &Server) -> Result<TcpStream> {
    let c = TcpStream::connect(server.authority())?;
    c.set_read_timeout(Some(PATIENCE))?;
    Ok(c)
}

/// Everything the server sends until it closes the connection (an error if it keeps it
/// open past [`PATIENCE`]).
fn until_closed(c: &mut TcpStream) -> Result<String> {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match c.read(&mut buf) {
            Ok(0) => return Ok(String::from_utf8_lossy(&got).into_owned()),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            // A reset is a close too.
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {
                return Ok(String::from_utf8_lossy(&got).into_owned())
            }
            Err(e) => {
                return Err(e).with_context(|| {
                    format!(
                        "the connection stayed open; got {:?}",
                        String::from_utf8_lossy(&got)
                    )
                })
            }
        }
    }
}

#[test]
fn silent_slow_and_idle_clients_are_closed() -> Result<()> {
    let server = Server::start(&["--header-timeout", "1", "--body-timeout", "1"])?;
    let host = server.authority().to_string();
    // Nothing sent at all.
    let mut silent = connect(&server)?;
    ensure!(until_closed(&mut silent)?.is_empty());
    // Part of a request head.
    let mut slow_head = connect(&server)?;
    write!(
        slow_head,
        "POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n"
    )?;
    ensure!(until_closed(&mut slow_head)?.is_empty());
    // A whole head, part of its body: a 408.
    let mut slow_body = connect(&server)?;
    write!(
        slow_body,
        "POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"prompt\""
    )?;
    let reply = until_closed(&mut slow_body)?;
    ensure!(reply.starts_with("HTTP/1.1 408"), "{reply}");
    ensure!(reply.contains("--body-timeout"), "{reply}");
    // One request answered, then idle on a kept-alive connection.
    let mut idle = connect(&server)?;
    write!(idle, "GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n")?;
    let reply = until_closed(&mut idle)?;
    ensure!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    // Still serving.
    let (status, _) = get(&agent(), &server.url("/health"))?;
    ensure!(status == 200);
    Ok(())
}

#[test]
fn a_flood_of_idle_connections_cannot_lock_others_out() -> Result<()> {
    let server = Server::start(&[
        "--max-connections",
        "8",
        "--header-timeout",
        "600",
        "--max-batch",
        "8",
    ])?;
    let host = server.authority().to_string();
    // 40 connections that never send a byte, plus 8 with half a head: far past the cap.
    let mut flood: Vec<TcpStream> = (0..40).map(|_| connect(&server)).collect::<Result<_>>()?;
    for _ in 0..8 {
        let mut c = connect(&server)?;
        // The server may already have closed this one to make room for the next newcomer (a
        // flood client's write then fails with a broken pipe): that is the server doing its job.
        let _ = write!(c, "GET /health HTTP/1.1\r\nHost: {host}\r\n");
        flood.push(c);
    }
    // Others are served while the flood stays (the idle ones make room).
    for _ in 0..5 {
        let (status, text) = get(&agent(), &server.url("/health"))?;
        ensure!(status == 200, "{status} {text}");
    }
    // Every newcomer took an idle one's place; past the last evicted ones' final moments
    // (a quarter second to answer a request that raced the eviction), 8 are open.
    common::wait_for_metrics(&server, PATIENCE, "40 evicted, at most 8 open", |m| {
        metric(m, "kvpolicy_http_connections_evicted_total").is_some_and(|n| n >= 40.0)
            && metric(m, "kvpolicy_http_connections").is_some_and(|n| n <= 8.0)
    })?;
    drop(flood);
    // Every place taken by a request in progress: a newcomer is answered 503 and closed.
    let streams: Vec<TcpStream> = (0..8)
        .map(|_| {
            let mut c = connect(&server)?;
            let body = json!({"prompt": "Once upon a time", "max_tokens": 3000, "stream": true})
                .to_string();
            write!(
                c,
                "POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            )?;
            let mut first = [0u8; 64];
            let n = c.read(&mut first)?;
            ensure!(first[..n].starts_with(b"HTTP/1.1 200"));
            Ok(c)
        })
        .collect::<Result<_>>()?;
    let mut late = connect(&server)?;
    // The 503 may be written and the socket closed before this request is: its write may
    // then fail; the reply is what the test reads.
    let _ = write!(late, "GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n");
    let reply = until_closed(&mut late)?;
    ensure!(reply.starts_with("HTTP/1.1 503"), "{reply}");
    ensure!(
        reply.to_ascii_lowercase().contains("retry-after: 1"),
        "{reply}"
    );
    drop(streams);
    Ok(())
}

/// A client that asks for a long stream and never reads it: once its socket is full the
/// server gives up within --send-timeout, closes the connection and cancels the request.
#[test]
fn a_client_that_stops_reading_is_let_go() -> Result<()> {
    use std::os::fd::AsRawFd;
    let server = Server::start(&["--send-timeout", "1", "--max-batch", "16"])?;
    let host = server.authority().to_string();
    let mut c = connect(&server)?;
    // A small receive buffer: the server's writes back up after a few events.
    let small: libc::c_int = 4096;
    // SAFETY: setsockopt on our own socket with a c_int of the size given.
    unsafe {
        libc::setsockopt(
            c.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVBUF,
            (&small as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
    }
    let body = json!({"prompt": "Once upon a time", "max_tokens": 4000, "n": 16,
        "logprobs": 20, "stream": true})
    .to_string();
    write!(
        c,
        "POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )?;
    // Never read: the 16 choices are cancelled once the server gives up on the socket.
    // How soon depends on how fast the model fills the socket buffers (megabytes on
    // loopback): seconds on an idle machine, minutes on a loaded one. The deadline itself
    // is tested exactly in `listen.rs` (paused time).
    common::wait_for_metrics(
        &server,
        PATIENCE * 10,
        "the stalled request cancelled",
        |m| {
            metric(m, "kvpolicy_requests_cancelled_total") == Some(16.0)
                && metric(m, "kvpolicy_requests_running") == Some(0.0)
        },
    )?;
    drop(c);
    Ok(())
}

#[test]
fn shutdown_is_bounded_whatever_clients_hold() -> Result<()> {
    let half_open = |server: &Server| -> Result<Vec<TcpStream>> {
        let host = server.authority();
        let mut head = connect(server)?;
        write!(head, "POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n")?;
        let mut body = connect(server)?;
        write!(
            body,
            "POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{{"
        )?;
        // Requests that reached the server: the engine, and hyper, saw them begin.
        std::thread::sleep(Duration::from_millis(300));
        Ok(vec![head, body, connect(server)?])
    };
    let slow = ["--header-timeout", "600", "--body-timeout", "600"];
    // SIGTERM and SIGHUP: within --shutdown-timeout, exit 0.
    for sig in [libc::SIGTERM, libc::SIGHUP] {
        let mut server = Server::start(&[&slow[..], &["--shutdown-timeout", "1"]].concat())?;
        let _held = half_open(&server)?;
        server.signal(sig)?;
        let status = server.wait_exit(PATIENCE)?;
        ensure!(status.success(), "signal {sig}: {status}");
    }
    // A second signal ends a long graceful wait at once.
    let mut server = Server::start(&[&slow[..], &["--shutdown-timeout", "3600"]].concat())?;
    let _held = half_open(&server)?;
    server.signal(libc::SIGTERM)?;
    std::thread::sleep(Duration::from_millis(300));
    server.signal(libc::SIGINT)?;
    let status = server.wait_exit(PATIENCE)?;
    ensure!(status.success(), "{status}");
    Ok(())
}

//! The server under hostile input, concurrency, disconnects and SIGTERM (issue 31): bad
//! requests get a 4xx in OpenAI's error shape and the server keeps serving; requests
//! batched together under `--batch-invariant` get exactly the tokens each gets alone;
//! clients that go away mid-stream leave no KV behind (`/metrics`); SIGTERM during load
//! exits 0.
mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use common::{agent, completion_text, get, metric, post, wait_for_metrics, Server};
use serde_json::{json, Value};

/// Held by the test running now: each starts servers that would spin against one
/// another's thread pools on a two-core machine (98.7 s for this file in parallel, 25.3 s
/// one test at a time, measured).
fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    ONE.lock().unwrap_or_else(|e| e.into_inner())
}

/// A hostile request and the answer it must get.
struct Case<'a> {
    name: &'a str,
    url: &'a str,
    body: Vec<u8>,
    status: u16,
    /// The field the error must name.
    param: Option<&'a str>,
}

impl<'a> Case<'a> {
    fn new(
        name: &'a str,
        url: &'a str,
        body: Vec<u8>,
        status: u16,
        param: Option<&'a str>,
    ) -> Self {
        Self {
            name,
            url,
            body,
            status,
            param,
        }
    }
}

#[test]
fn bad_requests_get_4xx_and_the_server_keeps_serving() -> Result<()> {
    let _one = one_at_a_time();
    let server = Server::start(&[
        "--max-body",
        "256KiB",
        "--ctx-size",
        "512",
        "--max-prompt-tokens",
        "300",
    ])?;
    let a = agent();
    let completions = server.url("/v1/completions");
    let chat = server.url("/v1/chat/completions");
    let embeddings = server.url("/v1/embeddings");
    let many_stops: Vec<String> = (0..10_000).map(|i| format!("s{i}")).collect();
    let long_prompt: Vec<u32> = vec![42; 600];
    let over_limit: Vec<u32> = vec![42; 350];
    let cases: Vec<Case> = vec![
        Case::new("oversized", &completions, vec![b'a'; 300_000], 413, None),
        Case::new(
            "past --max-prompt-tokens",
            &completions,
            serde_json::to_vec(&json!({"prompt": over_limit}))?,
            413,
            Some("prompt"),
        ),
        Case::new(
            "truncated",
            &completions,
            br#"{"prompt": "The capital"#.to_vec(),
            400,
            Some("body"),
        ),
        Case::new(
            "not UTF-8",
            &completions,
            b"{\"prompt\": \"\xff\xfe\"}".to_vec(),
            400,
            Some("body"),
        ),
        Case::new(
            "not an object",
            &completions,
            b"[1, 2]".to_vec(),
            400,
            Some("body"),
        ),
        Case::new(
            "no prompt",
            &completions,
            br#"{"max_tokens": 3}"#.to_vec(),
            400,
            Some("prompt"),
        ),
        Case::new(
            "wrong type",
            &completions,
            br#"{"prompt": "x", "max_tokens": "three"}"#.to_vec(),
            400,
            Some("max_tokens"),
        ),
        Case::new(
            "negative",
            &completions,
            br#"{"prompt": "x", "max_tokens": -1}"#.to_vec(),
            400,
            Some("max_tokens"),
        ),
        Case::new(
            "zero tokens",
            &completions,
            br#"{"prompt": "x", "max_tokens": 0}"#.to_vec(),
            400,
            Some("max_tokens"),
        ),
        Case::new(
            "hot",
            &completions,
            br#"{"prompt": "x", "temperature": 9}"#.to_vec(),
            400,
            Some("temperature"),
        ),
        Case::new(
            "n = 0",
            &completions,
            br#"{"prompt": "x", "n": 0}"#.to_vec(),
            400,
            Some("n"),
        ),
        Case::new(
            "n = 1000",
            &completions,
            br#"{"prompt": "x", "n": 1000}"#.to_vec(),
            400,
            Some("n"),
        ),
        Case::new(
            "10,000 stops",
            &completions,
            serde_json::to_vec(&json!({"prompt": "x", "stop": many_stops}))?,
            400,
            Some("stop"),
        ),
        Case::new(
            "two prompts",
            &completions,
            br#"{"prompt": ["a", "b"]}"#.to_vec(),
            400,
            Some("prompt"),
        ),
        Case::new(
            "past the vocabulary",
            &completions,
            br#"{"prompt": [1, 99999999]}"#.to_vec(),
            400,
            Some("prompt"),
        ),
        Case::new(
            "past the context",
            &completions,
            serde_json::to_vec(&json!({"prompt": long_prompt}))?,
            400,
            Some("prompt"),
        ),
        Case::new(
            "empty prompt",
            &completions,
            br#"{"prompt": ""}"#.to_vec(),
            400,
            Some("prompt"),
        ),
        Case::new(
            "no messages",
            &chat,
            br#"{"messages": []}"#.to_vec(),
            400,
            Some("messages"),
        ),
        Case::new(
            "bad role",
            &chat,
            br#"{"messages": [{"role": "robot", "content": "x"}]}"#.to_vec(),
            400,
            Some("messages[0].role"),
        ),
        Case::new(
            "image part",
            &chat,
            br#"{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}"#.to_vec(),
            400,
            Some("messages[0].content[0]"),
        ),
        Case::new(
            "content type",
            &chat,
            br#"{"messages": [{"role": "user", "content": 7}]}"#.to_vec(),
            400,
            Some("messages[0].content"),
        ),
        Case::new("unknown route", &embeddings, br#"{}"#.to_vec(), 404, None),
    ];
    for Case {
        name,
        url,
        body,
        status: want,
        param,
    } in &cases
    {
        let (status, text) = post(&a, url, body)?;
        ensure!(status == *want, "{name}: {status} {text}");
        let v: Value = serde_json::from_str(&text).with_context(|| format!("{name}: {text}"))?;
        let err = &v["error"];
        ensure!(
            err["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{name}: {text}"
        );
        if let Some(p) = param {
            ensure!(
                err["param"] == *p,
                "{name}: param {} in {text}",
                err["param"]
            );
        }
    }
    let (status, text) = get(&a, &completions)?;
    ensure!(
        status == 405 && text.contains("takes POST"),
        "{status} {text}"
    );
    // Still serving, and every answer counted.
    let (status, text) = post(
        &a,
        &completions,
        br#"{"prompt": "The capital of France is", "max_tokens": 2}"#,
    )?;
    ensure!(status == 200, "{text}");
    let (_, m) = get(&a, &server.url("/metrics"))?;
    let bad = metric(
        &m,
        r#"kvpolicy_requests_total{route="/v1/completions",status="400"}"#,
    );
    let sent = cases
        .iter()
        .filter(|c| c.url == completions && c.status == 400)
        .count();
    ensure!(bad == Some(sent as f64), "{bad:?} of {sent}\n{m}");
    Ok(())
}

/// Prompts of mixed lengths: pieces of 16 tokens make the longer ones span several steps.
fn prompts() -> Vec<Value> {
    (0..6)
        .map(|i| {
            let n = [3, 9, 20, 33, 47, 70][i];
            json!((0..n)
                .map(|k| 100 + (k * 37 + i * 101) % 4000)
                .collect::<Vec<_>>())
        })
        .collect()
}

/// A greedy answer's tokens and their log-probabilities (floats: equal only when every
/// kernel computed the same numbers).
fn greedy(a: &ureq::Agent, url: &str, prompt: &Value) -> Result<Value> {
    let body = json!({"prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 0});
    let (status, text) = post(a, url, &serde_json::to_vec(&body)?)?;
    ensure!(status == 200, "{text}");
    let v: Value = serde_json::from_str(&text)?;
    let lp = &v["choices"][0]["logprobs"];
    Ok(json!([lp["tokens"], lp["token_logprobs"]]))
}

/// Every prompt twice over, all at once (more requests than slots: some wait, some join
/// mid-run).
fn all_at_once(a: &ureq::Agent, url: &str) -> Result<Vec<Value>> {
    std::thread::scope(|s| {
        let handles: Vec<_> = prompts()
            .into_iter()
            .chain(prompts())
            .map(|p| {
                let (a, url) = (a.clone(), url.to_string());
                s.spawn(move || greedy(&a, &url, &p))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().map_err(|_| anyhow::anyhow!("panicked"))?)
            .collect::<Result<_>>()
    })
}

/// Pieces of 24 prompt tokens next to up to 11 decoding requests: batched steps pack 32
/// rows or more (where a quantized matmul on the CPU takes another kernel), a request alone
/// never does.
const BATCHING: [&str; 4] = ["--max-batch", "12", "--prefill-chunk", "24"];

#[test]
fn batch_invariant_requests_equal_their_solo_runs() -> Result<()> {
    let _one = one_at_a_time();
    let server = Server::start(&[&BATCHING[..], &["--batch-invariant"]].concat())?;
    let url = server.url("/v1/completions");
    let a = agent();
    let alone: Vec<Value> = prompts()
        .iter()
        .map(|p| greedy(&a, &url, p))
        .collect::<Result<_>>()?;
    for (i, got) in all_at_once(&a, &url)?.iter().enumerate() {
        let want = &alone[i % alone.len()];
        ensure!(got == want, "prompt {i}: {got} batched vs {want} alone");
    }
    // Without the flag the same request's numbers change with its batch-mates (so the
    // comparison above can fail). Made certain, not left to arrival timing: 11 requests are
    // decoding before the longest prompt arrives, so each of its 24-token pieces shares a
    // step with 11 decode rows (35 rows: the other kernel).
    let plain = Server::start(&BATCHING)?;
    let mates: Vec<TcpStream> = (0..11)
        .map(|_| start_stream(&plain.base))
        .collect::<Result<_>>()?;
    let longest = prompts().len() - 1;
    let got = greedy(&a, &plain.url("/v1/completions"), &prompts()[longest])?;
    drop(mates);
    ensure!(
        got != alone[longest],
        "without --batch-invariant, prefilled beside 11 decoding requests, the answer equals \
         the one alone: {got}"
    );
    Ok(())
}

/// Starts a streamed request on a raw connection and reads until its first token.
fn start_stream(base: &str) -> Result<TcpStream> {
    let host = base.trim_start_matches("http://");
    let mut conn = TcpStream::connect(host)?;
    conn.set_read_timeout(Some(Duration::from_secs(120)))?;
    let body =
        json!({"prompt": "Once upon a time", "max_tokens": 2000, "stream": true}).to_string();
    write!(
        conn,
        "POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )?;
    let mut seen = Vec::new();
    let mut buf = [0u8; 512];
    while !String::from_utf8_lossy(&seen).contains("data: ") {
        let n = conn.read(&mut buf)?;
        ensure!(n > 0, "the stream ended before its first token");
        seen.extend_from_slice(&buf[..n]);
    }
    Ok(conn)
}

/// `/metrics` once nothing runs or waits.
fn settled(server: &Server) -> Result<String> {
    wait_for_metrics(server, Duration::from_secs(120), "an idle server", |m| {
        metric(m, "kvpolicy_requests_running") == Some(0.0)
            && metric(m, "kvpolicy_requests_queued") == Some(0.0)
    })
}

#[test]
fn clients_that_disconnect_mid_stream_leave_no_kv() -> Result<()> {
    let _one = one_at_a_time();
    let server = Server::start(&["--max-batch", "10"])?;
    let a = agent();
    // 100 clients, each gone after its first token, 10 decoding at a time.
    for round in 0..10 {
        let conns: Vec<TcpStream> = (0..10)
            .map(|_| start_stream(&server.base))
            .collect::<Result<_>>()
            .with_context(|| format!("round {round}"))?;
        drop(conns);
    }
    let m = settled(&server)?;
    for tier in ["device", "host", "disk"] {
        let line = format!(r#"kvpolicy_kv_bytes{{tier="{tier}"}}"#);
        ensure!(metric(&m, &line) == Some(0.0), "{line}:\n{m}");
    }
    ensure!(metric(&m, "kvpolicy_kv_sequences") == Some(0.0), "{m}");
    ensure!(
        metric(&m, "kvpolicy_requests_cancelled_total") == Some(100.0),
        "{m}"
    );
    // And it still answers.
    let (status, text) = post(
        &a,
        &server.url("/v1/completions"),
        br#"{"prompt": "Hi", "max_tokens": 2}"#,
    )?;
    ensure!(status == 200, "{text}");
    Ok(())
}

#[test]
fn sigterm_during_load_exits_cleanly() -> Result<()> {
    let _one = one_at_a_time();
    let mut server = Server::start(&["--shutdown-timeout", "2", "--max-batch", "2"])?;
    let url = server.url("/v1/completions");
    let clients: Vec<_> = (0..4)
        .map(|_| {
            let url = url.clone();
            std::thread::spawn(move || {
                let body = json!({"prompt": "Once upon a time", "max_tokens": 5000}).to_string();
                post(&agent(), &url, body.as_bytes())
            })
        })
        .collect();
    // Two decoding, two waiting.
    wait_for_metrics(
        &server,
        Duration::from_secs(60),
        "2 running, 2 queued",
        |m| {
            metric(m, "kvpolicy_requests_running") == Some(2.0)
                && metric(m, "kvpolicy_requests_queued") == Some(2.0)
        },
    )?;
    let status = server.terminate(Duration::from_secs(30))?;
    ensure!(status.success(), "exit status {status}");
    for c in clients {
        // Cancelled at the deadline: an error answer or a closed connection, never a hang.
        let answer = c.join().map_err(|_| anyhow::anyhow!("client panicked"))?;
        if let Ok((code, text)) = answer {
            ensure!(
                code != 200,
                "a 5000-token request finished within 2 s: {text}"
            );
            ensure!(text.contains("shutting down"), "{code} {text}");
        }
    }
    Ok(())
}

#[test]
fn every_policy_serves_a_batch() -> Result<()> {
    let _one = one_at_a_time();
    let mut reference: Option<String> = None;
    for policy in [
        "full",
        "layer",
        "headwise:group=1",
        "recompute",
        "hybrid",
        "auto",
        "quest:budget=64",
    ] {
        let server = Server::start(&["--policy", policy, "--max-batch", "3"])?;
        let url = server.url("/v1/completions");
        let texts: Vec<String> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..3)
                .map(|_| {
                    let url = url.clone();
                    s.spawn(move || {
                        let body = json!({"prompt": "The capital of France is", "max_tokens": 6});
                        completion_text(&agent(), &url, &body)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().map_err(|_| anyhow::anyhow!("panicked"))?)
                .collect::<Result<_>>()
        })
        .with_context(|| policy.to_string())?;
        let first = texts[0].clone();
        ensure!(texts.iter().all(|t| *t == first), "{policy}: {texts:?}");
        // The lossless policies answer as `full` does.
        if !policy.starts_with("quest") {
            let want = reference.get_or_insert_with(|| first.clone());
            ensure!(first == *want, "{policy}: {first:?} vs full's {want:?}");
        }
    }
    Ok(())
}

#[test]
fn a_full_queue_answers_429_and_sigterm_removes_the_disk_tier() -> Result<()> {
    let _one = one_at_a_time();
    let disk = tempfile::tempdir()?;
    let d = disk.path().to_string_lossy().into_owned();
    let mut server = Server::start(&[
        "--policy",
        "layer",
        "--disk-dir",
        &d,
        "--max-batch",
        "1",
        "--max-queue",
        "1",
        "--shutdown-timeout",
        "1",
    ])?;
    let url = server.url("/v1/completions");
    let long =
        json!({"prompt": "Once upon a time", "max_tokens": 3000, "stream": true}).to_string();
    // One decoding (its stream begun), one waiting.
    let running = start_stream(&server.base)?;
    let waiting = {
        let url = url.clone();
        let body = long.clone();
        std::thread::spawn(move || post(&agent(), &url, body.as_bytes()))
    };
    wait_for_metrics(&server, Duration::from_secs(60), "1 queued", |m| {
        metric(m, "kvpolicy_requests_queued") == Some(1.0)
    })?;
    let mut r = agent()
        .post(&url)
        .header("content-type", "application/json")
        .send(long.as_bytes())?;
    let status = r.status().as_u16();
    let retry = r
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let text = r.body_mut().read_to_string()?;
    ensure!(status == 429, "{status} {text}");
    ensure!(retry.as_deref() == Some("1"), "Retry-After {retry:?}");
    ensure!(text.contains("rate_limit_error"), "{text}");
    // The running request's layers are on the disk tier (in files without names from the
    // start, so no kill leaves one behind) until the server stops.
    let (_, m) = get(&agent(), &server.url("/metrics"))?;
    let on_disk = metric(&m, r#"kvpolicy_kv_bytes{tier="disk"}"#);
    ensure!(
        on_disk.is_some_and(|b| b > 0.0),
        "nothing on the disk tier:\n{m}"
    );
    let status = server.terminate(Duration::from_secs(30))?;
    ensure!(status.success(), "exit status {status}");
    drop(running);
    let _ = waiting.join();
    let left: Vec<_> = std::fs::read_dir(disk.path())?.collect();
    ensure!(left.is_empty(), "disk-tier files left behind: {left:?}");
    Ok(())
}

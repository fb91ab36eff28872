//! A kvpolicy-server on a free loopback port for one test: started with the default model
//! (SmolLM2-135M, fetched on first use), stopped with SIGTERM when dropped.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// A running server.
pub struct Server {
    child: Option<Child>,
    /// `http://127.0.0.1:PORT`.
    pub base: String,
    /// The line the server printed once ready (`listening on …`, with what serves).
    pub banner: String,
}

impl Server {
    /// Starts the server with `args` after `--cpu --port 0`, waiting for its address.
    pub fn start(args: &[&str]) -> Result<Self> {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvpolicy-server"))
            .args(["--cpu", "--port", "0"])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()?;
        let out = child.stdout.take().context("stdout")?;
        let mut line = String::new();
        BufReader::new(out).read_line(&mut line)?;
        let Some(at) = line.find("http://") else {
            let _ = child.kill();
            bail!("the server did not start: {line:?}");
        };
        let base = line[at..]
            .split_whitespace()
            .next()
            .unwrap_or_default()
            .to_string();
        Ok(Self {
            child: Some(child),
            base,
            banner: line.trim().to_string(),
        })
    }

    /// `base` + `path`.
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// Sends SIGTERM and waits up to `within` for the exit.
    pub fn terminate(&mut self, within: Duration) -> Result<ExitStatus> {
        self.signal(libc::SIGTERM)?;
        self.wait_exit(within)
    }

    /// Sends `sig` (the server keeps running, or starts stopping).
    pub fn signal(&self, sig: i32) -> Result<()> {
        let child = self.child.as_ref().context("already stopped")?;
        // SAFETY: kill(2) on our own child's pid.
        unsafe {
            libc::kill(child.id() as i32, sig);
        }
        Ok(())
    }

    /// `host:port`.
    pub fn authority(&self) -> &str {
        self.base.trim_start_matches("http://")
    }

    /// Waits up to `within` for the exit (then kills it and fails).
    pub fn wait_exit(&mut self, within: Duration) -> Result<ExitStatus> {
        let mut child = self.child.take().context("already stopped")?;
        let start = Instant::now();
        loop {
            if let Some(status) = child.try_wait()? {
                return Ok(status);
            }
            if start.elapsed() > within {
                let _ = child.kill();
                bail!("the server did not exit within {within:?} of the signal");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if self.child.is_some() {
            let _ = self.terminate(Duration::from_secs(20));
        }
    }
}

/// An HTTP client that hands back 4xx and 5xx answers instead of failing on them.
pub fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(300)))
        .build()
        .into()
}

/// POSTs `body` to `url`: the status and the body's text.
pub fn post(agent: &ureq::Agent, url: &str, body: &[u8]) -> Result<(u16, String)> {
    let mut r = agent
        .post(url)
        .header("content-type", "application/json")
        .send(body)?;
    let status = r.status().as_u16();
    Ok((status, r.body_mut().read_to_string()?))
}

/// GETs `url`: the status and the body's text.
pub fn get(agent: &ureq::Agent, url: &str) -> Result<(u16, String)> {
    let mut r = agent.get(url).call()?;
    let status = r.status().as_u16();
    Ok((status, r.body_mut().read_to_string()?))
}

/// The value of the metric line starting with `name` (labels included) in `/metrics`.
pub fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// Polls `/metrics` until `ready` holds for its text (returned), for at most `within`.
pub fn wait_for_metrics(
    server: &Server,
    within: Duration,
    what: &str,
    ready: impl Fn(&str) -> bool,
) -> Result<String> {
    let a = agent();
    let start = Instant::now();
    loop {
        let (_, m) = get(&a, &server.url("/metrics"))?;
        if ready(&m) {
            return Ok(m);
        }
        if start.elapsed() > within {
            bail!("{what} not reached within {within:?}:\n{m}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// POSTs the completion request `body` to `url`: the first choice's text (a 200 required).
pub fn completion_text(agent: &ureq::Agent, url: &str, body: &serde_json::Value) -> Result<String> {
    let (status, text) = post(agent, url, &serde_json::to_vec(body)?)?;
    if status != 200 {
        bail!("{status}: {text}");
    }
    let v: serde_json::Value = serde_json::from_str(&text)?;
    Ok(v["choices"][0]["text"]
        .as_str()
        .context("text")?
        .to_string())
}

/// A greedy completion of `prompt` (token ids) at `url`, `max_tokens` long, its special
/// tokens 0–2 (end of text among them) banned so that every answer runs its length: its
/// tokens and log-probabilities, equal between two runs only when every kernel computed the
/// same numbers.
pub fn greedy_logprobs(
    agent: &ureq::Agent,
    url: &str,
    prompt: &serde_json::Value,
    max_tokens: usize,
) -> Result<serde_json::Value> {
    let body = serde_json::json!({"prompt": prompt, "max_tokens": max_tokens,
        "temperature": 0, "logprobs": 0, "logit_bias": {"0": -100, "1": -100, "2": -100}});
    let (status, text) = post(agent, url, &serde_json::to_vec(&body)?)?;
    if status != 200 {
        bail!("{status}: {text}");
    }
    let v: serde_json::Value = serde_json::from_str(&text)?;
    let lp = &v["choices"][0]["logprobs"];
    Ok(serde_json::json!([lp["tokens"], lp["token_logprobs"]]))
}

/// What [`run_sampled`] saw.
pub struct Sampled<T> {
    /// Each job's result, in order.
    pub results: Vec<T>,
    /// `/metrics` texts, one every 20 ms while the jobs ran.
    pub metrics: Vec<String>,
}

/// Runs `jobs` at once, each on a thread of its own, sampling `server`'s `/metrics` every
/// 20 ms until every job is done; the first job that failed fails it.
pub fn run_sampled<T: Send, F: FnOnce() -> Result<T> + Send>(
    server: &Server,
    jobs: impl IntoIterator<Item = F>,
) -> Result<Sampled<T>> {
    let done = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        let sampler = s.spawn(|| -> Result<Vec<String>> {
            let a = agent();
            let mut seen = Vec::new();
            while !done.load(std::sync::atomic::Ordering::SeqCst) {
                seen.push(get(&a, &server.url("/metrics"))?.1);
                std::thread::sleep(Duration::from_millis(20));
            }
            Ok(seen)
        });
        let handles: Vec<_> = jobs.into_iter().map(|job| s.spawn(job)).collect();
        let got = handles
            .into_iter()
            .map(|h| h.join().map_err(|_| anyhow::anyhow!("panicked"))?)
            .collect::<Result<Vec<_>>>();
        done.store(true, std::sync::atomic::Ordering::SeqCst);
        let metrics = sampler.join().map_err(|_| anyhow::anyhow!("panicked"))??;
        Ok(Sampled {
            results: got?,
            metrics,
        })
    })
}

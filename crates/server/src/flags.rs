//! The server's flags (the examples' model and policy flags, and its own) and their bounds:
//! every number is checked at start-up into a one-line error naming the flag, before
//! anything is allocated from it.
use std::net::IpAddr;
use std::time::Duration;

use anyhow::{ensure, Result};
use clap::Parser;
use kvpolicy_cli::args::{heading, parse_budget, ModelArgs, PolicyArgs, PrefixArgs};

use crate::swap::PreemptionMode;

/// Requests decoding together at most (`--max-batch`): past it one engine step's buffers
/// alone would not fit a machine.
pub const MAX_BATCH: usize = 4096;
/// Requests waiting at most (`--max-queue`).
pub const MAX_QUEUE: usize = 1 << 20;
/// Largest `--max-body`.
pub const MAX_BODY: u64 = 1 << 30;
/// Longest of the timeouts, in seconds (a day).
pub const MAX_SECONDS: f64 = 86_400.0;
/// Open files kept for the model, the caches and the engine beyond the connections.
pub const FD_RESERVE: u64 = 128;
/// Most threads parsing and tokenizing requests.
pub const MAX_TOKENIZER_THREADS: usize = 256;

/// The heading of the server's own flags in `--help` (the shared ones keep the examples').
pub const HEADING: &str = "Server";
/// The heading of the prefix cache's flags (the examples' also holds their sessions).
pub const PREFIX_HEADING: &str = "Prefix cache";

/// The server's flags: the examples' model and policy flags, and its own.
#[derive(Parser, Debug)]
#[command(
    name = "kvpolicy-server",
    about = "An OpenAI-compatible server over one model under a KV policy",
    next_line_help = true,
    // The server keeps no sessions: its prefix-cache flags' heading says only that.
    mut_args = |a: clap::Arg| match a.get_help_heading() {
        Some(h) if h == heading::PREFIX => a.help_heading(PREFIX_HEADING),
        _ => a,
    }
)]
pub struct ServerArgs {
    /// The model (the examples' flags).
    #[command(flatten)]
    pub model: ModelArgs,
    /// Seed of --random-weights.
    #[arg(long, value_name = "N", help_heading = heading::MODEL, default_value_t = 299_792_458)]
    pub seed: u64,
    /// The KV policy and its budgets (the examples' flags).
    #[command(flatten)]
    pub kv: PolicyArgs,
    /// The prefix cache (the examples' flags).
    #[command(flatten)]
    pub prefix: PrefixArgs,
    /// Address to listen on; one other than loopback without --api-key is warned about.
    #[arg(long, value_name = "IP", help_heading = HEADING, default_value = "127.0.0.1")]
    pub host: IpAddr,
    /// Port to listen on (0: a free one; the address is printed at start-up).
    #[arg(long, help_heading = HEADING, default_value_t = 8080)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on the /v1/ routes (401 without it; not empty).
    /// Default: no key asked for.
    #[arg(long, value_name = "KEY", help_heading = HEADING)]
    pub api_key: Option<String>,
    /// Host names the `Host` header may carry besides IP addresses and `localhost` (any
    /// port), comma-separated; `*` takes any. Name the server's DNS names here: a
    /// DNS-rebinding page sends its own, which is refused. Default: IP addresses and
    /// `localhost` only.
    #[arg(long, value_name = "NAMES", help_heading = HEADING, value_delimiter = ',')]
    pub allowed_hosts: Option<Vec<String>>,
    /// The model's name in responses and /v1/models. Default: the model's source.
    #[arg(long, value_name = "NAME", help_heading = HEADING)]
    pub served_model_name: Option<String>,
    /// Requests decoding together at most (the ragged batch's size; 1 to 4096).
    #[arg(long, value_name = "N", help_heading = HEADING, default_value_t = 8)]
    pub max_batch: usize,
    /// Requests waiting for a slot at most; past it a request gets 429 with Retry-After.
    #[arg(long, value_name = "N", help_heading = HEADING, default_value_t = 64)]
    pub max_queue: usize,
    /// Prompt tokens per engine step, shared by the requests being prefilled, so the
    /// running ones keep decoding between a newcomer's pieces (at most the context).
    #[arg(long, value_name = "N", help_heading = HEADING, default_value_t = 256)]
    pub prefill_chunk: usize,
    /// Prompt plus generated tokens per request at most. Default: the model's positions.
    #[arg(long, value_name = "N", help_heading = HEADING)]
    pub ctx_size: Option<usize>,
    /// Prompt tokens per request at most, below the context (413 past it). Default: no
    /// limit but the context, past which a prompt is a 400.
    #[arg(long, value_name = "N", help_heading = HEADING)]
    pub max_prompt_tokens: Option<usize>,
    /// Largest request body in bytes, e.g. 4MiB (units as --device-kv-budget; 413 past it;
    /// at most 1GiB).
    #[arg(long, value_name = "BYTES", help_heading = HEADING, default_value = "4MiB", value_parser = parse_budget)]
    pub max_body: u64,
    /// Requests parsed and tokenized at once, on threads of their own (the rest wait).
    #[arg(long, value_name = "N", help_heading = HEADING, default_value_t = 2)]
    pub tokenizer_threads: usize,
    /// Let /v1/completions' prompt text spell the tokenizer's control tokens
    /// (`<|im_start|>`), matched as those tokens (llama.cpp's `parse_special`). Default:
    /// such text is tokenized as text; chat messages' text always is.
    #[arg(long, help_heading = HEADING)]
    pub parse_special: bool,
    /// Make a request's tokens independent of what it is batched with: prompt pieces run
    /// in passes of their own, decode tokens in passes that take the kernel one token takes
    /// alone (slower with many requests; greedy output equals the request run alone).
    #[arg(long, help_heading = HEADING)]
    pub batch_invariant: bool,
    /// How a request preempted for memory gets its cache back: `swap` writes its K/V to a
    /// directory of the server's own under --disk-dir and reads them back when it resumes
    /// (needs --disk-dir); `recompute` drops them and computes them again from its tokens.
    /// Default: recompute (swap is faster under `full`, but under the streaming policies a
    /// resumed request can take the device past its budget: see docs/serving.md).
    #[arg(long, value_name = "swap|recompute", help_heading = HEADING, hide_possible_values = true)]
    pub preemption_mode: Option<PreemptionMode>,
    /// Connections open at most; past it a new connection is answered 503 and closed (with
    /// 128 open files kept for the server, within `ulimit -n`).
    #[arg(long, value_name = "N", help_heading = HEADING, default_value_t = 512)]
    pub max_connections: usize,
    /// Seconds a connection may take to send a request's headers, and may stay idle
    /// between requests, before it is closed.
    #[arg(long, value_name = "SECONDS", help_heading = HEADING, default_value_t = 10.0)]
    pub header_timeout: f64,
    /// Seconds a request may take to send its body (408 past it).
    #[arg(long, value_name = "SECONDS", help_heading = HEADING, default_value_t = 30.0)]
    pub body_timeout: f64,
    /// Seconds an answer may wait for the client to read it (its socket full) before the
    /// connection is closed and the request cancelled.
    #[arg(long, value_name = "SECONDS", help_heading = HEADING, default_value_t = 30.0)]
    pub send_timeout: f64,
    /// Seconds the whole shutdown may take after SIGTERM, SIGHUP or Ctrl-C: in-flight
    /// requests finish within it, then the rest are cancelled (a second signal exits at
    /// once).
    #[arg(long, value_name = "SECONDS", help_heading = HEADING, default_value_t = 10.0)]
    pub shutdown_timeout: f64,
}

/// A number of seconds from `flag`, within [0, [`MAX_SECONDS`]].
pub fn seconds(flag: &str, s: f64, zero_ok: bool) -> Result<Duration> {
    ensure!(
        s.is_finite() && (s > 0.0 || (zero_ok && s == 0.0)) && s <= MAX_SECONDS,
        "{flag} {s}: give a number of seconds {} 0 and at most {MAX_SECONDS}",
        if zero_ok { "≥" } else { ">" }
    );
    Ok(Duration::from_secs_f64(s))
}

impl ServerArgs {
    /// The bounds that need nothing but the flags.
    pub fn check(&self) -> Result<()> {
        for (n, flag, most) in [
            (self.max_batch, "--max-batch", MAX_BATCH),
            (self.prefill_chunk, "--prefill-chunk", usize::MAX),
            (self.max_connections, "--max-connections", usize::MAX),
            (
                self.tokenizer_threads,
                "--tokenizer-threads",
                MAX_TOKENIZER_THREADS,
            ),
        ] {
            ensure!(n > 0, "{flag} 0: give at least 1");
            ensure!(n <= most, "{flag} {n}: give at most {most}");
        }
        ensure!(
            self.max_queue <= MAX_QUEUE,
            "--max-queue {}: give at most {MAX_QUEUE}",
            self.max_queue
        );
        ensure!(
            self.max_body > 0 && self.max_body <= MAX_BODY,
            "--max-body {}: give 1 byte to 1GiB",
            self.max_body
        );
        seconds("--shutdown-timeout", self.shutdown_timeout, true)?;
        seconds("--header-timeout", self.header_timeout, false)?;
        seconds("--body-timeout", self.body_timeout, false)?;
        seconds("--send-timeout", self.send_timeout, false)?;
        if let Some(key) = &self.api_key {
            ensure!(
                !key.trim().is_empty(),
                "--api-key is empty: give a key clients will send (or leave the flag out)"
            );
            ensure!(
                key.bytes().all(|b| b.is_ascii_graphic()),
                "--api-key holds spaces or characters an HTTP header cannot carry: give printable ASCII"
            );
        }
        if let Some(hosts) = &self.allowed_hosts {
            ensure!(
                hosts.iter().all(|h| !h.trim().is_empty()),
                "--allowed-hosts has an empty name: give names separated by commas, or `*`"
            );
            if let Some(h) = hosts.iter().find(|h| h.contains([':', '/', ' '])) {
                anyhow::bail!(
                    "--allowed-hosts {h}: give host names alone (any port is taken), without a port, scheme or path"
                );
            }
        }
        if let Some(n) = self.max_prompt_tokens {
            ensure!(n > 0, "--max-prompt-tokens 0: give at least 1");
        }
        Ok(())
    }

    /// The bounds that need the model's context (`context` tokens).
    pub fn check_against(&self, context: usize) -> Result<()> {
        if let Some(n) = self.max_prompt_tokens {
            ensure!(
                n < context,
                "--max-prompt-tokens {n}: the context is {context} tokens; give fewer (room is left for the answer)"
            );
        }
        Ok(())
    }
}

//! The engine: one thread that owns the model and the policy and serves every request by
//! continuous batching — requests join and leave the running ragged batch at step
//! boundaries (Orca, OSDI '22, §3.1 "iteration-level scheduling") — with chunked prefill,
//! so a newcomer's prompt does not stall the requests already decoding (Sarathi-Serve,
//! OSDI '24, §4; vLLM's chunked prefill).
//!
//! **The scheduling rule**, every step: (1) waiting requests are admitted, oldest first,
//! while fewer than `max_batch` run; (2) every running request past its prompt decodes one
//! token; (3) the prompts still being prefilled, oldest first, fill a budget of
//! `prefill_chunk` prompt tokens (the oldest always gets at least one); (4) one ragged
//! forward pass runs all of it (`batch_step`, [`crate::passes`]: each request attends only its own cache);
//! (5) a request that finished, or whose client went away, leaves and its cache is freed
//! ([`Batched::release`](kvpolicy::core::Batched::release)) before the next step.
//! With a device budget, (1) also waits for memory and a step may first preempt the newest
//! requests ([`crate::memory`]); a preempted request waits ahead of the queue and, admitted
//! again, gets its cache back by one of vLLM's two modes (`--preemption-mode`): *swap*
//! reads back the K/V written to the disk tier when it was preempted ([`crate::swap`]) and
//! goes on where it stopped; *recompute* computes them again: its prompt in the same pieces
//! as before, then its generated tokens one decode pass each (the passes they first ran in,
//! so `--batch-invariant` gives exactly its tokens), without sampling them again.
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Instant;

use candle_core::Tensor;
use kvpolicy::models::{CausalLm, SeqChunk};
use kvpolicy::models::{Release, TextStream, TextTokenizer};
use kvpolicy::KvPolicy;

use crate::error::internal_message;
use crate::events::{logprobs, Event, Finish, Job};
use crate::memory::Governor;
use crate::metrics::Metrics;
use crate::passes::{forward, Passes};

mod admission;
mod prefix;
mod publish;
mod swapping;
use crate::reuse::Reuse;
use crate::sampler::Chooser;
use crate::swap::{SwapSpace, Swapped};

/// The engine's limits.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Requests decoding together at most.
    pub max_batch: usize,
    /// Requests waiting at most (more are refused: 429).
    pub max_queue: usize,
    /// Prompt tokens per step, and per piece of a prompt.
    pub prefill_chunk: usize,
    /// Kernels chosen per request, not per packed batch (see [`crate::passes::forward`]).
    pub batch_invariant: bool,
}

/// The memory rules ([`crate::memory`]) and where preempted requests' K/V go.
pub struct MemoryRules {
    /// Admission and preemption by memory (`None`: by slots only).
    pub governor: Option<Governor>,
    /// Preemption by swapping to the disk tier (`None`: by recomputation).
    pub swap: Option<SwapSpace>,
}

/// What the server keeps of the engine.
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Job>,
    waiting: Arc<AtomicUsize>,
    /// Free slots as of the last step.
    free: Arc<AtomicUsize>,
    /// Whether the engine thread still runs.
    alive: Arc<AtomicBool>,
    cancel: Arc<AtomicBool>,
    max_queue: usize,
}

/// Why a request was not queued.
#[derive(Debug)]
pub enum Refused {
    /// The queue is full.
    Full,
    /// The engine has stopped.
    Stopped,
}

impl EngineHandle {
    /// Queues a request's choices, all or none: refused when `max_queue` requests would
    /// then wait beyond the free slots.
    pub fn submit(&self, jobs: Vec<Job>) -> Result<(), Refused> {
        // Free slots take requests at the next step boundary: they do not count as queue.
        let room = self.max_queue + self.free.load(Ordering::SeqCst);
        let n = jobs.len();
        if self.waiting.fetch_add(n, Ordering::SeqCst) + n > room {
            self.waiting.fetch_sub(n, Ordering::SeqCst);
            return Err(Refused::Full);
        }
        for (i, job) in jobs.into_iter().enumerate() {
            if self.tx.send(job).is_err() {
                self.waiting.fetch_sub(n - i, Ordering::SeqCst);
                return Err(Refused::Stopped);
            }
        }
        Ok(())
    }

    /// Whether the engine thread still runs (`/health`).
    pub fn alive(&self) -> bool {
        self.alive.load(Ordering::SeqCst)
    }

    /// Ends every request now (each hears `Failed`) and stops the engine once the server
    /// holds no handle any more.
    pub fn cancel_all(&self) {
        self.cancel.store(true, Ordering::SeqCst);
    }
}

/// A running request.
struct Active {
    job: Job,
    pos: usize,
    /// Prompt tokens restored from the prefix cache.
    restored: usize,
    /// The prompt's K/V this request computed, stored in the cache when it finishes.
    computed: Option<kvpolicy::prefix::ChunkKv>,
    /// Whether its slot holds prefix chunks by reference (its prompt's chunks are stored
    /// and shared as soon as its prompt is in).
    sharing: bool,
    /// Its K/V on the disk tier while it is preempted by swapping ([`crate::swap`]).
    swapped: Option<Swapped>,
    generated: Vec<u32>,
    chooser: Chooser,
    detok: TextStream,
    last_token_at: Option<Instant>,
    /// When it was (last) admitted (the engine's admission count).
    admitted: u64,
}

impl Active {
    /// The most tokens its cache will hold: its prompt and the most it may generate.
    fn planned(&self) -> usize {
        self.job.prompt.len() + self.job.max_tokens
    }
}

/// The thread's state.
struct Engine {
    model: Arc<dyn CausalLm>,
    tok: Arc<TextTokenizer>,
    policy: Box<dyn KvPolicy>,
    cfg: EngineConfig,
    rx: mpsc::Receiver<Job>,
    waiting: VecDeque<Job>,
    queued: Arc<AtomicUsize>,
    cancel: Arc<AtomicBool>,
    slots: Vec<Option<Active>>,
    free: Arc<AtomicUsize>,
    alive: Arc<AtomicBool>,
    metrics: Arc<Metrics>,
    /// The prefix cache, when one is served.
    reuse: Option<Reuse>,
    /// Admission and preemption by memory.
    memory: Option<Governor>,
    /// Where preempted requests' K/V go, when they are swapped.
    swap: Option<SwapSpace>,
    /// Preempted requests, to be admitted again before any waiting one (oldest first).
    preempted: VecDeque<Active>,
    /// Admissions so far.
    admissions: u64,
    /// A request was preempted and none has left since: preempted ones wait.
    hold_resumes: bool,
}

/// Starts the engine on its own thread; `policy` must take ragged batches (built with
/// `build_batched_spec`) and be prepared for `cfg.max_batch` sequences.
pub fn start(
    model: Arc<dyn CausalLm>,
    tok: Arc<TextTokenizer>,
    policy: Box<dyn KvPolicy>,
    cfg: EngineConfig,
    metrics: Arc<Metrics>,
    reuse: Option<Reuse>,
    memory: MemoryRules,
) -> std::io::Result<(EngineHandle, std::thread::JoinHandle<()>)> {
    let (tx, rx) = mpsc::channel();
    let waiting = Arc::new(AtomicUsize::new(0));
    let cancel = Arc::new(AtomicBool::new(false));
    let free = Arc::new(AtomicUsize::new(cfg.max_batch));
    let alive = Arc::new(AtomicBool::new(true));
    let handle = EngineHandle {
        tx,
        free: free.clone(),
        alive: alive.clone(),
        waiting: waiting.clone(),
        cancel: cancel.clone(),
        max_queue: cfg.max_queue,
    };
    let engine = Engine {
        model,
        tok,
        policy,
        slots: (0..cfg.max_batch).map(|_| None).collect(),
        free,
        alive,
        cfg,
        rx,
        waiting: VecDeque::new(),
        queued: waiting,
        cancel,
        metrics,
        reuse,
        memory: memory.governor,
        swap: memory.swap,
        preempted: VecDeque::new(),
        admissions: 0,
        hold_resumes: false,
    };
    let thread = std::thread::Builder::new()
        .name("kvpolicy-engine".into())
        .spawn(move || engine.run())?;
    Ok((handle, thread))
}

impl Engine {
    fn run(mut self) {
        // Down however the thread ends (a panic included): `/health` then says so.
        struct Down(Arc<AtomicBool>);
        impl Drop for Down {
            fn drop(&mut self) {
                self.0.store(false, Ordering::SeqCst);
            }
        }
        let _down = Down(self.alive.clone());
        // The pools' budgets and usage in /metrics from the start.
        self.publish();
        loop {
            let idle = self.waiting.is_empty()
                && self.preempted.is_empty()
                && self.slots.iter().all(Option::is_none);
            if idle {
                match self.rx.recv() {
                    Ok(job) => self.waiting.push_back(job),
                    Err(_) => return,
                }
            }
            while let Ok(job) = self.rx.try_recv() {
                self.waiting.push_back(job);
            }
            if self.cancel.load(Ordering::SeqCst) {
                self.cancel_everything();
                continue;
            }
            self.drop_waiting_departed();
            self.admit();
            self.drop_departed();
            self.step();
            self.publish();
        }
    }

    fn cancel_everything(&mut self) {
        for job in self.waiting.drain(..) {
            self.queued.fetch_sub(1, Ordering::SeqCst);
            job.events.send(Event::ShuttingDown);
        }
        for a in self.preempted.drain(..) {
            a.job.events.send(Event::ShuttingDown);
        }
        for seq in 0..self.slots.len() {
            if let Some(a) = self.slots[seq].take() {
                a.job.events.send(Event::ShuttingDown);
                self.release(seq);
            }
        }
        self.publish();
    }

    fn release(&mut self, seq: usize) {
        // Room came back: preempted requests may be admitted again.
        self.hold_resumes = false;
        if let Some(b) = self.policy.as_batched() {
            b.release(seq);
        }
        if let Some(r) = self.reuse.as_mut() {
            r.forget(seq);
        }
    }

    /// This step's pieces: every decoding request's last token, then prompt pieces within
    /// the budget.
    fn chunks(&self) -> Vec<SeqChunk> {
        let mut chunks = Vec::new();
        for (seq, a) in self.slots.iter().enumerate() {
            if let Some(a) = a {
                if a.pos >= a.job.prompt.len() {
                    // The newest token, or one being replayed after a preemption.
                    if let Some(&token) = a.generated.get(a.pos - a.job.prompt.len()) {
                        chunks.push(SeqChunk {
                            seq,
                            pos: a.pos,
                            ids: vec![token],
                        });
                    }
                }
            }
        }
        // Whole pieces only (a request's pieces are the same whatever else runs), the
        // oldest first, while the budget lasts; the oldest always gets one.
        let chunk = self.cfg.prefill_chunk.max(1);
        let mut budget = chunk;
        let mut prefilling: Vec<(usize, &Active)> = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(seq, a)| a.as_ref().map(|a| (seq, a)))
            .filter(|(_, a)| a.pos < a.job.prompt.len())
            .collect();
        prefilling.sort_by_key(|(_, a)| a.job.received);
        for (i, (seq, a)) in prefilling.into_iter().enumerate() {
            let n = chunk.min(a.job.prompt.len() - a.pos);
            if i > 0 && n > budget {
                break;
            }
            chunks.push(SeqChunk {
                seq,
                pos: a.pos,
                ids: a.job.prompt[a.pos..a.pos + n].to_vec(),
            });
            budget = budget.saturating_sub(n);
        }
        chunks
    }

    fn step(&mut self) {
        // After a preemption the step is planned again: the others may take its pieces.
        let mut chunks = self.chunks();
        while self.make_room(&mut chunks) {
            chunks = self.chunks();
        }
        if chunks.is_empty() {
            return;
        }
        let started = Instant::now();
        let result = self.forward(&chunks);
        let prompt_tokens: usize = chunks
            .iter()
            .filter(|c| {
                self.slots[c.seq]
                    .as_ref()
                    .is_some_and(|a| c.pos < a.job.prompt.len())
            })
            .map(|c| c.ids.len())
            .sum();
        self.metrics.prompt_tokens.inc_by(prompt_tokens as u64);
        self.metrics
            .step_seconds
            .observe(started.elapsed().as_secs_f64());
        match result {
            Ok((order, logits)) => {
                for (chunk, rows) in order.iter().zip(logits) {
                    if let Err(e) = self.advance(chunk, &rows) {
                        self.fail(chunk.seq, format!("{e:#}"));
                    }
                }
            }
            Err(e) => {
                // The step's requests cannot go on: their caches hold a partial step.
                for c in &chunks {
                    self.fail(c.seq, format!("{e}"));
                }
            }
        }
    }

    /// The step's forward passes (see [`forward`]), recording prompt K/V for the cache.
    fn forward(&mut self, chunks: &[SeqChunk]) -> kvpolicy::models::Result<Passes> {
        let decode: Vec<bool> = chunks
            .iter()
            .map(|c| {
                self.slots[c.seq]
                    .as_ref()
                    .is_some_and(|a| c.pos >= a.job.prompt.len())
            })
            .collect();
        let model = self.model.as_ref();
        let invariant = self.cfg.batch_invariant;
        match self.reuse.as_mut() {
            Some(r) => r.recording(self.policy.as_mut(), |p| {
                forward(model, p, chunks, &decode, invariant)
            }),
            None => forward(model, self.policy.as_mut(), chunks, &decode, invariant),
        }
    }

    /// Ends slot `seq`'s request: `detail` goes to the log, the client hears an id.
    fn fail(&mut self, seq: usize, detail: String) {
        if let Some(a) = self.slots[seq].take() {
            a.job.events.send(Event::Failed(internal_message(&detail)));
            self.release(seq);
            self.metrics.failed.inc();
        }
    }

    /// One request's share of the step: past its prompt, sample and send a token; finish.
    fn advance(&mut self, chunk: &SeqChunk, rows: &Tensor) -> anyhow::Result<()> {
        let Some(a) = self.slots[chunk.seq].as_mut() else {
            return Ok(());
        };
        let prompt = a.job.prompt.len();
        a.pos += chunk.ids.len();
        if a.pos < prompt {
            return Ok(());
        }
        if a.pos - chunk.ids.len() < prompt && a.computed.is_none() {
            self.prompt_in(chunk.seq)?;
        }
        let Some(a) = self.slots[chunk.seq].as_mut() else {
            return Ok(());
        };
        if a.pos < prompt + a.generated.len() {
            // Replaying what it generated before a preemption: already sampled and sent.
            return Ok(());
        }
        let row = rows.get(rows.dim(0)? - 1)?;
        let tok = a.chooser.choose(&row)?;
        let now = Instant::now();
        match a.last_token_at {
            None => self
                .metrics
                .time_to_first_token
                .observe(now.duration_since(a.job.received).as_secs_f64()),
            Some(t) => self
                .metrics
                .time_per_token
                .observe(now.duration_since(t).as_secs_f64()),
        }
        a.last_token_at = Some(now);
        a.generated.push(tok);
        self.metrics.completion_tokens.inc();
        let finish = if self.model.info().eos.contains(&tok) {
            // What the detokenizer held back (a partial stop sequence, half a character).
            Some((Finish::Stop, a.detok.finish(&self.tok)?.into_text()))
        } else {
            let logprob = match a.job.params.logprobs {
                Some(top) => Some(logprobs(&self.tok, &row, tok, top)?),
                None => None,
            };
            match a.detok.push(&self.tok, tok)? {
                Release::Stopped(text) => {
                    a.job.events.send(Event::Token { text, logprob });
                    Some((Finish::Stop, String::new()))
                }
                Release::Text(text) => {
                    a.job.events.send(Event::Token { text, logprob });
                    (a.generated.len() >= a.job.max_tokens)
                        .then(|| {
                            a.detok.finish(&self.tok).map(|r| match r {
                                // A stop sequence in what was held back ends it first.
                                Release::Stopped(t) => (Finish::Stop, t),
                                Release::Text(t) => (Finish::Length, t),
                            })
                        })
                        .transpose()?
                }
            }
        };
        if let Some((finish, text)) = finish {
            let a = self.slots[chunk.seq].take();
            self.release(chunk.seq);
            self.metrics.finished.inc();
            if let Some(a) = a {
                a.job.events.send(Event::Done {
                    finish,
                    text,
                    prompt_tokens: a.job.prompt.len(),
                    completion_tokens: a.generated.len(),
                });
                self.store_finished(&a);
            }
        }
        Ok(())
    }
}

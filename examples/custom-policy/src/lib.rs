//! A KV policy written outside kvpolicy, on its public API only: StreamingLLM's attention
//! sinks + recent window (Xiao et al., "Efficient Streaming Language Models with Attention
//! Sinks", ICLR 2024, §3.2). **Approximate**: every query attends to the first `sinks`
//! tokens and the last `window` tokens up to itself, nothing in between — logits differ
//! from `full` once a sequence is longer than `sinks + window`, and the cache stays bounded
//! by `sinks + window + one chunk` tokens per layer however long it runs.
//!
//! How a policy plugs in: implement [`KvPolicy`] — `attend` receives each layer's queries
//! and new K/V ([`AttnStep`]) and returns the attention output; `seq_len`, `reset` and
//! `stats` report and clear what it keeps — declare its settings as a typed struct
//! ([`SinksSettings`]: serde + schemars, `///` docs, defaults), report what only it counts
//! as [`PolicyMetric`]s (`evicted_tokens`), then [`register`] it next to the built-in
//! policies in a [`PolicyRegistry`] and build it by spec like any other (the workspace's
//! runner and kvbench do: `--policy sinks:window=256`, `--policies full,sinks:sinks=4`). A model of one's
//! own calls `policy.attend(&AttnStep { .. })` from its attention layer the same way
//! kvpolicy's models do (see `kvpolicy::models::arch::attention`).
//!
//! Unlike the paper this keeps the cached keys' original positions (no re-rotation inside
//! the cache), which is what a window over an unmodified RoPE model means.
#![deny(missing_docs)]
use candle_core::Tensor;
use kvpolicy::core::{KvBuffer, PolicyMetric};
use kvpolicy::{
    attend_partial, merge_partials, AttnInputs, AttnStep, Knob, KvError, KvPolicy, KvStats,
    PolicyOption, PolicyOptions, PolicyRegistry,
};

/// Sinks kept when the settings do not say (StreamingLLM's 4).
pub const DEFAULT_SINKS: usize = 4;
/// Recent tokens kept when the settings do not say.
pub const DEFAULT_WINDOW: usize = 1020;

/// `sinks`' settings.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, serde::Deserialize, serde::Serialize, schemars::JsonSchema,
)]
#[serde(default, deny_unknown_fields)]
pub struct SinksSettings {
    /// First tokens of the sequence every query attends to (the attention sinks).
    pub sinks: usize,
    /// Recent tokens every query attends to, itself included (at least 1).
    pub window: usize,
}

impl Default for SinksSettings {
    fn default() -> Self {
        Self {
            sinks: DEFAULT_SINKS,
            window: DEFAULT_WINDOW,
        }
    }
}

/// Attention sinks + recent window (see the crate docs). Approximate.
#[derive(Debug)]
pub struct SinkWindow {
    sinks: usize,
    window: usize,
    /// Per layer: the first `sinks` tokens' K/V.
    head: Vec<KvBuffer>,
    /// Per layer: the most recent tokens' K/V (at least `window + chunk − 1` of them), and
    /// the position of its first token.
    tail: Vec<(KvBuffer, usize)>,
    len: usize,
    /// Tokens per layer dropped from the cache so far (layer 0's count).
    evicted: usize,
    stats: KvStats,
}

impl SinkWindow {
    /// Keeps `sinks` first tokens and a window of `window` recent ones.
    pub fn new(sinks: usize, window: usize) -> Self {
        Self {
            sinks,
            window: window.max(1),
            head: Vec::new(),
            tail: Vec::new(),
            len: 0,
            evicted: 0,
            stats: KvStats::default(),
        }
    }

    fn bytes(&self) -> u64 {
        let b = |buf: &KvBuffer| buf.allocated_bytes();
        self.head.iter().map(b).sum::<u64>() + self.tail.iter().map(|(t, _)| b(t)).sum::<u64>()
    }
}

impl KvPolicy for SinkWindow {
    fn name(&self) -> &str {
        "sinks"
    }

    fn attend(&mut self, step: &AttnStep<'_>) -> kvpolicy::core::Result<Tensor> {
        let (layer, pos, t) = (step.layer, step.pos, step.k.dim(2)?);
        while self.head.len() <= layer {
            self.head.push(KvBuffer::new(self.sinks.max(1)));
            self.tail.push((KvBuffer::new(256), self.sinks));
        }
        // New tokens below `sinks` go to the head, the rest to the tail.
        let to_head = self.sinks.saturating_sub(pos).min(t);
        if to_head > 0 {
            self.head[layer].append(
                &step.k.narrow(2, 0, to_head)?,
                &step.v.narrow(2, 0, to_head)?,
            )?;
        }
        if to_head < t {
            let n = t - to_head;
            let (tail, _) = &mut self.tail[layer];
            tail.append(
                &step.k.narrow(2, to_head, n)?,
                &step.v.narrow(2, to_head, n)?,
            )?;
        }
        let mut parts = Vec::with_capacity(2);
        if !self.head[layer].is_empty() {
            let (k, v) = self.head[layer].view(0, self.head[layer].len())?;
            parts.push(attend_partial(
                AttnInputs {
                    q: step.q,
                    k: &k,
                    v: &v,
                    q_pos: pos,
                    k_pos: 0,
                },
                step.spec,
            )?);
        }
        let (tail, first) = &mut self.tail[layer];
        if !tail.is_empty() {
            // Recent keys only within `window` of each query (and the model's own window).
            let mut spec = step.spec.clone();
            spec.sliding_window = Some(
                spec.sliding_window
                    .map_or(self.window, |w| w.min(self.window)),
            );
            let (k, v) = tail.view(0, tail.len())?;
            parts.push(attend_partial(
                AttnInputs {
                    q: step.q,
                    k: &k,
                    v: &v,
                    q_pos: pos,
                    k_pos: *first,
                },
                &spec,
            )?);
            // Evict what no later query can see: keep `window` tokens (a chunk's earliest
            // query needs them); rebuilt when twice that has piled up.
            if tail.len() > 2 * self.window + t {
                let keep = self.window;
                let (k, v) = tail.view(tail.len() - keep, keep)?;
                let (k, v) = (k.contiguous()?, v.contiguous()?);
                let mut fresh = KvBuffer::new(256);
                fresh.append(&k, &v)?;
                let dropped = tail.len() - keep;
                *first += dropped;
                if layer == 0 {
                    self.evicted += dropped;
                }
                *tail = fresh;
            }
        }
        let out = merge_partials(&parts)?;
        if layer == 0 {
            self.len = pos + t;
        }
        let bytes = self.bytes();
        self.stats.device_kv_bytes = bytes;
        self.stats.device_kv_peak_bytes = self.stats.device_kv_peak_bytes.max(bytes);
        Ok(out.out.to_dtype(step.q.dtype())?)
    }

    fn seq_len(&self) -> usize {
        self.len
    }

    fn reset(&mut self) {
        *self = Self::new(self.sinks, self.window);
    }

    fn stats(&self) -> KvStats {
        let mut stats = KvStats {
            kv_tokens: self.len as u64,
            // Approximate by design: once a sequence outgrows sinks + window the logits
            // differ from `full`'s.
            lossy: true,
            ..self.stats.clone()
        };
        stats.set_metric(PolicyMetric::counter(
            "evicted_tokens",
            self.evicted as f64,
            "tokens",
        ));
        stats
    }
}

/// Registers `sinks` (by default 4 sinks + a 1,020-token window) in `reg`.
pub fn register(reg: &mut PolicyRegistry) {
    reg.register(
        "sinks",
        "APPROXIMATE: StreamingLLM attention sinks + recent window (sinks + window tokens per layer); logits differ from full once a sequence is longer",
        &[] as &[PolicyOption],
        |_o: &PolicyOptions, s: SinksSettings| {
            if s.window == 0 {
                return Err(KvError::InvalidOption {
                    policy: "sinks".into(),
                    option: Knob::Setting("window"),
                    message: "0: every query attends at least to itself; give 1 or more"
                        .into(),
                });
            }
            Ok(Box::new(SinkWindow::new(s.sinks, s.window)))
        },
    );
}

/// kvpolicy's registry with `sinks` added.
pub fn registry() -> PolicyRegistry {
    let mut reg = kvpolicy::registry();
    register(&mut reg);
    reg
}

//! `GET /metrics`: the server's counters in Prometheus' text format (through
//! `prometheus-client`): requests by route and status, tokens in and out, time to first
//! token and per-token latency, running and queued requests, and the KV the policy holds
//! per tier right now (all zero once every request is done or gone).
use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// A request's route and answer.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    /// The route (`/v1/completions`, …; `other` for unknown ones).
    pub route: String,
    /// The HTTP status answered.
    pub status: String,
}

/// A KV tier.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TierLabels {
    /// `device`, `host` or `disk` (the KV); `ram` or `disk` (the prefix cache).
    pub tier: String,
}

/// How a request was preempted.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModeLabels {
    /// `recompute` (its cache dropped, recomputed from its tokens when it resumes).
    pub mode: String,
}

/// Why chunk files could not be written.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    /// `dir_missing`, `no_space`, `denied` or `other`.
    pub kind: String,
}

/// Every metric the server exports.
pub struct Metrics {
    registry: Registry,
    /// Requests answered, by route and status.
    pub requests: Family<RequestLabels, Counter>,
    /// Prompt tokens prefilled.
    pub prompt_tokens: Counter,
    /// Tokens generated.
    pub completion_tokens: Counter,
    /// Generations that ended (stop or length).
    pub finished: Counter,
    /// Requests whose client went away before the end.
    pub cancelled: Counter,
    /// Requests that failed in the engine.
    pub failed: Counter,
    /// Seconds from receiving a request to its first token.
    pub time_to_first_token: Histogram,
    /// Seconds between a request's tokens.
    pub time_per_token: Histogram,
    /// Seconds per engine step (one ragged forward pass).
    pub step_seconds: Histogram,
    /// Requests decoding or prefilling now.
    pub running: Gauge,
    /// Requests waiting for a slot (preempted ones included).
    pub queued: Gauge,
    /// KV bytes held now, per tier.
    pub kv_bytes: Family<TierLabels, Gauge<u64, AtomicU64>>,
    /// Sequences holding a cache now.
    pub kv_sequences: Gauge,
    /// The KV pool's bytes now as a fraction of its budget, per budgeted tier (vLLM's
    /// `kv_cache_usage_perc`).
    pub kv_usage: Family<TierLabels, Gauge<f64, AtomicU64>>,
    /// The KV pool's budget in bytes, per budgeted tier.
    pub kv_budget: Family<TierLabels, Gauge<u64, AtomicU64>>,
    /// The most bytes the KV pool ever held at once, per tier.
    pub kv_peak: Family<TierLabels, Gauge<u64, AtomicU64>>,
    /// Requests preempted to make room, by mode (vLLM's `num_preemptions`).
    pub preemptions: Family<ModeLabels, Counter>,
    /// Requests looked up in the prefix cache.
    pub prefix_lookups: Counter,
    /// Prompt tokens looked up in the prefix cache (vLLM's `prefix_cache_queries`; the
    /// tokens found are `prefix_restored_tokens`).
    pub prefix_queries: Counter,
    /// Requests that restored at least one chunk.
    pub prefix_hits: Counter,
    /// Prompt tokens restored instead of prefilled.
    pub prefix_restored_tokens: Counter,
    /// Chunks the requests added to the cache.
    pub prefix_stored_chunks: Counter,
    /// Bytes the prefix cache holds, per tier (`ram`, `disk`).
    pub prefix_bytes: Family<TierLabels, Gauge<u64, AtomicU64>>,
    /// Chunk files the prefix cache could not write, by cause.
    pub prefix_write_errors: Family<KindLabels, Counter>,
    /// Chunks the prefix cache evicted, per tier (`ram`, `disk`): for its own budget, or
    /// for a live request that needed the room in the pool.
    pub prefix_evictions: Family<TierLabels, Counter>,
    /// Bytes of the prefix cache's RAM chunks that running requests hold by reference
    /// (held once however many read them; part of `prefix_bytes{tier="ram"}`).
    pub kv_shared_bytes: Gauge<u64, AtomicU64>,
    /// Bytes of preempted requests' K/V swapped to the disk tier now.
    pub kv_swapped_bytes: Gauge<u64, AtomicU64>,
    /// HTTP connections open now.
    pub connections: Gauge,
    /// Connections answered 503 and closed at `--max-connections`.
    pub connections_shed: Counter,
    /// Idle connections closed at `--max-connections` for a newcomer.
    pub connections_evicted: Counter,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Every metric at zero, registered under `kvpolicy_`.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("kvpolicy");
        let m = Self {
            requests: Family::default(),
            prompt_tokens: Counter::default(),
            completion_tokens: Counter::default(),
            finished: Counter::default(),
            cancelled: Counter::default(),
            failed: Counter::default(),
            time_to_first_token: Histogram::new(exponential_buckets(0.01, 2.0, 16)),
            time_per_token: Histogram::new(exponential_buckets(0.001, 2.0, 16)),
            step_seconds: Histogram::new(exponential_buckets(0.001, 2.0, 16)),
            running: Gauge::default(),
            queued: Gauge::default(),
            kv_bytes: Family::default(),
            kv_sequences: Gauge::default(),
            kv_usage: Family::default(),
            kv_budget: Family::default(),
            kv_peak: Family::default(),
            preemptions: Family::default(),
            prefix_lookups: Counter::default(),
            prefix_queries: Counter::default(),
            prefix_hits: Counter::default(),
            prefix_restored_tokens: Counter::default(),
            prefix_stored_chunks: Counter::default(),
            prefix_bytes: Family::default(),
            kv_shared_bytes: Gauge::default(),
            kv_swapped_bytes: Gauge::default(),
            prefix_evictions: Family::default(),
            prefix_write_errors: Family::default(),
            connections: Gauge::default(),
            connections_shed: Counter::default(),
            connections_evicted: Counter::default(),
            registry: Registry::default(),
        };
        registry.register(
            "requests",
            "Requests answered, by route and HTTP status",
            m.requests.clone(),
        );
        registry.register(
            "prompt_tokens",
            "Prompt tokens prefilled",
            m.prompt_tokens.clone(),
        );
        registry.register(
            "completion_tokens",
            "Tokens generated",
            m.completion_tokens.clone(),
        );
        registry.register(
            "requests_finished",
            "Generations that ended (stop or length)",
            m.finished.clone(),
        );
        registry.register(
            "requests_cancelled",
            "Requests whose client went away before the end",
            m.cancelled.clone(),
        );
        registry.register(
            "requests_failed",
            "Requests that failed in the engine",
            m.failed.clone(),
        );
        registry.register(
            "time_to_first_token_seconds",
            "Seconds from receiving a request to its first token",
            m.time_to_first_token.clone(),
        );
        registry.register(
            "time_per_output_token_seconds",
            "Seconds between one request's tokens",
            m.time_per_token.clone(),
        );
        registry.register(
            "step_seconds",
            "Seconds per engine step (one ragged forward pass)",
            m.step_seconds.clone(),
        );
        registry.register(
            "requests_running",
            "Requests decoding or prefilling",
            m.running.clone(),
        );
        registry.register(
            "requests_queued",
            "Requests waiting for a slot or for memory (preempted ones included)",
            m.queued.clone(),
        );
        registry.register(
            "kv_bytes",
            "KV bytes the policy holds, per tier",
            m.kv_bytes.clone(),
        );
        registry.register(
            "kv_sequences",
            "Sequences holding a cache",
            m.kv_sequences.clone(),
        );
        registry.register(
            "kv_cache_usage_perc",
            "The KV pool's bytes as a fraction of its budget (all sequences together), per tier",
            m.kv_usage.clone(),
        );
        registry.register(
            "kv_budget_bytes",
            "The KV pool's budget (--device-kv-budget, --host-kv-budget), per tier",
            m.kv_budget.clone(),
        );
        registry.register(
            "kv_peak_bytes",
            "The most bytes the KV pool held at once since the start, per tier",
            m.kv_peak.clone(),
        );
        registry.register(
            "num_preemptions",
            "Requests preempted to make room in the KV pool, by mode",
            m.preemptions.clone(),
        );
        registry.register(
            "prefix_cache_lookups",
            "Requests looked up in the prefix cache",
            m.prefix_lookups.clone(),
        );
        registry.register(
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache (those found: prefix_cache_restored_tokens)",
            m.prefix_queries.clone(),
        );
        registry.register(
            "prefix_cache_hits",
            "Requests that restored at least one chunk from the prefix cache",
            m.prefix_hits.clone(),
        );
        registry.register(
            "prefix_cache_restored_tokens",
            "Prompt tokens restored from the prefix cache instead of prefilled",
            m.prefix_restored_tokens.clone(),
        );
        registry.register(
            "prefix_cache_stored_chunks",
            "Chunks the requests added to the prefix cache",
            m.prefix_stored_chunks.clone(),
        );
        registry.register(
            "prefix_cache_bytes",
            "Bytes the prefix cache holds, per tier",
            m.prefix_bytes.clone(),
        );
        registry.register(
            "prefix_cache_evictions",
            "Chunks the prefix cache evicted, per tier (for its budget, or for a live request's room in the pool)",
            m.prefix_evictions.clone(),
        );
        registry.register(
            "kv_shared_bytes",
            "Bytes of K/V that running requests hold by reference: prefix cache chunks (RAM) read by one or more requests, held once",
            m.kv_shared_bytes.clone(),
        );
        registry.register(
            "kv_swapped_bytes",
            "Bytes of preempted requests' K/V swapped to the disk tier now (--preemption-mode swap)",
            m.kv_swapped_bytes.clone(),
        );
        registry.register(
            "prefix_cache_write_errors",
            "Chunk files the prefix cache could not write (the directory gone, the disk full, writing denied, other)",
            m.prefix_write_errors.clone(),
        );
        registry.register(
            "http_connections",
            "HTTP connections open",
            m.connections.clone(),
        );
        registry.register(
            "http_connections_shed",
            "Connections answered 503 and closed at --max-connections",
            m.connections_shed.clone(),
        );
        registry.register(
            "http_connections_evicted",
            "Idle connections closed at --max-connections to let a newcomer in",
            m.connections_evicted.clone(),
        );
        Self { registry, ..m }
    }

    /// The KV gauges from the policy's stats.
    pub fn set_kv(&self, s: &kvpolicy::KvStats) {
        for (tier, bytes) in [
            ("device", s.device_kv_bytes),
            ("host", s.host_kv_bytes),
            ("disk", s.disk_kv_bytes),
        ] {
            self.kv_bytes
                .get_or_create(&TierLabels { tier: tier.into() })
                .set(bytes);
        }
        self.kv_sequences.set(s.sequences as i64);
    }

    /// The pool's gauges: usage against each budget, budgets and peaks (device and host).
    pub fn set_pool(&self, pool: &kvpolicy::KvPool) {
        for (tier, t) in [("device", &pool.device), ("host", &pool.host)] {
            let labels = TierLabels { tier: tier.into() };
            self.kv_peak.get_or_create(&labels).set(t.peak());
            if let Some(b) = t.budget() {
                self.kv_budget.get_or_create(&labels).set(b);
                let share = if b == 0 {
                    0.0
                } else {
                    t.used() as f64 / b as f64
                };
                self.kv_usage.get_or_create(&labels).set(share);
            }
        }
    }

    /// Counts a preemption in `mode`.
    pub fn preempted(&self, mode: &str) {
        self.preemptions
            .get_or_create(&ModeLabels { mode: mode.into() })
            .inc();
    }

    /// The prefix cache's gauges and write errors from its counters.
    pub fn set_prefix(&self, s: &kvpolicy::prefix::PrefixStats) {
        self.kv_shared_bytes.set(s.shared_bytes);
        for (tier, n) in [("ram", s.ram_evictions), ("disk", s.disk_evictions)] {
            let labels = TierLabels { tier: tier.into() };
            follow(&self.prefix_evictions.get_or_create(&labels), n);
        }
        for (tier, bytes) in [("ram", s.ram_bytes), ("disk", s.disk_bytes)] {
            self.prefix_bytes
                .get_or_create(&TierLabels { tier: tier.into() })
                .set(bytes);
        }
        for (kind, n) in s.write_error_kinds.by_kind() {
            let labels = KindLabels { kind: kind.into() };
            follow(&self.prefix_write_errors.get_or_create(&labels), n);
        }
    }

    /// Counts an answer.
    pub fn answered(&self, route: &str, status: u16) {
        self.requests
            .get_or_create(&RequestLabels {
                route: route.into(),
                status: status.to_string(),
            })
            .inc();
    }

    /// The text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// Brings counter `c` up to `n`, a count kept elsewhere (the prefix cache counts; the
/// counter follows).
fn follow(c: &Counter, n: u64) {
    let seen = c.get();
    if n > seen {
        c.inc_by(n - seen);
    }
}

//! What a policy reports: device-tier bytes now and at peak, host-tier bytes, bytes moved
//! each way, recompute work and time spent. Memory numbers are deterministic (they count
//! allocated buffer bytes), so tests assert them exactly; times are for reports only.
use serde::Serialize;

/// Counters a policy keeps; every field is cumulative (or a peak) since the last `reset`
/// except `device_kv_bytes`, `host_kv_bytes`, `kv_tokens`, `split`, the block counts,
/// `sequences`, `mini_batches` and the unit counts, which are current values.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct KvStats {
    /// Bytes of KV (or activation) buffers held on the device tier now.
    pub device_kv_bytes: u64,
    /// Highest value `device_kv_bytes` reached, transient growth copies included.
    pub device_kv_peak_bytes: u64,
    /// Most bytes one attention call held as scratch (score tiles, running results), as the
    /// attention counted them; bounded by the tiles, not by the context.
    pub attn_scratch_peak_bytes: u64,
    /// Most device bytes a step held besides the KV: its attention scratch plus the model's
    /// activations for the step's tokens ([`crate::KvShape::activation_bytes_per_token`]).
    pub device_scratch_peak_bytes: u64,
    /// Bytes of KV (or activation) buffers held on the host tier now.
    pub host_kv_bytes: u64,
    /// Bytes of host-tier buffers page-locked for asynchronous copies (CUDA engine; 0 on
    /// CPU).
    pub host_pinned_bytes: u64,
    /// Bytes copied host→device.
    pub h2d_bytes: u64,
    /// Bytes copied device→host.
    pub d2h_bytes: u64,
    /// Floating-point operations spent regenerating K/V from stored activations.
    pub recompute_flops: u64,
    /// Tokens whose K/V were regenerated rather than transferred (summed over layers,
    /// steps and sequences).
    pub recompute_tokens: u64,
    /// Tokens regenerated per layer in the last step (the KVPR split `l`; 0 when nothing is).
    pub split: u64,
    /// Tokens cached per layer.
    pub kv_tokens: u64,
    /// Seconds spent waiting for transfers that compute could not hide (host waits; on CUDA
    /// the compute stream waits on the device instead, so this stays near 0 there).
    pub transfer_wait_s: f64,
    /// Seconds the transfer engine spent copying (its worker or copy stream busy, overlapped
    /// with compute or not): with the step time, the overlap.
    pub copy_s: f64,
    /// Activation blocks in use, on either tier (`hybrid`, HybridServe §4.1).
    pub act_blocks: u64,
    /// KV blocks in use, on either tier (`hybrid`).
    pub kv_blocks: u64,
    /// Blocks resident on the device tier (`hybrid`; never more than its device pool holds).
    pub device_blocks: u64,
    /// Sequences holding a cache in a batched run (0 for single-sequence runs).
    pub sequences: u64,
    /// Mini-batches the last batched step was split into (`hybrid`; 0 before any plan).
    pub mini_batches: u64,
    /// (layer, head group) units kept on the device (`auto`).
    pub resident_units: u64,
    /// (layer, head group) units streamed through the ping-pong buffers (`auto`).
    pub streamed_units: u64,
    /// Resident units moved to the host because they no longer fit (`auto`; once each).
    pub demotions: u64,
    /// Bytes of the disk tier's files (K/V past the host budget).
    pub disk_kv_bytes: u64,
    /// Bytes read from the disk tier.
    pub disk_read_bytes: u64,
    /// Bytes written to the disk tier.
    pub disk_write_bytes: u64,
    /// Seconds the compute thread spent on disk reads and writes (waiting for a read-ahead
    /// included).
    pub disk_wait_s: f64,
    /// Disk reads started ahead of their use, each on its own thread.
    pub disk_read_aheads: u64,
    /// Whether the disk tier reads past the page cache (`O_DIRECT`; see `DiskIo`).
    pub disk_direct_io: bool,
    /// Whether the cache is stored LOSSILY (a host dtype smaller than the model's): the
    /// logits then differ from `full`'s by the measured tolerance, not the exact one.
    pub lossy: bool,
}

impl KvStats {
    /// Resident units over all decided units (`auto`; 1 when nothing streams, 0 before any
    /// unit is decided).
    pub fn resident_fraction(&self) -> f64 {
        let all = self.resident_units + self.streamed_units;
        if all == 0 {
            0.0
        } else {
            self.resident_units as f64 / all as f64
        }
    }

    /// Records one attention call's scratch and the step's activation bytes.
    pub fn note_scratch(&mut self, attention: u64, activations: u64) {
        self.attn_scratch_peak_bytes = self.attn_scratch_peak_bytes.max(attention);
        self.device_scratch_peak_bytes =
            self.device_scratch_peak_bytes.max(attention + activations);
    }
}

/// Tracks the device tier's current and peak bytes against an optional budget.
#[derive(Clone, Debug, Default)]
pub struct DeviceMeter {
    current: u64,
    peak: u64,
    budget: Option<u64>,
}

impl DeviceMeter {
    /// A meter with an optional byte budget.
    pub fn new(budget: Option<u64>) -> Self {
        Self {
            current: 0,
            peak: 0,
            budget,
        }
    }

    /// The budget, if any.
    pub fn budget(&self) -> Option<u64> {
        self.budget
    }

    /// Bytes held now.
    pub fn current(&self) -> u64 {
        self.current
    }

    /// Highest bytes held.
    pub fn peak(&self) -> u64 {
        self.peak
    }

    /// Whether `extra` more bytes would stay within the budget.
    pub fn fits(&self, extra: u64) -> bool {
        self.budget.is_none_or(|b| self.current + extra <= b)
    }

    /// Records an allocation of `bytes`.
    pub fn alloc(&mut self, bytes: u64) {
        self.current += bytes;
        self.peak = self.peak.max(self.current);
    }

    /// Records a release of `bytes`.
    pub fn free(&mut self, bytes: u64) {
        self.current = self.current.saturating_sub(bytes);
    }

    /// Records that `bytes` are held now (for tiers whose size is read off their pools).
    pub fn set(&mut self, bytes: u64) {
        self.current = bytes;
        self.peak = self.peak.max(bytes);
    }

    /// Forgets everything held (the peak too).
    pub fn reset(&mut self) {
        self.current = 0;
        self.peak = 0;
    }
}

//! The host tier's store trait ([`LayerStore`]): what [`HostLayers`](super::HostLayers) asks
//! of one layer's K/V wherever they live — room for more tokens, a read of a head range ×
//! token range, a write-back, a read-ahead, the bytes held — so that it routes every call to
//! the layer's store without asking which kind it is. Two stores implement it: host memory
//! ([`HostKv`](super::HostKv): HeadInfer §3.2, "the full KV cache lives in CPU memory") and
//! a file of the disk tier ([`DiskKv`](crate::DiskKv), for contexts beyond host memory).
//! [`Room`] is what a store's growth may use.
use std::any::Any;
use std::fmt::Debug;

use candle_core::{DType, Tensor};
use kvpolicy_core::{round_up, KvCodec, KvShape, Result};

use super::disk_traffic::{DiskTraffic, ReadSpan};
use crate::link::Link;
use crate::transfer::TransferEngine;

/// Bytes a tensor's elements take.
pub fn tensor_bytes(t: &Tensor) -> u64 {
    (t.elem_count() * t.dtype().size_in_bytes()) as u64
}

/// Bytes of `heads` heads' K and V at `tokens` tokens, stored as `codec` says.
pub(crate) fn stored_bytes(codec: KvCodec, shape: &KvShape, heads: usize, tokens: usize) -> u64 {
    (2 * shape.batch * heads * tokens) as u64 * codec.row_bytes(shape.dtype, shape.head_dim)
}

/// A store growing for `n` tokens takes the run's planned capacity at once when that is at
/// most this many times `n` (so host memory never holds more than this multiple of what the
/// tokens so far need). Two is enough for a prompt ending on a chunk's edge to reserve its
/// generation with its last prefill chunk; a server, which plans every request for the
/// model's whole context, over-reserves only a request past half of it, by less than 2×.
pub(crate) const RESERVE_FACTOR: usize = 2;

/// Where a write lands: heads `first_head..` of `layer`, from token `offset` on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WriteAt {
    /// The layer.
    pub layer: usize,
    /// The first KV head written.
    pub first_head: usize,
    /// The first token written.
    pub offset: usize,
}

/// The host budget when a disk tier takes the layers past it, and the RAM bytes the other
/// layers hold.
#[derive(Clone, Copy, Debug)]
pub(crate) struct HostBudget {
    /// Host bytes of K/V kept in RAM.
    pub(crate) budget: u64,
    /// RAM bytes of the other layers.
    pub(crate) others: u64,
}

/// What a store growing for more tokens may use: the link (queued copies may target its
/// buffers; its engine allocates host buffers), the disk traffic, the run's shape and
/// stored form, the growth chunk, and how many RAM bytes the host budget leaves it.
pub(crate) struct Room<'a> {
    link: &'a mut Link,
    traffic: &'a mut DiskTraffic,
    shape: &'a KvShape,
    codec: KvCodec,
    chunk: usize,
    /// The host budget, when a disk tier takes the layers past it.
    budget: Option<HostBudget>,
    /// Tokens the layer's store will hold by the run's end (its shape's `max_tokens`, or the
    /// window and a step of a window-keeping layer); 0 when unknown.
    planned: usize,
}

impl<'a> Room<'a> {
    /// Room for a layer of a run of `shape` stored as `codec`, growing `chunk` tokens at a
    /// time; `budget` `None` without a disk tier: RAM is not limited.
    pub(crate) fn new(
        link: &'a mut Link,
        traffic: &'a mut DiskTraffic,
        shape: &'a KvShape,
        codec: KvCodec,
        chunk: usize,
        budget: Option<HostBudget>,
    ) -> Self {
        Self {
            link,
            traffic,
            shape,
            codec,
            chunk,
            budget,
            planned: 0,
        }
    }

    /// The link between the tiers.
    pub(crate) fn link(&mut self) -> &mut Link {
        self.link
    }

    /// The disk tier's traffic.
    pub(crate) fn traffic(&mut self) -> &mut DiskTraffic {
        self.traffic
    }

    /// The layer's store will hold `tokens` by the run's end ([`Self::capacity_for`]).
    pub(crate) fn planned(mut self, tokens: usize) -> Self {
        self.planned = tokens;
        self
    }

    /// The capacity to grow to for `tokens`: the run's planned capacity when it is at most
    /// [`RESERVE_FACTOR`] × the whole growth chunks `tokens` need and within the host budget,
    /// else those chunks. Each growth copies the layer (and on a GPU page-locks the new
    /// buffers): growing chunk by chunk to the planned length made a 32K-token run copy its
    /// history ~8 times over, and a prompt ending on a chunk's edge grew (copied everything)
    /// again at the first decode step.
    /// A run planned to end inside the chunks `tokens` need takes only its planned length
    /// (many short sequences sharing one host budget do not each hold a whole chunk).
    pub(crate) fn capacity_for(&self, tokens: usize) -> usize {
        let need = round_up(tokens, self.chunk);
        if (tokens..=need).contains(&self.planned) {
            return self.planned;
        }
        let planned = round_up(self.planned, self.chunk);
        if planned > need && planned <= need.saturating_mul(RESERVE_FACTOR) && self.fits(planned) {
            planned
        } else {
            need
        }
    }

    /// Whether RAM buffers of `cap` tokens for every KV head stay within the host budget.
    pub(crate) fn fits(&self, cap: usize) -> bool {
        let bytes = stored_bytes(self.codec, self.shape, self.shape.n_kv_heads, cap);
        self.budget.is_none_or(|b| b.others + bytes <= b.budget)
    }

    /// The dims `(b, kv_heads, cap, width)` and dtype of buffers of `cap` tokens as stored
    /// (an error when the stored form cannot hold the head width).
    pub(crate) fn buffers(&self, cap: usize) -> Result<((usize, usize, usize, usize), DType)> {
        let s = self.shape;
        self.codec.check(s.head_dim)?;
        let (dt, w) = self.codec.stored(s.dtype, s.head_dim);
        Ok(((s.batch, s.n_kv_heads, cap, w), dt))
    }
}

/// One layer's K/V on the host tier, wherever they live (module docs). `K`/`V` written and
/// read are in the stored form (`HostLayers` encodes before a write).
pub(crate) trait LayerStore: Debug + Send {
    /// Makes room for `tokens`: `true` once the store holds room for them (grown where it
    /// is: larger RAM buffers, or a file a chunk at a time), `false` when it cannot grow
    /// there — RAM buffers that would pass the host budget — and the layer must move.
    fn make_room(&mut self, tokens: usize, room: &mut Room<'_>) -> Result<bool>;

    /// The heads × tokens `span` as `(b, g, len, width)` K and V on the host: views of
    /// host memory, or read from disk (taken from `traffic`'s read-ahead when read ahead).
    fn history(&self, span: ReadSpan, traffic: &mut DiskTraffic) -> Result<(Tensor, Tensor)>;

    /// Starts reading `span` ahead of its [`history`](Self::history), on its own thread,
    /// into `traffic`. Nothing for a store whose reads cost nothing (the default: RAM).
    fn read_ahead(&self, span: ReadSpan, traffic: &mut DiskTraffic) -> Result<()> {
        let _ = (span, traffic);
        Ok(())
    }

    /// Writes K and V `(b, g, t, width)` at `at` (its layer is this store's): queued on
    /// `link` behind the compute, or written through (`traffic` counts disk writes);
    /// counted device→host on the link either way.
    fn write(
        &mut self,
        link: &mut Link,
        traffic: &mut DiskTraffic,
        at: WriteAt,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<()>;

    /// Tokens it holds room for without growing (the disk tier's file: unbounded).
    fn capacity(&self) -> usize {
        usize::MAX
    }
    /// Drops its first `n` of `held` tokens, moving the rest to the front: `true` when it
    /// did (a RAM store), `false` when it keeps every token (the default: a disk file).
    fn drop_front(&mut self, n: usize, held: usize) -> Result<bool> {
        let _ = (n, held);
        Ok(false)
    }
    /// Bytes of host memory it holds.
    fn ram_bytes(&self) -> u64 {
        0
    }

    /// Bytes of the disk tier's files it holds.
    fn file_bytes(&self) -> u64 {
        0
    }

    /// Whether its reads bypass the page cache.
    fn direct_io(&self) -> bool {
        false
    }

    /// Hands its host buffers back to `engine` before it is dropped (the default: none).
    fn release(self: Box<Self>, engine: &mut dyn TransferEngine) {
        let _ = engine;
    }

    /// The store as [`Any`], for a caller asking for one kind's buffers
    /// ([`HostLayers::ram`](super::HostLayers::ram)).
    fn as_any(&self) -> &dyn Any;
}

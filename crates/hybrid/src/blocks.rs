//! Fixed-size token blocks and where they live (HybridServe §4.1): a block holds
//! `block_size` consecutive tokens of one request for every layer, either as K/V or as the
//! layer inputs X (an *activation* block). Blocks sit in preallocated pools, one per tier
//! and kind; a request's [`BlockTable`] maps its logical blocks to pool slots, and freeing
//! the request returns them.
use candle_core::{DType, Device, Tensor};
use kvpolicy_core::{grown, KvError, Result};
use kvpolicy_tiered::{grown_host, TransferEngine};

/// What a block stores.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    /// Keys and values.
    Kv,
    /// Layer inputs, turned back into K/V on the device when needed.
    Act,
}

/// Where a block lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Tier {
    /// Accelerator memory.
    Device,
    /// Host memory.
    Host,
}

/// One logical block of a request: its kind, tier and slot in that pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockRef {
    /// K/V or activations.
    pub kind: Kind,
    /// Device or host.
    pub tier: Tier,
    /// Slot in the pool of that tier and kind.
    pub slot: usize,
}

/// A request's blocks in token order, and how many tokens they hold.
#[derive(Clone, Debug, Default)]
pub struct BlockTable {
    /// Logical block `i` holds tokens `i·block_size ..`.
    pub blocks: Vec<BlockRef>,
    /// Tokens stored.
    pub tokens: usize,
    /// The share of K/V blocks this request is kept at.
    pub kv_share: f64,
}

/// How a pool's tensors are laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolLayout {
    /// Element type.
    pub dtype: DType,
    /// Tokens per block.
    pub block: usize,
    /// Values per row: `n_kv·head_dim` for K/V, `hidden` for X.
    pub width: usize,
    /// Layers.
    pub n_layers: usize,
}

/// Slots of `block_size` tokens for every layer, on one tier, of one kind. Each layer has
/// one tensor per stored quantity (K and V, or X), `(slots·block_size, width)`; a token's
/// row is `slot·block_size + offset`.
#[derive(Debug)]
pub struct Pool {
    /// What the pool stores.
    pub kind: Kind,
    /// Where.
    pub tier: Tier,
    device: Device,
    dtype: DType,
    block: usize,
    width: usize,
    /// `layers[l][j]`: quantity `j` (K, V or X) of layer `l`.
    layers: Vec<Vec<Tensor>>,
    n_layers: usize,
    slots: usize,
    /// Slot limit (`None` = grows as needed).
    limit: Option<usize>,
    free: Vec<usize>,
}

impl Pool {
    /// An empty pool of `kind` on `tier` (on `device`), laid out as `layout` says, holding
    /// at most `limit` slots.
    pub fn new(
        kind: Kind,
        tier: Tier,
        device: &Device,
        layout: PoolLayout,
        limit: Option<usize>,
    ) -> Self {
        Self {
            kind,
            tier,
            device: device.clone(),
            dtype: layout.dtype,
            block: layout.block,
            width: layout.width,
            layers: Vec::new(),
            n_layers: layout.n_layers,
            slots: 0,
            limit,
            free: Vec::new(),
        }
    }

    fn quantities(&self) -> usize {
        match self.kind {
            Kind::Kv => 2,
            Kind::Act => 1,
        }
    }

    /// Bytes one slot takes over all layers.
    pub fn slot_bytes(&self) -> u64 {
        (self.n_layers * self.quantities() * self.block * self.width * self.dtype.size_in_bytes())
            as u64
    }

    /// Bytes allocated.
    pub fn bytes(&self) -> u64 {
        self.slots as u64 * self.slot_bytes()
    }

    /// Slots allocated.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Slots in use.
    pub fn used(&self) -> usize {
        self.slots - self.free.len()
    }

    /// Whether a slot can be handed out without passing the limit.
    pub fn has_room(&self) -> bool {
        !self.free.is_empty() || self.limit.is_none_or(|l| self.slots < l)
    }

    /// A `(rows, width)` buffer holding a copy of `old` at its start: from `engine` on the
    /// host tier (page-locked where it can), on the device otherwise.
    fn alloc(
        &self,
        engine: &mut dyn TransferEngine,
        old: Option<&Tensor>,
        rows: usize,
    ) -> Result<Tensor> {
        match self.tier {
            Tier::Host => grown_host(engine, old, (rows, self.width), 0, self.dtype),
            Tier::Device => grown(old, (rows, self.width), 0, self.dtype, &self.device),
        }
    }

    /// Adds layers up to `n_layers`, each allocated for the current slots (host buffers
    /// through `engine`).
    pub fn ensure_layers(
        &mut self,
        n_layers: usize,
        engine: &mut dyn TransferEngine,
    ) -> Result<()> {
        self.n_layers = self.n_layers.max(n_layers);
        let rows = self.slots * self.block;
        while self.slots > 0 && self.layers.len() < self.n_layers {
            let qs = (0..self.quantities())
                .map(|_| self.alloc(engine, None, rows))
                .collect::<Result<Vec<_>>>()?;
            self.layers.push(qs);
        }
        Ok(())
    }

    /// Allocates every layer for `slots` slots up front (preallocation), keeping contents
    /// (host buffers through `engine`).
    pub fn reserve(&mut self, slots: usize, engine: &mut dyn TransferEngine) -> Result<()> {
        let slots = match self.limit {
            Some(l) => slots.min(l),
            None => slots,
        };
        if slots <= self.slots {
            return Ok(());
        }
        let rows = slots * self.block;
        let mut layers = Vec::with_capacity(self.n_layers);
        for l in 0..self.n_layers {
            let mut qs = Vec::with_capacity(self.quantities());
            for j in 0..self.quantities() {
                let old = self.layers.get(l).and_then(|q| q.get(j));
                qs.push(self.alloc(engine, old, rows)?);
            }
            layers.push(qs);
        }
        self.layers = layers;
        self.free.extend((self.slots..slots).rev());
        self.slots = slots;
        Ok(())
    }

    /// Takes a free slot, growing the pool (doubling) when it may.
    pub fn take(&mut self, engine: &mut dyn TransferEngine) -> Result<usize> {
        if self.free.is_empty() {
            if !self.has_room() {
                return Err(KvError::invariant(format!(
                    "the {:?} pool of {:?} blocks is full ({} slots)",
                    self.tier, self.kind, self.slots
                )));
            }
            self.reserve((self.slots * 2).max(4), engine)?;
        }
        self.free
            .pop()
            .ok_or_else(|| KvError::invariant("a pool with room handed out no slot"))
    }

    /// Returns a slot.
    pub fn give_back(&mut self, slot: usize) {
        if slot < self.slots && !self.free.contains(&slot) {
            self.free.push(slot);
        }
    }

    /// Quantity `j` of layer `layer`: `(slots·block, width)`.
    pub fn tensor(&self, layer: usize, j: usize) -> Result<&Tensor> {
        self.layers
            .get(layer)
            .and_then(|q| q.get(j))
            .ok_or_else(|| KvError::invariant(format!("layer {layer} has no {:?} pool", self.kind)))
    }

    /// Frees every slot (keeps the allocation).
    pub fn clear(&mut self) {
        self.free = (0..self.slots).rev().collect();
    }

    /// Drops the allocation (host buffers handed back to `engine`).
    pub fn release_all(&mut self, engine: &mut dyn TransferEngine) {
        if self.tier == Tier::Host {
            for t in self.layers.iter().flatten() {
                let _ = engine.host_release(t);
            }
        }
        self.layers.clear();
        self.slots = 0;
        self.free.clear();
    }
}

/// Pool rows of tokens `from..to` of a table, grouped by the pool (kind, tier) they sit in:
/// for each group the tokens' positions and their rows.
#[derive(Debug, Default, Clone)]
pub struct Rows {
    /// Token positions.
    pub positions: Vec<usize>,
    /// Rows in the pool tensors.
    pub rows: Vec<u32>,
}

impl BlockTable {
    /// Rows of tokens `0..upto` that sit in blocks of `kind` on `tier`.
    pub fn rows(&self, upto: usize, block: usize, kind: Kind, tier: Tier) -> Rows {
        let mut out = Rows::default();
        for (i, b) in self.blocks.iter().enumerate() {
            if b.kind != kind || b.tier != tier {
                continue;
            }
            let start = i * block;
            for p in start..(start + block).min(upto) {
                out.positions.push(p);
                out.rows.push((b.slot * block + p - start) as u32);
            }
        }
        out
    }
}

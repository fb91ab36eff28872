//! The host tier: every layer's K/V with the tokens each layer holds and the attention spec
//! it last ran with (HeadInfer §3.2: "the full KV cache lives in CPU memory"). Each layer's
//! K/V sit in one [`LayerStore`](store::LayerStore) — `(b, kv_heads, cap, head_dim)`
//! buffers in host memory ([`HostKv`]) that grow in large chunks through the transfer
//! engine (so the CUDA one page-locks them), or, with a [`DiskTier`], a file of the disk
//! tier ([`DiskKv`]) once the layer's growth would take the host tier past its budget:
//! reads and writes of that layer go to disk, the rest stays in RAM. [`HostLayers`] routes
//! every read, write and read-ahead to the layer's store without asking which kind it is.
//!
//! A layer may hold its first positions by reference instead: runs of a prefix shared with
//! other sequences ([`Self::attach`](HostLayers::attach), [`Self::adopt`](HostLayers::adopt));
//! its store then holds the positions after them.
//!
//! Files: this one [`HostLayers`]; `store` the store trait and what a growing store may
//! use; `ram` the RAM store; `disk_layer` the disk tier's file as a store; `disk_traffic`
//! the disk reads started ahead and the disk tier's byte and time counts; `shared` the runs
//! held by reference, `sharing` the methods that attach, adopt and read them.
use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Tensor};
use kvpolicy_core::{front_to_drop, window_capacity, AttnSpec, AttnStep, KvCodec, KvShape};
use kvpolicy_core::{HeadRange, KvError, KvPool, KvStats, Result, TokenRange};

use crate::disk::DiskKv;
use crate::disk_tier::DiskTier;
use crate::link::Link;

mod disk_layer;
mod disk_traffic;
mod ram;
mod shared;
mod sharing;
mod store;

pub use disk_traffic::READ_AHEAD;
use disk_traffic::{DiskTraffic, ReadSpan};
pub use ram::HostKv;
pub use shared::HistoryPiece;
use shared::LayerRuns;
use store::{stored_bytes, HostBudget, LayerStore, Room};
pub use store::{tensor_bytes, WriteAt};

/// Every layer's host-tier K/V with its length and last attention spec (module docs).
#[derive(Debug)]
pub struct HostLayers {
    /// Host buffers grow in chunks of this many tokens.
    chunk: usize,
    shape: Option<KvShape>,
    /// The disk reads ahead and the disk tier's counts (first: its drop joins the reads,
    /// which hold the layers' files open, before the layers go).
    traffic: DiskTraffic,
    layers: Vec<Option<Box<dyn LayerStore>>>,
    /// Per layer, the runs held by reference from position 0 (its store holds the
    /// positions after them: its base is where they end).
    shared: Vec<LayerRuns>,
    /// Per layer, positions seen (the next position written).
    lens: Vec<usize>,
    /// Per layer, the first position its store holds (RAM stores of sliding-window layers
    /// drop what no later query sees, when asked to: [`Self::dropping_windows`]); reads and
    /// writes address the store at `position − base`.
    bases: Vec<usize>,
    /// Whether RAM stores of sliding-window layers keep only their window.
    drop_windows: bool,
    specs: Vec<Option<AttnSpec>>,
    disk: Option<DiskTier>,
    /// How K/V are stored (the model's dtype, or LOSSY smaller forms).
    codec: KvCodec,
    /// The host ledger shared with other sequences ([`Self::pooled`]), and the RAM bytes
    /// this sequence has on its books.
    pool: Option<Arc<KvPool>>,
    booked: u64,
}

/// The error for a layer without storage.
fn no_storage(layer: usize) -> KvError {
    KvError::invariant(format!("layer {layer} has no host storage"))
}

impl HostLayers {
    /// Host storage growing in chunks of 8 × the device growth step `grow_tokens` (host
    /// memory is plentiful, and each growth copies the layer), spilling to `disk` past its
    /// budget when given.
    pub fn new(grow_tokens: usize, disk: Option<DiskTier>) -> Self {
        Self {
            chunk: grow_tokens.max(1) * 8,
            shape: None,
            traffic: DiskTraffic::default(),
            layers: Vec::new(),
            shared: Vec::new(),
            lens: Vec::new(),
            bases: Vec::new(),
            drop_windows: false,
            specs: Vec::new(),
            disk,
            codec: KvCodec::Model,
            pool: None,
            booked: 0,
        }
    }

    /// Shares the host budget with every sequence of `pool` (`None`: this sequence's own):
    /// RAM stores grow only while the pool's host ledger has room for them, and past it a
    /// layer goes to the disk tier, as past a sequence's own budget; the RAM held is on the
    /// ledger's books until it is freed.
    pub fn pooled(mut self, pool: Option<Arc<KvPool>>) -> Self {
        self.pool = pool;
        self
    }

    /// Puts the RAM held now on the pool's books.
    fn book(&mut self) {
        if let Some(p) = &self.pool {
            let now = self.ram_bytes();
            p.host.change(self.booked, now);
            self.booked = now;
        }
    }

    /// Stores K/V as `codec` says (LOSSY unless the model's dtype): what is written is
    /// encoded, and reads return the stored form ([`KvCodec::decode`] expands it).
    pub fn with_codec(mut self, codec: KvCodec) -> Self {
        self.codec = codec;
        self
    }

    /// Keeps only the window (and a step) of each sliding-window layer held in RAM: before
    /// such a layer's buffers would grow, the tokens no later query sees are dropped, as
    /// [`kvpolicy_core::WindowKv`] does on the device. [`Self::history`] and [`Self::write`]
    /// translate positions; a caller of the RAM buffers themselves reads their first
    /// position from [`Self::ram_from`]. A layer on the disk tier keeps every token.
    pub fn dropping_windows(mut self) -> Self {
        self.drop_windows = true;
        self
    }

    /// How K/V are stored.
    pub fn codec(&self) -> KvCodec {
        self.codec
    }

    /// The stored dtype and row width for `shape`.
    pub fn stored(&self, shape: &KvShape) -> (DType, usize) {
        self.codec.stored(shape.dtype, shape.head_dim)
    }

    /// Bytes of `heads` heads' K and V at `tokens` tokens as stored.
    pub fn stored_bytes(&self, shape: &KvShape, heads: usize, tokens: usize) -> u64 {
        stored_bytes(self.codec, shape, heads, tokens)
    }

    /// Tokens per growth chunk.
    pub fn chunk(&self) -> usize {
        self.chunk
    }

    /// Records the run's shape (from [`KvPolicy::prepare`](kvpolicy_core::KvPolicy::prepare)).
    pub fn set_shape(&mut self, shape: &KvShape) {
        self.shape = Some(shape.clone());
    }

    /// The shape `step` implies ([`KvShape::for_step`]), remembered for the next step.
    pub fn shape_for(&mut self, step: &AttnStep<'_>) -> Result<KvShape> {
        let shape = KvShape::for_step(self.shape.as_ref(), self.lens.len(), step)?;
        self.shape = Some(shape.clone());
        Ok(shape)
    }

    /// Makes `step.layer` hold room for the step's tokens, checks that the step continues
    /// the layer's sequence, and records its attention spec.
    pub fn begin(&mut self, link: &mut Link, step: &AttnStep<'_>, shape: &KvShape) -> Result<()> {
        let (layer, pos) = (step.layer, step.pos);
        let t = step.k.dim(2)?;
        if self.drop_windows && self.lens.get(layer) == Some(&pos) {
            self.drop_before(link, layer, step.spec.window_start(pos), t)?;
        }
        self.ensure(link, layer, shape, pos + t)?;
        if self.lens[layer] != pos {
            return Err(KvError::OutOfOrder {
                seq: step.seq,
                layer,
                held: self.lens[layer],
                pos,
            });
        }
        self.specs[layer] = Some(step.spec.clone());
        Ok(())
    }

    /// Drops `layer`'s tokens before `keep_from` from its RAM store when `t` more would
    /// make it grow (queued copies land first: they may read or write the moved rows).
    fn drop_before(
        &mut self,
        link: &mut Link,
        layer: usize,
        keep_from: usize,
        t: usize,
    ) -> Result<()> {
        let (base, len) = (self.bases[layer], self.lens[layer]);
        let Some(store) = self.layers[layer].as_mut() else {
            return Ok(());
        };
        let n = front_to_drop(base..len, keep_from, len + t, store.capacity());
        if n == 0 {
            return Ok(());
        }
        link.wait_all()?;
        if store.drop_front(n, len - base)? {
            self.bases[layer] = base + n;
        }
        Ok(())
    }

    /// The layers' stores.
    fn stores(&self) -> impl Iterator<Item = &dyn LayerStore> {
        self.layers.iter().flatten().map(|s| &**s)
    }

    /// RAM bytes of K/V held.
    fn ram_bytes(&self) -> u64 {
        self.stores().map(|s| s.ram_bytes()).sum()
    }

    /// Grows `layer`'s storage to hold `tokens`. Queued copies may target the old buffers,
    /// so they land first; a completed prefetch stays valid (it read the unchanged prefix).
    /// A layer whose growth in RAM would pass the disk tier's host budget moves to disk.
    pub fn ensure(
        &mut self,
        link: &mut Link,
        layer: usize,
        shape: &KvShape,
        tokens: usize,
    ) -> Result<()> {
        while self.layers.len() <= layer {
            self.layers.push(None);
            self.shared.push(LayerRuns::default());
            self.lens.push(0);
            self.bases.push(0);
            self.specs.push(None);
        }
        let tokens = tokens.saturating_sub(self.bases[layer]);
        let own = self.layers[layer].as_ref().map_or(0, |s| s.ram_bytes());
        // The other layers, and with a shared pool the other sequences' RAM.
        let others = self.ram_bytes() - own
            + self
                .pool
                .as_ref()
                .map_or(0, |p| p.host.used().saturating_sub(self.booked));
        let budget = self.disk.as_ref().map(|t| HostBudget {
            budget: t.host_budget,
            others,
        });
        let window = match self.drop_windows {
            true => shape.windows.get(layer).copied().flatten(),
            false => None,
        };
        // (A window-keeping layer's store holds the window and a step from its base; a
        // global layer's from position 0, or from the end of the runs it holds by reference.)
        let planned = match window {
            Some(_) => window_capacity(window, shape.max_tokens, shape.largest_step(), 1),
            None => shape.max_tokens.saturating_sub(self.bases[layer]),
        };
        let mut room = Room::new(
            &mut *link,
            &mut self.traffic,
            shape,
            self.codec,
            self.chunk,
            budget,
        )
        .planned(planned);
        let held = match &mut self.layers[layer] {
            Some(store) => store.make_room(tokens, &mut room)?,
            None if tokens == 0 => true,
            None => match HostKv::grown(None, tokens, &mut room)? {
                Some(ram) => {
                    self.layers[layer] = Some(Box::new(ram));
                    true
                }
                None => false,
            },
        };
        let done = match held {
            true => Ok(()),
            false => self.spill_to_disk(link, layer, shape, tokens),
        };
        self.book();
        done
    }

    /// Moves `layer` (in RAM, or new) to a file of the disk tier holding `tokens`, its
    /// stored tokens copied over.
    fn spill_to_disk(
        &mut self,
        link: &mut Link,
        layer: usize,
        shape: &KvShape,
        tokens: usize,
    ) -> Result<()> {
        let Some(tier) = &self.disk else {
            return Err(KvError::invariant(
                "a layer past the host budget without a disk tier",
            ));
        };
        let t0 = Instant::now();
        let (dt, w) = self.stored(shape);
        let dims = (shape.batch, shape.n_kv_heads, w);
        let name = format!("layer{layer}");
        let mut d = DiskKv::create(&tier.dir, &name, dims, dt, self.chunk, tier.io)?;
        d.ensure(tokens)?;
        let n = self.lens[layer] - self.bases[layer];
        if let Some(old) = self.layers[layer].as_ref().filter(|_| n > 0) {
            let all = HeadRange::new(0, shape.n_kv_heads);
            let span = ReadSpan::new(layer, all, TokenRange::new(0, n));
            let (k, v) = old.history(span, &mut self.traffic)?;
            self.traffic.count_written(d.write(&k, &v, 0, 0)?);
        }
        if let Some(old) = self.layers[layer].take() {
            old.release(link.engine());
        }
        self.layers[layer] = Some(Box::new(d));
        self.traffic.waited(t0.elapsed());
        Ok(())
    }

    /// Tokens `tokens` of heads `heads` (`g` of them) of `layer` as `(b,
    /// g, len, head_dim)` K and V on the host: views of RAM buffers, or read from disk
    /// (joined into one copy when the tokens span runs held by reference and the store:
    /// [`Self::history_pieces`] reads them without joining).
    pub fn history(
        &mut self,
        layer: usize,
        heads: HeadRange,
        tokens: TokenRange,
    ) -> Result<(Tensor, Tensor)> {
        let mut pieces = self.history_pieces(layer, heads, tokens)?;
        if pieces.len() == 1 {
            let p = pieces.remove(0);
            return Ok((p.k, p.v));
        }
        let ks: Vec<&Tensor> = pieces.iter().map(|p| &p.k).collect();
        let vs: Vec<&Tensor> = pieces.iter().map(|p| &p.v).collect();
        Ok((Tensor::cat(&ks, 2)?, Tensor::cat(&vs, 2)?))
    }

    /// Starts reading what [`history`](Self::history) will be asked for soon, on its own
    /// thread, if `layer` is on disk (nothing for a RAM layer, nor when [`READ_AHEAD`] reads
    /// are in flight already). Calls come in the order the reads will be asked for. The
    /// tokens must be written already: a read-ahead never races a write of its blocks.
    pub fn read_ahead(&mut self, layer: usize, heads: HeadRange, tokens: TokenRange) -> Result<()> {
        // (Runs held by reference are in RAM.)
        let from = tokens
            .start
            .max(self.shared.get(layer).map_or(0, LayerRuns::end));
        if from >= tokens.end() {
            return Ok(());
        }
        let own = TokenRange::new(from, tokens.end() - from);
        let span = ReadSpan::new(layer, heads, self.held(layer, own)?);
        match self.layers.get(layer).and_then(Option::as_ref) {
            Some(store) => store.read_ahead(span, &mut self.traffic),
            None => Ok(()),
        }
    }

    /// Writes `k`, `v` `(b, g, t, head_dim)` at `at`: queued on `link` behind the compute
    /// for a RAM layer (one job per sequence and head: one contiguous run each), written
    /// through for a disk layer. Counted device→host either way.
    pub fn write(&mut self, link: &mut Link, at: WriteAt, k: &Tensor, v: &Tensor) -> Result<()> {
        self.write_from(link, at, (k, v), KvCodec::Model)
    }

    /// [`Self::write`] of K/V stored as `from` on the device (`kv_dtype`: a demoted resident
    /// unit's history): kept as they are when this tier stores them alike — q8_0 blocks are
    /// not quantized twice — else decoded to the model's dtype and stored this tier's way.
    pub fn write_from(
        &mut self,
        link: &mut Link,
        at: WriteAt,
        (k, v): (&Tensor, &Tensor),
        from: KvCodec,
    ) -> Result<()> {
        // A smaller stored form is encoded on the device, before anything moves.
        let (k, v) = match (from, self.shape.as_ref()) {
            (KvCodec::Model, _) => (&self.codec.encode(k)?, &self.codec.encode(v)?),
            (_, Some(s)) => (
                &self.codec.recode(k, from, s.dtype, s.head_dim)?,
                &self.codec.recode(v, from, s.dtype, s.head_dim)?,
            ),
            (_, None) => {
                return Err(KvError::invariant(
                    "a write of stored K/V before the run's shape is known",
                ))
            }
        };
        let base = self.first_held(at.layer);
        let at = WriteAt {
            offset: at.offset.checked_sub(base).ok_or_else(|| {
                KvError::invariant(format!(
                    "layer {}: a write at {} before its first held position {base}",
                    at.layer, at.offset
                ))
            })?,
            ..at
        };
        match self.layers.get_mut(at.layer).and_then(Option::as_mut) {
            Some(store) => store.write(link, &mut self.traffic, at, k, v),
            None => Err(no_storage(at.layer)),
        }
    }

    /// The first position `layer`'s store holds (0 until a window dropped its front, or
    /// the end of the runs it holds by reference).
    pub fn first_held(&self, layer: usize) -> usize {
        self.bases.get(layer).copied().unwrap_or(0)
    }

    /// The run's shape, once known (from `prepare` or a step).
    pub fn known_shape(&self) -> Option<&KvShape> {
        self.shape.as_ref()
    }

    /// `tokens` of `layer` as its store addresses them (from its first held position).
    fn held(&self, layer: usize, tokens: TokenRange) -> Result<TokenRange> {
        let base = self.first_held(layer);
        if tokens.start < base {
            return Err(KvError::invariant(format!(
                "layer {layer}: tokens from {} asked for, but those before {base} were \
                 dropped (outside its window)",
                tokens.start
            )));
        }
        Ok(TokenRange::new(tokens.start - base, tokens.len))
    }

    /// `layer`'s RAM buffers with the position their first row holds, if it is in RAM
    /// (row `i` holds position `base + i`; `base` > 0 once a window dropped its front).
    pub fn ram_from(&self, layer: usize) -> Option<(&HostKv, usize)> {
        Some((self.ram(layer)?, self.first_held(layer)))
    }

    /// `layer`'s RAM buffers, if it is in RAM (row `i` holds position `i` only while
    /// [`Self::first_held`] is 0 — no window dropped, no runs held by reference; else see
    /// [`Self::ram_from`]).
    pub fn ram(&self, layer: usize) -> Option<&HostKv> {
        let store = self.layers.get(layer)?.as_ref()?;
        store.as_any().downcast_ref::<HostKv>()
    }

    /// Counts the step's `t` tokens as stored at `layer`.
    pub fn advance(&mut self, layer: usize, t: usize) {
        if let Some(l) = self.lens.get_mut(layer) {
            *l += t;
        }
    }

    /// The spec of `layer` if it holds exactly `pos` tokens in host storage: a layer whose
    /// history a prefetch for position `pos` may read.
    pub fn ready(&self, layer: usize, pos: usize) -> Option<&AttnSpec> {
        let stored = self.layers.get(layer).is_some_and(Option::is_some)
            || self.shared.get(layer).is_some_and(|r| r.end() > 0);
        match (self.lens.get(layer), self.specs.get(layer)) {
            (Some(&len), Some(Some(spec))) if len == pos && stored => Some(spec),
            _ => None,
        }
    }

    /// The widest visible history at `pos` over the layers seen (a global layer's among
    /// windowed ones, Gemma 2/3), at least `hist`.
    pub fn widest_history(&self, pos: usize, hist: usize) -> usize {
        self.specs
            .iter()
            .map(|s| s.as_ref().map_or(pos, |s| pos - s.window_start(pos)))
            .fold(hist, usize::max)
    }

    /// Tokens of the sequence (layer 0's count).
    pub fn seq_len(&self) -> usize {
        self.lens.first().copied().unwrap_or(0)
    }

    /// `stats` with the host tier's RAM bytes, the disk tier's file bytes and its traffic
    /// filled in.
    pub fn report(&self, stats: KvStats) -> KvStats {
        let disk = self.stores().map(|s| s.file_bytes()).sum();
        let stats = KvStats {
            host_kv_bytes: self.ram_bytes(),
            // The first layer's (all global layers hold the same runs).
            shared_kv_tokens: self
                .shared
                .iter()
                .map(|r| r.tokens() as u64)
                .max()
                .unwrap_or(0),
            disk_kv_bytes: disk,
            disk_direct_io: self.stores().any(|s| s.direct_io()),
            lossy: self
                .shape
                .as_ref()
                .is_some_and(|s| self.codec.lossy(s.dtype)),
            ..stats
        };
        self.traffic.report(stats, disk > 0)
    }

    /// Hands every buffer back to the engine, removes every file and forgets the sequence
    /// (the shape stays, with its layer count restarted).
    pub fn clear(&mut self, link: &mut Link) {
        self.traffic.clear();
        for store in self.layers.drain(..).flatten() {
            store.release(link.engine());
        }
        self.shared.clear();
        self.lens.clear();
        self.bases.clear();
        self.specs.clear();
        if let Some(s) = &mut self.shape {
            s.n_layers = 0;
        }
        self.book();
    }
}

impl Drop for HostLayers {
    /// The RAM this sequence held leaves the shared pool's books with it.
    fn drop(&mut self) {
        if let Some(p) = &self.pool {
            p.host.sub(self.booked);
        }
    }
}

#[cfg(test)]
mod tests;

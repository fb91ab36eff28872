//! The host tier: every layer's K/V in `(b, kv_heads, cap, head_dim)` buffers that grow in
//! large chunks through the transfer engine (so the CUDA one page-locks them), with the
//! tokens each layer holds and the attention spec it last ran with (HeadInfer §3.2: "the
//! full KV cache lives in CPU memory"). With a [`DiskTier`], a layer whose growth would take
//! the host tier past its budget moves to a file instead ([`DiskKv`]): reads and writes of
//! that layer go to disk, the rest stays in RAM.
use std::time::Instant;

use candle_core::{DType, Tensor};

use crate::disk::DiskKv;
use crate::disk_read::DiskRead;
use crate::link::{Direction, Link};
use crate::transfer::{grown_host, CopyJob};
use kvpolicy_core::round_up;
use kvpolicy_core::AttnSpec;
use kvpolicy_core::KvCodec;
use kvpolicy_core::{AttnStep, KvShape};
use kvpolicy_core::{HeadRange, KvError, Result, TokenRange};

use crate::disk_tier::DiskTier;
use kvpolicy_core::{KvStats, PolicyMetric};

/// One layer's K/V on the host tier: `(b, kv_heads, cap, head_dim)` each.
#[derive(Debug)]
pub struct HostKv {
    /// Keys.
    pub k: Tensor,
    /// Values.
    pub v: Tensor,
    /// Tokens the buffers hold room for.
    pub cap: usize,
}

/// Where one layer's host-tier K/V lives.
#[derive(Debug)]
pub enum HostStore {
    /// In host memory.
    Ram(HostKv),
    /// In a file of the disk tier.
    Disk(DiskKv),
}

/// Bytes a tensor's elements take.
pub fn tensor_bytes(t: &Tensor) -> u64 {
    (t.elem_count() * t.dtype().size_in_bytes()) as u64
}

/// What a read-ahead covers: heads and tokens of one layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct ReadSpan {
    layer: usize,
    heads: HeadRange,
    tokens: TokenRange,
}

/// Disk reads in flight at once, each on its own thread: the next units', so that the disk
/// has requests queued while the compute thread collects one, and a layer in RAM (which
/// reads nothing) leaves the disk busy with the next layer's. Side by side, not one after
/// another: this disk delivers more with several requests outstanding
/// (bench-results/2026-11-24-cpu-disk-tier.md).
pub const READ_AHEAD: usize = 3;

/// A read of the disk tier running on its own thread.
#[derive(Debug)]
struct ReadAhead {
    span: ReadSpan,
    thread: std::thread::JoinHandle<Result<(Tensor, Tensor)>>,
}

impl ReadAhead {
    /// Lets the read finish and drops what it read (it may hold files open or race a write).
    fn discard(self) {
        let _ = self.thread.join();
    }
}

/// Every layer's host-tier K/V with its length and last attention spec (module docs).
#[derive(Debug)]
pub struct HostLayers {
    /// Host buffers grow in chunks of this many tokens.
    chunk: usize,
    shape: Option<KvShape>,
    layers: Vec<Option<HostStore>>,
    lens: Vec<usize>,
    specs: Vec<Option<AttnSpec>>,
    disk: Option<DiskTier>,
    disk_read: u64,
    disk_written: u64,
    disk_s: f64,
    /// The disk reads started ahead of their use, in the order they will be asked for (the
    /// first stage of disk → host → device; at most [`READ_AHEAD`]).
    ahead: std::collections::VecDeque<ReadAhead>,
    /// Read-aheads started since the last clear.
    read_aheads: u64,
    /// How K/V are stored (the model's dtype, or LOSSY smaller forms).
    codec: KvCodec,
}

impl HostLayers {
    /// Host storage growing in chunks of 8 × the device growth step `grow_tokens` (host
    /// memory is plentiful, and each growth copies the layer), spilling to `disk` past its
    /// budget when given.
    pub fn new(grow_tokens: usize, disk: Option<DiskTier>) -> Self {
        Self {
            chunk: grow_tokens.max(1) * 8,
            shape: None,
            layers: Vec::new(),
            lens: Vec::new(),
            specs: Vec::new(),
            disk,
            disk_read: 0,
            disk_written: 0,
            disk_s: 0.0,
            ahead: Default::default(),
            read_aheads: 0,
            codec: KvCodec::Model,
        }
    }

    /// Stores K/V as `codec` says (LOSSY unless the model's dtype): what is written is
    /// encoded, and reads return the stored form ([`KvCodec::decode`] expands it).
    pub fn with_codec(mut self, codec: KvCodec) -> Self {
        self.codec = codec;
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
        (2 * shape.batch * heads * tokens) as u64
            * self.codec.row_bytes(shape.dtype, shape.head_dim)
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
        self.ensure(link, layer, shape, pos + step.k.dim(2)?)?;
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

    /// RAM bytes of K/V held.
    fn ram_bytes(&self) -> u64 {
        self.layers
            .iter()
            .flatten()
            .map(|s| match s {
                HostStore::Ram(h) => tensor_bytes(&h.k) + tensor_bytes(&h.v),
                HostStore::Disk(_) => 0,
            })
            .sum()
    }

    /// Grows `layer`'s storage to hold `tokens`. Queued copies may target the old buffers,
    /// so they land first; a completed prefetch stays valid (it read the unchanged prefix).
    /// A RAM layer whose growth would pass the disk tier's host budget moves to disk.
    pub fn ensure(
        &mut self,
        link: &mut Link,
        layer: usize,
        shape: &KvShape,
        tokens: usize,
    ) -> Result<()> {
        while self.layers.len() <= layer {
            self.layers.push(None);
            self.lens.push(0);
            self.specs.push(None);
        }
        let have = match &mut self.layers[layer] {
            Some(HostStore::Disk(d)) => {
                let t0 = Instant::now();
                d.ensure(tokens)?;
                self.disk_s += t0.elapsed().as_secs_f64();
                return Ok(());
            }
            Some(HostStore::Ram(h)) => h.cap,
            None => 0,
        };
        if tokens <= have {
            return Ok(());
        }
        link.wait_all()?;
        let cap = round_up(tokens, self.chunk);
        let old_bytes = match &self.layers[layer] {
            Some(HostStore::Ram(h)) => tensor_bytes(&h.k) + tensor_bytes(&h.v),
            _ => 0,
        };
        let ram = self.ram_bytes() - old_bytes + self.stored_bytes(shape, shape.n_kv_heads, cap);
        let spill = self.disk.as_ref().filter(|t| ram > t.host_budget);
        if let Some(tier) = spill.cloned() {
            return self.spill_to_disk(link, layer, shape, tokens, &tier);
        }
        self.codec.check(shape.head_dim)?;
        let (dt, w) = self.stored(shape);
        let dims = (shape.batch, shape.n_kv_heads, cap, w);
        let old = match self.layers[layer].take() {
            Some(HostStore::Ram(h)) => Some(h),
            _ => None,
        };
        let engine = link.engine();
        let k = grown_host(engine, old.as_ref().map(|o| &o.k), dims, 2, dt)?;
        let v = grown_host(engine, old.as_ref().map(|o| &o.v), dims, 2, dt)?;
        self.layers[layer] = Some(HostStore::Ram(HostKv { k, v, cap }));
        Ok(())
    }

    /// Moves `layer` (RAM or new) to a file holding `tokens`, its stored tokens copied over.
    fn spill_to_disk(
        &mut self,
        link: &mut Link,
        layer: usize,
        shape: &KvShape,
        tokens: usize,
        tier: &DiskTier,
    ) -> Result<()> {
        let t0 = Instant::now();
        let (dt, w) = self.stored(shape);
        let dims = (shape.batch, shape.n_kv_heads, w);
        let name = format!("layer{layer}");
        let mut d = DiskKv::create(&tier.dir, &name, dims, dt, self.chunk, tier.io)?;
        d.ensure(tokens)?;
        if let Some(HostStore::Ram(h)) = &self.layers[layer] {
            let n = self.lens[layer];
            if n > 0 {
                self.disk_written += d.write(&h.k.narrow(2, 0, n)?, &h.v.narrow(2, 0, n)?, 0, 0)?;
            }
        }
        if let Some(HostStore::Ram(h)) = self.layers[layer].take() {
            let _ = link.engine().host_release(&h.k);
            let _ = link.engine().host_release(&h.v);
        }
        self.layers[layer] = Some(HostStore::Disk(d));
        self.disk_s += t0.elapsed().as_secs_f64();
        Ok(())
    }

    /// Tokens `tokens` of heads `heads` (`g` of them) of `layer` as `(b,
    /// g, len, head_dim)` K and V on the host: views of RAM buffers, or read from disk.
    pub fn history(
        &mut self,
        layer: usize,
        heads: HeadRange,
        tokens: TokenRange,
    ) -> Result<(Tensor, Tensor)> {
        let (first_head, g, start, len) = (heads.first, heads.count, tokens.start, tokens.len);
        match self.layers.get(layer).and_then(Option::as_ref) {
            Some(HostStore::Ram(h)) => Ok((
                h.k.narrow(1, first_head, g)?.narrow(2, start, len)?,
                h.v.narrow(1, first_head, g)?.narrow(2, start, len)?,
            )),
            Some(HostStore::Disk(d)) => {
                let span = ReadSpan {
                    layer,
                    heads,
                    tokens,
                };
                let t0 = Instant::now();
                // Read-aheads queued before this one were not asked for: finished and
                // dropped (all of them when this read was not read ahead).
                let hit = self.ahead.iter().position(|a| a.span == span);
                let stale = hit.unwrap_or(self.ahead.len());
                self.ahead.drain(..stale).for_each(ReadAhead::discard);
                let (k, v) = match hit.and_then(|_| self.ahead.pop_front()) {
                    Some(a) => a
                        .thread
                        .join()
                        .map_err(|_| KvError::invariant("a disk read-ahead thread panicked"))??,
                    None => d.read((first_head, g), start, len)?,
                };
                self.disk_s += t0.elapsed().as_secs_f64();
                self.disk_read += tensor_bytes(&k) + tensor_bytes(&v);
                Ok((k, v))
            }
            None => Err(KvError::invariant(format!(
                "layer {layer} has no host storage"
            ))),
        }
    }

    /// Starts reading what [`history`](Self::history) will be asked for soon, on its own
    /// thread, if `layer` is on disk (nothing for a RAM layer, nor when [`READ_AHEAD`] reads
    /// are in flight already). Calls come in the order the reads will be asked for. The
    /// tokens must be written already: a read-ahead never races a write of its blocks.
    pub fn read_ahead(&mut self, layer: usize, heads: HeadRange, tokens: TokenRange) -> Result<()> {
        let span = ReadSpan {
            layer,
            heads,
            tokens,
        };
        if self.ahead.len() >= READ_AHEAD || self.ahead.iter().any(|a| a.span == span) {
            return Ok(());
        }
        let Some(HostStore::Disk(d)) = self.layers.get(layer).and_then(Option::as_ref) else {
            return Ok(());
        };
        let plan: DiskRead = d.plan_read((heads.first, heads.count), tokens.start, tokens.len)?;
        let thread = std::thread::Builder::new()
            .name("kv-disk-read".into())
            .spawn(move || plan.run())
            .map_err(|e| KvError::invariant(format!("cannot start a disk read thread: {e}")))?;
        self.ahead.push_back(ReadAhead { span, thread });
        self.read_aheads += 1;
        Ok(())
    }

    /// Writes `k`, `v` `(b, g, t, head_dim)` into `layer`'s heads from `first_head` on at
    /// token `offset`: queued on `link` behind the compute for a RAM layer (one job per
    /// sequence and head: one contiguous run each), written through for a disk layer. Counted
    /// device→host either way.
    pub fn write(
        &mut self,
        link: &mut Link,
        layer: usize,
        (k, v): (&Tensor, &Tensor),
        first_head: usize,
        offset: usize,
    ) -> Result<()> {
        // A smaller stored form is encoded on the device, before anything moves.
        let (k, v) = (&self.codec.encode(k)?, &self.codec.encode(v)?);
        match self.layers.get_mut(layer).and_then(Option::as_mut) {
            Some(HostStore::Ram(host)) => {
                let (batch, heads) = (k.dim(0)?, k.dim(1)?);
                let mut jobs = Vec::with_capacity(2 * batch * heads);
                for bi in 0..batch {
                    for j in 0..heads {
                        for (src, dst) in [(k, &host.k), (v, &host.v)] {
                            jobs.push(CopyJob {
                                src: src.narrow(0, bi, 1)?.narrow(1, j, 1)?,
                                dst: dst.narrow(0, bi, 1)?.narrow(1, first_head + j, 1)?,
                                dim: 2,
                                offset,
                            });
                        }
                    }
                }
                link.submit(jobs, Direction::D2h)?;
                Ok(())
            }
            Some(HostStore::Disk(d)) => {
                let t0 = Instant::now();
                // A read-ahead of these blocks planned before this write would find their
                // headers changed: it is finished and dropped first (callers read ahead
                // only what they wrote, so this is a guard).
                let heads = HeadRange::new(first_head, k.dim(1)?);
                let (stale, keep): (Vec<_>, Vec<_>) = self
                    .ahead
                    .drain(..)
                    .partition(|a| a.span.layer == layer && a.span.heads.overlaps(&heads));
                self.ahead = keep.into();
                stale.into_iter().for_each(ReadAhead::discard);
                let n = d.write(k, v, first_head, offset)?;
                self.disk_s += t0.elapsed().as_secs_f64();
                self.disk_written += n;
                link.count(n, Direction::D2h);
                Ok(())
            }
            None => Err(KvError::invariant(format!(
                "layer {layer} has no host storage"
            ))),
        }
    }

    /// `layer`'s RAM buffers, if it is in RAM.
    pub fn ram(&self, layer: usize) -> Option<&HostKv> {
        match self.layers.get(layer).and_then(Option::as_ref) {
            Some(HostStore::Ram(h)) => Some(h),
            _ => None,
        }
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
        let stored = self.layers.get(layer).is_some_and(Option::is_some);
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
        let files = || {
            self.layers.iter().flatten().filter_map(|s| match s {
                HostStore::Disk(d) => Some(d),
                HostStore::Ram(_) => None,
            })
        };
        let disk = files().map(DiskKv::bytes).sum();
        let mut stats = KvStats {
            host_kv_bytes: self.ram_bytes(),
            disk_kv_bytes: disk,
            disk_read_bytes: self.disk_read,
            disk_write_bytes: self.disk_written,
            disk_wait_s: self.disk_s,
            disk_direct_io: files().any(DiskKv::direct_io),
            lossy: self
                .shape
                .as_ref()
                .is_some_and(|s| self.codec.lossy(s.dtype)),
            ..stats
        };
        if disk > 0 {
            stats.set_metric(PolicyMetric::counter(
                "disk_read_aheads",
                self.read_aheads as f64,
                "reads",
            ));
        }
        stats
    }

    /// Hands every buffer back to the engine, removes every file and forgets the sequence
    /// (the shape stays, with its layer count restarted).
    pub fn clear(&mut self, link: &mut Link) {
        self.ahead.drain(..).for_each(ReadAhead::discard);
        self.read_aheads = 0;
        for s in self.layers.drain(..).flatten() {
            if let HostStore::Ram(h) = s {
                let _ = link.engine().host_release(&h.k);
                let _ = link.engine().host_release(&h.v);
            }
        }
        self.lens.clear();
        self.specs.clear();
        self.disk_read = 0;
        self.disk_written = 0;
        self.disk_s = 0.0;
        if let Some(s) = &mut self.shape {
            s.n_layers = 0;
        }
    }
}

impl Drop for HostLayers {
    /// Joins the reads still ahead, so that the files they hold open close with the tier.
    fn drop(&mut self) {
        self.ahead.drain(..).for_each(ReadAhead::discard);
    }
}

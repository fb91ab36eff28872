//! The block manager (HybridServe §4.1): the three pools — activation blocks on the device
//! (preferred), activation blocks that overflowed to the host, K/V blocks on the host — and
//! one [`BlockTable`] per request. It allocates a request's blocks as it grows (K/V or
//! activation by the request's share, an activation block on the device while its pool has
//! room), writes a step's new tokens into them, answers which rows of which pool hold a
//! request's tokens, and gives the slots back when the request ends.
use std::collections::BTreeMap;

use candle_core::{DType, Device, Tensor};
use kvpolicy_core::{AttnStep, KvError, Result};
use kvpolicy_tiered::{CopyJob, Direction, Link, TransferEngine};

use crate::blocks::{BlockRef, BlockTable, Kind, Pool, PoolLayout, Rows, Tier};
use crate::ratio::is_kv_block;

/// The three pools (see the module docs).
#[derive(Debug)]
struct Pools {
    dev_act: Pool,
    host_act: Pool,
    host_kv: Pool,
}

impl Pools {
    fn get(&self, kind: Kind, tier: Tier) -> &Pool {
        match (kind, tier) {
            (Kind::Act, Tier::Device) => &self.dev_act,
            (Kind::Act, Tier::Host) => &self.host_act,
            (Kind::Kv, _) => &self.host_kv,
        }
    }

    fn get_mut(&mut self, kind: Kind, tier: Tier) -> &mut Pool {
        match (kind, tier) {
            (Kind::Act, Tier::Device) => &mut self.dev_act,
            (Kind::Act, Tier::Host) => &mut self.host_act,
            (Kind::Kv, _) => &mut self.host_kv,
        }
    }

    fn all(&mut self) -> [&mut Pool; 3] {
        [&mut self.dev_act, &mut self.host_act, &mut self.host_kv]
    }
}

/// What the pools are sized for.
#[derive(Debug, Clone, Copy)]
pub struct PoolSpec {
    /// Element type of every pool.
    pub dtype: DType,
    /// Layers of the model.
    pub n_layers: usize,
    /// Width of an activation row (the model's hidden size).
    pub hidden: usize,
    /// Width of a K/V row (`n_kv_heads · head_dim`).
    pub kv_width: usize,
    /// Activation blocks the device pool may hold (`None`: unbounded).
    pub device_blocks: Option<usize>,
}

/// Pools and block tables (see the module docs).
#[derive(Debug)]
pub struct BlockManager {
    device: Device,
    /// Tokens per block.
    block: usize,
    pools: Option<Pools>,
    seqs: BTreeMap<usize, BlockTable>,
}

impl BlockManager {
    /// No pools yet; blocks of `block` tokens, activation blocks on `device`.
    pub fn new(device: &Device, block: usize) -> Self {
        Self {
            device: device.clone(),
            block,
            pools: None,
            seqs: BTreeMap::new(),
        }
    }

    /// Tokens per block.
    pub fn block(&self) -> usize {
        self.block
    }

    /// Requests holding blocks.
    pub fn len(&self) -> usize {
        self.seqs.len()
    }

    /// Whether no request holds blocks.
    pub fn is_empty(&self) -> bool {
        self.seqs.is_empty()
    }

    /// Sets the block size; only while no request holds blocks.
    pub fn set_block(&mut self, block: usize) {
        if self.seqs.is_empty() {
            self.block = block;
        }
    }

    /// Pools for `spec`: kept (with layers added) while requests hold blocks, made afresh
    /// otherwise.
    pub fn size(&mut self, spec: PoolSpec, engine: &mut dyn TransferEngine) -> Result<()> {
        if self.seqs.is_empty() {
            self.release_all(engine);
            self.pools = None;
        }
        match &mut self.pools {
            Some(p) => {
                for pool in p.all() {
                    pool.ensure_layers(spec.n_layers, engine)?;
                }
            }
            None => {
                let layout = |width| PoolLayout {
                    dtype: spec.dtype,
                    block: self.block,
                    width,
                    n_layers: spec.n_layers,
                };
                let (dev, host) = (&self.device, &Device::Cpu);
                self.pools = Some(Pools {
                    dev_act: Pool::new(
                        Kind::Act,
                        Tier::Device,
                        dev,
                        layout(spec.hidden),
                        spec.device_blocks,
                    ),
                    host_act: Pool::new(Kind::Act, Tier::Host, host, layout(spec.hidden), None),
                    host_kv: Pool::new(Kind::Kv, Tier::Host, host, layout(spec.kv_width), None),
                });
            }
        }
        Ok(())
    }

    /// Hands every pool's allocation back (host buffers to the engine).
    pub fn release_all(&mut self, engine: &mut dyn TransferEngine) {
        if let Some(p) = &mut self.pools {
            for pool in p.all() {
                pool.release_all(engine);
            }
        }
    }

    /// Forgets every request and frees the pools' contents.
    pub fn clear(&mut self, engine: &mut dyn TransferEngine) {
        self.seqs.clear();
        self.release_all(engine);
    }

    /// A request's block table.
    pub fn table(&self, seq: usize) -> Option<&BlockTable> {
        self.seqs.get(&seq)
    }

    /// Starts request `seq` with a share `kv_share` of K/V blocks.
    pub fn open(&mut self, seq: usize, kv_share: f64) {
        self.seqs.entry(seq).or_insert(BlockTable {
            blocks: Vec::new(),
            tokens: 0,
            kv_share,
        });
    }

    /// Tokens `seq` holds (0 for an unknown one).
    pub fn tokens(&self, seq: usize) -> usize {
        self.seqs.get(&seq).map_or(0, |t| t.tokens)
    }

    /// Records that `seq` holds `tokens`.
    pub fn set_tokens(&mut self, seq: usize, tokens: usize) {
        if let Some(t) = self.seqs.get_mut(&seq) {
            t.tokens = tokens;
        }
    }

    /// The longest request's tokens.
    pub fn longest(&self) -> usize {
        self.seqs.values().map(|s| s.tokens).max().unwrap_or(0)
    }

    /// Blocks for tokens up to `upto` of `seq`: K/V blocks on the host, activation blocks
    /// on the device while its pool has room, then on the host.
    pub fn allocate(
        &mut self,
        seq: usize,
        upto: usize,
        engine: &mut dyn TransferEngine,
    ) -> Result<()> {
        let block = self.block;
        let (Some(pools), Some(table)) = (self.pools.as_mut(), self.seqs.get_mut(&seq)) else {
            return Err(KvError::invariant(format!(
                "sequence {seq} has no block table"
            )));
        };
        while table.blocks.len() * block < upto {
            let i = table.blocks.len();
            let kind = if is_kv_block(i, table.kv_share) {
                Kind::Kv
            } else {
                Kind::Act
            };
            let tier = match kind {
                Kind::Act if pools.dev_act.has_room() => Tier::Device,
                _ => Tier::Host,
            };
            let slot = pools.get_mut(kind, tier).take(engine)?;
            table.blocks.push(BlockRef { kind, tier, slot });
        }
        Ok(())
    }

    /// Ends request `seq`: its slots go back to their pools.
    pub fn release(&mut self, seq: usize) {
        if let (Some(table), Some(pools)) = (self.seqs.remove(&seq), self.pools.as_mut()) {
            for b in table.blocks {
                pools.get_mut(b.kind, b.tier).give_back(b.slot);
            }
        }
    }

    /// Pool rows of `seq`'s tokens `0..upto` stored as `kind` on `tier`.
    pub fn rows(&self, seq: usize, upto: usize, kind: Kind, tier: Tier) -> Rows {
        match self.seqs.get(&seq) {
            Some(t) => t.rows(upto, self.block, kind, tier),
            None => Rows::default(),
        }
    }

    /// The pool of `kind` on `tier`.
    pub fn pool(&self, kind: Kind, tier: Tier) -> Result<&Pool> {
        self.pools
            .as_ref()
            .map(|p| p.get(kind, tier))
            .ok_or_else(|| KvError::invariant("the block pools are not sized"))
    }

    /// Blocks of `kind` over every request.
    pub fn count(&self, kind: Kind) -> u64 {
        self.seqs
            .values()
            .flat_map(|s| &s.blocks)
            .filter(|b| b.kind == kind)
            .count() as u64
    }

    /// Device bytes of the activation pool.
    pub fn device_bytes(&self) -> u64 {
        self.pools.as_ref().map_or(0, |p| p.dev_act.bytes())
    }

    /// Host bytes of the two host pools.
    pub fn host_bytes(&self) -> u64 {
        self.pools
            .as_ref()
            .map_or(0, |p| p.host_act.bytes() + p.host_kv.bytes())
    }

    /// Activation blocks held on the device.
    pub fn device_blocks(&self) -> u64 {
        self.pools.as_ref().map_or(0, |p| p.dev_act.used() as u64)
    }

    /// Writes the step's new tokens into their blocks at this layer (K/V rows or X rows),
    /// synchronously, before any later gather can read them; host-bound bytes are counted
    /// on `link`.
    pub fn write_back(&self, step: &AttnStep<'_>, link: &mut Link) -> Result<()> {
        let t = step.k.dim(2)?;
        let block = self.block;
        let Some(table) = self.seqs.get(&step.seq) else {
            return Err(KvError::invariant(format!(
                "sequence {} has no block table",
                step.seq
            )));
        };
        // Rows of the step as (t, width) matrices.
        let k = step.k.squeeze(0)?.transpose(0, 1)?.flatten_from(1)?;
        let v = step.v.squeeze(0)?.transpose(0, 1)?.flatten_from(1)?;
        let x = step.x.squeeze(0)?;
        let mut p = step.pos;
        let mut d2h = 0;
        while p < step.pos + t {
            let b = table
                .blocks
                .get(p / block)
                .ok_or_else(|| KvError::invariant(format!("token {p} has no block")))?;
            let in_block = p % block;
            let n = (block - in_block).min(step.pos + t - p);
            let row = b.slot * block + in_block;
            let j = p - step.pos;
            let srcs: [Option<&Tensor>; 2] = match b.kind {
                Kind::Kv => [Some(&k), Some(&v)],
                Kind::Act => [Some(&x), None],
            };
            let pool = self.pool(b.kind, b.tier)?;
            for (q, src) in srcs.into_iter().enumerate() {
                let Some(src) = src else { continue };
                let job = CopyJob {
                    src: src.narrow(0, j, n)?,
                    dst: pool.tensor(step.layer, q)?.clone(),
                    dim: 0,
                    offset: row,
                };
                if b.tier == Tier::Host {
                    d2h += job.bytes();
                }
                job.run()?;
            }
            p += n;
        }
        link.count(d2h, Direction::D2h);
        Ok(())
    }
}

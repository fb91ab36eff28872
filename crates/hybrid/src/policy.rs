//! The `hybrid` policy's runtime (HybridServe §4): per request a block table of K/V and
//! activation blocks; per layer and mini-batch, the host-resident K/V (and any activation
//! blocks that overflowed to the host) cross the link while the device regenerates K/V
//! from its resident activation blocks; each request then attends over its own cache.
//!
//! * **Staging.** A *unit* is one mini-batch at one layer. Its host rows are gathered and
//!   queued on the transfer engine in one batch; the next unit (the next mini-batch, or
//!   the first one at the next layer — the column-by-column order) is queued as soon as
//!   this one is, so its transfer overlaps this unit's regeneration and attention
//!   (ping-pong: at most two units staged on the device).
//! * **Assembly.** A request's cached K/V are the transferred rows and the regenerated
//!   rows, put back in token order by one gather, then the step's own K/V; the attention
//!   is [`kvpolicy_core::attend`], the same call `full` makes, so results are exact.
//! * **Write-back.** The step's new tokens go into their blocks for this layer (K/V rows
//!   or X rows), synchronously, before any later gather can read them.
use std::collections::{BTreeMap, HashMap};

use candle_core::{Device, Tensor};
use kvpolicy_core::{
    attend_partial, engine_for, AttnStep, CopyJob, KvError, KvPolicy, KvShape, KvStats,
    PolicyOptions, Probe, Profile, Result, SeqLoad, Ticket, TransferEngine,
};

use crate::blocks::{BlockRef, BlockTable, Kind, Pool, PoolLayout, Rows, Tier};
use crate::pack::{pack, Load};
use crate::ratio::{check_share, is_kv_block, Costs, LinearCost};

/// Token counts the profiler probes to fit the linear cost models.
const PROBE_TOKENS: [usize; 3] = [16, 64, 256];

/// The three pools: activations on the device (preferred), activations that overflowed to
/// the host, and K/V on the host.
#[derive(Debug)]
struct Pools {
    dev_act: Pool,
    host_act: Pool,
    host_kv: Pool,
}

impl Pools {
    fn get(&mut self, kind: Kind, tier: Tier) -> &mut Pool {
        match (kind, tier) {
            (Kind::Act, Tier::Device) => &mut self.dev_act,
            (Kind::Act, Tier::Host) => &mut self.host_act,
            (Kind::Kv, _) => &mut self.host_kv,
        }
    }
}

/// One request's host rows of one layer, copied (or being copied) to the device.
#[derive(Debug)]
struct Staged {
    ticket: Ticket,
    /// Tokens cached when it was staged (a later step makes it stale).
    cached: usize,
    /// K/V rows `(n, n_kv·head_dim)` each, with their positions.
    kv: Option<(Tensor, Tensor)>,
    kv_pos: Vec<usize>,
    /// X rows `(n, hidden)` of host activation blocks, with their positions.
    x: Option<Tensor>,
    x_pos: Vec<usize>,
    bytes: u64,
}

/// Activation-hybrid cache (HybridServe): see the crate docs.
pub struct HybridPolicy {
    device: Device,
    budget: Option<u64>,
    /// Tokens per block for this run: `--block-size`, bounded by the longest request.
    block: usize,
    /// Tokens per block as asked (`--block-size`).
    block_asked: usize,
    forced_share: Option<f64>,
    given_profile: Option<Profile>,
    link: Option<f64>,
    engine: Box<dyn TransferEngine>,
    /// `engine.copy_seconds()` at the last reset (stats count from there).
    copy_base: f64,
    shape: Option<KvShape>,
    costs: Option<Costs>,
    profile: Option<Profile>,
    pools: Option<Pools>,
    /// Bytes one unit may stage (`None` = unbounded: one mini-batch).
    unit_cap: Option<u64>,
    seqs: BTreeMap<usize, BlockTable>,
    /// The last plan: mini-batches of sequence slots, with each sequence's load.
    plan: Vec<Vec<usize>>,
    loads: HashMap<usize, SeqLoad>,
    staged: HashMap<(usize, usize), Staged>,
    staged_bytes: u64,
    device_peak: u64,
    stats: KvStats,
}

impl std::fmt::Debug for HybridPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HybridPolicy")
            .field("block", &self.block)
            .field("forced_share", &self.forced_share)
            .field("seqs", &self.seqs.len())
            .finish()
    }
}

fn invalid(message: String) -> KvError {
    KvError::InvalidOption {
        policy: "hybrid".into(),
        message,
    }
}

impl HybridPolicy {
    /// A policy from options (`block_size`, `kv_act_ratio`, `device_kv_budget`, `profile`,
    /// `link_bandwidth`).
    pub fn new(opts: &PolicyOptions) -> Result<Self> {
        if opts.block_size == 0 {
            return Err(invalid(
                "--block-size 0: a block holds at least one token (the default is 16)".into(),
            ));
        }
        let forced_share = opts.kv_act_ratio.map(check_share).transpose()?;
        Ok(Self {
            device: opts.device.clone(),
            budget: opts.device_kv_budget,
            block: opts.block_size,
            block_asked: opts.block_size,
            forced_share,
            given_profile: opts.profile.clone(),
            link: opts.link_bandwidth,
            engine: engine_for(&opts.device, opts.link_bandwidth)?,
            copy_base: 0.0,
            shape: None,
            costs: None,
            profile: None,
            pools: None,
            unit_cap: None,
            seqs: BTreeMap::new(),
            plan: Vec::new(),
            loads: HashMap::new(),
            staged: HashMap::new(),
            staged_bytes: 0,
            device_peak: 0,
            stats: KvStats::default(),
        })
    }

    /// Uses `engine` for host→device copies instead of the default one (tests inject
    /// failures this way).
    pub fn with_engine(mut self, engine: Box<dyn TransferEngine>) -> Self {
        self.copy_base = engine.copy_seconds();
        self.engine = engine;
        self
    }

    /// The cost models in use, once known.
    pub fn costs(&self) -> Option<&Costs> {
        self.costs.as_ref()
    }

    /// A request's block table.
    pub fn table(&self, seq: usize) -> Option<&BlockTable> {
        self.seqs.get(&seq)
    }

    fn kv_row_bytes(shape: &KvShape) -> u64 {
        (2 * shape.n_kv_heads * shape.head_dim * shape.dtype.size_in_bytes()) as u64
    }

    fn x_row_bytes(shape: &KvShape) -> u64 {
        (shape.hidden * shape.dtype.size_in_bytes()) as u64
    }

    fn device_bytes(&self) -> u64 {
        self.pools.as_ref().map_or(0, |p| p.dev_act.bytes()) + self.staged_bytes
    }

    fn note_device(&mut self) {
        self.device_peak = self.device_peak.max(self.device_bytes());
    }

    /// Sizes the pools and the staging area for `shape` (HybridServe's allocation: the
    /// device holds activation blocks and the staging of two units; K/V live on the host).
    fn setup(&mut self, shape: &KvShape) -> Result<()> {
        // A block longer than the longest request holds that request whole either way; a
        // longer one would only reserve memory no token uses (and a huge one overflow the
        // pool sizes), so the run's length bounds it. Pools holding blocks keep theirs.
        if self.seqs.is_empty() {
            self.block = self.block_asked.min(shape.max_tokens.max(1));
        }
        let kv_w = shape.n_kv_heads * shape.head_dim;
        let one_request = shape.max_tokens as u64 * Self::kv_row_bytes(shape);
        let mut dev_limit = None;
        self.unit_cap = None;
        if let Some(full_budget) = self.budget {
            // A step's attention scratch and activations come first; of the rest, half (at
            // least two units of the longest request) stages transfers, the rest holds
            // activation blocks.
            let scratch =
                shape.step_scratch_bytes(shape.n_kv_heads, shape.max_tokens, &self.device);
            if scratch >= full_budget {
                return Err(KvError::BudgetExceeded {
                    what: "a step's attention scratch and activations".into(),
                    needed: scratch,
                    budget: full_budget,
                    in_use: 0,
                    hint: "raise --device-kv-budget or use a smaller --prefill-chunk",
                });
            }
            let budget = full_budget - scratch;
            let staging = (2 * one_request).max(budget / 2);
            if staging > budget {
                return Err(KvError::BudgetExceeded {
                    what: format!(
                        "staging one layer of the longest request ({} tokens) twice",
                        shape.max_tokens
                    ),
                    needed: staging,
                    budget,
                    in_use: 0,
                    hint: "raise --device-kv-budget or shorten the requests",
                });
            }
            let act_slot =
                (shape.n_layers.max(1) as u64 * self.block as u64 * Self::x_row_bytes(shape))
                    .max(1);
            dev_limit = Some(((budget - staging) / act_slot) as usize);
            self.unit_cap = Some(staging / 2);
        }
        let (b, dt, n) = (self.block, shape.dtype, shape.n_layers);
        let host = Device::Cpu;
        let same_rows = self.shape.as_ref().is_some_and(|s| {
            (s.n_kv_heads, s.head_dim, s.hidden, s.dtype)
                == (shape.n_kv_heads, shape.head_dim, shape.hidden, shape.dtype)
        });
        if self.seqs.is_empty() {
            // Nothing cached: size everything afresh (a new run, or a new model).
            self.clear_staged();
            self.release_pools();
            self.pools = None;
            if !same_rows {
                self.costs = None;
                self.profile = None;
            }
        }
        match &mut self.pools {
            Some(p) => {
                for pool in [&mut p.dev_act, &mut p.host_act, &mut p.host_kv] {
                    pool.ensure_layers(n, self.engine.as_mut())?;
                }
            }
            None => {
                let layout = |width| PoolLayout {
                    dtype: dt,
                    block: b,
                    width,
                    n_layers: n,
                };
                self.pools = Some(Pools {
                    dev_act: Pool::new(
                        Kind::Act,
                        Tier::Device,
                        &self.device,
                        layout(shape.hidden),
                        dev_limit,
                    ),
                    host_act: Pool::new(Kind::Act, Tier::Host, &host, layout(shape.hidden), None),
                    host_kv: Pool::new(Kind::Kv, Tier::Host, &host, layout(kv_w), None),
                });
            }
        }
        self.shape = Some(shape.clone());
        Ok(())
    }

    /// Fits the cost models: from `--profile` (lines through the origin), or by probing
    /// transfers and regenerations of 16, 64 and 256 tokens and fitting lines.
    fn ensure_costs(&mut self, step: &AttnStep<'_>, shape: &KvShape) -> Result<()> {
        if self.costs.is_some() {
            return Ok(());
        }
        let (kvb, xb) = (Self::kv_row_bytes(shape), Self::x_row_bytes(shape));
        let costs = match &self.given_profile {
            Some(p) => Costs::from_profile(p, kvb, xb),
            None => {
                let (mut tp, mut rp) = (Vec::new(), Vec::new());
                for tokens in PROBE_TOKENS {
                    let probe = Probe {
                        device: &self.device,
                        batch: 1,
                        hidden: shape.hidden,
                        dtype: shape.dtype,
                        transfer_bytes: tokens * kvb as usize,
                        tokens,
                        link: self.link,
                    };
                    let p = Profile::measure_cached(&probe, self.engine.as_mut(), step.regen)?;
                    tp.push((tokens as f64, p.transfer_s((tokens as u64 * kvb) as f64)));
                    rp.push((tokens as f64, p.recompute_s(tokens as f64)));
                }
                Costs {
                    kv_bytes: kvb,
                    x_bytes: xb,
                    transfer: LinearCost::fit_or_rate(&tp),
                    recompute: LinearCost::fit_or_rate(&rp),
                }
            }
        };
        self.profile = Some(Profile {
            h2d_bytes_per_s: kvb as f64 / costs.transfer.per_token_s,
            recompute_tokens_per_s: 1.0 / costs.recompute.per_token_s,
            device: Some(format!("{:?}", self.device.location())),
            shape: Some(format!(
                "hybrid: transfer {:.3e} s + {:.3e} s/token, recompute {:.3e} s + {:.3e} s/token",
                costs.transfer.fixed_s,
                costs.transfer.per_token_s,
                costs.recompute.fixed_s,
                costs.recompute.per_token_s
            )),
        });
        self.costs = Some(costs);
        Ok(())
    }

    /// Drops every pool's allocation (host buffers back to the engine).
    fn release_pools(&mut self) {
        if let Some(p) = &mut self.pools {
            for pool in [&mut p.dev_act, &mut p.host_act, &mut p.host_kv] {
                pool.release_all(self.engine.as_mut());
            }
        }
    }

    /// The share of K/V blocks a new request is kept at.
    fn share_for(&self, tokens: usize) -> f64 {
        match (self.forced_share, &self.costs) {
            (Some(s), _) => s,
            (None, Some(c)) => c.balanced_share(tokens, self.block),
            (None, None) => 1.0,
        }
    }

    /// Blocks for tokens up to `upto` of `seq`: K/V blocks on the host, activation blocks
    /// on the device while its pool has room, then on the host.
    fn allocate(&mut self, seq: usize, upto: usize) -> Result<()> {
        let block = self.block;
        let (Some(pools), Some(table)) = (self.pools.as_mut(), self.seqs.get_mut(&seq)) else {
            return Err(KvError::Step(format!("sequence {seq} has no block table")));
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
            let slot = pools.get(kind, tier).take(self.engine.as_mut())?;
            table.blocks.push(BlockRef { kind, tier, slot });
        }
        self.note_device();
        Ok(())
    }

    /// Host rows of tokens `0..cached` of `seq` at `layer`, gathered and queued for the
    /// device.
    /// A prefetch that would overfill the staging area (two units) is skipped; a unit that
    /// is needed now first evicts what was prefetched if it must.
    fn stage_one(
        &mut self,
        layer: usize,
        seq: usize,
        cached: usize,
        prefetch: bool,
    ) -> Result<Option<Staged>> {
        let block = self.block;
        let (kv_rows, x_rows) = match self.seqs.get(&seq) {
            Some(t) => (
                t.rows(cached, block, Kind::Kv, Tier::Host),
                t.rows(cached, block, Kind::Act, Tier::Host),
            ),
            None => return Ok(None),
        };
        if let (Some(cap), Some(shape)) = (self.unit_cap, &self.shape) {
            let need = kv_rows.rows.len() as u64 * Self::kv_row_bytes(shape)
                + x_rows.rows.len() as u64 * Self::x_row_bytes(shape);
            if self.staged_bytes + need > 2 * cap {
                if prefetch {
                    return Ok(None);
                }
                self.clear_staged();
            }
        }
        let Some(pools) = self.pools.as_ref() else {
            return Ok(None);
        };
        let mut jobs = Vec::new();
        let mut bytes = 0;
        // One copy job per run of consecutive pool rows (a block, or neighbouring slots):
        // the worker reads the pool directly, nothing is gathered on the compute thread.
        let mut gather = |pool: &Pool, j: usize, rows: &Rows| -> Result<Option<Tensor>> {
            if rows.rows.is_empty() {
                return Ok(None);
            }
            let src = pool.tensor(layer, j)?;
            let shape = (rows.rows.len(), src.dim(1)?);
            // SAFETY: the runs below cover every row of `dst`, and `dst` is read only after
            // waiting on this batch's ticket, which fails if any copy did; an uninitialised
            // row is therefore never read (zeroing it would cost a pass over the buffer).
            let dst = unsafe { Tensor::empty(shape, src.dtype(), &self.device)? };
            let mut start = 0;
            while start < rows.rows.len() {
                let mut end = start + 1;
                while end < rows.rows.len() && rows.rows[end] == rows.rows[end - 1] + 1 {
                    end += 1;
                }
                let job = CopyJob {
                    src: src.narrow(0, rows.rows[start] as usize, end - start)?,
                    dst: dst.clone(),
                    dim: 0,
                    offset: start,
                };
                bytes += job.bytes();
                jobs.push(job);
                start = end;
            }
            Ok(Some(dst))
        };
        let k = gather(&pools.host_kv, 0, &kv_rows)?;
        let v = gather(&pools.host_kv, 1, &kv_rows)?;
        let x = gather(&pools.host_act, 0, &x_rows)?;
        let ticket = self.engine.submit(jobs)?;
        self.stats.h2d_bytes += bytes;
        self.staged_bytes += bytes;
        self.note_device();
        Ok(Some(Staged {
            ticket,
            cached,
            kv: k.zip(v),
            kv_pos: kv_rows.positions,
            x,
            x_pos: x_rows.positions,
            bytes,
        }))
    }

    /// Stages `members` (sequence, tokens cached) at `layer`, skipping those staged.
    fn stage_unit(
        &mut self,
        layer: usize,
        members: &[(usize, usize)],
        prefetch: bool,
    ) -> Result<()> {
        for &(seq, cached) in members {
            if self.staged.contains_key(&(layer, seq)) || cached == 0 {
                continue;
            }
            if let Some(s) = self.stage_one(layer, seq, cached, prefetch)? {
                self.staged.insert((layer, seq), s);
            }
        }
        Ok(())
    }

    /// `group`'s members with the tokens each has cached at this step (`grown`: at the
    /// next one, this step's tokens included).
    fn members(&self, group: &[usize], grown: bool) -> Vec<(usize, usize)> {
        group
            .iter()
            .filter_map(|s| {
                self.loads
                    .get(s)
                    .map(|l| (*s, if grown { l.cached + l.new } else { l.cached }))
            })
            .collect()
    }

    /// The members of the unit of `seq` (which has `cached` tokens) at this step.
    fn unit_of(&self, seq: usize, cached: usize) -> Vec<(usize, usize)> {
        match self.plan.iter().find(|g| g.contains(&seq)) {
            Some(g) => self
                .members(g, false)
                .into_iter()
                .map(|(s, c)| (s, if s == seq { cached } else { c }))
                .collect(),
            None => vec![(seq, cached)],
        }
    }

    /// The unit after the one of `seq` at `layer`, column by column: the next mini-batch,
    /// else the first one at the next layer, else — after the last layer — the first one
    /// at layer 0 of the next step (its tokens then include this step's; from layer 1 on, when
    /// those rows are written). Without a plan ([`KvPolicy::plan`] not called) a unit is
    /// one sequence, prefetched only when it is the only one.
    fn next_unit(
        &self,
        layer: usize,
        seq: usize,
        cached: usize,
        new: usize,
    ) -> (usize, Vec<(usize, usize)>) {
        let n_layers = self.shape.as_ref().map_or(0, |s| s.n_layers);
        let at = |g: &Vec<usize>, grown: bool| self.members(g, grown);
        // The next step's layer-0 rows of this step's tokens exist once layer 0 is done
        // for every sequence, i.e. from layer 1 on.
        let wrap = layer > 0;
        let Some(g) = self.plan.iter().position(|g| g.contains(&seq)) else {
            // Unplanned sequences side by side would each hold a prefetch: only a lone
            // sequence prefetches, so at most two units are ever staged.
            if self.seqs.len() > 1 {
                return (layer, Vec::new());
            }
            return match () {
                _ if layer + 1 < n_layers => (layer + 1, vec![(seq, cached)]),
                _ if wrap => (0, vec![(seq, cached + new)]),
                _ => (layer, Vec::new()),
            };
        };
        match (self.plan.get(g + 1), self.plan.first()) {
            (Some(next), _) => (layer, at(next, false)),
            (None, Some(first)) if layer + 1 < n_layers => (layer + 1, at(first, false)),
            (None, Some(first)) if wrap => (0, at(first, true)),
            _ => (layer, Vec::new()),
        }
    }

    fn drop_staged(&mut self, s: &Staged) {
        self.staged_bytes = self.staged_bytes.saturating_sub(s.bytes);
    }

    fn clear_staged(&mut self) {
        let _ = self.engine.wait_all();
        for (_, s) in std::mem::take(&mut self.staged) {
            self.drop_staged(&s);
        }
    }

    /// This step's cached K/V of `seq` at `layer`, in token order:
    /// `(1, n_kv, cached, head_dim)` each, or `None` when nothing is cached.
    fn cached_kv(
        &mut self,
        step: &AttnStep<'_>,
        cached: usize,
    ) -> Result<Option<(Tensor, Tensor)>> {
        if cached == 0 {
            return Ok(None);
        }
        let key = (step.layer, step.seq);
        let staged = match self.staged.remove(&key) {
            Some(s) if s.cached == cached => Some(s),
            Some(s) => {
                self.drop_staged(&s);
                None
            }
            None => None,
        };
        let staged = match staged {
            Some(s) => s,
            None => {
                // Not prefetched: stage this sequence's unit now.
                let members = self.unit_of(step.seq, cached);
                self.stage_unit(step.layer, &members, false)?;
                match self.staged.remove(&key) {
                    Some(s) => s,
                    None => {
                        return Err(KvError::Step(format!("sequence {} has no cache", step.seq)))
                    }
                }
            }
        };
        // Queue the next unit before computing on this one.
        let (layer, members) = self.next_unit(step.layer, step.seq, cached, step.k.dim(2)?);
        self.stage_unit(layer, &members, true)?;
        let (nkv, d) = (step.spec.n_kv_heads, step.spec.head_dim);
        let heads = |t: &Tensor| -> Result<Tensor> {
            let n = t.dim(0)?;
            Ok(t.reshape((1, n, nkv, d))?.transpose(1, 2)?)
        };
        let mut ks = Vec::new();
        let mut vs = Vec::new();
        let mut positions: Vec<usize> = Vec::new();
        // Regenerate from the device-resident activations while the transfer runs.
        let dev_rows = match self.seqs.get(&step.seq) {
            Some(t) => t.rows(cached, self.block, Kind::Act, Tier::Device),
            None => Rows::default(),
        };
        let mut regenerated = 0;
        if !dev_rows.rows.is_empty() {
            let pool = self
                .pools
                .as_ref()
                .ok_or_else(|| KvError::Step("no pools".into()))?;
            let src = pool.dev_act.tensor(step.layer, 0)?;
            let idx = Tensor::new(dev_rows.rows.as_slice(), src.device())?;
            let x = src.index_select(&idx, 0)?.unsqueeze(0)?;
            let (k, v) = step.regen.regen_at(&x, &dev_rows.positions)?;
            ks.push(k);
            vs.push(v);
            positions.extend(&dev_rows.positions);
            regenerated += dev_rows.rows.len();
        }
        self.stats.transfer_wait_s += self.engine.wait(staged.ticket)?;
        if let (Some(x), false) = (&staged.x, staged.x_pos.is_empty()) {
            let (k, v) = step.regen.regen_at(&x.unsqueeze(0)?, &staged.x_pos)?;
            ks.push(k);
            vs.push(v);
            positions.extend(&staged.x_pos);
            regenerated += staged.x_pos.len();
        }
        if let Some((k, v)) = &staged.kv {
            ks.push(heads(k)?);
            vs.push(heads(v)?);
            positions.extend(&staged.kv_pos);
        }
        self.drop_staged(&staged);
        self.stats.recompute_tokens += regenerated as u64;
        self.stats.recompute_flops += regenerated as u64 * step.regen.flops_per_token();
        self.stats.split = regenerated as u64;
        if positions.len() != cached {
            return Err(KvError::Step(format!(
                "sequence {} has {} of its {cached} cached tokens in blocks",
                step.seq,
                positions.len()
            )));
        }
        let k = Tensor::cat(&ks, 2)?;
        let v = Tensor::cat(&vs, 2)?;
        // Back to token order: `order[p]` is where position p sits in the concatenation.
        let mut order = vec![0u32; cached];
        for (i, &p) in positions.iter().enumerate() {
            match order.get_mut(p) {
                Some(o) => *o = i as u32,
                None => {
                    return Err(KvError::Step(format!(
                        "position {p} outside the {cached} cached tokens"
                    )))
                }
            }
        }
        let in_order = positions.iter().enumerate().all(|(i, &p)| i == p);
        if in_order {
            return Ok(Some((k, v)));
        }
        let idx = Tensor::new(order.as_slice(), k.device())?;
        Ok(Some((
            k.contiguous()?.index_select(&idx, 2)?,
            v.contiguous()?.index_select(&idx, 2)?,
        )))
    }

    /// Writes the step's new tokens into their blocks at this layer.
    fn write_back(&mut self, step: &AttnStep<'_>) -> Result<()> {
        let t = step.k.dim(2)?;
        let block = self.block;
        let (Some(pools), Some(table)) = (self.pools.as_ref(), self.seqs.get(&step.seq)) else {
            return Err(KvError::Step(format!(
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
                .ok_or_else(|| KvError::Step(format!("token {p} has no block")))?;
            let in_block = p % block;
            let n = (block - in_block).min(step.pos + t - p);
            let row = b.slot * block + in_block;
            let j = p - step.pos;
            let (pool, srcs): (&Pool, Vec<&Tensor>) = match (b.kind, b.tier) {
                (Kind::Kv, _) => (&pools.host_kv, vec![&k, &v]),
                (Kind::Act, Tier::Device) => (&pools.dev_act, vec![&x]),
                (Kind::Act, Tier::Host) => (&pools.host_act, vec![&x]),
            };
            for (q, src) in srcs.into_iter().enumerate() {
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
        self.stats.d2h_bytes += d2h;
        Ok(())
    }
}

impl KvPolicy for HybridPolicy {
    fn name(&self) -> &str {
        "hybrid"
    }

    fn prepare(&mut self, shape: &KvShape) -> Result<()> {
        self.setup(shape)
    }

    fn attend(&mut self, step: &AttnStep<'_>) -> Result<Tensor> {
        let (b, _, t, _) = step.k.dims4()?;
        if b != 1 {
            return Err(KvError::Step(format!(
                "`hybrid` keeps one block table per sequence and takes one sequence per step, not {b}; run several requests as a ragged batch (generate_batch)"
            )));
        }
        let known = self.shape.clone();
        let seen = known.as_ref().map_or(0, |s| s.n_layers);
        // Steps carry one sequence; a batched run's shape counts its requests: compare
        // per sequence, keep the count for sizing.
        let per_seq = known.clone().map(|k| KvShape { batch: b, ..k });
        let mut shape = KvShape::for_step(per_seq.as_ref(), seen, step)?;
        if let Some(k) = &known {
            shape.batch = k.batch;
        }
        if known.as_ref() != Some(&shape) {
            self.setup(&shape)?;
        }
        self.ensure_costs(step, &shape)?;
        let pos = step.pos;
        if !self.seqs.contains_key(&step.seq) {
            if pos != 0 || step.layer != 0 {
                return Err(KvError::Step(format!(
                    "sequence {} starts at layer {} position {pos}; a new sequence starts at layer 0, position 0",
                    step.seq, step.layer
                )));
            }
            let share = self.share_for(shape.max_tokens.max(t));
            self.seqs.insert(
                step.seq,
                BlockTable {
                    blocks: Vec::new(),
                    tokens: 0,
                    kv_share: share,
                },
            );
        }
        let tokens = self.seqs.get(&step.seq).map_or(0, |s| s.tokens);
        let expected = if step.layer == 0 { pos } else { pos + t };
        if tokens != expected {
            return Err(KvError::Step(format!(
                "sequence {} has {tokens} tokens cached at layer {}, but the step starts at position {pos} with {t} tokens",
                step.seq, step.layer
            )));
        }
        if step.layer == 0 {
            self.allocate(step.seq, pos + t)?;
        }
        let cached = self.cached_kv(step, pos)?;
        let (k, v) = match cached {
            Some((ck, cv)) => (
                Tensor::cat(&[&ck, step.k], 2)?,
                Tensor::cat(&[&cv, step.v], 2)?,
            ),
            None => (step.k.clone(), step.v.clone()),
        };
        let part = attend_partial(step.q, &k, &v, pos, 0, step.spec)?;
        let act = self.shape.as_ref().map_or(0, |s| {
            KvShape {
                batch: 1,
                ..s.clone()
            }
            .activation_bytes(step.q.dim(2).unwrap_or(0))
        });
        self.stats.note_scratch(part.scratch_bytes, act);
        let out = part.out.to_dtype(step.q.dtype())?;
        self.write_back(step)?;
        if step.layer == 0 {
            if let Some(s) = self.seqs.get_mut(&step.seq) {
                s.tokens = pos + t;
            }
        }
        self.note_device();
        Ok(out)
    }

    fn seq_len(&self) -> usize {
        self.seqs.values().map(|s| s.tokens).max().unwrap_or(0)
    }

    fn reset(&mut self) {
        self.clear_staged();
        self.seqs.clear();
        self.release_pools();
        self.plan.clear();
        self.loads.clear();
        self.device_peak = 0;
        self.stats = KvStats::default();
        self.copy_base = self.engine.copy_seconds();
    }

    fn stats(&self) -> KvStats {
        let count = |kind: Kind| {
            self.seqs
                .values()
                .flat_map(|s| &s.blocks)
                .filter(|b| b.kind == kind)
                .count() as u64
        };
        let (host, dev_blocks) = self.pools.as_ref().map_or((0, 0), |p| {
            (
                p.host_act.bytes() + p.host_kv.bytes(),
                p.dev_act.used() as u64,
            )
        });
        KvStats {
            device_kv_bytes: self.device_bytes(),
            device_kv_peak_bytes: self.device_peak,
            host_kv_bytes: host,
            kv_tokens: self.seq_len() as u64,
            act_blocks: count(Kind::Act),
            kv_blocks: count(Kind::Kv),
            device_blocks: dev_blocks,
            host_pinned_bytes: self.engine.pinned_bytes(),
            copy_s: self.engine.copy_seconds() - self.copy_base,
            sequences: self.seqs.len() as u64,
            ..self.stats.clone()
        }
    }

    fn profile(&self) -> Option<&Profile> {
        self.profile.as_ref()
    }

    fn batched(&self) -> bool {
        true
    }

    fn release(&mut self, seq: usize) {
        let keys: Vec<_> = self.staged.keys().filter(|k| k.1 == seq).copied().collect();
        for k in keys {
            if let Some(s) = self.staged.remove(&k) {
                self.drop_staged(&s);
            }
        }
        if let (Some(table), Some(pools)) = (self.seqs.remove(&seq), self.pools.as_mut()) {
            for b in table.blocks {
                pools.get(b.kind, b.tier).give_back(b.slot);
            }
        }
        self.loads.remove(&seq);
        self.plan.iter_mut().for_each(|g| g.retain(|&s| s != seq));
    }

    fn plan(&mut self, loads: &[SeqLoad]) -> Result<Vec<Vec<usize>>> {
        // A new step: keep what the last one prefetched for it (layer 0 at the length this
        // step starts from), drop the rest.
        let keep: HashMap<usize, usize> = loads.iter().map(|l| (l.seq, l.cached)).collect();
        let stale: Vec<(usize, usize)> = self
            .staged
            .iter()
            .filter(|((layer, seq), st)| *layer != 0 || keep.get(seq) != Some(&st.cached))
            .map(|(k, _)| *k)
            .collect();
        for k in stale {
            if let Some(st) = self.staged.remove(&k) {
                self.drop_staged(&st);
            }
        }
        let (kvb, xb) = match &self.shape {
            Some(s) => (Self::kv_row_bytes(s), Self::x_row_bytes(s)),
            None => (0, 0),
        };
        let work: Vec<Load> = loads
            .iter()
            .map(|l| {
                let (kv, host_x, act) = match self.seqs.get(&l.seq) {
                    Some(t) => {
                        let c = l.cached;
                        let n = |k, tier| t.rows(c, self.block, k, tier).rows.len();
                        let (hx, dx) = (n(Kind::Act, Tier::Host), n(Kind::Act, Tier::Device));
                        (n(Kind::Kv, Tier::Host), hx, hx + dx)
                    }
                    None => (0, 0, 0),
                };
                let (transfer_s, recompute_s) = match &self.costs {
                    Some(c) => (
                        c.transfer.at(kv as f64)
                            + c.transfer.per_token_s * (host_x as f64) * xb as f64
                                / kvb.max(1) as f64,
                        c.recompute.at(act as f64),
                    ),
                    None => (0.0, 0.0),
                };
                Load {
                    bytes: kv as u64 * kvb + host_x as u64 * xb,
                    imbalance_s: transfer_s - recompute_s,
                }
            })
            .collect();
        let groups = pack(&work, self.unit_cap);
        self.stats.mini_batches = groups.len() as u64;
        self.loads = loads.iter().map(|l| (l.seq, *l)).collect();
        self.plan = groups
            .iter()
            .map(|g| {
                g.iter()
                    .filter_map(|&i| loads.get(i).map(|l| l.seq))
                    .collect()
            })
            .collect();
        Ok(groups)
    }
}

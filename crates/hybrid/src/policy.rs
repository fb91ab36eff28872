//! The `hybrid` policy (HybridServe §4), composed of the block manager ([`crate::manager`]),
//! the stager ([`crate::stager`]) and the cost probe ([`crate::probe`]): per request a block table of K/V and
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
use crate::settings::HybridSettings;
use candle_core::{Device, Tensor};
use kvpolicy_core::{
    attend_partial, Advice, AttnInputs, AttnStep, DeviceMeter, Knob, KvError, KvPolicy, KvShape,
    KvStats, PolicyMetric, PolicyOption, PolicyOptions, Profile, Result, SeqLoad,
};
use kvpolicy_core::{Batched, Need, Profiled, ReaderStash, StashedUnit};
use kvpolicy_tiered::{Link, TransferEngine};

use crate::blocks::{BlockTable, Kind, Tier};
use crate::manager::{BlockManager, PoolSpec};
use crate::pack::{pack, Load};
use crate::probe::{fit_costs, kv_row_bytes, x_row_bytes, ProbeSite};
use crate::ratio::{check_share, Costs};
use crate::stager::Stager;

/// Activation-hybrid cache (HybridServe): see the crate docs.
pub struct HybridPolicy {
    device: Device,
    /// Tokens per block as asked (`block_size`); a run's blocks are bounded by its longest
    /// request.
    block_asked: usize,
    forced_share: Option<f64>,
    given_profile: Option<Profile>,
    link_bandwidth: Option<f64>,
    link: Link,
    shape: Option<KvShape>,
    costs: Option<Costs>,
    profile: Option<Profile>,
    blocks: BlockManager,
    stager: Stager,
    meter: DeviceMeter,
    stats: KvStats,
    /// Per sequence, the owner layer's K/V as assembled, for the layers reading it (MLKV).
    stash: ReaderStash,
}

impl std::fmt::Debug for HybridPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HybridPolicy")
            .field("block", &self.blocks.block())
            .field("forced_share", &self.forced_share)
            .field("seqs", &self.blocks.len())
            .finish()
    }
}

impl HybridPolicy {
    /// A policy from options (`block_size`, `kv_act_ratio`, `device_kv_budget`, `profile`,
    /// `link_bandwidth`).
    pub fn new(opts: &PolicyOptions, settings: HybridSettings) -> Result<Self> {
        if settings.block_size == 0 {
            return Err(KvError::InvalidOption {
                policy: "hybrid".into(),
                option: Knob::Setting("block_size"),
                message: "0: a block holds at least one token (the default is 16)".into(),
            });
        }
        let forced_share = settings.kv_act_ratio.map(check_share).transpose()?;
        Ok(Self {
            device: opts.device.clone(),
            block_asked: settings.block_size,
            forced_share,
            given_profile: opts.profile.clone(),
            link_bandwidth: opts.link_bandwidth,
            link: Link::for_device(&opts.device, opts.link_bandwidth)?,
            shape: None,
            costs: None,
            profile: None,
            blocks: BlockManager::new(&opts.device, settings.block_size),
            stager: Stager::new(&opts.device),
            meter: DeviceMeter::for_options(opts),
            stats: KvStats::default(),
            stash: ReaderStash::default(),
        })
    }

    /// Uses `engine` for host→device copies instead of the default one (tests inject
    /// failures this way).
    pub fn with_engine(mut self, engine: Box<dyn TransferEngine>) -> Self {
        self.link = Link::new(engine);
        self
    }

    /// The cost models in use, once known.
    pub fn costs(&self) -> Option<&Costs> {
        self.costs.as_ref()
    }

    /// A request's block table.
    pub fn table(&self, seq: usize) -> Option<&BlockTable> {
        self.blocks.table(seq)
    }

    fn device_bytes(&self) -> u64 {
        // With MLKV, plus the owner layers' assembled K/V kept for their readers.
        self.blocks.device_bytes() + self.stager.bytes() + self.stash.copied_bytes()
    }

    fn note_device(&mut self) {
        self.meter.set(self.device_bytes());
    }

    /// Sizes the pools and the staging area for `shape` (HybridServe's allocation: the
    /// device holds activation blocks and the staging of two units; K/V live on the host).
    fn setup(&mut self, shape: &KvShape) -> Result<()> {
        // A block longer than the longest request holds that request whole either way; a
        // longer one would only reserve memory no token uses (and a huge one overflow the
        // pool sizes), so the run's length bounds it. Pools holding blocks keep theirs.
        self.blocks
            .set_block(self.block_asked.min(shape.max_tokens.max(1)));
        let one_request = shape.max_tokens as u64 * kv_row_bytes(shape);
        let mut device_blocks = None;
        self.stager.unit_cap = None;
        if let Some(full_budget) = self.meter.budget() {
            // A step's attention scratch and activations come first; of the rest, half (at
            // least two units of the longest request) stages transfers, the rest holds
            // activation blocks.
            let scratch =
                shape.step_scratch_bytes(shape.n_kv_heads, shape.max_tokens, &self.device);
            if scratch >= full_budget {
                return Err(self.meter.exceeded(
                    "a step's attention scratch and activations",
                    Need::Total(scratch),
                    "",
                    vec![
                        Advice::Raise(Knob::Option(PolicyOption::DeviceKvBudget)),
                        Advice::SmallerPrefillChunk,
                    ],
                ));
            }
            let budget = full_budget - scratch;
            let staging = (2 * one_request).max(budget / 2);
            if staging > budget {
                return Err(self.meter.exceeded(
                    format!(
                        "staging one layer of the longest request ({} tokens) twice, and a step's scratch",
                        shape.max_tokens
                    ),
                    Need::Total(staging + scratch),
                    "",
                    vec![
                        Advice::Raise(Knob::Option(PolicyOption::DeviceKvBudget)),
                        Advice::ShorterRequests,
                    ],
                ));
            }
            let act_slot =
                (shape.n_layers.max(1) as u64 * self.blocks.block() as u64 * x_row_bytes(shape))
                    .max(1);
            device_blocks = Some(((budget - staging) / act_slot) as usize);
            self.stager.unit_cap = Some(staging / 2);
        }
        let same_rows = self.shape.as_ref().is_some_and(|s| {
            (s.n_kv_heads, s.head_dim, s.hidden, s.dtype)
                == (shape.n_kv_heads, shape.head_dim, shape.hidden, shape.dtype)
        });
        if self.blocks.is_empty() {
            // Nothing cached: size everything afresh (a new run, or a new model).
            self.stager.clear(&mut self.link);
            if !same_rows {
                self.costs = None;
                self.profile = None;
            }
        }
        let spec = PoolSpec {
            dtype: shape.dtype,
            n_layers: shape.n_layers,
            hidden: shape.hidden,
            kv_width: shape.n_kv_heads * shape.head_dim,
            device_blocks,
        };
        self.blocks.size(spec, self.link.engine())?;
        self.stager.row_bytes = (kv_row_bytes(shape), x_row_bytes(shape));
        self.shape = Some(shape.clone());
        Ok(())
    }

    /// Fits the cost models once (see [`crate::probe`]).
    fn ensure_costs(&mut self, step: &AttnStep<'_>, shape: &KvShape) -> Result<()> {
        if self.costs.is_some() {
            return Ok(());
        }
        let site = ProbeSite {
            device: &self.device,
            link: self.link_bandwidth,
            engine: self.link.engine(),
            regen: step.regen,
        };
        let (costs, profile) = fit_costs(self.given_profile.as_ref(), shape, site)?;
        self.costs = Some(costs);
        self.profile = Some(profile);
        Ok(())
    }

    /// The share of K/V blocks a new request is kept at.
    fn share_for(&self, tokens: usize) -> f64 {
        match (self.forced_share, &self.costs) {
            (Some(s), _) => s,
            (None, Some(c)) => c.balanced_share(tokens, self.blocks.block()),
            (None, None) => 1.0,
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
        let n_layers = self.shape.as_ref().map_or(0, |s| s.n_layers);
        let unit = (step.layer, step.seq, cached, step.k.dim(2)?);
        let staged = self
            .stager
            .take((&self.blocks, &mut self.link), unit, n_layers)?;
        self.note_device();
        let (nkv, d) = (step.spec.n_kv_heads, step.spec.head_dim);
        let heads = |t: &Tensor| -> Result<Tensor> {
            let n = t.dim(0)?;
            Ok(t.reshape((1, n, nkv, d))?.transpose(1, 2)?)
        };
        let mut ks = Vec::new();
        let mut vs = Vec::new();
        let mut positions: Vec<usize> = Vec::new();
        // Regenerate from the device-resident activations while the transfer runs.
        let dev_rows = self.blocks.rows(step.seq, cached, Kind::Act, Tier::Device);
        let mut regenerated = 0;
        if !dev_rows.rows.is_empty() {
            let src = self
                .blocks
                .pool(Kind::Act, Tier::Device)?
                .tensor(step.layer, 0)?;
            let idx = Tensor::new(dev_rows.rows.as_slice(), src.device())?;
            let x = src.index_select(&idx, 0)?.unsqueeze(0)?;
            let (k, v) = step.regen.regen_at(&x, &dev_rows.positions)?;
            ks.push(k);
            vs.push(v);
            positions.extend(&dev_rows.positions);
            regenerated += dev_rows.rows.len();
        }
        self.link.wait(staged.ticket)?;
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
        self.stager.finish(&staged);
        self.stats.recompute_tokens += regenerated as u64;
        self.stats.recompute_flops += regenerated as u64 * step.regen.flops_per_token();
        self.stats
            .set_metric(PolicyMetric::gauge("split", regenerated as f64, "tokens"));
        if positions.len() != cached {
            return Err(KvError::invariant(format!(
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
                    return Err(KvError::invariant(format!(
                        "position {p} outside the {cached} cached tokens"
                    )))
                }
            }
        }
        if positions.iter().enumerate().all(|(i, &p)| i == p) {
            return Ok(Some((k, v)));
        }
        let idx = Tensor::new(order.as_slice(), k.device())?;
        Ok(Some((
            k.contiguous()?.index_select(&idx, 2)?,
            v.contiguous()?.index_select(&idx, 2)?,
        )))
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
            return Err(KvError::Unsupported(format!(
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
        let (seq, layer, pos) = (step.seq, step.layer, step.pos);
        if self.blocks.table(seq).is_none() {
            if pos != 0 || layer != 0 {
                return Err(KvError::OutOfOrder {
                    seq,
                    layer,
                    held: 0,
                    pos,
                });
            }
            let share = self.share_for(shape.max_tokens.max(t));
            self.blocks.open(seq, share);
        }
        // Layer 0 counts the tokens; a later layer of the same step holds `t` fewer.
        let tokens = self.blocks.tokens(seq);
        let held = if layer == 0 {
            tokens
        } else {
            tokens.saturating_sub(t)
        };
        if held != pos || (layer > 0 && tokens < t) {
            return Err(KvError::OutOfOrder {
                seq,
                layer,
                held,
                pos,
            });
        }
        if layer == 0 {
            self.blocks.allocate(seq, pos + t, self.link.engine())?;
            self.note_device();
        }
        let (k, v) = match self.cached_kv(step, pos)? {
            Some((ck, cv)) => (
                Tensor::cat(&[&ck, step.k], 2)?,
                Tensor::cat(&[&cv, step.v], 2)?,
            ),
            None => (step.k.clone(), step.v.clone()),
        };
        let part = attend_partial(
            AttnInputs {
                q: step.q,
                k: &k,
                v: &v,
                q_pos: pos,
                k_pos: 0,
            },
            step.spec,
        )?;
        let act = KvShape {
            batch: 1,
            ..shape.clone()
        }
        .activation_bytes(step.q.dim(2)?);
        self.stats.note_scratch(part.scratch_bytes, act);
        let out = part.out.to_dtype(step.q.dtype())?;
        self.stash.release(seq);
        if shape.has_readers(layer) {
            // The layer's K/V as assembled for its attention, for the layers reading it
            // (counted on the device until the sequence's next layer step).
            self.stash.begin(step);
            self.stash.keep_owned(StashedUnit {
                first_head: 0,
                k,
                v,
                k_pos: 0,
            })?;
        }
        self.blocks.write_back(step, &mut self.link)?;
        if layer == 0 {
            self.blocks.set_tokens(seq, pos + t);
        }
        self.note_device();
        Ok(out)
    }

    /// A reading layer attends over its owner's K/V as that layer's step assembled them.
    fn attend_shared(&mut self, step: &AttnStep<'_>) -> Result<Tensor> {
        let part = self.stash.attend(step)?;
        Ok(part.out.to_dtype(step.q.dtype())?)
    }

    fn seq_len(&self) -> usize {
        self.blocks.longest()
    }

    fn reset(&mut self) {
        self.stash.clear();
        self.stager.clear(&mut self.link);
        self.blocks.clear(self.link.engine());
        self.stager.forget_plan();
        self.meter.reset();
        self.stats = KvStats::default();
        self.link.reset();
    }

    fn stats(&self) -> KvStats {
        let mut stats = KvStats {
            device_kv_bytes: self.device_bytes(),
            device_kv_peak_bytes: self.meter.peak(),
            host_kv_bytes: self.blocks.host_bytes(),
            kv_tokens: self.seq_len() as u64,
            sequences: self.blocks.len() as u64,
            ..self.stats.clone()
        };
        for (name, blocks) in [
            ("act_blocks", self.blocks.count(Kind::Act)),
            ("kv_blocks", self.blocks.count(Kind::Kv)),
            ("device_blocks", self.blocks.device_blocks()),
        ] {
            stats.set_metric(PolicyMetric::gauge(name, blocks as f64, "blocks"));
        }
        self.link.report(stats)
    }

    fn as_batched(&mut self) -> Option<&mut dyn Batched> {
        Some(self)
    }

    fn as_profiled(&self) -> Option<&dyn Profiled> {
        Some(self)
    }
}

impl Profiled for HybridPolicy {
    fn profile(&self) -> Option<&Profile> {
        self.profile.as_ref()
    }
}

impl Batched for HybridPolicy {
    fn release(&mut self, seq: usize) {
        self.stash.release(seq);
        self.stager.release(seq);
        self.blocks.release(seq);
    }

    fn plan(&mut self, loads: &[SeqLoad]) -> Result<Vec<Vec<usize>>> {
        // A new step: keep what the last one prefetched for it, drop the rest.
        self.stager.begin_step(loads);
        let (kvb, xb) = self.stager.row_bytes;
        let work: Vec<Load> = loads
            .iter()
            .map(|l| {
                let n = |k, tier| self.blocks.rows(l.seq, l.cached, k, tier).rows.len();
                let (kv, hx) = (n(Kind::Kv, Tier::Host), n(Kind::Act, Tier::Host));
                let act = hx + n(Kind::Act, Tier::Device);
                let (transfer_s, recompute_s) = match &self.costs {
                    Some(c) => (
                        c.transfer.at(kv as f64)
                            + c.transfer.per_token_s * (hx as f64) * xb as f64 / kvb.max(1) as f64,
                        c.recompute.at(act as f64),
                    ),
                    None => (0.0, 0.0),
                };
                Load {
                    bytes: kv as u64 * kvb + hx as u64 * xb,
                    imbalance_s: transfer_s - recompute_s,
                }
            })
            .collect();
        let groups = pack(&work, self.stager.unit_cap);
        self.stats.set_metric(PolicyMetric::gauge(
            "mini_batches",
            groups.len() as f64,
            "mini-batches",
        ));
        let plan = groups
            .iter()
            .map(|g| {
                g.iter()
                    .filter_map(|&i| loads.get(i).map(|l| l.seq))
                    .collect()
            })
            .collect();
        self.stager.set_plan(plan, loads);
        Ok(groups)
    }
}

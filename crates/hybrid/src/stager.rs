//! The stager (HybridServe §4.2): what crosses the link, in which order. A *unit* is one
//! mini-batch at one layer; its host rows (K/V blocks, and activation blocks that
//! overflowed to the host) are gathered into one batch of copies. The next unit — the next
//! mini-batch, or the first one at the next layer: column by column — is queued as soon as
//! this one is taken, so its transfer overlaps this unit's regeneration and attention. At
//! most two units are staged on the device (ping-pong), bounded by `unit_cap` bytes each.
use std::collections::HashMap;

use candle_core::{Device, Tensor};
use kvpolicy_core::{KvError, Result, SeqLoad};
use kvpolicy_tiered::{CopyJob, Direction, Link, Ticket};

use crate::blocks::{Kind, Pool, Rows, Tier};
use crate::manager::BlockManager;

/// One request's host rows of one layer, copied (or being copied) to the device.
#[derive(Debug)]
pub struct Staged {
    /// The batch copying them (`None`: nothing to copy).
    pub ticket: Option<Ticket>,
    /// Tokens cached when it was staged (a later step makes it stale).
    pub cached: usize,
    /// K/V rows `(n, n_kv·head_dim)` each, with their positions.
    pub kv: Option<(Tensor, Tensor)>,
    /// Positions of the K/V rows.
    pub kv_pos: Vec<usize>,
    /// X rows `(n, hidden)` of host activation blocks.
    pub x: Option<Tensor>,
    /// Positions of the X rows.
    pub x_pos: Vec<usize>,
    /// Device bytes it holds.
    pub bytes: u64,
}

/// The staging area and the unit order (see the module docs).
#[derive(Debug)]
pub struct Stager {
    device: Device,
    /// Bytes one unit may stage (`None` = unbounded: one mini-batch).
    pub unit_cap: Option<u64>,
    /// Bytes of one token's K/V row and of its X row.
    pub row_bytes: (u64, u64),
    staged: HashMap<(usize, usize), Staged>,
    bytes: u64,
    /// The last plan: mini-batches of sequence slots, with each sequence's load.
    plan: Vec<Vec<usize>>,
    loads: HashMap<usize, SeqLoad>,
}

/// (sequence, tokens cached) of each member of a unit.
type Members = Vec<(usize, usize)>;

impl Stager {
    /// An empty staging area for buffers on `device`.
    pub fn new(device: &Device) -> Self {
        Self {
            device: device.clone(),
            unit_cap: None,
            row_bytes: (0, 0),
            staged: HashMap::new(),
            bytes: 0,
            plan: Vec::new(),
            loads: HashMap::new(),
        }
    }

    /// Device bytes staged now.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Host rows of tokens `0..cached` of `seq` at `layer`, gathered and queued for the
    /// device. A prefetch that would overfill the staging area (two units) is skipped; a
    /// unit that is needed now first evicts what was prefetched if it must.
    fn stage_one(
        &mut self,
        (blocks, link): (&BlockManager, &mut Link),
        (layer, seq, cached): (usize, usize, usize),
        prefetch: bool,
    ) -> Result<Option<Staged>> {
        if blocks.table(seq).is_none() {
            return Ok(None);
        }
        let kv_rows = blocks.rows(seq, cached, Kind::Kv, Tier::Host);
        let x_rows = blocks.rows(seq, cached, Kind::Act, Tier::Host);
        if let Some(cap) = self.unit_cap {
            let (kvb, xb) = self.row_bytes;
            let need = kv_rows.rows.len() as u64 * kvb + x_rows.rows.len() as u64 * xb;
            if self.bytes + need > 2 * cap {
                if prefetch {
                    return Ok(None);
                }
                self.clear(link);
            }
        }
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
        let kv_pool = blocks.pool(Kind::Kv, Tier::Host)?;
        let k = gather(kv_pool, 0, &kv_rows)?;
        let v = gather(kv_pool, 1, &kv_rows)?;
        let x = gather(blocks.pool(Kind::Act, Tier::Host)?, 0, &x_rows)?;
        let ticket = link.submit(jobs, Direction::H2d)?;
        self.bytes += bytes;
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

    /// Stages `members` at `layer`, skipping those staged.
    fn stage_unit(
        &mut self,
        (blocks, link): (&BlockManager, &mut Link),
        layer: usize,
        members: &[(usize, usize)],
        prefetch: bool,
    ) -> Result<()> {
        for &(seq, cached) in members {
            if self.staged.contains_key(&(layer, seq)) || cached == 0 {
                continue;
            }
            if let Some(s) = self.stage_one((blocks, link), (layer, seq, cached), prefetch)? {
                self.staged.insert((layer, seq), s);
            }
        }
        Ok(())
    }

    /// `seq`'s host rows at `layer` with `cached` tokens — prefetched, or staged now with
    /// the rest of its unit — after queueing the unit that follows (`new`: the step's
    /// tokens, for the wrap to the next step). Call [`finish`](Self::finish) when done.
    pub fn take(
        &mut self,
        (blocks, link): (&BlockManager, &mut Link),
        (layer, seq, cached, new): (usize, usize, usize, usize),
        n_layers: usize,
    ) -> Result<Staged> {
        let key = (layer, seq);
        let staged = match self.staged.remove(&key) {
            Some(s) if s.cached == cached => Some(s),
            Some(s) => {
                self.finish(&s);
                None
            }
            None => None,
        };
        let staged = match staged {
            Some(s) => s,
            None => {
                // Not prefetched: stage this sequence's unit now.
                let members = self.unit_of(seq, cached);
                self.stage_unit((blocks, &mut *link), layer, &members, false)?;
                self.staged.remove(&key).ok_or_else(|| {
                    KvError::invariant(format!("sequence {seq} has no block table to stage"))
                })?
            }
        };
        // Queue the next unit before computing on this one.
        let (next_layer, members) =
            self.next_unit((layer, seq, cached, new), n_layers, blocks.len());
        self.stage_unit((blocks, link), next_layer, &members, true)?;
        Ok(staged)
    }

    /// `group`'s members with the tokens each has cached at this step (`grown`: at the
    /// next one, this step's tokens included).
    fn members(&self, group: &[usize], grown: bool) -> Members {
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
    fn unit_of(&self, seq: usize, cached: usize) -> Members {
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
    /// at layer 0 of the next step (its tokens then include this step's; from layer 1 on,
    /// when those rows are written). Without a plan (`Batched::plan` not called) a unit is
    /// one sequence, prefetched only when it is the only one.
    fn next_unit(
        &self,
        (layer, seq, cached, new): (usize, usize, usize, usize),
        n_layers: usize,
        n_seqs: usize,
    ) -> (usize, Members) {
        let at = |g: &Vec<usize>, grown: bool| self.members(g, grown);
        // The next step's layer-0 rows of this step's tokens exist once layer 0 is done
        // for every sequence, i.e. from layer 1 on.
        let wrap = layer > 0;
        let Some(g) = self.plan.iter().position(|g| g.contains(&seq)) else {
            // Unplanned sequences side by side would each hold a prefetch: only a lone
            // sequence prefetches, so at most two units are ever staged.
            if n_seqs > 1 {
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

    /// Gives back a taken (or stale) unit's device bytes.
    pub fn finish(&mut self, s: &Staged) {
        self.bytes = self.bytes.saturating_sub(s.bytes);
    }

    /// Drops everything staged once the copies have landed.
    pub fn clear(&mut self, link: &mut Link) {
        let _ = link.wait_all();
        for (_, s) in std::mem::take(&mut self.staged) {
            self.finish(&s);
        }
    }

    /// A new step over `loads`: keeps what the last one prefetched for it (layer 0 at the
    /// length this step starts from), drops the rest.
    pub fn begin_step(&mut self, loads: &[SeqLoad]) {
        let keep: HashMap<usize, usize> = loads.iter().map(|l| (l.seq, l.cached)).collect();
        let stale: Vec<(usize, usize)> = self
            .staged
            .iter()
            .filter(|((layer, seq), st)| *layer != 0 || keep.get(seq) != Some(&st.cached))
            .map(|(k, _)| *k)
            .collect();
        for k in stale {
            if let Some(st) = self.staged.remove(&k) {
                self.finish(&st);
            }
        }
    }

    /// The step's mini-batches (sequence slots) and loads.
    pub fn set_plan(&mut self, plan: Vec<Vec<usize>>, loads: &[SeqLoad]) {
        self.loads = loads.iter().map(|l| (l.seq, *l)).collect();
        self.plan = plan;
    }

    /// Forgets the plan and the loads (a reset).
    pub fn forget_plan(&mut self) {
        self.plan.clear();
        self.loads.clear();
    }

    /// Drops what is staged for `seq` and its place in the plan (the request ended).
    pub fn release(&mut self, seq: usize) {
        let keys: Vec<_> = self.staged.keys().filter(|k| k.1 == seq).copied().collect();
        for k in keys {
            if let Some(s) = self.staged.remove(&k) {
                self.finish(&s);
            }
        }
        self.loads.remove(&seq);
        self.plan.iter_mut().for_each(|g| g.retain(|&s| s != seq));
    }
}

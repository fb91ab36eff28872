//! A file of the disk tier as a host-tier layer store: [`DiskKv`]'s side of
//! [`LayerStore`](super::store::LayerStore). It grows a chunk at a time where it is, reads
//! what its read-aheads read (the first stage of disk → host → device), starts them on
//! request, drops those a write would make stale, and counts its bytes and time into the
//! disk tier's traffic. Writes go through at once and are counted device→host.
use std::any::Any;
use std::time::Instant;

use candle_core::Tensor;
use kvpolicy_core::{HeadRange, Result};

use super::disk_traffic::{DiskTraffic, ReadSpan};
use super::store::{tensor_bytes, LayerStore, Room, WriteAt};
use crate::disk::DiskKv;
use crate::link::{Direction, Link};

impl LayerStore for DiskKv {
    /// Grows the file a chunk at a time: a layer on disk stays there.
    fn make_room(&mut self, tokens: usize, room: &mut Room<'_>) -> Result<bool> {
        let t0 = Instant::now();
        self.ensure(tokens)?;
        room.traffic().waited(t0.elapsed());
        Ok(true)
    }

    /// Taken from the read ahead of `span`, or read now.
    fn history(&self, span: ReadSpan, traffic: &mut DiskTraffic) -> Result<(Tensor, Tensor)> {
        let t0 = Instant::now();
        let (heads, tokens) = (span.heads(), span.tokens());
        let (k, v) = match traffic.take(span)? {
            Some(read) => read,
            None => self.read((heads.first, heads.count), tokens.start, tokens.len)?,
        };
        traffic.waited(t0.elapsed());
        traffic.count_read(tensor_bytes(&k) + tensor_bytes(&v));
        Ok((k, v))
    }

    /// Planned now (the tokens must be written already: a read-ahead never races a write
    /// of its blocks), unless [`READ_AHEAD`](super::READ_AHEAD) reads are in flight or
    /// `span`'s is.
    fn read_ahead(&self, span: ReadSpan, traffic: &mut DiskTraffic) -> Result<()> {
        if !traffic.wants(span) {
            return Ok(());
        }
        let (heads, tokens) = (span.heads(), span.tokens());
        let plan = self.plan_read((heads.first, heads.count), tokens.start, tokens.len)?;
        traffic.start(span, plan)
    }

    /// Written through, after the read-aheads of these blocks are finished and dropped.
    fn write(
        &mut self,
        link: &mut Link,
        traffic: &mut DiskTraffic,
        at: WriteAt,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<()> {
        let WriteAt {
            layer,
            first_head,
            offset,
        } = at;
        let t0 = Instant::now();
        traffic.discard_overlapping(layer, &HeadRange::new(first_head, k.dim(1)?));
        let n = DiskKv::write(self, k, v, first_head, offset)?;
        traffic.waited(t0.elapsed());
        traffic.count_written(n);
        link.count(n, Direction::D2h);
        Ok(())
    }

    fn file_bytes(&self) -> u64 {
        self.bytes()
    }

    fn direct_io(&self) -> bool {
        DiskKv::direct_io(self)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

//! The disk tier: one layer's K/V in one file, for contexts whose KV exceeds host memory
//! (FlexGen's `--offload-dir`; HeadInfer §6 names disk offload as the next step).
//!
//! The file is laid out in chunks of `chunk` tokens; a chunk holds one block per (K or V,
//! sequence, KV head) of `chunk × head_dim` elements behind a header page, so a head's
//! token range is one positioned read per chunk it spans. Blocks, headers and data are
//! aligned to 4 KiB so that reads can bypass the page cache ([`DiskIo::Direct`], the
//! default: `O_DIRECT` into an aligned bounce buffer, header page and data in one request);
//! [`DiskIo::Buffered`] reads through the page cache instead. Writes always go through the
//! page cache (a decode step writes one row per head; the kernel flushes a dirty range
//! before a direct read of it, so reads see every write). The file grows a chunk at a
//! time and the chunk is written out, not left sparse, so a full disk fails at growth — the
//! store then stays as it was, usable at its previous length. Each block records the range
//! of tokens written to it, in memory and in its on-disk header; reading a token outside it,
//! or a block whose header disagrees, is an error: nothing unwritten is read back.
//! The file has no name from the start: it is created unlinked (`O_TMPFILE`, or created
//! by the `tempfile` crate and unlinked at once where the file system lacks it), mode 0600,
//! so no kill — SIGKILL and the OOM killer included — can leave it behind, no other user
//! can read the K/V, and no leftover name can collide. One descriptor per store: direct
//! reads reopen it through `/proc/self/fd` for the length of one read.
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Tensor};

use crate::disk_format::{disk_err, round_up, ALIGN, MAGIC};
use crate::disk_read::{DiskRead, Piece};
use kvpolicy_core::DiskIo;
use kvpolicy_core::{KvError, Result};

/// One layer's K/V in a file (see the module docs).
#[derive(Debug)]
pub struct DiskKv {
    /// How messages name the file (it has no name on disk).
    path: PathBuf,
    file: Arc<File>,
    /// Whether reads bypass the page cache ([`DiskIo::Direct`], where the file system
    /// allows it).
    direct: bool,
    batch: usize,
    heads: usize,
    head_dim: usize,
    dtype: DType,
    chunk: usize,
    chunks: usize,
    /// The tokens written to each block (index [`DiskKv::block`]), as a range within it.
    written: Vec<(u32, u32)>,
}

/// A tensor's elements as bytes in the machine's order, in logical order (what
/// [`Tensor::from_raw_buffer`] reads back).
pub fn raw_bytes(t: &Tensor) -> Result<Vec<u8>> {
    let t = t.flatten_all()?;
    Ok(match t.dtype() {
        DType::U8 => t.to_vec1::<u8>()?,
        DType::F32 => t
            .to_vec1::<f32>()?
            .iter()
            .flat_map(|x| x.to_ne_bytes())
            .collect(),
        DType::F16 => t
            .to_vec1::<half::f16>()?
            .iter()
            .flat_map(|x| x.to_ne_bytes())
            .collect(),
        DType::BF16 => t
            .to_vec1::<half::bf16>()?
            .iter()
            .flat_map(|x| x.to_ne_bytes())
            .collect(),
        other => {
            return Err(KvError::Unsupported(format!(
                "K/V of dtype {other:?} on the disk tier (f32, f16 and bf16 are)"
            )))
        }
    })
}

impl DiskKv {
    /// A new, empty store for `(batch, heads, ·, head_dim)` K/V of `dtype` in an unnamed
    /// file under `dir` (shown as `dir/name` in messages), growing `chunk` tokens at a
    /// time, read as `io` says.
    pub fn create(
        dir: &Path,
        name: &str,
        (batch, heads, head_dim): (usize, usize, usize),
        dtype: DType,
        chunk: usize,
        io: DiskIo,
    ) -> Result<Self> {
        let path = dir.join(format!("{name} (unnamed disk-tier file)"));
        let file =
            crate::disk_fs::unnamed_file(dir).map_err(|e| disk_err("cannot create", &path, e))?;
        let file = Arc::new(file);
        crate::disk_fs::register(&file);
        let direct = io == DiskIo::Direct && crate::disk_read::open_direct(&file).is_ok();
        Ok(Self {
            path,
            file,
            direct,
            batch,
            heads,
            head_dim,
            dtype,
            chunk: chunk.max(1),
            chunks: 0,
            written: Vec::new(),
        })
    }

    /// How messages name the file (its directory and layer; it has no name on disk).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether reads bypass the page cache ([`DiskIo::Direct`] on a file system that allows
    /// it).
    pub fn direct_io(&self) -> bool {
        self.direct
    }

    /// Tokens the file holds room for.
    pub fn capacity(&self) -> usize {
        self.chunks * self.chunk
    }

    fn row_bytes(&self) -> usize {
        self.head_dim * self.dtype.size_in_bytes()
    }

    /// A block: its header page, then its data rounded up to whole pages.
    fn block_bytes(&self) -> u64 {
        ALIGN + round_up((self.chunk * self.row_bytes()) as u64)
    }

    fn blocks_per_chunk(&self) -> usize {
        2 * self.batch * self.heads
    }

    /// Bytes of the file.
    pub fn bytes(&self) -> u64 {
        self.chunks as u64 * self.blocks_per_chunk() as u64 * self.block_bytes()
    }

    /// The index of block (chunk `c`, K or V `kv`, sequence `b`, head `h`).
    fn block(&self, c: usize, kv: usize, b: usize, h: usize) -> usize {
        ((c * 2 + kv) * self.batch + b) * self.heads + h
    }

    /// Grows the file to hold `tokens`, a chunk at a time, each written out. A failure
    /// (a full disk) truncates the file back: the store stays as it was.
    pub fn ensure(&mut self, tokens: usize) -> Result<()> {
        while self.capacity() < tokens {
            let at = self.bytes();
            let blocks = self.blocks_per_chunk();
            let mut chunk = vec![0u8; blocks * self.block_bytes() as usize];
            for i in 0..blocks {
                let o = i * self.block_bytes() as usize;
                chunk[o..o + 4].copy_from_slice(&MAGIC.to_le_bytes());
            }
            if let Err(e) = self.file.write_all_at(&chunk, at) {
                let _ = self.file.set_len(at);
                return Err(KvError::Disk {
                    what: format!(
                        "cannot grow {} to {} tokens (is the disk full? free space in the disk \
                         tier's directory or point it at a larger file system; the cache keeps \
                         the tokens it holds)",
                        self.path.display(),
                        self.capacity() + self.chunk,
                    ),
                    source: e,
                });
            }
            self.chunks += 1;
            self.written.extend(std::iter::repeat_n((0, 0), blocks));
        }
        Ok(())
    }

    /// Writes `k`, `v` `(batch, g, t, head_dim)` (CPU) into heads `first_head..` at token
    /// `offset`. A block's written tokens stay one range: a write touching or overlapping it
    /// extends it; one past its end starts it over (the tokens before are dropped, as a
    /// windowed layer's front: `auto` demoting a resident unit writes only the window it
    /// kept, after the tier may have been given the layer's older tokens), and reading them
    /// is then an error; one before its start is refused. Returns the bytes written.
    pub fn write(
        &mut self,
        k: &Tensor,
        v: &Tensor,
        first_head: usize,
        offset: usize,
    ) -> Result<u64> {
        let (batch, g, t, _) = k.dims4()?;
        self.ensure(offset + t)?;
        let row = self.row_bytes();
        let mut total = 0u64;
        for (kv, src) in [k, v].into_iter().enumerate() {
            for b in 0..batch {
                for j in 0..g {
                    let data = raw_bytes(&src.narrow(0, b, 1)?.narrow(1, j, 1)?)?;
                    let mut p = offset;
                    while p < offset + t {
                        let (c, within) = (p / self.chunk, p % self.chunk);
                        let n = (self.chunk - within).min(offset + t - p);
                        let idx = self.block(c, kv, b, first_head + j);
                        let (lo, hi) = self.written[idx];
                        let (lo, hi) = (lo as usize, hi as usize);
                        let now = if lo == hi || within > hi {
                            (within, within + n)
                        } else if within + n >= lo {
                            (lo.min(within), hi.max(within + n))
                        } else {
                            return Err(KvError::invariant(format!(
                                "a disk write of tokens {p}..{} would leave a gap next to the written {}..{}",
                                p + n,
                                c * self.chunk + lo,
                                c * self.chunk + hi
                            )));
                        };
                        let at = idx as u64 * self.block_bytes();
                        let bytes = &data[(p - offset) * row..(p - offset + n) * row];
                        let io = |e| disk_err("cannot write", &self.path, e);
                        self.file
                            .write_all_at(bytes, at + ALIGN + (within * row) as u64)
                            .map_err(io)?;
                        let mut header = MAGIC.to_le_bytes().to_vec();
                        header.extend((now.0 as u32).to_le_bytes());
                        header.extend((now.1 as u32).to_le_bytes());
                        self.file.write_all_at(&header, at).map_err(io)?;
                        self.written[idx] = (now.0 as u32, now.1 as u32);
                        total += bytes.len() as u64;
                        p += n;
                    }
                }
            }
        }
        Ok(total)
    }

    /// Tokens `start..start + len` of heads `first_head..first_head + g` as `(batch, g, len,
    /// head_dim)` K and V on the CPU. Fails on any token not written.
    pub fn read(
        &self,
        heads: (usize, usize),
        start: usize,
        len: usize,
    ) -> Result<(Tensor, Tensor)> {
        self.plan_read(heads, start, len)?.run()
    }

    /// [`read`](Self::read) planned now (each piece checked against what this store wrote)
    /// and run later, on any thread: a read-ahead.
    pub fn plan_read(
        &self,
        (first_head, g): (usize, usize),
        start: usize,
        len: usize,
    ) -> Result<DiskRead> {
        let row = self.row_bytes();
        let mut pieces = Vec::new();
        for kv in 0..2 {
            for b in 0..self.batch {
                for j in 0..g {
                    let base = (b * g + j) * len * row;
                    let mut p = start;
                    while p < start + len {
                        let (c, within) = (p / self.chunk, p % self.chunk);
                        let n = (self.chunk - within).min(start + len - p);
                        let idx = self.block(c, kv, b, first_head + j);
                        let known = self.written.get(idx).copied().unwrap_or((0, 0));
                        if !((known.0 as usize) <= within && within + n <= known.1 as usize) {
                            return Err(KvError::Disk {
                                what: format!(
                                    "{}: tokens {p}..{} of a block were never written (it holds {}..{})",
                                    self.path.display(),
                                    p + n,
                                    c * self.chunk + known.0 as usize,
                                    c * self.chunk + known.1 as usize
                                ),
                                source: std::io::Error::from(std::io::ErrorKind::InvalidData),
                            });
                        }
                        let at = idx as u64 * self.block_bytes();
                        pieces.push(Piece {
                            kv,
                            header_at: at,
                            expect: known,
                            data_at: at + ALIGN + (within * row) as u64,
                            buf_at: base + (p - start) * row,
                            bytes: n * row,
                        });
                        p += n;
                    }
                }
            }
        }
        Ok(DiskRead {
            file: self.file.clone(),
            direct: self.direct,
            path: self.path.clone(),
            pieces,
            dims: [self.batch, g, len, self.head_dim],
            dtype: self.dtype,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn store(dir: &Path) -> Result<DiskKv> {
        DiskKv::create(dir, "t", (1, 2, 3), DType::F32, 4, DiskIo::Direct)
    }

    fn kv(t: usize, base: f32) -> Result<(Tensor, Tensor)> {
        let k =
            Tensor::arange(base, base + (2 * t * 3) as f32, &Device::Cpu)?.reshape((1, 2, t, 3))?;
        let v = (&k * -1.0)?;
        Ok((k, v))
    }

    #[test]
    fn writes_read_back_across_chunks_and_the_file_never_has_a_name() -> Result<()> {
        let dir = tempfile::tempdir().map_err(|e| KvError::invariant(e.to_string()))?;
        let mut d = store(dir.path())?;
        let (k, v) = kv(6, 0.0)?;
        d.write(&k, &v, 0, 0)?;
        let (k2, v2) = kv(3, 100.0)?;
        d.write(&k2.narrow(1, 1, 1)?, &v2.narrow(1, 1, 1)?, 1, 6)?;
        assert_eq!(d.capacity(), 12);
        let (rk, rv) = d.read((0, 2), 0, 6)?;
        assert_eq!(
            rk.flatten_all()?.to_vec1::<f32>()?,
            k.flatten_all()?.to_vec1::<f32>()?
        );
        assert_eq!(
            rv.flatten_all()?.to_vec1::<f32>()?,
            v.flatten_all()?.to_vec1::<f32>()?
        );
        let (rk, _) = d.read((1, 1), 5, 4)?;
        let want: Vec<f32> = k
            .narrow(1, 1, 1)?
            .narrow(2, 5, 1)?
            .flatten_all()?
            .to_vec1::<f32>()?
            .into_iter()
            .chain(k2.narrow(1, 1, 1)?.flatten_all()?.to_vec1::<f32>()?)
            .collect();
        assert_eq!(rk.flatten_all()?.to_vec1::<f32>()?, want);
        // The file never had a name: nothing in the directory, before or after the drop.
        assert_eq!(
            std::fs::read_dir(dir.path()).map(Iterator::count).ok(),
            Some(0)
        );
        let file = Arc::downgrade(&d.file);
        drop(d);
        assert!(
            file.upgrade().is_none(),
            "the descriptor is closed with the store"
        );
        Ok(())
    }

    #[test]
    fn direct_and_buffered_reads_agree_at_any_offset() -> Result<()> {
        let dir = tempfile::tempdir().map_err(|e| KvError::invariant(e.to_string()))?;
        // Rows of 4 KiB: a read from token 2 of a chunk starts two pages into the block's
        // data, so a direct read takes the header page and the data in two requests.
        let dims = (1, 2, 1024);
        let mut stores = Vec::new();
        for io in [DiskIo::Direct, DiskIo::Buffered] {
            let mut d = DiskKv::create(dir.path(), "io", dims, DType::F32, 4, io)?;
            let k = Tensor::arange(0f32, (2 * 10 * 1024) as f32, &Device::Cpu)?
                .reshape((1, 2, 10, 1024))?;
            d.write(&k, &(&k + 0.5)?, 0, 0)?;
            stores.push((d, k));
        }
        assert!(!stores[1].0.direct_io());
        for (start, len) in [(0, 10), (2, 5), (5, 1), (7, 3)] {
            let mut got = Vec::new();
            for (d, k) in &stores {
                let (rk, rv) = d.read((1, 1), start, len)?;
                let want = k.narrow(1, 1, 1)?.narrow(2, start, len)?;
                assert_eq!(
                    rk.flatten_all()?.to_vec1::<f32>()?,
                    want.flatten_all()?.to_vec1::<f32>()?
                );
                got.push(rv.flatten_all()?.to_vec1::<f32>()?);
            }
            assert_eq!(got[0], got[1]);
        }
        Ok(())
    }

    #[test]
    fn nothing_unwritten_or_damaged_is_read_back() -> Result<()> {
        let dir = tempfile::tempdir().map_err(|e| KvError::invariant(e.to_string()))?;
        let mut d = store(dir.path())?;
        let (k, v) = kv(5, 0.0)?;
        d.write(&k, &v, 0, 0)?;
        // Head 0 holds 5 tokens: the 6th was never written.
        assert!(matches!(d.read((0, 1), 0, 6), Err(KvError::Disk { .. })));
        // A write past a gap starts the block's range over: the tokens before it are
        // dropped (reading them is an error), those written read back.
        let (k1, v1) = (
            k.narrow(1, 0, 1)?.narrow(2, 0, 1)?,
            v.narrow(1, 0, 1)?.narrow(2, 0, 1)?,
        );
        // (Blocks are chunks of 4 tokens: tokens 4 and 5 of head 0 go, 0..4 stay.)
        d.write(&k1, &v1, 0, 7)?;
        assert!(matches!(d.read((0, 1), 4, 2), Err(KvError::Disk { .. })));
        assert!(d.read((0, 1), 7, 1).is_ok());
        assert!(d.read((0, 1), 0, 4).is_ok());
        // A write before the range, leaving a gap, is refused.
        assert!(d.write(&k1, &v1, 0, 4).is_err());
        // A damaged header (here: the first block's token range) is caught on read.
        d.file
            .write_all_at(&[9, 0, 0, 0], 4)
            .map_err(|e| KvError::invariant(e.to_string()))?;
        assert!(matches!(d.read((0, 1), 0, 2), Err(KvError::Disk { .. })));
        // Other blocks are intact.
        assert!(d.read((1, 1), 0, 5).is_ok());
        Ok(())
    }
}

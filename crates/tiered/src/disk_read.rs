//! The disk tier's reads (issue "beyond host memory"): a planned read ([`DiskRead`]) of a
//! range of a layer file's heads and tokens, one piece per block it spans, each block's
//! header checked against what the store wrote — read past the page cache (`O_DIRECT` into
//! an aligned bounce buffer, header page and data in one request) or through it
//! ([`DiskIo`]), K's pieces and V's side by side. The file layout is
//! [`DiskKv`](crate::DiskKv)'s.
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};

use crate::disk_format::{disk_err, round_up, ALIGN, HEADER, MAGIC};
use kvpolicy_core::{KvError, Result};

/// `file` opened anew for `O_DIRECT` reads through its `/proc/self/fd` link (the disk
/// tier's files have no name; the link reaches them all the same): its own open file, so
/// the store's descriptor keeps buffered writes. Fails where the file system refuses
/// `O_DIRECT` (tmpfs) or `/proc` is not mounted.
pub(super) fn open_direct(file: &File) -> std::io::Result<File> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(format!("/proc/self/fd/{}", file.as_raw_fd()))
}

/// One `pread` of a [`DiskRead`] and the header its block must carry.
#[derive(Debug, Clone, Copy)]
pub(super) struct Piece {
    /// K (0) or V (1).
    pub kv: usize,
    /// Where the block (its header) starts in the file.
    pub header_at: u64,
    /// The token range the header must record.
    pub expect: (u32, u32),
    /// Where the piece's data starts in the file.
    pub data_at: u64,
    /// Where it goes in the K or V buffer (bytes).
    pub buf_at: usize,
    /// Its length in bytes.
    pub bytes: usize,
}

/// A planned read of the disk tier ([`DiskKv::plan_read`]); [`run`](Self::run) performs it.
#[derive(Debug)]
pub struct DiskRead {
    pub(super) file: Arc<File>,
    /// Read past the page cache, through a descriptor opened for this read.
    pub(super) direct: bool,
    pub(super) path: PathBuf,
    pub(super) pieces: Vec<Piece>,
    pub(super) dims: [usize; 4],
    pub(super) dtype: DType,
}

impl DiskRead {
    /// Reads every piece, checking each block's header against what was written when the
    /// read was planned; returns K and V `(batch, g, len, head_dim)` on the CPU. K's pieces
    /// and V's are read side by side (two requests outstanding: this disk delivers more).
    pub fn run(self) -> Result<(Tensor, Tensor)> {
        let n: usize = self.dims.iter().product();
        let (mut k, mut v) = (ReadBuf::new(self.dtype, n), ReadBuf::new(self.dtype, n));
        std::thread::scope(|s| {
            let values = s.spawn(|| self.read_into(1, &mut v));
            let keys = self.read_into(0, &mut k);
            let values = values
                .join()
                .map_err(|_| KvError::invariant("a disk read thread panicked"))?;
            keys.and(values)
        })?;
        Ok((
            k.tensor(self.dtype, &self.dims)?,
            v.tensor(self.dtype, &self.dims)?,
        ))
    }

    /// Reads the pieces of K (`kv` 0) or V (1) into `buf`.
    fn read_into(&self, kv: usize, buf: &mut ReadBuf) -> Result<()> {
        let io = |e| disk_err("cannot read", &self.path, e);
        let pieces = self.pieces.iter().filter(|p| p.kv == kv);
        let direct = match self.direct {
            true => Some(open_direct(&self.file).map_err(io)?),
            false => None,
        };
        let Some(file) = &direct else {
            for p in pieces {
                let mut header = [0u8; HEADER];
                self.file
                    .read_exact_at(&mut header, p.header_at)
                    .map_err(io)?;
                p.check(&header, &self.path)?;
                self.file
                    .read_exact_at(&mut buf.bytes()[p.buf_at..p.buf_at + p.bytes], p.data_at)
                    .map_err(io)?;
            }
            return Ok(());
        };
        // The widest span one piece reads: its header page, the data pages it touches, and
        // a page of slack to align the buffer's start.
        let widest = self.pieces.iter().map(|p| p.span().1).max().unwrap_or(0);
        let mut bounce = vec![0u8; (widest + 2 * ALIGN) as usize];
        let start = bounce.as_ptr().align_offset(ALIGN as usize);
        let bounce = &mut bounce[start..];
        let page = ALIGN as usize;
        for p in pieces {
            let (data_from, span) = p.span();
            let (data_from, span) = (data_from as usize, span as usize);
            if data_from == page {
                // Header page and data adjoin: one request.
                file.read_exact_at(&mut bounce[..span], p.header_at)
                    .map_err(io)?;
            } else {
                file.read_exact_at(&mut bounce[..page], p.header_at)
                    .map_err(io)?;
                let to = p.header_at + data_from as u64;
                file.read_exact_at(&mut bounce[data_from..span], to)
                    .map_err(io)?;
            }
            p.check(&bounce[..HEADER], &self.path)?;
            let skip = (p.data_at - p.header_at) as usize;
            buf.bytes()[p.buf_at..p.buf_at + p.bytes]
                .copy_from_slice(&bounce[skip..skip + p.bytes]);
        }
        Ok(())
    }
}

impl Piece {
    /// For a direct read, relative to the block's header: where the aligned data read
    /// starts and where the span ends (both whole pages).
    fn span(&self) -> (u64, u64) {
        let from = (self.data_at - self.header_at) / ALIGN * ALIGN;
        let to = round_up(self.data_at - self.header_at + self.bytes as u64);
        (from, to)
    }

    /// Checks a block header read back against what this store wrote.
    fn check(&self, header: &[u8], path: &Path) -> Result<()> {
        let word =
            |i: usize| u32::from_le_bytes([header[i], header[i + 1], header[i + 2], header[i + 3]]);
        if word(0) != MAGIC || (word(4), word(8)) != self.expect {
            return Err(KvError::Disk {
                what: format!(
                    "{}: a block at byte {} records tokens {:?} (magic {:#x}) where this store wrote {:?}",
                    path.display(),
                    self.header_at,
                    (word(4), word(8)),
                    word(0),
                    self.expect
                ),
                source: std::io::Error::from(std::io::ErrorKind::InvalidData),
            });
        }
        Ok(())
    }
}

/// What a [`DiskRead`] reads into: f32 elements directly (the tensor takes the vector, no
/// second copy), other dtypes as bytes.
enum ReadBuf {
    F32(Vec<f32>),
    Bytes(Vec<u8>),
}

impl ReadBuf {
    fn new(dtype: DType, n: usize) -> Self {
        match dtype {
            DType::F32 => Self::F32(vec![0.0; n]),
            other => Self::Bytes(vec![0; n * other.size_in_bytes()]),
        }
    }

    fn bytes(&mut self) -> &mut [u8] {
        match self {
            Self::F32(v) => bytemuck::cast_slice_mut(v),
            Self::Bytes(v) => v,
        }
    }

    fn tensor(self, dtype: DType, dims: &[usize; 4]) -> Result<Tensor> {
        Ok(match self {
            Self::F32(v) => Tensor::from_vec(v, dims, &Device::Cpu)?,
            Self::Bytes(v) => Tensor::from_raw_buffer(&v, dtype, dims, &Device::Cpu)?,
        })
    }
}

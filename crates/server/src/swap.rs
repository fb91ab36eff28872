//! Preemption by swapping (`--preemption-mode swap`): a preempted request's K/V — every
//! layer's, every position it holds, bit for bit what its policy stored
//! ([`KvRestore::export_kv`](kvpolicy::core::KvRestore::export_kv)) — go to a file of its
//! own on the disk tier, and its cache is freed; admitted again, the file is read and
//! appended back ([`restore_kv`](kvpolicy::prefix::restore_kv)) and the request goes on from
//! where it stopped, computing nothing twice (vLLM's swap preemption, Kwon et al.,
//! PagedAttention, SOSP '23 §4.5, there to host RAM; here to the tier below it). The files
//! live in a directory of this process's own under `--disk-dir` (mode 0700, removed when the
//! server stops — a server killed outright leaves it), one file (mode 0600) per preempted
//! request, removed when it resumes or leaves; a request whose policy cannot hand every
//! layer back (a window dropped a layer's front, K/V stored converted) is preempted by
//! recomputation instead.
use std::io::Write;
use std::os::unix::fs::{FileExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use anyhow::{ensure, Context, Result};
use candle_core::{DType, Device, Tensor};
use kvpolicy::prefix::{ChunkKv, LayerKv};
use kvpolicy::KvPolicy;

/// How a preempted request gets its cache back (vLLM's `preemption_mode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PreemptionMode {
    /// Dropped, and computed again from its tokens when it resumes.
    Recompute,
    /// Written to the disk tier (`--disk-dir`), and read back when it resumes.
    Swap,
}

impl PreemptionMode {
    /// The label of `/metrics`' preemption counter.
    pub fn label(self) -> &'static str {
        match self {
            Self::Recompute => "recompute",
            Self::Swap => "swap",
        }
    }
}

/// The directory preempted requests' K/V are swapped to.
pub struct SwapSpace {
    dir: tempfile::TempDir,
    next: u64,
}

/// One preempted request's K/V in a file of its own (removed when this is dropped): every
/// layer's K then V, each `(tokens, heads, head_dim)` — token-major, so that a piece of
/// positions is one read.
#[derive(Debug)]
pub struct Swapped {
    path: PathBuf,
    /// Positions held: `0..tokens` of every layer.
    pub tokens: usize,
    /// The file's bytes.
    pub bytes: u64,
    dtype: DType,
    /// Per layer, its KV heads and head width.
    layers: Vec<LayerWidth>,
}

/// One layer's K (or V) per token.
#[derive(Clone, Copy, Debug)]
struct LayerWidth {
    heads: usize,
    head_dim: usize,
}

impl Drop for Swapped {
    fn drop(&mut self) {
        // A file half written, or read back: nothing stays.
        let _ = std::fs::remove_file(&self.path);
    }
}

impl SwapSpace {
    /// A directory of this process's own under `parent` (which must exist).
    pub fn new(parent: &Path) -> Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix(".kvpolicy-swap-")
            .permissions(std::fs::Permissions::from_mode(0o700))
            .tempdir_in(parent)
            .with_context(|| {
                format!(
                    "--preemption-mode swap: cannot create a directory in --disk-dir {}; \
                     give a writable directory",
                    parent.display()
                )
            })?;
        Ok(Self { dir, next: 0 })
    }

    /// Writes slot `seq`'s K/V of `layers` layers, `tokens` positions each, from `policy`,
    /// one layer at a time; `None` when the policy cannot hand every layer back exactly
    /// (then nothing is left behind).
    pub fn swap_out(
        &mut self,
        policy: &mut dyn KvPolicy,
        seq: usize,
        layers: usize,
        tokens: usize,
    ) -> Result<Option<Swapped>> {
        let Some(r) = policy.as_restore() else {
            return Ok(None);
        };
        self.next += 1;
        let path = self.dir.path().join(format!("{}.kv", self.next));
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .with_context(|| format!("creating {}", path.display()))?;
        let mut out = Swapped {
            path,
            tokens,
            bytes: 0,
            dtype: DType::F32,
            layers: Vec::with_capacity(layers),
        };
        let mut w = std::io::BufWriter::new(file);
        for layer in 0..layers {
            let Some(kv) = r.export_kv(seq, layer)? else {
                return Ok(None);
            };
            let (_, heads, n, head_dim) = kv.k.dims4()?;
            if n != tokens || kv.v.dims4()? != (1, heads, n, head_dim) {
                return Ok(None);
            }
            if layer > 0 && kv.k.dtype() != out.dtype {
                return Ok(None);
            }
            out.dtype = kv.k.dtype();
            out.layers.push(LayerWidth { heads, head_dim });
            for t in [&kv.k, &kv.v] {
                t.permute((0, 2, 1, 3))?
                    .contiguous()?
                    .write_bytes(&mut w)
                    .with_context(|| format!("writing {}", out.path.display()))?;
            }
        }
        w.flush()
            .with_context(|| format!("writing {}", out.path.display()))?;
        out.bytes = (0..layers).map(|l| 2 * out.block(l, tokens)).sum();
        Ok(Some(out))
    }
}

impl Swapped {
    /// Bytes of `tokens` positions of layer `layer`'s K (or V).
    fn block(&self, layer: usize, tokens: usize) -> u64 {
        let w = self.layers[layer];
        (tokens * w.heads * w.head_dim * self.dtype.size_in_bytes()) as u64
    }

    /// Positions `from..from + len` of every layer, read from the file.
    pub fn piece(&self, from: usize, len: usize) -> Result<ChunkKv> {
        ensure!(
            from + len <= self.tokens,
            "positions {from}..{} of a swapped request holding {}",
            from + len,
            self.tokens
        );
        let file = std::fs::File::open(&self.path).with_context(|| {
            format!(
                "reading a swapped request back from {}",
                self.path.display()
            )
        })?;
        let mut at = 0;
        let mut layers = Vec::with_capacity(self.layers.len());
        for (l, w) in self.layers.iter().enumerate() {
            let whole = self.block(l, self.tokens);
            let read = |base: u64| -> Result<Tensor> {
                let mut buf = vec![0u8; self.block(l, len) as usize];
                file.read_exact_at(&mut buf, base + self.block(l, from))
                    .with_context(|| format!("reading {}", self.path.display()))?;
                let t = Tensor::from_raw_buffer(
                    &buf,
                    self.dtype,
                    &[1, len, w.heads, w.head_dim],
                    &Device::Cpu,
                )?;
                Ok(t.permute((0, 2, 1, 3))?.contiguous()?)
            };
            layers.push(LayerKv {
                k: read(at)?,
                v: read(at + whole)?,
            });
            at += 2 * whole;
        }
        Ok(ChunkKv { layers })
    }
}

//! Quantized matmul on the CPU as a candle [`CustomOp1`] for GGML's 32-element block
//! formats — Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 — and the K-quants Gemma 3 uses (Q4_K, Q6_K,
//! [`kquants`]): the CPU half of llama.cpp's `ggml_vec_dot_q4_1_q8_1` and
//! `ggml_vec_dot_q4_K_q8_K` families. Candle 0.11 dots Q4_1, Q5_0 and Q5_1 with a scalar loop
//! (`BlockQ4_1::vec_dot` in its `k_quants.rs`), 8–10× slower than this; for Q4_0 and Q8_0
//! its AVX path exists but this one measured faster in the model (1.5× and 1.2× decode on
//! SmolLM2, bench-results/2026-11-23-cpu-speed.md).
//!
//! `y = x·Wᵀ` with `W` `(n, k)` quantized and `x` `(…, k)` f32: each activation row is
//! quantized once per call to Q8_0 (Q8_1 for the formats with an offset; Q8_K for the
//! K-quants), exactly as candle quantizes it, and every output is an integer dot product
//! per block scaled in f32 — AVX2 + FMA when the CPU has them (runtime detection, [`avx2`],
//! [`avx2_kquants`]), the portable loop otherwise ([`blocks::dot_scalar`],
//! [`kquants::dot_scalar`]). Work is split over output rows on candle's own CPU
//! worker pool (`utils::barrier_pool`, the one its other quantized matmuls and our attention
//! run on, so no two pools compete for the cores); each task walks its weight rows once for
//! all activation rows (a short chunk reuses a weight row from L1 for every row).
//!
//! From [`GEMM_MIN_ROWS`] activation rows (a prefill chunk) a call is the integer GEMM
//! ([`gemm`]) where the CPU runs one of its micro-kernels, for every format here.
//!
//! Q4_0 and Q4_K weights whose rows come in whole groups of eight are held interleaved
//! eight rows at a time on a CPU with AVX2 ([`rows8`], [`avx2_rows8`], [`rows8_k`],
//! [`avx2_rows8_k`]; [`QuantMatMul::interleave_owned`] at load, in place): a decode step's
//! products then sum eight rows per instruction, at the memory's bandwidth on 1B–8B shapes
//! (bench-results/2026-11-27-cpu-scale.md).
use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};

#[cfg(target_arch = "x86_64")]
pub mod avx2;
#[cfg(target_arch = "x86_64")]
pub mod avx2_kquants;
#[cfg(target_arch = "x86_64")]
pub mod avx2_rows8;
#[cfg(target_arch = "x86_64")]
pub mod avx2_rows8_k;
#[cfg(target_arch = "x86_64")]
pub mod avx2_tile;
#[cfg(target_arch = "x86_64")]
pub mod avx512;
pub mod blocks;
mod decode8;
mod disjoint;
#[cfg(target_arch = "x86_64")]
mod features;
pub mod gemm;
pub mod kquants;
pub mod panel;
pub mod rows8;
pub mod rows8_k;

pub use blocks::{ActBlock, WeightFormat, QK};
pub use decode8::{dot_rows8, dot_rows8_k, Interleaved};
pub use kquants::{KQuant, Q8KRow};
pub use panel::{PanelFormat, WeightRows};

use disjoint::Disjoint;

/// Activation rows from which a call runs as the integer GEMM ([`gemm`]) where the CPU
/// has it; fewer rows are dotted against the weight's blocks row by row.
pub const GEMM_MIN_ROWS: usize = 32;

/// Output rows per work item.
const ROWS_PER_TASK: usize = 16;

/// The format of `dtype` if this module handles it.
pub fn format_of(dtype: GgmlDType) -> Option<WeightFormat> {
    match dtype {
        GgmlDType::Q4_0 => Some(WeightFormat::Q4_0),
        GgmlDType::Q4_1 => Some(WeightFormat::Q4_1),
        GgmlDType::Q5_0 => Some(WeightFormat::Q5_0),
        GgmlDType::Q5_1 => Some(WeightFormat::Q5_1),
        GgmlDType::Q8_0 => Some(WeightFormat::Q8_0),
        _ => None,
    }
}

/// The panel format of `dtype` if the integer GEMM packs it.
pub fn panel_format_of(dtype: GgmlDType) -> Option<PanelFormat> {
    match dtype {
        GgmlDType::Q4K => Some(PanelFormat::Q4K),
        GgmlDType::Q6K => Some(PanelFormat::Q6K),
        _ => format_of(dtype).map(PanelFormat::Block),
    }
}

/// One weight row's dot product with quantized activations, on the fastest path here.
#[inline]
pub fn dot(fmt: WeightFormat, row: &[u8], x: &[ActBlock]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if avx2::vnni() {
        // SAFETY: `vnni` checked AVX2, FMA, F16C and AVX-VNNI.
        return unsafe { avx2::dot_vnni(fmt, row, x) };
    }
    #[cfg(target_arch = "x86_64")]
    if avx2::available() {
        // SAFETY: `available` checked AVX2, FMA and F16C.
        return unsafe { avx2::dot(fmt, row, x) };
    }
    blocks::dot_scalar(fmt, row, x)
}

/// [`dot`] for `out.len()` consecutive weight rows of `data` (each `x.len()` blocks of
/// `fmt`), into `out` — a decode step's whole range of rows in one call; each result bit
/// for bit [`dot`]'s.
pub fn dot_rows(fmt: WeightFormat, data: &[u8], x: &[ActBlock], out: &mut [f32]) {
    let row_bytes = x.len() * fmt.block_bytes();
    assert!(
        data.len() >= out.len() * row_bytes,
        "dot_rows: {} bytes hold fewer than {} rows of {row_bytes}",
        data.len(),
        out.len()
    );
    #[cfg(target_arch = "x86_64")]
    if avx2::vnni() {
        // SAFETY: `vnni` checked AVX2, FMA, F16C and AVX-VNNI; `data` holds the rows.
        return unsafe { avx2::dot_rows_vnni(fmt, data, x, out) };
    }
    #[cfg(target_arch = "x86_64")]
    if avx2::available() {
        // SAFETY: `available` checked AVX2, FMA and F16C; `data` holds the rows.
        return unsafe { avx2::dot_rows(fmt, data, x, out) };
    }
    for (r, o) in out.iter_mut().enumerate() {
        *o = blocks::dot_scalar(fmt, &data[r * row_bytes..(r + 1) * row_bytes], x);
    }
}

/// [`kquants::dot_scalar`] for `out.len()` consecutive K-quant weight rows of `data` (each
/// `x`'s length), into `out` — a decode step's rows; each result bit for bit the portable
/// one's, on AVX2 (AVX-VNNI) where the CPU has it.
pub fn dot_rows_k(fmt: KQuant, data: &[u8], x: &Q8KRow, out: &mut [f32]) {
    let row_bytes = x.blocks.len() * QK / kquants::QK_K * fmt.block_bytes();
    assert!(
        data.len() >= out.len() * row_bytes,
        "dot_rows_k: {} bytes hold fewer than {} rows of {row_bytes}",
        data.len(),
        out.len()
    );
    #[cfg(target_arch = "x86_64")]
    if avx2::vnni() {
        // SAFETY: `vnni` checked AVX2, FMA, F16C and AVX-VNNI.
        return unsafe { avx2_kquants::dot_rows_vnni(fmt, data, x, out) };
    }
    #[cfg(target_arch = "x86_64")]
    if avx2::available() {
        // SAFETY: `available` checked AVX2, FMA and F16C.
        return unsafe { avx2_kquants::dot_rows(fmt, data, x, out) };
    }
    for (r, o) in out.iter_mut().enumerate() {
        *o = kquants::dot_scalar(fmt, &data[r * row_bytes..(r + 1) * row_bytes], x);
    }
}

/// Activation rows quantized for a weight format's row dot products.
enum RowActs {
    /// Q8_0/Q8_1 blocks, `per_row` for each row, for a 32-element format.
    Block {
        fmt: WeightFormat,
        blocks: Vec<ActBlock>,
        per_row: usize,
    },
    /// Q8_K rows for a K-quant.
    K { fmt: KQuant, rows: Vec<Q8KRow> },
}

impl RowActs {
    fn new(fmt: PanelFormat, x: &[f32], k: usize) -> Self {
        match fmt {
            PanelFormat::Block(fmt) => {
                let per_row = k / QK;
                let mut blocks = vec![ActBlock::ZERO; x.len() / k * per_row];
                for (row, out) in x.chunks_exact(k).zip(blocks.chunks_exact_mut(per_row)) {
                    blocks::quantize_row(row, out);
                }
                Self::Block {
                    fmt,
                    blocks,
                    per_row,
                }
            }
            PanelFormat::Q4K | PanelFormat::Q6K => Self::K {
                fmt: if fmt == PanelFormat::Q4K {
                    KQuant::Q4K
                } else {
                    KQuant::Q6K
                },
                rows: x.chunks_exact(k).map(Q8KRow::new).collect(),
            },
        }
    }

    /// Consecutive weight rows `data` dotted with activation row `i` into `out`.
    fn rows_into(&self, i: usize, data: &[u8], out: &mut [f32]) {
        match self {
            Self::Block {
                fmt,
                blocks,
                per_row,
            } => dot_rows(*fmt, data, &blocks[i * per_row..(i + 1) * per_row], out),
            Self::K { fmt, rows } => dot_rows_k(*fmt, data, &rows[i], out),
        }
    }
}

/// Where a [`QuantMatMul`]'s weight bytes live.
#[derive(Debug, Clone)]
enum Weight {
    /// Candle's tensor, row-major blocks as in the GGUF.
    Tensor(Arc<QTensor>),
    /// Q4_0 or Q4_K interleaved eight rows at a time ([`rows8`], [`rows8_k`]), the only copy.
    Rows8(Arc<Vec<u8>>),
}

/// `x·Wᵀ` for a quantized `W` of a format this module handles.
#[derive(Debug, Clone)]
pub struct QuantMatMul {
    w: Weight,
    fmt: PanelFormat,
    n: usize,
    k: usize,
}

impl QuantMatMul {
    /// The op for `w` `(n, k)`, or `None` when its format is not one handled here (candle's
    /// own kernels then apply), it is not on the CPU, or `k` is not whole blocks.
    pub fn new(w: Arc<QTensor>) -> Option<Self> {
        let fmt = panel_format_of(w.dtype())?;
        let (n, k) = w.shape().dims2().ok()?;
        (k % fmt.block_elems() == 0 && matches!(w.device(), candle_core::Device::Cpu)).then_some(
            Self {
                w: Weight::Tensor(w),
                fmt,
                n,
                k,
            },
        )
    }

    /// The interleaved layout an `(n, k)` weight of `dtype` is held in for the decode step's
    /// kernels, if any: Q4_0 ([`rows8`]) or Q4_K ([`rows8_k`]) in whole groups of eight
    /// rows, on a CPU with AVX2 (and so one of the integer GEMM's kernels for prefill).
    pub fn interleaves(dtype: GgmlDType, n: usize, k: usize) -> Option<Interleaved> {
        let (fmt, fits) = match dtype {
            GgmlDType::Q4_0 => (Interleaved::Q4_0, rows8::fits(WeightFormat::Q4_0, n, k)),
            GgmlDType::Q4K => (Interleaved::Q4K, rows8_k::fits(n, k)),
            _ => return None,
        };
        #[cfg(target_arch = "x86_64")]
        let simd = features::avx2()
            && panel_format_of(dtype).is_some_and(|f| gemm::kernel_for(f).is_some());
        #[cfg(not(target_arch = "x86_64"))]
        let simd = false;
        (simd && fits).then_some(fmt)
    }

    /// The op for the row-major weight `bytes` `(n, k)` of `dtype` (as a GGUF stores it),
    /// interleaved where it lies (no second copy) — what a loader calls where
    /// [`Self::interleaves`]; the bytes back, untouched, otherwise.
    pub fn interleave_owned(
        mut bytes: Vec<u8>,
        dtype: GgmlDType,
        n: usize,
        k: usize,
    ) -> std::result::Result<Self, Vec<u8>> {
        let done = match Self::interleaves(dtype, n, k) {
            Some(Interleaved::Q4_0) => rows8::interleave_in_place(&mut bytes, n, k),
            Some(Interleaved::Q4K) => rows8_k::interleave_in_place(&mut bytes, n, k),
            None => false,
        };
        match (done, panel_format_of(dtype)) {
            (true, Some(fmt)) => Ok(Self {
                w: Weight::Rows8(Arc::new(bytes)),
                fmt,
                n,
                k,
            }),
            _ => Err(bytes),
        }
    }

    /// This op with its weight interleaved ([`Self::interleaves`]) in a new buffer; the new
    /// op holds its only copy, so once every other holder of the tensor drops it the
    /// row-major bytes are freed. `None` where it does not apply.
    pub fn interleaved(&self) -> Option<Self> {
        let Weight::Tensor(t) = &self.w else {
            return None;
        };
        // Checked before the copy: a weight that stays row-major is never copied.
        Self::interleaves(t.dtype(), self.n, self.k)?;
        Self::interleave_owned(t.data().ok()?.to_vec(), t.dtype(), self.n, self.k).ok()
    }

    /// Whether the weight is held interleaved ([`Self::interleaved`]).
    pub fn is_interleaved(&self) -> bool {
        matches!(self.w, Weight::Rows8(_))
    }

    /// The weight's shape `(n, k)`.
    pub fn dims(&self) -> (usize, usize) {
        (self.n, self.k)
    }

    /// Rows `ids` of the weight as row-major blocks of its format (an embedding lookup
    /// through a tied table), one after the other; an error names an id past the rows.
    pub fn plain_rows(&self, ids: &[u32]) -> Result<Vec<u8>> {
        let row_bytes = self.fmt.row_bytes(self.k);
        let mut out = Vec::with_capacity(ids.len() * row_bytes);
        for &id in ids {
            let r = id as usize;
            if r >= self.n {
                candle_core::bail!(
                    "token id {id} is outside the embedding table's {} rows",
                    self.n
                );
            }
            match &self.w {
                Weight::Tensor(t) => {
                    out.extend_from_slice(&t.data()?[r * row_bytes..(r + 1) * row_bytes])
                }
                Weight::Rows8(d) if self.fmt == PanelFormat::Q4K => {
                    rows8_k::plain_row(d, self.k, r, &mut out)
                }
                Weight::Rows8(d) => rows8::plain_row(d, self.k, r, &mut out),
            }
        }
        Ok(out)
    }

    /// The GGML type of the weight.
    pub fn ggml_dtype(&self) -> GgmlDType {
        match self.fmt {
            PanelFormat::Q4K => GgmlDType::Q4K,
            PanelFormat::Q6K => GgmlDType::Q6K,
            PanelFormat::Block(WeightFormat::Q4_0) => GgmlDType::Q4_0,
            PanelFormat::Block(WeightFormat::Q4_1) => GgmlDType::Q4_1,
            PanelFormat::Block(WeightFormat::Q5_0) => GgmlDType::Q5_0,
            PanelFormat::Block(WeightFormat::Q5_1) => GgmlDType::Q5_1,
            PanelFormat::Block(WeightFormat::Q8_0) => GgmlDType::Q8_0,
        }
    }

    /// Whether a call with `rows` activation rows runs here: as the integer GEMM from
    /// [`GEMM_MIN_ROWS`] rows where the CPU has it, else as row dot products (every format).
    pub fn handles(&self, rows: usize) -> bool {
        rows < GEMM_MIN_ROWS || gemm::kernel_for(self.fmt).is_some()
    }

    /// Applies the op to `x` `(…, k)` (f32; another float type is computed in f32 and
    /// returned in its own).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if x.dtype() != DType::F32 {
            let y = self.forward(&x.to_dtype(DType::F32)?)?;
            return y.to_dtype(x.dtype());
        }
        x.contiguous()?.apply_op1_no_bwd(self)
    }
}

impl CustomOp1 for QuantMatMul {
    fn name(&self) -> &'static str {
        "kvpolicy-quant-matmul"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = match storage {
            CpuStorage::F32(v) => v,
            _ => candle_core::bail!("quantized matmul takes f32 activations"),
        };
        let (start, end) = layout
            .contiguous_offsets()
            .ok_or_else(|| candle_core::Error::Msg("quantized matmul: x not contiguous".into()))?;
        let x = &x[start..end];
        let dims = layout.shape().dims();
        let (k, n) = (self.k, self.n);
        if dims.last() != Some(&k) {
            candle_core::bail!("quantized matmul: x is {dims:?}, the weight takes {k} inputs");
        }
        let m = x.len() / k;
        let row_bytes = self.fmt.row_bytes(k);
        let data = match &self.w {
            Weight::Tensor(t) => t.data()?,
            Weight::Rows8(d) => std::borrow::Cow::Borrowed(d.as_slice()),
        };
        if data.len() != n * row_bytes {
            candle_core::bail!(
                "quantized matmul: weight holds {} bytes, expected {n} rows of {row_bytes}",
                data.len()
            );
        }
        let weight = match &self.w {
            Weight::Tensor(_) => WeightRows::Plain(&data),
            Weight::Rows8(_) => WeightRows::Rows8(&data),
        };
        let mut out_dims = dims.to_vec();
        if let Some(last) = out_dims.last_mut() {
            *last = n;
        }
        if let Some(kernel) = gemm::kernel_for(self.fmt).filter(|_| m >= GEMM_MIN_ROWS) {
            let y = gemm::gemm_rows(kernel, self.fmt, weight, n, k, x);
            return Ok((CpuStorage::F32(y), Shape::from(out_dims)));
        }
        if let WeightRows::Rows8(data) = weight {
            let fmt = match self.fmt {
                PanelFormat::Q4K => Interleaved::Q4K,
                _ => Interleaved::Q4_0,
            };
            let y = decode8::products(fmt, data, n, k, x);
            return Ok((CpuStorage::F32(y), Shape::from(out_dims)));
        }
        let acts = RowActs::new(self.fmt, x, k);
        // Output transposed, (n, m): each work item owns whole weight rows.
        let mut yt = vec![0f32; n * m];
        let out = Disjoint(yt.as_mut_ptr());
        candle_core::utils::barrier_pool().execute_chunked(n.div_ceil(ROWS_PER_TASK), |tasks| {
            let rows = tasks.start * ROWS_PER_TASK..(tasks.end * ROWS_PER_TASK).min(n);
            if m == 1 {
                // A decode step: the task's rows in one call.
                // SAFETY: `execute_chunked` hands each range of rows to one worker, so
                // elements `rows` of `yt` (length n·1) are written by this thread alone, and
                // `yt` outlives the call, which returns when every worker is done.
                let mine = unsafe { out.slice(rows.clone()) };
                acts.rows_into(0, &data[rows.start * row_bytes..rows.end * row_bytes], mine);
                return;
            }
            for r in rows {
                let w = &data[r * row_bytes..(r + 1) * row_bytes];
                for i in 0..m {
                    let mut y = [0f32];
                    acts.rows_into(i, w, &mut y);
                    // SAFETY: `execute_chunked` hands each range of rows to one worker, so
                    // element (r, i) of `yt` (length n·m) is written by exactly one thread,
                    // and `yt` outlives the call, which returns when every worker is done.
                    unsafe { out.write(r * m + i, y[0]) };
                }
            }
        });
        let y = if m == 1 {
            yt
        } else {
            let mut y = vec![0f32; m * n];
            for (r, col) in yt.chunks_exact(m).enumerate() {
                for (i, v) in col.iter().enumerate() {
                    y[i * n + r] = *v;
                }
            }
            y
        };
        Ok((CpuStorage::F32(y), Shape::from(out_dims)))
    }
}

/// Whether a [`QuantMatMul`] applies to `x` for this weight: f32 activations on the CPU.
pub fn applies(x: &Tensor) -> bool {
    x.dtype() == DType::F32 && x.device().is_cpu()
}

//! Quantized prefill without dequantizing: `y = x·Wᵀ` for a chunk of activation rows as
//! an integer GEMM, llama.cpp's way (`ggml_compute_forward_mul_mat` with `vec_dot_type`
//! Q8 and its repacked GEMMs): the activations are quantized once per call as the decode
//! path quantizes them (Q8_0/Q8_1 per 32 values, [`super::blocks::quantize_row`]; Q8_K's one
//! scale per 256 for the K-quants, as candle's and llama.cpp's K-quant dots do), so a row
//! gets the same integer values whether it is decoded or prefilled; the weight is repacked
//! a 16-column [`Panel`] at a time, and every block is an exact integer dot product scaled
//! in f32.
//!
//! Work is split over panels on candle's CPU worker pool; each task packs its panel once
//! (it stays in L1) and runs every activation row against it, a few rows per micro-kernel
//! call. Micro-kernels ([`Kernel`], runtime detection): AVX-512 VNNI ([`super::avx512`]),
//! AVX-VNNI and AVX2 at 256 bits ([`super::avx2_tile`]; plain AVX2 not for Q8_0). Where
//! none applies (other architectures; Q8_0 on plain AVX2) callers keep the
//! dequantize-and-f32-GEMM path ([`kernel_for`] says which) rather than a portable integer
//! GEMM, which would be slower than that f32 one; [`reference()`] is the integer math in
//! scalar code, for the tests.
use super::blocks::{quantize_row, quantize_row_q8k, ActBlock, WeightFormat, QK};
use super::disjoint::Disjoint;
use super::panel::{Panel, PanelFormat, WeightRows, NR};

/// A micro-kernel of the integer GEMM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    /// AVX-512 F/BW/VNNI: 8 rows × 16 columns per call.
    Avx512,
    /// AVX2 + FMA + AVX-VNNI: 3 rows × 16 columns.
    AvxVnni,
    /// AVX2 + FMA (`maddubs`): 3 rows × 16 columns; not Q8_0.
    Avx2,
}

impl Kernel {
    /// Every kernel, fastest first.
    pub const ALL: [Kernel; 3] = [Kernel::Avx512, Kernel::AvxVnni, Kernel::Avx2];

    /// Whether this CPU runs this kernel for `fmt`.
    pub fn runs(self, fmt: PanelFormat) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            match self {
                Kernel::Avx512 => super::avx512::available(),
                Kernel::AvxVnni => super::avx2::vnni(),
                Kernel::Avx2 => {
                    super::avx2::available() && super::avx2_tile::exact_without_vnni(fmt)
                }
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = fmt;
            false
        }
    }

    /// Activation rows per call.
    fn rows(self) -> usize {
        match self {
            Kernel::Avx512 => 8,
            Kernel::AvxVnni | Kernel::Avx2 => 3,
        }
    }
}

/// The fastest kernel this CPU runs for `fmt`, if any.
pub fn kernel_for(fmt: PanelFormat) -> Option<Kernel> {
    Kernel::ALL.into_iter().find(|k| k.runs(fmt))
}

/// A chunk's activations, quantized: `m` rows of `blocks` blocks, per sub-block the
/// integer zero term `−z·Σq` of the weight's format, and per block `d·Σq` in f32 for the
/// formats with an offset (the decode path's `ActBlock::s` is rounded through f16 as
/// candle's Q8_1 is; here it is not).
pub struct QuantizedRows {
    /// Row-major blocks.
    pub x: Vec<ActBlock>,
    /// Row-major `−z·Σq`, `blocks · subs` per row.
    pub zsum: Vec<i32>,
    /// Row-major `d·Σq` per block (empty for formats without an offset).
    pub sx: Vec<f32>,
    /// Blocks per row.
    pub blocks: usize,
}

impl QuantizedRows {
    /// Quantizes `x` (`m` rows of `k`) for weights of `fmt`, rows spread over the pool.
    pub fn new(fmt: PanelFormat, x: &[f32], k: usize) -> Self {
        let blocks = k / QK;
        let m = x.len() / k;
        let subs = fmt.subs();
        let mut xq = vec![ActBlock::ZERO; m * blocks];
        let mut zsum = vec![0i32; m * blocks * subs];
        let off = fmt.has_offset();
        let mut sx = vec![0f32; if off { m * blocks } else { 0 }];
        let (xo, zo, so) = (
            Disjoint(xq.as_mut_ptr()),
            Disjoint(zsum.as_mut_ptr()),
            Disjoint(sx.as_mut_ptr()),
        );
        let z = fmt.zero();
        candle_core::utils::barrier_pool().execute_chunked(m, |rows| {
            for r in rows {
                // SAFETY: each row index is handed to one worker only, so its ranges of
                // `xq` and `zsum` are written by one thread; both outlive the call.
                let (out, zs) = unsafe {
                    (
                        xo.slice(r * blocks..(r + 1) * blocks),
                        zo.slice(r * blocks * subs..(r + 1) * blocks * subs),
                    )
                };
                if fmt.block_elems() == 256 {
                    quantize_row_q8k(&x[r * k..(r + 1) * k], out);
                } else {
                    quantize_row(&x[r * k..(r + 1) * k], out);
                }
                for (i, (b, zb)) in out.iter().zip(zs.chunks_exact_mut(subs)).enumerate() {
                    let mut total = 0;
                    for (s, v) in b.qs.chunks_exact(QK / subs).zip(zb.iter_mut()) {
                        let sum = s.iter().map(|q| *q as i32).sum::<i32>();
                        *v = -z * sum;
                        total += sum;
                    }
                    if off {
                        // SAFETY: as above; element (r, i) of `sx` is this row's.
                        unsafe { so.write(r * blocks + i, b.d * total as f32) };
                    }
                }
            }
        });
        Self {
            x: xq,
            zsum,
            sx,
            blocks,
        }
    }

    /// Rows `r0 .. r0 + count` for the micro-kernel.
    #[cfg(target_arch = "x86_64")]
    fn tile_rows(&self, r0: usize, count: usize, subs: usize) -> super::avx512::TileRows<'_> {
        let b = self.blocks;
        super::avx512::TileRows {
            x: &self.x[r0 * b..(r0 + count) * b],
            zsum: &self.zsum[r0 * b * subs..(r0 + count) * b * subs],
            sx: if self.sx.is_empty() {
                &[]
            } else {
                &self.sx[r0 * b..(r0 + count) * b]
            },
            blocks: b,
        }
    }
}

/// `x·Wᵀ`, `(m, n)` row-major, for `x` `(m, k)` and the `(n, k)` weight `data` of `fmt`,
/// on `kernel`; `k` is a multiple of the format's block.
///
/// # Panics
/// If this CPU does not run `kernel` for `fmt` ([`Kernel::runs`]).
pub fn gemm(
    kernel: Kernel,
    fmt: PanelFormat,
    data: &[u8],
    n: usize,
    k: usize,
    x: &[f32],
) -> Vec<f32> {
    gemm_rows(kernel, fmt, WeightRows::Plain(data), n, k, x)
}

/// [`gemm()`] for a weight in either layout ([`WeightRows`]): the same result from the same
/// weight.
///
/// # Panics
/// If this CPU does not run `kernel` for `fmt` ([`Kernel::runs`]).
pub fn gemm_rows(
    kernel: Kernel,
    fmt: PanelFormat,
    weight: WeightRows<'_>,
    n: usize,
    k: usize,
    x: &[f32],
) -> Vec<f32> {
    let (WeightRows::Plain(data) | WeightRows::Rows8(data)) = weight;
    if let WeightRows::Rows8(_) = weight {
        assert!(
            matches!(fmt, PanelFormat::Q4K | PanelFormat::Block(WeightFormat::Q4_0))
                && n.is_multiple_of(8),
            "gemm: an interleaved weight is Q4_0 or Q4_K in whole groups of eight rows, not {fmt:?} with {n} rows"
        );
    }
    assert!(
        kernel.runs(fmt),
        "{kernel:?} does not run {fmt:?} on this CPU"
    );
    let row_bytes = fmt.row_bytes(k);
    assert!(
        k > 0
            && k.is_multiple_of(fmt.block_elems())
            && data.len() == n * row_bytes
            && x.len().is_multiple_of(k),
        "gemm: {} weight bytes, x of {} values, are not (n = {n}, k = {k}) of {fmt:?}",
        data.len(),
        x.len()
    );
    let mr = kernel.rows();
    let m = x.len() / k;
    let rows = QuantizedRows::new(fmt, x, k);
    let mut y = vec![0f32; m * n];
    let out = Disjoint(y.as_mut_ptr());
    candle_core::utils::barrier_pool().execute_chunked(n.div_ceil(NR), |panels| {
        let mut panel = Panel::default();
        for p in panels {
            panel.pack_from(fmt, weight, n, k, p);
            let cols = NR.min(n - NR * p);
            let mut r0 = 0;
            while r0 < m {
                let count = mr.min(m - r0);
                let at = TileAt {
                    r0,
                    count,
                    cols,
                    ldo: n,
                };
                // SAFETY: `kernel` runs here (asserted); panel p's columns are written by
                // this task alone (one worker per panel), `y` outlives the call, and `tile`
                // writes `cols` columns of `count` rows from (r0, NR·p), all inside `y`.
                unsafe { tile(kernel, fmt, &panel, &rows, at, out.at(r0 * n + NR * p)) };
                r0 += count;
            }
        }
    });
    y
}

/// Where one micro-kernel call reads and writes: rows `r0 .. r0 + count`, `cols` of the
/// panel's columns, output row stride `ldo`.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
struct TileAt {
    r0: usize,
    count: usize,
    cols: usize,
    ldo: usize,
}

/// Dispatches one micro-kernel call by kernel, row count and format shape.
///
/// # Safety
/// `kernel` runs on this CPU for `fmt`; otherwise as [`super::avx512::tile`], for the rows
/// of `at`.
#[cfg(target_arch = "x86_64")]
unsafe fn tile(
    kernel: Kernel,
    fmt: PanelFormat,
    panel: &Panel,
    rows: &QuantizedRows,
    at: TileAt,
    out: *mut f32,
) {
    use super::avx2_tile::{tile_avx2, tile_vnni};
    use super::avx512::tile as t512;
    let tr = rows.tile_rows(at.r0, at.count, fmt.subs());
    let (ldo, cols) = (at.ldo, at.cols);
    macro_rules! by_rows {
        ($s:literal, $o:literal) => {
            match (kernel, at.count) {
                (Kernel::Avx512, 8) => t512::<8, $s, $o>(panel, &tr, out, ldo, cols),
                (Kernel::Avx512, 7) => t512::<7, $s, $o>(panel, &tr, out, ldo, cols),
                (Kernel::Avx512, 6) => t512::<6, $s, $o>(panel, &tr, out, ldo, cols),
                (Kernel::Avx512, 5) => t512::<5, $s, $o>(panel, &tr, out, ldo, cols),
                (Kernel::Avx512, 4) => t512::<4, $s, $o>(panel, &tr, out, ldo, cols),
                (Kernel::Avx512, 3) => t512::<3, $s, $o>(panel, &tr, out, ldo, cols),
                (Kernel::Avx512, 2) => t512::<2, $s, $o>(panel, &tr, out, ldo, cols),
                (Kernel::Avx512, _) => t512::<1, $s, $o>(panel, &tr, out, ldo, cols),
                (Kernel::AvxVnni, 3) => tile_vnni::<3, $s, $o>(panel, &tr, out, ldo, cols),
                (Kernel::AvxVnni, 2) => tile_vnni::<2, $s, $o>(panel, &tr, out, ldo, cols),
                (Kernel::AvxVnni, _) => tile_vnni::<1, $s, $o>(panel, &tr, out, ldo, cols),
                (Kernel::Avx2, 3) => tile_avx2::<3, $s, $o>(panel, &tr, out, ldo, cols),
                (Kernel::Avx2, 2) => tile_avx2::<2, $s, $o>(panel, &tr, out, ldo, cols),
                (Kernel::Avx2, _) => tile_avx2::<1, $s, $o>(panel, &tr, out, ldo, cols),
            }
        };
    }
    match (fmt.subs(), fmt.has_offset()) {
        (2, false) => by_rows!(2, false),
        (2, true) => unreachable!("no format has 16-element sub-blocks and offsets"),
        (_, true) => by_rows!(1, true),
        _ => by_rows!(1, false),
    }
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn tile(_: Kernel, _: PanelFormat, _: &Panel, _: &QuantizedRows, _: TileAt, _: *mut f32) {
    unreachable!("no kernel runs off x86-64 (`Kernel::runs`)")
}

/// The GEMM's math in scalar code, from the same panels and quantized rows: the reference
/// the SIMD kernel is tested against (integer sums exact; f32 accumulation per block).
pub fn reference(fmt: PanelFormat, data: &[u8], n: usize, k: usize, x: &[f32]) -> Vec<f32> {
    let m = x.len() / k;
    let rows = QuantizedRows::new(fmt, x, k);
    let (blocks, subs, z) = (rows.blocks, fmt.subs(), fmt.zero());
    let mut y = vec![0f32; m * n];
    let mut panel = Panel::default();
    for p in 0..n.div_ceil(NR) {
        panel.pack(fmt, data, n, k, p);
        for c in 0..NR.min(n - NR * p) {
            for r in 0..m {
                let mut acc = 0f32;
                for b in 0..blocks {
                    let xb = &rows.x[r * blocks + b];
                    for s in 0..subs {
                        let mut sum = 0i32;
                        for e in s * QK / subs..(s + 1) * QK / subs {
                            let q = panel.qs[b * QK * NR + (e / 4) * 4 * NR + 4 * c + e % 4];
                            sum += (q as i32 - z) * xb.qs[e] as i32;
                        }
                        acc += sum as f32 * (panel.scales[(b * subs + s) * NR + c] * xb.d);
                    }
                    if fmt.has_offset() {
                        acc += panel.offsets[b * NR + c] * rows.sx[r * blocks + b];
                    }
                }
                y[r * n + NR * p + c] = acc;
            }
        }
    }
    y
}

//! The decode step on weights interleaved eight rows at a time — Q4_0 ([`super::rows8`])
//! and Q4_K ([`super::rows8_k`]): the dispatch to the eight-row kernels
//! ([`super::avx2_rows8`], [`super::avx2_rows8_k`]; the portable loops elsewhere) and the
//! split of a call's groups over candle's CPU worker pool.
use super::blocks::{self, ActBlock, WeightFormat, QK};
use super::disjoint::Disjoint;
use super::kquants::{self, KQuant, Q8KRow, QK_K};
use super::{rows8, rows8_k};

/// The interleaved formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Interleaved {
    /// Q4_0, [`rows8`].
    Q4_0,
    /// Q4_K, [`rows8_k`].
    Q4K,
}

/// Output rows per work item: whole groups of eight.
const ROWS_PER_TASK: usize = 16;

/// Rows `first .. first + out.len()` (whole groups) of the interleaved weight `data` dotted
/// with `x` (`xsum` its [`rows8::block_sums`]) into `out`; each result bit for bit
/// [`blocks::dot_scalar`]'s on the row-major row. AVX2 where the CPU has it.
pub fn dot_rows8(data: &[u8], x: &[ActBlock], xsum: &[i32], first: usize, out: &mut [f32]) {
    let group_bytes = x.len() * rows8::GROUP_BLOCK_BYTES;
    assert!(
        first.is_multiple_of(rows8::ROWS)
            && out.len().is_multiple_of(rows8::ROWS)
            && xsum.len() == x.len()
            && data.len() >= (first + out.len()) / rows8::ROWS * group_bytes,
        "dot_rows8: rows {first}..+{} of {} bytes ({} blocks per row)",
        out.len(),
        data.len(),
        x.len()
    );
    let groups =
        &data[first / rows8::ROWS * group_bytes..(first + out.len()) / rows8::ROWS * group_bytes];
    #[cfg(target_arch = "x86_64")]
    if super::features::avx2() {
        // SAFETY: `features::avx2` checked AVX2, FMA and F16C; `groups` holds
        // `out.len() / ROWS` whole groups of `x.len()` blocks (asserted).
        return unsafe { super::avx2_rows8::dot_groups(groups, x, xsum, out) };
    }
    let k = x.len() * QK;
    for (r, o) in out.iter_mut().enumerate() {
        let mut row = Vec::with_capacity(x.len() * 18);
        rows8::plain_row(groups, k, r, &mut row);
        *o = blocks::dot_scalar(WeightFormat::Q4_0, &row, x);
    }
}

/// Rows `first .. first + out.len()` (whole groups) of the interleaved Q4_K weight `data`
/// dotted with `x` into `out`; each result bit for bit [`kquants::dot_scalar`]'s on the
/// row-major row. AVX2 where the CPU has it.
pub fn dot_rows8_k(data: &[u8], x: &Q8KRow, first: usize, out: &mut [f32]) {
    let group_bytes = x.blocks.len() / 8 * rows8_k::GROUP_SUPER_BYTES;
    assert!(
        x.blocks.len().is_multiple_of(8)
            && x.sums.len() == 2 * x.blocks.len()
            && first.is_multiple_of(rows8_k::ROWS)
            && out.len().is_multiple_of(rows8_k::ROWS)
            && data.len() >= (first + out.len()) / rows8_k::ROWS * group_bytes,
        "dot_rows8_k: rows {first}..+{} of {} bytes ({} blocks per row)",
        out.len(),
        data.len(),
        x.blocks.len()
    );
    let groups = &data
        [first / rows8_k::ROWS * group_bytes..(first + out.len()) / rows8_k::ROWS * group_bytes];
    #[cfg(target_arch = "x86_64")]
    if super::features::avx2() {
        let path = super::avx2_rows8::best_path();
        // SAFETY: `groups` holds `out.len() / 8` whole groups of `x`'s super-blocks
        // (asserted); `dot_groups_on` runs only a path this CPU has.
        unsafe { super::avx2_rows8_k::dot_groups_on(path, groups, x, out) };
        return;
    }
    let k = x.blocks.len() * QK;
    for (r, o) in out.iter_mut().enumerate() {
        let mut row = Vec::with_capacity(k / QK_K * rows8_k::SUPER_BYTES);
        rows8_k::plain_row(groups, k, r, &mut row);
        *o = kquants::dot_scalar(KQuant::Q4K, &row, x);
    }
}

/// A call's activation rows quantized for an interleaved format.
enum Acts {
    /// Q8_0 blocks and their sums, `k / 32` per row (Q4_0).
    Q8_0 {
        blocks: Vec<ActBlock>,
        sums: Vec<i32>,
        per_row: usize,
    },
    /// Q8_K rows (Q4_K).
    Q8K(Vec<Q8KRow>),
}

impl Acts {
    fn new(fmt: Interleaved, x: &[f32], k: usize) -> Self {
        match fmt {
            Interleaved::Q4_0 => {
                let per_row = k / QK;
                let mut acts = vec![ActBlock::ZERO; x.len() / k * per_row];
                for (row, out) in x.chunks_exact(k).zip(acts.chunks_exact_mut(per_row)) {
                    blocks::quantize_row(row, out);
                }
                let sums = rows8::block_sums(&acts);
                Self::Q8_0 {
                    blocks: acts,
                    sums,
                    per_row,
                }
            }
            Interleaved::Q4K => Self::Q8K(x.chunks_exact(k).map(Q8KRow::new).collect()),
        }
    }

    /// Row `i`'s products with rows `first ..` of `data` into `out`.
    fn dot(&self, i: usize, data: &[u8], first: usize, out: &mut [f32]) {
        match self {
            Self::Q8_0 {
                blocks,
                sums,
                per_row,
            } => {
                let at = i * per_row..(i + 1) * per_row;
                dot_rows8(data, &blocks[at.clone()], &sums[at], first, out)
            }
            Self::Q8K(rows) => dot_rows8_k(data, &rows[i], first, out),
        }
    }
}

/// `x·Wᵀ` `(m, n)` for the interleaved weight `data` `(n, k)` of `fmt`: each activation row
/// quantized once, then every task's groups of rows ([`ROWS_PER_TASK`], whole groups)
/// dotted with each row.
pub(crate) fn products(fmt: Interleaved, data: &[u8], n: usize, k: usize, x: &[f32]) -> Vec<f32> {
    let m = x.len() / k;
    let acts = Acts::new(fmt, x, k);
    // (m, n) row-major: each task owns its columns of every row.
    let mut y = vec![0f32; m * n];
    let out = Disjoint(y.as_mut_ptr());
    candle_core::utils::barrier_pool().execute_chunked(n.div_ceil(ROWS_PER_TASK), |tasks| {
        let rows = tasks.start * ROWS_PER_TASK..(tasks.end * ROWS_PER_TASK).min(n);
        for i in 0..m {
            // SAFETY: `execute_chunked` hands each range of rows to one worker, so columns
            // `rows` of output row i are written by this thread alone, and `y` outlives the
            // call, which returns when every worker is done.
            let mine = unsafe { out.slice(i * n + rows.start..i * n + rows.end) };
            acts.dot(i, data, rows.start, mine);
        }
    });
    y
}

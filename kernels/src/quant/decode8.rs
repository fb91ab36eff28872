//! The decode step on Q4_0 weights interleaved eight rows at a time ([`super::rows8`]):
//! the dispatch to the eight-row kernel ([`super::avx2_rows8`], the portable loop
//! elsewhere) and the split of a call's groups over candle's CPU worker pool.
use super::blocks::{self, ActBlock, WeightFormat, QK};
use super::disjoint::Disjoint;
use super::rows8;

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

/// `x·Wᵀ` `(m, n)` for the interleaved Q4_0 weight `data` `(n, k)`: each activation row
/// quantized once, then every task's groups of rows ([`ROWS_PER_TASK`], whole groups)
/// dotted with each row.
pub(crate) fn products(data: &[u8], n: usize, k: usize, x: &[f32]) -> Vec<f32> {
    let per_row = k / QK;
    let m = x.len() / k;
    let mut acts = vec![ActBlock::ZERO; m * per_row];
    for (row, out) in x.chunks_exact(k).zip(acts.chunks_exact_mut(per_row)) {
        blocks::quantize_row(row, out);
    }
    let sums = rows8::block_sums(&acts);
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
            let at = i * per_row..(i + 1) * per_row;
            dot_rows8(data, &acts[at.clone()], &sums[at], rows.start, mine);
        }
    });
    y
}

//! Q4_0 weights interleaved eight rows at a time, once at load, for the decode step's
//! matrix–vector product — llama.cpp's load-time "repack" of Q4_0 (`block_q4_0x8`,
//! `ggml-cpu/repack.cpp`) without its second copy: the interleaved bytes replace the
//! row-major ones (the same 18 bytes per 32 weights), and everything else that reads the
//! weight (the prefill GEMM's panels, the embedding lookup of a tied table) reassembles
//! row-major blocks from them ([`plain_block`]).
//!
//! Layout: rows in groups of [`ROWS`]; a group's blocks one after the other, each
//! [`GROUP_BLOCK_BYTES`] bytes: the eight rows' f16 scales (16 bytes), then four 32-byte
//! runs — run `h` holds, for rows 0…7, bytes `4h … 4h+3` of that row's 16 nibble bytes.
//! One run's low nibbles are elements `4h … 4h+3` of all eight rows, its high nibbles
//! elements `16+4h … 19+4h`: a 32-bit lane per row, so one `maddubs`/`vpdpbusd` against
//! four broadcast activation bytes sums four products for each of the eight rows, and the
//! eight scales convert in one instruction. A decode step reads each group as one stream.
//!
//! Results are bit for bit [`super::blocks::dot_scalar`]'s on the row-major block: per
//! row and block the exact integer sum `Σ (q − 8)·x` (the `− 8` folded in as `− 8·Σx`, an
//! integer), then `acc += d_w·d_x·sum` in f32 in block order, as the portable loop adds.
use super::blocks::{ActBlock, WeightFormat, QK};

/// Rows per interleaved group.
pub const ROWS: usize = 8;

/// Bytes of one block of one group: eight f16 scales and eight rows' 16 nibble bytes.
pub const GROUP_BLOCK_BYTES: usize = ROWS * 18;

/// Whether an `(n, k)` weight of `fmt` can be interleaved: Q4_0, whole groups of rows.
pub fn fits(fmt: WeightFormat, n: usize, k: usize) -> bool {
    fmt == WeightFormat::Q4_0 && n > 0 && n.is_multiple_of(ROWS) && k > 0 && k.is_multiple_of(QK)
}

/// The row-major Q4_0 weight `plain` `(n, k)` interleaved into a new buffer; `None` unless
/// [`fits`] and `plain` holds exactly `n` rows.
pub fn interleave(plain: &[u8], n: usize, k: usize) -> Option<Vec<u8>> {
    let mut out = plain.to_vec();
    interleave_in_place(&mut out, n, k).then_some(out)
}

/// Interleaves the row-major Q4_0 weight `bytes` `(n, k)` where it lies: a group of eight
/// rows occupies the same bytes in both layouts, so each group is copied aside (one
/// group's bytes of scratch) and written back interleaved. `false`, and `bytes` untouched,
/// unless [`fits`] and `bytes` holds exactly `n` rows.
pub fn interleave_in_place(bytes: &mut [u8], n: usize, k: usize) -> bool {
    let blocks = k / QK;
    if !fits(WeightFormat::Q4_0, n, k) || bytes.len() != n * blocks * 18 {
        return false;
    }
    let row_bytes = blocks * 18;
    let mut plain = vec![0u8; ROWS * row_bytes];
    for group in bytes.chunks_exact_mut(blocks * GROUP_BLOCK_BYTES) {
        plain.copy_from_slice(group);
        for (b, dst) in group.chunks_exact_mut(GROUP_BLOCK_BYTES).enumerate() {
            for r in 0..ROWS {
                let src = &plain[r * row_bytes + b * 18..][..18];
                dst[2 * r..2 * r + 2].copy_from_slice(&src[..2]);
                for h in 0..4 {
                    let at = 16 + 32 * h + 4 * r;
                    dst[at..at + 4].copy_from_slice(&src[2 + 4 * h..6 + 4 * h]);
                }
            }
        }
    }
    true
}

/// Block `b` of row `row` of an interleaved weight with `k` columns, as its row-major 18
/// bytes.
#[inline]
pub fn plain_block(data: &[u8], k: usize, row: usize, b: usize) -> [u8; 18] {
    let blocks = k / QK;
    let src = &data[((row / ROWS) * blocks + b) * GROUP_BLOCK_BYTES..][..GROUP_BLOCK_BYTES];
    let r = row % ROWS;
    let mut out = [0u8; 18];
    out[..2].copy_from_slice(&src[2 * r..2 * r + 2]);
    for h in 0..4 {
        let at = 16 + 32 * h + 4 * r;
        out[2 + 4 * h..6 + 4 * h].copy_from_slice(&src[at..at + 4]);
    }
    out
}

/// Row `row` of an interleaved weight with `k` columns, row-major, appended to `out`.
pub fn plain_row(data: &[u8], k: usize, row: usize, out: &mut Vec<u8>) {
    for b in 0..k / QK {
        out.extend_from_slice(&plain_block(data, k, row, b));
    }
}

/// The integer sums `Σq` of each activation block (the `− 8·Σx` term of every row).
pub fn block_sums(x: &[ActBlock]) -> Vec<i32> {
    x.iter()
        .map(|b| b.qs.iter().map(|&q| q as i32).sum())
        .collect()
}

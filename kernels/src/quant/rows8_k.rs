//! Q4_K weights interleaved eight rows at a time — [`super::rows8`]'s idea for the
//! K-quant most GGUFs are made of (llama.cpp's `block_q4_Kx8`), in the same bytes: a group's
//! 256-element super-block is [`GROUP_SUPER_BYTES`] = 8 × 144 bytes, laid out as the eight
//! rows' `d` (f16, 16 bytes), their `dmin` (16 bytes), their twelve packed scale bytes one
//! row after the other (96 bytes), then 32 runs of 32 bytes — run `c` holds, for rows 0…7,
//! bytes `4c … 4c+3` of that row's 128 nibble bytes. Run `c`'s low nibbles are elements
//! `4(c mod 8) … +3` of sub-block `2⌊c/8⌋`, its high nibbles the same elements of sub-block
//! `2⌊c/8⌋ + 1` (ggml's Q4_K packs sub-blocks `2i` and `2i+1` as the low and high nibbles of
//! bytes `32i … 32i+31`), so one `vpdpbusd` against four broadcast activation bytes adds
//! four products for each of the eight rows.
//!
//! Results are bit for bit [`super::kquants::dot_scalar`]'s: per row and super-block the
//! exact integer `Σ sc·Σ q·x` and `Σ m·Σ x`, then [`super::kquants::finish`]'s f32 steps.
use super::kquants::QK_K;

/// Rows per interleaved group.
pub const ROWS: usize = 8;

/// Bytes of one Q4_K super-block.
pub const SUPER_BYTES: usize = 144;

/// Bytes of one super-block of one group.
pub const GROUP_SUPER_BYTES: usize = ROWS * SUPER_BYTES;

/// Where the packed scale bytes start in a group super-block.
pub const SCALES_AT: usize = 32;

/// Where the 32 runs of nibble bytes start in a group super-block.
pub const RUNS_AT: usize = SCALES_AT + ROWS * 12;

/// Whether an `(n, k)` Q4_K weight can be interleaved: whole groups of rows.
pub fn fits(n: usize, k: usize) -> bool {
    n > 0 && n.is_multiple_of(ROWS) && k > 0 && k.is_multiple_of(QK_K)
}

/// The row-major (GGUF) position in row `r`'s super-block of each byte of the group
/// super-block, written as `(interleaved offset, row-major offset)` pairs to `f`.
#[inline(always)]
fn each_byte(r: usize, mut f: impl FnMut(usize, usize, usize)) {
    f(2 * r, 0, 2); // d
    f(16 + 2 * r, 2, 2); // dmin
    f(SCALES_AT + 12 * r, 4, 12); // the packed scales and mins
    for c in 0..32 {
        f(RUNS_AT + 32 * c + 4 * r, 16 + 4 * c, 4);
    }
}

/// Interleaves the row-major Q4_K weight `bytes` `(n, k)` where it lies (a group of eight
/// rows occupies the same bytes in both layouts; one group of scratch). `false`, and `bytes`
/// untouched, unless [`fits`] and `bytes` holds exactly `n` rows.
pub fn interleave_in_place(bytes: &mut [u8], n: usize, k: usize) -> bool {
    let supers = k / QK_K;
    if !fits(n, k) || bytes.len() != n * supers * SUPER_BYTES {
        return false;
    }
    let row_bytes = supers * SUPER_BYTES;
    let mut plain = vec![0u8; ROWS * row_bytes];
    for group in bytes.chunks_exact_mut(supers * GROUP_SUPER_BYTES) {
        plain.copy_from_slice(group);
        for (b, dst) in group.chunks_exact_mut(GROUP_SUPER_BYTES).enumerate() {
            for r in 0..ROWS {
                let src = &plain[r * row_bytes + b * SUPER_BYTES..][..SUPER_BYTES];
                each_byte(r, |to, from, len| {
                    dst[to..to + len].copy_from_slice(&src[from..from + len])
                });
            }
        }
    }
    true
}

/// Super-block `b` of row `row` of an interleaved Q4_K weight with `k` columns, as its
/// row-major 144 bytes.
#[inline]
pub fn plain_block(data: &[u8], k: usize, row: usize, b: usize) -> [u8; SUPER_BYTES] {
    let supers = k / QK_K;
    let src = &data[((row / ROWS) * supers + b) * GROUP_SUPER_BYTES..][..GROUP_SUPER_BYTES];
    let mut out = [0u8; SUPER_BYTES];
    each_byte(row % ROWS, |from, to, len| {
        out[to..to + len].copy_from_slice(&src[from..from + len])
    });
    out
}

/// Row `row` of an interleaved Q4_K weight with `k` columns, row-major, appended to `out`.
pub fn plain_row(data: &[u8], k: usize, row: usize, out: &mut Vec<u8>) {
    for b in 0..k / QK_K {
        out.extend_from_slice(&plain_block(data, k, row, b));
    }
}

//! The element types the CPU attention kernel reads, widened to f32: f32 itself (read in
//! place), f16/bf16 (a cache stored smaller, `kv_dtype`; read in place by the decode path,
//! widened per tile otherwise) and llama.cpp's `q8_0` blocks (32 values as an f16 scale
//! and 32 signed bytes, 34 bytes; widened per tile as candle's `dequantize` does,
//! `scale · q` — the values a cache stored as q8_0 holds, read without a widened copy of
//! the whole cache).
use super::small;

/// Element types read by the kernel, widened to f32.
pub(super) trait Elem: Copy + Send + Sync + 'static {
    /// Its lane kind for the decode path's in-place reads ([`small::F32`], `F16`, `BF16`);
    /// `None`: never read in place (widened into a tile first).
    const LANE: Option<u8>;
    /// Values one element holds: 1, or a q8_0 block's 32.
    const VALUES: usize = 1;
    /// Value `i` of the values `src` holds, in order.
    fn at(src: &[Self], i: usize) -> f32;
    /// The slice itself when it already holds f32 (read in place, no tile copy).
    fn as_f32(s: &[Self]) -> Option<&[f32]> {
        let _ = s;
        None
    }
    /// `src` widened into `dst` (`src.len() · VALUES` values).
    fn widen(src: &[Self], dst: &mut [f32]) {
        for (i, x) in dst.iter_mut().enumerate() {
            *x = Self::at(src, i);
        }
    }
}

impl Elem for f32 {
    const LANE: Option<u8> = Some(small::F32);
    fn at(src: &[Self], i: usize) -> f32 {
        src[i]
    }
    fn as_f32(s: &[Self]) -> Option<&[f32]> {
        Some(s)
    }
}

impl Elem for half::f16 {
    const LANE: Option<u8> = Some(small::F16);
    fn at(src: &[Self], i: usize) -> f32 {
        src[i].to_f32()
    }
    fn widen(src: &[Self], dst: &mut [f32]) {
        use half::slice::HalfFloatSliceExt;
        src.convert_to_f32_slice(dst);
    }
}

impl Elem for half::bf16 {
    const LANE: Option<u8> = Some(small::BF16);
    fn at(src: &[Self], i: usize) -> f32 {
        src[i].to_f32()
    }
    fn widen(src: &[Self], dst: &mut [f32]) {
        use half::slice::HalfFloatSliceExt;
        src.convert_to_f32_slice(dst);
    }
}

/// Values per q8_0 block.
pub const Q8_VALUES: usize = 32;
/// Bytes per q8_0 block: an f16 scale (little-endian) and 32 signed bytes.
pub const Q8_BYTES: usize = 34;

/// One q8_0 block as stored (byte-aligned, as a cache row of blocks lays them out).
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub(super) struct Q8Block {
    scale: [u8; 2],
    qs: [i8; Q8_VALUES],
}

const _: () = assert!(std::mem::size_of::<Q8Block>() == Q8_BYTES);
const _: () = assert!(std::mem::align_of::<Q8Block>() == 1);

impl Q8Block {
    /// The blocks `bytes` holds (its length a multiple of [`Q8_BYTES`]).
    pub(super) fn slice(bytes: &[u8]) -> &[Q8Block] {
        // SAFETY: `Q8Block` is 34 bytes of alignment 1 with no padding, and every bit
        // pattern is a valid value of its fields; the length is whole blocks.
        unsafe {
            std::slice::from_raw_parts(bytes.as_ptr() as *const Q8Block, bytes.len() / Q8_BYTES)
        }
    }

    fn scale(&self) -> f32 {
        half::f16::from_le_bytes(self.scale).to_f32()
    }
}

impl Elem for Q8Block {
    const LANE: Option<u8> = None;
    const VALUES: usize = Q8_VALUES;
    fn at(src: &[Self], i: usize) -> f32 {
        let b = &src[i / Q8_VALUES];
        b.scale() * b.qs[i % Q8_VALUES] as f32
    }
    fn widen(src: &[Self], dst: &mut [f32]) {
        for (b, out) in src.iter().zip(dst.chunks_exact_mut(Q8_VALUES)) {
            let d = b.scale();
            for (x, &q) in out.iter_mut().zip(&b.qs) {
                *x = d * q as f32;
            }
        }
    }
}

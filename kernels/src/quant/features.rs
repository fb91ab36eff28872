//! The CPU features the quantized kernels dispatch on, detected once at run time: its own
//! module so that the block code ([`super::blocks`]) and the AVX2 kernels ([`super::avx2`],
//! which reads blocks) can both ask without importing each other.

/// Whether this CPU has AVX2, FMA and F16C (checked once).
pub fn avx2() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| {
        is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
    })
}

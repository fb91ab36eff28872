//! Config numbers checked in the type they are used in: JSON numbers arrive as f64 but
//! RoPE bases, scaling factors, soft-caps, query scales and norm epsilons are used as f32,
//! where a value that passes an f64 check can still become 0 or infinity (`rope_theta`
//! 1e39, a factor of 1e-46) and give NaN or constant logits.
use crate::error::{ModelError, Result};

/// `v` as f32 when it is a normal number above 0 there, with a finite reciprocal (it
/// divides or scales), else an error naming `field`.
pub fn positive_f32(v: f64, field: &str) -> Result<f32> {
    let f = v as f32;
    // Normal (not 0, not subnormal) with a finite reciprocal: it is divided by, too.
    if v.is_finite() && v > 0.0 && f.is_normal() && (1.0 / f).is_finite() {
        Ok(f)
    } else {
        Err(ModelError::config(
            field,
            format!("{v} must be a number above 0 that is finite as a 32-bit float (at most ~3.4e38, at least ~1.2e-38)"),
        ))
    }
}

/// `v` as f32 when it is finite and at least 0 there, else an error naming `field`.
pub fn non_negative_f32(v: f64, field: &str) -> Result<f32> {
    let f = v as f32;
    if v.is_finite() && v >= 0.0 && f.is_finite() {
        Ok(f)
    } else {
        Err(ModelError::config(
            field,
            format!("{v} must be a number ≥ 0 that is finite as a 32-bit float (at most ~3.4e38)"),
        ))
    }
}

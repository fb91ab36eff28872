//! The cost profile the schedulers plan with (KVPR §3.3, HybridServe §4.3): host→device
//! bandwidth for the transfer sizes in play and the rate at which one layer regenerates K/V
//! from stored activations.
//!
//! A [`Profile`] is either measured on the actual device at the first step (by the toolkit,
//! `kvpolicy-tiered`'s `probe`, cached per device and layer shape for the life of the
//! process) or
//! read from a JSON file (the `profile` option), so that schedules are reproducible and
//! testable:
//!
//! ```json
//! {"h2d_bytes_per_s": 2.5e10, "recompute_tokens_per_s": 1.0e6}
//! ```
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{KvError, Result};

/// Measured (or given) rates of one device for one layer shape.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    /// Host→device bandwidth in bytes per second.
    pub h2d_bytes_per_s: f64,
    /// Tokens (per sequence) whose K and V one layer regenerates per second.
    pub recompute_tokens_per_s: f64,
    /// What it was measured on (informational).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    /// The layer shape it was measured for (informational).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shape: Option<String>,
}

fn bad(origin: &str, reason: impl Into<String>) -> KvError {
    KvError::BadProfile {
        origin: origin.to_string(),
        reason: reason.into(),
    }
}
impl Profile {
    /// Checks that both rates are positive and finite; `origin` names the source in errors.
    pub fn validate(&self, origin: &str) -> Result<()> {
        for (name, v) in [
            ("h2d_bytes_per_s", self.h2d_bytes_per_s),
            ("recompute_tokens_per_s", self.recompute_tokens_per_s),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(bad(
                    origin,
                    format!("`{name}` is {v}; it must be a positive number"),
                ));
            }
        }
        Ok(())
    }

    /// Parses and validates a JSON profile.
    pub fn from_json(text: &str, origin: &str) -> Result<Self> {
        let p: Profile = serde_json::from_str(text).map_err(|e| bad(origin, e.to_string()))?;
        p.validate(origin)?;
        Ok(p)
    }

    /// Reads and validates a JSON profile file.
    pub fn load(path: &Path) -> Result<Self> {
        let origin = path.display().to_string();
        // A profile is a few numbers: 1 MiB is far more than one holds.
        let text = crate::userfile::read_text_capped(path, "the profile", 1 << 20)
            .map_err(|e| bad(&origin, e.to_string()))?;
        Self::from_json(&text, &origin)
    }

    /// The profile as pretty JSON (what [`Profile::load`] reads).
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default()
    }

    /// Seconds to move `bytes` host→device.
    pub fn transfer_s(&self, bytes: f64) -> f64 {
        bytes / self.h2d_bytes_per_s
    }

    /// Seconds one layer needs to regenerate K/V of `tokens` tokens.
    pub fn recompute_s(&self, tokens: f64) -> f64 {
        tokens / self.recompute_tokens_per_s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_rejects() {
        let p = Profile::from_json(
            r#"{"h2d_bytes_per_s": 1e9, "recompute_tokens_per_s": 5e4}"#,
            "t",
        );
        assert!(matches!(p, Ok(ref p) if p.h2d_bytes_per_s == 1e9));
        for (text, needle) in [
            (
                r#"{"h2d_bytes_per_s": 0, "recompute_tokens_per_s": 5}"#,
                "h2d_bytes_per_s",
            ),
            (
                r#"{"h2d_bytes_per_s": 1, "recompute_tokens_per_s": -5}"#,
                "recompute_tokens_per_s",
            ),
            (r#"{"h2d_bytes_per_s": 1}"#, "missing field"),
            (r#"{"h2d_bytes_per_s": 1, "recompute": 2}"#, "unknown field"),
            ("not json", "expected"),
        ] {
            let e = Profile::from_json(text, "f.json")
                .err()
                .map(|e| e.to_string());
            let e = e.unwrap_or_default();
            assert!(e.contains(needle) && e.contains("f.json"), "{text}: {e}");
        }
    }
}

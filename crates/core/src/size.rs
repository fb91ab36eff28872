//! Byte sizes as people write them (`64MiB`, `1.5GB`, `4096`) and as reports print them.
use crate::error::{KvError, Result};

/// Parses a byte size: a number followed by an optional unit among B, KB, MB, GB, TB
/// (powers of 1000) and KiB, MiB, GiB, TiB (powers of 1024); case-insensitive, spaces allowed.
pub fn parse_bytes(input: &str) -> Result<u64> {
    let s = input.trim();
    let bad = |reason: &str| KvError::BadSize {
        input: input.to_string(),
        reason: reason.to_string(),
    };
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    if num.is_empty() {
        return Err(bad("it does not start with a number"));
    }
    let value: f64 = num.parse().map_err(|_| bad("the number is malformed"))?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "m" | "mb" => 1e6,
        "g" | "gb" => 1e9,
        "t" | "tb" => 1e12,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        "tib" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        _ => {
            return Err(bad(
                "the unit is not one of B, KB, MB, GB, TB, KiB, MiB, GiB, TiB",
            ))
        }
    };
    let bytes = value * mult;
    if !bytes.is_finite() || bytes < 1.0 || bytes > u64::MAX as f64 {
        return Err(bad("the size must be at least one byte"));
    }
    Ok(bytes.round() as u64)
}

/// Formats a byte count with a binary unit, e.g. `1.50 MiB`.
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units() -> Result<()> {
        assert_eq!(parse_bytes("64MiB")?, 64 * 1024 * 1024);
        assert_eq!(parse_bytes("2 GB")?, 2_000_000_000);
        assert_eq!(parse_bytes("1.5kib")?, 1536);
        assert_eq!(parse_bytes("4096")?, 4096);
        Ok(())
    }

    #[test]
    fn rejects_garbage() {
        for bad in ["", "MiB", "12 parsecs", "0", "-5MB", "1.2.3GB"] {
            let err = parse_bytes(bad).err().map(|e| e.to_string());
            assert!(
                err.as_deref()
                    .is_some_and(|e| e.contains("cannot parse the size")),
                "{bad:?} gave {err:?}"
            );
        }
    }

    #[test]
    fn formats() {
        assert_eq!(format_bytes(12), "12 B");
        assert_eq!(format_bytes(3 * 1024 * 1024 / 2), "1.50 MiB");
    }
}

//! Byte sizes as people write them (`64MiB`, `1.5GB`, `4096`) and as reports print them.

/// A size string such as `64MiB` that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cannot parse the size `{input}`: {reason}; write a number with an optional unit, e.g. 512MiB, 2GB or 1048576")]
pub struct SizeError {
    /// The text given.
    pub input: String,
    /// Why it is rejected.
    pub reason: String,
}

type Result<T> = std::result::Result<T, SizeError>;

/// Parses a byte size: a number followed by an optional unit among B, KB, MB, GB, TB
/// (powers of 1000) and KiB, MiB, GiB, TiB (powers of 1024); case-insensitive, spaces allowed.
pub fn parse_bytes(input: &str) -> Result<u64> {
    let s = input.trim();
    let bad = |reason: &str| SizeError {
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
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" => 1_000,
        "m" | "mb" => 1_000_000,
        "g" | "gb" => 1_000_000_000,
        "t" | "tb" => 1_000_000_000_000,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        "tib" => 1 << 40,
        _ => {
            return Err(bad(
                "the unit is not one of B, KB, MB, GB, TB, KiB, MiB, GiB, TiB",
            ))
        }
    };
    let too_large = || bad("the size does not fit in 64 bits (at most 16 EiB)");
    let bytes = if num.contains('.') {
        let value: f64 = num.parse().map_err(|_| bad("the number is malformed"))?;
        let bytes = (value * mult as f64).round();
        // 2^64 is the first value a u64 cannot hold.
        if !bytes.is_finite() || bytes >= 18_446_744_073_709_551_616.0 {
            return Err(too_large());
        }
        bytes as u64
    } else {
        // Whole numbers exactly (an f64 would round above 2^53).
        let value: u64 = num.parse().map_err(|_| too_large())?;
        value.checked_mul(mult).ok_or_else(too_large)?
    };
    if bytes < 1 {
        return Err(bad("the size must be at least one byte"));
    }
    Ok(bytes)
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
    fn sizes_past_64_bits_are_errors_not_saturated() -> Result<()> {
        assert_eq!(parse_bytes("18446744073709551615")?, u64::MAX);
        for big in ["18446744073709551616", "1000000000000TiB", "16777216TiB"] {
            let err = parse_bytes(big).err().map(|e| e.to_string());
            assert!(
                err.as_deref().is_some_and(|e| e.contains("64 bits")),
                "{big:?} gave {err:?}"
            );
        }
        assert!(parse_bytes("16777215.99TiB").is_ok());
        Ok(())
    }

    #[test]
    fn formats() {
        assert_eq!(format_bytes(12), "12 B");
        assert_eq!(format_bytes(3 * 1024 * 1024 / 2), "1.50 MiB");
    }
}

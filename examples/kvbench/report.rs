//! The sweep's outputs: a markdown table (÷ `full` at the same context; the peers'
//! rows — candle's stock model, llama.cpp — carry no KV tiers), a CSV file.
use std::path::Path;

use anyhow::Result;
use kvpolicy::core::format_bytes;

use crate::sweep::Row;
use kvpolicy_cli::atomic::write_atomic;

/// `full`'s row at `context`, the anchor of the ratios.
fn anchor(rows: &[Row], context: usize) -> Option<&Row> {
    rows.iter()
        .find(|r| r.context == context && r.policy == "full")
}

/// Rows of a peer implementation (candle's stock model, llama.cpp): no KV tiers to report.
fn peer(r: &Row) -> bool {
    r.policy == "stock" || r.policy == "llama.cpp"
}

fn ratio(a: f64, b: Option<f64>) -> String {
    match b {
        Some(b) if b > 0.0 => format!("{:.2}", a / b),
        _ => "-".into(),
    }
}

/// The table: one row per context and variant; `bandwidth` adds the PCIe bound column.
pub fn markdown(rows: &[Row], bandwidth: Option<f64>) -> String {
    let mut s = String::from(
        "| context | policy | prefill tok/s | ÷ full | decode tok/s | ÷ full | device KV peak | ÷ full | host KV | h2d bytes/token | policy metrics |",
    );
    let mut rule = String::from("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|");
    if bandwidth.is_some() {
        s.push_str(
            " PCIe bound s/token | s/token | bound ÷ s/token | copy s/token | link busy ÷ decode |",
        );
        rule.push_str("---:|---:|---:|---:|---:|");
    }
    s.push('\n');
    s.push_str(&rule);
    s.push('\n');
    for r in rows {
        let a = anchor(rows, r.context);
        let is_peer = peer(r);
        let dev = if is_peer {
            "-".to_string()
        } else {
            format_bytes(r.device_kv_peak_bytes)
        };
        let dev_ratio = if is_peer {
            "-".to_string()
        } else {
            ratio(
                r.device_kv_peak_bytes as f64,
                a.map(|a| a.device_kv_peak_bytes as f64),
            )
        };
        s.push_str(&format!(
            "| {} | {} | {:.1} | {} | {:.2} | {} | {} | {} | {} | {} | {} |",
            r.context,
            if r.lossy {
                format!("{} (LOSSY)", r.policy)
            } else {
                r.policy.clone()
            },
            r.prefill_tok_s,
            ratio(r.prefill_tok_s, a.map(|a| a.prefill_tok_s)),
            r.decode_tok_s,
            ratio(r.decode_tok_s, a.map(|a| a.decode_tok_s)),
            dev,
            dev_ratio,
            if is_peer {
                "-".into()
            } else {
                format_bytes(r.host_kv_bytes)
            },
            if is_peer {
                "-".into()
            } else {
                r.h2d_bytes_per_token.to_string()
            },
            if is_peer || r.metrics.is_empty() {
                "-".into()
            } else {
                r.metrics
                    .iter()
                    .map(|m| format!("{} {} {}", m.name, m.value, m.unit))
                    .collect::<Vec<_>>()
                    .join(", ")
            },
        ));
        if let Some(b) = bandwidth {
            let step = 1.0 / r.decode_tok_s;
            let (bound, of_bound) = if r.h2d_bytes_per_token > 0 {
                let bound = r.h2d_bytes_per_token as f64 / b;
                (format!("{bound:.4}"), format!("{:.2}", bound / step))
            } else {
                ("-".into(), "-".into())
            };
            s.push_str(&format!(
                " {bound} | {step:.4} | {of_bound} | {:.4} | {:.2} |",
                r.copy_s_per_token, r.link_utilization
            ));
        }
        s.push('\n');
    }
    s
}

/// Writes every row as CSV (through a temporary file, so a failure leaves nothing behind).
pub fn write_csv(rows: &[Row], path: &Path) -> Result<()> {
    // The policies' own metrics, one column each, in the order they first appear.
    let mut metrics: Vec<&str> = Vec::new();
    for m in rows.iter().flat_map(|r| &r.metrics) {
        if !metrics.contains(&m.name) {
            metrics.push(m.name);
        }
    }
    let mut out = String::from(
        "context,policy,prefill_tok_s,decode_tok_s,decode_vs_full,device_kv_peak_bytes,device_vs_full,host_kv_bytes,h2d_bytes_per_token,d2h_bytes_per_token,link_utilization,lossy",
    );
    for m in &metrics {
        out.push(',');
        out.push_str(m);
    }
    out.push('\n');
    for r in rows {
        let a = anchor(rows, r.context);
        let opt = |x: Option<f64>| x.map(|v| format!("{v:.6}")).unwrap_or_default();
        out.push_str(&format!(
            "{},{},{:.3},{:.3},{},{},{},{},{},{},{:.4},{}",
            r.context,
            csv_field(&r.policy),
            r.prefill_tok_s,
            r.decode_tok_s,
            opt(a.map(|a| r.decode_tok_s / a.decode_tok_s)),
            r.device_kv_peak_bytes,
            opt(a
                .filter(|a| a.device_kv_peak_bytes > 0 && !peer(r))
                .map(|a| r.device_kv_peak_bytes as f64 / a.device_kv_peak_bytes as f64)),
            r.host_kv_bytes,
            r.h2d_bytes_per_token,
            r.d2h_bytes_per_token,
            r.link_utilization,
            r.lossy,
        ));
        for name in &metrics {
            out.push(',');
            if let Some(m) = r.metrics.iter().find(|m| m.name == *name) {
                out.push_str(&m.value.to_string());
            }
        }
        out.push('\n');
    }
    write_atomic(path, |w| Ok(w.write_all(out.as_bytes())?))
}

/// `s` as one CSV field: quoted when it holds a comma or a quote (a spec with settings).
fn csv_field(s: &str) -> String {
    if s.contains([',', '"']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

/// One line per row that used the disk tier: its files, the bytes read per decoded token,
/// the read rate during decode and the time the compute thread waited on the disk.
pub fn disk_lines(rows: &[Row]) -> String {
    let mut s = String::new();
    for r in rows.iter().filter(|r| r.disk_kv_bytes > 0) {
        let step = 1.0 / r.decode_tok_s;
        s.push_str(&format!(
            "disk tier: {} at {}: {} on disk ({} reads); {} read per decoded token = {:.1} MB/s during decode; disk wait {:.4} s/token of {:.4}\n",
            r.policy,
            r.context,
            format_bytes(r.disk_kv_bytes),
            if r.disk_direct_io { "direct" } else { "buffered" },
            format_bytes(r.disk_read_bytes_per_token),
            r.disk_read_bytes_per_token as f64 / step / 1e6,
            r.disk_wait_s_per_token,
            step
        ));
    }
    s
}

//! Memory read bandwidth, the denominator of a decode step's roofline: a decode step at
//! batch 1 streams every weight once, so `weight bytes per token ÷ this` is the fastest
//! step the machine allows (the "memory roofline" of `scripts/scale_bench.py`'s table).
//!
//! ```sh
//! cargo run --release --example membw -- [--mib 2048] [--threads 2]
//! ```
//!
//! `--threads` threads each sum a disjoint slice of one buffer far larger than the
//! last-level cache (u64 adds in four independent lanes, vectorized by the compiler: the
//! loads, not the adds, bound it); the best of `--passes` is printed as one JSON object
//! `{"read_gb_s": …, "threads": …, "mib": …}` — a decode step also reads warm, not cold.
use anyhow::Result;
use clap::Parser;

/// Flags.
#[derive(Parser)]
#[command(about = "Memory read bandwidth (GB/s) with N threads: the decode roofline's denominator")]
struct Args {
    /// Buffer size in MiB (far past the last-level cache).
    #[arg(long, default_value_t = 2048)]
    mib: usize,
    /// Reading threads (default: the cores, as kvpolicy's own default).
    #[arg(long)]
    threads: Option<usize>,
    /// Timed passes over the buffer (the best is printed).
    #[arg(long, default_value_t = 7)]
    passes: usize,
}

/// Sums `v` in four lanes.
fn sum(v: &[u64]) -> u64 {
    let mut acc = [0u64; 4];
    for c in v.chunks_exact(4) {
        for (a, x) in acc.iter_mut().zip(c) {
            *a = a.wrapping_add(*x);
        }
    }
    acc.iter().fold(0, |s, a| s.wrapping_add(*a))
}

fn main() -> Result<()> {
    let args = Args::parse();
    anyhow::ensure!(
        args.mib >= 64,
        "--mib must be at least 64 (a smaller buffer is read from the caches, not memory)"
    );
    anyhow::ensure!(args.passes >= 1, "--passes must be at least 1");
    let threads = args
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .max(1);
    let n = args.mib * 1024 * 1024 / 8;
    // Written first, so every page is mapped before the timed passes.
    let buf: Vec<u64> = (0..n as u64).collect();
    let part = n.div_ceil(threads).div_ceil(4) * 4;
    let mut best = 0f64;
    for _ in 0..args.passes {
        let t = std::time::Instant::now();
        let total = std::thread::scope(|s| {
            let handles: Vec<_> = buf.chunks(part).map(|c| s.spawn(move || sum(c))).collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or(0))
                .fold(0u64, u64::wrapping_add)
        });
        std::hint::black_box(total);
        best = best.max((n * 8) as f64 / t.elapsed().as_secs_f64());
    }
    println!(
        "{{\"read_gb_s\": {:.3}, \"threads\": {threads}, \"mib\": {}}}",
        best / 1e9,
        args.mib
    );
    Ok(())
}

//! The CPU thread count, settled once at start-up. Without `RAYON_NUM_THREADS` candle
//! 0.11 works it out again on every f32 matmul (`utils::get_num_threads` reads the CPU
//! affinity and `/proc/cpuinfo`: ~1,200 file opens in a 20-token run); setting the variable
//! once to the same value (the physical cores) makes that a lookup; candle's worker pool,
//! which our quantized kernels and attention run on, and rayon's size themselves from it.

/// Sets `RAYON_NUM_THREADS` to candle's default count unless the user set it. Call first
/// thing in `main`, before any thread is started.
pub fn settle() {
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        let n = candle_core::utils::get_num_threads();
        // Single-threaded here: `main` calls this before any other thread exists.
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    }
}

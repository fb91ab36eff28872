//! The PTX of `cuda/*.cu`, built by `build.rs` (feature `cuda`): one constant per kernel
//! file, used by `cuda` (`heads_into.cu`) and `gather` (`gather_pages.cu`).
include!(concat!(env!("OUT_DIR"), "/ptx.rs"));

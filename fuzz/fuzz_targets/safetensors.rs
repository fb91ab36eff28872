//! A safetensors file from arbitrary bytes (see `kvpolicy_fuzz::safetensors`).
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kvpolicy_fuzz::safetensors(data);
});

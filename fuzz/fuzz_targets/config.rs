//! config.json from arbitrary bytes (see `kvpolicy_fuzz::config`).
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kvpolicy_fuzz::config(data);
});

//! Policy operation sequences from arbitrary bytes (see `kvpolicy_fuzz::policy_ops`).
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kvpolicy_fuzz::policy_ops(data);
});

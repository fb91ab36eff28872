//! One client connection's bytes against the server's router (kvpolicy_server::fuzzing).
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| kvpolicy_server::fuzzing::http(data));

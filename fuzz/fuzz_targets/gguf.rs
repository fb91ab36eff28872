//! A GGUF file from arbitrary bytes (see `kvpolicy_fuzz::gguf`).
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // `GgufFile::open` catches the panics of candle's header reader (e.g. alignment 0) and
    // returns an error. libfuzzer-sys's panic hook would abort on those caught panics too,
    // so it is replaced by a silent one; a panic that escapes still aborts the run.
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| std::panic::set_hook(Box::new(|_| {})));
    kvpolicy_fuzz::gguf(data);
});

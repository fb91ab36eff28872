//! Generate with a OPT (125M, 1.3B … 66B) model under any KV policy; the same flags as `llama`.
//!
//! `cargo run --release --example opt -- --model-dir path/to/opt-125m --policy recompute --prompt "…"`
fn main() -> std::process::ExitCode {
    kvpolicy_cli::main("opt", &["opt"], None, kvpolicy_custom_policy::registry())
}

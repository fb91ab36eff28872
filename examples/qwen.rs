//! Generate with a Qwen2 model under any KV policy; the same flags as `llama`.
//!
//! `cargo run --release --example qwen -- --model-dir path/to/Qwen2-0.5B --policy headwise --prompt "…"`
fn main() -> std::process::ExitCode {
    kvpolicy_cli::main("qwen", &["qwen2"], None, kvpolicy_custom_policy::registry())
}

//! Generate with a Mistral (sliding-window attention) model under any KV policy; the same flags as `llama`.
//!
//! `cargo run --release --example mistral -- --model-dir path/to/Mistral-7B-v0.1 --policy headwise --prompt "…"`
fn main() -> std::process::ExitCode {
    kvpolicy_cli::main(
        "mistral",
        &["mistral"],
        None,
        kvpolicy_custom_policy::registry(),
    )
}

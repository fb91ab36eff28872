//! Generate with a Llama-family model (Llama 2/3, SmolLM2) under any KV policy.
//!
//! `cargo run --release --example llama -- --prompt "The capital of France is" --temperature 0`
fn main() -> std::process::ExitCode {
    kvpolicy_cli::main(
        "llama",
        &["llama"],
        Some(kvpolicy::models::ModelSpec::Default),
        kvpolicy_custom_policy::registry(),
    )
}

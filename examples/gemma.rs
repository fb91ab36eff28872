//! Generate with a Gemma, Gemma 2 or Gemma 3 model under any KV policy; the same flags as `llama`.
//!
//! `cargo run --release --example gemma -- --model-dir path/to/gemma-2-2b --policy headwise --prompt "…"`
fn main() -> std::process::ExitCode {
    kvpolicy_cli::main(
        "gemma",
        &["gemma", "gemma2", "gemma3"],
        Some(kvpolicy::models::ModelSpec::Pypi(
            &kvpolicy::models::load::pypi::GEMMA3_270M,
        )),
        kvpolicy_custom_policy::registry(),
    )
}

//! The official `openai` Python client (PyPI `openai`, installed by `.ci/run`) completes,
//! chats and streams against the server, and reads its errors
//! (`tests/openai_client.py`), with an API key required.
mod common;

use std::process::Command;

use anyhow::{ensure, Result};

#[test]
fn the_openai_client_completes_chats_and_streams() -> Result<()> {
    let server = common::Server::start(&["--api-key", "k-test", "--ctx-size", "2048"])?;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/openai_client.py");
    let out = Command::new("python3")
        .args([script, &server.url("/v1"), "k-test"])
        .output()?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    ensure!(out.status.success(), "{text}");
    ensure!(text.contains("openai client: ok"), "{text}");
    Ok(())
}

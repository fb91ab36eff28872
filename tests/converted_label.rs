//! A model whose config.json declares a lossy conversion (`kvpolicy_conversion`, as
//! `kvpolicy-compress` writes it) is labeled LOSSY by the runner: in its summary and in
//! `--stats-out` (`"lossy": true` whatever the policy, and `"model_conversion"`); an
//! identity conversion (`"lossy": false`) and an unconverted model are not.
mod common;

use anyhow::{ensure, Result};

fn run_with_label(label: Option<serde_json::Value>) -> Result<(String, serde_json::Value)> {
    let dir = common::copy_fixture("llama_gqa")?;
    let cfg_path = dir.path().join("config.json");
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&cfg_path)?)?;
    if let (Some(l), Some(o)) = (label, cfg.as_object_mut()) {
        o.insert("kvpolicy_conversion".into(), l);
    }
    std::fs::write(&cfg_path, serde_json::to_string(&cfg)?)?;
    let stats = dir.path().join("stats.json");
    let (d, s) = (dir.path().to_string_lossy(), stats.to_string_lossy());
    let o = common::cli::llama(&[
        "--model-dir",
        &d,
        "--prompt-ids",
        "1,2,3",
        "--max-new-tokens",
        "2",
        "--stats-out",
        &s,
    ])?;
    ensure!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let json = serde_json::from_str(&std::fs::read_to_string(&stats)?)?;
    Ok((String::from_utf8_lossy(&o.stderr).into_owned(), json))
}

#[test]
fn a_converted_model_is_labeled_lossy_in_the_summary_and_stats() -> Result<()> {
    let lossy =
        serde_json::json!({"lossy": true, "method": "svd", "kv_heads": {"from": 2, "to": 1}});
    let (err, st) = run_with_label(Some(lossy))?;
    ensure!(
        err.contains("LOSSY model: converted by kvpolicy-compress: KV heads 2→1 by svd"),
        "summary: {err}"
    );
    ensure!(st["lossy"] == true, "stats: {st}");
    ensure!(
        st["model_conversion"] == "converted by kvpolicy-compress: KV heads 2→1 by svd",
        "stats: {st}"
    );
    for label in [
        Some(serde_json::json!({"lossy": false, "kv_heads": {"from": 2, "to": 2}})),
        None,
    ] {
        let (err, st) = run_with_label(label)?;
        ensure!(!err.contains("LOSSY"), "summary: {err}");
        ensure!(
            st["lossy"] == false && st.get("model_conversion").is_none(),
            "stats: {st}"
        );
    }
    Ok(())
}

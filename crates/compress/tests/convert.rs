//! `kvpolicy-compress` end to end on the HF fixtures: the identity settings copy the model
//! exactly (from safetensors and from GGUF), SVD is exact where the merged heads are
//! complex multiples of each other (and mean pooling is not), a converted model runs under
//! every lossless policy with KV bytes scaled by the head ratio, and bad input fails
//! before any work, leaving nothing behind.
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{ensure, Context, Result};
use candle_core::{DType, Device, Tensor};
use kvpolicy::{KvStats, LogitsMode, PolicyOptions};
use rand::{Rng, SeedableRng};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

fn compress(args: &[&str]) -> Result<std::process::Output> {
    Ok(Command::new(env!("CARGO_BIN_EXE_kvpolicy-compress"))
        .args(args)
        .output()?)
}

fn convert(input: &[&str], out: &Path, extra: &[&str]) -> Result<()> {
    let mut args: Vec<&str> = input.to_vec();
    let out_s = out.to_str().context("utf-8 path")?;
    args.extend(["--out", out_s]);
    args.extend(extra);
    let o = compress(&args)?;
    ensure!(
        o.status.success(),
        "kvpolicy-compress {args:?} failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    Ok(())
}

fn ids(dir: &Path) -> Result<Vec<u32>> {
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("ids.json"))?)?;
    let mut out = Vec::new();
    for key in ["prompt_ids", "decode_ids"] {
        for i in v[key].as_array().context("ids")? {
            out.push(i.as_u64().context("id")? as u32);
        }
    }
    Ok(out)
}

/// Teacher-forced logits `[tokens, vocab]` of the model at `dir` (a directory, or a GGUF
/// file) under `policy`, prefilled in chunks of 5 tokens, and the policy's final stats.
fn logits(dir: &Path, ids: &[u32], policy: &str) -> Result<(Vec<Vec<f32>>, KvStats)> {
    let files = if dir.is_dir() {
        kvpolicy::models::load::source::dir_files(dir)?
    } else {
        kvpolicy::models::ModelFiles::Gguf(dir.to_path_buf())
    };
    let loaded = kvpolicy::models::load(&files, &Device::Cpu, DType::F32, None)?;
    let mut p = kvpolicy::registry().build(policy, &PolicyOptions::default())?;
    // The shape tells the policy which layers read another's cache (MLKV).
    let shape = kvpolicy::models::engine::generate::kv_shape(loaded.model.info(), 1, ids.len(), 5);
    p.prepare(&shape)?;
    let mut rows = Vec::new();
    for (i, chunk) in ids.chunks(5).enumerate() {
        let t = Tensor::new(chunk, &Device::Cpu)?.unsqueeze(0)?;
        let l = loaded
            .model
            .forward(&t, i * 5, p.as_mut(), LogitsMode::All)?;
        rows.extend(l.squeeze(0)?.to_vec2::<f32>()?);
    }
    Ok((rows, p.stats()))
}

fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| x.iter().zip(y).map(|(p, q)| (p - q).abs()))
        .fold(0.0, f32::max)
}

fn tensors(dir: &Path) -> Result<std::collections::HashMap<String, Tensor>> {
    Ok(candle_core::safetensors::load(
        dir.join("model.safetensors"),
        &Device::Cpu,
    )?)
}

fn config(dir: &Path) -> Result<serde_json::Value> {
    Ok(serde_json::from_str(&std::fs::read_to_string(
        dir.join("config.json"),
    )?)?)
}

#[test]
fn identity_copies_the_weights_and_the_logits_exactly() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    for name in ["llama_gqa", "mistral", "qwen2"] {
        let src = fixture(name);
        let out = tmp.path().join(name);
        let kv = config(&src)?["num_key_value_heads"].to_string();
        let layers = config(&src)?["num_hidden_layers"].to_string();
        convert(
            &["--model-dir", src.to_str().context("path")?],
            &out,
            &["--kv-heads", &kv, "--kv-layers", &layers],
        )?;
        let (a, b) = (tensors(&src)?, tensors(&out)?);
        ensure!(a.len() == b.len(), "{name}: tensor count changed");
        for (k, t) in &a {
            let u = b.get(k).context(k.clone())?;
            ensure!(
                t.flatten_all()?.to_vec1::<f32>()? == u.flatten_all()?.to_vec1::<f32>()?,
                "{name}: {k} changed"
            );
        }
        let label = &config(&out)?["kvpolicy_conversion"];
        ensure!(
            label["lossy"] == false,
            "{name}: identity labeled lossy: {label}"
        );
        let ids = ids(&src)?;
        ensure!(
            logits(&src, &ids, "full")?.0 == logits(&out, &ids, "full")?.0,
            "{name}: logits changed"
        );
    }
    Ok(())
}

/// llama.cpp's GGUF of each fixture, dequantized and renamed, is the HF fixture again:
/// every tensor equal (q/k rows back in HF's order), and the output computes the GGUF's
/// logits (a Mistral GGUF is architecture `llama`, without the sliding window: as read by
/// llama.cpp and the examples, so the comparison is with the GGUF, not the HF model).
#[test]
fn gguf_input_is_rebuilt_as_the_hf_checkpoint() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    for name in ["llama_gqa", "mistral", "qwen2"] {
        let gguf = fixture("gguf").join(format!("{name}.gguf"));
        let out = tmp.path().join(name);
        let kv = config(&fixture(name))?["num_key_value_heads"].to_string();
        convert(
            &["--gguf", gguf.to_str().context("path")?],
            &out,
            &["--kv-heads", &kv],
        )?;
        let (hf, got) = (tensors(&fixture(name))?, tensors(&out)?);
        for (k, t) in &hf {
            if k == "lm_head.weight" && !got.contains_key(k) {
                continue; // tied in the GGUF; config.json says so
            }
            let u = got.get(k).with_context(|| format!("{name}: no {k}"))?;
            ensure!(
                t.dims() == u.dims(),
                "{name}: {k} dims {:?} vs {:?}",
                t.dims(),
                u.dims()
            );
            let d = (t - u)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
            ensure!(d == 0.0, "{name}: {k} differs by {d}");
        }
        let ids = ids(&fixture(name))?;
        let d = max_diff(
            &logits(&gguf, &ids, "full")?.0,
            &logits(&out, &ids, "full")?.0,
        );
        ensure!(d <= 1e-4, "{name}: logits differ by {d}");
        ensure!(
            out.join("tokenizer.json").is_file(),
            "{name}: no tokenizer.json"
        );
    }
    Ok(())
}

/// Rows `[W | b]` of a projection (the bias, if any, as a last column).
fn rows_of(ts: &std::collections::HashMap<String, Tensor>, prefix: &str) -> Result<Vec<Vec<f32>>> {
    let mut w = ts[&format!("{prefix}.weight")].to_vec2::<f32>()?;
    if let Some(b) = ts.get(&format!("{prefix}.bias")) {
        for (row, x) in w.iter_mut().zip(b.to_vec1::<f32>()?) {
            row.push(x);
        }
    }
    Ok(w)
}

/// Writes rows made by [`rows_of`] back.
fn set_rows(
    ts: &mut std::collections::HashMap<String, Tensor>,
    prefix: &str,
    rows: Vec<Vec<f32>>,
) -> Result<()> {
    let has_bias = ts.contains_key(&format!("{prefix}.bias"));
    let n = rows.len();
    let cols = rows[0].len() - usize::from(has_bias);
    let mut w = Vec::with_capacity(n * cols);
    let mut b = Vec::with_capacity(n);
    for r in rows {
        w.extend_from_slice(&r[..cols]);
        if has_bias {
            b.push(r[cols]);
        }
    }
    ts.insert(
        format!("{prefix}.weight"),
        Tensor::from_vec(w, (n, cols), &Device::Cpu)?,
    );
    if has_bias {
        ts.insert(
            format!("{prefix}.bias"),
            Tensor::from_vec(b, n, &Device::Cpu)?,
        );
    }
    Ok(())
}

/// A model whose merged KV heads are, at every RoPE frequency, complex multiples of the
/// group's first head (keys, biases included) and linear images of it (values) loses
/// nothing when SVD merges them: the folds into the query and output projections reproduce
/// it. On `llama_mha` (heads 4 → 2: one query head per KV head) and `qwen2` (2 → 1: two
/// query heads per KV head, q/k/v biases). Mean pooling does not reproduce it.
#[test]
fn svd_is_exact_where_merged_heads_are_complex_multiples() -> Result<()> {
    for (name, pairs, to) in [
        ("llama_mha", vec![(0usize, 1usize), (2, 3)], "2"),
        ("qwen2", vec![(0, 1)], "1"),
    ] {
        let src = fixture(name);
        let tmp = tempfile::tempdir()?;
        let built = tmp.path().join("built");
        std::fs::create_dir(&built)?;
        std::fs::copy(src.join("config.json"), built.join("config.json"))?;
        let mut ts = tensors(&src)?;
        let (d, layers) = (16usize, 3usize);
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for l in 0..layers {
            for proj in ["k_proj", "v_proj"] {
                let prefix = format!("model.layers.{l}.self_attn.{proj}");
                let w = rows_of(&ts, &prefix)?;
                let mut w2 = w.clone();
                for &(a, b) in &pairs {
                    if proj == "k_proj" {
                        for i in 0..d / 2 {
                            let (re, im) = (
                                rng.random_range(-1.5f32..1.5),
                                rng.random_range(-1.5f32..1.5),
                            );
                            let (xr, xi) = (&w[a * d + i], &w[a * d + i + d / 2]);
                            w2[b * d + i] =
                                xr.iter().zip(xi).map(|(x, y)| re * x - im * y).collect();
                            w2[b * d + i + d / 2] =
                                xr.iter().zip(xi).map(|(x, y)| im * x + re * y).collect();
                        }
                    } else {
                        let m: Vec<Vec<f32>> = (0..d)
                            .map(|_| (0..d).map(|_| rng.random_range(-0.5f32..0.5)).collect())
                            .collect();
                        for r in 0..d {
                            let cols = w[0].len();
                            w2[b * d + r] = (0..cols)
                                .map(|c| (0..d).map(|s| m[r][s] * w[a * d + s][c]).sum())
                                .collect();
                        }
                    }
                }
                set_rows(&mut ts, &prefix, w2)?;
            }
        }
        candle_core::safetensors::save(&ts, built.join("model.safetensors"))?;
        let ids = ids(&src)?;
        let (want, _) = logits(&built, &ids, "full")?;
        let b = built.to_str().context("path")?;
        let svd = tmp.path().join("svd");
        convert(&["--model-dir", b], &svd, &["--kv-heads", to])?;
        let mean = tmp.path().join("mean");
        convert(
            &["--model-dir", b],
            &mean,
            &["--kv-heads", to, "--method", "mean"],
        )?;
        let d_svd = max_diff(&want, &logits(&svd, &ids, "full")?.0);
        let d_mean = max_diff(&want, &logits(&mean, &ids, "full")?.0);
        ensure!(d_svd <= 1e-3, "{name}: svd deviates by {d_svd}");
        ensure!(
            d_mean > 1e-1,
            "{name}: mean pooling deviates by only {d_mean}: the test does not discriminate"
        );
    }
    Ok(())
}

/// A converted model (4 → 1 KV heads) runs under every lossless policy with `full`'s
/// logits, and every policy that stores K/V stores exactly a quarter of what it stores for
/// the original (`recompute` and `hybrid` store layer inputs, whose width the heads do not
/// set: logits only).
#[test]
fn converted_models_run_under_every_policy_with_kv_bytes_scaled() -> Result<()> {
    let src = fixture("llama_mha");
    let tmp = tempfile::tempdir()?;
    let out = tmp.path().join("kv1");
    convert(
        &["--model-dir", src.to_str().context("path")?],
        &out,
        &["--kv-heads", "1"],
    )?;
    let label = &config(&out)?["kvpolicy_conversion"];
    ensure!(
        label["lossy"] == true && label["method"] == "svd",
        "label: {label}"
    );
    runs_like_full_and_stores_less(&src, &out, 4, |policy, s| {
        (!matches!(policy, "recompute" | "hybrid"))
            .then_some(s.device_kv_bytes + s.host_kv_bytes + s.disk_kv_bytes)
    })
}

/// `out`, converted from `src`, runs under every lossless policy with `full`'s logits
/// (≤ 1e-5), and for each policy `stored` measures (`None`: not compared) it stores exactly
/// `1 / factor` of what it stores for `src`.
fn runs_like_full_and_stores_less(
    src: &Path,
    out: &Path,
    factor: u64,
    stored: impl Fn(&str, &KvStats) -> Option<u64>,
) -> Result<()> {
    let ids = ids(src)?;
    let (reference, _) = logits(out, &ids, "full")?;
    for policy in ["full", "layer", "headwise", "auto", "recompute", "hybrid"] {
        let (got, st) = logits(out, &ids, policy)?;
        let d = max_diff(&reference, &got);
        ensure!(d <= 1e-5, "{policy}: logits differ from full's by {d}");
        let Some(a) = stored(policy, &st) else {
            continue;
        };
        let (_, orig) = logits(src, &ids, policy)?;
        let b = stored(policy, &orig).unwrap_or_default();
        ensure!(
            factor * a == b && a > 0,
            "{policy}: stores {a} bytes, the original {b}"
        );
    }
    Ok(())
}

/// `--kv-layers 1` of 3 (MLKV): one layer keeps K/V projections, the others read its cache;
/// the model runs under every lossless policy with `full`'s logits and every policy stores
/// exactly a third of what it stores for the original.
#[test]
fn kv_layers_share_one_cache_under_every_policy() -> Result<()> {
    let src = fixture("llama_mha");
    let tmp = tempfile::tempdir()?;
    let out = tmp.path().join("mlkv1");
    convert(
        &["--model-dir", src.to_str().context("path")?],
        &out,
        &["--kv-layers", "1"],
    )?;
    let cfg = config(&out)?;
    ensure!(cfg["num_key_value_layers"] == 1, "config: {cfg}");
    let label = &cfg["kvpolicy_conversion"];
    ensure!(
        label["lossy"] == true && label["kv_layers"]["to"] == 1,
        "label: {label}"
    );
    let t = tensors(&out)?;
    ensure!(t.contains_key("model.layers.0.self_attn.k_proj.weight"));
    ensure!(!t.contains_key("model.layers.1.self_attn.k_proj.weight"));
    ensure!(!t.contains_key("model.layers.2.self_attn.v_proj.weight"));
    // The KV layer's projections are the mean of the three layers'.
    let orig = tensors(&src)?;
    let name = |i: usize| format!("model.layers.{i}.self_attn.k_proj.weight");
    let mean = ((&orig[&name(0)] + &orig[&name(1)])? + &orig[&name(2)])?.affine(1.0 / 3.0, 0.0)?;
    let d = (&mean - &t[&name(0)])?
        .abs()?
        .flatten_all()?
        .max(0)?
        .to_scalar::<f32>()?;
    ensure!(d <= 1e-6, "k_proj of layer 0 is not the group's mean ({d})");
    // `full` and `auto` (no budget) store on the device, the others on the host.
    runs_like_full_and_stores_less(&src, &out, 3, |policy, s| {
        Some(match policy {
            "full" | "auto" => s.device_kv_bytes,
            _ => s.host_kv_bytes + s.disk_kv_bytes,
        })
    })
}

/// `--model-dir DIR FLAG VALUE --out OUT`.
fn args3(dir: &str, flag: &str, value: &str, out: &str) -> Vec<String> {
    ["--model-dir", dir, flag, value, "--out", out]
        .iter()
        .map(|s| s.to_string())
        .collect()
}

fn leftovers(dir: &Path) -> Result<Vec<String>> {
    Ok(std::fs::read_dir(dir)?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".kvpolicy-compress-"))
        .collect())
}

#[test]
fn bad_input_fails_with_a_clear_error_and_leaves_nothing() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let src = fixture("llama_gqa");
    let s = src.to_str().context("path")?;
    let full = tmp.path().join("full");
    std::fs::create_dir(&full)?;
    std::fs::write(full.join("keep.txt"), "mine")?;
    let link = tmp.path().join("link");
    std::os::unix::fs::symlink(tmp.path().join("elsewhere"), &link)?;
    let new = tmp.path().join("new");
    let p = |x: &Path| x.to_str().unwrap_or_default().to_string();
    let opt = fixture("opt");
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            vec![
                "--model-dir".into(),
                s.into(),
                "--kv-heads".into(),
                "3".into(),
                "--out".into(),
                p(&new),
            ],
            "does not divide the model's 2 KV heads",
        ),
        (
            vec![
                "--model-dir".into(),
                s.into(),
                "--kv-heads".into(),
                "0".into(),
                "--out".into(),
                p(&new),
            ],
            "does not divide",
        ),
        (
            vec![
                "--model-dir".into(),
                s.into(),
                "--kv-heads".into(),
                "1".into(),
                "--out".into(),
                p(&full),
            ],
            "exists and is not empty",
        ),
        (
            vec![
                "--model-dir".into(),
                s.into(),
                "--kv-heads".into(),
                "1".into(),
                "--out".into(),
                p(&link),
            ],
            "symbolic link",
        ),
        (
            vec![
                "--model-dir".into(),
                s.into(),
                "--kv-heads".into(),
                "1".into(),
                "--out".into(),
                p(&tmp.path().join("no/such")),
            ],
            "parent directory does not exist",
        ),
        (
            vec![
                "--model-dir".into(),
                p(&opt),
                "--kv-heads".into(),
                "1".into(),
                "--out".into(),
                p(&new),
            ],
            "model_type `opt` cannot be converted",
        ),
        (
            vec![
                "--model-dir".into(),
                s.into(),
                "--kv-heads".into(),
                "1".into(),
                "--calibration".into(),
                p(&src.join("ids.json")),
                "--out".into(),
                p(&new),
            ],
            "no tokenizer.json",
        ),
        (
            vec![
                "--model-dir".into(),
                s.into(),
                "--kv-heads".into(),
                "1".into(),
                "--calibration-ids".into(),
                "1,99999".into(),
                "--out".into(),
                p(&new),
            ],
            "outside the model's vocabulary",
        ),
        (
            args3(s, "--kv-layers", "0", &p(&new)),
            "--kv-layers 0 is not between 1 and the model's 3 layers",
        ),
        (
            args3(s, "--kv-layers", "4", &p(&new)),
            "--kv-layers 4 is not between 1",
        ),
        (
            vec![
                "--model-dir".into(),
                s.into(),
                "--kv-layers".into(),
                "2".into(),
                "--kv-heads".into(),
                "1".into(),
                "--out".into(),
                p(&new),
            ],
            "use --method mean",
        ),
        (
            args3(&p(&fixture("mlkv_llama")), "--kv-layers", "1", &p(&new)),
            "already shares K/V across layers",
        ),
    ];
    for (args, want) in cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let o = compress(&args)?;
        let err = String::from_utf8_lossy(&o.stderr);
        ensure!(
            o.status.code() == Some(1),
            "{args:?}: exit {:?}, stderr {err}",
            o.status.code()
        );
        ensure!(err.contains(want), "{args:?}: stderr lacks `{want}`: {err}");
        ensure!(!err.contains("panicked"), "{args:?} panicked: {err}");
        ensure!(!new.exists(), "{args:?} left {}", new.display());
        ensure!(
            leftovers(tmp.path())?.is_empty(),
            "{args:?} left a temporary"
        );
    }
    ensure!(
        std::fs::read_to_string(full.join("keep.txt"))? == "mine",
        "the existing directory was touched"
    );
    ensure!(
        std::fs::symlink_metadata(&link)?.file_type().is_symlink()
            && !tmp.path().join("elsewhere").exists(),
        "the link was followed"
    );
    // An empty directory is filled.
    let empty = tmp.path().join("empty");
    std::fs::create_dir(&empty)?;
    convert(
        &["--model-dir", s],
        &empty,
        &["--kv-heads", "1", "--method", "mean"],
    )?;
    ensure!(empty.join("model.safetensors").is_file() && leftovers(tmp.path())?.is_empty());
    Ok(())
}

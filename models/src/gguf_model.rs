//! Decoders from GGUF files, for every architecture llama.cpp names the way this crate's
//! HF families are: `llama` (Llama 2/3, SmolLM2, Mistral), `qwen2`, `gemma`, `gemma2` and
//! `gemma3`. The tensors keep llama.cpp's names (`blk.N.attn_q.weight` …) and its
//! conventions, which differ from the HF checkpoints in three ways:
//!
//! * `llama` files have q/k rows permuted by the converter, so RoPE rotates adjacent pairs;
//!   the other architectures keep HF's order and rotate halves (llama.cpp's NEOX style).
//! * Gemma's RMSNorm weights already include the `+ 1` (the converter adds it).
//! * What config.json says, the metadata may not: llama.cpp fills in its own rules
//!   (`llama-model.cpp`, `load_hparams`), followed here — Gemma 2 soft-caps default to 50 and
//!   30 and even layers slide; Gemma 3 slides on five of every six layers with a local RoPE
//!   base of 10,000 and scales RoPE only on global layers; both scale queries by
//!   `head_dim^-1/2`, except the 27B models, which use `(hidden / heads)^-1/2`.
use candle_core::quantized::QMatMul;
use candle_core::{DType, Device};
use kvpolicy_core::AttnSpec;

use crate::attention::Attention;
use crate::decoder::{Block, Decoder};
use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;
use crate::layers::{Embedding, Linear, Mlp, Norm, RmsNorm};
use crate::model::ModelInfo;
use crate::rope::{Rope, RopeConfig, RopeScaling, RopeStyle};

/// The GGUF architectures [`from_gguf`] builds.
pub const GGUF_ARCHITECTURES: &[&str] = &["llama", "qwen2", "gemma", "gemma2", "gemma3"];

/// What an architecture's llama.cpp graph does differently from plain Llama.
struct Arch {
    style: RopeStyle,
    act: candle_nn::Activation,
    embed_scale: bool,
    qkv_bias: bool,
    sandwich_norms: bool,
    qk_norm: bool,
    attn_softcap: Option<f64>,
    final_softcap: Option<f64>,
    /// Query scale when not `head_dim^-1/2`.
    scale: Option<f64>,
    windows: Vec<Option<usize>>,
    /// RoPE base of sliding-window layers, unscaled (Gemma 3).
    local_theta: Option<f64>,
}

/// The error for a GGUF of an architecture we do not build.
fn unsupported(g: &GgufFile, arch: &str) -> ModelError {
    g.corrupt(format!(
        "has architecture `{arch}`, which is not supported from GGUF; supported: {}",
        GGUF_ARCHITECTURES.join(", ")
    ))
}

/// The architecture `arch`'s rules for a model of `n_layers` layers, width `h`, `nh` heads.
fn arch_rules(g: &GgufFile, arch: &str, n_layers: usize, h: usize, nh: usize) -> Result<Arch> {
    let key = |k: &str| format!("{arch}.{k}");
    let plain = || Arch {
        style: RopeStyle::Interleaved,
        act: candle_nn::Activation::Silu,
        embed_scale: false,
        qkv_bias: false,
        sandwich_norms: false,
        qk_norm: false,
        attn_softcap: None,
        final_softcap: None,
        scale: None,
        windows: vec![None; n_layers],
        local_theta: None,
    };
    let gemma = || Arch {
        style: RopeStyle::Half,
        act: candle_nn::Activation::GeluPytorchTanh,
        embed_scale: true,
        ..plain()
    };
    let window = || -> Result<usize> {
        match g.meta_usize(&key("attention.sliding_window"))? {
            0 => Err(g.corrupt(format!("has {arch}.attention.sliding_window = 0"))),
            w => Ok(w),
        }
    };
    let positive = |name: &str, default: f64| -> Result<f64> {
        let v = g.meta_f64_or(&key(name), default)?;
        if v.is_finite() && v > 0.0 {
            Ok(v)
        } else {
            Err(g.corrupt(format!("has {arch}.{name} = {v}; it must be > 0")))
        }
    };
    // llama.cpp's LLM_TYPE_27B (46 layers for Gemma 2, 62 for Gemma 3).
    let scale_27b = |layers: usize| (n_layers == layers).then(|| 1.0 / ((h / nh) as f64).sqrt());
    Ok(match arch {
        "llama" => plain(),
        "qwen2" => Arch {
            style: RopeStyle::Half,
            qkv_bias: true,
            ..plain()
        },
        "gemma" => gemma(),
        "gemma2" => {
            let w = window()?;
            Arch {
                sandwich_norms: true,
                attn_softcap: Some(positive("attn_logit_softcapping", 50.0)?),
                final_softcap: Some(positive("final_logit_softcapping", 30.0)?),
                scale: scale_27b(46),
                windows: (0..n_layers).map(|i| (i % 2 == 0).then_some(w)).collect(),
                ..gemma()
            }
        }
        "gemma3" => {
            let w = window()?;
            Arch {
                sandwich_norms: true,
                qk_norm: true,
                scale: scale_27b(62),
                windows: (0..n_layers)
                    .map(|i| ((i + 1) % 6 != 0).then_some(w))
                    .collect(),
                local_theta: Some(10_000.0),
                ..gemma()
            }
        }
        other => return Err(unsupported(g, other)),
    })
}

/// RoPE scaling from `{arch}.rope.scaling.*` (linear only, as llama.cpp's `freq_scale`).
fn rope_scaling(g: &GgufFile, arch: &str) -> Result<RopeScaling> {
    match g.meta_str(&format!("{arch}.rope.scaling.type")).as_deref() {
        None | Some("none") => Ok(RopeScaling::None),
        Some("linear") => {
            let factor = g.meta_f64_or(&format!("{arch}.rope.scaling.factor"), 1.0)?;
            if !(factor.is_finite() && factor > 0.0) {
                return Err(g.corrupt(format!("has {arch}.rope.scaling.factor = {factor}")));
            }
            Ok(RopeScaling::Linear { factor })
        }
        Some(other) => Err(g.corrupt(format!(
            "asks for `{other}` RoPE scaling; only linear scaling is read from GGUF"
        ))),
    }
}

/// Builds the model from a GGUF file (see the module docs for the architectures).
pub fn from_gguf(g: &GgufFile, device: &Device) -> Result<Decoder> {
    let arch = g.architecture()?;
    if !GGUF_ARCHITECTURES.contains(&arch.as_str()) {
        return Err(unsupported(g, &arch));
    }
    let key = |k: &str| format!("{arch}.{k}");
    let nh = g.meta_usize(&key("attention.head_count"))?;
    let nkv = g.meta_usize_or(&key("attention.head_count_kv"), nh)?;
    let n_layers = g.meta_usize(&key("block_count"))?;
    let h = g.meta_usize(&key("embedding_length"))?;
    let eps = g.meta_f64_or(&key("attention.layer_norm_rms_epsilon"), 1e-5)?;
    let theta = g.meta_f64_or(&key("rope.freq_base"), 10_000.0)?;
    let max_positions = g.meta_usize_or(&key("context_length"), 2048)?;
    if nh == 0 || nkv == 0 || nh % nkv != 0 {
        return Err(g.corrupt(format!(
            "has inconsistent head counts ({nh} heads, {nkv} KV heads): the query heads must be a \
             whole multiple of the KV heads, both at least 1"
        )));
    }
    if n_layers == 0 {
        return Err(g.corrupt(format!(
            "says {arch}.block_count = 0; a decoder needs at least one layer"
        )));
    }
    if !(eps.is_finite() && eps >= 0.0) {
        return Err(g.corrupt(format!(
            "has {arch}.attention.layer_norm_rms_epsilon = {eps}; it must be a finite number ≥ 0"
        )));
    }
    if !(theta.is_finite() && theta > 0.0) {
        return Err(g.corrupt(format!(
            "has {arch}.rope.freq_base = {theta}; it must be a finite number > 0"
        )));
    }
    // The layer count sizes per-layer tables below: it must be one the tensors bear out
    // (each layer is several tensors, and each tensor takes bytes of the file).
    let last = format!("blk.{}.attn_q.weight", n_layers - 1);
    if n_layers > g.content().tensor_infos.len() || !g.has_tensor(&last) {
        return Err(g.corrupt(format!(
            "says {arch}.block_count = {n_layers} but holds no {last}; the metadata does not match the tensors"
        )));
    }
    let rules = arch_rules(g, &arch, n_layers, h, nh)?;
    // Gemma's heads are wider than hidden / heads: `attention.key_length` says how wide.
    let hd = match g.meta(&key("attention.key_length")) {
        Some(_) => g.meta_usize(&key("attention.key_length"))?,
        None if h % nh == 0 => g.meta_usize_or(&key("rope.dimension_count"), h / nh)?,
        None => {
            return Err(g.corrupt(format!(
            "has a width of {h} that {nh} heads do not divide, and no {arch}.attention.key_length"
        )))
        }
    };
    // Sizes in the metadata are checked against the tensors (whose bytes the file holds)
    // before anything is allocated from them.
    let (vocab, emb_w) = match g.tensor_dims("token_embd.weight")?.as_slice() {
        [v, w] => (*v, *w),
        other => {
            return Err(g.corrupt(format!(
                "token_embd.weight has dimensions {other:?}, expected 2"
            )))
        }
    };
    if emb_w != h {
        return Err(g.corrupt(format!(
            "token_embd.weight is {vocab}×{emb_w} but the embedding width is {h}"
        )));
    }
    let q = g.tensor_dims("blk.0.attn_q.weight")?;
    if q.get(1).copied() != Some(h)
        || hd.checked_mul(nh) != q.first().copied()
        || hd == 0
        || hd % 2 != 0
    {
        return Err(g.corrupt(format!(
            "blk.0.attn_q.weight has dimensions {q:?}, but {nh} heads × {hd} (even) from a width of {h} were expected"
        )));
    }
    let freq_factors = if g.has_tensor("rope_freqs.weight") {
        let t = g
            .tensor("rope_freqs.weight", &Device::Cpu)?
            .dequantize(&Device::Cpu)?;
        Some(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
    } else {
        None
    };
    let rope = Rope::new(
        &RopeConfig {
            theta,
            scaling: rope_scaling(g, &arch)?,
            freq_factors,
        },
        hd,
        rules.style,
    );
    let local_rope = rules.local_theta.map(|theta| {
        let cfg = RopeConfig {
            theta,
            scaling: RopeScaling::None,
            freq_factors: None,
        };
        Rope::new(&cfg, hd, rules.style)
    });
    let embed_q = std::sync::Arc::new(g.tensor("token_embd.weight", device)?);
    // On the CPU the table stays quantized and rows are dequantized at lookup; on a GPU a
    // lookup would copy the quantized table to the host, so it is dequantized once.
    let embed = if device.is_cpu() {
        Embedding::Quant(embed_q.clone())
    } else {
        Embedding::Dense(candle_nn::Embedding::new(embed_q.dequantize(device)?, h))
    };
    let bias = |name: &str, out: usize| -> Result<Option<candle_core::Tensor>> {
        if !rules.qkv_bias {
            return Ok(None);
        }
        let b = g.dense(name, device)?;
        if b.dims() != [out] {
            return Err(g.corrupt(format!("{name} has shape {:?}, expected [{out}]", b.dims())));
        }
        Ok(Some(b))
    };
    let ql = |name: String, out: usize, inp: usize, bias: Option<candle_core::Tensor>| {
        let t = g.tensor(&name, device)?;
        if t.shape().dims() != [out, inp] {
            return Err(g.corrupt(format!(
                "{name} has shape {:?}, expected [{out}, {inp}]",
                t.shape().dims()
            )));
        }
        Ok(Linear::quantized(QMatMul::from_qtensor(t)?, bias, out, inp))
    };
    let norm = |name: String, width: usize| -> Result<Norm> {
        let w = g.dense(&name, device)?;
        if w.dims() != [width] {
            return Err(g.corrupt(format!(
                "{name} has shape {:?}, expected [{width}]",
                w.dims()
            )));
        }
        Ok(Norm::Rms(RmsNorm::new(w, eps)))
    };
    let ffn = |i: usize| -> Result<usize> {
        let name = format!("blk.{i}.ffn_up.weight");
        g.tensor_dims(&name).and_then(|d| {
            d.first()
                .copied()
                .ok_or_else(|| g.corrupt(format!("{name} has no dimensions")))
        })
    };
    let mut layers = Vec::new(); // n_layers comes from the file: no reservation
    let mut intermediate = 0;
    for i in 0..n_layers {
        let ff = ffn(i)?;
        intermediate = intermediate.max(ff);
        let mut spec = AttnSpec::new(nh, nkv, hd);
        spec.sliding_window = rules.windows[i];
        spec.softcap = rules.attn_softcap;
        if let Some(s) = rules.scale {
            spec.scale = s;
        }
        let blk = |t: &str| format!("blk.{i}.{t}.weight");
        let b = |t: &str| format!("blk.{i}.{t}.bias");
        let attn = Attention {
            layer: i,
            q: ql(blk("attn_q"), nh * hd, h, bias(&b("attn_q"), nh * hd)?)?,
            k: ql(blk("attn_k"), nkv * hd, h, bias(&b("attn_k"), nkv * hd)?)?,
            v: ql(blk("attn_v"), nkv * hd, h, bias(&b("attn_v"), nkv * hd)?)?,
            o: ql(blk("attn_output"), h, nh * hd, None)?,
            rope: Some(match (&local_rope, spec.sliding_window) {
                (Some(l), Some(_)) => l.clone(),
                _ => rope.clone(),
            }),
            q_norm: rules
                .qk_norm
                .then(|| norm(blk("attn_q_norm"), hd))
                .transpose()?,
            k_norm: rules
                .qk_norm
                .then(|| norm(blk("attn_k_norm"), hd))
                .transpose()?,
            spec,
        };
        let mlp = Mlp::Gated {
            gate: ql(blk("ffn_gate"), ff, h, None)?,
            up: ql(blk("ffn_up"), ff, h, None)?,
            down: ql(blk("ffn_down"), h, ff, None)?,
            act: rules.act,
        };
        let sandwich = |t: &str| -> Result<Option<Norm>> {
            rules.sandwich_norms.then(|| norm(blk(t), h)).transpose()
        };
        layers.push(Block {
            attn_norm: norm(blk("attn_norm"), h)?,
            attn,
            post_attn_norm: sandwich("post_attention_norm")?,
            mlp_norm: norm(blk("ffn_norm"), h)?,
            mlp,
            post_mlp_norm: sandwich("post_ffw_norm")?,
        });
    }
    // A tied head reads the embedding table itself (one copy of it in memory).
    let lm_head = if g.has_tensor("output.weight") {
        ql("output.weight".to_string(), vocab, h, None)?
    } else {
        Linear::quantized(QMatMul::from_arc(embed_q)?, None, vocab, h)
    };
    let info = ModelInfo {
        architecture: arch.clone(),
        source: g.path().display().to_string(),
        vocab_size: vocab,
        max_positions,
        n_layers,
        n_heads: nh,
        n_kv_heads: nkv,
        head_dim: hd,
        hidden: h,
        intermediate,
        dtype: DType::F32,
        device: device.clone(),
        bos: g.meta_u32_opt("tokenizer.ggml.bos_token_id"),
        eos: g
            .meta_u32_opt("tokenizer.ggml.eos_token_id")
            .into_iter()
            .collect(),
        windows: rules.windows.clone(),
    };
    Ok(Decoder {
        embed,
        embed_scale: rules.embed_scale.then(|| (h as f64).sqrt()),
        positions: None,
        layers,
        norm: Some(norm("output_norm.weight".into(), h)?),
        lm_head,
        final_softcap: rules.final_softcap,
        info,
    })
}

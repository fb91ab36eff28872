//! llama.cpp's rules per GGUF architecture (`llama-model.cpp`, `load_hparams`): what each
//! graph does differently from plain Llama, with the defaults it fills in where the
//! metadata is silent — Gemma 2's soft-caps and alternating windows, Gemma 3's five local
//! layers in six with their own RoPE base, the 27B models' query scale — and the RoPE
//! scaling the metadata names.
use crate::arch::rope::{RopeScaling, RopeStyle};
use crate::error::{Message, ModelError, ModelInput, Result};
use crate::load::gguf::file::GgufFile;

/// The GGUF architectures [`from_gguf`](crate::load::gguf::build::from_gguf) builds.
pub const GGUF_ARCHITECTURES: &[&str] = &["llama", "qwen2", "gemma", "gemma2", "gemma3"];

/// What an architecture's llama.cpp graph does differently from plain Llama.
pub struct Arch {
    /// Which pairs RoPE rotates.
    pub style: RopeStyle,
    /// Activation of the MLP gate.
    pub act: candle_nn::Activation,
    /// Embeddings are multiplied by `sqrt(hidden)`.
    pub embed_scale: bool,
    /// Biases on q/k/v.
    pub qkv_bias: bool,
    /// Norms after attention and MLP as well as before.
    pub sandwich_norms: bool,
    /// RMSNorm on queries and keys per head.
    pub qk_norm: bool,
    /// Attention-logit soft-cap.
    pub attn_softcap: Option<f64>,
    /// Final-logit soft-cap.
    pub final_softcap: Option<f64>,
    /// Query scale when not `head_dim^-1/2`.
    pub scale: Option<f64>,
    /// Sliding window per layer.
    pub windows: Vec<Option<usize>>,
    /// RoPE base of sliding-window layers, unscaled (Gemma 3).
    pub local_theta: Option<f64>,
}

/// The error for a GGUF of an architecture we do not build, with the way out: a GGUF of
/// one that is built, or the model's safetensors (which load more architectures).
pub fn unsupported(g: &GgufFile, arch: &str) -> ModelError {
    g.refused(
        Message::from(format!(
            "has architecture `{arch}`, which is not supported from GGUF; supported: {}; use a GGUF of one of these, or the model's safetensors with ",
            GGUF_ARCHITECTURES.join(", ")
        ))
        .input(ModelInput::ModelDir)
        .text(format!(
            " (config.json's model_type one of {})",
            crate::config::MODEL_TYPES.join(", ")
        )),
    )
}

/// The architecture `arch`'s rules for a model of `n_layers` layers, width `h`, `nh` heads.
pub fn arch_rules(g: &GgufFile, arch: &str, n_layers: usize, h: usize, nh: usize) -> Result<Arch> {
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
pub fn rope_scaling(g: &GgufFile, arch: &str) -> Result<RopeScaling> {
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

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
use candle_core::{DType, Device, Tensor};
use kvpolicy_core::AttnSpec;
use kvpolicy_kernels::quant::QuantMatMul;

use crate::arch::attention::{Attention, KvProjections};
use crate::arch::decoder::{Block, Decoder, DecoderParts, ModelIdentity};
use crate::arch::layers::{Embedding, Linear, Mlp, Norm, RmsNorm};
use crate::arch::rope::{Rope, RopeConfig, RopeScaling};
use crate::error::Result;
use crate::load::gguf::file::GgufFile;
use crate::load::gguf::hparams::Hparams;
use crate::load::gguf::rules::{arch_rules, rope_scaling, Arch};

/// Checks what the metadata alone says before anything large is read: the hyperparameters
/// and the architecture's rules against the tensors present (what [`from_gguf`] checks
/// first; the loader runs it before building the tokenizer, so a file that is not a model
/// we run is named as such, not for its vocabulary).
pub fn check(g: &GgufFile) -> Result<()> {
    let hp = Hparams::read(g)?;
    arch_rules(g, &hp.arch, hp.n_layers, hp.hidden, hp.n_heads)?;
    Ok(())
}

/// Builds the model from a GGUF file (see the module docs for the architectures).
pub fn from_gguf(g: &GgufFile, device: &Device) -> Result<Decoder> {
    let hp = Hparams::read(g)?;
    let rules = arch_rules(g, &hp.arch, hp.n_layers, hp.hidden, hp.n_heads)?;
    let ropes = Ropes::read(g, &hp, &rules)?;
    let t = Tensors {
        g,
        device,
        eps: hp.eps,
    };
    let mut layers = Vec::new(); // n_layers comes from the file: no reservation
    for i in 0..hp.n_layers {
        layers.push(t.block(i, &hp, &rules, &ropes)?);
    }
    let (vocab, h) = (hp.vocab, hp.hidden);
    let tied = !g.has_tensor("output.weight");
    // A tied head reads the embedding table itself (one copy of it in memory): held
    // interleaved by the head's kernel where that applies, the lookup reassembling rows.
    let shared = match tied {
        true => t.interleaved("token_embd.weight", vocab, h)?,
        false => None,
    };
    let (embed, lm_head) = match shared {
        Some(op) => (
            Embedding::Shared(op.clone()),
            Linear::from_op(op, None, vocab, h),
        ),
        _ => {
            let embed_q = std::sync::Arc::new(g.tensor("token_embd.weight", device)?);
            let lm_head = if tied {
                Linear::quantized(QMatMul::from_arc(embed_q.clone())?, None, vocab, h)
            } else {
                t.linear("output.weight".to_string(), vocab, h, None)?
            };
            // On the CPU the table stays quantized and rows are dequantized at lookup; on
            // a GPU a lookup would copy the quantized table to the host, so it is
            // dequantized once.
            let embed = if device.is_cpu() {
                Embedding::Quant(embed_q)
            } else {
                Embedding::Dense(candle_nn::Embedding::new(
                    embed_q.dequantize(device)?,
                    hp.hidden,
                ))
            };
            (embed, lm_head)
        }
    };
    let parts = DecoderParts {
        embed,
        embed_scale: rules.embed_scale.then(|| (h as f64).sqrt()),
        positions: None,
        layers,
        norm: Some(t.norm("output_norm.weight".into(), h)?),
        lm_head,
        final_softcap: rules.final_softcap,
    };
    Decoder::new(
        parts,
        ModelIdentity {
            architecture: hp.arch.clone(),
            source: g.path().display().to_string(),
            max_positions: hp.max_positions,
            bos: g.meta_u32_opt("tokenizer.ggml.bos_token_id"),
            eos: g
                .meta_u32_opt("tokenizer.ggml.eos_token_id")
                .into_iter()
                .collect(),
            dtype: DType::F32,
            device: device.clone(),
            conversion: None,
        },
    )
}

/// The rotary embeddings of the global layers and, where they differ, of the
/// sliding-window layers (Gemma 3's unscaled local base).
struct Ropes {
    global: Rope,
    local: Option<Rope>,
}

impl Ropes {
    fn read(g: &GgufFile, hp: &Hparams, rules: &Arch) -> Result<Self> {
        let freq_factors = if g.has_tensor("rope_freqs.weight") {
            let t = g
                .tensor("rope_freqs.weight", &Device::Cpu)?
                .dequantize(&Device::Cpu)?;
            Some(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
        } else {
            None
        };
        let global = RopeConfig {
            theta: hp.theta,
            scaling: rope_scaling(g, &hp.arch)?,
            freq_factors,
        };
        let local = rules.local_theta.map(|theta| RopeConfig {
            theta,
            scaling: RopeScaling::None,
            freq_factors: None,
        });
        Ok(Self {
            global: Rope::new(&global, hp.head_dim, rules.style),
            local: local.map(|c| Rope::new(&c, hp.head_dim, rules.style)),
        })
    }

    /// The rotation of a layer with `window`.
    fn of(&self, window: Option<usize>) -> Rope {
        match (&self.local, window) {
            (Some(l), Some(_)) => l.clone(),
            _ => self.global.clone(),
        }
    }
}

/// The file's tensors on `device`, each checked against the shape the layer expects.
struct Tensors<'a> {
    g: &'a GgufFile,
    device: &'a Device,
    eps: f64,
}

impl Tensors<'_> {
    /// A quantized `(out, inp)` projection with an optional bias.
    fn linear(&self, name: String, out: usize, inp: usize, bias: Option<Tensor>) -> Result<Linear> {
        if let Some(op) = self.interleaved(&name, out, inp)? {
            return Ok(Linear::from_op(op, bias, out, inp));
        }
        let t = self.g.tensor(&name, self.device)?;
        if t.shape().dims() != [out, inp] {
            return Err(self.g.corrupt(format!(
                "{name} has shape {:?}, expected [{out}, {inp}]",
                t.shape().dims()
            )));
        }
        Ok(Linear::quantized(QMatMul::from_qtensor(t)?, bias, out, inp))
    }

    /// The Q4_0 or Q4_K weight `name` `(out, inp)` read straight into the decode kernel's
    /// interleaved layout (`QuantMatMul::interleave_owned`: one buffer, rearranged where it
    /// lies), where that layout applies (the CPU, whole groups of rows, AVX2).
    fn interleaved(&self, name: &str, out: usize, inp: usize) -> Result<Option<QuantMatMul>> {
        let dtype = self.g.tensor_dtype(name)?;
        if !self.device.is_cpu()
            || self.g.tensor_dims(name)? != [out, inp]
            || QuantMatMul::interleaves(dtype, out, inp).is_none()
        {
            return Ok(None);
        }
        Ok(QuantMatMul::interleave_owned(self.g.raw_bytes(name)?, dtype, out, inp).ok())
    }

    /// The bias `name` of width `out`, when the architecture has q/k/v biases.
    fn bias(&self, rules: &Arch, name: &str, out: usize) -> Result<Option<Tensor>> {
        if !rules.qkv_bias {
            return Ok(None);
        }
        let b = self.g.dense(name, self.device)?;
        if b.dims() != [out] {
            return Err(self
                .g
                .corrupt(format!("{name} has shape {:?}, expected [{out}]", b.dims())));
        }
        Ok(Some(b))
    }

    /// An RMSNorm of `width`.
    fn norm(&self, name: String, width: usize) -> Result<Norm> {
        let w = self.g.dense(&name, self.device)?;
        if w.dims() != [width] {
            return Err(self.g.corrupt(format!(
                "{name} has shape {:?}, expected [{width}]",
                w.dims()
            )));
        }
        Ok(Norm::Rms(RmsNorm::new(w, self.eps)))
    }

    /// Layer `i`'s feed-forward width (rows of its `ffn_up`).
    fn ffn_width(&self, i: usize) -> Result<usize> {
        let name = format!("blk.{i}.ffn_up.weight");
        self.g.tensor_dims(&name).and_then(|d| {
            d.first()
                .copied()
                .ok_or_else(|| self.g.corrupt(format!("{name} has no dimensions")))
        })
    }

    /// Decoder block `i`.
    fn block(&self, i: usize, hp: &Hparams, rules: &Arch, ropes: &Ropes) -> Result<Block> {
        let (h, nh, nkv, hd) = (hp.hidden, hp.n_heads, hp.n_kv_heads, hp.head_dim);
        let ff = self.ffn_width(i)?;
        let mut spec = AttnSpec::new(nh, nkv, hd);
        spec.sliding_window = rules.windows[i];
        spec.softcap = rules.attn_softcap;
        if let Some(s) = rules.scale {
            spec.scale = s;
        }
        let blk = |t: &str| format!("blk.{i}.{t}.weight");
        let b = |t: &str| format!("blk.{i}.{t}.bias");
        let qk_norm = |t: &str| rules.qk_norm.then(|| self.norm(blk(t), hd)).transpose();
        let attn = Attention {
            layer: i,
            q: self.linear(
                blk("attn_q"),
                nh * hd,
                h,
                self.bias(rules, &b("attn_q"), nh * hd)?,
            )?,
            kv: Some(KvProjections {
                k: self.linear(
                    blk("attn_k"),
                    nkv * hd,
                    h,
                    self.bias(rules, &b("attn_k"), nkv * hd)?,
                )?,
                v: self.linear(
                    blk("attn_v"),
                    nkv * hd,
                    h,
                    self.bias(rules, &b("attn_v"), nkv * hd)?,
                )?,
                k_norm: qk_norm("attn_k_norm")?,
            }),
            o: self.linear(blk("attn_output"), h, nh * hd, None)?,
            rope: Some(ropes.of(spec.sliding_window)),
            q_norm: qk_norm("attn_q_norm")?,
            spec,
        };
        let mlp = Mlp::Gated {
            gate: self.linear(blk("ffn_gate"), ff, h, None)?,
            up: self.linear(blk("ffn_up"), ff, h, None)?,
            down: self.linear(blk("ffn_down"), h, ff, None)?,
            act: rules.act,
        };
        let sandwich = |t: &str| {
            rules
                .sandwich_norms
                .then(|| self.norm(blk(t), h))
                .transpose()
        };
        Ok(Block {
            attn_norm: self.norm(blk("attn_norm"), h)?,
            attn,
            post_attn_norm: sandwich("post_attention_norm")?,
            mlp_norm: self.norm(blk("ffn_norm"), h)?,
            mlp,
            post_mlp_norm: sandwich("post_ffw_norm")?,
        })
    }
}

//! The architectures: one shared [`attention::Attention`] layer (projections, positional
//! encoding and the policy call), one [`decoder::Decoder`] that runs the blocks, the building
//! blocks they share ([`layers`], [`rope`]), and one file per HF family (`llama`, `mistral`,
//! `qwen2`, `gemma`, `opt`) that wires what differs — norms, MLP, embeddings, biases,
//! position handling — from its config.json and safetensors weights. GGUF files build the
//! same decoder in [`crate::load::gguf`].
pub mod attention;
pub mod decoder;
pub mod gemma;
pub mod layers;
pub mod llama;
pub mod mistral;
pub mod opt;
pub mod qwen2;
pub mod rope;

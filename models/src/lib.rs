//! `kvpolicy-models`: model definitions whose attention calls a [`kvpolicy_core::KvPolicy`],
//! with loading (local safetensors directories, the hub, GGUF), tokenizers and the
//! generation loop.
//!
//! One shared [`attention::Attention`] owns the projections, the positional encoding and the
//! policy call; one [`Decoder`] runs the blocks; each architecture file (`llama`, `mistral`,
//! `qwen2`, `gemma`, `opt`; `gguf_model` for GGUF files) only wires what differs — norms, MLP, embeddings, biases,
//! position handling — and [`ModelConfig`] dispatches on config.json's `model_type`.
#![deny(missing_docs)]
#![deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

pub mod attention;
pub mod config;
pub mod decoder;
pub mod error;
pub mod files;
pub mod gemma;
pub mod generate;
pub mod gguf;
pub mod gguf_model;
pub mod layers;
pub mod llama;
pub mod mistral;
pub mod model;
pub mod opt;
pub mod pypi;
pub mod qwen2;
pub mod random;
pub mod rope;
pub mod sizes;
pub mod source;
pub mod tokenizer;
pub mod weights;

pub use config::{LlamaConfig, ModelConfig, OptConfig};
pub use decoder::Decoder;
pub use error::{Message, ModelError, ModelInput, Result};
pub use generate::{
    batch_step, generate, generate_batch, prefill, validate_request, BatchGeneration,
    GenerateConfig, Generation,
};
pub use gguf::GgufFile;
pub use model::{CausalLm, LogitsMode, ModelInfo, SeqChunk};
pub use source::{activation_dtype, load, resolve, Loaded, ModelFiles, ModelSpec};
pub use tokenizer::TextTokenizer;

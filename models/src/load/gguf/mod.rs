//! GGUF files: the container ([`file`](mod@file): header, metadata, tensor extents checked;
//! [`blocks`]: a tensor read in place), the
//! hyperparameters its metadata gives ([`hparams`]), llama.cpp's per-architecture rules
//! ([`rules`]), and the decoder built from its tensors ([`build`]).
pub mod blocks;
pub mod build;
pub mod file;
pub mod hparams;
pub mod rules;

//! Running a loaded model: chunked prefill and decoding of one request ([`generate`]) and
//! of ragged batches of requests, each under its own cache ([`batch`]); one request through
//! a prefix cache ([`reuse`]); the next token from its logits ([`sampler`]).
pub mod batch;
pub mod generate;
pub mod reuse;
pub mod sampler;

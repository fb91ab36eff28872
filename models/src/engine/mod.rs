//! Running a loaded model: chunked prefill and decoding of one request ([`generate`]) and
//! of ragged batches of requests, each under its own cache ([`batch`]).
pub mod batch;
pub mod generate;

//! `kvpolicy-server` as a library: the binary (`main.rs`) serves [`app::build`]'s router on a
//! socket; the HTTP fuzz target ([`fuzzing`]) drives the same router in-process. Not a
//! library to depend on (unpublished).
#![deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

pub mod answer;
pub mod api;
pub mod app;
pub mod engine;
pub mod error;
pub mod events;
pub mod fields;
pub mod flags;
// A fuzz body reports what it finds by panicking.
#[allow(clippy::panic)]
pub mod fuzzing;
pub mod guard;
pub mod intake;
pub mod listen;
pub mod memory;
pub mod metrics;
pub mod passes;
pub mod reply;
pub mod reuse;
pub mod routes;
pub mod sampler;
pub mod shutdown;
pub mod swap;

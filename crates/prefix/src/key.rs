//! What makes two chunks of K/V the same (issue "KV reuse across requests", item 1): a
//! [`Fingerprint`] of everything that shapes a model's K/V, and [`ChunkKey`]s chained over
//! the token ids — the key of chunk `i` hashes the key of chunk `i − 1`, so it names the
//! whole prefix up to the chunk's end, as vLLM's prefix-caching block hashes and LMCache's
//! chunk keys do. Equal keys mean equal K/V: the same model, the same tokens before.
use sha2::{Digest, Sha256};

/// A SHA-256 digest of what shapes a model's K/V: its architecture and dimensions, the
/// identity of its weights (their bytes), the activation dtype, RoPE and window settings,
/// and the codec chunks are stored in. Built with [`FingerprintBuilder`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Fingerprint(pub [u8; 32]);

impl Fingerprint {
    /// The first 16 hex digits, for messages.
    pub fn short(&self) -> String {
        hex(&self.0[..8])
    }
}

/// Collects named fields into a [`Fingerprint`]; each field is length-prefixed, so no two
/// field lists hash alike by concatenation.
#[derive(Clone, Default)]
pub struct FingerprintBuilder {
    hasher: Sha256,
}

impl FingerprintBuilder {
    /// An empty builder (format version 1).
    pub fn new() -> Self {
        let mut b = Self::default();
        b.field("kvpolicy-prefix fingerprint", b"1");
        b
    }

    /// Adds a named field.
    pub fn field(&mut self, name: &str, value: &[u8]) -> &mut Self {
        for part in [name.as_bytes(), value] {
            self.hasher.update((part.len() as u64).to_le_bytes());
            self.hasher.update(part);
        }
        self
    }

    /// Adds a named field from everything `read` yields (a weight file's bytes, read in
    /// pieces).
    pub fn field_from(
        &mut self,
        name: &str,
        read: &mut dyn std::io::Read,
    ) -> std::io::Result<&mut Self> {
        let mut inner = Sha256::new();
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = read.read(&mut buf)?;
            if n == 0 {
                break;
            }
            inner.update(&buf[..n]);
        }
        Ok(self.field(name, &inner.finalize()))
    }

    /// The fingerprint.
    pub fn finish(&self) -> Fingerprint {
        Fingerprint(self.hasher.clone().finalize().into())
    }
}

/// The key of one chunk: a digest of the fingerprint, the previous chunk's key and the
/// chunk's token ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChunkKey(pub [u8; 32]);

impl ChunkKey {
    /// The key in hex: the chunk's file name.
    pub fn hex(&self) -> String {
        hex(&self.0)
    }
}

/// The keys of `ids`' whole chunks of `chunk` tokens (a last partial chunk has none: it
/// is never stored). `chunk` 0 gives no keys.
pub fn chunk_keys(fp: &Fingerprint, ids: &[u32], chunk: usize) -> Vec<ChunkKey> {
    if chunk == 0 {
        return Vec::new();
    }
    let mut prev = [0u8; 32];
    ids.chunks_exact(chunk)
        .map(|piece| {
            let mut h = Sha256::new();
            h.update(fp.0);
            h.update(prev);
            h.update((piece.len() as u64).to_le_bytes());
            for id in piece {
                h.update(id.to_le_bytes());
            }
            prev = h.finalize().into();
            ChunkKey(prev)
        })
        .collect()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fp(tag: &[u8]) -> Fingerprint {
        FingerprintBuilder::new().field("model", tag).finish()
    }

    #[test]
    fn a_key_names_the_whole_prefix() {
        let a = chunk_keys(&fp(b"m"), &[1, 2, 3, 4, 5, 6, 7], 2);
        assert_eq!(a.len(), 3);
        // Same second chunk, different first: different keys from there on.
        let b = chunk_keys(&fp(b"m"), &[9, 2, 3, 4, 5, 6], 2);
        assert_ne!(a[0], b[0]);
        assert_ne!(a[1], b[1]);
        // Same prefix: same keys; the trailing partial chunk changes nothing.
        let c = chunk_keys(&fp(b"m"), &[1, 2, 3, 4, 0], 2);
        assert_eq!(&a[..2], &c[..]);
        // Another model: other keys.
        assert_ne!(chunk_keys(&fp(b"n"), &[1, 2], 2)[0], a[0]);
        assert!(chunk_keys(&fp(b"m"), &[1, 2], 0).is_empty());
    }

    #[test]
    fn fields_are_delimited() {
        let ab = FingerprintBuilder::new().field("a", b"bc").finish();
        let abc = FingerprintBuilder::new().field("ab", b"c").finish();
        assert_ne!(ab, abc);
    }
}

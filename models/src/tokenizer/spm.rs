//! SentencePiece vocabularies from GGUF (`tokenizer.ggml.model = "llama"`: Gemma, Llama 2,
//! Mistral), rebuilt as a `tokenizers` BPE model that tokenizes as llama.cpp's SPM tokenizer
//! (`llm_tokenizer_spm`) does: spaces become `▁` (and a leading one is added where
//! `add_space_prefix` says so), then adjacent pieces merge, highest-scoring result first,
//! and characters the vocabulary lacks fall back to `<0xXX>` byte tokens.
//!
//! The file has pieces and scores but no merge list; the merges are derived from the
//! vocabulary — every split of a piece into two pieces is a merge, ranked by the merged
//! piece's score — as HF's `SentencePieceExtractor` does when it converts such a model.
use std::collections::HashMap;

use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::decoders::DecoderWrapper;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::prepend::Prepend;
use tokenizers::normalizers::replace::Replace;
use tokenizers::normalizers::utils::Sequence as NormalizerSequence;
use tokenizers::normalizers::NormalizerWrapper;
use tokenizers::Tokenizer;

use crate::error::tok_err;
use crate::error::{ModelError, Result};
use crate::load::gguf::file::GgufFile;

/// llama.cpp's token type of byte-fallback pieces (`<0x0A>`), never merged into.
const BYTE: i64 = 6;

/// Merges `(left, right)` of `tokens`, best first: every split of a piece into two pieces
/// of the vocabulary, ranked by the merged piece's score (then its id).
fn merges(tokens: &[String], scores: &[f32], types: &[i64]) -> Vec<(String, String)> {
    let ids: HashMap<&str, usize> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.as_str(), i))
        .collect();
    let mut ranked: Vec<(f32, usize, usize, &str, &str)> = Vec::new();
    for (id, piece) in tokens.iter().enumerate() {
        if types.get(id) == Some(&BYTE) {
            continue;
        }
        let score = scores.get(id).copied().unwrap_or(0.0);
        for (k, _) in piece.char_indices().skip(1) {
            let (l, r) = piece.split_at(k);
            if let (Some(&li), Some(&ri)) = (ids.get(l), ids.get(r)) {
                let normal = |i: usize| types.get(i) != Some(&BYTE);
                if normal(li) && normal(ri) {
                    ranked.push((score, id, li, l, r));
                }
            }
        }
    }
    ranked.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    ranked
        .into_iter()
        .map(|(_, _, _, l, r)| (l.to_string(), r.to_string()))
        .collect()
}

/// The tokenizer of an SPM vocabulary in `g` (without its special tokens, which the caller
/// adds as it does for every GGUF vocabulary).
pub(super) fn spm_tokenizer(g: &GgufFile, tokens: &[String], types: &[i64]) -> Result<Tokenizer> {
    let scores = g.meta_floats("tokenizer.ggml.scores").ok_or_else(|| {
        g.corrupt("has a `llama` (SentencePiece) vocabulary without `tokenizer.ggml.scores`".into())
    })?;
    if scores.len() != tokens.len() {
        return Err(ModelError::Tokenizer(
            format!(
                "{} has {} token scores for {} tokens",
                g.path().display(),
                scores.len(),
                tokens.len()
            )
            .into(),
        ));
    }
    let vocab: tokenizers::models::bpe::Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    let unk = g
        .meta_u32_opt("tokenizer.ggml.unknown_token_id")
        .and_then(|i| tokens.get(i as usize).cloned());
    let mut builder = BPE::builder()
        .vocab_and_merges(vocab, merges(tokens, &scores, types))
        .byte_fallback(true);
    if let Some(u) = unk {
        builder = builder.unk_token(u);
    }
    let bpe = builder.build().map_err(tok_err)?;
    let prefix = g
        .meta_bool("tokenizer.ggml.add_space_prefix")
        .unwrap_or(true);
    let mut normalizers = Vec::new();
    if prefix {
        normalizers.push(NormalizerWrapper::Prepend(Prepend::new("▁".into())));
    }
    normalizers.push(NormalizerWrapper::Replace(
        Replace::new(" ", "▁").map_err(tok_err)?,
    ));
    let mut decoders = vec![
        DecoderWrapper::Replace(Replace::new("▁", " ").map_err(tok_err)?),
        DecoderWrapper::ByteFallback(ByteFallback::new()),
        DecoderWrapper::Fuse(Fuse::new()),
    ];
    if prefix {
        decoders.push(DecoderWrapper::Strip(Strip::new(' ', 1, 0)));
    }
    let mut tok = Tokenizer::new(bpe);
    tok.with_normalizer(Some(NormalizerSequence::new(normalizers)))
        .map_err(tok_err)?;
    tok.with_decoder(Some(DecoderSequence::new(decoders)));
    Ok(tok)
}

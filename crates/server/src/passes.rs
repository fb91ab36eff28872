//! A step's forward passes. Normally one ragged pass over every request's piece
//! ([`batch_step`]); batch-invariant (`--batch-invariant`), each prompt piece in a pass of
//! its own and the decode tokens in passes small enough to take the kernel one token takes
//! alone, so no request's numbers depend on its batch-mates (on the CPU a quantized model's
//! matmul switches kernel at [`ModelInfo::row_split`](kvpolicy::models::ModelInfo::row_split)
//! packed rows).
use candle_core::Tensor;
use kvpolicy::models::{batch_step, CausalLm, LogitsMode, SeqChunk};
use kvpolicy::KvPolicy;

/// The chunks in the order run, and their logits.
pub type Passes = (Vec<SeqChunk>, Vec<Tensor>);

/// A step's forward passes: one ragged pass; or, batch-invariant, each prompt piece alone
/// and the decode tokens (`decode[i]`) in passes small enough to take the kernel one token
/// takes alone ([`ModelInfo::row_split`](kvpolicy::models::ModelInfo::row_split)), so no
/// request's numbers depend on its batch-mates.
pub fn forward(
    model: &dyn CausalLm,
    policy: &mut dyn KvPolicy,
    chunks: &[SeqChunk],
    decode: &[bool],
    invariant: bool,
) -> kvpolicy::models::Result<Passes> {
    if !invariant {
        return batch_step(model, policy, chunks, LogitsMode::Last);
    }
    let most = model
        .info()
        .row_split
        .map_or(usize::MAX, |r| r.saturating_sub(1).max(1));
    let mut groups: Vec<Vec<SeqChunk>> = chunks
        .iter()
        .zip(decode)
        .filter(|(_, &d)| !d)
        .map(|(c, _)| vec![c.clone()])
        .collect();
    let decoding: Vec<SeqChunk> = chunks
        .iter()
        .zip(decode)
        .filter(|(_, &d)| d)
        .map(|(c, _)| c.clone())
        .collect();
    groups.extend(decoding.chunks(most).map(<[SeqChunk]>::to_vec));
    let (mut order, mut logits) = (Vec::new(), Vec::new());
    for g in groups {
        let (o, l) = batch_step(model, policy, &g, LogitsMode::Last)?;
        order.extend(o);
        logits.extend(l);
    }
    Ok((order, logits))
}

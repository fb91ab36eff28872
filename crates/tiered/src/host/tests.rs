//! The host tier's growth.
use super::*;
use crate::transfer::SyncTransferEngine;

fn shape(max_tokens: usize) -> KvShape {
    KvShape {
        n_layers: 1,
        n_heads: 2,
        n_kv_heads: 1,
        head_dim: 4,
        hidden: 8,
        batch: 1,
        dtype: DType::F32,
        max_tokens,
        step_tokens: 0,
        activation_bytes_per_token: 0,
        windows: Vec::new(),
        readers: Vec::new(),
    }
}

/// Tokens of room layer 0 holds after growing for `tokens` in a run of `max_tokens`.
fn room_after(max_tokens: usize, tokens: usize) -> Result<u64> {
    let mut link = Link::new(Box::<SyncTransferEngine>::default());
    let mut host = HostLayers::new(1, None); // chunks of 8 tokens
    let s = shape(max_tokens);
    host.set_shape(&s);
    host.ensure(&mut link, 0, &s, tokens)?;
    Ok(host.ram_bytes() / host.stored_bytes(&s, 1, 1))
}

#[test]
fn growth_takes_the_planned_length_within_the_reserve_factor() -> Result<()> {
    // 10 tokens need 2 chunks (16); a run of 32 (4 chunks) is within 2 × 16: reserved.
    assert_eq!(room_after(32, 10)?, 32);
    assert_eq!(room_after(27, 10)?, 32);
    // A run of 33 or more tokens is past 2 × 16: whole chunks only.
    assert_eq!(room_after(33, 10)?, 16);
    assert_eq!(room_after(1000, 10)?, 16);
    // Never less than the tokens need.
    assert_eq!(room_after(4, 10)?, 16);
    // A run ending inside the chunks they need takes its length only.
    assert_eq!(room_after(12, 10)?, 12);
    assert_eq!(room_after(10, 10)?, 10);
    Ok(())
}

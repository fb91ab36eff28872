//! Arbitrary sequences of attention steps (any layer, any position, any chunk, shapes that
//! may not fit) and resets against every policy: errors only, never a panic.
#![no_main]
use candle_core::{DType, Device, Tensor};
use kvpolicy::{build_policy, AttnSpec, AttnStep, HeadGroup, KvRegen, PolicyOptions};
use libfuzzer_sys::fuzz_target;

struct Regen;
impl KvRegen for Regen {
    fn regen(&self, x: &Tensor, _pos: usize) -> kvpolicy::core::Result<(Tensor, Tensor)> {
        let (b, t, _) = x.dims3()?;
        let z = Tensor::zeros((b, 2, t, 4), DType::F32, x.device())?;
        Ok((z.clone(), z))
    }
    fn flops_per_token(&self) -> u64 {
        1
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&first, ops)) = data.split_first() else {
        return;
    };
    let names = ["full", "layer", "headwise", "recompute"];
    let mut opts = PolicyOptions {
        grow_tokens: 1 + (first as usize % 5),
        head_group: HeadGroup::Fixed(1 + (first as usize >> 6)),
        recompute_split: if first & 8 != 0 { Some(first as usize % 7) } else { None },
        ..PolicyOptions::default()
    };
    if first & 16 != 0 {
        opts.device_kv_budget = Some(64 * first as u64);
    }
    let Ok(mut p) = build_policy(names[first as usize % 4], &opts) else {
        return;
    };
    let dev = Device::Cpu;
    let mut spec = AttnSpec::new(4, 2, 4);
    for op in ops.chunks(3) {
        let [a, b, c] = [op[0], *op.get(1).unwrap_or(&0), *op.get(2).unwrap_or(&0)];
        if a == 255 {
            p.reset();
            continue;
        }
        spec.sliding_window = if c & 1 == 1 { Some(1 + (c as usize >> 1) % 6) } else { None };
        let t = 1 + (a as usize % 4);
        let nkv = if c & 128 != 0 { 1 } else { 2 };
        let layer = (b as usize) % 3;
        let pos = (b as usize >> 2) % 40;
        let (Ok(q), Ok(k), Ok(v), Ok(x)) = (
            Tensor::ones((1, 4, t, 4), DType::F32, &dev),
            Tensor::ones((1, nkv, t, 4), DType::F32, &dev),
            Tensor::ones((1, nkv, t, 4), DType::F32, &dev),
            Tensor::ones((1, t, 16), DType::F32, &dev),
        ) else {
            return;
        };
        let _ = p.attend(&AttnStep {
            layer,
            q: &q,
            k: &k,
            v: &v,
            x: &x,
            pos,
            spec: &spec,
            regen: &Regen,
        });
        let _ = p.stats();
    }
});

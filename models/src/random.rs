//! Random weights for any config, generated directly on the target device — for benchmarks
//! at real scale (a Llama-3-8B config, say) with no download. Speed and memory do not depend
//! on weight values, and every policy can still be checked against `full` on them.
use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::VarBuilder;

/// A weight source that draws every tensor from N(0, std²) (norm weights are ones).
#[derive(Clone, Debug)]
pub struct RandomWeights {
    std: f64,
}

impl SimpleBackend for RandomWeights {
    fn get(
        &self,
        s: Shape,
        name: &str,
        _h: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        if name.contains("norm") {
            return Tensor::ones(s, dtype, dev);
        }
        Tensor::randn(0f32, self.std as f32, s, dev)?.to_dtype(dtype)
    }

    fn get_unchecked(
        &self,
        name: &str,
        _dtype: DType,
        _dev: &Device,
    ) -> candle_core::Result<Tensor> {
        candle_core::bail!("random weights need a shape for `{name}`")
    }

    fn contains_tensor(&self, _name: &str) -> bool {
        true
    }
}

/// A var builder of random weights (std 0.02, the usual initializer range) on `device`,
/// seeded so that runs repeat.
pub fn random_varbuilder(
    dtype: DType,
    device: &Device,
    seed: u64,
) -> candle_core::Result<VarBuilder<'static>> {
    device.set_seed(seed)?;
    Ok(VarBuilder::from_backend(
        Box::new(RandomWeights { std: 0.02 }),
        dtype,
        device.clone(),
    ))
}

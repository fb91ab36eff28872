//! Random weights for any config, generated directly on the target device — for benchmarks
//! at real scale (a Llama-3-8B config, say) with no download. Speed and memory do not depend
//! on weight values, and every policy can still be checked against `full` on them.
use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::VarBuilder;

/// A weight source that draws every tensor from N(0, std²) (norm weights are ones). On the
/// CPU the draws come from a seeded generator of this crate (candle's CPU RNG cannot be
/// seeded); on accelerators from the device's seeded generator, without a host round trip.
#[derive(Debug)]
pub struct RandomWeights {
    std: f64,
    rng: std::sync::Mutex<rand::rngs::StdRng>,
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
        if dev.is_cpu() {
            use rand::Rng;
            let normal =
                rand_distr::Normal::new(0f32, self.std as f32).map_err(candle_core::Error::wrap)?;
            let mut rng = self
                .rng
                .lock()
                .map_err(|_| candle_core::Error::Msg("random weight generator poisoned".into()))?;
            let data: Vec<f32> = (0..s.elem_count()).map(|_| rng.sample(normal)).collect();
            return Tensor::from_vec(data, s, dev)?.to_dtype(dtype);
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
    use rand::SeedableRng;
    if !device.is_cpu() {
        device.set_seed(seed)?;
    }
    let backend = RandomWeights {
        std: 0.02,
        rng: std::sync::Mutex::new(rand::rngs::StdRng::seed_from_u64(seed)),
    };
    Ok(VarBuilder::from_backend(
        Box::new(backend),
        dtype,
        device.clone(),
    ))
}

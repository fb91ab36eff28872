//! Builds `cuda/*.cu` to PTX with nvcc when the `cuda` feature is on (through cudaforge,
//! as candle-kernels does); without it, nothing.
#[cfg(feature = "cuda")]
fn main() -> anyhow::Result<()> {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-changed=cuda");
    cudaforge::KernelBuilder::new()
        .source_dir("cuda")
        .arg("-std=c++17")
        .arg("-O3")
        .build_ptx()?
        .write(std::path::Path::new(&std::env::var("OUT_DIR")?).join("ptx.rs"))?;
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn main() {}

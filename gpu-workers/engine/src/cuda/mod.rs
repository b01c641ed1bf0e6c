//! The CUDA backend: the Llama forward pass on an NVIDIA GPU, through `cudarc` with the
//! CUDA libraries loaded at run time (`libcuda`, `libnvrtc`, `libcublas`), so that building
//! Hearth needs no CUDA toolkit and a machine without a GPU runs the same binary on its
//! CPU.
//!
//! * Weights are dequantized once, at load, to f16 (`q|k|v` and `gate|up` stacked so that
//!   one GEMM computes each group) and multiplied by cuBLAS (`cublasGemmEx`, f16 inputs,
//!   f32 accumulation and output). The residual adds ride on the GEMMs (β = 1).
//! * Everything else is Hearth's own kernels ([`plan::KERNELS`], CUDA C compiled by NVRTC
//!   for the device's architecture at load): embedding, RMSNorm, RoPE, the KV write,
//!   paged attention (prefill and decode alike: a row attends to its own sequence through
//!   its block table), SwiGLU.
//! * The KV pool lives on the device in the CPU pool's exact layout, so prefix-cache
//!   copies, KV export/import and PD transfers are byte copies, and blocks move between
//!   CPU and GPU workers unchanged.
//! * Decode steps (every row sampled, at most 64 rows) replay a CUDA graph captured per
//!   row bucket ([`plan::GRAPH_BUCKETS`]); inputs are copied into the same device buffers
//!   before each replay. `--cuda-graphs false` (`EngineConfig::cuda_graphs`) turns graphs off.
//! * Sampling stays on the host: the step's logits rows come back, and the scheduler,
//!   prefix cache, grammar and sampler above are the CPU engine's, unchanged.

pub mod plan;
pub mod program;

#[cfg(feature = "cuda")]
mod device;
#[cfg(feature = "cuda")]
pub use device::{compile_cubin, compile_ptx, nvrtc_version, CudaCompute, CudaError, CudaOptions, DeviceReport};

/// Which device a worker computes on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Device {
    #[default]
    Cpu,
    /// An NVIDIA GPU by ordinal.
    Cuda(usize),
}

impl Device {
    /// `cpu`, `cuda` (GPU 0) or `cuda:N`.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "cpu" => Ok(Device::Cpu),
            "cuda" | "gpu" => Ok(Device::Cuda(0)),
            other => match other.strip_prefix("cuda:").map(str::parse) {
                Some(Ok(n)) => Ok(Device::Cuda(n)),
                _ => Err(format!("unknown device {s:?} (cpu, cuda or cuda:N)")),
            },
        }
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Device;

    #[test]
    fn devices_parse() {
        assert_eq!(Device::parse("cpu"), Ok(Device::Cpu));
        assert_eq!(Device::parse("CUDA"), Ok(Device::Cuda(0)));
        assert_eq!(Device::parse("cuda:3"), Ok(Device::Cuda(3)));
        assert!(Device::parse("cuda:x").unwrap_err().contains("cpu, cuda or cuda:N"));
        assert!(Device::parse("tpu").is_err());
        assert_eq!(Device::Cuda(1).to_string(), "cuda:1");
    }
}

//! Model architectures. The dense families share one transformer ([`transformer`]: the
//! weights, the batched forward pass over the paged KV cache) built from shared pieces
//! ([`rope`], [`crate::attention`], the norms and activations of [`crate::kernels`]); each family is
//! one small file that reads its own settings from the model file into a [`BlockSpec`] —
//! a bias, a norm, a window, a soft-cap is one line there. Kernels live in
//! [`crate::kernels`] and know nothing about models; quantization types are theirs.
//!
//! | family | GGUF `general.architecture` | Hugging Face `model_type` | differs from Llama by |
//! |---|---|---|---|
//! | [`llama`] | `llama` | `llama` | — (Llama 3's RoPE factors) |
//! | [`mistral`] | `llama` with a window | `mistral` | sliding window on every layer |
//! | [`qwen2`] | `qwen2` | `qwen2` | Q/K/V biases, NeoX RoPE |
//! | [`qwen3`] | `qwen3` | `qwen3` | Q/K RMSNorm, NeoX RoPE |
//! | [`gemma2`] | `gemma2` | `gemma2` | √d embeddings, post-norms, GeGLU, soft-caps, alternating windows |
//! | [`gemma3`] | `gemma3` | `gemma3`, `gemma3_text` | as Gemma 2 with Q/K norm, 5:1 windows, local RoPE base |
//! | [`phi3`] | `phi3` | `phi3` | fused QKV and gate-up tensors, NeoX RoPE, LongRoPE |
//! | [`mixtral`] | `llama` with experts | `mixtral` | mixture-of-experts MLP (softmax top-k) |
//! | [`qwen3moe`] | `qwen3moe` | `qwen3_moe` | Qwen3's attention, mixture-of-experts MLP |
//! | [`deepseek2`] | `deepseek2` | `deepseek_v3`, `deepseek_v2`, `kimi_k2` | latent attention ([`mla`]), shared experts, sigmoid group-limited routing |
//!
//! Mixture-of-experts MLPs are [`moe`]'s; latent attention and its cache layout [`mla`]'s.

pub mod arch;
pub mod config;
pub mod deepseek2;
pub mod gemma2;
pub mod gemma3;
pub mod layers;
pub mod llama;
pub mod lora;
pub mod mistral;
pub mod mixtral;
pub mod mla;
pub mod moe;
pub mod options;
pub mod phi3;
pub mod qwen2;
pub mod qwen3;
pub mod qwen3moe;
pub mod rope;
pub mod stage;
pub mod transformer;

pub use arch::Arch;
pub use config::{
    Activation, BlockSpec, Gating, Hparams, MlaSpec, ModelConfig, MoeSpec, NORM_SHIFT_KEY, ROPE_LAYOUT_KEY,
};
pub use lora::{LoraAdapter, LoraError, LoraLimits};
pub use options::{FloatWeights, LoadOptions, PreparedPack};
pub use rope::{RopeLayout, RopeScaling, RopeScalingKind};
pub use stage::{StagePlan, StageSpan};
pub use transformer::{Batch, ForwardScratch, LayerWeights, Model, ModelWeights, Session, StageInput};

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Gguf(#[from] crate::formats::gguf::GgufError),
    #[error("unsupported architecture {0:?} (Hearth serves {list})", list = Arch::supported())]
    Architecture(String),
    #[error("tensor {name} has type {ty}, which Hearth cannot compute with (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K; requantize the file with llama-quantize, e.g. to Q4_K_M)")]
    TensorType {
        name: String,
        ty: crate::formats::gguf::GgmlType,
    },
    #[error("tensor {name} has shape {got:?}, expected {want:?}")]
    Shape {
        name: String,
        got: Vec<u64>,
        want: Vec<u64>,
    },
    #[error("invalid model configuration: {0}")]
    Config(String),
}

/// One family: how its files are recognised and how it reads its own settings.
pub struct Family {
    /// GGUF `general.architecture` (None: stored under another family's name, as llama.cpp
    /// stores Mistral as `llama`).
    pub gguf: Option<&'static str>,
    /// Hugging Face `model_type`s (the first is what an export writes; none: GGUF files
    /// only, neither read from nor exported to Hugging Face directories).
    pub hf_model_types: &'static [&'static str],
    /// The Hugging Face class an export names in `architectures`.
    pub hf_class: &'static str,
    /// Reads the family's keys into the configuration the common keys began.
    pub configure: fn(&Hparams<'_>, &mut ModelConfig) -> Result<(), ModelError>,
}

impl Arch {
    pub fn family(self) -> &'static Family {
        match self {
            Arch::Llama => &llama::FAMILY,
            Arch::Mistral => &mistral::FAMILY,
            Arch::Qwen2 => &qwen2::FAMILY,
            Arch::Qwen3 => &qwen3::FAMILY,
            Arch::Gemma2 => &gemma2::FAMILY,
            Arch::Gemma3 => &gemma3::FAMILY,
            Arch::Phi3 => &phi3::FAMILY,
            Arch::Mixtral => &mixtral::FAMILY,
            Arch::Qwen3Moe => &qwen3moe::FAMILY,
            Arch::Deepseek2 => &deepseek2::FAMILY,
        }
    }

    /// The family of a GGUF `general.architecture`.
    pub fn from_gguf(name: &str) -> Option<Arch> {
        Self::ALL.into_iter().find(|a| a.family().gguf == Some(name))
    }

    /// The family of a Hugging Face `model_type`.
    pub fn from_hf(model_type: &str) -> Option<Arch> {
        Self::ALL
            .into_iter()
            .find(|a| a.family().hf_model_types.contains(&model_type))
    }

    /// The GGUF architecture name a family's files carry.
    pub fn gguf_name(self) -> &'static str {
        self.family().gguf.unwrap_or("llama")
    }

    fn supported() -> String {
        Self::ALL
            .iter()
            .filter_map(|a| a.family().gguf)
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Every Hugging Face `model_type` Hearth reads, for error messages.
    pub fn hf_supported() -> String {
        Self::ALL
            .iter()
            .flat_map(|a| a.family().hf_model_types)
            .copied()
            .collect::<Vec<_>>()
            .join(", ")
    }
}

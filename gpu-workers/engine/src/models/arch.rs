//! The architectures Hearth computes, by name: what a KV layout or a file records of a model
//! without the model code (each family's settings are in [`crate::models`]).

use serde::{Deserialize, Serialize};

/// The architectures Hearth computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
    Gemma2,
    Gemma3,
    Phi3,
    Mixtral,
    Qwen3Moe,
    Deepseek2,
}

impl Arch {
    pub const ALL: [Arch; 10] = [
        Arch::Llama,
        Arch::Mistral,
        Arch::Qwen2,
        Arch::Qwen3,
        Arch::Gemma2,
        Arch::Gemma3,
        Arch::Phi3,
        Arch::Mixtral,
        Arch::Qwen3Moe,
        Arch::Deepseek2,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Mistral => "mistral",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Gemma2 => "gemma2",
            Arch::Gemma3 => "gemma3",
            Arch::Phi3 => "phi3",
            Arch::Mixtral => "mixtral",
            Arch::Qwen3Moe => "qwen3moe",
            Arch::Deepseek2 => "deepseek2",
        }
    }
}

impl std::fmt::Display for Arch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

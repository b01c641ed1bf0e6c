//! Llama (Llama 2/3.x, SmolLM2, TinyLlama): the base block every other family varies —
//! RMSNorm, grouped-query attention with RoPE on adjacent pairs (llama.cpp's converter
//! permutes the Q/K rows; Hugging Face directories rotate halves, see [`crate::formats::hf`]), a
//! SwiGLU MLP, optionally tied embeddings. Llama 3.1's RoPE scaling arrives as the
//! `rope_freqs` tensor (found at load) or as `rope_scaling.rope_type = "llama3"`.
//! Mistral is stored under this name too: a window in the file makes it [`super::mistral`];
//! so is Mixtral: experts make it [`super::mixtral`].

use super::{Family, Hparams, ModelConfig, ModelError};

pub const FAMILY: Family = Family {
    gguf: Some("llama"),
    hf_model_types: &["llama"],
    hf_class: "LlamaForCausalLM",
    configure,
};

fn configure(h: &Hparams<'_>, c: &mut ModelConfig) -> Result<(), ModelError> {
    if h.opt_u("expert_count")?.is_some_and(|n| n > 0) {
        return (super::mixtral::FAMILY.configure)(h, c);
    }
    if h.opt_u("attention.sliding_window")?.is_some_and(|w| w > 0) {
        return (super::mistral::FAMILY.configure)(h, c);
    }
    Ok(())
}

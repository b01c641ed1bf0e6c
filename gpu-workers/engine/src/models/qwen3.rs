//! Qwen3 (dense): Llama's block with a per-head RMSNorm on Q and K before RoPE, RoPE on
//! halves, and heads wider than `d_model / n_heads` (`attention.key_length`).

use super::{Family, Hparams, ModelConfig, ModelError, RopeLayout};

pub const FAMILY: Family = Family {
    gguf: Some("qwen3"),
    hf_model_types: &["qwen3"],
    hf_class: "Qwen3ForCausalLM",
    configure,
};

fn configure(_: &Hparams<'_>, c: &mut ModelConfig) -> Result<(), ModelError> {
    c.rope_layout = RopeLayout::Halves;
    c.block.qk_norm = true;
    Ok(())
}

//! Phi-3 / Phi-3.5 / Phi-4-mini: Llama's block with the Q, K, V projections fused into
//! one `attn_qkv` matrix and the MLP's gate and up into one `ffn_up` of twice the width
//! (both layouts are found at load), RoPE on halves, and the 128k variants' LongRoPE
//! (`rope_factors_long`/`_short`, chosen by the context served). Its `sliding_window` is
//! ignored, as llama.cpp ignores it (the released configs' windows are wrong for some
//! checkpoints).

use super::{Family, Hparams, ModelConfig, ModelError, RopeLayout};

pub const FAMILY: Family = Family {
    gguf: Some("phi3"),
    hf_model_types: &["phi3"],
    hf_class: "Phi3ForCausalLM",
    configure,
};

fn configure(_: &Hparams<'_>, c: &mut ModelConfig) -> Result<(), ModelError> {
    c.rope_layout = RopeLayout::Halves;
    Ok(())
}

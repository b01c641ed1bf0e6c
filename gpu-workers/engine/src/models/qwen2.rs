//! Qwen2 / Qwen2.5: Llama's block with biases on the Q, K and V projections (found at
//! load) and RoPE on halves (llama.cpp's NeoX layout: its converter keeps the rows).
//! Qwen2.5's long-context YaRN comes from the file (`rope.scaling.type = yarn`).

use super::{Family, Hparams, ModelConfig, ModelError, RopeLayout};

pub const FAMILY: Family = Family {
    gguf: Some("qwen2"),
    hf_model_types: &["qwen2"],
    hf_class: "Qwen2ForCausalLM",
    configure,
};

fn configure(_: &Hparams<'_>, c: &mut ModelConfig) -> Result<(), ModelError> {
    c.rope_layout = RopeLayout::Halves;
    Ok(())
}

//! Qwen3-MoE (30B-A3B, 235B-A22B): Qwen3's attention (Q/K RMSNorm, RoPE on halves, wide
//! heads) with a mixture-of-experts MLP in every layer — a softmax router over 128
//! experts, the best 8 renormalized, no shared expert.

use super::{Family, Hparams, ModelConfig, ModelError, MoeSpec};

pub const FAMILY: Family = Family {
    gguf: Some("qwen3moe"),
    hf_model_types: &["qwen3_moe"],
    hf_class: "Qwen3MoeForCausalLM",
    configure,
};

fn configure(h: &Hparams<'_>, c: &mut ModelConfig) -> Result<(), ModelError> {
    (super::qwen3::FAMILY.configure)(h, c)?;
    let used = h.u("expert_used_count")?.max(1);
    // llama.cpp's graph renormalizes the chosen weights whatever the file says.
    let mut moe = MoeSpec::read(h, c.n_layers, c.n_ff / used)?
        .ok_or_else(|| ModelError::Config("a qwen3moe file without expert_count".into()))?;
    moe.norm_weights = true;
    c.moe = Some(moe);
    Ok(())
}

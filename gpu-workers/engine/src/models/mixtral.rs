//! Mixtral: Mistral's block with a mixture-of-experts MLP — a softmax router over the
//! experts (8), the best `expert_used_count` (2) renormalized to sum to 1. llama.cpp stores
//! it as `llama` with expert tensors (`ffn_{gate,up,down}_exps`): an `expert_count` in a
//! `llama` file makes it this family.

use super::{Arch, Family, Hparams, ModelConfig, ModelError, MoeSpec};

pub const FAMILY: Family = Family {
    gguf: None,
    hf_model_types: &["mixtral"],
    hf_class: "MixtralForCausalLM",
    configure,
};

fn configure(h: &Hparams<'_>, c: &mut ModelConfig) -> Result<(), ModelError> {
    (super::mistral::FAMILY.configure)(h, c)?;
    c.arch = Arch::Mixtral;
    // llama.cpp's `llama` graph renormalizes the chosen experts' weights whatever the file says.
    let mut moe = MoeSpec::read(h, c.n_layers, c.n_ff)?
        .ok_or_else(|| ModelError::Config("a Mixtral file without expert_count".into()))?;
    moe.norm_weights = true;
    c.moe = Some(moe);
    Ok(())
}

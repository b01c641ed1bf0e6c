//! Mistral (7B v0.1): Llama's block with every layer attending only to the last
//! `sliding_window` positions. llama.cpp's converter writes Mistral as `llama` and
//! llama.cpp ignores the window; Hearth applies it when the file (or `config.json`'s
//! `sliding_window`) states one, as transformers does. Later Mistral releases have no
//! window and load as plain Llama.

use super::{Arch, Family, Hparams, ModelConfig, ModelError};

pub const FAMILY: Family = Family {
    gguf: None,
    hf_model_types: &["mistral"],
    hf_class: "MistralForCausalLM",
    configure,
};

fn configure(h: &Hparams<'_>, c: &mut ModelConfig) -> Result<(), ModelError> {
    c.arch = Arch::Mistral;
    c.block.sliding_window = h.opt_u("attention.sliding_window")?.filter(|&w| w > 0);
    Ok(())
}

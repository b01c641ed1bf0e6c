//! Gemma 3 (text): Gemma 2's block without attention soft-capping and with a per-head
//! RMSNorm on Q and K; five windowed layers for every global one, the windowed layers
//! rotating with their own base (`rope.freq_base_swa`, 10 000) and never scaled, the
//! global ones with the file's base and scaling (linear ×8 on the 4B and larger).

use super::{Family, Hparams, ModelConfig, ModelError};

pub const FAMILY: Family = Family {
    gguf: Some("gemma3"),
    hf_model_types: &["gemma3_text", "gemma3"],
    hf_class: "Gemma3ForCausalLM",
    configure,
};

fn configure(h: &Hparams<'_>, c: &mut ModelConfig) -> Result<(), ModelError> {
    super::gemma2::gemma_block(h, c)?;
    let b = &mut c.block;
    b.qk_norm = true;
    b.final_softcap = h.opt_f("final_logit_softcapping")?.filter(|&c| c > 0.0);
    if let Some(w) = h.opt_u("attention.sliding_window")?.filter(|&w| w > 0) {
        b.sliding_window = Some(w);
        b.swa_layers = h.swa_pattern(c.n_layers, 6)?;
        b.swa_rope_theta = Some(h.opt_f("rope.freq_base_swa")?.unwrap_or(10000.0));
    }
    Ok(())
}

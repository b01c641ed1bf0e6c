//! Gemma 2: embeddings scaled by √d, RMSNorm before *and after* attention and the MLP, a
//! GeGLU MLP (GELU, tanh form), attention scores and logits soft-capped, even layers
//! attending within a sliding window (4096 by default) and odd ones globally, RoPE on
//! halves. Norm weights are stored with Gemma's `1 +` folded in, as llama.cpp's converter
//! writes them (a Hugging Face directory is shifted on load).

use super::{Activation, Arch, Family, Hparams, ModelConfig, ModelError, RopeLayout};

pub const FAMILY: Family = Family {
    gguf: Some("gemma2"),
    hf_model_types: &["gemma2"],
    hf_class: "Gemma2ForCausalLM",
    configure,
};

fn configure(h: &Hparams<'_>, c: &mut ModelConfig) -> Result<(), ModelError> {
    gemma_block(h, c)?;
    let b = &mut c.block;
    // Absent: Gemma 2's published caps; 0: none.
    b.attn_softcap = Some(h.opt_f("attn_logit_softcapping")?.unwrap_or(50.0)).filter(|&c| c > 0.0);
    b.final_softcap = Some(h.opt_f("final_logit_softcapping")?.unwrap_or(30.0)).filter(|&c| c > 0.0);
    b.sliding_window = Some(h.opt_u("attention.sliding_window")?.unwrap_or(4096));
    b.swa_layers = h.swa_pattern(c.n_layers, 2)?;
    b.swa_rope_theta = Some(h.opt_f("rope.freq_base_swa")?.unwrap_or(c.rope_theta));
    Ok(())
}

/// What Gemma 2 and 3 share: RoPE on halves, √d embeddings, post-norms, GeGLU, and the
/// query scale (`attention.scale`, else llama.cpp's rule: 1/√head_dim, but 1/√(d/heads)
/// for the 27B models).
pub(super) fn gemma_block(h: &Hparams<'_>, c: &mut ModelConfig) -> Result<(), ModelError> {
    c.rope_layout = RopeLayout::Halves;
    let is_27b = match c.arch {
        Arch::Gemma3 => c.n_layers == 62,
        _ => c.n_layers == 46,
    };
    let b = &mut c.block;
    b.embed_scale = Some((c.d_model as f32).sqrt());
    b.post_norms = true;
    b.activation = Activation::GeluTanh;
    b.attn_scale = match h.opt_f("attention.scale")? {
        Some(s) => s,
        None if is_27b => 1.0 / ((c.d_model / c.n_heads) as f32).sqrt(),
        None => 1.0 / (c.head_dim as f32).sqrt(),
    };
    Ok(())
}

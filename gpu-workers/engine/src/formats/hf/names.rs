//! Tensor names between the two conventions: a Hugging Face checkpoint's per layer and per
//! expert, and GGUF's (both ways; shared by opening and exporting).

use crate::models::Arch;

/// A layer's tensors: (Hugging Face name after `model.layers.N.`, GGUF name after `blk.N.`).
/// Gemma's four norms sit where Llama's two do, under the same Hugging Face names.
fn layer_names(arch: Arch) -> Vec<(&'static str, &'static str)> {
    let gemma = matches!(arch, Arch::Gemma2 | Arch::Gemma3);
    let mut t = vec![
        ("input_layernorm.weight", "attn_norm.weight"),
        ("self_attn.q_proj.weight", "attn_q.weight"),
        ("self_attn.k_proj.weight", "attn_k.weight"),
        ("self_attn.v_proj.weight", "attn_v.weight"),
        ("self_attn.q_proj.bias", "attn_q.bias"),
        ("self_attn.k_proj.bias", "attn_k.bias"),
        ("self_attn.v_proj.bias", "attn_v.bias"),
        ("self_attn.qkv_proj.weight", "attn_qkv.weight"),
        ("self_attn.o_proj.weight", "attn_output.weight"),
        ("self_attn.q_norm.weight", "attn_q_norm.weight"),
        ("self_attn.k_norm.weight", "attn_k_norm.weight"),
        ("mlp.gate_proj.weight", "ffn_gate.weight"),
        ("mlp.up_proj.weight", "ffn_up.weight"),
        ("mlp.gate_up_proj.weight", "ffn_up.weight"),
        ("mlp.down_proj.weight", "ffn_down.weight"),
    ];
    // Mixtures of experts: the router, DeepSeek's selection bias and shared experts (the
    // routed experts are per-expert tensors: [`expert_name`]).
    t.push(if arch == Arch::Mixtral {
        ("block_sparse_moe.gate.weight", "ffn_gate_inp.weight")
    } else {
        ("mlp.gate.weight", "ffn_gate_inp.weight")
    });
    t.extend([
        ("mlp.gate.e_score_correction_bias", "exp_probs_b.bias"),
        ("mlp.shared_experts.gate_proj.weight", "ffn_gate_shexp.weight"),
        ("mlp.shared_experts.up_proj.weight", "ffn_up_shexp.weight"),
        ("mlp.shared_experts.down_proj.weight", "ffn_down_shexp.weight"),
        // Latent attention (`kv_b_proj` is split per head at open: [`split_latent_kv`]).
        ("self_attn.q_a_proj.weight", "attn_q_a.weight"),
        ("self_attn.q_a_layernorm.weight", "attn_q_a_norm.weight"),
        ("self_attn.q_b_proj.weight", "attn_q_b.weight"),
        ("self_attn.kv_a_proj_with_mqa.weight", "attn_kv_a_mqa.weight"),
        ("self_attn.kv_a_layernorm.weight", "attn_kv_a_norm.weight"),
        ("self_attn.kv_b_proj.weight", "attn_kv_b.weight"),
    ]);
    if gemma {
        t.extend([
            ("post_attention_layernorm.weight", "post_attention_norm.weight"),
            ("pre_feedforward_layernorm.weight", "ffn_norm.weight"),
            ("post_feedforward_layernorm.weight", "post_ffw_norm.weight"),
        ]);
    } else {
        t.push(("post_attention_layernorm.weight", "ffn_norm.weight"));
    }
    t
}

/// Hugging Face tensor name → GGUF tensor name.
pub(crate) fn gguf_name(hf: &str, arch: Arch) -> Option<String> {
    match hf {
        "model.embed_tokens.weight" => return Some("token_embd.weight".into()),
        "model.norm.weight" => return Some("output_norm.weight".into()),
        "lm_head.weight" => return Some("output.weight".into()),
        _ => {}
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, part) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    if let Some(expert) = part
        .strip_prefix("mlp.experts.")
        .or_else(|| part.strip_prefix("block_sparse_moe.experts."))
    {
        let (e, m) = expert.split_once('.')?;
        let e: usize = e.parse().ok()?;
        let (_, _, g) = EXPERT_NAMES
            .iter()
            .find(|(h, h_mixtral, _)| *h == m || *h_mixtral == m)?;
        return Some(format!("blk.{layer}.{g}.{e}.weight"));
    }
    let (_, g) = layer_names(arch).into_iter().find(|(h, _)| *h == part)?;
    Some(format!("blk.{layer}.{g}"))
}

/// A routed expert's matrices: (Hugging Face name after `mlp.experts.E.`, Mixtral's after
/// `block_sparse_moe.experts.E.`, the GGUF 3-D tensor's stem). A Hugging Face directory's
/// experts are presented as `blk.N.{stem}.E.weight`, which the model code reads as the
/// slices of one stacked tensor.
pub(super) const EXPERT_NAMES: [(&str, &str, &str); 3] = [
    ("gate_proj.weight", "w1.weight", "ffn_gate_exps"),
    ("up_proj.weight", "w3.weight", "ffn_up_exps"),
    ("down_proj.weight", "w2.weight", "ffn_down_exps"),
];

/// Expert `e` of layer `layer`'s `stem` tensor (`ffn_gate_exps`, …) under its Hugging Face name.
pub(super) fn expert_name(arch: Arch, layer: &str, stem: &str, e: usize) -> Option<String> {
    let (h, h_mixtral, _) = EXPERT_NAMES.iter().find(|(_, _, g)| *g == stem)?;
    Some(if arch == Arch::Mixtral {
        format!("model.layers.{layer}.block_sparse_moe.experts.{e}.{h_mixtral}")
    } else {
        format!("model.layers.{layer}.mlp.experts.{e}.{h}")
    })
}

/// GGUF tensor name → Hugging Face tensor name (the inverse of [`gguf_name`]; a fused
/// `ffn_up` of twice the width is Phi-3's `gate_up_proj`).
pub(super) fn hf_name(gguf: &str, arch: Arch, fused_up: bool) -> Option<String> {
    match gguf {
        "token_embd.weight" => return Some("model.embed_tokens.weight".into()),
        "output_norm.weight" => return Some("model.norm.weight".into()),
        "output.weight" => return Some("lm_head.weight".into()),
        _ => {}
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, part) = rest.split_once('.')?;
    let (h, _) = layer_names(arch)
        .into_iter()
        .filter(|(h, _)| fused_up == (*h == "mlp.gate_up_proj.weight") || part != "ffn_up.weight")
        .find(|(_, g)| *g == part)?;
    Some(format!("model.layers.{layer}.{h}"))
}

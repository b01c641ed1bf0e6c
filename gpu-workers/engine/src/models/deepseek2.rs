//! DeepSeek-V2/V3, Kimi K2 (`deepseek2`): multi-head latent attention and a
//! mixture-of-experts MLP after the first dense layers.
//!
//! * **Attention** ([`super::mla`]): queries through an optional low-rank bottleneck
//!   (`q_lora_rank`; the Lite models project directly); keys and values decompressed per
//!   head from one normalized latent vector of `kv_lora_rank` per position plus one RoPE
//!   key of `qk_rope` dims shared by every head — which is all the KV cache stores. RoPE on
//!   adjacent pairs of the RoPE dims only. YaRN rotates at magnitude 1 and corrects the
//!   score scale instead: `(1 + 0.1 · mscale_all_dim · ln factor)² / √(qk_nope + qk_rope)`
//!   (`rope.scaling.yarn_log_multiplier` stores `0.1 · mscale_all_dim`).
//! * **MLP** ([`super::moe`]): dense for `leading_dense_block_count` layers, then routed
//!   experts — softmax (V2) or sigmoid with a per-expert selection bias (V3, K2), top-k
//!   within the best expert groups, weights optionally renormalized and scaled by the
//!   routed scaling factor — plus shared experts every token runs.
//!
//! Files as llama.cpp's converter writes them now (`attn_k_b`/`attn_v_b` split per head,
//! `key_length_mla`); older files with one `attn_kv_b` are refused with what to do.

use super::{Family, Hparams, MlaSpec, ModelConfig, ModelError, MoeSpec};

pub const FAMILY: Family = Family {
    gguf: Some("deepseek2"),
    hf_model_types: &["deepseek_v3", "deepseek_v2", "kimi_k2"],
    hf_class: "DeepseekV3ForCausalLM",
    configure,
};

fn configure(h: &Hparams<'_>, c: &mut ModelConfig) -> Result<(), ModelError> {
    let bad = |m: String| Err(ModelError::Config(m));
    let (Some(k_mla), Some(v_mla)) = (
        h.opt_u("attention.key_length_mla")?,
        h.opt_u("attention.value_length_mla")?,
    ) else {
        return bad(
            "a deepseek2 file without attention.key_length_mla (converted before llama.cpp split attn_kv_b); convert it again with a current convert_hf_to_gguf.py".into(),
        );
    };
    let kv_lora_rank = h.u("attention.kv_lora_rank")?;
    let qk_rope = c.rope_dims;
    let spec = MlaSpec {
        q_lora_rank: h.opt_u("attention.q_lora_rank")?.unwrap_or(0),
        kv_lora_rank,
        qk_nope: k_mla.saturating_sub(qk_rope),
        qk_rope,
        v_head: v_mla,
        yarn_log_mul: h.opt_f("rope.scaling.yarn_log_multiplier")?.unwrap_or(0.0) / 0.1,
    };
    // The file's key/value lengths are the latent's (what the cache holds).
    if c.head_dim != spec.latent_dim() || c.n_kv_heads != 1 {
        return bad(format!(
            "latent attention with key length {} and {} KV heads (expected {} and 1)",
            c.head_dim,
            c.n_kv_heads,
            spec.latent_dim()
        ));
    }
    if spec.qk_nope == 0 || qk_rope == 0 || kv_lora_rank == 0 || kv_lora_rank > 1 << 14 || v_mla == 0 || v_mla > 1 << 10
    {
        return bad(format!("latent attention dims {spec:?} out of range"));
    }
    // Every head's query and key: `qk_nope + qk_rope` wide (what the score scale divides
    // by); one KV "head", the latent every head reads.
    c.head_dim = k_mla;
    c.mla = Some(spec);
    c.block.attn_scale = c.mla_score_scale();
    // Without experts (a dense model in this architecture) every layer is dense.
    c.moe = MoeSpec::read(h, c.n_layers, c.n_ff)?;
    Ok(())
}

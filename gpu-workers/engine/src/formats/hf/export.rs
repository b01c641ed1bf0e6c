//! Writing a Hugging Face directory from a GGUF model ([`export`]): tensors dequantized, Q/K
//! rows un-permuted, experts unstacked, `attn_k_b`/`attn_v_b` joined into `kv_b_proj`,
//! and a `config.json` the model's configuration reads back from.

use std::path::Path;

use safetensors::Dtype;
use serde_json::{json, Value};

use crate::formats::gguf::{GgufFile, TensorInfo};
use crate::formats::hf::error::{io_err, HfError};
use crate::formats::hf::names::{expert_name, hf_name};
use crate::kernels::dequantize_row;
use crate::models::{Arch, Gating, ModelConfig, RopeLayout, RopeScalingKind};

/// Element type of an exported directory's matrices (norms are always F32).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExportDtype {
    F32,
    F16,
    BF16,
}

impl ExportDtype {
    pub fn parse(s: &str) -> Option<Self> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "float32" => Some(Self::F32),
            "f16" | "float16" => Some(Self::F16),
            "bf16" | "bfloat16" => Some(Self::BF16),
            _ => None,
        }
    }

    fn dtype(self) -> Dtype {
        match self {
            Self::F32 => Dtype::F32,
            Self::F16 => Dtype::F16,
            Self::BF16 => Dtype::BF16,
        }
    }

    fn torch_name(self) -> &'static str {
        match self {
            Self::F32 => "float32",
            Self::F16 => "float16",
            Self::BF16 => "bfloat16",
        }
    }

    fn encode(self, v: &[f32]) -> Vec<u8> {
        match self {
            Self::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Self::F16 => v.iter().flat_map(|x| half::f16::from_f32(*x).to_le_bytes()).collect(),
            Self::BF16 => v.iter().flat_map(|x| half::bf16::from_f32(*x).to_le_bytes()).collect(),
        }
    }
}

/// A tensor of a GGUF model dequantized, as Hugging Face stores it: a `llama` file's Q/K
/// rows are permuted so that RoPE pairs are adjacent, and this undoes it (row `h·d + 2i + s`
/// of a head returns to `h·d + s·d/2 + i`); Gemma's norms lose the 1 GGUF adds.
fn hf_tensor(g: &GgufFile, t: &TensorInfo, c: &ModelConfig) -> Result<Vec<f32>, HfError> {
    let cols = t.dims.first().copied().unwrap_or(1) as usize;
    let rows = (t.n_elements() as usize) / cols.max(1);
    let (per_block, block_bytes) =
        t.ty.block_layout()
            .ok_or_else(|| HfError::Unsupported(format!("tensor {} has type {:?}", t.name, t.ty)))?;
    let row_bytes = cols / per_block * block_bytes;
    let data = g.tensor_data(t);
    let mut out = vec![0f32; rows * cols];
    for (r, o) in out.chunks_exact_mut(cols).enumerate() {
        dequantize_row(t.ty, &data[r * row_bytes..(r + 1) * row_bytes], o);
    }
    if matches!(c.arch, Arch::Gemma2 | Arch::Gemma3) && t.name.ends_with("norm.weight") {
        out.iter_mut().for_each(|v| *v -= 1.0 - c.norm_shift);
    }
    if c.mla.is_some() {
        return Ok(out); // DeepSeek's checkpoints keep RoPE's adjacent pairs, as GGUF does
    }
    let heads = if t.name.ends_with("attn_q.weight") || t.name.ends_with("attn_q.bias") {
        c.n_heads
    } else if t.name.ends_with("attn_k.weight") || t.name.ends_with("attn_k.bias") {
        c.n_kv_heads
    } else {
        return Ok(out);
    };
    if c.rope_dims != c.head_dim {
        return Err(HfError::Unsupported(
            "partial rotary dimensions cannot be exported".into(),
        ));
    }
    if c.rope_layout != RopeLayout::Adjacent {
        return Ok(out); // already rotating halves
    }
    // A bias is one column of `rows` values.
    let cols = if t.dims.len() == 1 { 1 } else { cols };
    let (hd, half) = (c.head_dim, c.head_dim / 2);
    let mut hf = vec![0f32; out.len()];
    for h in 0..heads {
        for i in 0..half {
            for s in 0..2 {
                let from = (h * hd + 2 * i + s) * cols;
                let to = (h * hd + s * half + i) * cols;
                hf[to..to + cols].copy_from_slice(&out[from..from + cols]);
            }
        }
    }
    Ok(hf)
}

/// The Hugging Face tensors a GGUF tensor holds several of: stacked experts (one per
/// expert; a fused gate-up stack as gate and up), and latent attention's per-head `attn_k_b`
/// (transposed back) with `attn_v_b`, as one `kv_b_proj`. None: the tensor is one Hugging
/// Face tensor; an empty list: it went out with another (`attn_v_b` with `attn_k_b`).
#[allow(clippy::type_complexity)]
fn hf_split(
    g: &GgufFile,
    t: &TensorInfo,
    c: &ModelConfig,
) -> Result<Option<Vec<(String, Vec<usize>, Vec<f32>)>>, HfError> {
    let Some((layer, part)) = t.name.strip_prefix("blk.").and_then(|r| r.split_once('.')) else {
        return Ok(None);
    };
    let stem = part.trim_end_matches(".weight");
    let n = t.dims.get(2).copied().unwrap_or(1) as usize;
    match stem {
        "ffn_gate_exps" | "ffn_up_exps" | "ffn_down_exps" | "ffn_gate_up_exps" => {
            let v = hf_tensor(g, t, c)?;
            let (cols, rows) = (t.dims[0] as usize, t.dims[1] as usize);
            let mut out = Vec::new();
            for (e, m) in v.chunks_exact(rows * cols).enumerate() {
                let parts: Vec<(&str, &[f32])> = if stem == "ffn_gate_up_exps" {
                    let (gate, up) = m.split_at(rows / 2 * cols);
                    vec![("ffn_gate_exps", gate), ("ffn_up_exps", up)]
                } else {
                    vec![(stem, m)]
                };
                for (s, m) in parts {
                    let name = expert_name(c.arch, layer, s, e).expect("an expert tensor");
                    out.push((name, vec![m.len() / cols, cols], m.to_vec()));
                }
            }
            Ok(Some(out))
        }
        "attn_v_b" => Ok(Some(Vec::new())),
        "attn_k_b" => {
            let (Some(m), Some(vt)) = (c.mla, g.tensor(&format!("blk.{layer}.attn_v_b.weight"))) else {
                return Err(HfError::Unsupported(format!(
                    "{} without latent attention's attn_v_b",
                    t.name
                )));
            };
            let (k, v) = (hf_tensor(g, t, c)?, hf_tensor(g, vt, c)?);
            let (r, nope, vh) = (m.kv_lora_rank, m.qk_nope, m.v_head);
            if k.len() != n * r * nope || v.len() != n * vh * r {
                return Err(HfError::Unsupported(format!(
                    "{}: latent attention shapes disagree",
                    t.name
                )));
            }
            let mut kv = Vec::with_capacity(n * (nope + vh) * r);
            for h in 0..n {
                let kh = &k[h * r * nope..(h + 1) * r * nope];
                for i in 0..nope {
                    kv.extend((0..r).map(|j| kh[j * nope + i]));
                }
                kv.extend_from_slice(&v[h * vh * r..(h + 1) * vh * r]);
            }
            let name = format!("model.layers.{layer}.self_attn.kv_b_proj.weight");
            Ok(Some(vec![(name, vec![n * (nope + vh), r], kv)]))
        }
        _ => Ok(None),
    }
}

/// Llama 3's `rope_scaling` recovered from a `rope_freqs` tensor (llama.cpp's converter
/// keeps only the per-frequency divisors): the factor is the largest divisor, and the ramp
/// between kept and divided frequencies fixes `original / low` and `original / high`
/// (only those ratios matter, so `original` is the file's context). Checked by
/// recomputing every divisor.
fn llama3_scaling(factors: &[f32], c: &ModelConfig) -> Result<Value, HfError> {
    if factors.len() != c.rope_dims / 2 || factors.is_empty() {
        return Err(HfError::Unsupported(format!(
            "rope_freqs has {} values for {} rotated pairs",
            factors.len(),
            c.rope_dims / 2
        )));
    }
    let factor = factors.iter().copied().fold(1.0f32, f32::max) as f64;
    let n = factors.len();
    let freq = |i: usize| (c.rope_theta as f64).powf(-((2 * i) as f64) / c.rope_dims as f64);
    // On the ramp, 1/f = (1 − s)/factor + s with s linear in the frequency.
    let smooth = |f: f64| (1.0 / f - 1.0 / factor) / (1.0 - 1.0 / factor);
    let ramp: Vec<(f64, f64)> = (0..n)
        .filter(|&i| factors[i] as f64 > 1.0 + 1e-6 && (factors[i] as f64) < factor - 1e-6)
        .map(|i| (freq(i), smooth(factors[i] as f64)))
        .collect();
    let orig = c.context_length as f64;
    let two_pi = 2.0 * std::f64::consts::PI;
    // smooth = (orig·f/2π − low)/(high − low): two ramp points give the line; else any
    // boundary between the last kept and the first divided frequency.
    let (low, high) = match ramp.as_slice() {
        [(f0, s0), .., (f1, s1)] => {
            let slope = (s1 - s0) / (f1 - f0);
            let high_minus_low = orig / two_pi / slope;
            let low = orig * f0 / two_pi - s0 * high_minus_low;
            (low, low + high_minus_low)
        }
        _ => {
            let kept = (0..n).take_while(|&i| factors[i] <= 1.0 + 1e-6).last().unwrap_or(0);
            let edge = (freq(kept) + freq((kept + 1).min(n - 1))) / 2.0 * orig / two_pi;
            (edge * 0.999, edge * 1.001)
        }
    };
    let scaling = crate::models::RopeScaling {
        kind: RopeScalingKind::Llama3,
        factor: factor as f32,
        original_context: c.context_length,
        low_freq_factor: low as f32,
        high_freq_factor: high as f32,
        ..Default::default()
    };
    let plain =
        crate::models::rope::RopeFreqs::new(c.rope_theta, c.rope_dims, &Default::default(), None, orig as usize);
    let scaled = crate::models::rope::RopeFreqs::new(c.rope_theta, c.rope_dims, &scaling, None, orig as usize);
    for (i, (p, s)) in plain.inv_freq.iter().zip(&scaled.inv_freq).enumerate() {
        if ((p / s) - factors[i]).abs() > 1e-3 * factors[i] {
            return Err(HfError::Unsupported(format!(
                "rope_freqs is not a Llama 3 scaling (divisor {i}: {} vs {})",
                factors[i],
                p / s
            )));
        }
    }
    Ok(json!({
        "rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
        "original_max_position_embeddings": c.context_length,
    }))
}

/// `config.json` for a GGUF model's configuration, in its family's terms.
fn hf_config(
    g: &GgufFile,
    c: &ModelConfig,
    dtype: ExportDtype,
    rope_scaling: Value,
    spec: &hearth_protocol::TokenizerSpec,
) -> Value {
    let b = &c.block;
    let family = c.arch.family();
    let (mut class, mut model_type) = (family.hf_class, family.hf_model_types[0]);
    let softmax_deepseek = c.arch == Arch::Deepseek2 && c.moe.as_ref().is_some_and(|m| m.gating == Gating::Softmax);
    if softmax_deepseek {
        (class, model_type) = ("DeepseekV2ForCausalLM", "deepseek_v2");
    }
    let gemma = matches!(c.arch, Arch::Gemma2 | Arch::Gemma3);
    let s = &c.rope_scaling;
    let rope_scaling = match (&rope_scaling, s.kind) {
        (Value::Null, RopeScalingKind::Linear) => json!({"rope_type": "linear", "factor": s.factor}),
        (Value::Null, RopeScalingKind::Yarn) => {
            let mut y = json!({
                "rope_type": "yarn", "factor": shortest(s.factor),
                "original_max_position_embeddings": s.original_context,
                "beta_fast": shortest(s.beta_fast), "beta_slow": shortest(s.beta_slow),
            });
            let o = y.as_object_mut().expect("an object");
            if let Some(m) = c.mla {
                // DeepSeek states the score correction as `mscale_all_dim` (and rotates at 1);
                // its own code reads `type`.
                o.insert("type".into(), json!("yarn"));
                o.insert("mscale".into(), json!(shortest(m.yarn_log_mul)));
                o.insert("mscale_all_dim".into(), json!(shortest(m.yarn_log_mul)));
            } else if s.attn_factor != 1.0 {
                let yarn_magnitude = 0.1 * s.factor.ln() + 1.0;
                o.insert(
                    "attention_factor".into(),
                    json!(shortest(s.attn_factor * yarn_magnitude)),
                );
            }
            y
        }
        _ => rope_scaling,
    };
    let mut v = json!({
        "architectures": [class],
        "model_type": model_type,
        "hidden_size": c.d_model,
        "intermediate_size": c.n_ff,
        "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads,
        "head_dim": c.head_dim,
        "num_hidden_layers": c.n_layers,
        "rms_norm_eps": shortest(c.rms_eps),
        "rope_theta": shortest(c.rope_theta),
        "rope_scaling": rope_scaling,
        "max_position_embeddings": c.context_length,
        "vocab_size": c.vocab_size,
        "hidden_act": if gemma { "gelu_pytorch_tanh" } else { "silu" },
        "tie_word_embeddings": g.tensor("output.weight").is_none(),
        "bos_token_id": spec.bos_id,
        "eos_token_id": spec.eos_id,
        "torch_dtype": dtype.torch_name(),
    });
    let o = v.as_object_mut().expect("an object");
    if c.arch == Arch::Llama {
        o.insert("attention_bias".into(), json!(false));
    }
    if let Some(m) = &c.moe {
        match c.arch {
            Arch::Mixtral => {
                o.insert("num_local_experts".into(), json!(m.experts));
                o.insert("intermediate_size".into(), json!(m.ff_expert));
            }
            Arch::Qwen3Moe => {
                o.insert("num_experts".into(), json!(m.experts));
                o.insert("moe_intermediate_size".into(), json!(m.ff_expert));
                o.insert("norm_topk_prob".into(), json!(true));
                o.insert("decoder_sparse_step".into(), json!(1));
                o.insert("mlp_only_layers".into(), json!([]));
            }
            _ => {
                o.insert("n_routed_experts".into(), json!(m.experts));
                o.insert("n_shared_experts".into(), json!(m.shared));
                o.insert("moe_intermediate_size".into(), json!(m.ff_expert));
                o.insert("first_k_dense_replace".into(), json!(m.leading_dense));
                o.insert("routed_scaling_factor".into(), json!(shortest(m.weights_scale)));
                o.insert("norm_topk_prob".into(), json!(m.norm_weights));
                o.insert("moe_layer_freq".into(), json!(1));
                let sigmoid = m.gating == Gating::Sigmoid;
                o.insert(
                    "scoring_func".into(),
                    json!(if sigmoid { "sigmoid" } else { "softmax" }),
                );
                o.insert("topk_method".into(), json!(if sigmoid { "noaux_tc" } else { "greedy" }));
                o.insert("n_group".into(), json!(m.groups.max(1)));
                o.insert("topk_group".into(), json!(m.groups_used.max(1)));
            }
        }
        o.insert("num_experts_per_tok".into(), json!(m.used));
    }
    if let Some(m) = c.mla {
        o.insert(
            "q_lora_rank".into(),
            if m.q_lora_rank == 0 {
                Value::Null
            } else {
                json!(m.q_lora_rank)
            },
        );
        o.insert("kv_lora_rank".into(), json!(m.kv_lora_rank));
        o.insert("qk_nope_head_dim".into(), json!(m.qk_nope));
        o.insert("qk_rope_head_dim".into(), json!(m.qk_rope));
        o.insert("v_head_dim".into(), json!(m.v_head));
        o.insert("num_key_value_heads".into(), json!(c.n_heads));
        o.insert("head_dim".into(), json!(m.qk_rope));
        o.insert("attention_bias".into(), json!(false));
    }
    o.insert("sliding_window".into(), json!(b.sliding_window));
    if gemma {
        o.insert("hidden_activation".into(), json!("gelu_pytorch_tanh"));
        o.insert("query_pre_attn_scalar".into(), json!(shortest(b.attn_scale.powi(-2))));
        o.insert("attn_logit_softcapping".into(), json!(b.attn_softcap.map(shortest)));
        o.insert("final_logit_softcapping".into(), json!(b.final_softcap.map(shortest)));
        let types: Vec<&str> = (0..c.n_layers)
            .map(|l| {
                if c.window(l).is_some() {
                    "sliding_attention"
                } else {
                    "full_attention"
                }
            })
            .collect();
        o.insert("layer_types".into(), json!(types));
        if let Some(t) = b.swa_rope_theta {
            o.insert("rope_local_base_freq".into(), json!(shortest(t)));
        }
    }
    v
}

/// An f32 as the f64 its shortest decimal form names (1e-5, not 9.999999747378752e-6).
pub(super) fn shortest(v: f32) -> f64 {
    v.to_string().parse().unwrap_or(v as f64)
}

/// Writes a Hugging Face directory (config, tokenizer, safetensors in `shards` files) from a
/// GGUF model of any family. Returns the total bytes of weights written.
pub fn export(g: &GgufFile, out: &Path, dtype: ExportDtype, shards: usize) -> Result<u64, HfError> {
    let c = ModelConfig::from_gguf(g)?;
    let unsupported = |m: String| Err(HfError::Unsupported(m));
    if c.arch.family().hf_model_types.is_empty() {
        return unsupported(format!("{} models have no Hugging Face form Hearth writes", c.arch));
    }
    if let Some(m) = &c.moe {
        if c.arch == Arch::Deepseek2 && m.gating == Gating::Softmax && m.groups > 1 {
            return unsupported(
                "a softmax-scored deepseek2 model with expert groups (a group scores its best two, which no Hugging Face DeepSeek config states)".into(),
            );
        }
    }
    std::fs::create_dir_all(out).map_err(io_err(out))?;
    let spec = crate::formats::gguf::tokenizer_spec(g)?;
    // Weights, dequantized, in the order of the GGUF file.
    let mut items: Vec<(String, Vec<usize>, Dtype, Vec<u8>)> = Vec::new();
    let mut rope_scaling = Value::Null;
    for t in &g.tensors {
        if t.name == "rope_freqs.weight" {
            rope_scaling = llama3_scaling(&hf_tensor(g, t, &c)?, &c)?;
            continue;
        }
        if let Some(expanded) = hf_split(g, t, &c)? {
            for (name, shape, v) in expanded {
                items.push((name, shape, dtype.dtype(), dtype.encode(&v)));
            }
            continue;
        }
        let fused_up = t.name.ends_with("ffn_up.weight") && t.dims.get(1) == Some(&(2 * c.n_ff as u64));
        let Some(name) = hf_name(&t.name, c.arch, fused_up) else {
            return Err(HfError::Unsupported(format!(
                "tensor {} has no Hugging Face name in a {} model",
                t.name, c.arch
            )));
        };
        let v = hf_tensor(g, t, &c)?;
        let shape: Vec<usize> = t.dims.iter().rev().map(|&d| d as usize).collect();
        let dt = if shape.len() == 1 { ExportDtype::F32 } else { dtype };
        items.push((name, shape, dt.dtype(), dt.encode(&v)));
    }
    let total: u64 = items.iter().map(|i| i.3.len() as u64).sum();
    let shards = shards.clamp(1, items.len().max(1));
    let per_shard = total.div_ceil(shards as u64);
    let mut groups: Vec<Vec<usize>> = vec![Vec::new()];
    let mut filled = 0u64;
    for (i, it) in items.iter().enumerate() {
        if filled >= per_shard && groups.len() < shards {
            groups.push(Vec::new());
            filled = 0;
        }
        groups.last_mut().expect("one group").push(i);
        filled += it.3.len() as u64;
    }
    let n = groups.len();
    let mut weight_map = serde_json::Map::new();
    for (k, group) in groups.iter().enumerate() {
        let file = if n == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{n:05}.safetensors", k + 1)
        };
        let views = group
            .iter()
            .map(|&i| {
                let (name, shape, dt, bytes) = &items[i];
                weight_map.insert(name.clone(), json!(file));
                safetensors::tensor::TensorView::new(*dt, shape.clone(), bytes)
                    .map(|v| (name.clone(), v))
                    .map_err(|e| HfError::Unsupported(format!("tensor {name}: {e}")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let path = out.join(&file);
        safetensors::serialize_to_file(views, None, &path).map_err(|e| HfError::Safetensors {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
    }
    let write = |name: &str, v: &Value| {
        let path = out.join(name);
        std::fs::write(&path, serde_json::to_vec_pretty(v).expect("JSON")).map_err(io_err(&path))
    };
    if n > 1 {
        write(
            "model.safetensors.index.json",
            &json!({"metadata": {"total_size": total}, "weight_map": weight_map}),
        )?;
    }
    write("config.json", &hf_config(g, &c, dtype, rope_scaling, &spec))?;
    let tokenizer = hearth_protocol::tokenizer::hf_tokenizer_json(&spec)
        .map_err(|e| HfError::Unsupported(format!("tokenizer.json: {e}")))?;
    write("tokenizer.json", &tokenizer)?;
    let name_of = |id: Option<u32>| id.and_then(|i| spec.tokens.get(i as usize).cloned());
    write(
        "tokenizer_config.json",
        &json!({
            "bos_token": name_of(spec.bos_id),
            "eos_token": name_of(spec.eos_id),
            "add_bos_token": spec.add_bos,
            "chat_template": spec.chat_template,
            "model_max_length": c.context_length,
        }),
    )?;
    Ok(total)
}

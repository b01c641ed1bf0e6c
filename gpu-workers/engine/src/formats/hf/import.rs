//! Opening a Hugging Face directory's weights and configuration: the safetensors shards
//! mapped as GGUF tensors, `config.json` as GGUF metadata (RoPE scaling included), and
//! latent attention's `kv_b_proj` split per head as llama.cpp's converter splits it.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

use crate::formats::gguf::{GgmlType, MetaValue, TensorInfo};
use crate::formats::hf::error::{invalid, io_err, read_json, HfError};
use crate::formats::hf::names::gguf_name;
use crate::models::{Arch, NORM_SHIFT_KEY, ROPE_LAYOUT_KEY};

/// Tensor name → shard file, from `model.safetensors.index.json`.
type WeightMap = HashMap<String, String>;

/// The safetensors files of a directory: the index's shards, or `model.safetensors`, or
/// every `*.safetensors` file (sorted).
pub(super) fn shard_files(dir: &Path) -> Result<(Vec<PathBuf>, Option<WeightMap>), HfError> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let v = read_json(&index)?;
        let map = v
            .get("weight_map")
            .and_then(Value::as_object)
            .ok_or_else(|| invalid(&index, "no weight_map object"))?;
        let mut weight_map = HashMap::new();
        let mut files: Vec<String> = Vec::new();
        for (name, file) in map {
            let file = file
                .as_str()
                .ok_or_else(|| invalid(&index, format!("weight_map[{name:?}] is not a file name")))?;
            if file.contains('/') || file.contains("..") {
                return Err(invalid(&index, format!("shard {file:?} is outside the directory")));
            }
            if !files.iter().any(|f| f == file) {
                files.push(file.to_string());
            }
            weight_map.insert(name.clone(), file.to_string());
        }
        files.sort();
        return Ok((files.iter().map(|f| dir.join(f)).collect(), Some(weight_map)));
    }
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok((vec![single], None));
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(io_err(dir))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(invalid(dir, "no *.safetensors weights in the directory"));
    }
    Ok((files, None))
}

pub(crate) fn ggml_type(d: Dtype) -> Option<GgmlType> {
    match d {
        Dtype::F32 => Some(GgmlType::F32),
        Dtype::F16 => Some(GgmlType::F16),
        Dtype::BF16 => Some(GgmlType::BF16),
        _ => None,
    }
}

/// Maps every shard and lists its tensors under GGUF names (dims reversed to GGUF order),
/// leaving out layers from `skip_from` on.
pub(super) fn open_weights(
    dir: &Path,
    arch: Arch,
    skip_from: Option<usize>,
) -> Result<(Vec<Mmap>, Vec<TensorInfo>), HfError> {
    let skipped = |name: &str| {
        name.ends_with("rotary_emb.inv_freq") // recomputed from rope_theta
            || skip_from.is_some_and(|from| {
                name.strip_prefix("model.layers.")
                    .and_then(|r| r.split_once('.'))
                    .and_then(|(l, _)| l.parse::<usize>().ok())
                    .is_some_and(|l| l >= from)
            })
    };
    let (files, weight_map) = shard_files(dir)?;
    let mut maps = Vec::with_capacity(files.len());
    let mut tensors = Vec::new();
    let mut seen = HashSet::new();
    for (shard, path) in files.iter().enumerate() {
        let file = File::open(path).map_err(io_err(path))?;
        // SAFETY: read-only map of a model file that is not modified while served (as for
        // GGUF); `SafeTensors::deserialize` bounds-checks every tensor against it.
        let map = unsafe { Mmap::map(&file) }.map_err(io_err(path))?;
        let st = SafeTensors::deserialize(&map).map_err(|e| HfError::Safetensors {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        let base = map.as_ptr() as usize;
        for (name, view) in st.tensors() {
            if skipped(&name) {
                continue;
            }
            let ty = ggml_type(view.dtype()).ok_or_else(|| {
                HfError::Unsupported(format!(
                    "{}: tensor {name} is {:?}; Hearth loads F32, F16 and BF16 safetensors",
                    path.display(),
                    view.dtype()
                ))
            })?;
            let Some(gname) = gguf_name(&name, arch) else {
                return Err(invalid(
                    path,
                    format!("tensor {name:?} is not part of a {arch} model Hearth can run"),
                ));
            };
            if let Some(wm) = &weight_map {
                let listed = wm.get(&name).map(|f| dir.join(f));
                if listed.as_deref() != Some(path.as_path()) {
                    return Err(invalid(path, format!("tensor {name} is not where the index says")));
                }
            }
            if !seen.insert(name.clone()) {
                return Err(invalid(path, format!("tensor {name} appears twice")));
            }
            let data = view.data();
            tensors.push(TensorInfo {
                name: gname,
                dims: view.shape().iter().rev().map(|&d| d as u64).collect(),
                ty,
                offset: data.as_ptr() as usize - base,
                len: data.len(),
                shard,
            });
        }
        maps.push(map);
    }
    if let Some(wm) = &weight_map {
        if let Some(missing) = wm.keys().find(|k| !seen.contains(*k) && !skipped(k)) {
            return Err(invalid(
                dir,
                format!("tensor {missing} is in the index but in no shard"),
            ));
        }
    }
    Ok((maps, tensors))
}

fn uint(cfg: &Value, path: &Path, key: &str) -> Result<u64, HfError> {
    cfg.get(key)
        .and_then(Value::as_u64)
        .ok_or_else(|| invalid(path, format!("{key} is missing or not a whole number")))
}

/// `config.json` → GGUF `{arch}.*` metadata, refusing what the families' forward pass does
/// not do. Returns the architecture, and the first layer whose tensors are not the model's
/// own (DeepSeek-V3's multi-token-prediction layers, which llama.cpp's converter drops too).
pub(super) fn config_metadata(
    dir: &Path,
    meta: &mut HashMap<String, MetaValue>,
) -> Result<(Arch, Option<usize>), HfError> {
    let path = dir.join("config.json");
    let cfg = read_json(&path)?;
    let model_type = cfg.get("model_type").and_then(Value::as_str).unwrap_or("");
    if cfg.get("text_config").is_some() {
        return Err(HfError::Unsupported(format!(
            "{}: a multimodal checkpoint (text_config): serve its language model as its own directory ({})",
            path.display(),
            Arch::hf_supported()
        )));
    }
    let arch = Arch::from_hf(model_type).ok_or_else(|| {
        HfError::Unsupported(format!(
            "{}: model_type {model_type:?} is not supported (Hearth serves {})",
            path.display(),
            Arch::hf_supported()
        ))
    })?;
    let unsupported = |what: &str| HfError::Unsupported(format!("{}: {what} is not supported", path.display()));
    if let Some(q) = cfg.get("quantization_config") {
        let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("unknown");
        return Err(unsupported(&format!(
            "a quantized checkpoint (quantization_config, {method}): convert it to BF16 or GGUF first"
        )));
    }
    let gemma = matches!(arch, Arch::Gemma2 | Arch::Gemma3);
    let act = cfg
        .get("hidden_activation")
        .or(cfg.get("hidden_act"))
        .and_then(Value::as_str);
    let want_act = if gemma { "gelu_pytorch_tanh" } else { "silu" };
    if let Some(act) = act.filter(|a| *a != want_act) {
        return Err(unsupported(&format!(
            "hidden_act {act:?} for {arch} (it uses {want_act})"
        )));
    }
    if cfg.get("mlp_bias").and_then(Value::as_bool) == Some(true) {
        return Err(unsupported("mlp_bias"));
    }
    if cfg
        .get("partial_rotary_factor")
        .and_then(Value::as_f64)
        .is_some_and(|f| f != 1.0)
    {
        return Err(unsupported("partial_rotary_factor"));
    }
    let d = uint(&cfg, &path, "hidden_size")?;
    let heads = uint(&cfg, &path, "num_attention_heads")?;
    let kv_heads = cfg.get("num_key_value_heads").and_then(Value::as_u64).unwrap_or(heads);
    let mla = arch == Arch::Deepseek2;
    let head_dim = match cfg.get("head_dim").and_then(Value::as_u64) {
        Some(hd) => hd,
        None if heads > 0 && d % heads == 0 => d / heads,
        None if mla => 0, // the latent's dims, set below
        None => {
            return Err(invalid(
                &path,
                format!("hidden_size {d} does not split into {heads} heads"),
            ))
        }
    };
    let f = |key: &str, default: f64| cfg.get(key).and_then(Value::as_f64).unwrap_or(default);
    let p = arch.gguf_name();
    let mut put = |k: &str, v: MetaValue| {
        meta.insert(format!("{p}.{k}"), v);
    };
    put("embedding_length", MetaValue::U64(d));
    put("attention.head_count", MetaValue::U64(heads));
    put("attention.head_count_kv", MetaValue::U64(kv_heads));
    put("attention.key_length", MetaValue::U64(head_dim));
    put("attention.value_length", MetaValue::U64(head_dim));
    put("block_count", MetaValue::U64(uint(&cfg, &path, "num_hidden_layers")?));
    put(
        "feed_forward_length",
        MetaValue::U64(uint(&cfg, &path, "intermediate_size")?),
    );
    put("vocab_size", MetaValue::U64(uint(&cfg, &path, "vocab_size")?));
    put(
        "context_length",
        MetaValue::U64(
            cfg.get("max_position_embeddings")
                .and_then(Value::as_u64)
                .unwrap_or(2048),
        ),
    );
    put("rope.freq_base", MetaValue::F64(f("rope_theta", 10000.0)));
    put(
        "attention.layer_norm_rms_epsilon",
        MetaValue::F64(f("rms_norm_eps", 1e-6)),
    );
    if let Some(r) = cfg.get("rope_scaling").filter(|v| !v.is_null()) {
        for (k, v) in rope_scaling_metadata(r).map_err(|e| unsupported(&format!("rope_scaling {r}: {e}")))? {
            put(&k, v);
        }
    }
    let window = cfg.get("sliding_window").and_then(Value::as_u64).filter(|&w| w > 0);
    match arch {
        Arch::Mistral => {
            if let Some(w) = window {
                put("attention.sliding_window", MetaValue::U64(w));
            }
        }
        Arch::Gemma2 | Arch::Gemma3 => {
            if let Some(s) = cfg.get("query_pre_attn_scalar").and_then(Value::as_f64) {
                put("attention.scale", MetaValue::F64(1.0 / s.sqrt()));
            }
            // A cap of null is no cap (written as 0, which the families read as none).
            for k in ["attn_logit_softcapping", "final_logit_softcapping"] {
                match cfg.get(k) {
                    Some(Value::Null) => put(k, MetaValue::F64(0.0)),
                    Some(v) => {
                        if let Some(v) = v.as_f64() {
                            put(k, MetaValue::F64(v));
                        }
                    }
                    None => {}
                }
            }
            if let Some(w) = window {
                put("attention.sliding_window", MetaValue::U64(w));
            }
            if let Some(b) = cfg.get("rope_local_base_freq").and_then(Value::as_f64) {
                put("rope.freq_base_swa", MetaValue::F64(b));
            }
            // Which layers are windowed: `layer_types` (current configs), else a period.
            if let Some(types) = cfg.get("layer_types").and_then(Value::as_array) {
                let flags = types
                    .iter()
                    .map(|t| MetaValue::Bool(t.as_str() == Some("sliding_attention")))
                    .collect();
                put("attention.sliding_window_pattern", MetaValue::Array(flags));
            } else if let Some(n) = cfg.get("sliding_window_pattern").and_then(Value::as_u64) {
                put("attention.sliding_window_pattern", MetaValue::U64(n));
            }
            // Gemma's norms multiply by `1 + w`: GGUF stores the sum, this view shifts.
            meta.insert(NORM_SHIFT_KEY.into(), MetaValue::F64(1.0));
        }
        Arch::Mixtral => {
            if let Some(w) = window {
                put("attention.sliding_window", MetaValue::U64(w));
            }
            put("expert_count", MetaValue::U64(uint(&cfg, &path, "num_local_experts")?));
            put(
                "expert_used_count",
                MetaValue::U64(uint(&cfg, &path, "num_experts_per_tok")?),
            );
        }
        Arch::Qwen3Moe => {
            // The families renormalize the chosen experts' weights, as llama.cpp does.
            // (transformers' default when it is absent is false.)
            if cfg.get("norm_topk_prob").and_then(Value::as_bool) != Some(true) {
                return Err(unsupported(
                    "norm_topk_prob other than true (the chosen experts' weights are renormalized)",
                ));
            }
            if cfg
                .get("decoder_sparse_step")
                .and_then(Value::as_u64)
                .is_some_and(|s| s != 1)
                || cfg
                    .get("mlp_only_layers")
                    .and_then(Value::as_array)
                    .is_some_and(|a| !a.is_empty())
            {
                return Err(unsupported(
                    "dense layers among the expert layers (decoder_sparse_step, mlp_only_layers)",
                ));
            }
            put("expert_count", MetaValue::U64(uint(&cfg, &path, "num_experts")?));
            put(
                "expert_used_count",
                MetaValue::U64(uint(&cfg, &path, "num_experts_per_tok")?),
            );
            put(
                "expert_feed_forward_length",
                MetaValue::U64(uint(&cfg, &path, "moe_intermediate_size")?),
            );
        }
        Arch::Deepseek2 => {
            let rank = |k: &str| cfg.get(k).and_then(Value::as_u64).unwrap_or(0);
            let (kv_lora, rope) = (
                uint(&cfg, &path, "kv_lora_rank")?,
                uint(&cfg, &path, "qk_rope_head_dim")?,
            );
            let (nope, v) = (uint(&cfg, &path, "qk_nope_head_dim")?, uint(&cfg, &path, "v_head_dim")?);
            put("attention.q_lora_rank", MetaValue::U64(rank("q_lora_rank")));
            put("attention.kv_lora_rank", MetaValue::U64(kv_lora));
            // The cache's one "head" is the latent; each query head is `nope + rope` wide.
            put("attention.head_count_kv", MetaValue::U64(1));
            put("attention.key_length", MetaValue::U64(kv_lora + rope));
            put("attention.value_length", MetaValue::U64(kv_lora));
            put("attention.key_length_mla", MetaValue::U64(nope + rope));
            put("attention.value_length_mla", MetaValue::U64(v));
            put("rope.dimension_count", MetaValue::U64(rope));
            if let Some(r) = cfg.get("rope_scaling").filter(|v| !v.is_null()) {
                let m = |k: &str| r.get(k).and_then(Value::as_f64);
                // DeepSeek's defaults: `mscale` 1, `mscale_all_dim` 0. Keys rotate at their
                // ratio's magnitude, which llama.cpp (and so Hearth) takes as 1.
                let (ms, all) = (m("mscale").unwrap_or(1.0), m("mscale_all_dim").unwrap_or(0.0));
                if ms != all {
                    return Err(unsupported(&format!(
                        "rope_scaling with mscale {ms} unlike mscale_all_dim {all}"
                    )));
                }
                put("rope.scaling.yarn_log_multiplier", MetaValue::F64(0.1 * all));
            }
            if let Some(n) = cfg.get("n_routed_experts").and_then(Value::as_u64).filter(|&n| n > 0) {
                if cfg
                    .get("moe_layer_freq")
                    .and_then(Value::as_u64)
                    .is_some_and(|f| f != 1)
                {
                    return Err(unsupported("moe_layer_freq other than 1"));
                }
                // Defaults as each model type's own config class has them: V2 softmax and
                // greedy without renormalization; V3 (and Kimi K2) sigmoid, noaux_tc, renormalized.
                let v2 = model_type == "deepseek_v2";
                let scoring =
                    cfg.get("scoring_func")
                        .and_then(Value::as_str)
                        .unwrap_or(if v2 { "softmax" } else { "sigmoid" });
                let gating = match scoring {
                    "softmax" => 1,
                    "sigmoid" => 2,
                    other => {
                        return Err(unsupported(&format!(
                            "scoring_func {other:?} (softmax and sigmoid are)"
                        )))
                    }
                };
                let groups = cfg.get("n_group").and_then(Value::as_u64).unwrap_or(1);
                let method =
                    cfg.get("topk_method")
                        .and_then(Value::as_str)
                        .unwrap_or(if v2 { "greedy" } else { "noaux_tc" });
                match method {
                    "greedy" => {}
                    "noaux_tc" if gating != 2 => {
                        return Err(unsupported("topk_method \"noaux_tc\" with softmax scores"))
                    }
                    // A group scores the sum of its best two experts (DeepSeek-V3).
                    "noaux_tc" if groups > 1 => {
                        put("expert_group_count", MetaValue::U64(groups));
                        put("expert_group_used_count", MetaValue::U64(uint(&cfg, &path, "topk_group")?));
                    }
                    "noaux_tc" | "group_limited_greedy" if groups <= 1 => {}
                    other => {
                        return Err(unsupported(&format!(
                            "topk_method {other:?} with {groups} groups (a group scoring its single best expert; Hearth's grouped routing is DeepSeek-V3's noaux_tc)"
                        )))
                    }
                }
                put("expert_count", MetaValue::U64(n));
                put(
                    "expert_used_count",
                    MetaValue::U64(uint(&cfg, &path, "num_experts_per_tok")?),
                );
                put("expert_shared_count", MetaValue::U64(rank("n_shared_experts")));
                put(
                    "expert_feed_forward_length",
                    MetaValue::U64(uint(&cfg, &path, "moe_intermediate_size")?),
                );
                put(
                    "leading_dense_block_count",
                    MetaValue::U64(rank("first_k_dense_replace")),
                );
                put("expert_weights_scale", MetaValue::F64(f("routed_scaling_factor", 1.0)));
                put(
                    "expert_weights_norm",
                    MetaValue::Bool(cfg.get("norm_topk_prob").and_then(Value::as_bool).unwrap_or(!v2)),
                );
                put("expert_gating_func", MetaValue::U64(gating));
            }
        }
        _ => {}
    }
    let mtp_from = match cfg.get("num_nextn_predict_layers").and_then(Value::as_u64) {
        Some(n) if n > 0 => Some(uint(&cfg, &path, "num_hidden_layers")? as usize),
        _ => None,
    };
    meta.insert("general.architecture".into(), MetaValue::String(p.into()));
    if matches!(arch, Arch::Llama | Arch::Mistral | Arch::Mixtral) {
        meta.insert(ROPE_LAYOUT_KEY.into(), MetaValue::String("halves".into()));
    }
    // Token ids from config.json, used when tokenizer_config.json does not name the tokens.
    let first_id = |k: &str| match cfg.get(k) {
        Some(Value::Array(a)) => a.first().and_then(Value::as_u64),
        Some(v) => v.as_u64(),
        None => None,
    };
    for (key, gkey) in [
        ("bos_token_id", "tokenizer.ggml.bos_token_id"),
        ("eos_token_id", "tokenizer.ggml.eos_token_id"),
    ] {
        if let Some(id) = first_id(key) {
            meta.insert(gkey.into(), MetaValue::U64(id));
        }
    }
    Ok((arch, mtp_from))
}

/// `rope_scaling` → `rope.scaling.*` keys (llama.cpp's, plus Llama 3's two frequency
/// factors, which llama.cpp's converter bakes into a tensor instead).
fn rope_scaling_metadata(r: &Value) -> Result<Vec<(String, MetaValue)>, String> {
    let kind = r
        .get("rope_type")
        .or(r.get("type"))
        .and_then(Value::as_str)
        .ok_or("no rope_type")?;
    let num = |k: &str| r.get(k).and_then(Value::as_f64);
    let factor = num("factor").unwrap_or(1.0);
    let mut out = vec![("rope.scaling.factor".to_string(), MetaValue::F64(factor))];
    let mut put = |k: &str, v: Option<f64>| {
        if let Some(v) = v {
            out.push((format!("rope.scaling.{k}"), MetaValue::F64(v)));
        }
    };
    match kind {
        "default" => return Ok(Vec::new()),
        "linear" => {}
        "llama3" => {
            put("low_freq_factor", num("low_freq_factor"));
            put("high_freq_factor", num("high_freq_factor"));
        }
        "yarn" => {
            put("yarn_beta_fast", num("beta_fast"));
            put("yarn_beta_slow", num("beta_slow"));
            // transformers' `attention_factor` replaces YaRN's 0.1·ln(s) + 1; llama.cpp's
            // attn_factor multiplies it.
            put("attn_factor", num("attention_factor").map(|a| a / (0.1 * factor.ln() + 1.0)));
        }
        "dynamic" => {
            return Err("dynamic NTK scaling changes RoPE with each sequence's length, which a shared KV cache cannot hold (use yarn)".into())
        }
        other => return Err(format!("rope type {other:?} (linear, llama3 and yarn are)")),
    }
    if let Some(o) = r.get("original_max_position_embeddings").and_then(Value::as_u64) {
        out.push(("rope.scaling.original_context_length".into(), MetaValue::U64(o)));
    }
    out.push(("rope.scaling.type".into(), MetaValue::String(kind.into())));
    Ok(out)
}

/// Latent attention's `kv_b_proj` (per head: `qk_nope` key rows, then `v_head` value rows,
/// each `kv_lora_rank` wide) in the form the model code reads, llama.cpp's: each head's value
/// rows are a matrix of their own as they lie (`attn_v_b.H`, uncopied), and its key rows are
/// transposed into one `attn_k_b` tensor in anonymous memory — returned, as the view's last
/// shard (None: no layer has a `kv_b_proj`).
pub(super) fn split_latent_kv(
    dir: &Path,
    maps: &[Mmap],
    meta: &HashMap<String, MetaValue>,
    tensors: &mut Vec<TensorInfo>,
) -> Result<Option<Mmap>, HfError> {
    let get = |k: &str| {
        meta.get(&format!("deepseek2.{k}"))
            .and_then(MetaValue::as_u64)
            .unwrap_or(0) as usize
    };
    let (nh, kv_lora, v) = (
        get("attention.head_count"),
        get("attention.kv_lora_rank"),
        get("attention.value_length_mla"),
    );
    let nope = get("attention.key_length_mla").saturating_sub(get("rope.dimension_count"));
    let kv_b: Vec<usize> = (0..tensors.len())
        .filter(|&i| tensors[i].name.ends_with(".attn_kv_b.weight"))
        .collect();
    if kv_b.is_empty() {
        return Ok(None);
    }
    let elem = |t: &TensorInfo| t.ty.block_layout().map_or(0, |(_, bytes)| bytes);
    // Every kv_b_proj has the shape the config states (checked arithmetic: the config is
    // not validated yet), so its bytes are `nh · (nope + v) · kv_lora` elements.
    let rows = nope
        .checked_add(v)
        .and_then(|w| nh.checked_mul(w))
        .filter(|_| nope > 0 && kv_lora > 0);
    for &i in &kv_b {
        let t = &tensors[i];
        if rows.is_none() || t.dims != [kv_lora as u64, rows.unwrap_or(0) as u64] {
            return Err(invalid(
                dir,
                format!(
                    "{} is {:?}; {nh} heads of {nope} key and {v} value rows of {kv_lora} expected",
                    t.name, t.dims
                ),
            ));
        }
    }
    // The keys are a share of tensors already mapped, so this cannot overflow.
    let k_bytes: usize = kv_b.iter().map(|&i| tensors[i].len / (nope + v) * nope).sum();
    let mut memory = memmap2::MmapMut::map_anon(k_bytes.max(1)).map_err(io_err(dir))?;
    let mut at = 0;
    let mut derived = Vec::new();
    for &i in &kv_b {
        let t = &tensors[i];
        let e = elem(t);
        let stem = t.name.trim_end_matches(".attn_kv_b.weight");
        let data = &maps[t.shard][t.offset..t.offset + t.len];
        let row = kv_lora * e;
        let start = at;
        for h in 0..nh {
            let head = &data[h * (nope + v) * row..];
            // k_b[h][j][i] = kv_b[h·(nope+v) + i][j]
            for j in 0..kv_lora {
                for i in 0..nope {
                    let from = i * row + j * e;
                    memory[at..at + e].copy_from_slice(&head[from..from + e]);
                    at += e;
                }
            }
            derived.push(TensorInfo {
                name: format!("{stem}.attn_v_b.{h}.weight"),
                dims: vec![kv_lora as u64, v as u64],
                ty: t.ty,
                offset: t.offset + (h * (nope + v) + nope) * row,
                len: v * row,
                shard: t.shard,
            });
        }
        derived.push(TensorInfo {
            name: format!("{stem}.attn_k_b.weight"),
            dims: vec![nope as u64, kv_lora as u64, nh as u64],
            ty: t.ty,
            offset: start,
            len: at - start,
            shard: maps.len(),
        });
    }
    tensors.retain(|t| !t.name.ends_with(".attn_kv_b.weight"));
    tensors.extend(derived);
    Ok(Some(memory.make_read_only().map_err(io_err(dir))?))
}

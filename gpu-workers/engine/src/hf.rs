//! Hugging Face model directories: `config.json`, `*.safetensors` (F32, F16 or BF16; one
//! file or shards listed by `model.safetensors.index.json`), `tokenizer.json` and
//! `tokenizer_config.json` (special tokens, chat template).
//!
//! [`open`] maps every shard (nothing is copied but latent attention's per-head keys, which
//! are transposed at open: the weights are used from the page cache
//! as GGUF weights are) and presents the directory as the same [`GgufFile`] view the model
//! code reads: the configuration under GGUF's `llama.*` keys, the tokenizer under
//! `tokenizer.ggml.*`, tensors under GGUF's names with their dimensions reversed, and
//! [`ROPE_LAYOUT_KEY`] = `halves` for Llama, Mistral and Mixtral, because their Hugging Face
//! checkpoints keep Q/K rows unpermuted and rotate the two halves of each head (DeepSeek's
//! rotate adjacent pairs, as GGUF does). Routed experts stay one tensor per expert, and
//! `kv_b_proj` is split per head as llama.cpp's converter splits it ([`split_latent_kv`]).
//!
//! The tokenizer is Hearth's own, built from `tokenizer.json`'s vocabulary, merges and
//! added tokens (with their strip flags): byte-level BPE whose pre-tokenizer is one of
//! Hearth's table (its `Split` patterns, `Digits` and `ByteLevel` compared with the table's),
//! or SentencePiece-style BPE with byte fallback (`Prepend`+`Replace` or `Replace`
//! normalizers, or `Metaspace`); anything else is refused by name. The engine tests check it
//! against the `tokenizers` crate token for token. It is Hearth's own because the gateway
//! tokenizes too (for routing and limits), from the [`hearth_protocol::TokenizerSpec`] a
//! worker hands it.
//!
//! [`export`] writes such a directory from a GGUF model (dequantized; Q/K rows un-permuted;
//! experts unstacked; `attn_k_b`/`attn_v_b` joined into `kv_b_proj`), for tests and
//! `hearth model export-hf`.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};
use serde_json::{json, Value};

use crate::gguf::{GgmlType, GgufError, GgufFile, MetaValue, TensorInfo};
use crate::kernels::dequantize_row;
use crate::models::{
    Arch, Gating, ModelConfig, ModelError, RopeLayout, RopeScalingKind, NORM_SHIFT_KEY, ROPE_LAYOUT_KEY,
};

#[derive(Debug, thiserror::Error)]
pub enum HfError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("{path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("{path}: {message}")]
    Invalid { path: String, message: String },
    #[error("{path}: not a valid safetensors file ({message}); is it truncated or corrupt?")]
    Safetensors { path: String, message: String },
    #[error("{0}")]
    Unsupported(String),
    #[error(transparent)]
    Model(#[from] ModelError),
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> HfError + '_ {
    move |source| HfError::Io {
        path: path.display().to_string(),
        source,
    }
}

fn invalid(path: &Path, message: impl Into<String>) -> HfError {
    HfError::Invalid {
        path: path.display().to_string(),
        message: message.into(),
    }
}

fn read_json(path: &Path) -> Result<Value, HfError> {
    let text = std::fs::read_to_string(path).map_err(io_err(path))?;
    serde_json::from_str(&text).map_err(|e| invalid(path, format!("not valid JSON: {e}")))
}

/// Opens a model: a GGUF file, or a Hugging Face directory.
pub fn open_model(path: &Path) -> Result<GgufFile, HfError> {
    if path.is_dir() {
        open(path)
    } else {
        Ok(GgufFile::open(path)?)
    }
}

/// Bytes of weights a model occupies on disk: the GGUF file, or the safetensors a directory
/// is loaded from.
pub fn weights_bytes(path: &Path) -> u64 {
    let files = if path.is_dir() {
        shard_files(path).map(|(f, _)| f).unwrap_or_default()
    } else {
        vec![path.to_path_buf()]
    };
    files
        .iter()
        .filter_map(|f| std::fs::metadata(f).ok())
        .map(|m| m.len())
        .sum()
}

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
const EXPERT_NAMES: [(&str, &str, &str); 3] = [
    ("gate_proj.weight", "w1.weight", "ffn_gate_exps"),
    ("up_proj.weight", "w3.weight", "ffn_up_exps"),
    ("down_proj.weight", "w2.weight", "ffn_down_exps"),
];

/// Expert `e` of layer `layer`'s `stem` tensor (`ffn_gate_exps`, …) under its Hugging Face name.
fn expert_name(arch: Arch, layer: &str, stem: &str, e: usize) -> Option<String> {
    let (h, h_mixtral, _) = EXPERT_NAMES.iter().find(|(_, _, g)| *g == stem)?;
    Some(if arch == Arch::Mixtral {
        format!("model.layers.{layer}.block_sparse_moe.experts.{e}.{h_mixtral}")
    } else {
        format!("model.layers.{layer}.mlp.experts.{e}.{h}")
    })
}

/// GGUF tensor name → Hugging Face tensor name (the inverse of [`gguf_name`]; a fused
/// `ffn_up` of twice the width is Phi-3's `gate_up_proj`).
fn hf_name(gguf: &str, arch: Arch, fused_up: bool) -> Option<String> {
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

/// Tensor name → shard file, from `model.safetensors.index.json`.
type WeightMap = HashMap<String, String>;

/// The safetensors files of a directory: the index's shards, or `model.safetensors`, or
/// every `*.safetensors` file (sorted).
fn shard_files(dir: &Path) -> Result<(Vec<PathBuf>, Option<WeightMap>), HfError> {
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
fn open_weights(dir: &Path, arch: Arch, skip_from: Option<usize>) -> Result<(Vec<Mmap>, Vec<TensorInfo>), HfError> {
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
fn config_metadata(dir: &Path, meta: &mut HashMap<String, MetaValue>) -> Result<(Arch, Option<usize>), HfError> {
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

/// A token in `tokenizer_config.json`: a string or `{"content": …}`.
fn token_text(v: Option<&Value>) -> Option<&str> {
    match v? {
        Value::String(s) => Some(s),
        Value::Object(o) => o.get("content")?.as_str(),
        _ => None,
    }
}

/// `tokenizer.json` (+ `tokenizer_config.json`) → GGUF `tokenizer.ggml.*` metadata.
fn tokenizer_metadata(dir: &Path, meta: &mut HashMap<String, MetaValue>) -> Result<(), HfError> {
    let path = dir.join("tokenizer.json");
    let tj = read_json(&path)?;
    let unsupported = |what: String| HfError::Unsupported(format!("{}: {what}", path.display()));
    let model = tj.get("model").ok_or_else(|| invalid(&path, "no model"))?;
    let ty = model.get("type").and_then(Value::as_str).unwrap_or("");
    if ty != "BPE" {
        return Err(unsupported(format!(
            "tokenizer model {ty:?} is not supported (Hearth runs BPE: byte-level, or SentencePiece-style with byte fallback)"
        )));
    }
    let byte_fallback = model.get("byte_fallback").and_then(Value::as_bool).unwrap_or(false);
    for (key, ok) in [
        ("continuing_subword_prefix", Value::Null),
        ("end_of_word_suffix", Value::Null),
        ("dropout", Value::Null),
    ]
    .into_iter()
    .chain((!byte_fallback).then_some(("unk_token", Value::Null)))
    {
        if let Some(v) = model.get(key) {
            if *v != ok && !(v.is_string() && v.as_str() == Some("")) {
                return Err(unsupported(format!("BPE option {key} = {v} is not supported")));
            }
        }
    }
    let normalizer = tj.get("normalizer").unwrap_or(&Value::Null);
    let pre_tokenizer = tj.get("pre_tokenizer").unwrap_or(&Value::Null);
    let (kind, pre): (&str, String) = if byte_fallback {
        // SentencePiece as tokenizer.json writes it: BPE over `▁`-text with byte fallback.
        let variant = spm_variant(normalizer, pre_tokenizer).ok_or_else(|| {
            unsupported(format!(
                "byte-fallback BPE with normalizer {normalizer} and pre-tokenizer {pre_tokenizer} is not a SentencePiece layout Hearth reproduces (Prepend + Replace, Replace, or Metaspace)"
            ))
        })?;
        ("spm-bpe", variant)
    } else {
        if !normalizer.is_null() {
            return Err(unsupported("a normalizer is not supported with byte-level BPE".into()));
        }
        let pre = pre_tokenizer_name(pre_tokenizer).ok_or_else(|| {
            unsupported(format!(
                "pre-tokenizer {} is not one Hearth reproduces (byte-level BPE with the patterns of {})",
                pre_tokenizer,
                hearth_protocol::tokenizer::supported_pre()
            ))
        })?;
        ("gpt2", pre.to_string())
    };
    let wants_ignore =
        hearth_protocol::tokenizer::pretokenize::lookup(&pre).is_some_and(|d| d.ignore_merges && kind == "gpt2");
    if model.get("ignore_merges").and_then(Value::as_bool).unwrap_or(false) != wants_ignore {
        return Err(unsupported(format!(
            "BPE option ignore_merges = {} is not what the {pre} pre-tokenizer's models use",
            !wants_ignore
        )));
    }
    let unk = model
        .get("unk_token")
        .and_then(Value::as_str)
        .filter(|u| !u.is_empty())
        .map(str::to_string);
    let vocab = model
        .get("vocab")
        .and_then(Value::as_object)
        .ok_or_else(|| invalid(&path, "model.vocab is not an object"))?;
    // id → (text, GGUF token type): 1 normal, 3 control (special), 4 user-defined.
    let mut by_id: BTreeMap<u64, (String, i64)> = BTreeMap::new();
    let (mut lstrip, mut rstrip) = (Vec::new(), Vec::new());
    for (tok, id) in vocab {
        let id = id
            .as_u64()
            .ok_or_else(|| invalid(&path, format!("vocab[{tok:?}] is not an id")))?;
        // With byte fallback, `<0xXX>` pieces are bytes and the unknown token is unknown.
        use hearth_protocol::tokenizer::{parse_byte_token, TOKEN_TYPE_BYTE, TOKEN_TYPE_NORMAL, TOKEN_TYPE_UNKNOWN};
        let ty = if byte_fallback && parse_byte_token(tok).is_some() {
            TOKEN_TYPE_BYTE
        } else if unk.as_deref() == Some(tok.as_str()) {
            TOKEN_TYPE_UNKNOWN
        } else {
            TOKEN_TYPE_NORMAL
        };
        by_id.insert(id, (tok.clone(), ty as i64));
    }
    for a in tj.get("added_tokens").and_then(Value::as_array).into_iter().flatten() {
        let (Some(id), Some(content)) = (
            a.get("id").and_then(Value::as_u64),
            a.get("content").and_then(Value::as_str),
        ) else {
            return Err(invalid(&path, "an added token lacks id or content"));
        };
        if a.get("single_word").and_then(Value::as_bool) == Some(true) {
            return Err(unsupported(format!(
                "added token {content:?} has single_word, which is not supported"
            )));
        }
        for (flag, list) in [("lstrip", &mut lstrip), ("rstrip", &mut rstrip)] {
            if a.get(flag).and_then(Value::as_bool) == Some(true) {
                list.push(MetaValue::I64(id as i64));
            }
        }
        let special = a.get("special").and_then(Value::as_bool).unwrap_or(false);
        by_id.insert(id, (content.to_string(), if special { 3 } else { 4 }));
    }
    let n = by_id.len() as u64;
    if by_id.keys().next_back().is_some_and(|&last| last + 1 != n) {
        return Err(invalid(&path, "token ids are not contiguous from 0"));
    }
    let merges = model
        .get("merges")
        .and_then(Value::as_array)
        .ok_or_else(|| invalid(&path, "model.merges is not a list"))?
        .iter()
        .map(|m| match m {
            Value::String(s) => Some(s.clone()),
            Value::Array(p) if p.len() == 2 => Some(format!("{} {}", p[0].as_str()?, p[1].as_str()?)),
            _ => None,
        })
        .collect::<Option<Vec<String>>>()
        .ok_or_else(|| invalid(&path, "a merge is neither \"a b\" nor [a, b]"))?;
    let ids: HashMap<&str, u64> = by_id.iter().map(|(id, (t, _))| (t.as_str(), *id)).collect();
    let strs = |v: Vec<String>| MetaValue::Array(v.into_iter().map(MetaValue::String).collect());
    meta.insert("tokenizer.ggml.model".into(), MetaValue::String(kind.into()));
    meta.insert("tokenizer.ggml.pre".into(), MetaValue::String(pre));
    meta.insert(
        "tokenizer.ggml.token_type".into(),
        MetaValue::Array(by_id.values().map(|(_, t)| MetaValue::I64(*t)).collect()),
    );
    meta.insert("tokenizer.ggml.merges".into(), strs(merges));
    meta.insert("tokenizer.hearth.lstrip".into(), MetaValue::Array(lstrip));
    meta.insert("tokenizer.hearth.rstrip".into(), MetaValue::Array(rstrip));
    let cfg_path = dir.join("tokenizer_config.json");
    if cfg_path.exists() {
        let tc = read_json(&cfg_path)?;
        for (key, gkey) in [
            ("bos_token", "tokenizer.ggml.bos_token_id"),
            ("eos_token", "tokenizer.ggml.eos_token_id"),
        ] {
            if let Some(t) = token_text(tc.get(key)) {
                let id = ids
                    .get(t)
                    .ok_or_else(|| invalid(&cfg_path, format!("{key} {t:?} is not in the vocabulary")))?;
                meta.insert(gkey.into(), MetaValue::U64(*id));
            }
        }
        if let Some(b) = tc.get("add_bos_token").and_then(Value::as_bool) {
            meta.insert("tokenizer.ggml.add_bos_token".into(), MetaValue::Bool(b));
        }
        let template = match tc.get("chat_template") {
            Some(Value::String(s)) => Some(s.clone()),
            // A list of named templates: the one called "default".
            Some(Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                .and_then(|t| t.get("template")?.as_str().map(str::to_string)),
            _ => None,
        };
        if let Some(t) = template {
            meta.insert("tokenizer.chat_template".into(), MetaValue::String(t));
        }
    }
    // The post-processor (after tokenizer_config.json: it is what the tokenizer does): none,
    // ByteLevel (offsets only), or a template that puts one special token before a single
    // sequence (BOS, as `add_bos_token`).
    match tj.get("post_processor") {
        None | Some(Value::Null) => {}
        Some(p) if p.get("type").and_then(Value::as_str) == Some("ByteLevel") => {}
        Some(p) if p.get("type").and_then(Value::as_str) == Some("TemplateProcessing") => {
            let single = p.get("single").and_then(Value::as_array).cloned().unwrap_or_default();
            let special = |v: &Value| v.get("SpecialToken")?.get("id")?.as_str().map(str::to_string);
            let is_sequence = |v: &Value| v.get("Sequence").is_some();
            match single.as_slice() {
                [seq] if is_sequence(seq) => {
                    meta.insert("tokenizer.ggml.add_bos_token".into(), MetaValue::Bool(false));
                }
                [bos, seq] if is_sequence(seq) && special(bos).is_some() => {
                    let bos = special(bos).unwrap_or_default();
                    let id = ids.get(bos.as_str()).ok_or_else(|| {
                        invalid(&path, format!("post-processor token {bos:?} is not in the vocabulary"))
                    })?;
                    meta.insert("tokenizer.ggml.bos_token_id".into(), MetaValue::U64(*id));
                    meta.insert("tokenizer.ggml.add_bos_token".into(), MetaValue::Bool(true));
                }
                _ => {
                    return Err(unsupported(
                        "a post-processor template other than [BOS] + sequence is not supported".into(),
                    ))
                }
            }
        }
        Some(p) => {
            return Err(unsupported(format!(
                "post-processor {} is not supported",
                p.get("type").unwrap_or(&Value::Null)
            )))
        }
    }
    meta.insert(
        "tokenizer.ggml.tokens".into(),
        strs(by_id.into_values().map(|(t, _)| t).collect()),
    );
    Ok(())
}

/// The patterns a `tokenizer.json` pre-tokenizer splits by, in order, if it is made only of
/// pieces Hearth runs: `Split` (a regex, `Isolated`), `Digits`, and `ByteLevel` (its GPT-2
/// regex when `use_regex`). None when there is no final byte-level step.
fn pre_tokenizer_patterns(p: &Value) -> Option<Vec<String>> {
    let steps: Vec<&Value> = match p.get("type").and_then(Value::as_str)? {
        "Sequence" => p.get("pretokenizers")?.as_array()?.iter().collect(),
        _ => vec![p],
    };
    let (last, rest) = steps.split_last()?;
    if last.get("type").and_then(Value::as_str) != Some("ByteLevel")
        || last.get("add_prefix_space").and_then(Value::as_bool) == Some(true)
    {
        return None;
    }
    let mut patterns = Vec::new();
    for step in rest {
        match step.get("type").and_then(Value::as_str)? {
            "Split" => {
                let behavior = step.get("behavior").and_then(Value::as_str).unwrap_or("Isolated");
                if behavior != "Isolated" || step.get("invert").and_then(Value::as_bool) == Some(true) {
                    return None;
                }
                patterns.push(step.get("pattern")?.get("Regex")?.as_str()?.to_string());
            }
            "Digits" => patterns.push(
                if step.get("individual_digits").and_then(Value::as_bool) == Some(true) {
                    r"\p{N}"
                } else {
                    r"\p{N}+"
                }
                .to_string(),
            ),
            _ => return None,
        }
    }
    if last.get("use_regex").and_then(Value::as_bool) != Some(false) {
        patterns.push(hearth_protocol::tokenizer::pretokenize::GPT2.to_string());
    }
    Some(patterns)
}

/// The `spm-bpe` variant (see `hearth_protocol::tokenizer::SPM_BPE_VARIANTS`) of a
/// byte-fallback tokenizer.json: `Prepend("▁")` + `Replace(" ", "▁")`, `Replace` alone, or a
/// `Metaspace` pre-tokenizer.
fn spm_variant(normalizer: &Value, pre: &Value) -> Option<String> {
    let ty = |v: &Value| v.get("type").and_then(Value::as_str).map(str::to_string);
    let is_replace = |v: &Value| {
        ty(v).as_deref() == Some("Replace")
            && v.get("pattern").and_then(|p| p.get("String")).and_then(Value::as_str) == Some(" ")
            && v.get("content").and_then(Value::as_str) == Some("▁")
    };
    let is_prepend =
        |v: &Value| ty(v).as_deref() == Some("Prepend") && v.get("prepend").and_then(Value::as_str) == Some("▁");
    match (normalizer, pre) {
        (n, Value::Null) if is_replace(n) => Some("never".into()),
        (n, Value::Null) if ty(n).as_deref() == Some("Sequence") => {
            match n.get("normalizers")?.as_array()?.as_slice() {
                [a, b] if is_prepend(a) && is_replace(b) => Some("prepend".into()),
                [a] if is_replace(a) => Some("never".into()),
                _ => None,
            }
        }
        (Value::Null, p) if ty(p).as_deref() == Some("Metaspace") => {
            if p.get("replacement").and_then(Value::as_str).unwrap_or("▁") != "▁" {
                return None;
            }
            let scheme = match p.get("prepend_scheme").and_then(Value::as_str) {
                Some(s @ ("always" | "first" | "never")) => s.to_string(),
                Some(_) => return None,
                None if p.get("add_prefix_space").and_then(Value::as_bool) == Some(false) => "never".into(),
                None => "always".into(),
            };
            let split = p.get("split").and_then(Value::as_bool).unwrap_or(true);
            Some(format!("metaspace-{scheme}{}", if split { "-split" } else { "" }))
        }
        _ => None,
    }
}

/// Hearth's name for a pre-tokenizer it reproduces exactly, if it is one.
fn pre_tokenizer_name(p: &Value) -> Option<&'static str> {
    let patterns = pre_tokenizer_patterns(p)?;
    let refs: Vec<&str> = patterns.iter().map(String::as_str).collect();
    hearth_protocol::tokenizer::pretokenize::name_of(&refs)
}

/// Latent attention's `kv_b_proj` (per head: `qk_nope` key rows, then `v_head` value rows,
/// each `kv_lora_rank` wide) in the form the model code reads, llama.cpp's: each head's value
/// rows are a matrix of their own as they lie (`attn_v_b.H`, uncopied), and its key rows are
/// transposed into one `attn_k_b` tensor in anonymous memory — returned, as the view's last
/// shard (None: no layer has a `kv_b_proj`).
fn split_latent_kv(
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

/// Opens a Hugging Face model directory as a [`GgufFile`] view (see the module docs).
pub fn open(dir: &Path) -> Result<GgufFile, HfError> {
    let mut meta = HashMap::new();
    let (arch, mtp_from) = config_metadata(dir, &mut meta)?;
    tokenizer_metadata(dir, &mut meta)?;
    let name = dir
        .file_name()
        .map_or("model".into(), |n| n.to_string_lossy().to_string());
    meta.insert("general.name".into(), MetaValue::String(name));
    let (mut maps, mut tensors) = open_weights(dir, arch, mtp_from)?;
    let mut memory_shards = 0;
    if arch == Arch::Deepseek2 {
        if let Some(map) = split_latent_kv(dir, &maps, &meta, &mut tensors)? {
            maps.push(map);
            memory_shards = 1;
        }
    }
    let file = GgufFile::from_parts(dir.to_path_buf(), maps, memory_shards, meta, tensors);
    // Fail here, with the directory named, rather than at the first request.
    let c = ModelConfig::from_gguf(&file)?;
    let layers = file
        .tensors
        .iter()
        .filter(|t| t.name.ends_with(".attn_norm.weight"))
        .count();
    if layers != c.n_layers {
        return Err(invalid(
            dir,
            format!("config.json says {} layers; the weights have {layers}", c.n_layers),
        ));
    }
    Ok(file)
}

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
fn shortest(v: f32) -> f64 {
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
    let spec = crate::gguf::tokenizer_spec(g)?;
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

#[cfg(test)]
mod tests {
    use super::*;

    /// `kv_b_proj` split as llama.cpp's converter splits it, with key and value widths that
    /// differ (so a swap of the two, or of the transposition, shows).
    #[test]
    fn latent_kv_splits_per_head_as_llama_cpp_does() {
        let (nh, nope, v, r) = (2usize, 2usize, 3usize, 4usize);
        let rows = nh * (nope + v);
        let mut map = memmap2::MmapMut::map_anon(rows * r * 4).unwrap();
        for (k, c) in map.chunks_exact_mut(4).enumerate() {
            c.copy_from_slice(&(k as f32).to_le_bytes()); // kv_b[row][col] = row·r + col
        }
        let maps = vec![map.make_read_only().unwrap()];
        let meta: HashMap<String, MetaValue> = [
            ("attention.head_count", nh),
            ("attention.kv_lora_rank", r),
            ("attention.value_length_mla", v),
            ("attention.key_length_mla", nope + 1),
            ("rope.dimension_count", 1),
        ]
        .into_iter()
        .map(|(k, n)| (format!("deepseek2.{k}"), MetaValue::U64(n as u64)))
        .collect();
        let mut tensors = vec![TensorInfo {
            name: "blk.0.attn_kv_b.weight".into(),
            dims: vec![r as u64, rows as u64],
            ty: GgmlType::F32,
            offset: 0,
            len: rows * r * 4,
            shard: 0,
        }];
        let memory = split_latent_kv(Path::new("d"), &maps, &meta, &mut tensors)
            .unwrap()
            .unwrap();
        let all = [maps[0].as_ref(), memory.as_ref()];
        let floats = |t: &TensorInfo| -> Vec<f32> {
            all[t.shard][t.offset..t.offset + t.len]
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect()
        };
        let find = |n: &str| tensors.iter().find(|t| t.name == n).unwrap();
        let k_b = find("blk.0.attn_k_b.weight");
        assert_eq!(k_b.dims, [nope as u64, r as u64, nh as u64]);
        let k = floats(k_b);
        for h in 0..nh {
            for j in 0..r {
                for i in 0..nope {
                    assert_eq!(k[(h * r + j) * nope + i], ((h * (nope + v) + i) * r + j) as f32);
                }
            }
            let v_b = find(&format!("blk.0.attn_v_b.{h}.weight"));
            assert_eq!(v_b.dims, [r as u64, v as u64]);
            let want: Vec<f32> = (0..v * r).map(|k| ((h * (nope + v) + nope) * r + k) as f32).collect();
            assert_eq!(floats(v_b), want);
        }
        assert!(tensors.iter().all(|t| t.name != "blk.0.attn_kv_b.weight"));
    }

    #[test]
    fn tensor_names_map_both_ways() {
        for arch in Arch::ALL {
            for (g, fused) in [
                ("token_embd.weight", false),
                ("output.weight", false),
                ("output_norm.weight", false),
                ("blk.0.attn_q.weight", false),
                ("blk.0.attn_q.bias", false),
                ("blk.2.attn_qkv.weight", false),
                ("blk.1.attn_k_norm.weight", false),
                ("blk.29.ffn_down.weight", false),
                ("blk.3.ffn_norm.weight", false),
                ("blk.3.ffn_up.weight", false),
                ("blk.3.ffn_up.weight", true),
                ("blk.4.ffn_gate_inp.weight", false),
                ("blk.4.exp_probs_b.bias", false),
                ("blk.4.ffn_down_shexp.weight", false),
                ("blk.0.attn_q_a_norm.weight", false),
                ("blk.0.attn_kv_a_mqa.weight", false),
            ] {
                let h = hf_name(g, arch, fused).unwrap();
                assert_eq!(gguf_name(&h, arch).as_deref(), Some(g), "{arch}: {h}");
            }
        }
        // Gemma's extra norms, and the Llama name they share.
        assert_eq!(
            gguf_name("model.layers.0.post_attention_layernorm.weight", Arch::Gemma2).as_deref(),
            Some("blk.0.post_attention_norm.weight")
        );
        assert_eq!(
            gguf_name("model.layers.0.post_attention_layernorm.weight", Arch::Llama).as_deref(),
            Some("blk.0.ffn_norm.weight")
        );
        assert_eq!(
            gguf_name("model.layers.0.pre_feedforward_layernorm.weight", Arch::Llama),
            None
        );
        assert_eq!(gguf_name("model.layers.0.self_attn.o_proj.bias", Arch::Qwen2), None);
        // Routed experts: one tensor per expert, under the stacked tensor's stem.
        for arch in [Arch::Mixtral, Arch::Qwen3Moe, Arch::Deepseek2] {
            for (_, _, stem) in EXPERT_NAMES {
                let h = expert_name(arch, "2", stem, 7).unwrap();
                assert_eq!(gguf_name(&h, arch), Some(format!("blk.2.{stem}.7.weight")), "{h}");
            }
        }
        assert_eq!(
            expert_name(Arch::Mixtral, "0", "ffn_gate_exps", 3).as_deref(),
            Some("model.layers.0.block_sparse_moe.experts.3.w1.weight")
        );
        assert_eq!(
            hf_name("blk.1.ffn_gate_inp.weight", Arch::Mixtral, false).as_deref(),
            Some("model.layers.1.block_sparse_moe.gate.weight")
        );
        assert_eq!(
            gguf_name("model.layers.0.mlp.experts.x.up_proj.weight", Arch::Qwen3Moe),
            None
        );
    }

    #[test]
    fn sentencepiece_layouts_of_tokenizer_json_are_recognised() {
        let replace = json!({"type": "Replace", "pattern": {"String": " "}, "content": "▁"});
        let prepend = json!({"type": "Prepend", "prepend": "▁"});
        // Llama 2 / Mistral v0.x (legacy), and a Replace-only normalizer.
        let legacy = json!({"type": "Sequence", "normalizers": [prepend, replace]});
        assert_eq!(spm_variant(&legacy, &Value::Null).as_deref(), Some("prepend"));
        assert_eq!(spm_variant(&replace, &Value::Null).as_deref(), Some("never"));
        // Metaspace (Llama 2 non-legacy, Mistral v0.3, Gemma): its scheme and split.
        let m = json!({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": false});
        assert_eq!(spm_variant(&Value::Null, &m).as_deref(), Some("metaspace-first"));
        let old = json!({"type": "Metaspace", "replacement": "▁", "add_prefix_space": true});
        assert_eq!(
            spm_variant(&Value::Null, &old).as_deref(),
            Some("metaspace-always-split")
        );
        assert_eq!(spm_variant(&Value::Null, &json!({"type": "ByteLevel"})), None);
        for v in hearth_protocol::tokenizer::SPM_BPE_VARIANTS {
            // Every variant Hearth writes is one it reads back.
            let spec = hearth_protocol::TokenizerSpec {
                model: "spm-bpe".into(),
                pre: v.to_string(),
                ..Default::default()
            };
            let tj = hearth_protocol::tokenizer::hf_tokenizer_json(&spec).unwrap();
            assert_eq!(
                spm_variant(&tj["normalizer"], &tj["pre_tokenizer"]).as_deref(),
                Some(*v)
            );
        }
    }

    #[test]
    fn pre_tokenizers_hearth_reproduces() {
        use hearth_protocol::tokenizer::pretokenize::GPT2;
        let bl = json!({"type": "ByteLevel", "add_prefix_space": false, "use_regex": true});
        assert_eq!(pre_tokenizer_name(&bl), Some("gpt-2"));
        let smol = json!({"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": true}, bl]});
        assert_eq!(pre_tokenizer_name(&smol), Some("smollm"));
        let split =
            |r: &str| json!({"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated", "invert": false});
        let raw = json!({"type": "ByteLevel", "add_prefix_space": false, "use_regex": false});
        let as_splits = json!({"type": "Sequence", "pretokenizers": [split(r"\p{N}"), split(GPT2), raw]});
        assert_eq!(pre_tokenizer_name(&as_splits), Some("smollm"));
        let llama3 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
        let l3 = json!({"type": "Sequence", "pretokenizers": [split(llama3), raw]});
        assert_eq!(pre_tokenizer_name(&l3), Some("llama-bpe"));
        let unknown = json!({"type": "Sequence", "pretokenizers": [split("x"), bl]});
        assert_eq!(pre_tokenizer_name(&unknown), None);
        assert_eq!(
            pre_tokenizer_name(&json!({"type": "ByteLevel", "add_prefix_space": true})),
            None
        );
    }
}

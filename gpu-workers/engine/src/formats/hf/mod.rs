//! Hugging Face model directories: `config.json`, `*.safetensors` (F32, F16 or BF16; one
//! file or shards listed by `model.safetensors.index.json`), `tokenizer.json` and
//! `tokenizer_config.json` (special tokens, chat template).
//!
//! [`open`] maps every shard (nothing is copied but latent attention's per-head keys, which
//! are transposed at open: the weights are used from the page cache
//! as GGUF weights are) and presents the directory as the same [`GgufFile`] view the model
//! code reads: the configuration under GGUF's `llama.*` keys, the tokenizer under
//! `tokenizer.ggml.*`, tensors under GGUF's names with their dimensions reversed, and
//! [`ROPE_LAYOUT_KEY`](crate::models::ROPE_LAYOUT_KEY) = `halves` for Llama, Mistral and Mixtral, because their Hugging Face
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
//!
//! [`error`] is how it fails; [`names`] maps tensor names both ways; [`import`] reads the
//! weights and configuration; [`tokenizer`] the tokenizer files; [`export`] writes a
//! directory.

pub mod error;
pub mod export;
pub mod import;
pub mod names;
pub mod tokenizer;

use std::collections::HashMap;
use std::path::Path;

use crate::formats::gguf::{GgufFile, MetaValue};
use crate::formats::hf::error::{invalid, HfError};
use crate::formats::hf::import::{config_metadata, open_weights, shard_files, split_latent_kv};
use crate::formats::hf::tokenizer::tokenizer_metadata;
use crate::models::{Arch, ModelConfig};

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

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    use serde_json::{json, Value};

    use crate::formats::gguf::{GgmlType, MetaValue, TensorInfo};
    use crate::formats::hf::import::split_latent_kv;
    use crate::formats::hf::names::{expert_name, gguf_name, hf_name, EXPERT_NAMES};
    use crate::formats::hf::tokenizer::{pre_tokenizer_name, spm_variant};

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

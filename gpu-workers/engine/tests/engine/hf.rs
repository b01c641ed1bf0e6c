//! Hugging Face directories (safetensors + tokenizer.json), written from the default GGUF in
//! the test itself: the same logits as the GGUF when exported in F32, the golden greedy
//! answer from a sharded F16 export, Hearth's tokenizer identical to the `tokenizers` crate
//! on `tokenizer.json`, and clear errors for broken directories.

use crate::harness::TempDir;
use std::path::Path;

use hearth_engine::formats::gguf::GgufFile;
use hearth_engine::formats::hf::{self, export::ExportDtype};
use hearth_engine::models::{FloatWeights, ForwardScratch, LoadOptions, Model, RopeLayout, Session};
use hearth_engine::tokenizer_spec;
use hearth_protocol::chat::{ChatMessage, ChatTemplate};
use hearth_protocol::tokenizer::Tokenizer;

const GOLDEN_QUESTION: &str = "What is the capital of France? Answer in one sentence.";
const GOLDEN_ANSWER: [u32; 8] = [504, 3575, 282, 4649, 314, 7042, 30, 2];

fn export(dtype: ExportDtype, shards: usize, name: &str) -> TempDir {
    let dir = TempDir::new(name);
    let g = GgufFile::open(&crate::harness::default_model()).unwrap();
    hf::export::export(&g, &dir.0, dtype, shards).unwrap();
    dir
}

fn golden_ids(file: &GgufFile) -> Vec<u32> {
    let spec = tokenizer_spec(file).unwrap();
    let tok = Tokenizer::from_spec(&spec).unwrap();
    let tmpl = ChatTemplate::new(spec.chat_template.as_deref().unwrap(), "<|im_start|>", "<|im_end|>").unwrap();
    let text = tmpl.render(&[ChatMessage::new("user", GOLDEN_QUESTION)], true).unwrap();
    tok.encode(&text)
}

fn greedy(model: &Model, ids: &[u32]) -> Vec<u32> {
    let mut s = Session::new(model, 128, ForwardScratch::default());
    let mut logits = s.feed(ids);
    let mut out = Vec::new();
    for _ in 0..12 {
        let t = (0..logits.len())
            .max_by(|&a, &b| logits[a].total_cmp(&logits[b]))
            .unwrap() as u32;
        out.push(t);
        if t == 2 {
            break;
        }
        logits = s.feed(&[t]);
    }
    out
}

#[test]
fn f32_export_gives_the_gguf_logits() {
    // Float activations on both sides and weights dequantized exactly: any difference is a
    // layout error (Q/K un-permuting, rotate-half RoPE, names, transposition).
    let dir = export(ExportDtype::F32, 1, "f32");
    let gguf = Model::load(GgufFile::open(&crate::harness::default_model()).unwrap()).unwrap();
    let hfm = Model::load(hf::open(&dir.0).unwrap()).unwrap();
    assert_eq!(hfm.config.rope_layout, RopeLayout::Halves);
    assert_eq!(gguf.config.rope_layout, RopeLayout::Adjacent);
    assert_eq!(
        Model::load(hf::open(&dir.0).unwrap()).unwrap().n_params(),
        gguf.n_params()
    );
    let ids = golden_ids(gguf.file());
    assert_eq!(golden_ids(hfm.file()), ids, "the tokenizer from tokenizer.json");
    let a = Session::new(&gguf, 64, ForwardScratch::precise()).feed(&ids);
    let b = Session::new(&hfm, 64, ForwardScratch::precise()).feed(&ids);
    let worst = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
    eprintln!("max |logit difference| GGUF vs safetensors F32: {worst}");
    assert!(worst < 1e-3, "logits differ by {worst}");
}

/// F16 and BF16 checkpoints answer the golden prompt both ways float weights are computed:
/// quantized to Q8_0 at load (the default) and multiplied as floats.
#[test]
fn sharded_f16_export_answers_the_golden_prompt() {
    let dir = export(ExportDtype::F16, 3, "f16");
    assert!(dir.0.join("model.safetensors.index.json").exists());
    assert!(dir.0.join("model-00003-of-00003.safetensors").exists());
    let file = hf::open(&dir.0).unwrap();
    assert_eq!(file.tensor("blk.0.attn_q.weight").unwrap().dims, [576, 576]);
    let ids = golden_ids(&file);
    // BF16 only rounds more: the same answer.
    let bf16 = export(ExportDtype::BF16, 1, "bf16");
    for dir in [&dir, &bf16] {
        for float in [FloatWeights::Q8_0, FloatWeights::Float] {
            let model = Model::load_options(
                hf::open(&dir.0).unwrap(),
                LoadOptions {
                    pack_cache: hearth_engine::kernels::pack_cache::PackCache::OFF,
                    float_weights: float,
                    ..Default::default()
                },
            )
            .unwrap();
            assert_eq!(
                model.packed_bytes() > 0,
                float == FloatWeights::Q8_0 && hearth_engine::kernels::isa().is_simd()
            );
            assert_eq!(
                greedy(&model, &ids),
                GOLDEN_ANSWER,
                "{} with float weights {float:?}",
                dir.0.display()
            );
        }
    }
}

#[test]
fn hearth_tokenizer_matches_the_tokenizers_crate_on_tokenizer_json() {
    let dir = TempDir::new("tok");
    let g = GgufFile::open(&crate::harness::default_model()).unwrap();
    hf::export::export(&g, &dir.0, ExportDtype::F16, 1).unwrap();
    let hearth = Tokenizer::from_spec(&tokenizer_spec(&hf::open(&dir.0).unwrap()).unwrap()).unwrap();
    let reference = tokenizers::Tokenizer::from_file(dir.0.join("tokenizer.json")).unwrap();
    let corpus = [
        "Hello world! 12345",
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
        "  leading spaces,\ttabs\tand\n\n\nnewlines   ",
        "It's we're they'll I'd you've she'S DON'T",
        "Ünïcödé: naïve café, 日本語のテキスト, Ελληνικά, русский, العربية",
        "emoji 🤖🔥👩‍👩‍👧 and symbols ∑∫√ ≠ ≤ → ←",
        "fn main() { let x: Vec<u8> = vec![1, 2, 3]; println!(\"{x:?}\"); }",
        "def f(a, b=3.14159):\n    return a ** b  # 2024-11-30T12:00:00Z",
        "<|endoftext|>special<|im_end|>inside<|im_start|>text",
        "numbers 0.5 1,000,000 -42 3e10 0x1F 007",
        "\u{0}\u{1}\u{7f} control bytes \r\n windows",
        "",
        "a",
        "   ",
    ];
    let mut long = String::new();
    for i in 0..200 {
        long.push_str(&format!("word{i} {} ", "xyz".repeat(i % 7)));
    }
    for text in corpus.iter().copied().chain([long.as_str()]) {
        let want = reference.encode(text, false).unwrap().get_ids().to_vec();
        let got = hearth.encode(text);
        assert_eq!(got, want, "{text:?}");
        assert_eq!(
            hearth.decode(&got, false).unwrap(),
            reference.decode(&want, false).unwrap(),
            "decode {text:?}"
        );
    }
}

fn write(path: &Path, text: &str) {
    std::fs::write(path, text).unwrap();
}

#[test]
fn broken_directories_are_refused_with_the_reason() {
    let dir = export(ExportDtype::F16, 2, "broken");
    let err = |d: &Path| hf::open(d).err().map(|e| e.to_string()).unwrap_or_default();
    let shard = dir.0.join("model-00002-of-00002.safetensors");
    let bytes = std::fs::read(&shard).unwrap();

    // Truncated shard.
    std::fs::write(&shard, &bytes[..bytes.len() / 2]).unwrap();
    let e = err(&dir.0);
    assert!(
        e.contains("model-00002-of-00002.safetensors") && e.contains("truncated or corrupt"),
        "{e}"
    );
    // Corrupt header.
    let mut bad = bytes.clone();
    bad[8..16].copy_from_slice(b"garbage!");
    std::fs::write(&shard, &bad).unwrap();
    assert!(err(&dir.0).contains("not a valid safetensors file"), "{}", err(&dir.0));
    // Missing shard.
    std::fs::remove_file(&shard).unwrap();
    assert!(
        err(&dir.0).contains("model-00002-of-00002.safetensors"),
        "{}",
        err(&dir.0)
    );
    std::fs::write(&shard, &bytes).unwrap();
    assert!(hf::open(&dir.0).is_ok());

    // Unsupported architecture and options are named.
    let cfg_path = dir.0.join("config.json");
    let cfg = std::fs::read_to_string(&cfg_path).unwrap();
    write(&cfg_path, &cfg.replace("\"llama\"", "\"mamba\""));
    assert!(err(&dir.0).contains("model_type \"mamba\""), "{}", err(&dir.0));
    write(
        &cfg_path,
        &cfg.replace(
            "\"rope_scaling\": null",
            "\"rope_scaling\": {\"type\": \"dynamic\", \"factor\": 2}",
        ),
    );
    let e = err(&dir.0);
    assert!(e.contains("rope_scaling") && e.contains("dynamic"), "{e}");
    write(&cfg_path, &cfg.replace("\"silu\"", "\"gelu\""));
    assert!(err(&dir.0).contains("hidden_act \"gelu\""), "{}", err(&dir.0));
    write(&cfg_path, "{not json");
    assert!(err(&dir.0).contains("not valid JSON"), "{}", err(&dir.0));
    write(&cfg_path, &cfg);

    // A tokenizer Hearth cannot reproduce exactly is refused, not approximated.
    let tok_path = dir.0.join("tokenizer.json");
    let tok = std::fs::read_to_string(&tok_path).unwrap();
    write(
        &tok_path,
        &tok.replace("\"byte_fallback\": false", "\"byte_fallback\": true"),
    );
    assert!(err(&dir.0).contains("byte-fallback BPE"), "{}", err(&dir.0));
    write(
        &tok_path,
        &tok.replacen("\"type\": \"Split\"", "\"type\": \"Punctuation\"", 1),
    );
    assert!(err(&dir.0).contains("pre-tokenizer"), "{}", err(&dir.0));
    // A pattern that is no known pre-tokenizer's.
    write(&tok_path, &tok.replacen("\\\\p{N}\"", "\\\\p{N}{1,5}\"", 1));
    assert!(err(&dir.0).contains("pre-tokenizer"), "{}", err(&dir.0));
    write(&tok_path, &tok);
    assert!(hf::open(&dir.0).is_ok());
}

/// Every family's synthetic model (`bench/synth-model --shape FAMILY-tiny`) exported to a
/// Hugging Face directory (F32: exact) and loaded back gives the GGUF's logits and greedy
/// tokens: names, Gemma's norm shift and post-norms, Phi-3's fused tensors, Qwen's biases and
/// Q/K norms, Llama 3's `rope_scaling` recovered from `rope_freqs`, windows and soft-caps in
/// `config.json`; per-expert tensors, routers, selection biases and shared experts; latent
/// attention's `kv_b_proj` (split per head again at load) and DeepSeek's YaRN `mscale`.
#[test]
fn every_family_round_trips_through_safetensors() {
    for (family, _) in crate::harness::FAMILIES.iter().chain(&crate::harness::MOE_FAMILIES) {
        let (_, path) = crate::harness::synth(&["--shape", &format!("{family}-tiny"), "--types", "f16"]).remove(0);
        let dir = TempDir::new(&format!("family-{family}"));
        let g = GgufFile::open(&path).unwrap();
        hf::export::export(&g, &dir.0, ExportDtype::F32, 2).unwrap();
        let opts = LoadOptions {
            pack_cache: hearth_engine::kernels::pack_cache::PackCache::OFF,
            float_weights: FloatWeights::Float,
            ..Default::default()
        };
        let gguf = Model::load_options(g, opts.clone()).unwrap();
        let hfm = Model::load_options(hf::open(&dir.0).unwrap(), opts).unwrap();
        assert_eq!(hfm.config.arch, gguf.config.arch, "{family}");
        let mut a = gguf.config.clone();
        let mut b = hfm.config.clone();
        // What differs by format only: the RoPE pairing of `llama` files, the norm shift,
        // and Llama 3's scaling (a tensor in GGUF, parameters in config.json).
        a.rope_layout = b.rope_layout;
        b.norm_shift = a.norm_shift;
        b.rope_scaling = a.rope_scaling;
        // Gemma's query scale travels as `query_pre_attn_scalar` (its inverse square).
        assert!((a.block.attn_scale - b.block.attn_scale).abs() < 1e-6, "{family}");
        b.block.attn_scale = a.block.attn_scale;
        assert_eq!(a, b, "{family}: configuration");
        let ids: Vec<u32> = (0..48u32).map(|i| (i * 7919 + 13) % 1000 + 100).collect();
        let mut sa = Session::new(&gguf, 128, ForwardScratch::precise());
        let mut sb = Session::new(&hfm, 128, ForwardScratch::precise());
        let (la, lb) = (sa.feed(&ids), sb.feed(&ids));
        let scale = la.iter().fold(0f32, |m, v| m.max(v.abs()));
        let worst = la.iter().zip(&lb).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(
            worst <= 1e-3 * scale,
            "{family}: logits differ by {worst} (scale {scale})"
        );
        assert_eq!(
            greedy_n(&gguf, &ids, 16),
            greedy_n(&hfm, &ids, 16),
            "{family}: greedy tokens"
        );
    }
}

fn greedy_n(model: &Model, ids: &[u32], n: usize) -> Vec<u32> {
    let mut s = Session::new(model, 128, ForwardScratch::precise());
    let mut logits = s.feed(ids);
    (0..n)
        .map(|_| {
            let t = hearth_engine::step::sampling::argmax(&logits);
            logits = s.feed(&[t]);
            t
        })
        .collect()
}

/// DeepSeek-V3 checkpoints carry multi-token-prediction layers after the model's own, which
/// are left out (as llama.cpp's converter does); a routing Hearth does not compute is refused
/// by name rather than approximated.
#[test]
fn deepseek_checkpoints_skip_prediction_layers_and_name_unsupported_routing() {
    let (_, path) = crate::harness::synth(&["--shape", "deepseek2-tiny", "--types", "f16"]).remove(0);
    let dir = TempDir::new("deepseek-mtp");
    let g = GgufFile::open(&path).unwrap();
    let layers = hearth_engine::models::ModelConfig::from_gguf(&g).unwrap().n_layers;
    hf::export::export(&g, &dir.0, ExportDtype::F16, 2).unwrap();
    let err = |d: &Path| hf::open(d).err().map(|e| e.to_string()).unwrap_or_default();

    // An extra layer's tensor in a shard of its own, listed by the index.
    let extra = format!("model.layers.{layers}.eh_proj.weight");
    let bytes = vec![0u8; 2 * 256 * 256];
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F16, vec![256, 256], &bytes).unwrap();
    safetensors::serialize_to_file(vec![(extra.clone(), view)], None, &dir.0.join("mtp.safetensors")).unwrap();
    let index_path = dir.0.join("model.safetensors.index.json");
    let mut index: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&index_path).unwrap()).unwrap();
    index["weight_map"][&extra] = "mtp.safetensors".into();
    write(&index_path, &index.to_string());
    assert!(err(&dir.0).contains(&extra), "{}", err(&dir.0));
    let cfg_path = dir.0.join("config.json");
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    cfg["num_nextn_predict_layers"] = 1.into();
    write(&cfg_path, &cfg.to_string());
    let view = hf::open(&dir.0).unwrap();
    assert!(view
        .tensors
        .iter()
        .all(|t| !t.name.starts_with(&format!("blk.{layers}."))));
    // Loaded as served (repacked, originals released; the keys split from `kv_b_proj` live
    // in memory, which must not be released), it answers as the GGUF file does.
    let ids: Vec<u32> = (0..24u32).map(|i| (i * 7919 + 13) % 1000 + 100).collect();
    assert_eq!(
        greedy_n(&Model::load(view).unwrap(), &ids, 8),
        greedy_n(&Model::load(GgufFile::open(&path).unwrap()).unwrap(), &ids, 8)
    );

    // DeepSeek-V2's group-limited greedy routing (a group scores its single best expert).
    cfg["topk_method"] = "group_limited_greedy".into();
    write(&cfg_path, &cfg.to_string());
    let e = err(&dir.0);
    assert!(e.contains("topk_method \"group_limited_greedy\""), "{e}");
    cfg["topk_method"] = "noaux_tc".into();
    cfg["scoring_func"] = "tanh".into();
    write(&cfg_path, &cfg.to_string());
    assert!(err(&dir.0).contains("scoring_func \"tanh\""), "{}", err(&dir.0));
}

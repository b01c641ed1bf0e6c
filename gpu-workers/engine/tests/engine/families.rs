//! Every dense family through the engine's machinery, on its synthetic model
//! (`bench/synth-model --shape FAMILY-tiny`, Q8_0): speculative decoding gives the greedy
//! tokens without it, the prefix cache reuses a prompt and continues identically, KV blocks
//! moved to another engine (disaggregation) continue exactly as colocated, and a grammar
//! constrains the output — the same checks the default model has, for windows, soft-caps,
//! Q/K norms, biases and fused projections.

use hearth_engine::{EngineConfig, EngineHandle};
use hearth_protocol::{Constraint, SamplingParams, Tokenizer};

/// Greedy tokens and the cached-token count.
async fn generate(
    e: &EngineHandle,
    prompt: &[u32],
    max_tokens: u32,
    speculative: bool,
    constraint: Option<Constraint>,
) -> (Vec<u32>, u32) {
    let sampling = SamplingParams {
        temperature: 0.0,
        max_tokens,
        ignore_eos: constraint.is_none(),
        speculative,
        ..Default::default()
    };
    let (tokens, usage) = crate::harness::generate(e, prompt, sampling, constraint).await.unwrap();
    (tokens, usage.cached_tokens)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_family_serves_through_the_engine() {
    for (family, arch) in crate::harness::FAMILIES {
        let (_, path) = crate::harness::synth(&["--shape", &format!("{family}-tiny"), "--types", "q8_0"]).remove(0);
        let cfg = EngineConfig {
            threads: 2,
            kv_cache_mib: Some(32),
            ..Default::default()
        };
        let a = EngineHandle::load(&path, "m", &cfg).unwrap();
        assert_eq!(a.info().architecture, arch);
        let tok = Tokenizer::from_spec(&a.info().tokenizer).unwrap();
        // A prompt crossing the Gemma models' 32-token windows, in blocks of 16.
        let prompt = tok.encode(&"The quick brown fox jumps over the lazy dog. ".repeat(8));
        assert!(prompt.len() > 64, "{}", prompt.len());
        let (want, cached) = generate(&a, &prompt, 24, false, None).await;
        assert_eq!(cached, 0);
        let (spec, _) = generate(&a, &prompt, 24, true, None).await;
        assert_eq!(spec, want, "{family}: speculative decoding");
        let (again, cached) = generate(&a, &prompt, 24, false, None).await;
        assert!(
            cached as usize >= (prompt.len() - 1) / 16 * 16 - 16,
            "{family}: cached {cached}"
        );
        assert_eq!(again, want, "{family}: from the prefix cache");

        let b = EngineHandle::load(&path, "m", &cfg).unwrap();
        let hashes = a.prompt_block_hashes(&prompt, "");
        let blocks: Vec<_> = a
            .export_blocks(hashes.clone())
            .await
            .unwrap()
            .into_iter()
            .flatten()
            .collect();
        assert_eq!(blocks.len(), hashes.len());
        let report = b.import_blocks(a.kv_layout(), blocks).await.unwrap();
        assert_eq!(report.imported, hashes.len(), "{family}: {report:?}");
        let (moved, cached) = generate(&b, &prompt, 24, false, None).await;
        assert_eq!(cached as usize, hashes.len() * 16);
        assert_eq!(moved, want, "{family}: continued from imported blocks");

        let grammar = Constraint::Lark {
            grammar: r#"start: "yes" | "no""#.into(),
        };
        let (out, _) = generate(&a, &prompt, 8, false, Some(grammar)).await;
        let words: Vec<u32> = out.into_iter().filter(|&t| !tok.is_special(t)).collect();
        let text = tok.decode(&words, false).unwrap();
        assert!(text == "yes" || text == "no", "{family}: {text:?} ({words:?})");
    }
}

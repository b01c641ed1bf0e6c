//! The default model's context stretched by RoPE scaling, as an operator sets it
//! (`--rope-scaling yarn:4 --context-length 32768`): the golden answer is unchanged, a
//! 30,000-token prompt is served, a longer one is refused with the context error, and a
//! context past the model's without scaling is refused at load with the setting to use.

use hearth_engine::formats::fetch::DEFAULT_MODEL_ID;
use hearth_engine::models::RopeScaling;
use hearth_engine::{EngineConfig, EngineHandle};
use hearth_protocol::{ChatMessage, ChatTemplate, SamplingParams, Tokenizer, Usage};

/// Greedy generation: the tokens, the usage, or the error's code.
async fn generate(e: &EngineHandle, prompt: Vec<u32>, max_tokens: u32) -> Result<(Vec<u32>, Usage), String> {
    let sampling = SamplingParams {
        temperature: 0.0,
        max_tokens,
        ..Default::default()
    };
    crate::harness::generate(e, &prompt, sampling, None).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn yarn_stretches_the_default_model_to_32k_tokens() {
    let cfg = EngineConfig {
        rope_scaling: Some(RopeScaling::parse("yarn:4").unwrap()),
        max_context: Some(32768),
        kv_cache_mib: Some(800),
        ..Default::default()
    };
    let engine = EngineHandle::load(&crate::harness::default_model(), DEFAULT_MODEL_ID, &cfg).unwrap();
    assert_eq!(engine.info().context_length, 32768);
    assert!(engine.kv_capacity_tokens() >= 32768, "{}", engine.kv_capacity_tokens());

    // The golden prompt: YaRN keeps the high frequencies that short contexts use.
    let spec = &engine.info().tokenizer;
    let tok = Tokenizer::from_spec(spec).unwrap();
    let tmpl = ChatTemplate::for_tokenizer(spec.chat_template.as_deref().unwrap(), &tok).unwrap();
    let text = tmpl
        .render(
            &[ChatMessage::new(
                "user",
                "What is the capital of France? Answer in one sentence.",
            )],
            true,
        )
        .unwrap();
    let (out, _) = generate(&engine, tok.encode(&text), 16).await.unwrap();
    assert_eq!(
        tok.decode(&out, false).unwrap(),
        "The capital of France is Paris.<|im_end|>"
    );

    // A 30,000-token prompt (a long document, then a question), served to the end.
    let mut ids = tok.encode("<|im_start|>user\n");
    let paragraph = tok.encode(
        "The Hearth platform serves language models to many tenants at once. Each request is \
         authenticated, limited, routed to a worker that may already hold its prefix, and metered. ",
    );
    while ids.len() + paragraph.len() < 29_950 {
        ids.extend(&paragraph);
    }
    ids.extend(tok.encode("\nWhat does the platform do with each request?<|im_end|>\n<|im_start|>assistant\n"));
    let filler = tok.encode(" x");
    while ids.len() < 30_000 {
        ids.insert(1, filler[0]);
    }
    assert_eq!(ids.len(), 30_000);
    let (out, usage) = generate(&engine, ids.clone(), 8).await.unwrap();
    assert_eq!(usage.prompt_tokens, 30_000);
    assert!(!out.is_empty() && out.len() <= 8, "{out:?}");
    eprintln!("30,000-token prompt answered: {:?}", tok.decode(&out, false));

    // Past the stretched context: refused, not truncated.
    ids.extend(std::iter::repeat_n(filler[0], 2800));
    assert_eq!(generate(&engine, ids, 8).await.unwrap_err(), "context_length_exceeded");
}

#[test]
fn a_context_past_the_model_needs_rope_scaling() {
    let cfg = EngineConfig {
        max_context: Some(32768),
        kv_cache_mib: Some(64),
        ..Default::default()
    };
    let err = EngineHandle::load(&crate::harness::default_model(), DEFAULT_MODEL_ID, &cfg)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("32768") && err.contains("8192") && err.contains("--rope-scaling"),
        "{err}"
    );
}

//! Steps cut short between layers (fair scheduling): an interactive request arriving while
//! the engine prefills batch work's long prompts cuts the step in progress, and every
//! request — the cut ones included — generates exactly what it generates alone.

use std::path::PathBuf;
use std::time::Duration;

use hearth_engine::fetch::{ensure_model, hearth_home, DEFAULT_MODEL_ID};
use hearth_engine::{EngineConfig, EngineHandle};
use hearth_protocol::{GenerateRequest, Priority, Qos, SamplingParams};

mod common;

fn model_path() -> PathBuf {
    ensure_model(DEFAULT_MODEL_ID, &hearth_home(), &mut |m| eprintln!("{m}")).expect("default model")
}

/// Prompts of `n` ordinary tokens, different for each `seed`.
fn prompt(seed: u32, n: u32) -> Vec<u32> {
    (0..n).map(|i| 300 + (i * 37 + seed * 1009) % 5000).collect()
}

fn request(id: &str, prompt: Vec<u32>, tenant: &str, priority: Priority) -> GenerateRequest {
    GenerateRequest {
        request_id: id.into(),
        model: DEFAULT_MODEL_ID.into(),
        prompt,
        sampling: SamplingParams {
            temperature: 0.0,
            max_tokens: 6,
            ignore_eos: true,
            ..Default::default()
        },
        // Its own namespace: nothing is shared through the prefix cache.
        cache_namespace: id.into(),
        n: 1,
        prefill_only: false,
        resume: Vec::new(),
        kv_source: None,
        qos: Qos {
            tenant: tenant.into(),
            priority,
            ..Default::default()
        },
        constraint: None,
        adapter: None,
    }
}

async fn greedy(e: EngineHandle, req: GenerateRequest) -> Vec<u32> {
    common::run_request(&e, req).await.expect("the request succeeds").0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interactive_request_cuts_a_batch_prefill_step_and_nothing_changes_its_output() {
    let m = model_path();
    let cfg = EngineConfig {
        threads: 2,
        // Long steps: 128 tokens of the batch work's 384-token prompts each.
        max_batch_tokens: 128,
        ..Default::default()
    };
    let e = EngineHandle::load(&m, DEFAULT_MODEL_ID, &cfg).unwrap();
    let mut runs = Vec::new();
    for round in 0..10u32 {
        let flood: Vec<_> = (0..3)
            .map(|k| {
                let p = prompt(round * 10 + k, 384);
                let req = request(&format!("f{round}-{k}"), p.clone(), "bulk", Priority::Batch);
                (tokio::spawn(greedy(e.clone(), req)), p)
            })
            .collect();
        // Into the batch prefill, then the interactive request.
        tokio::time::sleep(Duration::from_millis(40)).await;
        let p = prompt(1000 + round, 24);
        let req = request(&format!("s{round}"), p.clone(), "chat", Priority::Interactive);
        let steady = tokio::spawn(greedy(e.clone(), req));
        runs.push((steady.await.unwrap(), p));
        for (h, p) in flood {
            runs.push((h.await.unwrap(), p));
        }
        if e.metrics().steps_cut.get() > 0 && round >= 1 {
            break;
        }
    }
    assert!(
        e.metrics().steps_cut.get() > 0,
        "no step was cut in 10 rounds of an interactive request arriving mid-prefill"
    );
    // Each alone, on a fresh engine: the same tokens.
    let alone = EngineHandle::load(&m, DEFAULT_MODEL_ID, &cfg).unwrap();
    for (i, (got, p)) in runs.into_iter().enumerate() {
        let want = greedy(
            alone.clone(),
            request(&format!("alone{i}"), p, "solo", Priority::Interactive),
        )
        .await;
        assert_eq!(got, want, "request {i} generated what it generates alone");
    }
}

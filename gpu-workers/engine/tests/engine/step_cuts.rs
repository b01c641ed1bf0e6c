//! Steps cut short between layers (fair scheduling): an interactive request arriving while
//! the engine prefills batch work's long prompts cuts the step in progress, and every
//! request — the cut ones included — generates exactly what it generates alone. And the
//! step profile (`hearth_engine_step_*`, `hearth_engine_thread_seconds_total`) counts what
//! the steps computed.

use std::sync::Arc;
use std::time::{Duration, Instant};

use hearth_engine::formats::fetch::DEFAULT_MODEL_ID;
use hearth_engine::worker::metrics::EngineCollector;
use hearth_engine::{Backend, EngineConfig, EngineHandle};
use hearth_protocol::{GenerateRequest, Priority, Qos, SamplingParams};

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
    crate::harness::run_request(&e, req)
        .await
        .expect("the request succeeds")
        .0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interactive_request_cuts_a_batch_prefill_step_and_nothing_changes_its_output() {
    let m = crate::harness::default_model();
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_step_profile_counts_each_step_by_kind_with_its_rows() {
    let m = crate::harness::default_model();
    let cfg = EngineConfig {
        threads: 1,
        max_batch_tokens: 16,
        speculative_tokens: 0,
        ..Default::default()
    };
    let e = EngineHandle::load(&m, DEFAULT_MODEL_ID, &cfg).unwrap();
    let started = Instant::now();
    let out = greedy(e.clone(), request("p", prompt(7, 40), "t", Priority::Interactive)).await;
    assert_eq!(out.len(), 6);
    let mut registry = prometheus_client::registry::Registry::default();
    let backend: Arc<dyn Backend> = Arc::new(e.clone());
    registry.register_collector(Box::new(EngineCollector::new(vec![("w".into(), backend)])));
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    // Every time the text counts was spent before it was read.
    let elapsed = started.elapsed().as_secs_f64();
    let series = hearth_engine::worker::metrics::series_sum;
    let kind = |name: &str, k: &str| series(&text, name, &format!("kind=\"{k}\""));
    // 40 prompt tokens in 16-token steps (16, 16, 8; the last gives the first token), then
    // one decode step for each of the other 5 tokens.
    assert_eq!(kind("hearth_engine_step_seconds_count", "prompt"), 3.0, "prompt steps");
    assert_eq!(kind("hearth_engine_step_rows_total", "prompt"), 40.0);
    assert_eq!(kind("hearth_engine_step_seconds_count", "decode"), 5.0, "decode steps");
    assert_eq!(kind("hearth_engine_step_rows_total", "decode"), 5.0);
    let phase = |p: &str| series(&text, "hearth_engine_thread_seconds_total", &format!("phase=\"{p}\""));
    let steps = series(&text, "hearth_engine_step_seconds_sum", "");
    assert!(steps > 0.0);
    assert!(phase("forward") + 1e-9 >= steps, "the forward phase holds every step");
    for p in ["plan", "sample", "commands", "publish"] {
        assert!(phase(p) > 0.0, "the {p} phase was timed");
    }
    // One thread, each moment counted once: the phases fit in the request's time.
    let busy: f64 = ["plan", "forward", "sample", "commands", "publish"]
        .map(phase)
        .iter()
        .sum();
    assert!(busy <= elapsed, "the phases add up to {busy} s in {elapsed} s");
}

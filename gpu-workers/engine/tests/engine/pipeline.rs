//! Pipeline parallelism: a model split by layers over stages that talk over TCP gives the
//! single process's greedy tokens — plain, speculative and grammar-constrained — for every
//! family on 2 stages (3 where the synthetic model has the layers); a group refuses a
//! stranger, a different file, a wrong token and garbage on its port, and serves on.

use std::net::{TcpListener, TcpStream};
use std::path::Path;

use hearth_engine::models::{LoadOptions, Model, StagePlan};
use hearth_engine::pipeline::stage::{serve, StageOptions};
use hearth_engine::pipeline::PipelineConfig;
use hearth_engine::{EngineConfig, EngineHandle};
use hearth_protocol::{Constraint, SamplingParams, Tokenizer};

/// Starts stages 2..=n of `path` in this process (each its own thread and TCP port).
fn followers(path: &Path, n: usize, token: Option<&str>) -> Vec<String> {
    (2..=n)
        .map(|k| follower(path, StagePlan::Balanced { index: k - 1, count: n }, token))
        .collect()
}

fn follower(path: &Path, plan: StagePlan, token: Option<&str>) -> String {
    let file = hearth_engine::formats::hf::open_model(path).unwrap();
    let model = Model::load_options(
        file,
        LoadOptions {
            stage: Some(plan),
            ..LoadOptions::default()
        },
    )
    .unwrap();
    let opts = StageOptions {
        fingerprint: hearth_engine::models::stage::fingerprint(model.file()),
        token: token.map(str::to_string),
        kv_cache_mib: Some(64),
        threads: 1,
    };
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    std::thread::spawn(move || serve(listener, model, opts));
    addr
}

fn leader_cfg(n: usize, next: Vec<String>, token: Option<&str>) -> EngineConfig {
    let mut p = PipelineConfig::new(next, token.map(str::to_string));
    p.connect_timeout = std::time::Duration::from_secs(20);
    EngineConfig {
        threads: 1,
        kv_cache_mib: Some(32),
        stage: Some(StagePlan::Balanced { index: 0, count: n }),
        pipeline: Some(p),
        ..Default::default()
    }
}

async fn greedy(e: &EngineHandle, prompt: &[u32], speculative: bool, constraint: Option<Constraint>) -> Vec<u32> {
    let sampling = SamplingParams {
        temperature: 0.0,
        max_tokens: if constraint.is_some() { 8 } else { 24 },
        ignore_eos: constraint.is_none(),
        speculative,
        ..Default::default()
    };
    crate::harness::generate(e, prompt, sampling, constraint)
        .await
        .unwrap()
        .0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_family_gives_the_single_process_tokens_on_two_and_three_stages() {
    let families = crate::harness::FAMILIES.iter().chain(&crate::harness::MOE_FAMILIES);
    for (family, _) in families {
        let (_, path) = crate::harness::synth(&["--shape", &format!("{family}-tiny"), "--types", "q8_0"]).remove(0);
        let one = EngineHandle::load(
            &path,
            "m",
            &EngineConfig {
                threads: 2,
                kv_cache_mib: Some(32),
                ..Default::default()
            },
        )
        .unwrap();
        let tok = Tokenizer::from_spec(&one.info().tokenizer).unwrap();
        // A prompt of several blocks (and past the Gemma models' 32-token windows), whose
        // prefill is cut into micro-batches.
        let prompt = tok.encode(&"The quick brown fox jumps over the lazy dog. ".repeat(8));
        let grammar = || Constraint::Lark {
            grammar: r#"start: "yes" | "no""#.into(),
        };
        let want = greedy(&one, &prompt, false, None).await;
        // Streams at once (lanes of steps in flight on a group), each as it runs alone.
        let prompts: Vec<Vec<u32>> = (1..=5)
            .map(|i| tok.encode(&"Pack my box with five dozen jugs. ".repeat(i)))
            .collect();
        let mut alone = Vec::new();
        for p in &prompts {
            alone.push(greedy(&one, p, false, None).await);
        }
        let want_constrained = greedy(&one, &prompt, false, Some(grammar())).await;
        let layers =
            hearth_engine::models::ModelConfig::from_gguf(&hearth_engine::formats::hf::open_model(&path).unwrap())
                .unwrap()
                .n_layers;
        for n in [2, 3] {
            if n > layers {
                // More stages than layers is refused by name.
                let err = EngineHandle::load(&path, "m", &leader_cfg(n, vec!["127.0.0.1:1".into(); n - 1], None))
                    .unwrap_err()
                    .to_string();
                assert!(err.contains("a stage needs at least one layer"), "{err}");
                continue;
            }
            let token = Some("group-secret");
            let next = followers(&path, n, token);
            let group = EngineHandle::load(&path, "m", &leader_cfg(n, next, token)).unwrap();
            assert_eq!(
                greedy(&group, &prompt, false, None).await,
                want,
                "{family} on {n} stages"
            );
            let together = futures_util::future::join_all(prompts.iter().map(|p| greedy(&group, p, false, None))).await;
            assert_eq!(together, alone, "{family} on {n} stages, streams at once");
            assert_eq!(
                greedy(&group, &prompt, true, None).await,
                want,
                "{family} on {n} stages, speculative"
            );
            // Again: from the prefix cache, whose blocks every stage holds.
            assert_eq!(
                greedy(&group, &prompt, false, None).await,
                want,
                "{family} on {n} stages, cached"
            );
            assert_eq!(
                greedy(&group, &prompt, false, Some(grammar())).await,
                want_constrained,
                "{family} on {n} stages, constrained"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_refuses_strangers_and_serves_on() {
    let (_, path) = crate::harness::synth(&["--shape", "llama3-tiny", "--types", "q8_0"]).remove(0);
    let (_, other) = crate::harness::synth(&["--shape", "qwen3moe-tiny", "--types", "q8_0"]).remove(0);
    let token = Some("group-secret");
    let stage2 = followers(&path, 2, token).remove(0);
    let err = |cfg: EngineConfig, model: &Path| EngineHandle::load(model, "m", &cfg).unwrap_err().to_string();

    // Without the token, or with another: refused, and the stage stays up.
    let e = err(leader_cfg(2, vec![stage2.clone()], None), &path);
    assert!(e.contains("token was not proved"), "{e}");
    let e = err(leader_cfg(2, vec![stage2.clone()], Some("guess")), &path);
    assert!(e.contains("token was not proved"), "{e}");
    // A leader of another model: refused by the file's fingerprint.
    let e = err(
        EngineConfig {
            stage: Some(StagePlan::Layers(0..1)),
            ..leader_cfg(2, vec![stage2.clone()], token)
        },
        &other,
    );
    assert!(e.contains("a different model file"), "{e}");
    // Layers that do not follow the leader's (0..1, then a stage of 0..2).
    let overlap = follower(&path, StagePlan::Layers(0..2), token);
    let e = err(leader_cfg(2, vec![overlap], token), &path);
    assert!(e.contains("must follow each other"), "{e}");
    // Garbage and a cut-short frame on the stage's port: the connection is dropped.
    for junk in [&b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"[..], &b"HPS1\x02\0\0\0"[..]] {
        use std::io::Write;
        let mut s = TcpStream::connect(&stage2).unwrap();
        let _ = s.write_all(junk);
        drop(s);
    }
    // The stage still serves its group.
    let group = EngineHandle::load(&path, "m", &leader_cfg(2, vec![stage2], token)).unwrap();
    let tok = Tokenizer::from_spec(&group.info().tokenizer).unwrap();
    let out = greedy(&group, &tok.encode("Hello there"), false, None).await;
    assert_eq!(out.len(), 24);
    // n > 1 (forks share the prompt's blocks; the partial block is copied on every stage,
    // and the choices may fall in different lanes): each choice as on one process, seeded.
    let one = EngineHandle::load(
        &path,
        "m",
        &EngineConfig {
            threads: 1,
            kv_cache_mib: Some(32),
            ..Default::default()
        },
    )
    .unwrap();
    let story = tok.encode("Tell me a story about a dragon and a knight.");
    let choices = |e: EngineHandle| {
        let prompt = story.clone();
        async move {
            let req = hearth_protocol::GenerateRequest {
                request_id: "n3".into(),
                model: "m".into(),
                prompt,
                sampling: SamplingParams {
                    temperature: 0.9,
                    seed: Some(7),
                    max_tokens: 16,
                    ignore_eos: true,
                    ..Default::default()
                },
                cache_namespace: String::new(),
                n: 3,
                prefill_only: false,
                resume: Vec::new(),
                kv_source: None,
                qos: Default::default(),
                constraint: None,
                adapter: None,
            };
            let mut rx = e.generate(req);
            let mut out = vec![Vec::new(); 3];
            while let Some(ev) = rx.recv().await {
                match ev {
                    hearth_protocol::GenerateEvent::Token { index, id, .. } => out[index as usize].push(id),
                    hearth_protocol::GenerateEvent::Done { .. } => break,
                    hearth_protocol::GenerateEvent::Error { message, .. } => panic!("{message}"),
                    hearth_protocol::GenerateEvent::Finish { .. } => {}
                }
            }
            out
        }
    };
    assert_eq!(choices(group.clone()).await, choices(one).await, "n = 3 on a group");
    // Adapters and the prefill side of disaggregation are refused by name.
    let mut req = hearth_protocol::GenerateRequest {
        request_id: "pd".into(),
        model: "m".into(),
        prompt: tok.encode("Hello there"),
        sampling: SamplingParams::default(),
        cache_namespace: String::new(),
        n: 1,
        prefill_only: true,
        resume: Vec::new(),
        kv_source: None,
        qos: Default::default(),
        constraint: None,
        adapter: None,
    };
    assert_eq!(
        crate::harness::run_request(&group, req.clone()).await.unwrap_err(),
        "unsupported"
    );
    req.prefill_only = false;
    req.adapter = Some(hearth_protocol::AdapterRef {
        name: "a".into(),
        digest: "0".repeat(64),
        path: "a".into(),
    });
    assert_eq!(
        crate::harness::run_request(&group, req).await.unwrap_err(),
        "adapter_unavailable"
    );
}

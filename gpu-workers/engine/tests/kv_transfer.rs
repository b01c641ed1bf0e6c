//! Moving a prompt's KV blocks from one engine to another (the engine half of
//! prefill/decode disaggregation): the receiving engine continues exactly as colocated
//! serving does, receives only the blocks it lacks, and computes what arrives corrupted.

use std::path::PathBuf;

use futures_util::StreamExt;
use hearth_engine::fetch::{ensure_model, hearth_home, DEFAULT_MODEL_ID};
use hearth_engine::{EngineConfig, EngineHandle};
use hearth_protocol::{GenerateEvent, GenerateRequest, SamplingParams};

fn model_path() -> PathBuf {
    ensure_model(DEFAULT_MODEL_ID, &hearth_home(), &mut |m| eprintln!("{m}")).expect("default model")
}

fn engine() -> EngineHandle {
    let cfg = EngineConfig {
        threads: 2,
        kv_cache_mib: Some(32),
        ..Default::default()
    };
    EngineHandle::load(&model_path(), DEFAULT_MODEL_ID, &cfg).unwrap()
}

/// A chat-shaped prompt of about 200 tokens (12 full blocks of 16).
fn prompt() -> Vec<u32> {
    let mut p = vec![
        1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407,
    ];
    for i in 0..180u32 {
        p.push(200 + (i * 37) % 5000);
    }
    p.extend([2, 198, 1, 520, 9531, 198]);
    p
}

/// Greedy tokens and the prompt tokens the engine reused from its cache.
async fn greedy(e: &EngineHandle, prompt: &[u32], max_tokens: u32) -> (Vec<u32>, u32) {
    let req = GenerateRequest {
        request_id: "t".into(),
        model: DEFAULT_MODEL_ID.into(),
        prompt: prompt.to_vec(),
        sampling: SamplingParams {
            temperature: 0.0,
            max_tokens,
            ignore_eos: true,
            ..Default::default()
        },
        cache_namespace: String::new(),
        n: 1,
    };
    let mut rx = e.generate(req);
    let mut tokens = Vec::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            GenerateEvent::Token { id, .. } => tokens.push(id),
            GenerateEvent::Done { usage, .. } => return (tokens, usage.cached_tokens),
            GenerateEvent::Error { message, .. } => panic!("{message}"),
            GenerateEvent::Finish { .. } => {}
        }
    }
    panic!("no Done")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn imported_blocks_continue_exactly_as_colocated() {
    let prompt = prompt();
    // Colocated: one engine prefills and decodes.
    let colocated = engine();
    let (want, cached) = greedy(&colocated, &prompt, 12).await;
    assert_eq!(cached, 0);

    // Prefill side: computes the prompt (and its first token), keeps the blocks cached.
    let prefill = engine();
    let (first, _) = greedy(&prefill, &prompt, 1).await;
    assert_eq!(first[0], want[0]);
    let hashes = prefill.prompt_block_hashes(&prompt, "");
    assert_eq!(hashes.len(), (prompt.len() - 1) / 16);
    let blocks: Vec<_> = prefill
        .export_blocks(hashes.clone())
        .await
        .unwrap()
        .into_iter()
        .map(|b| b.expect("every full block is cached on the prefill side"))
        .collect();

    // Decode side: receives the blocks it lacks, then continues.
    let decode = engine();
    assert_eq!(decode.missing_blocks(hashes.clone()).await.unwrap(), hashes);
    let report = decode.import_blocks(prefill.kv_layout(), blocks.clone()).await.unwrap();
    assert_eq!((report.imported, report.already_held), (hashes.len(), 0), "{report:?}");
    assert!(report.rejected.is_empty());
    assert!(decode.missing_blocks(hashes.clone()).await.unwrap().is_empty());
    let (got, cached) = greedy(&decode, &prompt, 12).await;
    assert_eq!(
        cached as usize,
        hashes.len() * 16,
        "the whole imported prefix was reused"
    );
    assert_eq!(got, want, "decoding continues exactly as colocated");

    // Sent again: nothing new is written.
    let again = decode.import_blocks(prefill.kv_layout(), blocks).await.unwrap();
    assert_eq!((again.imported, again.already_held), (0, hashes.len()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_missing_blocks_travel_and_corrupted_ones_are_computed() {
    let prompt = prompt();
    let prefill = engine();
    greedy(&prefill, &prompt, 1).await;
    let hashes = prefill.prompt_block_hashes(&prompt, "");
    // The decode side already holds the first half of the prefix (an earlier request).
    let decode = engine();
    let half = &prompt[..(hashes.len() / 2) * 16 + 1];
    greedy(&decode, half, 1).await;
    let missing = decode.missing_blocks(hashes.clone()).await.unwrap();
    assert_eq!(missing, hashes[hashes.len() / 2..], "only the second half is missing");
    let mut blocks: Vec<_> = prefill
        .export_blocks(missing.clone())
        .await
        .unwrap()
        .into_iter()
        .map(Option::unwrap)
        .collect();
    // One block arrives corrupted: refused by its checksum, and computed by the request.
    let last = blocks.len() - 1;
    blocks[last].data[100] ^= 0x40;
    let report = decode.import_blocks(prefill.kv_layout(), blocks).await.unwrap();
    assert_eq!(report.imported, missing.len() - 1);
    assert_eq!(report.rejected.len(), 1);
    assert_eq!(report.rejected[0].1, "checksum mismatch");
    let colocated = engine();
    let (want, _) = greedy(&colocated, &prompt, 8).await;
    let (got, cached) = greedy(&decode, &prompt, 8).await;
    assert_eq!(got, want);
    assert_eq!(
        cached as usize,
        (hashes.len() - 1) * 16,
        "all but the corrupted block reused"
    );

    // Another layout is refused whole.
    let mut other = prefill.kv_layout();
    other.block_tokens *= 2;
    assert!(decode.import_blocks(other, Vec::new()).await.is_err());
}

/// The workers' shared token in these tests.
const TOKEN: &str = "kv-test-token";

/// Serves `engine` as a worker on a loopback port; its base URL.
async fn serve(engine: EngineHandle) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let engines: Vec<(String, std::sync::Arc<dyn hearth_engine::Backend>)> =
        vec![(DEFAULT_MODEL_ID.into(), std::sync::Arc::new(engine))];
    let app = hearth_engine::server::router_many(engines, "test", Some(TOKEN.into()));
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}")
}

async fn pull(decode_url: &str, source: &str, prompt: &[u32]) -> (u16, serde_json::Value) {
    let resp = reqwest::Client::new()
        .post(format!("{decode_url}/v1/worker/m/{DEFAULT_MODEL_ID}/kv/pull"))
        .bearer_auth(TOKEN)
        .json(&serde_json::json!({"source": source, "prompt": prompt}))
        .send()
        .await
        .unwrap();
    (resp.status().as_u16(), resp.json().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_move_worker_to_worker_over_http() {
    let prompt = prompt();
    let prefill = engine();
    greedy(&prefill, &prompt, 1).await;
    let n = prefill.prompt_block_hashes(&prompt, "").len();
    let prefill_url = serve(prefill).await;
    let decode = engine();
    let decode_url = serve(decode.clone()).await;
    let (status, report) = pull(&decode_url, &prefill_url, &prompt).await;
    assert_eq!(status, 200, "{report}");
    assert_eq!(report["missing"], n);
    assert_eq!(report["import"]["imported"], n, "{report}");
    let (got, cached) = greedy(&decode, &prompt, 8).await;
    assert_eq!(cached as usize, n * 16);
    let (want, _) = greedy(&engine(), &prompt, 8).await;
    assert_eq!(got, want);
    // Pulled again: nothing is missing, nothing travels.
    let (status, report) = pull(&decode_url, &prefill_url, &prompt).await;
    assert_eq!((status, report["missing"].as_u64()), (200, Some(0)));
    // Without the workers' token, neither side moves a block.
    for path in ["kv/pull", "kv/export"] {
        let resp = reqwest::Client::new()
            .post(format!("{decode_url}/v1/worker/m/{DEFAULT_MODEL_ID}/{path}"))
            .json(&serde_json::json!({"source": prefill_url, "prompt": prompt, "hashes": []}))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 401, "{path}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transfer_cut_midway_keeps_what_arrived_and_the_request_completes() {
    use axum::body::{Body, Bytes};
    use hearth_engine::kv_transfer::{encode_block, encode_header};
    let prompt = prompt();
    let prefill = engine();
    greedy(&prefill, &prompt, 1).await;
    let hashes = prefill.prompt_block_hashes(&prompt, "");
    let blocks = prefill.export_blocks(hashes.clone()).await.unwrap();
    // A source that sends the header and three blocks, then drops the connection.
    let mut partial = encode_header(prefill.kv_layout(), hashes.len());
    for (h, b) in hashes.iter().zip(&blocks).take(3) {
        partial.extend(encode_block(*h, b.as_ref()));
    }
    let app = axum::Router::new().route(
        "/v1/worker/m/{model}/kv/export",
        axum::routing::post(move || {
            let partial = partial.clone();
            async move {
                let s = futures_util::stream::iter([Ok::<_, std::io::Error>(Bytes::from(partial))]).chain(
                    futures_util::stream::once(async { Err(std::io::Error::other("the prefill worker died")) }),
                );
                Body::from_stream(s)
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let source = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    let decode = engine();
    let decode_url = serve(decode.clone()).await;
    let (status, report) = pull(&decode_url, &source, &prompt).await;
    assert_eq!(status, 502, "{report}");
    assert!(report["error"].as_str().is_some(), "{report}");
    assert_eq!(report["import"]["imported"], 3, "what arrived intact is kept: {report}");
    // The request completes: the missing blocks are computed.
    let (got, cached) = greedy(&decode, &prompt, 8).await;
    assert_eq!(cached, 3 * 16);
    let (want, _) = greedy(&engine(), &prompt, 8).await;
    assert_eq!(got, want);
}

//! Moving a prompt's KV blocks from one engine to another (the engine half of
//! prefill/decode disaggregation): the receiving engine continues exactly as colocated
//! serving does, receives only the blocks it lacks, and computes what arrives corrupted.
//! Every test runs twice: on the default model, and on a synthetic DeepSeek-V3-shaped
//! model (`bench/synth-model --shape deepseek2-tiny`: latent attention's cache layout,
//! mixture-of-experts layers), whose blocks hold one latent per position.

use std::path::{Path, PathBuf};

use futures_util::StreamExt;
use hearth_engine::formats::fetch::DEFAULT_MODEL_ID;
use hearth_engine::{EngineConfig, EngineHandle};
use hearth_protocol::{GenerateEvent, GenerateRequest, SamplingParams};

/// The synthetic latent-attention, mixture-of-experts model.
fn latent_model_path() -> PathBuf {
    crate::harness::synth(&["--shape", "deepseek2-tiny", "--types", "q8_0"])
        .remove(0)
        .1
}

fn engine(m: &Path) -> EngineHandle {
    let cfg = EngineConfig {
        threads: 2,
        kv_cache_mib: Some(32),
        ..Default::default()
    };
    EngineHandle::load(m, DEFAULT_MODEL_ID, &cfg).unwrap()
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
        prefill_only: false,
        resume: Vec::new(),
        kv_source: None,
        qos: Default::default(),
        constraint: None,
        adapter: None,
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

async fn imported_blocks_continue_exactly_as_colocated(m: &Path) {
    let prompt = prompt();
    // Colocated: one engine prefills and decodes.
    let colocated = engine(m);
    let (want, cached) = greedy(&colocated, &prompt, 12).await;
    assert_eq!(cached, 0);

    // Prefill side: computes the prompt (and its first token), keeps the blocks cached.
    let prefill = engine(m);
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
    let decode = engine(m);
    assert_eq!(decode.missing_blocks(hashes.clone()).await.unwrap(), hashes);
    // A batch continuing a chain the engine does not hold is refused whole.
    let layout = prefill.kv_layout();
    let orphans = decode
        .start_import(layout, blocks[1..].to_vec(), Some(hashes[0]))
        .unwrap()
        .await
        .unwrap();
    assert_eq!(orphans.imported, 0);
    assert_eq!(orphans.rejected.len(), hashes.len() - 1);
    // In two batches, as a transfer hands them over: both started before either is done
    // (imports run in the order started), the second continuing the first's chain.
    let k = hashes.len() / 2;
    let first = decode.start_import(layout, blocks[..k].to_vec(), None).unwrap();
    let second = decode
        .start_import(layout, blocks[k..].to_vec(), Some(hashes[k - 1]))
        .unwrap();
    let (first, second) = (first.await.unwrap(), second.await.unwrap());
    assert_eq!(first.imported + second.imported, hashes.len(), "{first:?} {second:?}");
    assert!(first.rejected.is_empty() && second.rejected.is_empty());
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

async fn only_missing_blocks_travel_and_corrupted_ones_are_computed(m: &Path) {
    let prompt = prompt();
    let prefill = engine(m);
    greedy(&prefill, &prompt, 1).await;
    let hashes = prefill.prompt_block_hashes(&prompt, "");
    // The decode side already holds the first half of the prefix (an earlier request).
    let decode = engine(m);
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
    let mut damaged = blocks[last].data.to_vec();
    damaged[100] ^= 0x40;
    blocks[last].data = damaged.into();
    let report = decode.import_blocks(prefill.kv_layout(), blocks).await.unwrap();
    assert_eq!(report.imported, missing.len() - 1);
    assert_eq!(report.rejected.len(), 1);
    assert_eq!(report.rejected[0].1, "checksum mismatch");
    let colocated = engine(m);
    let (want, _) = greedy(&colocated, &prompt, 8).await;
    let (got, cached) = greedy(&decode, &prompt, 8).await;
    assert_eq!(got, want);
    assert_eq!(
        cached as usize,
        (hashes.len() - 1) * 16,
        "all but the corrupted block reused"
    );

    // Another layout is refused whole: another shape, another family of the same shape,
    // keys rotated another way (RoPE scaling).
    let mut other = prefill.kv_layout();
    other.block_tokens *= 2;
    assert!(decode.import_blocks(other, Vec::new()).await.is_err());
    let mut other = prefill.kv_layout();
    other.arch = hearth_engine::models::Arch::Qwen2;
    assert!(decode.import_blocks(other, Vec::new()).await.is_err());
    let mut other = prefill.kv_layout();
    other.rope ^= 1;
    assert!(decode.import_blocks(other, Vec::new()).await.is_err());
    // Latent blocks and full K/V blocks never mix.
    let mut other = prefill.kv_layout();
    other.latent = !other.latent;
    assert!(decode.import_blocks(other, Vec::new()).await.is_err());
}

/// Mid-stream failover's engine half: another engine given the tokens generated so far
/// (`resume`) continues with exactly the tokens the first would have produced.
async fn a_resumed_request_continues_exactly(m: &Path) {
    let prompt = prompt();
    let want = run(&engine(m), request(&prompt, 12)).await;
    let mut rest = request(&prompt, 12);
    rest.resume = want.tokens[..5].to_vec();
    let tail = run(&engine(m), rest).await;
    assert_eq!(tail.tokens, want.tokens[5..], "the resumed engine continues exactly");
    assert_eq!(tail.usage.completion_tokens, 12);
}

/// The workers' shared token in these tests.
const TOKEN: &str = "kv-test-token";

/// Serves `engine` as a worker on a loopback port; its base URL.
async fn serve(engine: EngineHandle) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let engines: Vec<(String, std::sync::Arc<dyn hearth_engine::Backend>)> =
        vec![(DEFAULT_MODEL_ID.into(), std::sync::Arc::new(engine))];
    let app = hearth_engine::worker::server::router_many(
        engines,
        "test",
        hearth_engine::worker::server::WorkerOptions {
            token: Some(TOKEN.into()),
            ..Default::default()
        },
    );
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

async fn blocks_move_worker_to_worker_over_http(m: &Path) {
    let prompt = prompt();
    let prefill = engine(m);
    greedy(&prefill, &prompt, 1).await;
    let n = prefill.prompt_block_hashes(&prompt, "").len();
    let prefill_url = serve(prefill).await;
    let decode = engine(m);
    let decode_url = serve(decode.clone()).await;
    let (status, report) = pull(&decode_url, &prefill_url, &prompt).await;
    assert_eq!(status, 200, "{report}");
    assert_eq!(report["missing"], n);
    assert_eq!(report["import"]["imported"], n, "{report}");
    let (got, cached) = greedy(&decode, &prompt, 8).await;
    assert_eq!(cached as usize, n * 16);
    let (want, _) = greedy(&engine(m), &prompt, 8).await;
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
    // A worker holding the token needs it on every worker route: a plain generation names
    // a `cache_namespace` (any tenant's prefix cache), info and events describe the cache.
    let plain = serde_json::json!({
        "request_id": "no-token", "model": DEFAULT_MODEL_ID, "prompt": prompt,
        "sampling": {"temperature": 0.0, "max_tokens": 2}, "cache_namespace": "tenant-a",
    });
    let c = reqwest::Client::new();
    for (name, req) in [
        (
            "generate",
            c.post(format!("{decode_url}/v1/worker/generate")).json(&plain),
        ),
        (
            "m/generate",
            c.post(format!("{decode_url}/v1/worker/m/{DEFAULT_MODEL_ID}/generate"))
                .json(&plain),
        ),
        (
            "generate, wrong token",
            c.post(format!("{decode_url}/v1/worker/generate"))
                .bearer_auth("not-the-token")
                .json(&plain),
        ),
        ("info", c.get(format!("{decode_url}/v1/worker/info"))),
        ("events", c.get(format!("{decode_url}/v1/worker/events"))),
        ("models", c.get(format!("{decode_url}/v1/worker/models"))),
        (
            "load",
            c.post(format!("{decode_url}/v1/worker/m/{DEFAULT_MODEL_ID}/load")),
        ),
    ] {
        let resp = req.send().await.unwrap();
        assert_eq!(resp.status(), 401, "{name}");
        let body: serde_json::Value = resp.json().await.unwrap();
        assert_eq!(body["code"], "invalid_worker_token", "{name}: {body}");
    }
    // With it, the same generation runs; the probes and metrics stay open.
    let resp = c
        .post(format!("{decode_url}/v1/worker/generate"))
        .bearer_auth(TOKEN)
        .json(&plain)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert!(resp.text().await.unwrap().contains("\"done\""));
    for path in ["/livez", "/readyz", "/metrics"] {
        assert_eq!(
            c.get(format!("{decode_url}{path}")).send().await.unwrap().status(),
            200,
            "{path}"
        );
    }
}

async fn a_transfer_cut_midway_keeps_what_arrived_and_the_request_completes(m: &Path) {
    use axum::body::{Body, Bytes};
    use hearth_engine::kv::transfer::{encode_block, encode_header};
    let prompt = prompt();
    let prefill = engine(m);
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
                    futures_util::stream::once(async {
                        // After what was sent has reached the puller (a small body could
                        // otherwise be cut before the response's head is read).
                        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                        Err(std::io::Error::other("the prefill worker died"))
                    }),
                );
                Body::from_stream(s)
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let source = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    let decode = engine(m);
    let decode_url = serve(decode.clone()).await;
    let (status, report) = pull(&decode_url, &source, &prompt).await;
    assert_eq!(status, 502, "{report}");
    assert!(report["error"].as_str().is_some(), "{report}");
    assert_eq!(report["import"]["imported"], 3, "what arrived intact is kept: {report}");
    // The request completes: the missing blocks are computed.
    let (got, cached) = greedy(&decode, &prompt, 8).await;
    assert_eq!(cached, 3 * 16);
    let (want, _) = greedy(&engine(m), &prompt, 8).await;
    assert_eq!(got, want);
}

/// A request sent to a worker over HTTP with a `kv_source` and no hold (the gateway's peer
/// fetch), asking for the holder's first `held` tokens (0: all): its greedy tokens and
/// cached prompt tokens.
async fn generate_from(worker: &str, source: &str, prompt: &[u32], held: u32) -> (Vec<u32>, u32) {
    let body = serde_json::json!({
        "request_id": "fetch", "model": DEFAULT_MODEL_ID, "prompt": prompt,
        "sampling": {"temperature": 0.0, "max_tokens": 8, "ignore_eos": true},
        "kv_source": {"worker": source, "hold": "", "tokens": held},
    });
    let resp = reqwest::Client::new()
        .post(format!("{worker}/v1/worker/m/{DEFAULT_MODEL_ID}/generate"))
        .bearer_auth(TOKEN)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let text = resp.text().await.unwrap();
    let mut tokens = Vec::new();
    for line in text.lines() {
        match serde_json::from_str::<GenerateEvent>(line).unwrap() {
            GenerateEvent::Token { id, .. } => tokens.push(id),
            GenerateEvent::Done { usage, .. } => return (tokens, usage.cached_tokens),
            GenerateEvent::Error { message, .. } => panic!("{message}"),
            GenerateEvent::Finish { .. } => {}
        }
    }
    panic!("no Done: {text}")
}

/// The worker's `hearth_kv_transfer_failures_total`.
async fn transfer_failures(worker: &str) -> f64 {
    let text = reqwest::get(format!("{worker}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    hearth_engine::worker::metrics::series_sum(&text, "hearth_kv_transfer_failures_total", "")
}

async fn a_peer_fetch_reuses_the_holders_prefix_and_a_gone_or_silent_peer_costs_a_recompute(m: &Path) {
    let prompt = prompt();
    let (want, _) = greedy(&engine(m), &prompt, 8).await;
    let holder = engine(m);
    greedy(&holder, &prompt, 1).await;
    let n = holder.prompt_block_hashes(&prompt, "").len() as u32;
    let holder_url = serve(holder).await;

    // The peer holds the prefix: the request reuses all of it, as the holder would.
    let worker_url = serve(engine(m)).await;
    let (got, cached) = generate_from(&worker_url, &holder_url, &prompt, n * 16).await;
    assert_eq!((got, cached), (want.clone(), n * 16));
    assert_eq!(transfer_failures(&worker_url).await, 0.0);
    // Another prompt sharing the first 100 tokens (6 whole blocks): asked for those only,
    // it reuses them and the transfer is whole, not failed.
    let mut other = prompt[..100].to_vec();
    other.extend((0..60u32).map(|i| 300 + (i * 53) % 4000));
    let (other_want, _) = greedy(&engine(m), &other, 8).await;
    let worker_url = serve(engine(m)).await;
    let (got, cached) = generate_from(&worker_url, &holder_url, &other, 96).await;
    assert_eq!((got, cached), (other_want, 96));
    assert_eq!(transfer_failures(&worker_url).await, 0.0);

    // A peer that is gone (nothing listens), and one that accepts and never answers
    // (bounded by the fetch's deadline, 2 s plus 10 ms a block): both cost a recompute.
    let gone = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_url = format!("http://{}", silent.local_addr().unwrap());
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((conn, _)) = silent.accept().await {
            held.push(conn);
        }
    });
    for (i, source) in [gone, silent_url].iter().enumerate() {
        let worker_url = serve(engine(m)).await;
        let (got, cached) = generate_from(&worker_url, source, &prompt, n * 16).await;
        assert_eq!((got, cached), (want.clone(), 0), "source {i}");
        assert_eq!(transfer_failures(&worker_url).await, 1.0, "source {i}");
    }
}

/// A request's events: tokens, their text, the finish reason and the usage.
struct Run {
    tokens: Vec<u32>,
    text: String,
    finish: hearth_protocol::FinishReason,
    usage: hearth_protocol::Usage,
}

async fn run(e: &EngineHandle, req: GenerateRequest) -> Run {
    let mut rx = e.generate(req);
    let (mut tokens, mut text) = (Vec::new(), String::new());
    while let Some(ev) = rx.recv().await {
        match ev {
            GenerateEvent::Token { id, text: t, .. } => {
                tokens.push(id);
                text.push_str(&t);
            }
            GenerateEvent::Done {
                usage, finish_reason, ..
            } => {
                return Run {
                    tokens,
                    text,
                    finish: finish_reason,
                    usage,
                }
            }
            GenerateEvent::Error { message, .. } => panic!("{message}"),
            GenerateEvent::Finish { .. } => {}
        }
    }
    panic!("no Done")
}

fn request(prompt: &[u32], max_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        request_id: "pd-1".into(),
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
        prefill_only: false,
        resume: Vec::new(),
        kv_source: None,
        qos: Default::default(),
        constraint: None,
        adapter: None,
    }
}

/// Blocks referenced by nothing but the cache (cached-idle blocks count as free).
fn all_free(e: &EngineHandle) -> bool {
    let l = e.stats().load;
    l.free_blocks == l.total_blocks
}

async fn settle() {
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
}

/// A transport that passes a peer's frames on, damaging or cutting them.
struct Faulty {
    inner: std::sync::Arc<hearth_engine::kv::transfer::LocalKvTransport>,
    /// Flip a byte of this block (by position in the stream).
    corrupt: Option<usize>,
    /// End the stream with an error after this many blocks.
    cut_after: Option<usize>,
}

impl hearth_engine::kv::transfer::KvTransport for Faulty {
    fn release(&self, peer: &str, model: &str, hold: String) -> futures_util::future::BoxFuture<'static, ()> {
        self.inner.release(peer, model, hold)
    }

    fn fetch(
        &self,
        peer: &str,
        model: &str,
        hashes: Vec<hearth_protocol::BlockHash>,
        release: Option<String>,
    ) -> futures_util::future::BoxFuture<
        'static,
        Result<hearth_engine::kv::transfer::FrameStream, hearth_engine::kv::transfer::TransferError>,
    > {
        use futures_util::FutureExt;
        use hearth_engine::kv::transfer::{Frame, TransferError};
        let inner = self.inner.fetch(peer, model, hashes, release);
        let (corrupt, cut) = (self.corrupt, self.cut_after);
        async move {
            let frames = inner.await?;
            let mut block = 0usize;
            Ok(frames
                .map(move |f| match f {
                    Ok(Frame::Block(h, Some(mut b))) => {
                        block += 1;
                        if cut.is_some_and(|c| block > c) {
                            return Err(TransferError::Truncated {
                                peer: "test".into(),
                                got: block - 1,
                                want: block,
                            });
                        }
                        if corrupt == Some(block - 1) {
                            let mut damaged = b.data.to_vec();
                            damaged[7] ^= 0x10;
                            b.data = damaged.into();
                        }
                        Ok(Frame::Block(h, Some(b)))
                    }
                    other => other,
                })
                .boxed())
        }
        .boxed()
    }
}

/// Prefill-only on one engine, then the rest on another that fetches the blocks through
/// `transport`: the stitched tokens and text, the decode half's usage, and its import.
async fn disaggregated(
    prefill: &EngineHandle,
    decode: &EngineHandle,
    transport: &dyn hearth_engine::kv::transfer::KvTransport,
    prompt: &[u32],
    max_tokens: u32,
) -> (Run, Run, hearth_engine::kv::block::PullReport) {
    let mut first = request(prompt, max_tokens);
    first.prefill_only = true;
    let head = run(prefill, first).await;
    assert_eq!(head.finish, hearth_protocol::FinishReason::Handoff);
    assert_eq!(head.tokens.len(), 1);
    settle().await; // the engine publishes its counters after the step that sent `Done`
    assert!(!all_free(prefill), "the prompt's blocks are held for the decode worker");
    let mut rest = request(prompt, max_tokens);
    rest.resume = head.tokens.clone();
    rest.kv_source = Some(hearth_protocol::KvSource {
        worker: "prefill".into(),
        hold: "pd-1".into(),
        tokens: 0,
    });
    let report = hearth_engine::kv::transfer::prepare(decode, transport, &rest, "decode", &Default::default())
        .await
        .expect("a kv_source means a pull");
    let tail = run(decode, rest).await;
    (head, tail, report)
}

async fn a_prefill_only_request_hands_off_and_the_decode_side_continues_exactly(m: &Path) {
    let prompt = prompt();
    let colocated = engine(m);
    let want = run(&colocated, request(&prompt, 12)).await;

    let (prefill, decode) = (engine(m), engine(m));
    let local = std::sync::Arc::new(hearth_engine::kv::transfer::LocalKvTransport::default());
    local.add("prefill", prefill.clone());
    let (head, tail, report) = disaggregated(&prefill, &decode, &*local, &prompt, 12).await;
    let blocks = (prompt.len() - 1) / 16;
    assert_eq!((report.missing, report.import.imported), (blocks, blocks), "{report:?}");
    assert!(report.error.is_none());
    let mut tokens = head.tokens.clone();
    tokens.extend(&tail.tokens);
    assert_eq!(tokens, want.tokens, "greedy output is the colocated one");
    assert_eq!(format!("{}{}", head.text, tail.text), want.text);
    assert_eq!(tail.usage.completion_tokens, 12, "the resumed token counts");
    assert_eq!(tail.usage.prompt_tokens as usize, prompt.len());
    assert_eq!(tail.usage.cached_tokens as usize, blocks * 16);
    assert_eq!(tail.finish, hearth_protocol::FinishReason::Length);
    settle().await;
    assert!(all_free(&prefill), "the hold ends with the transfer");
    assert!(all_free(&decode));
    let m = decode.metrics();
    assert_eq!(m.transfer_blocks.get(), blocks as u64);
    assert_eq!(m.transfer_failures.get(), 0);

    // The decode side holds the prefix now: a second hand-off moves no block.
    let (_, _, again) = disaggregated(&prefill, &decode, &*local, &prompt, 4).await;
    assert_eq!((again.missing, again.import.imported), (0, 0));
    settle().await;
    assert!(all_free(&prefill), "released even when nothing was fetched");
}

async fn a_corrupted_or_cut_transfer_still_completes_and_frees_every_block(m: &Path) {
    let prompt = prompt();
    let colocated = engine(m);
    let want = run(&colocated, request(&prompt, 8)).await;
    let blocks = (prompt.len() - 1) / 16;
    for (corrupt, cut_after) in [(Some(3), None), (None, Some(5))] {
        let (prefill, decode) = (engine(m), engine(m));
        let local = std::sync::Arc::new(hearth_engine::kv::transfer::LocalKvTransport::default());
        local.add("prefill", prefill.clone());
        let faulty = Faulty {
            inner: local,
            corrupt,
            cut_after,
        };
        let (head, tail, report) = disaggregated(&prefill, &decode, &faulty, &prompt, 8).await;
        let mut tokens = head.tokens.clone();
        tokens.extend(&tail.tokens);
        assert_eq!(
            tokens, want.tokens,
            "computed what did not arrive ({corrupt:?}, {cut_after:?})"
        );
        let kept = corrupt.or(cut_after).unwrap();
        assert_eq!(report.import.imported, kept, "{report:?}");
        assert_eq!(tail.usage.cached_tokens as usize, kept * 16);
        assert!(kept < blocks);
        assert_eq!(decode.metrics().transfer_failures.get(), 1);
        settle().await;
        assert!(all_free(&prefill), "the prefill side's hold is released");
        assert!(all_free(&decode), "nothing stays referenced on the decode side");
    }
}

/// Each test above on the default model and on the latent-attention model.
macro_rules! on_both_models {
    ($($name:ident),*) => {
        mod default_model {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                super::$name(&crate::harness::default_model()).await
            })*
        }
        mod latent_attention_model {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                super::$name(&super::latent_model_path()).await
            })*
        }
    };
}

on_both_models!(
    a_resumed_request_continues_exactly,
    imported_blocks_continue_exactly_as_colocated,
    only_missing_blocks_travel_and_corrupted_ones_are_computed,
    blocks_move_worker_to_worker_over_http,
    a_transfer_cut_midway_keeps_what_arrived_and_the_request_completes,
    a_peer_fetch_reuses_the_holders_prefix_and_a_gone_or_silent_peer_costs_a_recompute,
    a_prefill_only_request_hands_off_and_the_decode_side_continues_exactly,
    a_corrupted_or_cut_transfer_still_completes_and_frees_every_block
);

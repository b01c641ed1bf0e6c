//! Prefill/decode disaggregation end to end: a prefill worker, a decode worker and a
//! gateway, as three processes, answer as colocated serving does — streamed and not — with
//! one usage record whose cached tokens are the prefill side's; when the decode worker is
//! gone, the request still completes on the prefill worker.

use std::time::{Duration, Instant};

use crate::harness::*;
use serde_json::{json, Value};

const TOKEN: &str = "pd-e2e-worker-token";
const GOLDEN: &str = "The capital of France is Paris.";

/// A long shared system prompt and a question of its own, so that a second question
/// still has more uncached tokens than the threshold.
fn with_system(question: &str) -> Value {
    let system: String = (0..12)
        .map(|i| format!("Rule {i}: answer briefly and precisely. "))
        .collect();
    json!({"model": MODEL, "temperature": 0, "max_tokens": 6,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]})
}

#[tokio::test]
async fn prefill_and_decode_workers_answer_as_one_worker_would() {
    let data = temp_dir("pd");
    let env = [("HEARTH_WORKER_TOKEN", TOKEN)];
    let prefill = spawn_with_env(&["worker", "--listen", "127.0.0.1:0", "--role", "prefill"], &env);
    let decode = spawn_with_env(&["worker", "--listen", "127.0.0.1:0", "--role", "decode"], &env);
    let gateway = spawn_with_env(
        &[
            "gateway",
            "--listen",
            "127.0.0.1:0",
            "--data-dir",
            data.to_str().unwrap(),
            "--worker",
            &prefill.url,
            "--worker",
            &decode.url,
            "--pd-threshold",
            "16",
        ],
        &env,
    );
    let key = new_key(&data, "acme");
    let url = format!("{}/v1/chat/completions", gateway.url);

    // The registry shows the roles, and follows both workers' KV events.
    let routing_url = format!("{}/admin/v1/routing", gateway.url);
    let r = wait_for_workers(&routing_url, |w| w["exact_events"] == true).await;
    assert_eq!(roles(&r), ["prefill", "decode"], "{r}");
    assert_eq!(r["data"][0]["pd_threshold"], 16);

    // The golden prompt (42 tokens, 2 full blocks), not streamed: the colocated answer.
    let (status, _, body) = post(&url, Some(&key), &chat_body(json!({}))).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["choices"][0]["message"]["content"], GOLDEN);
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
    assert_eq!(body["usage"]["prompt_tokens"], 42);
    assert_eq!(body["usage"]["completion_tokens"], 8);

    // Streamed, with usage: the same text and usage. (Another tenant: nothing of its
    // prompt is cached, so it is disaggregated too.)
    let other = new_key(&data, "beta");
    let resp = client()
        .post(&url)
        .bearer_auth(&other)
        .json(&chat_body(
            json!({"stream": true, "stream_options": {"include_usage": true}}),
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let events = sse_events(resp).await;
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, GOLDEN);
    assert_eq!(chunks[chunks.len() - 2]["choices"][0]["finish_reason"], "stop");
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(
        (usage["prompt_tokens"].clone(), usage["completion_tokens"].clone()),
        (json!(42), json!(8))
    );

    // Two questions after one long system prompt: the second finds the system prompt's
    // blocks cached on the prefill worker (reported as cached tokens), and the decode
    // worker, which received them with the first, is sent only the blocks it lacks.
    let (s, _, first) = post(&url, Some(&key), &with_system("Name three primary colours, please.")).await;
    assert_eq!(s, 200, "{first}");
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let blocks_before = metric_sum(&metrics(&decode.url).await, "hearth_kv_transfer_blocks_total");
    let (s, _, second) = post(
        &url,
        Some(&key),
        &with_system("Which planet is the largest in the solar system, and why?"),
    )
    .await;
    assert_eq!(s, 200, "{second}");
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    let prompt_tokens = second["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(cached >= 64, "the system prompt's blocks were cached: {second}");
    let moved = metric_sum(&metrics(&decode.url).await, "hearth_kv_transfer_blocks_total") - blocks_before;
    let full = (prompt_tokens - 1) / 16;
    assert!(
        moved > 0.0 && moved < (full - cached / 16 + 1) as f64,
        "moved {moved} of {full} blocks"
    );

    let gw = metrics(&gateway.url).await;
    assert_eq!(
        metric_sum(
            &gw,
            "hearth_pd_requests_total{model=\"smollm2-135m-instruct\",outcome=\"disaggregated\"}"
        ),
        4.0,
        "{gw}"
    );
    assert!(metric_sum(&metrics(&decode.url).await, "hearth_kv_transfer_bytes_total") > 0.0);

    // One usage record per request, with the prefill side's cached tokens.
    let rows = usage_rows(&data);
    assert_eq!(rows.len(), 4, "{rows:?}");
    assert!(rows.iter().all(|r| r["status"] == "completed"), "{rows:?}");
    assert!(
        rows.iter()
            .any(|r| r["cached_tokens"] == json!(cached) && r["prompt_tokens"] == json!(prompt_tokens)),
        "{rows:?}"
    );

    // The decode worker dies: the next long request still gets the golden answer, from
    // the prefill worker continuing after its own first token.
    drop(decode);
    let (status, _, body) = post(&url, Some(&key), &chat_body(json!({}))).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["choices"][0]["message"]["content"], GOLDEN);
    assert_eq!(body["usage"]["completion_tokens"], 8);
    let rows = usage_rows(&data);
    assert_eq!(rows.len(), 5);
    assert!(rows.iter().all(|r| r["status"] == "completed"), "{rows:?}");
}

#[tokio::test]
async fn serve_runs_a_disaggregated_setup_in_one_process() {
    let data = temp_dir("pd-serve");
    let server = spawn(&[
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--data-dir",
        data.to_str().unwrap(),
        "--prefill-workers",
        "1",
        "--decode-workers",
        "1",
        "--pd-threshold",
        "16",
    ]);
    let key = new_key(&data, "acme");
    let url = format!("{}/v1/chat/completions", server.url);
    for stream in [false, true] {
        let resp = client()
            .post(&url)
            .bearer_auth(&key)
            .json(&chat_body(
                json!({"stream": stream, "prompt_cache_key": format!("{stream}")}),
            ))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        let text = if stream {
            let events = sse_events(resp).await;
            events
                .iter()
                .filter_map(|e| serde_json::from_str::<Value>(e).ok())
                .filter_map(|c| c["choices"][0]["delta"]["content"].as_str().map(str::to_string))
                .collect::<String>()
        } else {
            let body: Value = resp.json().await.unwrap();
            body["choices"][0]["message"]["content"].as_str().unwrap().to_string()
        };
        assert_eq!(text, GOLDEN);
    }
    let m = metrics(&server.url).await;
    assert_eq!(
        metric_sum(
            &m,
            "hearth_pd_requests_total{model=\"smollm2-135m-instruct\",outcome=\"disaggregated\"}"
        ),
        2.0,
        "{m}"
    );
    assert!(
        metric_sum(&m, "hearth_kv_transfer_blocks_total{worker=\"local-decode-1\"}") >= 4.0,
        "{m}"
    );
    let r = get_json(&format!("{}/admin/v1/routing", server.url), ADMIN_TOKEN).await;
    assert_eq!(roles(&r), ["prefill", "decode"]);
}

/// The roles of the first model's workers in a routing table, in order.
fn roles(routing: &Value) -> Vec<&str> {
    routing["data"][0]["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["role"].as_str().unwrap())
        .collect()
}

/// The routing table once every worker of the model satisfies `ready`.
async fn wait_for_workers(routing_url: &str, ready: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let r = get_json(routing_url, ADMIN_TOKEN).await;
        if r["data"][0]["workers"].as_array().unwrap().iter().all(&ready) {
            return r;
        }
        assert!(Instant::now() < deadline, "KV events not followed: {r}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The routing table's `cached_blocks` per worker name.
async fn cached_blocks(gateway: &str) -> Vec<(String, u64)> {
    let r = get_json(&format!("{gateway}/admin/v1/routing"), ADMIN_TOKEN).await;
    r["data"][0]["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| {
            (
                w["name"].as_str().unwrap().to_string(),
                w["cached_blocks"].as_u64().unwrap(),
            )
        })
        .collect()
}

/// [`cached_blocks`] once KV events have stopped arriving (two reads 300 ms apart agree).
async fn settled_blocks(gateway: &str) -> Vec<(String, u64)> {
    let mut last = cached_blocks(gateway).await;
    for _ in 0..100 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let now = cached_blocks(gateway).await;
        if now == last {
            break;
        }
        last = now;
    }
    last
}

/// Waits until the router's index shows a worker holding more blocks than in `before`;
/// that worker's name.
async fn new_holder(gateway: &str, before: &[(String, u64)]) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let now = cached_blocks(gateway).await;
        if let Some((name, _)) = now.iter().find(|(n, c)| before.iter().any(|(m, b)| m == n && c > b)) {
            return name.clone();
        }
        assert!(Instant::now() < deadline, "no worker's KV events arrived: {now:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Peer fetch end to end: two workers behind a gateway that places requests at random.
/// Once the router's index shows one worker holding a long prompt's prefix, the first
/// repeat placed on the other worker pulls the prefix from the holder (reported as cached
/// tokens) instead of computing it; every answer is the same and every request leaves one
/// usage record. Then a holder dies: whatever the gateway knows of it by then (a fetch
/// from it failing at once, or the worker already out of routing), the answer and the
/// usage record are the same.
#[tokio::test]
async fn a_worker_pulls_a_prefix_its_peer_holds() {
    let data = temp_dir("fetch");
    let env = [("HEARTH_WORKER_TOKEN", TOKEN)];
    let a = spawn_with_env(&["worker", "--listen", "127.0.0.1:0"], &env);
    let b = spawn_with_env(&["worker", "--listen", "127.0.0.1:0"], &env);
    let gateway = spawn_with_env(
        &[
            "gateway",
            "--listen",
            "127.0.0.1:0",
            "--data-dir",
            data.to_str().unwrap(),
            "--worker",
            &a.url,
            "--worker",
            &b.url,
            "--routing-policy",
            "random",
            "--kv-fetch-min-tokens",
            "32",
        ],
        &env,
    );
    let key = new_key(&data, "acme");
    let url = format!("{}/v1/chat/completions", gateway.url);
    let routing_url = format!("{}/admin/v1/routing", gateway.url);
    let r = wait_for_workers(&routing_url, |w| w["exact_events"] == true && w["kv_peer"] == true).await;
    assert_eq!(r["data"][0]["fetch_min_tokens"], 32, "{r}");
    let transferred = || async {
        metric_sum(&metrics(&a.url).await, "hearth_kv_transfer_blocks_total")
            + metric_sum(&metrics(&b.url).await, "hearth_kv_transfer_blocks_total")
    };

    let body = with_system("Name three primary colours, please.");
    let before = settled_blocks(&gateway.url).await;
    let (s, _, first) = post(&url, Some(&key), &body).await;
    assert_eq!(s, 200, "{first}");
    let answer = first["choices"][0]["message"]["content"].clone();
    new_holder(&gateway.url, &before).await;
    let mut requests = 1;
    let mut fetched = None;
    // Each repeat lands on the other worker with probability ½: 40 tries miss it with
    // probability 2⁻⁴⁰.
    for _ in 0..40 {
        let (s, _, r) = post(&url, Some(&key), &body).await;
        requests += 1;
        assert_eq!(s, 200, "{r}");
        assert_eq!(r["choices"][0]["message"]["content"], answer);
        if transferred().await > 0.0 {
            fetched = Some(r);
            break;
        }
    }
    let r = fetched.expect("no request was placed on the worker lacking the prefix");
    let prompt_tokens = r["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(
        r["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap(),
        (prompt_tokens - 1) / 16 * 16,
        "the whole prefix was pulled: {r}"
    );
    let gw = metrics(&gateway.url).await;
    assert!(
        metric_sum(&gw, "hearth_routing_fetches_total{model=\"smollm2-135m-instruct\"}") >= 1.0,
        "{gw}"
    );
    for w in [&a, &b] {
        assert_eq!(
            metric_sum(&metrics(&w.url).await, "hearth_kv_transfer_failures_total"),
            0.0
        );
    }
    let r = get_json(&routing_url, ADMIN_TOKEN).await;
    let fetches: u64 = r["data"][0]["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["fetches"].as_u64().unwrap())
        .sum();
    assert!(fetches >= 1, "{r}");

    // A second prompt sharing nothing with the first, held by one worker; that worker dies.
    let rules: String = (0..12)
        .map(|i| format!("Clause {i}: be courteous and exact. "))
        .collect();
    let body = json!({"model": MODEL, "temperature": 0, "max_tokens": 6,
        "messages": [{"role": "system", "content": rules}, {"role": "user", "content": "Why is the sky blue?"}]});
    let before = settled_blocks(&gateway.url).await;
    let (s, _, r) = post(&url, Some(&key), &body).await;
    assert_eq!(s, 200, "{r}");
    requests += 1;
    let answer = r["choices"][0]["message"]["content"].clone();
    let holder = new_holder(&gateway.url, &before).await;
    let (dead, alive) = if holder.contains(a.url.trim_start_matches("http://")) {
        (a, b)
    } else {
        (b, a)
    };
    drop(dead);
    let (s, _, r) = post(&url, Some(&key), &body).await;
    assert_eq!(s, 200, "{r}");
    requests += 1;
    assert_eq!(r["choices"][0]["message"]["content"], answer);
    assert_eq!(r["usage"]["prompt_tokens_details"]["cached_tokens"], 0, "{r}");
    let rows = usage_rows(&data);
    assert_eq!(rows.len(), requests, "{rows:?}");
    assert!(rows.iter().all(|r| r["status"] == "completed"), "{rows:?}");
    drop(alive);
}

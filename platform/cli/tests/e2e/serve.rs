//! End-to-end: the real `hearth` binary on a free port, real HTTP, the real default model
//! (fetched with pip on first use), the CLI against the same data directory.

use std::time::{Duration, Instant};

use crate::harness::*;
use futures_util::StreamExt;
use serde_json::{json, Value};

#[tokio::test]
async fn chat_answers_paris_streams_and_records_usage() {
    let data = temp_dir("chat");
    let server = serve(&data);
    assert!(
        server.stdout_head.iter().any(|l| l.contains("No API keys yet"))
            && server.stdout_head.iter().any(|l| l.contains("key create --tenant")),
        "first start must say how to get a key: {:?}",
        server.stdout_head
    );
    let key = new_key(&data, "acme");
    let url = format!("{}/v1/chat/completions", server.url);

    // Non-streaming.
    let (status, headers, body) = post(&url, Some(&key), &chat_body(json!({}))).await;
    assert_eq!(status, 200, "{body}");
    assert!(headers
        .get("x-request-id")
        .is_some_and(|v| v.to_str().unwrap().starts_with("req_")));
    assert_eq!(body["object"], "chat.completion");
    let content = body["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(content.contains("Paris"), "{content}");
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
    assert_eq!(body["usage"]["prompt_tokens"], 42);
    assert_eq!(body["usage"]["completion_tokens"], 8);
    assert_eq!(body["usage"]["total_tokens"], 50);
    assert_eq!(body["usage"]["prompt_tokens_details"]["cached_tokens"], 0);

    // Streaming with usage.
    let resp = client()
        .post(&url)
        .bearer_auth(&key)
        .json(&chat_body(
            json!({"stream": true, "stream_options": {"include_usage": true}}),
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let events = sse_events(resp).await;
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert!(chunks.iter().all(|c| c["object"] == "chat.completion.chunk"));
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, content, "streamed text equals the non-streamed answer");
    let usage_chunk = chunks.last().unwrap();
    assert_eq!(usage_chunk["choices"], json!([]));
    assert_eq!(usage_chunk["usage"]["completion_tokens"], 8);
    assert_eq!(chunks[chunks.len() - 2]["choices"][0]["finish_reason"], "stop");

    // Streaming without usage: no usage chunk, still [DONE].
    let resp = client()
        .post(&url)
        .bearer_auth(&key)
        .json(&chat_body(json!({"stream": true})))
        .send()
        .await
        .unwrap();
    let events = sse_events(resp).await;
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    assert!(events.iter().all(|e| !e.contains("\"usage\"")));

    // Completions, max_tokens and stop strings.
    let (status, _, body) = post(
        &format!("{}/v1/completions", server.url),
        Some(&key),
        &json!({"model": MODEL, "prompt": "The capital of France is", "max_tokens": 5, "temperature": 0}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "text_completion");
    assert_eq!(body["usage"]["completion_tokens"], 5);
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    let (_, _, body) = post(&url, Some(&key), &chat_body(json!({"stop": [" Paris"]}))).await;
    assert_eq!(body["choices"][0]["message"]["content"], "The capital of France is");
    assert_eq!(body["choices"][0]["finish_reason"], "stop");

    // Seeded sampling is reproducible.
    let sampled = json!({"temperature": 1.0, "seed": 1234, "max_tokens": 12});
    let (_, _, a) = post(&url, Some(&key), &chat_body(sampled.clone())).await;
    let (_, _, b) = post(&url, Some(&key), &chat_body(sampled)).await;
    assert_eq!(
        a["choices"][0]["message"]["content"],
        b["choices"][0]["message"]["content"]
    );

    // Models.
    let models = get_json(&format!("{}/v1/models", server.url), &key).await;
    assert_eq!(models["data"][0]["id"], MODEL);

    // One usage row per request, with the engine's counts.
    let rows = usage_rows(&data);
    assert_eq!(rows.len(), 7, "{rows:?}");
    assert!(rows.iter().all(|r| r["status"] == "completed"));
    assert!(rows
        .iter()
        .any(|r| r["prompt_tokens"] == 42 && r["completion_tokens"] == 8 && r["endpoint"] == "/v1/chat/completions"));
}

#[tokio::test]
async fn errors_are_openai_shaped_and_keys_revoke() {
    let data = temp_dir("errors");
    let server = serve(&data);
    let key = new_key(&data, "acme");
    let url = format!("{}/v1/chat/completions", server.url);
    let check = |status: u16, body: &Value, want_status: u16, code: &str| {
        assert_eq!(status, want_status, "{body}");
        let e = &body["error"];
        assert_eq!(e["code"], code, "{body}");
        assert!(
            e["message"].as_str().is_some_and(|m| !m.is_empty()) && e.get("type").is_some() && e.get("param").is_some()
        );
    };

    let (s, _, b) = post(&url, None, &chat_body(json!({}))).await;
    check(s, &b, 401, "invalid_api_key");
    let (s, _, b) = post(&url, Some("hk_deadbeef_00"), &chat_body(json!({}))).await;
    check(s, &b, 401, "invalid_api_key");
    let (s, _, b) = post(&url, Some("not-a-key"), &chat_body(json!({}))).await;
    check(s, &b, 401, "invalid_api_key");

    let resp = client()
        .post(&url)
        .bearer_auth(&key)
        .body("{\"model\": ")
        .send()
        .await
        .unwrap();
    let s = resp.status().as_u16();
    check(s, &resp.json().await.unwrap(), 400, "invalid_json");
    let (s, _, b) = post(&url, Some(&key), &chat_body(json!({"model": "gpt-17"}))).await;
    check(s, &b, 404, "model_not_found");
    let (s, _, b) = post(&url, Some(&key), &chat_body(json!({"temperature": 9}))).await;
    check(s, &b, 400, "invalid_value");
    assert_eq!(b["error"]["param"], "temperature");
    let (s, _, b) = post(&url, Some(&key), &chat_body(json!({"messages": "hi"}))).await;
    check(s, &b, 400, "invalid_value");
    let (s, _, b) = post(&url, Some(&key), &chat_body(json!({"max_tokens": 9000}))).await;
    check(s, &b, 400, "context_length_exceeded");
    let (s, _, b) = post(
        &format!("{}/v1/completions", server.url),
        Some(&key),
        &json!({"model": MODEL, "prompt": [999999]}),
    )
    .await;
    check(s, &b, 400, "invalid_value");
    let resp = client().get(format!("{}/v1/nope", server.url)).send().await.unwrap();
    assert_eq!(resp.status(), 404);
    assert!(resp.headers().get("x-request-id").is_some());

    // Failed requests are recorded too (one row per authenticated request).
    let rows = usage_rows(&data);
    assert!(
        rows.len() >= 6 && rows.iter().all(|r| r["status"] == "failed"),
        "{rows:?}"
    );

    // The admin API: closed without the token, open with it.
    let admin_url = format!("{}/admin/v1/tenants", server.url);
    let resp = client().get(&admin_url).send().await.unwrap();
    assert_eq!(resp.status(), 401);
    let resp = client()
        .post(&admin_url)
        .bearer_auth(ADMIN_TOKEN)
        .json(&json!({"name": "beta"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 201);
    let resp = client()
        .post(&admin_url)
        .bearer_auth(ADMIN_TOKEN)
        .json(&json!({"name": "beta"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 409);
    let resp = client()
        .post(format!("{admin_url}/beta/keys"))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 201);
    // The response carrying a new key's secret is never cached; every response says
    // nosniff and sends no referrer.
    let h = resp.headers().clone();
    assert_eq!(h["cache-control"], "no-store");
    assert_eq!(h["x-content-type-options"], "nosniff");
    assert_eq!(h["referrer-policy"], "no-referrer");
    let beta_key = resp.json::<Value>().await.unwrap()["key"].as_str().unwrap().to_string();
    let (s, h, _) = post(&url, Some(&beta_key), &chat_body(json!({"max_tokens": 1}))).await;
    assert_eq!(s, 200);
    assert_eq!(h["x-content-type-options"], "nosniff");
    let beta_id = beta_key.split('_').nth(1).unwrap();
    let resp = client()
        .delete(format!("{}/admin/v1/keys/{beta_id}", server.url))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let (s, _, b) = post(&url, Some(&beta_key), &chat_body(json!({"max_tokens": 1}))).await;
    check(s, &b, 401, "invalid_api_key");

    // Revocation through the CLI (another process) takes effect within the cache TTL.
    let key_id = key.split('_').nth(1).unwrap();
    admin(&data, &["key", "revoke", key_id]);
    let deadline = Instant::now() + hearth_tenants::KEY_CACHE_TTL + Duration::from_secs(3);
    loop {
        let (s, _, _) = post(&url, Some(&key), &chat_body(json!({"max_tokens": 1}))).await;
        if s == 401 {
            break;
        }
        assert!(Instant::now() < deadline, "revoked key still accepted");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

#[tokio::test]
async fn client_disconnect_stops_generation_and_is_metered() {
    let data = temp_dir("disconnect");
    let server = serve(&data);
    let key = new_key(&data, "acme");
    let url = format!("{}/v1/chat/completions", server.url);
    let body = json!({"model": MODEL, "stream": true, "max_tokens": 4000, "temperature": 1.0, "seed": 1,
                      "messages": [{"role": "user", "content": "Write a very long story about a dragon."}]});
    let resp = client().post(&url).bearer_auth(&key).json(&body).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    let mut stream = resp.bytes_stream();
    let mut seen = 0;
    while seen < 5 {
        stream.next().await.unwrap().unwrap();
        seen += 1;
    }
    drop(stream);
    // The record appears with what was generated, far below max_tokens, and the engine is
    // free again: the next request is answered.
    let deadline = Instant::now() + Duration::from_secs(30);
    let row = loop {
        if let Some(r) = usage_rows(&data).into_iter().find(|r| r["status"] == "cancelled") {
            break r;
        }
        assert!(Instant::now() < deadline, "no cancelled usage row");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let generated = row["completion_tokens"].as_u64().unwrap();
    assert!((1..4000).contains(&generated), "{row}");
    assert_eq!(row["finish_reason"], "cancelled");
    let (s, _, b) = post(&url, Some(&key), &chat_body(json!({}))).await;
    assert_eq!(s, 200);
    assert!(b["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .contains("Paris"));
}

#[tokio::test]
async fn gateway_and_worker_run_apart() {
    let data = temp_dir("split");
    let (worker, gateway) = worker_and_gateway(&data);
    let key = new_key(&data, "acme");
    let url = format!("{}/v1/chat/completions", gateway.url);
    let (s, _, b) = post(&url, Some(&key), &chat_body(json!({}))).await;
    assert_eq!(s, 200, "{b}");
    assert!(b["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .contains("Paris"));
    assert_eq!(b["usage"]["prompt_tokens"], 42);
    let resp = client()
        .post(&url)
        .bearer_auth(&key)
        .json(&chat_body(json!({"stream": true})))
        .send()
        .await
        .unwrap();
    assert_eq!(sse_events(resp).await.last().map(String::as_str), Some("[DONE]"));

    // The worker dies: a clean 503, not a hang.
    drop(worker);
    let (s, _, b) = post(&url, Some(&key), &chat_body(json!({}))).await;
    assert_eq!(s, 503, "{b}");
    assert_eq!(b["error"]["code"], "service_unavailable");
    let rows = usage_rows(&data);
    assert_eq!(rows.iter().filter(|r| r["status"] == "completed").count(), 2);
    assert_eq!(rows.iter().filter(|r| r["status"] == "failed").count(), 1);
}

/// A long system prompt shared by the prefix-cache tests (a few hundred tokens).
fn long_system() -> String {
    (0..40)
        .map(|i| format!("Rule {i}: answer politely and precisely, citing the rule number. "))
        .collect()
}

fn cached_chat(system: &str, question: &str, extra: Value) -> Value {
    let mut b = json!({"model": MODEL, "temperature": 0, "max_tokens": 4,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]});
    b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    b
}

#[tokio::test]
async fn batching_prefix_cache_and_tenant_isolation() {
    let data = temp_dir("engine");
    let server = serve(&data);
    let key_a = new_key(&data, "alpha");
    let key_b = new_key(&data, "beta");
    let url = format!("{}/v1/chat/completions", server.url);

    // Concurrent streams are batched together and still give the golden answer.
    let tasks: Vec<_> = (0..6)
        .map(|_| {
            let (url, key) = (url.clone(), key_a.clone());
            tokio::spawn(async move {
                let resp = client()
                    .post(&url)
                    .bearer_auth(&key)
                    .json(&chat_body(json!({"stream": true})))
                    .send()
                    .await
                    .unwrap();
                let events = sse_events(resp).await;
                assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
                events[..events.len() - 1]
                    .iter()
                    .map(|e| serde_json::from_str::<Value>(e).unwrap())
                    .filter_map(|c| c["choices"][0]["delta"]["content"].as_str().map(str::to_string))
                    .collect::<String>()
            })
        })
        .collect();
    for t in tasks {
        assert_eq!(t.await.unwrap(), "The capital of France is Paris.");
    }

    // A repeated long prompt is served from the prefix cache.
    let system = long_system();
    let (s, _, first) = post(&url, Some(&key_a), &cached_chat(&system, "Hi", json!({}))).await;
    assert_eq!(s, 200, "{first}");
    let prompt_tokens = first["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(prompt_tokens > 300, "{prompt_tokens}");
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let (_, _, again) = post(&url, Some(&key_a), &cached_chat(&system, "Hello there", json!({}))).await;
    let cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        cached >= 256 && cached % 16 == 0 && cached < prompt_tokens,
        "cached {cached} of {prompt_tokens}"
    );
    // Same answer with and without the cache hit (greedy).
    let (_, _, replay) = post(&url, Some(&key_a), &cached_chat(&system, "Hi", json!({}))).await;
    assert_eq!(
        replay["choices"][0]["message"]["content"],
        first["choices"][0]["message"]["content"]
    );
    assert!(
        replay["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            > 0
    );

    // Another tenant sending the very same prompt gets nothing from alpha's cache…
    let (_, _, other) = post(&url, Some(&key_b), &cached_chat(&system, "Hi", json!({}))).await;
    assert_eq!(other["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(
        other["choices"][0]["message"]["content"],
        first["choices"][0]["message"]["content"]
    );
    // …and neither does a different prompt_cache_key within a tenant.
    let (_, _, keyed) = post(
        &url,
        Some(&key_a),
        &cached_chat(&system, "Hi", json!({"prompt_cache_key": "conv-9"})),
    )
    .await;
    assert_eq!(keyed["usage"]["prompt_tokens_details"]["cached_tokens"], 0);

    // n > 1 shares the prompt: one prompt's tokens billed, n completions.
    let (s, _, multi) = post(
        &url,
        Some(&key_a),
        &chat_body(json!({"n": 3, "temperature": 1.0, "seed": 3, "max_tokens": 6})),
    )
    .await;
    assert_eq!(s, 200, "{multi}");
    let choices = multi["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    assert_eq!(multi["usage"]["prompt_tokens"], 42);
    let completion = multi["usage"]["completion_tokens"].as_u64().unwrap();
    assert!((3..=18).contains(&completion), "{completion}");
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
    }

    // Logprobs: the chosen token and the alternatives, as OpenAI shapes them.
    let (s, _, lp) = post(
        &url,
        Some(&key_a),
        &chat_body(json!({"logprobs": true, "top_logprobs": 3, "max_tokens": 3})),
    )
    .await;
    assert_eq!(s, 200, "{lp}");
    let content = lp["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 3);
    assert_eq!(content[0]["token"], "The");
    assert!(content[0]["logprob"].as_f64().unwrap() <= 0.0);
    assert_eq!(content[0]["top_logprobs"].as_array().unwrap().len(), 3);
    assert_eq!(content[0]["top_logprobs"][0]["token"], "The");

    // min_tokens holds back the end of sequence; ignore_eos runs to max_tokens.
    let (_, _, long) = post(
        &url,
        Some(&key_a),
        &chat_body(json!({"ignore_eos": true, "max_tokens": 20})),
    )
    .await;
    assert_eq!(long["usage"]["completion_tokens"], 20);
    assert_eq!(long["choices"][0]["finish_reason"], "length");
    let (_, _, min) = post(
        &url,
        Some(&key_a),
        &chat_body(json!({"min_tokens": 12, "max_tokens": 40})),
    )
    .await;
    assert!(min["usage"]["completion_tokens"].as_u64().unwrap() >= 12, "{min}");
}

#[tokio::test]
async fn worker_kv_events_match_the_prompt_block_hashes() {
    let data = temp_dir("events");
    let (worker, gateway) = worker_and_gateway(&data);
    let key = new_key(&data, "acme");
    let tenant: Value = serde_json::from_str(&admin(&data, &["--json", "tenant", "list"])).unwrap();
    let tenant_id = tenant[0]["id"].as_str().unwrap().to_string();

    let events = client()
        .get(format!("{}/v1/worker/events", worker.url))
        .send()
        .await
        .unwrap();
    assert_eq!(events.status(), 200);
    let mut reader = NdjsonReader {
        bytes: events.bytes_stream().boxed(),
        buf: Vec::new(),
    };
    let snapshot = reader.next().await;
    assert_eq!(snapshot["event"], "snapshot");
    assert_eq!(snapshot["blocks"], json!([]));

    let body = cached_chat(&long_system(), "Hi", json!({}));
    let (s, _, resp) = post(&format!("{}/v1/chat/completions", gateway.url), Some(&key), &body).await;
    assert_eq!(s, 200, "{resp}");
    let prompt_tokens = resp["usage"]["prompt_tokens"].as_u64().unwrap() as usize;

    // The same hashes the router will compute: tokenize like the gateway, hash like the engine.
    let info: hearth_protocol::WorkerInfo = client()
        .get(format!("{}/v1/worker/info", worker.url))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let tok = hearth_protocol::Tokenizer::from_spec(&info.tokenizer).unwrap();
    let tmpl = hearth_protocol::ChatTemplate::new(
        info.tokenizer.chat_template.as_deref().unwrap(),
        "<|im_start|>",
        "<|im_end|>",
    )
    .unwrap();
    let messages: Vec<hearth_protocol::ChatMessage> = serde_json::from_value(body["messages"].clone()).unwrap();
    let ids = tok.encode(&tmpl.render(&messages, true).unwrap());
    assert_eq!(ids.len(), prompt_tokens);
    let root = hearth_protocol::namespace_root(MODEL, &hearth_protocol::cache_namespace(&tenant_id, None));
    let want = hearth_protocol::block_hashes(root, &ids, 16);
    let mut stored: Vec<Value> = Vec::new();
    while stored.len() < want.len() {
        let ev = reader.next().await;
        if ev["event"] == "stored" {
            stored.extend(ev["blocks"].as_array().unwrap().iter().cloned());
        }
    }
    let want: Vec<Value> = want.iter().map(|h| json!(h.0)).collect();
    assert_eq!(&stored[..want.len()], &want[..]);
}

/// Reads newline-delimited JSON values from a streaming response.
struct NdjsonReader {
    bytes: futures_util::stream::BoxStream<'static, reqwest::Result<axum::body::Bytes>>,
    buf: Vec<u8>,
}

impl NdjsonReader {
    async fn next(&mut self) -> Value {
        loop {
            if let Some(pos) = self.buf.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = self.buf.drain(..=pos).collect();
                return serde_json::from_slice(&line).unwrap();
            }
            let chunk = tokio::time::timeout(Duration::from_secs(60), self.bytes.next())
                .await
                .unwrap()
                .unwrap()
                .unwrap();
            self.buf.extend_from_slice(&chunk);
        }
    }
}

#[tokio::test]
async fn two_workers_route_repeated_prefixes_to_their_cache() {
    let data = temp_dir("routing");
    let server = spawn(&[
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--data-dir",
        data.to_str().unwrap(),
        "--workers",
        "2",
    ]);
    let key = new_key(&data, "acme");
    let url = format!("{}/v1/chat/completions", server.url);
    let system = long_system();
    let routing_url = format!("{}/admin/v1/routing", server.url);
    let r = wait_for_exact_events(&routing_url, 2).await;
    assert_eq!(r["data"][0]["policy"]["policy"], "kv_aware");
    let (_, _, first) = post(&url, Some(&key), &cached_chat(&system, "Hi", json!({}))).await;
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    // Every repeat of the prefix lands on the worker that cached it (round robin would
    // miss every other time).
    for q in ["Hello", "Good morning", "Hey there", "Greetings"] {
        let (s, _, again) = post(&url, Some(&key), &cached_chat(&system, q, json!({}))).await;
        assert_eq!(s, 200, "{again}");
        let cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        assert!(cached >= 256, "request {q:?} missed the cache: {again}");
    }
    let r: Value = routing_state(&routing_url).await;
    let decisions = r["data"][0]["decisions"].as_array().unwrap();
    let hits = decisions
        .iter()
        .find(|d| d["reason"] == "hit")
        .map_or(0, |d| d["count"].as_u64().unwrap());
    assert!(hits >= 4, "{r}");
    assert!(r["data"][0]["index_blocks"].as_u64().unwrap() > 0);

    // Session affinity pins a session while its worker is under its bound.
    let body = chat_body(json!({"max_tokens": 2}));
    for _ in 0..3 {
        let resp = client()
            .post(&url)
            .bearer_auth(&key)
            .header("x-session-affinity", "s-1")
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
    }
    let r: Value = routing_state(&routing_url).await;
    let affinity = r["data"][0]["decisions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["reason"] == "affinity")
        .map_or(0, |d| d["count"].as_u64().unwrap());
    assert!(affinity >= 2, "{r}");

    // Prometheus metrics.
    // Operator-only: refused without the admin token.
    let refused = client().get(format!("{}/metrics", server.url)).send().await.unwrap();
    assert_eq!(refused.status(), 401);
    let metrics = client()
        .get(format!("{}/metrics", server.url))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains(
            "hearth_routing_decisions_total{model=\"smollm2-135m-instruct\",policy=\"kv_aware\",reason=\"hit\"}"
        ),
        "{metrics}"
    );
    assert!(metrics.contains("hearth_worker_inflight_requests{"));
    assert!(metrics.contains("hearth_router_index_blocks{"));
    // Request histograms (vLLM's names in Hearth's namespace) and the in-process engines'.
    let m = format!("model=\"{MODEL}\"");
    assert!(
        metric_sum(&metrics, &format!("hearth:time_to_first_token_seconds_count{{{m}}}")) >= 5.0,
        "{metrics}"
    );
    assert!(
        metric_sum(
            &metrics,
            &format!("hearth:e2e_request_latency_seconds_bucket{{{m},le=\"+Inf\"}}")
        ) >= 5.0
    );
    assert!(metric_sum(&metrics, &format!("hearth:inter_token_latency_seconds_count{{{m}}}")) > 0.0);
    assert!(metric_sum(&metrics, &format!("hearth:prompt_tokens_total{{{m}}}")) > 0.0);
    assert!(metric_sum(&metrics, &format!("hearth_prompt_tokens_cached_total{{{m}}}")) > 0.0);
    assert!(
        metric_sum(
            &metrics,
            &format!("hearth_requests_total{{{m},endpoint=\"/v1/chat/completions\",status=\"200\"}}")
        ) >= 5.0
    );
    assert!(
        metric_sum(
            &metrics,
            "hearth_limiter_decisions_total{decision=\"admitted\",limit=\"\"}"
        ) >= 5.0
    );
    for w in ["local-0", "local-1"] {
        assert!(
            metrics.contains(&format!("hearth:kv_cache_usage_perc{{worker=\"{w}\"}}")),
            "{metrics}"
        );
        assert!(metric_sum(&metrics, &format!("hearth_model_load_seconds{{worker=\"{w}\"}}")) > 0.0);
    }
    assert!(
        metric_sum(&metrics, "hearth:request_queue_time_seconds_count{") >= 5.0,
        "{metrics}"
    );
    assert!(metric_sum(&metrics, "hearth:request_prefill_time_seconds_count{") >= 5.0);
    assert!(metric_sum(&metrics, "hearth:prefix_cache_hits_total{") > 0.0);

    // Draining a worker sends everything to the other one.
    for slot in [0, 1] {
        let drained = client()
            .post(format!("{}/admin/v1/routing/{MODEL}/workers/{slot}/drain", server.url))
            .bearer_auth(ADMIN_TOKEN)
            .json(&json!({"draining": slot == 0}))
            .send()
            .await
            .unwrap();
        assert_eq!(drained.status(), 200);
    }
    let (s, _, _) = post(&url, Some(&key), &chat_body(json!({"max_tokens": 1}))).await;
    assert_eq!(s, 200);
}

#[tokio::test]
async fn sim_workers_over_http_follow_events_and_hit_the_cache() {
    let data = temp_dir("sim");
    let workers: Vec<Proc> = (0..3).map(|_| sim_worker("200")).collect();
    let mut args = vec![
        "gateway",
        "--listen",
        "127.0.0.1:0",
        "--data-dir",
        data.to_str().unwrap(),
    ];
    for w in &workers {
        args.extend(["--worker", w.url.as_str()]);
    }
    let gateway = spawn(&args);
    let key = new_key(&data, "acme");
    wait_for_exact_events(&format!("{}/admin/v1/routing", gateway.url), 3).await;
    let prompt: String = "word ".repeat(1500);
    let url = format!("{}/v1/completions", gateway.url);
    for i in 0..4 {
        let (s, _, b) = post(
            &url,
            Some(&key),
            &json!({"model": MODEL, "prompt": format!("{prompt} q{i}"), "max_tokens": 4}),
        )
        .await;
        assert_eq!(s, 200, "{b}");
        let cached = b["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
        assert_eq!(cached > 0, i > 0, "request {i}: {b}");
    }
}

/// The sum of every sample whose line starts with `prefix` (a name, or a name and labels).
async fn routing_state(url: &str) -> Value {
    get_json(url, ADMIN_TOKEN).await
}

/// Waits until the gateway follows all `n` workers' KV events (exact mode); returns the state.
async fn wait_for_exact_events(url: &str, n: usize) -> Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let r = routing_state(url).await;
        let workers = r["data"][0]["workers"].as_array().unwrap().clone();
        assert_eq!(workers.len(), n);
        if workers.iter().all(|w| w["exact_events"] == true) {
            return r;
        }
        assert!(Instant::now() < deadline, "KV event streams not followed: {r}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// `count_tokens` is not billed, but it is a request (a long prompt costs the tokenizer's
/// time): under the tenant's requests per minute, refused past them in Anthropic's shape with
/// the rate headers, and counted in `/metrics` by outcome.
#[tokio::test]
async fn count_tokens_is_under_the_request_limits() {
    let data = temp_dir("count-limits");
    let server = serve(&data);
    let key = new_key(&data, "acme");
    // Before the key is first used, so the server reads the limits with it.
    admin(&data, &["tenant", "limits", "acme", "--rpm", "3"]);
    let url = format!("{}/v1/messages/count_tokens", server.url);
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "Tell me about Paris."}]});
    let count = || client().post(&url).header("x-api-key", &key).json(&body).send();
    for i in 0..3 {
        let r = count().await.unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(
            r.headers()["x-ratelimit-remaining-requests"],
            (2 - i).to_string().as_str()
        );
        let v: Value = r.json().await.unwrap();
        assert!(v["input_tokens"].as_u64().unwrap() > 0, "{v}");
    }
    let r = count().await.unwrap();
    assert_eq!(r.status(), 429);
    assert!(r.headers()["retry-after"].to_str().unwrap().parse::<u64>().unwrap() >= 1);
    let v: Value = r.json().await.unwrap();
    assert_eq!(
        (v["type"].as_str(), v["error"]["type"].as_str()),
        (Some("error"), Some("rate_limit_error")),
        "{v}"
    );
    assert!(
        usage_rows(&data)
            .iter()
            .all(|r| r["endpoint"] != "/v1/messages/count_tokens"),
        "count_tokens is not metered"
    );
    let metrics = client()
        .get(format!("{}/metrics", server.url))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("hearth_token_counts_total{outcome=\"counted\"} 3"),
        "{metrics}"
    );
    assert!(
        metrics.contains("hearth_token_counts_total{outcome=\"refused\"} 1"),
        "{metrics}"
    );
}

#[tokio::test]
async fn rate_limits_answer_429_with_headers_and_are_metered() {
    let data = temp_dir("limits");
    let server = serve(&data);
    let key = new_key(&data, "acme");
    // Before the key is first used, so the server reads the limits with it.
    admin(&data, &["tenant", "limits", "acme", "--rpm", "3"]);
    admin(&data, &TEST_PRICE);
    let url = format!("{}/v1/chat/completions", server.url);
    let body = chat_body(json!({"max_tokens": 1}));
    for i in 0..3 {
        let (s, h, b) = post(&url, Some(&key), &body).await;
        assert_eq!(s, 200, "{b}");
        assert_eq!(h["x-ratelimit-limit-requests"], "3");
        assert_eq!(h["x-ratelimit-remaining-requests"], (2 - i).to_string().as_str());
    }
    let (s, h, b) = post(&url, Some(&key), &body).await;
    assert_eq!(s, 429, "{b}");
    assert_eq!(b["error"]["code"], "rate_limit_exceeded");
    assert_eq!(b["error"]["type"], "requests");
    assert!(h["retry-after"].to_str().unwrap().parse::<u64>().unwrap() >= 1);
    assert_eq!(h["x-ratelimit-remaining-requests"], "0");
    let rows = usage_rows(&data);
    let refused: Vec<&Value> = rows
        .iter()
        .filter(|r| r["error_code"] == "rate_limit_exceeded")
        .collect();
    assert_eq!(refused.len(), 1);
    // Recorded for audit, at zero cost: a refused request is never billed.
    assert_eq!(refused[0]["prompt_tokens"], 0, "{:?}", refused[0]);
    assert_eq!(refused[0]["cost"]["total_nusd"], 0, "{:?}", refused[0]);
    assert!(rows
        .iter()
        .any(|r| r["status"] == "completed" && r["cost"]["total_nusd"].as_i64().unwrap() > 0));

    // A second key of another tenant: concurrency and tokens per minute, set over the admin API.
    let other = new_key(&data, "beta");
    let other_id = other.split('_').nth(1).unwrap();
    let resp = client()
        .put(format!("{}/admin/v1/keys/{other_id}/limits", server.url))
        .bearer_auth(ADMIN_TOKEN)
        .json(&json!({"concurrent": 1, "tpm": 100}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let stream = client()
        .post(&url)
        .bearer_auth(&other)
        .json(&chat_body(json!({"stream": true, "max_tokens": 8})))
        .send()
        .await
        .unwrap();
    assert_eq!(stream.status(), 200);
    let (s, _, b) = post(&url, Some(&other), &body).await;
    assert_eq!(s, 429, "one in flight already: {b}");
    assert!(b["error"]["message"].as_str().unwrap().contains("concurrent"));
    sse_events(stream).await;
    // 42 prompt tokens + 8 generated used half of the 100 tokens per minute: a request that
    // may need 42 + 20 does not fit in what is left.
    let (s, h, b) = post(&url, Some(&other), &chat_body(json!({"max_tokens": 20}))).await;
    assert_eq!(s, 429, "{b}");
    assert_eq!(b["error"]["type"], "tokens");
    assert!(h.get("x-ratelimit-limit-tokens").is_some());
}

/// A log written to a file (not a terminal) is plain text: no ANSI escape sequences, even
/// with colours requested by the environment's defaults.
#[test]
fn logs_to_a_file_carry_no_escape_sequences() {
    use std::process::{Command, Stdio};
    let data = temp_dir("plainlog");
    let log_path = data.join("serve.log");
    let log = std::fs::File::create(&log_path).unwrap();
    needs_for(&["serve"]);
    let mut child = Command::new(bin())
        .args(["serve", "--listen", "127.0.0.1:0", "--backend", "sim", "--data-dir"])
        .arg(&data)
        .env("HEARTH_LOG", "info")
        .env_remove("NO_COLOR")
        .stdout(Stdio::piped())
        .stderr(Stdio::from(log))
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let started = std::io::BufRead::lines(std::io::BufReader::new(stdout))
        .map_while(Result::ok)
        .any(|l| l.contains("listening on "));
    let _ = child.kill();
    let _ = child.wait();
    assert!(started, "hearth serve did not start");
    let text = std::fs::read_to_string(&log_path).unwrap();
    assert!(text.contains("INFO"), "the log has the start-up lines: {text}");
    assert!(!text.contains('\u{1b}'), "escape sequences in a log file: {text:?}");
}

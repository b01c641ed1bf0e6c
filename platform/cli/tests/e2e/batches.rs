//! End-to-end for OpenAI's Files and Batch APIs through real processes (a sim worker, which
//! runs the real worker and scheduler without the maths, and real gateways):
//! * a batch of good and bad lines: every good line answered once, every bad one in the
//!   error file; the gateway SIGKILLed mid-batch and restarted: the batch completes, one
//!   usage row per line run, none doubled, each at the batch price;
//! * another tenant sees none of it (404);
//! * cancelling: no line starts after the batch is `cancelled`, unrun lines in the error file;
//! * two gateways on one database (PostgreSQL when `DATABASE_URL` is set) and Redis share
//!   one batch: both run lines, none twice.

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::harness::*;
use serde_json::{json, Value};

/// The JSONL of `good` chat lines (`good-N`) and the bad ones, mixed in.
fn input(good: usize, max_tokens: u32) -> (String, usize) {
    let mut lines = Vec::new();
    for i in 0..good {
        lines.push(
            json!({"custom_id": format!("good-{i}"), "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": MODEL, "max_tokens": max_tokens, "temperature": 0,
                    "messages": [{"role": "user", "content": format!("Count to {i}.")}]}})
            .to_string(),
        );
        if i == good / 2 {
            // Refused when the batch is created: not JSON, another endpoint, no custom_id.
            lines.push("{not json".to_string());
            lines.push(
                json!({"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings", "body": {}}).to_string(),
            );
            lines.push(json!({"method": "POST", "url": "/v1/chat/completions", "body": {}}).to_string());
            // Runs, and is refused by the model: more tokens than the context holds.
            lines.push(
                json!({"custom_id": "bad-context", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"model": MODEL, "max_tokens": 100_000_000, "messages": [{"role": "user", "content": "hi"}]}})
                .to_string(),
            );
        }
    }
    (lines.join("\n") + "\n", 4)
}

async fn upload(url: &str, key: &str, content: String) -> Value {
    let form = reqwest::multipart::Form::new().text("purpose", "batch").part(
        "file",
        reqwest::multipart::Part::bytes(content.into_bytes()).file_name("requests.jsonl"),
    );
    let r = client()
        .post(format!("{url}/v1/files"))
        .bearer_auth(key)
        .multipart(form)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

async fn create(url: &str, key: &str, file: &str) -> Value {
    let (s, _, b) = post(
        &format!("{url}/v1/batches"),
        Some(key),
        &json!({"input_file_id": file, "endpoint": "/v1/chat/completions", "completion_window": "24h",
            "metadata": {"job": "e2e"}}),
    )
    .await;
    assert_eq!(s, 200, "{b}");
    assert_eq!(b["status"], "in_progress", "{b}");
    b
}

async fn status(url: &str, key: &str, id: &str) -> (u16, Value) {
    let r = client()
        .get(format!("{url}/v1/batches/{id}"))
        .bearer_auth(key)
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
}

/// Polls the batch until `done` holds (at most two minutes).
async fn wait_for(url: &str, key: &str, id: &str, done: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let (s, b) = status(url, key, id).await;
        assert_eq!(s, 200, "{b}");
        if done(&b) {
            return b;
        }
        assert!(Instant::now() < deadline, "batch stuck: {b}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn content(url: &str, key: &str, file: &str) -> (u16, String) {
    let r = client()
        .get(format!("{url}/v1/files/{file}/content"))
        .bearer_auth(key)
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

fn jsonl(text: &str) -> Vec<Value> {
    text.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

/// The usage rows of one batch.
fn batch_rows(data: &Path, extra: &[&str], batch: &str) -> Vec<Value> {
    usage_rows_with(data, extra)
        .into_iter()
        .filter(|r| r["batch_id"] == batch)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_survives_sigkill_and_keeps_tenants_apart() {
    let data = temp_dir("batches");
    let worker = sim_worker("1");
    let args = ["--batch-lease-secs", "3", "--batch-concurrency", "2"];
    let gw = gateway_with(&data, &worker.url, &args, &[]);
    let key = new_key(&data, "acme");
    let other = new_key(&data, "globex");
    admin(&data, &TEST_PRICE);
    let url = gw.url.clone();

    // 30 good lines of 24 tokens, 4 bad ones.
    let (text, bad) = input(30, 24);
    let file = upload(&url, &key, text).await;
    assert_eq!(file["object"], "file");
    assert_eq!(file["purpose"], "batch");
    let file_id = file["id"].as_str().unwrap();
    let b = create(&url, &key, file_id).await;
    let id = b["id"].as_str().unwrap().to_string();
    assert_eq!(b["request_counts"]["total"], 34, "{b}");
    assert_eq!(b["request_counts"]["failed"], 3, "refused at creation: {b}");
    assert_eq!(b["metadata"]["job"], "e2e");

    // Another tenant sees none of it.
    let (s, _) = status(&url, &other, &id).await;
    assert_eq!(s, 404);
    for path in [format!("/v1/files/{file_id}"), format!("/v1/files/{file_id}/content")] {
        let r = client()
            .get(format!("{url}{path}"))
            .bearer_auth(&other)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 404, "{path}");
    }
    let (s, _, _) = post(&format!("{url}/v1/batches/{id}/cancel"), Some(&other), &json!({})).await;
    assert_eq!(s, 404);
    let listed = get_json(&format!("{url}/v1/batches"), &other).await;
    assert_eq!(listed["data"].as_array().unwrap().len(), 0, "{listed}");

    // SIGKILL once some lines are answered, while others run.
    let mid = wait_for(&url, &key, &id, |b| {
        b["request_counts"]["completed"].as_i64() >= Some(4)
    })
    .await;
    let mut gw = gw;
    gw.child.kill().unwrap();
    let _ = gw.child.wait();
    println!("injected: SIGKILL of the gateway at {}", mid["request_counts"]);
    let gw2 = gateway_with(&data, &worker.url, &args, &[]);
    let url = gw2.url.clone();
    let done = wait_for(&url, &key, &id, |b| b["status"] == "completed").await;
    println!("observed: {}", done["request_counts"]);
    assert_eq!(done["request_counts"]["completed"], 30, "{done}");
    assert_eq!(done["request_counts"]["failed"], 4, "{done}");
    assert!(done["completed_at"].as_i64().is_some());

    // Every good line answered once, in OpenAI's output shape.
    let (s, out) = content(&url, &key, done["output_file_id"].as_str().unwrap()).await;
    assert_eq!(s, 200);
    let out = jsonl(&out);
    let mut seen: HashMap<String, usize> = HashMap::new();
    for l in &out {
        *seen.entry(l["custom_id"].as_str().unwrap().to_string()).or_default() += 1;
        assert_eq!(l["response"]["status_code"], 200, "{l}");
        assert_eq!(l["response"]["body"]["object"], "chat.completion", "{l}");
        assert_eq!(l["error"], Value::Null);
        assert_eq!(l["id"], l["response"]["request_id"]);
    }
    assert_eq!(seen.len(), 30);
    assert!(seen.values().all(|n| *n == 1), "{seen:?}");
    // Every bad one in the error file.
    let (_, err) = content(&url, &key, done["error_file_id"].as_str().unwrap()).await;
    let err = jsonl(&err);
    assert_eq!(err.len(), bad, "{err:#?}");
    let codes: Vec<String> = err
        .iter()
        .map(|l| {
            l["error"]["code"]
                .as_str()
                .map(str::to_string)
                .unwrap_or_else(|| l["response"]["status_code"].to_string())
        })
        .collect();
    for code in ["invalid_json", "invalid_url", "missing_custom_id", "400"] {
        assert!(codes.iter().any(|c| c == code), "{code} not in {codes:?}");
    }

    // One usage row per line that ran (30 good, 1 refused by the model), none doubled, each
    // at the batch price: half of $1/M input and $2/M output.
    let rows = batch_rows(&data, &[], &id);
    let mut ids: Vec<&str> = rows.iter().map(|r| r["request_id"].as_str().unwrap()).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), rows.len(), "a row doubled");
    assert_eq!(rows.len(), 31, "{rows:#?}");
    for r in rows.iter().filter(|r| r["status"] == "completed") {
        let (p, c) = (
            r["prompt_tokens"].as_i64().unwrap(),
            r["completion_tokens"].as_i64().unwrap(),
        );
        let cached = r["cached_tokens"].as_i64().unwrap();
        let full = ((p - cached) * 1_000 + cached * 100 + c * 2_000) as f64; // nano-USD
        let cost = r["cost"]["total_nusd"].as_i64().unwrap() as f64;
        assert!((cost - full / 2.0).abs() <= 2.0, "{r}: {cost} against {}", full / 2.0);
    }
    // The batch shows its usage so far.
    let (_, shown) = status(&url, &key, &id).await;
    assert!(shown["usage"]["output_tokens"].as_i64().unwrap() > 0, "{shown}");
    // The export names the batch.
    let csv = client()
        .get(format!("{url}/v1/tenant/usage/export?format=csv&granularity=request"))
        .bearer_auth(&key)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(csv.lines().next().unwrap().contains("batch_id"), "{csv}");
    assert!(csv.contains(&id));

    // Cancelling: the lines running finish, none starts after.
    let (text, _) = input(40, 64);
    let file = upload(&url, &key, text).await;
    let c = create(&url, &key, file["id"].as_str().unwrap()).await;
    let cid = c["id"].as_str().unwrap().to_string();
    wait_for(&url, &key, &cid, |b| {
        b["request_counts"]["completed"].as_i64() >= Some(2)
    })
    .await;
    let (s, _, cancelling) = post(&format!("{url}/v1/batches/{cid}/cancel"), Some(&key), &json!({})).await;
    assert_eq!(s, 200, "{cancelling}");
    assert!(["cancelling", "cancelled"].contains(&cancelling["status"].as_str().unwrap()));
    let cancelled = wait_for(&url, &key, &cid, |b| b["status"] == "cancelled").await;
    let ran = batch_rows(&data, &[], &cid).len();
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        batch_rows(&data, &[], &cid).len(),
        ran,
        "a line started after the cancel"
    );
    let answered = cancelled["request_counts"]["completed"].as_i64().unwrap();
    assert!(answered < 40, "{cancelled}");
    let (_, err) = content(&url, &key, cancelled["error_file_id"].as_str().unwrap()).await;
    let unrun = jsonl(&err)
        .iter()
        .filter(|l| l["error"]["code"] == "batch_cancelled")
        .count() as i64;
    assert_eq!(
        unrun,
        40 - answered - (cancelled["request_counts"]["failed"].as_i64().unwrap() - 4)
    );
    println!("cancelled: {answered} of 40 lines answered, {unrun} not run");
    let audit = admin(&data, &["audit", "--tenant", "acme"]);
    assert!(audit.contains("batch.cancel") && audit.contains(&cid), "{audit}");

    // Deleting the input leaves the finished batch and its outputs.
    let r = client()
        .delete(format!("{url}/v1/files/{file_id}"))
        .bearer_auth(&key)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let (s, _) = content(&url, &key, done["output_file_id"].as_str().unwrap()).await;
    assert_eq!(s, 200);
    drop(gw2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_share_one_batch() {
    let (data_a, data_b) = (temp_dir("batches-a"), temp_dir("batches-b"));
    let (_pg, db_url) = one_database(&data_a).await;
    let worker = sim_worker("1");
    let prefix = format!("hearth-batches-{}-{}:", std::process::id(), hearth_tenants::now_ms());
    let redis = redis_url();
    let args = [
        "--database-url",
        &db_url,
        "--redis-url",
        &redis,
        "--redis-prefix",
        &prefix,
        "--batch-concurrency",
        "2",
    ];
    let ga = gateway_with(&data_a, &worker.url, &args, &[]);
    let gb = gateway_with(&data_b, &worker.url, &args, &[]);
    let key = new_key_with(&data_a, &["--database-url", &db_url], "acme");
    let (text, _) = input(40, 8);
    let file = upload(&ga.url, &key, text).await;
    let b = create(&ga.url, &key, file["id"].as_str().unwrap()).await;
    let id = b["id"].as_str().unwrap();
    let done = wait_for(&gb.url, &key, id, |b| b["status"] == "completed").await;
    assert_eq!(done["request_counts"]["completed"], 40, "{done}");
    let (_, out) = content(&gb.url, &key, done["output_file_id"].as_str().unwrap()).await;
    let mut ids: Vec<String> = jsonl(&out)
        .iter()
        .map(|l| l["custom_id"].as_str().unwrap().to_string())
        .collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 40);
    let rows = batch_rows(&data_a, &["--database-url", &db_url], id);
    assert_eq!(rows.len(), 41, "40 good lines and the one the model refuses");
    let (ma, mb) = (metrics(&ga.url).await, metrics(&gb.url).await);
    let (na, nb) = (
        metric_sum(&ma, "hearth_batch_lines_total"),
        metric_sum(&mb, "hearth_batch_lines_total"),
    );
    println!("lines run: gateway A {na}, gateway B {nb}");
    assert_eq!(na + nb, 41.0);
    assert!(na > 0.0 && nb > 0.0, "both gateways run lines: {na} and {nb}");
}

/// The other endpoints a batch may run: `/v1/completions` and `/v1/responses` answer in
/// their own shapes; a line of one endpoint in a batch of another is an error line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_and_responses_batches() {
    let data = temp_dir("batches-endpoints");
    let worker = sim_worker("4");
    let gw = gateway_with(&data, &worker.url, &[], &[]);
    let key = new_key(&data, "acme");
    let url = gw.url.clone();
    for (endpoint, body, object) in [
        (
            "/v1/completions",
            json!({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4}),
            "text_completion",
        ),
        (
            "/v1/responses",
            json!({"model": MODEL, "input": "Say hi.", "max_output_tokens": 4}),
            "response",
        ),
    ] {
        let lines = [
            json!({"custom_id": "a", "method": "POST", "url": endpoint, "body": body}).to_string(),
            json!({"custom_id": "b", "method": "POST", "url": endpoint, "body": body}).to_string(),
            json!({"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": body}).to_string(),
        ];
        let file = upload(&url, &key, lines.join("\n")).await;
        let (s, _, b) = post(
            &format!("{url}/v1/batches"),
            Some(&key),
            &json!({"input_file_id": file["id"], "endpoint": endpoint, "completion_window": "24h"}),
        )
        .await;
        assert_eq!(s, 200, "{b}");
        let done = wait_for(&url, &key, b["id"].as_str().unwrap(), |b| b["status"] == "completed").await;
        assert_eq!(
            (
                done["request_counts"]["completed"].as_i64(),
                done["request_counts"]["failed"].as_i64()
            ),
            (Some(2), Some(1)),
            "{endpoint}: {done}"
        );
        let (_, out) = content(&url, &key, done["output_file_id"].as_str().unwrap()).await;
        for l in jsonl(&out) {
            assert_eq!(l["response"]["body"]["object"], object, "{endpoint}: {l}");
        }
        let (_, err) = content(&url, &key, done["error_file_id"].as_str().unwrap()).await;
        assert_eq!(jsonl(&err)[0]["error"]["code"], "invalid_url", "{endpoint}: {err}");
    }
    // Requests the API refuses: named, in OpenAI's error shape.
    let file = upload(&url, &key, "{}\n".into()).await;
    for (body, param) in [
        (
            json!({"input_file_id": file["id"], "endpoint": "/v1/embeddings", "completion_window": "24h"}),
            "endpoint",
        ),
        (
            json!({"input_file_id": file["id"], "endpoint": "/v1/completions", "completion_window": "1h"}),
            "completion_window",
        ),
        (
            json!({"input_file_id": "file-nope", "endpoint": "/v1/completions", "completion_window": "24h"}),
            "input_file_id",
        ),
        (
            json!({"input_file_id": file["id"], "endpoint": "/v1/completions", "completion_window": "24h", "metadata": {"k": 1}}),
            "metadata",
        ),
    ] {
        let (s, _, b) = post(&format!("{url}/v1/batches"), Some(&key), &body).await;
        assert_eq!((s, b["error"]["param"].as_str()), (400, Some(param)), "{b}");
    }
}

/// Issue 78, finding 3: with four 60-line batches of one tenant open, another tenant's
/// 3-line batch runs beside them (the slots are shared between tenants first), and
/// completes while most of the first tenant's lines are still waiting. Before, the oldest
/// batches took every slot that came free, and the second tenant's batch ran only after the
/// first tenant's were done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_tenants_batches_do_not_starve_anothers() {
    let data = temp_dir("batches-fair");
    // About 20 tokens a second per line: each line takes about a second.
    let worker = sim_worker("1");
    let gw = gateway_with(&data, &worker.url, &["--batch-concurrency", "4"], &[]);
    let (hog, small) = (new_key(&data, "hog"), new_key(&data, "small"));
    let url = gw.url.clone();
    let batch = |n: usize| {
        (0..n)
            .map(|i| {
                json!({"custom_id": format!("l{i}"), "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": MODEL, "max_tokens": 20, "ignore_eos": true,
                                "messages": [{"role": "user", "content": format!("Line {i}.")}]}})
                .to_string()
            })
            .collect::<Vec<_>>()
            .join("\n")
    };
    let create_batch = |key: String, lines: String| {
        let url = url.clone();
        async move {
            let file = upload(&url, &key, lines).await;
            let (s, _, b) = post(
                &format!("{url}/v1/batches"),
                Some(&key),
                &json!({"input_file_id": file["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}),
            )
            .await;
            assert_eq!(s, 200, "{b}");
            b["id"].as_str().unwrap().to_string()
        }
    };
    let mut hogs = Vec::new();
    for _ in 0..4 {
        hogs.push(create_batch(hog.clone(), batch(60)).await);
    }
    // The hog's lines are running when the small batch arrives.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let started = Instant::now();
    let mine = create_batch(small.clone(), batch(3)).await;
    let done = wait_for(&url, &small, &mine, |b| b["status"] == "completed").await;
    assert_eq!(done["request_counts"]["completed"], 3, "{done}");
    let mut hog_done = 0;
    for id in &hogs {
        let (_, b) = status(&url, &hog, id).await;
        hog_done += b["request_counts"]["completed"].as_i64().unwrap_or(0);
    }
    assert!(
        hog_done < 200,
        "the small batch finished after {:?}, when {hog_done} of the hog's 240 lines were done",
        started.elapsed()
    );
    for id in &hogs {
        let _ = post(&format!("{url}/v1/batches/{id}/cancel"), Some(&hog), &json!({})).await;
    }
}

/// Issue 78, finding 7: a batch line is held against a hard budget at the batch price it
/// will pay (half the list price), so a line that fits the budget only at the batch price
/// runs instead of pausing the batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_line_is_held_at_the_batch_price() {
    let data = temp_dir("batches-budget");
    let worker = sim_worker("100");
    let gw = gateway_with(&data, &worker.url, &[], &[]);
    admin(&data, &TEST_PRICE);
    let key = new_key(&data, "thrifty");
    // $0.0001: a short prompt and 70 completion tokens ($2/M) are over $0.00014 at the
    // list price, under $0.0001 at the batch price.
    admin(&data, &["tenant", "budget", "thrifty", "--monthly-usd", "0.0001"]);
    let line = json!({"custom_id": "only", "method": "POST", "url": "/v1/chat/completions",
                      "body": {"model": MODEL, "max_tokens": 70, "ignore_eos": true,
                               "messages": [{"role": "user", "content": "Hi."}]}});
    let file = upload(&gw.url, &key, line.to_string()).await;
    let (s, _, b) = post(
        &format!("{}/v1/batches", gw.url),
        Some(&key),
        &json!({"input_file_id": file["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}),
    )
    .await;
    assert_eq!(s, 200, "{b}");
    let done = wait_for(&gw.url, &key, b["id"].as_str().unwrap(), |b| {
        b["status"] == "completed" || b["paused_reason"].is_string()
    })
    .await;
    assert_eq!(done["request_counts"]["completed"], 1, "{done}");
}

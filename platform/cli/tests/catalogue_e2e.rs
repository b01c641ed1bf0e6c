//! `hearth serve --catalogue`: two models from one catalogue file, each loaded on its first
//! request; `/v1/models` shows their states; the one with an idle TTL scales to zero and is
//! loaded again by the next request.

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::json;

async fn states(url: &str, key: &str) -> Vec<(String, String)> {
    let models = get_json(&format!("{url}/v1/models"), key).await;
    let mut v: Vec<(String, String)> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["id"].as_str().unwrap().to_string(),
                m["state"].as_str().unwrap_or("?").to_string(),
            )
        })
        .collect();
    v.sort();
    v
}

async fn ask(url: &str, key: &str, model: &str) {
    let body = json!({"model": model, "temperature": 0, "messages": [{"role": "user", "content": QUESTION}]});
    let (status, _, body) = post(&format!("{url}/v1/chat/completions"), Some(key), &body).await;
    assert_eq!(status, 200, "{model}: {body}");
    let content = body["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(content, "The capital of France is Paris.", "{model}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn catalogue_models_load_on_demand_and_scale_to_zero() {
    let data = temp_dir("catalogue");
    let file = data.join("catalogue.toml");
    std::fs::write(
        &file,
        format!(
            r#"
[[model]]
id = "alpha"
source = "{MODEL}"
idle_ttl_s = 1

[[model]]
id = "beta"
source = "{MODEL}"
context_length = 256
"#
        ),
    )
    .unwrap();
    let server = spawn(&[
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--data-dir",
        data.to_str().unwrap(),
        "--catalogue",
        file.to_str().unwrap(),
        "--kv-cache-mib",
        "32",
    ]);
    let key = new_key(&data, "acme");
    let url = server.url.clone();
    let cold = |m: &str| (m.to_string(), "cold".to_string());
    let warm = |m: &str| (m.to_string(), "warm".to_string());
    assert_eq!(states(&url, &key).await, [cold("alpha"), cold("beta")]);
    let beta = get_json(&format!("{url}/v1/models/beta"), &key).await;
    assert_eq!(beta["context_length"], 256, "{beta}");

    ask(&url, &key, "alpha").await;
    assert_eq!(states(&url, &key).await, [warm("alpha"), cold("beta")]);
    ask(&url, &key, "beta").await;

    // alpha's idle TTL (1 s) passes: unloaded; beta (no TTL) stays warm.
    let t = Instant::now();
    while states(&url, &key).await[0] != cold("alpha") {
        assert!(t.elapsed() < Duration::from_secs(20), "alpha was not unloaded");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(states(&url, &key).await, [cold("alpha"), warm("beta")]);
    // The next request loads it again.
    ask(&url, &key, "alpha").await;
    assert_eq!(states(&url, &key).await[0], warm("alpha"));
    drop(server);
}

/// A catalogue worker behind a separate gateway: the gateway finds both models through
/// `GET /v1/worker/models`, routes each to the worker's per-model routes, and follows their
/// states through its health checks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_catalogue_worker_serves_several_models_to_a_gateway() {
    let data = temp_dir("catalogue-worker");
    let file = data.join("catalogue.toml");
    std::fs::write(
        &file,
        format!("[[model]]\nid = \"alpha\"\nsource = \"{MODEL}\"\n\n[[model]]\nid = \"beta\"\nsource = \"{MODEL}\"\n"),
    )
    .unwrap();
    let worker = spawn(&[
        "worker",
        "--listen",
        "127.0.0.1:0",
        "--catalogue",
        file.to_str().unwrap(),
        "--kv-cache-mib",
        "32",
    ]);
    let gateway = gateway_with(&data, &worker.url, &[], &[]);
    let key = new_key(&data, "acme");
    let url = gateway.url.clone();
    let ids: Vec<String> = states(&url, &key).await.into_iter().map(|(id, _)| id).collect();
    assert_eq!(ids, ["alpha", "beta"]);
    ask(&url, &key, "beta").await;
    // The gateway learns beta's state at its next health check (every 2 s).
    let t = Instant::now();
    while states(&url, &key).await
        != [
            ("alpha".to_string(), "cold".to_string()),
            ("beta".to_string(), "warm".to_string()),
        ]
    {
        assert!(t.elapsed() < Duration::from_secs(20), "{:?}", states(&url, &key).await);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    ask(&url, &key, "alpha").await;
    drop((gateway, worker));
}

//! `hearth serve --catalogue`: two models from one catalogue file (the default GGUF and a
//! Hugging Face directory exported from it), each loaded on its first request; `/v1/models`
//! shows their states; the one with an idle TTL scales to zero (its memory released) and is
//! loaded again by the next request. Models added and removed at runtime (admin API and
//! CLI, in-process and on a catalogue worker behind a gateway), and per-tenant visibility.

use std::time::{Duration, Instant};

use crate::harness::*;
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

/// Resident memory of a process, in MiB.
fn rss_mib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: f64 = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap();
    kib / 1024.0
}

/// `hearth CMD…`, which must succeed; its stdout.
fn hearth<S: AsRef<std::ffi::OsStr> + std::fmt::Debug>(args: &[S]) -> String {
    let out = std::process::Command::new(bin())
        .args(args)
        .env("HEARTH_ADMIN_TOKEN", ADMIN_TOKEN)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "hearth {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// `hearth CMD…`, which must fail; its stderr.
fn hearth_fails<S: AsRef<std::ffi::OsStr> + std::fmt::Debug>(args: &[S]) -> String {
    let out = std::process::Command::new(bin())
        .args(args)
        .env("HEARTH_ADMIN_TOKEN", ADMIN_TOKEN)
        .output()
        .unwrap();
    assert!(!out.status.success(), "hearth {args:?} succeeded");
    String::from_utf8(out.stderr).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn catalogue_models_load_on_demand_and_scale_to_zero() {
    let data = temp_dir("catalogue");
    // A Hugging Face directory (sharded F16 safetensors + tokenizer.json) from the GGUF.
    let hf = data.join("smollm2-hf");
    needs_for(&["serve"]); // export-hf reads the default model
    hearth(&["model", "export-hf", "--out", hf.to_str().unwrap(), "--shards", "2"]);
    let file = data.join("catalogue.toml");
    std::fs::write(
        &file,
        format!(
            r#"
[[model]]
id = "alpha"
source = "{MODEL}"
context_length = 256

[[model]]
id = "beta"
source = "smollm2-hf"  # relative to this file
idle_ttl_s = 1
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
    let alpha = get_json(&format!("{url}/v1/models/alpha"), &key).await;
    assert_eq!(alpha["context_length"], 256, "{alpha}");

    ask(&url, &key, "alpha").await;
    assert_eq!(states(&url, &key).await, [warm("alpha"), cold("beta")]);
    let before = rss_mib(server.child.id());
    ask(&url, &key, "beta").await;
    let warm_rss = rss_mib(server.child.id());

    // beta's idle TTL (1 s) passes: unloaded, its memory released; alpha (no TTL) stays warm.
    let t = Instant::now();
    while states(&url, &key).await[1] != cold("beta") {
        assert!(t.elapsed() < Duration::from_secs(20), "beta was not unloaded");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(states(&url, &key).await, [warm("alpha"), cold("beta")]);
    // The state turns cold when the host drops the engine's handle; the engine thread then
    // stops and frees the weights a moment later (a fresh-clone CI run once read RSS in
    // between: 99 MiB released at that instant).
    let t = Instant::now();
    let mut cold_rss = rss_mib(server.child.id());
    while warm_rss - cold_rss <= 100.0 && t.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(100)).await;
        cold_rss = rss_mib(server.child.id());
    }
    eprintln!(
        "RSS: alpha warm {before:.0} MiB; + beta (F16 safetensors) {warm_rss:.0} MiB; beta unloaded {cold_rss:.0} MiB"
    );
    assert!(
        warm_rss - cold_rss > 100.0,
        "unloading beta released {:.0} MiB",
        warm_rss - cold_rss
    );
    // The next request loads it again.
    ask(&url, &key, "beta").await;
    assert_eq!(states(&url, &key).await[1], warm("beta"));
    drop(server);
}

/// Models added and removed at runtime with `hearth admin model` (in-process catalogue),
/// written back to the catalogue file; a model limited to one tenant is invisible to others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_are_added_and_removed_at_runtime_and_visible_per_tenant() {
    let data = temp_dir("catalogue-runtime");
    let file = data.join("catalogue.toml");
    std::fs::write(&file, format!("[[model]]\nid = \"alpha\"\nsource = \"{MODEL}\"\n")).unwrap();
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
    let url = server.url.clone();
    let (acme, globex) = (new_key(&data, "acme"), new_key(&data, "globex"));
    let cli = |rest: &[&str]| -> Vec<String> {
        ["admin", "model", "--gateway-url", url.as_str()]
            .iter()
            .chain(rest)
            .map(|s| s.to_string())
            .collect()
    };

    let out = hearth(&cli(&[
        "add",
        "--id",
        "private",
        "--source",
        MODEL,
        "--tenant",
        "acme",
        "--idle-ttl-s",
        "60",
    ]));
    assert!(out.starts_with("private\tcold"), "{out}");
    let written = std::fs::read_to_string(&file).unwrap();
    assert!(
        written.contains("id = \"private\"") && written.contains("tenants = [\"acme\"]"),
        "{written}"
    );
    // Visible to acme only; to globex it does not exist.
    let ids = |v: Vec<(String, String)>| v.into_iter().map(|(id, _)| id).collect::<Vec<_>>();
    assert_eq!(ids(states(&url, &acme).await), ["alpha", "private"]);
    assert_eq!(ids(states(&url, &globex).await), ["alpha"]);
    let hidden = client()
        .get(format!("{url}/v1/models/private"))
        .bearer_auth(&globex)
        .send()
        .await
        .unwrap();
    assert_eq!(hidden.status(), 404);
    ask(&url, &acme, "private").await;
    let body = json!({"model": "private", "messages": [{"role": "user", "content": "hi"}]});
    let (status, _, err) = post(&format!("{url}/v1/chat/completions"), Some(&globex), &body).await;
    assert_eq!(
        (status, err["error"]["code"].as_str()),
        (404, Some("model_not_found")),
        "{err}"
    );
    let list = hearth(&cli(&["list"]));
    assert!(list.contains("private\twarm\tlocal-private=warm\tacme"), "{list}");

    // Refusals are explained.
    let dup = hearth_fails(&cli(&["add", "--id", "alpha", "--source", MODEL]));
    assert!(dup.contains("409") && dup.contains("already served"), "{dup}");
    let bad = hearth_fails(&cli(&["add", "--id", "nope", "--source", "/no/such/model.gguf"]));
    assert!(bad.contains("400") && bad.contains("does not exist"), "{bad}");
    let bad_id = hearth_fails(&cli(&["add", "--id", "a b", "--source", MODEL]));
    assert!(bad_id.contains("400"), "{bad_id}");

    // Removed: gone for everyone, and from the file.
    assert_eq!(hearth(&cli(&["remove", "private"])).trim(), "removed private");
    assert_eq!(ids(states(&url, &acme).await), ["alpha"]);
    let (status, _, _) = post(&format!("{url}/v1/chat/completions"), Some(&acme), &body).await;
    assert_eq!(status, 404);
    assert!(!std::fs::read_to_string(&file).unwrap().contains("private"));
    let gone = hearth_fails(&cli(&["remove", "private"]));
    assert!(gone.contains("404"), "{gone}");
    ask(&url, &acme, "alpha").await;

    // The last model removed: the catalogue is empty, and a restart still serves it (none).
    assert_eq!(hearth(&cli(&["remove", "alpha"])).trim(), "removed alpha");
    drop(server);
    let server = spawn(&[
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--data-dir",
        data.to_str().unwrap(),
        "--catalogue",
        file.to_str().unwrap(),
    ]);
    assert!(states(&server.url, &acme).await.is_empty());
    let cli = |rest: &[&str]| -> Vec<String> {
        ["admin", "model", "--gateway-url", server.url.as_str()]
            .iter()
            .chain(rest)
            .map(|s| s.to_string())
            .collect()
    };
    hearth(&cli(&["add", "--id", "alpha", "--source", MODEL]));
    ask(&server.url, &acme, "alpha").await;
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
    let token = [("HEARTH_WORKER_TOKEN", "e2e-worker-token")];
    let worker = spawn_with_env(
        &[
            "worker",
            "--listen",
            "127.0.0.1:0",
            "--catalogue",
            file.to_str().unwrap(),
            "--kv-cache-mib",
            "32",
        ],
        &token,
    );
    let gateway = gateway_with(&data, &worker.url, &[], &token);
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

    // Added at runtime through the gateway's admin API: the worker's catalogue takes it and
    // the gateway serves it through the worker's per-model routes.
    let admin = |m: reqwest::Method, path: &str| {
        client()
            .request(m, format!("{url}/admin/v1/models{path}"))
            .bearer_auth(ADMIN_TOKEN)
    };
    let spec = json!({"id": "gamma", "source": MODEL, "idle_ttl_s": 30});
    let resp = admin(reqwest::Method::POST, "").json(&spec).send().await.unwrap();
    assert_eq!(resp.status(), 201, "{}", resp.text().await.unwrap());
    ask(&url, &key, "gamma").await;
    let resp = admin(reqwest::Method::POST, "").json(&spec).send().await.unwrap();
    assert_eq!(resp.status(), 409);
    let bad = admin(reqwest::Method::POST, "")
        .json(&json!({"id": "x", "source": MODEL, "bogus": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 400);
    // Catalogue changes need the worker token: straight to the worker without it, refused.
    let direct = client()
        .post(format!("{}/v1/worker/models", worker.url))
        .json(&json!({"id": "sneaky", "source": MODEL}))
        .send()
        .await
        .unwrap();
    assert_eq!(direct.status(), 401);
    let resp = admin(reqwest::Method::DELETE, "/gamma").send().await.unwrap();
    assert_eq!(resp.status(), 200);
    let body = json!({"model": "gamma", "messages": [{"role": "user", "content": "hi"}]});
    let (status, _, _) = post(&format!("{url}/v1/chat/completions"), Some(&key), &body).await;
    assert_eq!(status, 404);
    assert!(!std::fs::read_to_string(&file).unwrap().contains("gamma"));
    drop((gateway, worker));
}

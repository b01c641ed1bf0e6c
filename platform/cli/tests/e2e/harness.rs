//! Helpers shared by the end-to-end test files.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use hearth_testkit::tier::{needs, Tier};

pub const MODEL: &str = "smollm2-135m-instruct";
pub const ADMIN_TOKEN: &str = "e2e-admin-token-0123456789";
pub const QUESTION: &str = "What is the capital of France? Answer in one sentence.";

pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_hearth")
}

pub fn temp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "hearth-e2e-{tag}-{}-{}",
        std::process::id(),
        hearth_tenants::now_ms()
    ));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A child process killed on drop, with the address it printed.
pub struct Proc {
    pub child: Child,
    pub url: String,
    pub stdout_head: Vec<String>,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The tier `hearth ARGS` needs: an engine or sim backend (`serve`, `worker`) reads the
/// default model, or the synthetic model named with `--model`.
pub fn needs_for(args: &[&str]) {
    if args.iter().any(|a| a.contains("/synth/")) {
        needs(Tier::Reference);
    } else if matches!(args.first(), Some(&"serve" | &"worker")) {
        needs(Tier::Model);
    }
}

/// Starts `hearth ARGS`, waits for its "listening on http://ADDR" line.
// The child is killed and waited for by `Proc::drop`, or before the panic on failure.
#[allow(clippy::zombie_processes)]
pub fn spawn(args: &[&str]) -> Proc {
    spawn_with_env(args, &[])
}

/// [`spawn`] with extra environment variables.
#[allow(clippy::zombie_processes)]
pub fn spawn_with_env(args: &[&str], env: &[(&str, &str)]) -> Proc {
    needs_for(args);
    let mut child = Command::new(bin())
        .args(args)
        .env("HEARTH_ADMIN_TOKEN", ADMIN_TOKEN)
        .env("HEARTH_LOG", "warn")
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn hearth");
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let deadline = Instant::now() + Duration::from_secs(180);
    let mut head = Vec::new();
    loop {
        let line = rx
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .expect("hearth did not start");
        head.push(line.clone());
        if let Some(rest) = line.split("listening on ").nth(1) {
            let url = rest.split_whitespace().next().unwrap().to_string();
            // Collect what follows promptly (the first-start hint).
            while let Ok(l) = rx.recv_timeout(Duration::from_millis(300)) {
                head.push(l);
            }
            std::thread::spawn(move || while rx.recv().is_ok() {});
            return Proc {
                child,
                url,
                stdout_head: head,
            };
        }
    }
}

/// A `hearth worker` on the sim backend (the real worker with simulated compute), time
/// compressed `speedup` times.
pub fn sim_worker(speedup: &str) -> Proc {
    spawn(&[
        "worker",
        "--listen",
        "127.0.0.1:0",
        "--backend",
        "sim",
        "--sim-speedup",
        speedup,
    ])
}

/// A real-engine `hearth worker` and a `hearth gateway` in front of it.
pub fn worker_and_gateway(data: &Path) -> (Proc, Proc) {
    worker_and_gateway_with(data, &[], &[])
}

/// [`worker_and_gateway`] with extra arguments and environment for both.
pub fn worker_and_gateway_with(data: &Path, extra: &[&str], env: &[(&str, &str)]) -> (Proc, Proc) {
    let mut w = vec!["worker", "--listen", "127.0.0.1:0"];
    w.extend_from_slice(extra);
    let worker = spawn_with_env(&w, env);
    let gateway = gateway_with(data, &worker.url, extra, env);
    (worker, gateway)
}

/// A `hearth gateway` in front of the worker at `worker_url`.
pub fn gateway_with(data: &Path, worker_url: &str, extra: &[&str], env: &[(&str, &str)]) -> Proc {
    let mut g = vec![
        "gateway",
        "--listen",
        "127.0.0.1:0",
        "--data-dir",
        data.to_str().unwrap(),
        "--worker",
        worker_url,
    ];
    g.extend_from_slice(extra);
    spawn_with_env(&g, env)
}

/// `price set` arguments for the price the money tests use: $1 / $0.1 / $2 per million
/// input / cached input / output tokens, for every model.
pub const TEST_PRICE: [&str; 10] = [
    "price",
    "set",
    "--model",
    "*",
    "--input",
    "1",
    "--cached-input",
    "0.1",
    "--output",
    "2",
];

/// `hearth serve` on the sim backend (the real scheduler and prefix cache, no maths) at
/// `speedup`, with `extra` arguments.
pub fn sim_serve_with(data: &Path, speedup: &str, extra: &[&str]) -> Proc {
    let mut args = vec![
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--data-dir",
        data.to_str().unwrap(),
        "--backend",
        "sim",
        "--sim-speedup",
        speedup,
    ];
    args.extend_from_slice(extra);
    spawn(&args)
}

pub fn serve(data: &Path) -> Proc {
    spawn(&["serve", "--listen", "127.0.0.1:0", "--data-dir", data.to_str().unwrap()])
}

pub fn admin(data: &Path, args: &[&str]) -> String {
    let out = Command::new(bin())
        .args(["admin", "--data-dir", data.to_str().unwrap()])
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "admin {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Creates a tenant and a key with the CLI; returns the key.
pub fn new_key(data: &Path, tenant: &str) -> String {
    new_key_with(data, &[], tenant)
}

/// `hearth admin --data-dir DATA EXTRA ARGS` (EXTRA: e.g. `--database-url URL`).
pub fn admin_with(data: &Path, extra: &[&str], args: &[&str]) -> String {
    let mut all = extra.to_vec();
    all.extend_from_slice(args);
    admin(data, &all)
}

/// [`new_key`] with extra admin arguments (another database).
pub fn new_key_with(data: &Path, extra: &[&str], tenant: &str) -> String {
    admin_with(data, extra, &["tenant", "create", tenant]);
    let out = admin_with(data, extra, &["key", "create", "--tenant", tenant]);
    out.split_whitespace()
        .find(|w| w.starts_with("hk_"))
        .expect("key printed")
        .to_string()
}

/// The usage rows as the CLI sees them. A live gateway commits its records moments after
/// each response (from its outbox), so read until two reads 150 ms apart agree.
pub fn usage_rows(data: &Path) -> Vec<Value> {
    usage_rows_with(data, &[])
}

pub fn usage_rows_with(data: &Path, extra: &[&str]) -> Vec<Value> {
    let read = || {
        let mut args = extra.to_vec();
        args.extend_from_slice(&["--json", "usage", "--limit", "1000"]);
        serde_json::from_str::<Value>(&admin(data, &args))
            .unwrap()
            .as_array()
            .unwrap()
            .clone()
    };
    let mut last = read();
    for _ in 0..40 {
        std::thread::sleep(Duration::from_millis(150));
        let now = read();
        if now.len() == last.len() {
            return now;
        }
        last = now;
    }
    last
}

/// The sum of the samples of a Prometheus text whose lines start with `prefix`.
pub fn metric_sum(metrics: &str, prefix: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A process's `/metrics` (the gateway's needs the admin token).
pub async fn metrics(base: &str) -> String {
    let resp = client()
        .get(format!("{base}/metrics"))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .unwrap();
    let status = resp.status();
    let text = resp.text().await.unwrap();
    assert_eq!(status, 200, "GET {base}/metrics: {text}");
    text
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .unwrap()
}

pub async fn post(url: &str, key: Option<&str>, body: &Value) -> (u16, reqwest::header::HeaderMap, Value) {
    let mut r = client().post(url).json(body);
    if let Some(k) = key {
        r = r.bearer_auth(k);
    }
    let resp = r.send().await.unwrap();
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    (status, headers, resp.json().await.unwrap_or(Value::Null))
}

/// `GET url` with a bearer key, as JSON.
pub async fn get_json(url: &str, key: &str) -> Value {
    client()
        .get(url)
        .bearer_auth(key)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

pub fn chat_body(extra: Value) -> Value {
    let mut b = json!({"model": MODEL, "temperature": 0, "messages": [{"role": "user", "content": QUESTION}]});
    b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    b
}

/// Reads an SSE response to the end; returns the `data:` payloads.
pub async fn sse_events(resp: reqwest::Response) -> Vec<String> {
    let text = resp.text().await.unwrap();
    text.split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .map(str::to_string)
        .collect()
}

/// One database for several gateways: a fresh PostgreSQL schema when `DATABASE_URL` names
/// one (the handle keeps it), else a SQLite file in `data`.
pub async fn one_database(data: &Path) -> (Option<hearth_tenants::Db>, String) {
    let pg = hearth_tenants::db::testing::postgres().await;
    let url = match &pg {
        Some(db) => {
            let schema: String = sqlx::query_scalar("SELECT current_schema()::text")
                .fetch_one(&db.pool)
                .await
                .unwrap();
            let base = std::env::var("DATABASE_URL").unwrap();
            let sep = if base.contains('?') { '&' } else { '?' };
            format!("{base}{sep}options=-c%20search_path%3D{schema}")
        }
        None => format!("sqlite://{}", data.join("hearth.db").display()),
    };
    (pg, url)
}

/// The Redis the suite uses (`REDIS_URL`, else the local one `scripts/services` starts).
pub fn redis_url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

/// Waits for the process to exit by itself within `within`; its exit status.
pub async fn wait_exit(p: &mut Proc, within: Duration) -> std::process::ExitStatus {
    let deadline = Instant::now() + within;
    loop {
        if let Some(s) = p.child.try_wait().unwrap() {
            return s;
        }
        assert!(Instant::now() < deadline, "{} did not exit within {within:?}", p.url);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

//! `hearth bench batch`: a large batch (OpenAI Batch API) beside interactive load on one
//! engine, through a real gateway and a real-engine worker (separate processes).
//!
//! Three phases with the same request shape:
//! 1. **capacity** — `capacity_clients` clients send the lines' requests back to back for
//!    `seconds`: the engine's lines/s when nothing else runs;
//! 2. **interactive alone** — streamed chat requests arriving at random (Poisson) at
//!    `interactive_share` of that capacity for `seconds`: their time to first token;
//! 3. **interactive + batch** — the same interactive load while a batch of `lines` runs
//!    (the gateway's runner, `--batch-concurrency concurrency`), until the batch completes.
//!
//! Targets (issue 44): the batch's lines/s ≥ 80 % of the capacity the interactive load
//! leaves idle (`capacity × (1 − interactive share)`, the share measured in phase 2), and
//! the interactive P90 TTFT with the batch ≤ 1.2 × without it.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde::Serialize;
use serde_json::{json, Value};

use crate::procs::{self, Proc};
use crate::{percentile, Rng};

pub struct BatchBenchConfig {
    /// The `hearth` executable.
    pub exe: PathBuf,
    pub model: String,
    pub model_id: String,
    pub threads: Option<usize>,
    pub lines: usize,
    pub max_tokens: u32,
    /// Batch lines run at once (the gateway's `--batch-concurrency`).
    pub concurrency: usize,
    /// Clients of the capacity phase (enough to fill the engine's batch).
    pub capacity_clients: usize,
    /// The interactive load, as a share of the measured capacity (requests/s).
    pub interactive_share: f64,
    /// Length of the capacity and interactive-alone phases.
    pub seconds: f64,
    pub seed: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Interactive {
    pub requests: usize,
    pub errors: usize,
    pub ttft_p50_ms: f64,
    pub ttft_p90_ms: f64,
    pub ttft_p99_ms: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct BatchReport {
    pub isa: String,
    pub lines: usize,
    pub max_tokens: u32,
    pub concurrency: usize,
    pub capacity_clients: usize,
    /// Phase 1: lines/s with nothing else running.
    pub capacity_lines_per_s: f64,
    /// Phase 2: the interactive rate (requests/s) and its share of the capacity.
    pub interactive_rps: f64,
    pub interactive_share: f64,
    pub interactive_alone: Interactive,
    /// Phase 3.
    pub interactive_with_batch: Interactive,
    pub batch_seconds: f64,
    pub batch_lines_per_s: f64,
    pub batch_completed: i64,
    pub batch_failed: i64,
    /// Batch lines/s ÷ the capacity the interactive load leaves idle (target ≥ 0.8).
    pub batch_of_idle_capacity: f64,
    /// Interactive P90 TTFT with the batch ÷ without (target ≤ 1.2).
    pub ttft_p90_ratio: f64,
}

const ADMIN: &str = "batch-bench-admin-token";

fn body(model: &str, max_tokens: u32, i: usize, stream: bool) -> Value {
    let mut b = json!({"model": model, "max_tokens": max_tokens, "temperature": 0,
        "messages": [{"role": "user", "content": format!("Write one sentence about the number {i}.")}]});
    if stream {
        b["stream"] = json!(true);
    }
    b
}

/// One streamed request: its time to first token (None on an error).
async fn ttft(client: &reqwest::Client, url: &str, key: &str, body: &Value) -> Option<f64> {
    let start = Instant::now();
    let resp = client
        .post(format!("{url}/v1/chat/completions"))
        .bearer_auth(key)
        .json(body)
        .send()
        .await
        .ok()?;
    if !resp.status().is_success() {
        return None;
    }
    let mut stream = resp.bytes_stream();
    let mut first = None;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.ok()?;
        if first.is_none() && chunk.windows(9).any(|w| w == b"\"content\"") {
            first = Some(start.elapsed().as_secs_f64() * 1000.0);
        }
    }
    first
}

/// Where the interactive requests go, and their shape.
#[derive(Clone)]
struct Target {
    client: reqwest::Client,
    url: String,
    key: String,
    model: String,
    max_tokens: u32,
}

/// Poisson arrivals at `rps` until `stop` says so; the TTFTs and errors.
async fn interactive(to: Target, rps: f64, seed: u64, stop: impl Fn() -> bool) -> Interactive {
    let samples = Arc::new(Mutex::new((Vec::new(), 0usize)));
    let mut rng = Rng(seed | 1);
    let mut tasks = Vec::new();
    let mut i = 0;
    while !stop() {
        tokio::time::sleep(Duration::from_secs_f64(rng.gap(rps))).await;
        let (to, samples) = (to.clone(), samples.clone());
        let b = body(&to.model, to.max_tokens, 10_000 + i, true);
        i += 1;
        tasks.push(tokio::spawn(async move {
            let t = ttft(&to.client, &to.url, &to.key, &b).await;
            let mut s = samples.lock().unwrap_or_else(|e| e.into_inner());
            match t {
                Some(t) => s.0.push(t),
                None => s.1 += 1,
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
    let (mut t, errors) = samples.lock().unwrap_or_else(|e| e.into_inner()).clone();
    t.sort_by(f64::total_cmp);
    Interactive {
        requests: t.len() + errors,
        errors,
        ttft_p50_ms: percentile(&t, 0.5),
        ttft_p90_ms: percentile(&t, 0.9),
        ttft_p99_ms: percentile(&t, 0.99),
    }
}

pub async fn run(cfg: BatchBenchConfig) -> anyhow::Result<BatchReport> {
    let data = std::env::temp_dir().join(format!(
        "hearth-bench-batch-{}-{}",
        std::process::id(),
        hearth_tenants::now_ms()
    ));
    std::fs::create_dir_all(&data)?;
    let data_s = data.to_string_lossy().into_owned();
    let env = [("HEARTH_ADMIN_TOKEN", ADMIN)];
    let threads = cfg.threads.map(|t| t.to_string());
    let mut wargs = vec![
        "worker",
        "--listen",
        "127.0.0.1:0",
        "--model",
        &cfg.model,
        "--model-id",
        &cfg.model_id,
    ];
    if let Some(t) = &threads {
        wargs.extend(["--threads", t]);
    }
    let (_worker, wurl): (Proc, String) = procs::spawn(&cfg.exe, &wargs, &env)?;
    let conc = cfg.concurrency.to_string();
    let (_gateway, url) = procs::spawn(
        &cfg.exe,
        &[
            "gateway",
            "--listen",
            "127.0.0.1:0",
            "--data-dir",
            &data_s,
            "--worker",
            &wurl,
            "--batch-concurrency",
            &conc,
        ],
        &env,
    )?;
    procs::cli(&cfg.exe, "admin", &data_s, &["tenant", "create", "bench"])?;
    let key = procs::new_key(&cfg.exe, &data_s, "bench")?;
    let client = reqwest::Client::new();
    let model = cfg.model_id.clone();

    // Warm-up: the model loaded, the prefix cache's template warm.
    for i in 0..4 {
        client
            .post(format!("{url}/v1/chat/completions"))
            .bearer_auth(&key)
            .json(&body(&model, cfg.max_tokens, i, false))
            .send()
            .await?
            .error_for_status()?;
    }

    // 1. Capacity: closed loop, `capacity_clients` clients.
    let done = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let until = Instant::now() + Duration::from_secs_f64(cfg.seconds);
    let start = Instant::now();
    let mut clients = Vec::new();
    for c in 0..cfg.capacity_clients {
        let (client, url, key, model, done) = (client.clone(), url.clone(), key.clone(), model.clone(), done.clone());
        let max_tokens = cfg.max_tokens;
        clients.push(tokio::spawn(async move {
            let mut i = c;
            while Instant::now() < until {
                let ok = client
                    .post(format!("{url}/v1/chat/completions"))
                    .bearer_auth(&key)
                    .json(&body(&model, max_tokens, i, false))
                    .send()
                    .await
                    .is_ok_and(|r| r.status().is_success());
                if ok {
                    done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                i += 64;
            }
        }));
    }
    for c in clients {
        let _ = c.await;
    }
    let capacity = done.load(std::sync::atomic::Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64();
    let rps = (capacity * cfg.interactive_share).max(0.05);

    // 2. Interactive alone.
    let t0 = Instant::now();
    let secs = cfg.seconds;
    let to = Target {
        client: client.clone(),
        url: url.clone(),
        key: key.clone(),
        model: model.clone(),
        max_tokens: cfg.max_tokens,
    };
    let alone = interactive(to.clone(), rps, cfg.seed, move || t0.elapsed().as_secs_f64() >= secs).await;
    let share = rps / capacity;

    // 3. Interactive beside the batch, until the batch completes.
    let lines: Vec<String> = (0..cfg.lines)
        .map(|i| {
            json!({"custom_id": format!("line-{i}"), "method": "POST", "url": "/v1/chat/completions",
                "body": body(&model, cfg.max_tokens, i, false)})
            .to_string()
        })
        .collect();
    let form = reqwest::multipart::Form::new().text("purpose", "batch").part(
        "file",
        reqwest::multipart::Part::bytes((lines.join("\n") + "\n").into_bytes()).file_name("bench.jsonl"),
    );
    let file: Value = client
        .post(format!("{url}/v1/files"))
        .bearer_auth(&key)
        .multipart(form)
        .send()
        .await?
        .error_for_status()?
        .json()
        .await?;
    let finished = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stop = finished.clone();
    let load = tokio::spawn(interactive(to, rps, cfg.seed.wrapping_add(1), move || {
        stop.load(std::sync::atomic::Ordering::SeqCst)
    }));
    let created = Instant::now();
    let batch: Value = client
        .post(format!("{url}/v1/batches"))
        .bearer_auth(&key)
        .json(&json!({"input_file_id": file["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}))
        .send()
        .await?
        .error_for_status()?
        .json()
        .await?;
    let id = batch["id"].as_str().unwrap_or_default().to_string();
    let last = loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let b: Value = client
            .get(format!("{url}/v1/batches/{id}"))
            .bearer_auth(&key)
            .send()
            .await?
            .json()
            .await?;
        if b["status"] != "in_progress" && b["status"] != "finalizing" {
            break b;
        }
    };
    let batch_seconds = created.elapsed().as_secs_f64();
    finished.store(true, std::sync::atomic::Ordering::SeqCst);
    let with = load.await?;
    anyhow::ensure!(last["status"] == "completed", "the batch ended {}", last["status"]);
    let completed = last["request_counts"]["completed"].as_i64().unwrap_or(0);
    let batch_rate = completed as f64 / batch_seconds;
    let idle = capacity * (1.0 - share).max(0.05);
    let _ = std::fs::remove_dir_all(&data);
    Ok(BatchReport {
        isa: hearth_engine::kernels::Isa::best().name().to_string(),
        lines: cfg.lines,
        max_tokens: cfg.max_tokens,
        concurrency: cfg.concurrency,
        capacity_clients: cfg.capacity_clients,
        capacity_lines_per_s: capacity,
        interactive_rps: rps,
        interactive_share: share,
        ttft_p90_ratio: with.ttft_p90_ms / alone.ttft_p90_ms.max(1e-9),
        interactive_alone: alone,
        interactive_with_batch: with,
        batch_seconds,
        batch_lines_per_s: batch_rate,
        batch_completed: completed,
        batch_failed: last["request_counts"]["failed"].as_i64().unwrap_or(0),
        batch_of_idle_capacity: batch_rate / idle,
    })
}

impl BatchReport {
    pub fn table(&self) -> String {
        let row = |name: &str, i: &Interactive| {
            format!(
                "| {name} | {} | {} | {:.0} | {:.0} | {:.0} |\n",
                i.requests, i.errors, i.ttft_p50_ms, i.ttft_p90_ms, i.ttft_p99_ms
            )
        };
        let verdict = |ok: bool| if ok { "met" } else { "missed" };
        format!(
            "hearth bench batch — {} lines of {} tokens, {} at once, ISA {}\n\n\
             | interactive load | requests | errors | TTFT p50 ms | p90 ms | p99 ms |\n|---|---|---|---|---|---|\n{}{}\n\
             capacity ({} clients, nothing else running): {:.2} lines/s; interactive load {:.2} req/s ({:.0} % of it)\n\
             batch: {} completed, {} failed in {:.1} s = {:.2} lines/s\n\n\
             | target | measured | goal | |\n|---|---|---|---|\n\
             | batch lines/s ÷ idle capacity | {:.2} | ≥ 0.80 | {} |\n\
             | interactive P90 TTFT with ÷ without the batch | {:.2}× | ≤ 1.20× | {} |\n",
            self.lines,
            self.max_tokens,
            self.concurrency,
            self.isa,
            row("alone", &self.interactive_alone),
            row("beside the batch", &self.interactive_with_batch),
            self.capacity_clients,
            self.capacity_lines_per_s,
            self.interactive_rps,
            self.interactive_share * 100.0,
            self.batch_completed,
            self.batch_failed,
            self.batch_seconds,
            self.batch_lines_per_s,
            self.batch_of_idle_capacity,
            verdict(self.batch_of_idle_capacity >= 0.8),
            self.ttft_p90_ratio,
            verdict(self.ttft_p90_ratio <= 1.2),
        )
    }
}

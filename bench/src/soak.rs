//! `hearth bench soak`: hours of mixed traffic through a real gateway and a real-engine
//! worker (separate processes), watching what leaks. The mix: chat (whole and streamed),
//! streams the client abandons part-way, tool calls, JSON-schema answers, legacy
//! completions, requests through a tenant processor (a Wasm guest) and malformed requests.
//! Every `sample` seconds it records each process's resident memory, open file descriptors
//! and threads, the gateway's live async tasks, and the requests and errors so far. The
//! report compares the first sample after warm-up with the last (flat is the goal) and checks
//! the books: one usage row per request, a completed row per successful response.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde::Serialize;
use serde_json::{json, Value};

use crate::procs::{self, Proc};
use crate::Rng;

const ADMIN: &str = "soak-admin-token";

pub struct SoakConfig {
    /// The `hearth` executable.
    pub exe: PathBuf,
    pub model: String,
    pub model_id: String,
    pub threads: Option<usize>,
    pub minutes: f64,
    pub concurrency: usize,
    pub sample_secs: f64,
    pub seed: u64,
}

/// One sample of both processes.
#[derive(Debug, Clone, Serialize)]
pub struct Sample {
    pub t_s: f64,
    pub gateway_rss_kib: u64,
    pub worker_rss_kib: u64,
    pub gateway_fds: u64,
    pub worker_fds: u64,
    pub gateway_threads: u64,
    pub worker_threads: u64,
    /// The gateway runtime's live tasks (`hearth_runtime_alive_tasks`).
    pub gateway_tasks: u64,
    pub requests: u64,
    pub errors: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Growth {
    pub from_s: f64,
    pub to_s: f64,
    pub gateway_rss_kib: i64,
    pub worker_rss_kib: i64,
    pub gateway_fds: i64,
    pub worker_fds: i64,
    pub gateway_tasks: i64,
}

#[derive(Debug, Clone, Serialize)]
pub struct SoakReport {
    pub isa: String,
    pub minutes: f64,
    pub concurrency: usize,
    pub requests: u64,
    /// Requests by kind of traffic.
    pub by_kind: BTreeMap<String, u64>,
    /// Outcomes other than the expected one, by kind and what happened.
    pub errors: BTreeMap<String, u64>,
    /// 2xx answers read to the end.
    pub successes: u64,
    /// Streams the client abandoned part-way.
    pub abandoned: u64,
    pub usage_rows: u64,
    pub usage_rows_completed: u64,
    pub usage_rows_cancelled: u64,
    /// Rows == requests, and completed rows == successful responses (abandoned streams
    /// may end either way: a stream abandoned as its last token was sent is complete).
    pub books_balance: bool,
    pub samples: Vec<Sample>,
    /// Last sample minus the first after warm-up (a tenth of the run).
    pub growth: Growth,
}

fn start(exe: &Path, args: &[&str]) -> anyhow::Result<(Proc, String)> {
    procs::spawn(exe, args, &[("HEARTH_ADMIN_TOKEN", ADMIN)])
}

fn admin(exe: &Path, data: &str, args: &[&str]) -> anyhow::Result<String> {
    procs::cli(exe, "admin", data, args)
}

/// (resident KiB, open descriptors, threads) of a process, from /proc.
fn proc_stats(pid: u32) -> (u64, u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count() as u64);
    (field("VmRSS:"), fds, field("Threads:"))
}

#[derive(Default)]
struct Tally {
    requests: u64,
    successes: u64,
    abandoned: u64,
    by_kind: BTreeMap<String, u64>,
    errors: BTreeMap<String, u64>,
}

impl Tally {
    fn error(&mut self, kind: &str, what: String) {
        *self.errors.entry(format!("{kind}: {what}")).or_default() += 1;
    }
}

const KINDS: [(&str, u64); 8] = [
    ("chat", 25),
    ("stream", 25),
    ("abandon", 10),
    ("tools", 10),
    ("schema", 10),
    ("completion", 10),
    ("processor", 5),
    ("malformed", 5),
];

fn body(kind: &str, model: &str, rng: &mut Rng) -> Value {
    let topics = ["the sea", "a city at night", "bread", "mountains", "a library", "rain"];
    let topic = rng.pick(&topics);
    let max_tokens = rng.range(8, 40);
    match kind {
        "stream" | "abandon" => json!({"model": model, "stream": true,
            "stream_options": {"include_usage": true}, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": format!("Write a few lines about {topic}.")}]}),
        "tools" => json!({"model": model, "max_tokens": 48,
            "messages": [{"role": "user", "content": format!("What is the weather like in {topic}?")}],
            "tools": [{"type": "function", "function": {"name": "get_weather",
                "parameters": {"type": "object", "properties": {"place": {"type": "string"}}, "required": ["place"]}}}],
            "tool_choice": "required"}),
        "schema" => json!({"model": model, "max_tokens": 48,
            "messages": [{"role": "user", "content": format!("Describe {topic} as JSON.")}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "d", "schema": {"type": "object",
                "properties": {"name": {"type": "string"}, "size": {"type": "integer"}}, "required": ["name", "size"]}}}}),
        "completion" => {
            json!({"model": model, "max_tokens": max_tokens, "prompt": format!("Once upon a time, {topic}")})
        }
        _ => json!({"model": model, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": format!("Say something about {topic}.")}]}),
    }
}

async fn one(
    client: &reqwest::Client,
    base: &str,
    keys: &(String, String),
    model: &str,
    rng: &mut Rng,
    tally: &Mutex<Tally>,
) {
    let total: u64 = KINDS.iter().map(|k| k.1).sum();
    let mut r = rng.range(0, total - 1);
    let kind = KINDS
        .iter()
        .find(|(_, w)| {
            if r < *w {
                true
            } else {
                r -= w;
                false
            }
        })
        .map_or("chat", |k| k.0);
    let path = if kind == "completion" {
        "/v1/completions"
    } else {
        "/v1/chat/completions"
    };
    let key = if kind == "processor" { &keys.1 } else { &keys.0 };
    let req = client.post(format!("{base}{path}")).bearer_auth(key);
    let req = if kind == "malformed" {
        req.header("content-type", "application/json").body("{\"model\": ")
    } else {
        req.json(&body(kind, model, rng))
    };
    {
        let mut t = tally.lock().unwrap_or_else(|e| e.into_inner());
        t.requests += 1;
        *t.by_kind.entry(kind.to_string()).or_default() += 1;
    }
    let outcome: Result<bool, String> = async {
        let resp = req.send().await.map_err(|e| format!("transport: {e}"))?;
        let status = resp.status().as_u16();
        if kind == "malformed" {
            return if status == 400 {
                Ok(false)
            } else {
                Err(format!("status {status}"))
            };
        }
        if status != 200 {
            let code = resp
                .json::<Value>()
                .await
                .ok()
                .and_then(|v| v["error"]["code"].as_str().map(str::to_string))
                .unwrap_or_default();
            return Err(format!("status {status} {code}"));
        }
        if kind == "abandon" {
            let mut s = resp.bytes_stream();
            for _ in 0..2 {
                if s.next().await.is_none() {
                    break;
                }
            }
            return Ok(true);
        }
        let text = resp.text().await.map_err(|e| format!("body: {e}"))?;
        if text.contains("\"error\"") && !text.contains("\"content\"") {
            return Err("error in body".into());
        }
        Ok(false)
    }
    .await;
    let mut t = tally.lock().unwrap_or_else(|e| e.into_inner());
    match outcome {
        Ok(true) => t.abandoned += 1,
        Ok(false) if kind == "malformed" => {}
        Ok(false) => t.successes += 1,
        Err(e) => t.error(kind, e),
    }
}

pub async fn run(cfg: SoakConfig) -> anyhow::Result<SoakReport> {
    let data = std::env::temp_dir().join(format!(
        "hearth-soak-{}-{}",
        std::process::id(),
        hearth_tenants::now_ms()
    ));
    std::fs::create_dir_all(&data)?;
    let data_s = data.to_string_lossy().into_owned();
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
    let (worker, wurl) = start(&cfg.exe, &wargs)?;
    let (gateway, gurl) = start(
        &cfg.exe,
        &[
            "gateway",
            "--listen",
            "127.0.0.1:0",
            "--data-dir",
            &data_s,
            "--worker",
            &wurl,
        ],
    )?;
    admin(&cfg.exe, &data_s, &["tenant", "create", "soak"])?;
    let key = procs::new_key(&cfg.exe, &data_s, "soak")?;
    let pkey = procs::new_key(&cfg.exe, &data_s, "soak")?;
    let wasm = data.join("trivial.wasm");
    std::fs::write(&wasm, hearth_runtime::wat_guest::trivial())?;
    let key_id = pkey.split('_').nth(1).unwrap_or_default().to_string();
    procs::cli(
        &cfg.exe,
        "processor",
        &data_s,
        &[
            "upload",
            "--tenant",
            "soak",
            "--name",
            "trivial",
            "--activate",
            "--key",
            &key_id,
            &wasm.to_string_lossy(),
        ],
    )?;
    let client = reqwest::Client::builder().timeout(Duration::from_secs(120)).build()?;
    let keys = Arc::new((key, pkey));
    let tally = Arc::new(Mutex::new(Tally::default()));
    let started = Instant::now();
    let deadline = started + Duration::from_secs_f64(cfg.minutes * 60.0);
    let mut tasks = Vec::new();
    for i in 0..cfg.concurrency {
        let (client, base, keys, tally, model) = (
            client.clone(),
            gurl.clone(),
            keys.clone(),
            tally.clone(),
            cfg.model_id.clone(),
        );
        let mut rng = Rng(cfg.seed.wrapping_add(i as u64 * 7919) | 1);
        tasks.push(tokio::spawn(async move {
            while Instant::now() < deadline {
                one(&client, &base, &keys, &model, &mut rng, &tally).await;
            }
        }));
    }
    let (gpid, wpid) = (gateway.0.id(), worker.0.id());
    let mut samples = Vec::new();
    let sample = |samples: &mut Vec<Sample>, tasks: u64| {
        let (grss, gfds, gthr) = proc_stats(gpid);
        let (wrss, wfds, wthr) = proc_stats(wpid);
        let t = tally.lock().unwrap_or_else(|e| e.into_inner());
        let s = Sample {
            t_s: started.elapsed().as_secs_f64(),
            gateway_rss_kib: grss,
            worker_rss_kib: wrss,
            gateway_fds: gfds,
            worker_fds: wfds,
            gateway_threads: gthr,
            worker_threads: wthr,
            gateway_tasks: tasks,
            requests: t.requests,
            errors: t.errors.values().sum(),
        };
        eprintln!(
            "soak {:>7.0} s: gateway {} KiB / {} fds / {} tasks, worker {} KiB / {} fds, {} requests, {} errors",
            s.t_s,
            s.gateway_rss_kib,
            s.gateway_fds,
            s.gateway_tasks,
            s.worker_rss_kib,
            s.worker_fds,
            s.requests,
            s.errors
        );
        samples.push(s);
    };
    let every = Duration::from_secs_f64(cfg.sample_secs.max(1.0));
    while Instant::now() < deadline {
        tokio::time::sleep(every.min(deadline.saturating_duration_since(Instant::now()))).await;
        let tasks = alive_tasks(&client, &gurl).await;
        sample(&mut samples, tasks);
    }
    for t in tasks {
        let _ = t.await;
    }
    // Idle again: the last sample shows what is left once traffic stops.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let tasks = alive_tasks(&client, &gurl).await;
    sample(&mut samples, tasks);
    // The books, once the gateway has committed everything (it exits after its flush).
    #[cfg(unix)]
    {
        let _ = Command::new("kill").args(["-TERM", &gpid.to_string()]).status();
    }
    let mut gateway = gateway;
    let stop = Instant::now() + Duration::from_secs(60);
    while gateway.0.try_wait()?.is_none() && Instant::now() < stop {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let db = hearth_tenants::db::open(&format!("sqlite://{}", data.join("hearth.db").display()), None).await?;
    let rows: Vec<(String, i64)> = sqlx::query_as("SELECT status, COUNT(*) FROM usage_records GROUP BY status")
        .fetch_all(&db.pool)
        .await?;
    let count = |s: &str| rows.iter().find(|r| r.0 == s).map_or(0, |r| r.1 as u64);
    let usage_rows: u64 = rows.iter().map(|r| r.1 as u64).sum();
    drop(worker);
    let t = Arc::try_unwrap(tally)
        .map_err(|_| anyhow::anyhow!("traffic still running"))?
        .into_inner()
        .unwrap_or_else(|e| e.into_inner());
    let completed = count("completed");
    let cancelled = count("cancelled");
    let books_balance = usage_rows == t.requests && completed >= t.successes && completed <= t.successes + t.abandoned;
    let warm = samples
        .iter()
        .find(|s| s.t_s >= cfg.minutes * 6.0)
        .or(samples.first())
        .cloned();
    let last = samples.last().cloned();
    let growth = match (warm, last) {
        (Some(a), Some(b)) => Growth {
            from_s: a.t_s,
            to_s: b.t_s,
            gateway_rss_kib: b.gateway_rss_kib as i64 - a.gateway_rss_kib as i64,
            worker_rss_kib: b.worker_rss_kib as i64 - a.worker_rss_kib as i64,
            gateway_fds: b.gateway_fds as i64 - a.gateway_fds as i64,
            worker_fds: b.worker_fds as i64 - a.worker_fds as i64,
            gateway_tasks: b.gateway_tasks as i64 - a.gateway_tasks as i64,
        },
        _ => anyhow::bail!("no samples"),
    };
    std::fs::remove_dir_all(&data).ok();
    Ok(SoakReport {
        isa: hearth_engine::kernels::Isa::best().name().to_string(),
        minutes: cfg.minutes,
        concurrency: cfg.concurrency,
        requests: t.requests,
        by_kind: t.by_kind,
        errors: t.errors,
        successes: t.successes,
        abandoned: t.abandoned,
        usage_rows,
        usage_rows_completed: completed,
        usage_rows_cancelled: cancelled,
        books_balance,
        samples,
        growth,
    })
}

/// The gateway's live tasks, from its metrics.
async fn alive_tasks(client: &reqwest::Client, base: &str) -> u64 {
    let Ok(resp) = client.get(format!("{base}/metrics")).bearer_auth(ADMIN).send().await else {
        return 0;
    };
    let text = resp.text().await.unwrap_or_default();
    text.lines()
        .find(|l| l.starts_with("hearth_runtime_alive_tasks "))
        .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

impl SoakReport {
    pub fn table(&self) -> String {
        let mut out = format!(
            "Soak: {:.1} min, {} clients, ISA {}\n\n{:>8} {:>12} {:>12} {:>8} {:>8} {:>8} {:>9} {:>7}\n",
            self.minutes,
            self.concurrency,
            self.isa,
            "t (s)",
            "gw RSS KiB",
            "wk RSS KiB",
            "gw fds",
            "wk fds",
            "gw tasks",
            "requests",
            "errors"
        );
        for s in &self.samples {
            out += &format!(
                "{:>8.0} {:>12} {:>12} {:>8} {:>8} {:>8} {:>9} {:>7}\n",
                s.t_s,
                s.gateway_rss_kib,
                s.worker_rss_kib,
                s.gateway_fds,
                s.worker_fds,
                s.gateway_tasks,
                s.requests,
                s.errors
            );
        }
        let g = &self.growth;
        out += &format!(
            "\ngrowth {:.0} s → {:.0} s: gateway RSS {:+} KiB, worker RSS {:+} KiB, gateway fds {:+}, worker fds {:+}, gateway tasks {:+}\n",
            g.from_s, g.to_s, g.gateway_rss_kib, g.worker_rss_kib, g.gateway_fds, g.worker_fds, g.gateway_tasks
        );
        out += &format!(
            "requests {} ({} successful, {} abandoned streams); by kind {:?}\n",
            self.requests, self.successes, self.abandoned, self.by_kind
        );
        out += &format!("errors {:?}\n", self.errors);
        out += &format!(
            "usage rows {} (completed {}, cancelled {}): books {}\n",
            self.usage_rows,
            self.usage_rows_completed,
            self.usage_rows_cancelled,
            if self.books_balance {
                "balance"
            } else {
                "DO NOT balance"
            }
        );
        out
    }
}

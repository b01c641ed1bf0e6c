//! `hearth bench processors`: what a trivial pre + post processor adds to a request, per
//! guest language, and whether processor work scales across cores.
//!
//! * **Per request** (in the runtime, as the gateway does it): a fresh instance from the
//!   pool, `on-request`, `on-response`, drop. P50/P99 over sequential requests.
//! * **Through the gateway** (the WAT guest): the same instant-worker gateway as
//!   `hearth bench gateway`, two metered tenants, one with the processor as pre + post;
//!   requests alternate between them over HTTP; the added P50 is the difference.
//! * **Scaling**: requests/s of the per-request loop with 1 and 2 concurrent tasks on a
//!   2-thread runtime.
//!
//! Guests: the WAT trivial processor (built in-process; the "compiled language" figure —
//! no language runtime at all), and the JavaScript and Python trivial processors from
//! `sdk/processors/build` when their directory is given.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hearth_runtime::{Action, Limits, Request, Response, Runtime};
use serde::Serialize;

#[derive(Debug, Clone, Serialize)]
pub struct GuestResult {
    pub guest: String,
    pub bytes: usize,
    /// Validation + compilation at upload (first time; later loads come from the cache).
    pub compile_ms: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub per_s_1_task: f64,
    pub per_s_2_tasks: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct ProcessorBenchReport {
    pub requests: usize,
    pub guests: Vec<GuestResult>,
    /// P50 through the gateway without and with the WAT processor, µs.
    pub gateway_plain_p50_us: f64,
    pub gateway_processor_p50_us: f64,
}

impl ProcessorBenchReport {
    pub fn table(&self) -> String {
        let mut s = format!(
            "processor overhead per request: new instance + on-request + on-response ({} sequential requests)\n\n",
            self.requests
        );
        s += &format!(
            "{:<10} {:>12} {:>12} {:>10} {:>10} {:>12} {:>12} {:>8}\n",
            "guest", "bytes", "compile ms", "p50 µs", "p99 µs", "1 task /s", "2 tasks /s", "scaling"
        );
        for g in &self.guests {
            s += &format!(
                "{:<10} {:>12} {:>12.0} {:>10.1} {:>10.1} {:>12.0} {:>12.0} {:>7.2}×\n",
                g.guest,
                g.bytes,
                g.compile_ms,
                g.p50_us,
                g.p99_us,
                g.per_s_1_task,
                g.per_s_2_tasks,
                g.per_s_2_tasks / g.per_s_1_task.max(1e-9)
            );
        }
        s += &format!(
            "\nthrough the gateway (HTTP, instant worker, metered): p50 {:.1} µs without, {:.1} µs with the WAT pre+post processor: +{:.1} µs (target ≤ 50)\n",
            self.gateway_plain_p50_us,
            self.gateway_processor_p50_us,
            self.gateway_processor_p50_us - self.gateway_plain_p50_us
        );
        s
    }
}

use crate::percentile;

fn request() -> Request {
    Request {
        tenant: "bench".into(),
        model: "m".into(),
        endpoint: "/v1/chat/completions".into(),
        body: r#"{"model":"m","messages":[{"role":"user","content":"Say something short about the sea."}]}"#.into(),
        headers: Vec::new(),
    }
}

fn response() -> Response {
    Response {
        tenant: "bench".into(),
        model: "m".into(),
        endpoint: "/v1/chat/completions".into(),
        body: r#"{"choices":[{"index":0,"message":{"role":"assistant","content":"The sea is wide."}}]}"#.into(),
    }
}

async fn one(rt: &Runtime, c: &hearth_runtime::Compiled, limits: Limits) -> anyhow::Result<()> {
    let mut i = rt.instantiate(c, "{}", limits).await?;
    let a = i.on_request(&request()).await?;
    let b = i.on_response(&response()).await?;
    anyhow::ensure!(
        a == Action::Continue && b == Action::Continue,
        "a trivial guest must continue"
    );
    Ok(())
}

async fn guest(
    rt: &Arc<Runtime>,
    name: &str,
    wasm: Vec<u8>,
    requests: usize,
    seconds: f64,
) -> anyhow::Result<GuestResult> {
    let t = Instant::now();
    let bytes = wasm.len();
    let rt2 = rt.clone();
    let c = tokio::task::spawn_blocking(move || rt2.compile(&wasm)).await??;
    let compile_ms = t.elapsed().as_secs_f64() * 1e3;
    let limits = Limits {
        cpu_ms: 1000,
        memory_mib: 256,
        ..Default::default()
    };
    for _ in 0..requests.min(50) {
        one(rt, &c, limits).await?;
    }
    let mut lat = Vec::with_capacity(requests);
    for _ in 0..requests {
        let t = Instant::now();
        one(rt, &c, limits).await?;
        lat.push(t.elapsed().as_secs_f64() * 1e6);
    }
    lat.sort_by(f64::total_cmp);
    let mut rates = [0.0; 2];
    for (k, tasks) in [1usize, 2].into_iter().enumerate() {
        let deadline = Instant::now() + Duration::from_secs_f64(seconds);
        let started = Instant::now();
        let mut hs = Vec::new();
        for _ in 0..tasks {
            let (rt, c) = (rt.clone(), c.clone());
            hs.push(tokio::spawn(async move {
                let mut n = 0usize;
                while Instant::now() < deadline {
                    if one(&rt, &c, limits).await.is_ok() {
                        n += 1;
                    }
                }
                n
            }));
        }
        let mut n = 0;
        for h in hs {
            n += h.await?;
        }
        rates[k] = n as f64 / started.elapsed().as_secs_f64();
    }
    Ok(GuestResult {
        guest: name.to_string(),
        bytes,
        compile_ms,
        p50_us: percentile(&lat, 0.5),
        p99_us: percentile(&lat, 0.99),
        per_s_1_task: rates[0],
        per_s_2_tasks: rates[1],
    })
}

/// Runs the benchmark. `examples`: the directory `sdk/processors/build` wrote (for the JS and
/// Python guests); `model_path`/`model_id`: the tokenizer for the gateway part.
pub async fn run(
    examples: Option<&Path>,
    model_path: &Path,
    model_id: &str,
    requests: usize,
    seconds: f64,
) -> anyhow::Result<ProcessorBenchReport> {
    // No disk cache: the compile column is the cold upload cost.
    let rt = Arc::new(Runtime::new(None)?);
    let mut guests = vec![guest(&rt, "wat", hearth_runtime::wat_guest::trivial(), requests, seconds).await?];
    if let Some(dir) = examples {
        for (name, file) in [("js", "trivial.wasm"), ("python", "trivial-py.wasm")] {
            let path = dir.join(file);
            match std::fs::read(&path) {
                Ok(wasm) => guests.push(guest(&rt, name, wasm, (requests / 10).max(20), seconds).await?),
                Err(e) => tracing::warn!(path = %path.display(), error = %e, "guest not built; skipped"),
            }
        }
    }
    let (plain, with) = crate::gateway::processor_overhead(model_path, model_id, requests).await?;
    Ok(ProcessorBenchReport {
        requests,
        guests,
        gateway_plain_p50_us: plain,
        gateway_processor_p50_us: with,
    })
}

//! `hearth bench gateway`: what authentication, limits, budgets and metering cost per
//! request, timed over real HTTP on loopback against an instant worker (a [`WorkerClient`]
//! that answers at once), so that only the gateway is measured.
//!
//! Modes, each its own gateway on its own port, in one run:
//! * `baseline` — the gateway's own pipeline phases composed without authentication,
//!   budget, limits and metering (parse → resolve → tokenize → dispatch → relay →
//!   postprocess), behind the same request-id layer;
//! * `in_process` — an API key, tenant and key limits (requests, tokens, in flight;
//!   high enough never to refuse), a monthly budget, and every request rated and committed
//!   to the SQLite ledger before its response ends;
//! * `in_process_fsync` — `in_process` with `--usage-durability fsync`: each record flushed
//!   to disk (group-committed) before its response ends;
//! * `redis` — the same with the limits counted in Redis (when a Redis URL is given).
//!
//! Latency: sequential requests on keep-alive connections, one per mode in turn so that
//! drift affects every mode alike (P50/P99). Throughput: 32 concurrent clients for a few
//! seconds, per mode. Client and server share this machine's cores,
//! so the throughput figure is a floor for the gateway alone.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;
use futures_util::{FutureExt, StreamExt};
use hearth_billing::UsageLedger;
use hearth_protocol::{FinishReason, GenerateEvent, GenerateRequest, KvEvent, LoadReport, Usage, WorkerInfo};
use hearth_tenants::{Budget, KeySpec, Limits, TenantStore};
use serde::Serialize;
use serde_json::json;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Extension;
use hearth_billing::{Pending, UsageRecord};
use hearth_gateway::app;
use hearth_gateway::pipeline::meter::Meter;
use hearth_gateway::pipeline::{dispatch, parse, postprocess, relay, resolve, tokenize, Endpoint, RequestContext};
use hearth_gateway::policy::limits::{Limiter, RedisLimiter};
use hearth_gateway::state::AppState;
use hearth_gateway::upstream::registry::{ModelRegistry, RoutingConfig};
use hearth_gateway::upstream::workers::{EventStream, KvEventStream, WorkerClient, WorkerError};
use hearth_gateway::RequestId;

/// A worker that answers every request at once with `max_tokens` copies of one token.
pub struct InstantWorker {
    info: WorkerInfo,
}

impl WorkerClient for InstantWorker {
    fn name(&self) -> &str {
        "instant"
    }

    fn info(&self) -> BoxFuture<'_, Result<WorkerInfo, WorkerError>> {
        async move { Ok(self.info.clone()) }.boxed()
    }

    fn generate(&self, req: GenerateRequest) -> BoxFuture<'_, Result<EventStream, WorkerError>> {
        async move {
            let n = req.sampling.max_tokens.min(4096);
            let mut events: Vec<GenerateEvent> = (0..n)
                .map(|_| GenerateEvent::Token {
                    index: 0,
                    id: 31,
                    text: "a".into(),
                    logprob: None,
                    top_logprobs: Vec::new(),
                })
                .collect();
            events.push(GenerateEvent::Finish {
                index: 0,
                finish_reason: FinishReason::Length,
            });
            events.push(GenerateEvent::Done {
                finish_reason: FinishReason::Length,
                usage: Usage {
                    prompt_tokens: req.prompt.len() as u32,
                    cached_tokens: 0,
                    completion_tokens: n,
                },
                timings: Default::default(),
            });
            Ok(futures_util::stream::iter(events).boxed())
        }
        .boxed()
    }

    fn kv_events(&self) -> BoxFuture<'_, Result<KvEventStream, WorkerError>> {
        async move {
            let snap = KvEvent::Snapshot {
                block_tokens: self.info.block_tokens,
                blocks: Vec::new(),
                load: LoadReport {
                    running: 0,
                    waiting: 0,
                    inflight_prefill_tokens: 0,
                    free_blocks: 1 << 20,
                    total_blocks: 1 << 20,
                },
                disk: Vec::new(),
                adapters: Vec::new(),
            };
            Ok(futures_util::stream::iter([snap])
                .chain(futures_util::stream::pending())
                .boxed())
        }
        .boxed()
    }

    fn health(&self) -> BoxFuture<'_, Result<(), WorkerError>> {
        async { Ok(()) }.boxed()
    }
}

pub struct GatewayBenchConfig {
    /// Sequential requests per mode for the latency figures.
    pub requests: usize,
    /// Seconds of the concurrent phase per mode.
    pub seconds: f64,
    pub concurrency: usize,
    pub redis_url: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ModeResult {
    pub mode: String,
    pub p50_us: f64,
    pub p99_us: f64,
    pub mean_us: f64,
    /// P50 minus the baseline's P50.
    pub added_p50_us: f64,
    pub requests_per_s: f64,
    pub errors: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct GatewayBenchReport {
    pub requests: usize,
    pub concurrency: usize,
    pub modes: Vec<ModeResult>,
    /// Successful metered requests, all of them in the ledger at the end.
    pub usage_records: usize,
}

impl GatewayBenchReport {
    pub fn table(&self) -> String {
        let mut s = format!(
            "gateway overhead, instant worker, HTTP on loopback ({} sequential requests; {} concurrent clients)\n\n",
            self.requests, self.concurrency
        );
        s += &format!(
            "{:<16} {:>10} {:>10} {:>10} {:>14} {:>12}\n",
            "mode", "p50 µs", "p99 µs", "mean µs", "added p50 µs", "req/s"
        );
        for m in &self.modes {
            s += &format!(
                "{:<16} {:>10.1} {:>10.1} {:>10.1} {:>14.1} {:>12.0}{}\n",
                m.mode,
                m.p50_us,
                m.p99_us,
                m.mean_us,
                m.added_p50_us,
                m.requests_per_s,
                if m.errors > 0 {
                    format!("  ({} errors)", m.errors)
                } else {
                    String::new()
                }
            );
        }
        let ours = |m: &str| self.modes.iter().find(|x| x.mode == m);
        if let Some(m) = ours("in_process") {
            s += &format!(
                "\nin-process: auth + limits + budget + metering add {:.1} µs at P50 (target ≤ 150); {:.0} req/s (target ≥ 5000)\n(peer gateways: bench/gateway-compare measures them in the same run)\n",
                m.added_p50_us, m.requests_per_s
            );
        }
        s += &format!(
            "ledger: {} metered requests succeeded, {} usage records committed\n",
            self.usage_records, self.usage_records
        );
        if let (Some(w), Some(f)) = (ours("in_process"), ours("in_process_fsync")) {
            s += &format!(
                "--usage-durability fsync: +{:.1} µs at P50 over write ({:.0} vs {:.0} µs); {:.0} vs {:.0} req/s ({:.2}×) with group commit\n",
                f.p50_us - w.p50_us,
                f.p50_us,
                w.p50_us,
                f.requests_per_s,
                w.requests_per_s,
                f.requests_per_s / w.requests_per_s.max(1e-9)
            );
        }
        if let Some(m) = ours("redis") {
            s += &format!(
                "redis: {:.1} µs added at P50 (target ≤ 1000); {:.0} req/s\n",
                m.added_p50_us, m.requests_per_s
            );
        }
        s
    }
}

use crate::percentile;

struct Mode {
    name: &'static str,
    app: axum::Router,
    key: String,
}

async fn start(app: axum::Router) -> anyhow::Result<String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Ok(format!("http://{addr}/v1/chat/completions"))
}

/// The baseline's meter: records nothing.
struct Unmetered;

impl Meter for Unmetered {
    fn record<'a>(&'a self, _: &'a mut UsageRecord) -> BoxFuture<'a, Option<Pending>> {
        async { None }.boxed()
    }

    fn settle<'a>(&'a self, _: &'a UsageRecord, _: Option<Pending>) -> BoxFuture<'a, ()> {
        async {}.boxed()
    }
}

/// The baseline app: the gateway's pipeline without its authenticate, budget, limit and
/// meter phases, behind the same request-id layer as the real app.
fn baseline_app(state: Arc<AppState>) -> axum::Router {
    axum::Router::new()
        .route("/v1/chat/completions", axum::routing::post(baseline))
        .with_state(state)
        .layer(axum::middleware::from_fn(app::request_id))
}

async fn baseline(
    State(state): State<Arc<AppState>>,
    Extension(RequestId(id)): Extension<RequestId>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let mut ctx = RequestContext::new(id, Endpoint::Chat, headers, body);
    ctx.tenant = Some(hearth_tenants::TenantContext {
        tenant_id: "bench".into(),
        tenant_name: "bench".into(),
        key_id: "bench".into(),
        scopes: hearth_tenants::Scopes::ALL,
        models: None,
        tenant_limits: Default::default(),
        key_limits: Default::default(),
        budget: None,
        expires_at: None,
    });
    ctx.usage = Some(UsageRecord::started(
        &ctx.request_id,
        "bench",
        None,
        Endpoint::Chat.path(),
        0,
    ));
    let run = async {
        parse::run(&mut ctx, false)?;
        resolve::run(&state, &mut ctx).await?;
        tokenize::run(&mut ctx)?;
        let dispatched = dispatch::run(&state, &mut ctx).await?;
        let events = relay::start(state.clone(), Arc::new(Unmetered), &mut ctx, dispatched).await?;
        postprocess::run(&state, &mut ctx, events).await
    };
    run.await.unwrap_or_else(IntoResponse::into_response)
}

/// Sends requests to one gateway.
#[derive(Clone)]
struct Sender {
    client: reqwest::Client,
    url: Arc<str>,
    key: Arc<str>,
    body: Arc<Vec<u8>>,
}

impl Sender {
    /// One request; true when it succeeded.
    async fn send(&self) -> bool {
        let r = self
            .client
            .post(&*self.url)
            .bearer_auth(&*self.key)
            .header("content-type", "application/json")
            .body((*self.body).clone())
            .send()
            .await;
        match r {
            Ok(r) => {
                let ok = r.status().is_success();
                r.bytes().await.is_ok() && ok
            }
            Err(_) => false,
        }
    }
}

/// Requests/s, errors and successes of `concurrency` clients for `seconds`.
async fn throughput(s: &Sender, cfg: &GatewayBenchConfig) -> anyhow::Result<(f64, usize, usize)> {
    let deadline = Instant::now() + Duration::from_secs_f64(cfg.seconds);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..cfg.concurrency {
        let s = s.clone();
        tasks.push(tokio::spawn(async move {
            let (mut n, mut e) = (0usize, 0usize);
            while Instant::now() < deadline {
                if s.send().await {
                    n += 1;
                } else {
                    e += 1;
                }
            }
            (n, e)
        }));
    }
    let (mut n, mut e) = (0, 0);
    for t in tasks {
        let (a, b) = t.await?;
        n += a;
        e += b;
    }
    Ok((n as f64 / started.elapsed().as_secs_f64(), e, n))
}

/// Runs the benchmark with the model's tokenizer (`model_path`) served as `model_id`.
pub async fn run(model_path: &Path, model_id: &str, cfg: GatewayBenchConfig) -> anyhow::Result<GatewayBenchReport> {
    let info = hearth_engine::worker::sim::sim_info(model_path, model_id, "local")?;
    let dir = std::env::temp_dir().join(format!("hearth-bench-gateway-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let db = hearth_gateway::server::db::open(&dir, None).await?;
    let tenants = TenantStore::new(&db);
    tenants.create_tenant("bench").await?;
    let generous = Limits {
        rpm: Some(100_000_000),
        tpm: Some(1_000_000_000),
        concurrent: Some(100_000),
        ..Default::default()
    };
    tenants.set_tenant_limits("bench", generous).await?;
    tenants
        .set_budget(
            "bench",
            Some(Budget {
                monthly_nusd: i64::MAX / 4,
                hard: true,
            }),
        )
        .await?;
    let key = tenants.create_key("bench", &KeySpec::default()).await?;
    tenants.set_key_limits(&key.info.id, generous).await?;
    let ledger = UsageLedger::with_outbox(&db, &dir).await?;
    ledger
        .set_price(
            "*",
            hearth_billing::PriceRates {
                input_micros_per_mtok: 150_000,
                cached_input_micros_per_mtok: 75_000,
                output_micros_per_mtok: 600_000,
                processor_micros_per_cpu_s: 0,
                batch_percent: hearth_billing::DEFAULT_BATCH_PERCENT,
            },
            None,
        )
        .await?;
    // The same ledger with `--usage-durability fsync`: its own outbox, on the same disk.
    let fsync_dir = dir.join("fsync");
    let fsync_ledger =
        UsageLedger::with_outbox_durability(&db, &fsync_dir, hearth_billing::outbox::Durability::Fsync).await?;
    let gateway = |limiter: Limiter, ledger: UsageLedger| {
        let info = info.clone();
        let db = db.clone();
        async move {
            let worker: Arc<dyn WorkerClient> = Arc::new(InstantWorker { info });
            let models = ModelRegistry::discover(vec![worker], Duration::ZERO, &RoutingConfig::default()).await?;
            let mut state = AppState::new(TenantStore::new(&db), ledger, models);
            state.limiter = limiter;
            anyhow::Ok(Arc::new(state))
        }
    };
    let mut modes = vec![
        Mode {
            name: "baseline",
            app: baseline_app(gateway(Limiter::default(), ledger.clone()).await?),
            key: "unused".into(),
        },
        Mode {
            name: "in_process",
            app: app::router(gateway(Limiter::default(), ledger.clone()).await?),
            key: key.key.clone(),
        },
        Mode {
            name: "in_process_fsync",
            app: app::router(gateway(Limiter::default(), fsync_ledger).await?),
            key: key.key.clone(),
        },
    ];
    if let Some(url) = cfg.redis_url.as_deref() {
        let prefix = format!("hearth-bench-{}:", std::process::id());
        let limiter = Limiter::with_redis(RedisLimiter::connect(url, &prefix).await?);
        modes.push(Mode {
            name: "redis",
            app: app::router(gateway(limiter, ledger.clone()).await?),
            key: key.key.clone(),
        });
    }
    let body = Arc::new(serde_json::to_vec(&json!({
        "model": model_id, "max_tokens": 8,
        "messages": [{"role": "user", "content": "Say something short about the sea."}],
    }))?);
    let client = reqwest::Client::builder().pool_max_idle_per_host(256).build()?;
    let mut senders = Vec::new();
    for m in &modes {
        senders.push(Sender {
            client: client.clone(),
            url: start(m.app.clone()).await?.into(),
            key: m.key.clone().into(),
            body: body.clone(),
        });
    }
    // Warm-up, then latency: one request per mode in turn, so drift hits all modes alike;
    // the mode that goes first rotates (the first request of a round pays for waking up).
    let mut ok = vec![0usize; modes.len()];
    let mut errors = vec![0usize; modes.len()];
    let mut lat = vec![Vec::with_capacity(cfg.requests); modes.len()];
    for round in 0..cfg.requests + 200 {
        for k in 0..senders.len() {
            let i = (round + k) % senders.len();
            let s = &senders[i];
            let t = Instant::now();
            if s.send().await {
                ok[i] += 1;
            } else {
                errors[i] += 1;
            }
            if round >= 200 {
                lat[i].push(t.elapsed().as_secs_f64() * 1e6);
            }
        }
    }
    let mut results = Vec::new();
    let mut base = 0.0;
    let mut metered_ok = 0;
    for (i, m) in modes.iter().enumerate() {
        let (rps, e, n) = throughput(&senders[i], &cfg).await?;
        let l = &mut lat[i];
        l.sort_by(f64::total_cmp);
        let p50 = percentile(l, 0.5);
        if m.name == "baseline" {
            base = p50;
        } else {
            metered_ok += ok[i] + n;
        }
        results.push(ModeResult {
            mode: m.name.to_string(),
            p50_us: p50,
            p99_us: percentile(l, 0.99),
            mean_us: l.iter().sum::<f64>() / l.len().max(1) as f64,
            added_p50_us: p50 - base,
            requests_per_s: rps,
            errors: errors[i] + e,
        });
    }
    // Records the writer could not take at once wait in the outbox and are replayed within
    // seconds: give them that time, then every success must be in the ledger.
    let deadline = Instant::now() + Duration::from_secs(20);
    let metered = loop {
        ledger.flush().await;
        let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM usage_records")
            .fetch_one(&db.pool)
            .await?;
        if n as usize == metered_ok || Instant::now() > deadline {
            break n;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    if metered as usize != metered_ok {
        anyhow::bail!("{metered_ok} metered requests succeeded but the ledger has {metered} records");
    }
    let _ = std::fs::remove_dir_all(&dir);
    modes.clear();
    Ok(GatewayBenchReport {
        requests: cfg.requests,
        concurrency: cfg.concurrency,
        modes: results,
        usage_records: metered_ok,
    })
}

/// P50 (µs) of the same request through one metered gateway for a tenant without processors
/// and a tenant with the trivial WAT processor as pre + post, interleaved.
pub async fn processor_overhead(model_path: &Path, model_id: &str, requests: usize) -> anyhow::Result<(f64, f64)> {
    let info = hearth_engine::worker::sim::sim_info(model_path, model_id, "local")?;
    let dir = std::env::temp_dir().join(format!("hearth-bench-processors-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let db = hearth_gateway::server::db::open(&dir, None).await?;
    let tenants = TenantStore::new(&db);
    let mut keys = Vec::new();
    for t in ["plain", "proc"] {
        tenants.create_tenant(t).await?;
        keys.push(tenants.create_key(t, &KeySpec::default()).await?.key);
    }
    let runtime = Arc::new(hearth_runtime::Runtime::new(None)?);
    let wasm = hearth_runtime::wat_guest::trivial();
    let compiled = runtime.compile(&wasm)?;
    tenants
        .add_processor(
            "proc",
            &hearth_tenants::processors::ProcessorSpec {
                name: "trivial".into(),
                sha256: compiled.sha256.clone(),
                config: "{}".into(),
                cpu_ms: 50,
                memory_mib: 16,
                key_id: None,
                position: None,
                activate: true,
            },
            &wasm,
        )
        .await?;
    let worker: Arc<dyn WorkerClient> = Arc::new(InstantWorker { info });
    let models = ModelRegistry::discover(vec![worker], Duration::ZERO, &RoutingConfig::default()).await?;
    let mut state = AppState::new(
        TenantStore::new(&db),
        UsageLedger::with_outbox(&db, &dir).await?,
        models,
    );
    state.processors = Some(hearth_gateway::policy::processors::ProcessorHost { runtime });
    let url: Arc<str> = start(app::router(Arc::new(state))).await?.into();
    let body = Arc::new(serde_json::to_vec(&json!({
        "model": model_id, "max_tokens": 8,
        "messages": [{"role": "user", "content": "Say something short about the sea."}],
    }))?);
    let client = reqwest::Client::builder().build()?;
    let senders: Vec<Sender> = keys
        .iter()
        .map(|k| Sender {
            client: client.clone(),
            url: url.clone(),
            key: k.as_str().into(),
            body: body.clone(),
        })
        .collect();
    let mut lat = [Vec::new(), Vec::new()];
    for round in 0..requests + 200 {
        // The first of each round rotates (it pays for waking the client up).
        for k in 0..senders.len() {
            let i = (round + k) % senders.len();
            let s = &senders[i];
            let t = Instant::now();
            anyhow::ensure!(s.send().await, "a benchmark request failed");
            if round >= 200 {
                lat[i].push(t.elapsed().as_secs_f64() * 1e6);
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    let mut p50 = [0.0; 2];
    for (i, l) in lat.iter_mut().enumerate() {
        l.sort_by(f64::total_cmp);
        p50[i] = percentile(l, 0.5);
    }
    Ok((p50[0], p50[1]))
}

//! The launchers: `hearth serve` (gateway + in-process workers + SQLite), `hearth worker`
//! and `hearth gateway`; model resolution and engine loading.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use hearth_billing::UsageLedger;
use hearth_engine::formats::fetch::{ensure_model, hearth_home};
use hearth_engine::kv::transfer::LocalKvTransport;
use hearth_engine::worker::metrics::EngineCollector;
use hearth_engine::worker::server::Lifecycle;
use hearth_engine::worker::sim::{sim_info, CostModel, SimHandle};
use hearth_engine::{Backend, EngineHandle};
use hearth_gateway::app;
use hearth_gateway::state::AppState;
use hearth_gateway::upstream::cluster::{Discovery, Registrar, SharedRouting, WorkerRecord};
use hearth_gateway::upstream::registry::{ModelRegistry, RoutingConfig};
use hearth_gateway::upstream::workers::{HttpWorker, ModelHostClient, WorkerClient};
use hearth_tenants::TenantStore;

use crate::args::{
    AccessArgs, DataArgs, GatewayArgs, HttpArgs, LifecycleArgs, LimitStoreArgs, ModelArgs, ServeArgs, WorkerArgs,
};
use crate::catalogue::LocalCatalogue;
use crate::local_worker::InProcessWorker;

/// Resolves `--model` to a file (fetching a known model if needed) and the id to serve it as.
pub async fn resolve_model(args: &ModelArgs) -> anyhow::Result<(PathBuf, String)> {
    let as_path = Path::new(&args.model);
    let (path, id) = if as_path.exists() || args.model.ends_with(".gguf") {
        if !as_path.exists() {
            bail!("model file {} does not exist", as_path.display());
        }
        let stem = as_path
            .file_stem()
            .map_or("model".into(), |s| s.to_string_lossy().to_lowercase());
        (as_path.to_path_buf(), args.model_id.clone().unwrap_or(stem))
    } else {
        let model = args.model.clone();
        let path = tokio::task::spawn_blocking(move || {
            ensure_model(&model, &hearth_home(), &mut |m| eprintln!("hearth: {m}"))
        })
        .await??;
        (path, args.model_id.clone().unwrap_or_else(|| args.model.clone()))
    };
    Ok((path, id))
}

/// Starts the backend `--backend` names for `--model`.
async fn load_backend(args: &ModelArgs) -> anyhow::Result<Arc<dyn Backend>> {
    match args.backend.as_str() {
        "engine" => Ok(Arc::new(load_engine(args).await?)),
        "sim" => {
            let (path, id) = resolve_model(args).await?;
            let info = sim_info(&path, &id, &args.region)?;
            tracing::info!(model = %id, speedup = args.sim_speedup, "sim backend ready");
            let cost = CostModel::default();
            let queue = args.max_queue_tokens.unwrap_or(cost.kv_tokens) as u64;
            Ok(Arc::new(SimHandle::start_with_queue(
                info,
                cost,
                args.sim_speedup,
                queue,
            )))
        }
        other => bail!("unknown backend {other:?} (engine, sim)"),
    }
}

/// Loads the engine for `--model`.
async fn load_engine(args: &ModelArgs) -> anyhow::Result<EngineHandle> {
    let (path, id) = resolve_model(args).await?;
    let cfg = args.engine_config();
    let threads = cfg.threads;
    let engine = tokio::task::spawn_blocking(move || EngineHandle::load(&path, &id, &cfg))
        .await?
        .context("loading the model")?;
    tracing::info!(
        model = %engine.info().model,
        parameters = engine.info().parameters,
        context = engine.info().context_length,
        threads,
        load_ms = (engine.load_seconds() * 1000.0) as u64,
        isa = %hearth_engine::kernels::isa(),
        "engine ready"
    );
    Ok(engine)
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        if let Ok(mut s) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            s.recv().await;
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
    tracing::info!("shutting down");
}

/// The workers a gateway starts with.
struct Workers {
    clients: Vec<Arc<dyn WorkerClient>>,
    /// How long to wait for them to answer at start.
    wait: Duration,
    /// In-process engines (`hearth serve`), whose metrics join the gateway's.
    engines: Option<EngineCollector>,
    /// The workers' catalogues (models added and removed at runtime).
    hosts: Vec<Arc<dyn ModelHostClient>>,
    /// Workers found in the registry in Redis as they register.
    discover: Option<Discover>,
    /// The adapter store they read (`--adapter-dir`), where the gateway puts uploads.
    adapter_store: Option<PathBuf>,
}

/// `hearth gateway --discover`: the registry is read with the workers' token.
struct Discover {
    token: String,
    interval: Duration,
}

/// This process's id among the gateways sharing routing state: host, pid, start time.
fn gateway_id() -> String {
    let host = host_name().unwrap_or_else(|| "gateway".into());
    format!("{host}-{}-{:x}", std::process::id(), hearth_tenants::now_ms())
}

/// The host's name (`HOSTNAME`, else the kernel's), if it has one.
fn host_name() -> Option<String> {
    std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/proc/sys/kernel/hostname").ok())
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
}

async fn run_gateway(
    listen: SocketAddr,
    data: &DataArgs,
    workers: Workers,
    access: &AccessArgs,
    routing: RoutingConfig,
    limits: &LimitStoreArgs,
    (lifecycle, http): (&LifecycleArgs, &HttpArgs),
) -> anyhow::Result<()> {
    let db = data.open().await?;
    let (state, discovery) = gateway_state(data, &db, workers, access, &routing, limits, http).await?;
    let gw = Arc::new(state);
    spawn_background(&gw, discovery).await;
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("cannot listen on {listen}"))?;
    let addr = listener.local_addr()?;
    let config = Effective {
        data_dir: &data.dir(),
        database: db.backend.as_str(),
        pd_threshold: routing.pd_threshold,
        processor_warm: limits.processor_warm,
    };
    announce(&gw, addr, config).await?;
    serve_until_drained(gw, listener, lifecycle, http).await
}

/// The gateway's shared state from its arguments, and the worker registry to poll
/// (`--discover`, with the Redis connection the limits use).
async fn gateway_state(
    data: &DataArgs,
    db: &hearth_tenants::Db,
    workers: Workers,
    access: &AccessArgs,
    routing: &RoutingConfig,
    limits: &LimitStoreArgs,
    http: &HttpArgs,
) -> anyhow::Result<(AppState, Option<(Discovery, Duration)>)> {
    let (admin_token, public_origin) = access.checked()?;
    let data_dir = data.dir();
    let limiter = limits.limiter().await?;
    if workers.discover.is_some() && limiter.redis().is_none() {
        bail!("--discover reads the worker registry in Redis: give --redis-url (HEARTH_REDIS_URL)");
    }
    let models = ModelRegistry::discover(workers.clients, workers.wait, routing).await?;
    models.set_hosts(workers.hosts);
    let mut tenants = TenantStore::new(db);
    tenants.file_quota = i64::try_from(limits.tenant_file_bytes).unwrap_or(i64::MAX);
    let mut state = AppState::new(
        tenants,
        UsageLedger::with_outbox_durability(
            db,
            &data_dir,
            hearth_billing::outbox::Durability::parse(&limits.usage_durability).map_err(anyhow::Error::msg)?,
        )
        .await?,
        models,
    );
    state.admin_token = admin_token;
    state.public_origin = public_origin;
    state.operator_sso = access.operator_sso()?;
    state
        .tenants
        .set_stale_limit(Duration::from_secs(limits.auth_stale_secs));
    state.body_limits = hearth_gateway::server::http::BodyLimits::new(
        &http.limits(),
        "/processors",
        hearth_tenants::processors::MAX_PROCESSOR_BYTES + (1 << 20),
    )
    .with_upload(
        "/adapters",
        hearth_gateway::manage::adapters::MAX_ADAPTER_UPLOAD_BYTES + (1 << 20),
    )
    .with_upload("/v1/files", hearth_tenants::batches::MAX_FILE_BYTES + (1 << 20));
    state.request_limits = hearth_gateway::state::RequestLimits {
        stream_idle: Duration::from_secs(limits.stream_idle_timeout_secs.max(1)),
        max_duration: Duration::from_secs(limits.max_request_secs.max(1)),
    };
    state.response_retention = hearth_tenants::responses::ResponseRetention {
        ttl_ms: i64::from(limits.responses_ttl_days.max(1)) * 24 * 3600 * 1000,
        max_per_tenant: limits.responses_per_tenant.max(1),
        max_tenant_bytes: limits.responses_tenant_bytes.max(1),
        max_response_bytes: limits.response_max_bytes.max(1),
        max_conversation_bytes: limits.conversation_max_bytes.max(1),
    };
    state.keep_billing_header = limits.keep_billing_header;
    state.batches = hearth_gateway::state::BatchSettings {
        concurrency: limits.batch_concurrency,
        lease: Duration::from_secs(limits.batch_lease_secs),
        ..Default::default()
    };
    state.default_max_tokens = limits.default_max_tokens.filter(|&n| n > 0);
    let mut discovery = None;
    if let Some(r) = limiter.redis() {
        // Budget reservations live where the limits live: shared by every gateway.
        let (conn, prefix) = r.connection();
        let mut budgets = hearth_gateway::policy::budget::BudgetCache::with_redis(conn.clone(), prefix);
        budgets.health = Some(r.health());
        state.budgets = Arc::new(budgets);
        // So do session pins and load: N gateways route like one.
        let mut shared = SharedRouting::new(conn.clone(), prefix, &gateway_id());
        shared.health = Some(r.health());
        state.shared_routing = Some(Arc::new(shared));
        discovery = workers.discover.as_ref().map(|d| {
            let mut discovery = Discovery::new(conn, prefix, &d.token);
            discovery.refused = state.metrics.registrations_refused.clone();
            (discovery, d.interval)
        });
    }
    state.limiter = limiter;
    if let Some(dir) = &workers.adapter_store {
        std::fs::create_dir_all(dir).with_context(|| format!("creating the adapter store {}", dir.display()))?;
        hearth_gateway::manage::adapters::sweep_staging(dir);
        tracing::info!(dir = %dir.display(), "adapter store");
    }
    state.adapter_dir = workers.adapter_store.clone();
    state.processors = Some(hearth_gateway::policy::processors::ProcessorHost {
        runtime: Arc::new(
            hearth_runtime::Runtime::new(Some(
                limits
                    .processor_cache
                    .clone()
                    .unwrap_or_else(|| data_dir.join("processors")),
            ))?
            .with_warm(limits.processor_warm),
        ),
    });
    if let Some(engines) = workers.engines {
        state.metrics.register_collector(Box::new(engines));
    }
    Ok((state, discovery))
}

/// This gateway's background work: purging expired stored responses, exchanging load with
/// the other gateways, its share of the batch lines, and the worker registry's polls (the
/// first one before it listens, so that registered workers serve from the start).
async fn spawn_background(gw: &Arc<AppState>, discovery: Option<(Discovery, Duration)>) {
    // Expired stored responses are invisible at once and deleted hourly; each tenant's
    // stored bytes are read for `/metrics` each minute.
    {
        let gw = gw.clone();
        tokio::spawn(async move {
            let mut every = tokio::time::interval(Duration::from_secs(60));
            for minute in 0u64.. {
                every.tick().await;
                if minute % 60 == 0 {
                    if let Err(e) = gw.tenants.purge_responses().await {
                        tracing::warn!(error = %e, "expired stored responses could not be purged");
                    }
                }
                match gw.tenants.response_totals().await {
                    Ok(totals) => gw.metrics.set_stored_responses(&totals),
                    Err(e) => tracing::warn!(error = %e, "stored responses could not be counted"),
                }
            }
        });
    }
    if let Some(shared) = gw.shared_routing.clone() {
        tokio::spawn(shared.sync_load(gw.clone(), Duration::from_millis(500)));
    }
    // Batches (OpenAI Batch API): this gateway's share of the lines, in the batch class.
    tokio::spawn(hearth_gateway::routes::batches::runner::run(gw.clone(), gateway_id()));
    if let Some((discovery, interval)) = discovery {
        // The first poll before listening: workers already registered serve from the start.
        let mut discovery = discovery;
        if let Err(e) = discovery.poll(&gw.models).await {
            tracing::warn!(error = %e, "worker registry unreachable at start");
        }
        tokio::spawn(discovery.run(gw.clone(), interval));
    }
}

/// What the startup line reports beside the state's own settings.
struct Effective<'a> {
    data_dir: &'a Path,
    database: &'a str,
    pd_threshold: usize,
    processor_warm: usize,
}

/// The effective configuration, logged, and the first steps for a newcomer, printed.
async fn announce(gw: &AppState, addr: SocketAddr, config: Effective<'_>) -> anyhow::Result<()> {
    let Effective {
        data_dir,
        database,
        pd_threshold,
        processor_warm,
    } = config;
    let served: Vec<String> = gw.models.all().iter().map(|m| m.id.clone()).collect();
    tracing::info!(
        listen = %addr,
        data_dir = %data_dir.display(),
        database,
        rate_limits = if gw.limiter.shared() { "redis" } else { "in-process" },
        models = ?served,
        admin_api = gw.admin_token.is_some(),
        operator_sso = gw.operator_sso.as_ref().map(|o| format!("{} ({} operators)", o.provider.issuer, o.operators.len())),
        pd_threshold,
        processor_warm,
        shared_routing = gw.shared_routing.as_ref().map(|s| s.gateway().to_string()),
        "effective configuration"
    );
    if gw.public_origin.is_none() && !addr.ip().is_loopback() {
        tracing::warn!(
            listen = %addr,
            "--public-url is unset: invitation links and single sign-on work only for requests addressed to localhost \
             (links are never built from a client's Host header); give the URL clients reach this gateway at"
        );
    }
    println!("Hearth is listening on http://{addr} (models: {})", served.join(", "));
    println!(
        "Dashboard: http://{addr}/dashboard (sign in with an API key that has the 'manage' scope, or the admin token)"
    );
    if !gw.tenants.has_active_keys().await? {
        let dd = data_dir.display();
        println!(
            "No API keys yet. Create a tenant and a key, then call the API with it:\n  \
             hearth admin --data-dir {dd} tenant create demo\n  \
             hearth admin --data-dir {dd} key create --tenant demo\n  \
             curl http://{addr}/v1/chat/completions -H \"Authorization: Bearer $KEY\" \\\n    \
             -H 'Content-Type: application/json' \\\n    \
             -d '{{\"model\":\"{}\",\"messages\":[{{\"role\":\"user\",\"content\":\"Hello!\"}}]}}'",
            served.first().map_or("MODEL", String::as_str)
        );
    }
    Ok(())
}

/// Serves until SIGTERM, then drains: readiness off, the shutdown delay, requests in flight
/// finished (or ended at the drain timeout), and every usage record committed.
async fn serve_until_drained(
    gw: Arc<AppState>,
    listener: tokio::net::TcpListener,
    lifecycle: &LifecycleArgs,
    http: &HttpArgs,
) -> anyhow::Result<()> {
    // With the peer's address: the audit log records where management actions came from.
    let service = app::router(gw.clone());
    // SIGTERM: readiness off, the shutdown delay (load balancers notice), then no new
    // connections while requests in flight finish — bounded by the drain timeout, past
    // which they end with an error and their usage record — then the usage is flushed.
    let (drained_tx, drained) = tokio::sync::watch::channel(false);
    let draining = gw.clone();
    let delay = Duration::from_secs(lifecycle.shutdown_delay_secs);
    let shutdown = async move {
        shutdown_signal().await;
        draining.draining.store(true, std::sync::atomic::Ordering::SeqCst);
        tracing::info!(
            delay_s = delay.as_secs(),
            "draining: /readyz answers 503; requests in flight finish"
        );
        tokio::time::sleep(delay).await;
        drained_tx.send_replace(true);
    };
    let connections = gw.metrics.connections.clone();
    let server = hearth_gateway::server::http::serve(listener, service, http.limits(), connections, shutdown);
    let timeout = Duration::from_secs(lifecycle.drain_timeout_secs);
    let abort = gw.clone();
    let overrun = async move {
        let mut drained = drained;
        let _ = drained.wait_for(|d| *d).await;
        tokio::time::sleep(timeout).await;
        tracing::warn!("drain timeout: ending the requests still in flight");
        abort.abort.send_replace(true);
        // Their relays record them and end at once; a connection still open after that (a
        // client that does not read) does not hold the exit.
        tokio::time::sleep(Duration::from_secs(5)).await;
    };
    tokio::select! {
        r = server => r?,
        () = overrun => tracing::warn!("closing the connections still open"),
    }
    // Every authenticated request's usage is handed to the ledger (a relay records even a
    // client that went away after the connection closed), then committed.
    if tokio::time::timeout(Duration::from_secs(10), gw.unrecorded.idle())
        .await
        .is_err()
    {
        tracing::warn!(requests = gw.unrecorded.running(), "requests still unrecorded at exit");
    }
    gw.ledger.flush().await;
    tracing::info!("usage flushed; exiting");
    Ok(())
}

pub async fn serve(mut a: ServeArgs) -> anyhow::Result<()> {
    // Refused before a model is loaded.
    a.access.checked()?;
    // Tenants' adapters: the in-process engines read what the gateway stores.
    let adapters = a
        .model
        .adapter_dir
        .clone()
        .unwrap_or_else(|| a.data.dir().join("adapters"));
    std::fs::create_dir_all(&adapters).with_context(|| format!("creating the adapter store {}", adapters.display()))?;
    a.model.adapter_dir = Some(adapters);
    if let Some(path) = &a.catalogue {
        if a.pipeline > 1 {
            bail!("--pipeline splits one model: it does not combine with --catalogue");
        }
        if a.prefill_workers + a.decode_workers > 0 {
            bail!("--prefill-workers and --decode-workers serve one model: they do not combine with --catalogue");
        }
        let catalogue = LocalCatalogue::open(path, &a.model, a.memory_budget_mib).await?;
        tracing::info!(models = ?catalogue.ids(), "catalogue: models load on their first request");
        let clients = catalogue
            .backends()
            .into_iter()
            .map(|(id, backend)| {
                Arc::new(InProcessWorker::new(backend, &format!("local-{id}"))) as Arc<dyn WorkerClient>
            })
            .collect();
        // Metrics follow the catalogue as models are added and removed.
        let listed = catalogue.clone();
        let engines = EngineCollector::dynamic(move || {
            listed
                .backends()
                .into_iter()
                .map(|(id, b)| (format!("local-{id}"), b))
                .collect()
        });
        let workers = Workers {
            clients,
            wait: Duration::ZERO,
            engines: Some(engines),
            hosts: vec![catalogue as Arc<dyn ModelHostClient>],
            discover: None,
            adapter_store: a.model.adapter_dir.clone(),
        };
        let routing = a.routing.config(&a.model.region)?;
        return run_gateway(
            a.listen,
            &a.data,
            workers,
            &a.access,
            routing,
            &a.limits,
            (&a.lifecycle, &a.http),
        )
        .await;
    }
    a.model.memory_budget_mib = a.memory_budget_mib;
    // `--pipeline N`: the other stages as local processes, for as long as this one runs.
    let _stages = match a.pipeline {
        0 | 1 => None,
        n => {
            if a.prefill_workers + a.decode_workers > 0 || a.workers > 1 {
                bail!("--pipeline splits one engine across processes: it does not combine with --workers, --prefill-workers or --decode-workers");
            }
            let (path, id) = resolve_model(&a.model).await?;
            a.model.model = path.display().to_string();
            a.model.model_id = Some(id);
            Some(crate::pipeline::LocalStages::start(n, &path, &mut a.model)?)
        }
    };
    // Roles: `--prefill-workers`/`--decode-workers` (disaggregated), else `--workers` alike.
    let pd = a.prefill_workers + a.decode_workers > 0;
    let roles: Vec<&str> = if pd {
        let mut r = vec!["prefill"; a.prefill_workers];
        r.extend(vec!["decode"; a.decode_workers]);
        r
    } else {
        vec!["both"; a.workers.clamp(1, 64)]
    };
    anyhow::ensure!(roles.len() <= 64, "at most 64 in-process workers");
    let n = roles.len();
    let mut model = a.model.clone();
    let total = model
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    model.threads = Some((total / n).max(1));
    let transport = Arc::new(LocalKvTransport::default());
    let mut clients: Vec<Arc<dyn WorkerClient>> = Vec::new();
    let mut engines = Vec::new();
    for (i, role) in roles.into_iter().enumerate() {
        let backend = load_backend(&model).await?;
        let name = if pd {
            format!("local-{role}-{i}")
        } else {
            format!("local-{i}")
        };
        let mut worker = InProcessWorker::new(backend.clone(), &name);
        // Several engines move KV blocks between them in process: the decode halves of
        // disaggregated requests, and peer fetches.
        if n > 1 {
            worker = worker.with_role(role, transport.clone());
        }
        clients.push(Arc::new(worker));
        engines.push((name, backend));
    }
    let workers = Workers {
        clients,
        wait: Duration::ZERO,
        engines: Some(EngineCollector::new(engines)),
        hosts: Vec::new(),
        discover: None,
        adapter_store: a.model.adapter_dir.clone(),
    };
    let routing = a.routing.config(&a.model.region)?;
    run_gateway(
        a.listen,
        &a.data,
        workers,
        &a.access,
        routing,
        &a.limits,
        (&a.lifecycle, &a.http),
    )
    .await
}

pub async fn worker(mut a: WorkerArgs) -> anyhow::Result<()> {
    let token = a.worker_token.clone().filter(|t| !t.is_empty());
    if let Some(plan) = crate::pipeline::apply(&a.stage, &mut a.model, token.as_deref())? {
        return crate::pipeline::follower(plan, &a.stage, &a.model, token).await;
    }
    if a.catalogue.is_some() && a.model.stage.is_some() {
        bail!("--stage splits one model: it does not combine with --catalogue");
    }
    a.model.memory_budget_mib = a.memory_budget_mib;
    let (engines, catalogue): (Vec<(String, Arc<dyn Backend>)>, _) = match &a.catalogue {
        Some(path) => {
            let catalogue = LocalCatalogue::open(path, &a.model, a.memory_budget_mib).await?;
            (catalogue.backends(), Some(catalogue))
        }
        None => {
            let engine = load_backend(&a.model).await?;
            (vec![(engine.info().model.clone(), engine)], None)
        }
    };
    let listener = tokio::net::TcpListener::bind(a.listen)
        .await
        .with_context(|| format!("cannot listen on {}", a.listen))?;
    let addr = listener.local_addr()?;
    let served: Vec<&str> = engines.iter().map(|(m, _)| m.as_str()).collect();
    println!(
        "Hearth worker ({}, role {}) is listening on http://{addr}",
        served.join(", "),
        a.role
    );
    if a.role != "both" && a.worker_token.is_none() {
        tracing::warn!(
            role = %a.role,
            "no worker token (HEARTH_WORKER_TOKEN): requests are never disaggregated to this worker; give the workers and the gateway the same token"
        );
    }
    let name = worker_name(addr);
    let lifecycle = Arc::new(Lifecycle::default());
    let registrar = match a.redis_url.as_deref().filter(|u| !u.is_empty()) {
        Some(url) => {
            let token = a.worker_token.as_deref().filter(|t| !t.is_empty()).context(
                "--redis-url registers this worker, and registrations are sealed with the workers' token: set HEARTH_WORKER_TOKEN",
            )?;
            let info = engines.first().map(|(_, e)| e.info().clone());
            let now = hearth_tenants::now_ms();
            let record = WorkerRecord {
                id: format!("{name}-{:x}", now),
                url: a.advertise_url.clone().unwrap_or_else(|| format!("http://{name}")),
                models: engines.iter().map(|(m, _)| m.clone()).collect(),
                region: a.model.region.clone(),
                role: a.role.clone(),
                capacity: info.map_or(0, |i| i.capacity),
                draining: false,
                started_ms: now,
                heartbeat_ms: now,
                ttl_ms: 0, // set by each heartbeat
            };
            let conn = hearth_gateway::server::redis_conn::connect(url).await?;
            let heartbeat = Duration::from_millis(a.heartbeat_ms.max(50));
            let r = Registrar::start(conn, &a.redis_prefix, token, record.clone(), heartbeat)
                .await
                .context("registering in the worker registry")?;
            tracing::info!(id = %record.id, url = %record.url, region = %record.region, role = %record.role, "registered");
            Some(r)
        }
        None => None,
    };
    let opts = hearth_engine::worker::server::WorkerOptions {
        token: a.worker_token.clone(),
        role: Some(a.role.clone()),
        lifecycle: Some(lifecycle.clone()),
    };
    let app = match catalogue {
        Some(c) => hearth_engine::worker::server::router_catalogue(&name, c, opts),
        None => hearth_engine::worker::server::router_many(engines, &name, opts),
    };
    // SIGTERM: refuse new work and say so (readiness, the registry), finish the streams in
    // flight (bounded), deregister, exit.
    let (drained_tx, drained) = tokio::sync::watch::channel(false);
    let timeout = Duration::from_secs(a.lifecycle.drain_timeout_secs);
    let delay = Duration::from_secs(a.lifecycle.shutdown_delay_secs);
    let draining = lifecycle.clone();
    let reg = registrar.clone();
    let shutdown = async move {
        shutdown_signal().await;
        draining.drain();
        if let Some(r) = &reg {
            r.drain().await;
        }
        tracing::info!(
            in_flight = draining.in_flight(),
            "draining: new requests refused; finishing those in flight"
        );
        let finished = tokio::time::timeout(timeout, async {
            draining.idle().await;
            tokio::time::sleep(delay).await;
        })
        .await;
        if finished.is_err() {
            tracing::warn!(
                in_flight = draining.in_flight(),
                "drain timeout: ending the generations still running"
            );
        }
        if let Some(r) = &reg {
            r.deregister().await;
        }
        drained_tx.send_replace(true);
    };
    // The same connection and body limits as the gateway's (no processor uploads here).
    let http_limits = a.http.limits();
    let body = hearth_gateway::server::http::BodyLimits::new(&http_limits, "", 0);
    let app = app
        .layer(axum::extract::DefaultBodyLimit::disable())
        .layer(axum::middleware::from_fn(move |req, next| {
            hearth_gateway::server::http::body_guard(body.clone(), req, next)
        }));
    // The worker's metrics are the engine's; its connection counts are not exported.
    let connections = hearth_gateway::server::http::ConnectionMetrics::default();
    let server = hearth_gateway::server::http::serve(listener, app, http_limits, connections, shutdown);
    // Past the drain, open connections (streams over the timeout) do not hold the exit.
    let overrun = async move {
        let mut drained = drained;
        let _ = drained.wait_for(|d| *d).await;
        tokio::time::sleep(Duration::from_secs(1)).await;
        if lifecycle.in_flight() > 0 {
            tracing::warn!(in_flight = lifecycle.in_flight(), "exiting with generations unfinished");
        }
    };
    tokio::select! {
        r = server => r?,
        () = overrun => {}
    }
    tracing::info!("worker stopped");
    Ok(())
}

/// How a worker names itself in metrics and traces: its address, or — listening on every
/// interface (`0.0.0.0`) — the host's name and the port, so that workers differ.
fn worker_name(addr: SocketAddr) -> String {
    if !addr.ip().is_unspecified() {
        return addr.to_string();
    }
    let host = host_name().unwrap_or_else(|| addr.ip().to_string());
    format!("{host}:{}", addr.port())
}

pub async fn gateway(a: GatewayArgs) -> anyhow::Result<()> {
    // Refused before workers are waited for.
    a.access.checked()?;
    // One client per model of each worker (a catalogue worker serves several); a worker
    // not up yet is waited for up to --worker-wait-secs.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(a.worker_wait_secs);
    let mut clients: Vec<Arc<dyn WorkerClient>> = Vec::new();
    let mut hosts: Vec<Arc<dyn ModelHostClient>> = Vec::new();
    for u in &a.workers {
        let found = loop {
            match HttpWorker::discover(u, a.worker_token.clone()).await {
                Ok((ws, host)) => {
                    hosts.extend(host.map(|h| Arc::new(h) as Arc<dyn ModelHostClient>));
                    break ws;
                }
                Err(hearth_gateway::upstream::workers::WorkerError::Unavailable { .. })
                    if tokio::time::Instant::now() < deadline =>
                {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                // Unreachable past the wait: the registry reports it.
                Err(_) => break vec![HttpWorker::new(u)?.with_token(a.worker_token.clone())],
            }
        };
        clients.extend(found.into_iter().map(|w| Arc::new(w) as Arc<dyn WorkerClient>));
    }
    let routing = a.routing.config(&a.region)?;
    let discover = if a.discover {
        let token =
            a.worker_token.clone().filter(|t| !t.is_empty()).context(
                "--discover accepts only registrations sealed with the workers' token: set HEARTH_WORKER_TOKEN",
            )?;
        Some(Discover {
            token,
            interval: Duration::from_millis(a.discovery_interval_ms.max(50)),
        })
    } else {
        None
    };
    let workers = Workers {
        clients,
        wait: Duration::from_secs(a.worker_wait_secs),
        engines: None,
        hosts,
        discover,
        adapter_store: a.adapter_dir.clone(),
    };
    run_gateway(
        a.listen,
        &a.data,
        workers,
        &a.access,
        routing,
        &a.limits,
        (&a.lifecycle, &a.http),
    )
    .await
}

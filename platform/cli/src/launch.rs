//! The launchers: `hearth serve` (gateway + in-process workers + SQLite), `hearth worker`
//! and `hearth gateway`; model resolution and engine loading.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use hearth_billing::UsageLedger;
use hearth_engine::fetch::{ensure_model, hearth_home};
use hearth_engine::kv_transfer::LocalKvTransport;
use hearth_engine::metrics::EngineCollector;
use hearth_engine::sim::{sim_info, CostModel, SimHandle};
use hearth_engine::{Backend, EngineHandle};
use hearth_gateway::app;
use hearth_gateway::registry::{ModelRegistry, RoutingConfig};
use hearth_gateway::state::AppState;
use hearth_gateway::workers::{HttpWorker, ModelHostClient, WorkerClient};
use hearth_tenants::TenantStore;

use crate::args::{DataArgs, GatewayArgs, LimitStoreArgs, ModelArgs, ServeArgs, WorkerArgs};
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
}

async fn run_gateway(
    listen: SocketAddr,
    data: &DataArgs,
    workers: Workers,
    admin_token: Option<String>,
    routing: RoutingConfig,
    limits: &LimitStoreArgs,
) -> anyhow::Result<()> {
    let data_dir = data.dir();
    let db = data.open().await?;
    let limiter = limits.limiter().await?;
    let models = ModelRegistry::discover(workers.clients, workers.wait, &routing).await?;
    let routing_pd = routing.pd_threshold;
    models.set_hosts(workers.hosts);
    let mut state = AppState::new(
        TenantStore::new(&db),
        UsageLedger::with_outbox(&db, &data_dir).await?,
        models,
    );
    state.admin_token = admin_token.filter(|t| !t.is_empty());
    if let Some(r) = limiter.redis() {
        // Budget reservations live where the limits live: shared by every gateway.
        let (conn, prefix) = r.connection();
        state.budgets = Arc::new(hearth_gateway::pipeline::budget::BudgetCache::with_redis(conn, prefix));
    }
    state.limiter = limiter;
    state.processors = Some(hearth_gateway::processors::ProcessorHost {
        runtime: Arc::new(hearth_runtime::Runtime::new(Some(
            limits
                .processor_cache
                .clone()
                .unwrap_or_else(|| data_dir.join("processors")),
        ))?),
    });
    if let Some(engines) = workers.engines {
        state.metrics.register_collector(Box::new(engines));
    }
    let gw = Arc::new(state);
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("cannot listen on {listen}"))?;
    let addr = listener.local_addr()?;
    let served: Vec<String> = gw.models.all().iter().map(|m| m.id.clone()).collect();
    tracing::info!(
        listen = %addr,
        data_dir = %data_dir.display(),
        database = db.backend.as_str(),
        rate_limits = if gw.limiter.shared() { "redis" } else { "in-process" },
        models = ?served,
        admin_api = gw.admin_token.is_some(),
        pd_threshold = routing_pd,
        "effective configuration"
    );
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
    // With the peer's address: the audit log records where management actions came from.
    let service = app::router(gw).into_make_service_with_connect_info::<SocketAddr>();
    axum::serve(listener, service)
        .with_graceful_shutdown(shutdown_signal())
        .await?;
    Ok(())
}

pub async fn serve(a: ServeArgs) -> anyhow::Result<()> {
    if let Some(path) = &a.catalogue {
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
        };
        let routing = a.routing.config(&a.model.region)?;
        return run_gateway(a.listen, &a.data, workers, a.admin_token, routing, &a.limits).await;
    }
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
        if pd {
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
    };
    let routing = a.routing.config(&a.model.region)?;
    run_gateway(a.listen, &a.data, workers, a.admin_token, routing, &a.limits).await
}

pub async fn worker(a: WorkerArgs) -> anyhow::Result<()> {
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
    let opts = hearth_engine::server::WorkerOptions {
        token: a.worker_token.clone(),
        role: Some(a.role.clone()),
    };
    let app = match catalogue {
        Some(c) => hearth_engine::server::router_catalogue(&name, c, opts),
        None => hearth_engine::server::router_many(engines, &name, opts),
    };
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown_signal())
        .await?;
    Ok(())
}

/// How a worker names itself in metrics and traces: its address, or — listening on every
/// interface (`0.0.0.0`) — the host's name and the port, so that workers differ.
fn worker_name(addr: SocketAddr) -> String {
    if !addr.ip().is_unspecified() {
        return addr.to_string();
    }
    let host = std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/proc/sys/kernel/hostname").ok())
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| addr.ip().to_string());
    format!("{host}:{}", addr.port())
}

pub async fn gateway(a: GatewayArgs) -> anyhow::Result<()> {
    // One client per model of each worker (a catalogue worker serves several); a worker
    // not up yet is waited for up to --worker-wait-secs.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(a.worker_wait_secs);
    let mut clients: Vec<Arc<dyn WorkerClient>> = Vec::new();
    let mut hosts: Vec<Arc<dyn ModelHostClient>> = Vec::new();
    for u in &a.workers {
        let found = loop {
            match HttpWorker::discover(u).await {
                Ok((ws, host)) => {
                    let host = host.map(|h| h.with_token(a.worker_token.clone()));
                    hosts.extend(host.map(|h| Arc::new(h) as Arc<dyn ModelHostClient>));
                    break ws
                        .into_iter()
                        .map(|w| w.with_token(a.worker_token.clone()))
                        .collect::<Vec<_>>();
                }
                Err(hearth_gateway::workers::WorkerError::Unavailable { .. })
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
    let workers = Workers {
        clients,
        wait: Duration::from_secs(a.worker_wait_secs),
        engines: None,
        hosts,
    };
    run_gateway(a.listen, &a.data, workers, a.admin_token, routing, &a.limits).await
}

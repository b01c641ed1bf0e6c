//! The `hearth` command line.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::{Args, Parser, Subcommand};
use hearth_billing::UsageLedger;
use hearth_engine::fetch::{ensure_model, hearth_home, DEFAULT_MODEL_ID};
use hearth_engine::sim::{sim_info, CostModel, SimHandle};
use hearth_engine::{Backend, EngineConfig, EngineHandle};
use hearth_platform::db;
use hearth_platform::gateway::{self, Gateway};
use hearth_platform::registry::{ModelRegistry, RoutingConfig};
use hearth_platform::workers::{HttpWorker, InProcessWorker, WorkerClient};
use hearth_router::Policy;
use hearth_tenants::TenantStore;

#[derive(Parser)]
#[command(name = "hearth", version, about = "Hearth: serverless multi-tenant LLM serving")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Gateway + one in-process engine worker + SQLite: everything in one process.
    Serve(ServeArgs),
    /// An engine worker serving one model over HTTP (for `hearth gateway --worker`).
    Worker(WorkerArgs),
    /// The API tier alone, dispatching to `hearth worker` processes.
    Gateway(GatewayArgs),
    /// Manage tenants, API keys and usage in the data directory.
    Admin(AdminArgs),
    /// Model files.
    Model {
        #[command(subcommand)]
        command: ModelCommand,
    },
    /// Benchmarks: print a table, optionally write JSON.
    Bench {
        #[command(subcommand)]
        command: BenchCommand,
    },
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Routing policies on simulated workers (virtual time), and the router micro-benchmark.
    Routing {
        #[arg(long, default_value_t = 7)]
        workers: usize,
        /// Fewer requests (finishes in seconds).
        #[arg(long)]
        quick: bool,
        #[arg(long, default_value_t = 42)]
        seed: u64,
        /// Write the results as JSON to this file (`-` for stdout).
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// The engine in-process: load, prefill, decode at 1/8/32 streams, cached TTFT, RSS.
    Engine {
        #[command(flatten)]
        model: ModelArgs,
        /// Shorter measurements (smoke runs).
        #[arg(long)]
        quick: bool,
        /// Write the results as JSON to this file (`-` for stdout).
        #[arg(long)]
        json: Option<PathBuf>,
    },
}

#[derive(Args, Clone)]
struct DataArgs {
    /// Holds the SQLite database and local state (default: ~/.local/share/hearth).
    #[arg(long, env = "HEARTH_DATA_DIR", global = true)]
    data_dir: Option<PathBuf>,
}

impl DataArgs {
    fn dir(&self) -> PathBuf {
        self.data_dir.clone().unwrap_or_else(db::default_data_dir)
    }
}

#[derive(Args, Clone)]
struct ModelArgs {
    /// A known model id (fetched into $HEARTH_HOME/models) or a path to a Llama GGUF file.
    #[arg(long, env = "HEARTH_MODEL", default_value = DEFAULT_MODEL_ID)]
    model: String,
    /// The id clients use for the model (default: the known id, or the file's stem).
    #[arg(long, env = "HEARTH_MODEL_ID")]
    model_id: Option<String>,
    /// Compute threads (default: all cores).
    #[arg(long, env = "HEARTH_THREADS")]
    threads: Option<usize>,
    /// KV cache size in MiB (default: a quarter of available memory, at most 1024).
    #[arg(long, env = "HEARTH_KV_CACHE_MIB")]
    kv_cache_mib: Option<usize>,
    /// Tokens per engine step, shared by decodes and prefill chunks.
    #[arg(long, env = "HEARTH_MAX_BATCH_TOKENS", default_value_t = 512)]
    max_batch_tokens: usize,
    /// Sequences decoded together.
    #[arg(long, env = "HEARTH_MAX_RUNNING", default_value_t = 64)]
    max_running: usize,
    /// Region label of the engine(s).
    #[arg(long, env = "HEARTH_REGION", default_value = "local")]
    region: String,
    /// `engine` (the real model) or `sim` (the real scheduler and caches, with a cost model
    /// instead of the maths; see `hearth_engine::sim`).
    #[arg(long, env = "HEARTH_BACKEND", default_value = "engine")]
    backend: String,
    /// For `--backend sim`: how many times faster than the cost model time runs.
    #[arg(long, default_value_t = 1.0)]
    sim_speedup: f64,
}

#[derive(Args, Clone)]
struct RoutingArgs {
    /// Routing policy: kv_aware (default), prefix_aware, least_outstanding, random; or
    /// MODEL=POLICY for one model (repeatable).
    #[arg(
        long = "routing-policy",
        env = "HEARTH_ROUTING_POLICY",
        value_delimiter = ',',
        default_value = "kv_aware"
    )]
    policies: Vec<String>,
}

impl RoutingArgs {
    fn config(&self, region: &str) -> anyhow::Result<RoutingConfig> {
        let mut cfg = RoutingConfig {
            region: region.to_string(),
            ..Default::default()
        };
        for p in &self.policies {
            let (model, name) = match p.split_once('=') {
                Some((m, n)) => (Some(m), n),
                None => (None, p.as_str()),
            };
            let policy = Policy::parse(name).ok_or_else(|| {
                anyhow::anyhow!("unknown routing policy {name:?} (kv_aware, prefix_aware, least_outstanding, random)")
            })?;
            match model {
                Some(m) => {
                    cfg.per_model.insert(m.to_string(), policy);
                }
                None => cfg.policy = policy,
            }
        }
        Ok(cfg)
    }
}

impl ModelArgs {
    fn engine_config(&self) -> EngineConfig {
        EngineConfig {
            threads: self
                .threads
                .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())),
            kv_cache_mib: self.kv_cache_mib,
            max_batch_tokens: self.max_batch_tokens,
            max_running: self.max_running,
            region: self.region.clone(),
        }
    }
}

#[derive(Args)]
struct ServeArgs {
    #[arg(long, env = "HEARTH_LISTEN", default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    #[command(flatten)]
    data: DataArgs,
    #[command(flatten)]
    model: ModelArgs,
    /// Enables the admin API (`/admin/v1`) for bearers of this token.
    #[arg(long, env = "HEARTH_ADMIN_TOKEN", hide_env_values = true)]
    admin_token: Option<String>,
    /// In-process engine workers (each with its own KV cache; threads are shared out).
    #[arg(long, env = "HEARTH_WORKERS_LOCAL", default_value_t = 1)]
    workers: usize,
    #[command(flatten)]
    routing: RoutingArgs,
}

#[derive(Args)]
struct WorkerArgs {
    #[arg(long, env = "HEARTH_LISTEN", default_value = "127.0.0.1:8081")]
    listen: SocketAddr,
    #[command(flatten)]
    model: ModelArgs,
}

#[derive(Args)]
struct GatewayArgs {
    #[arg(long, env = "HEARTH_LISTEN", default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    #[command(flatten)]
    data: DataArgs,
    /// A worker's base URL (repeat for several).
    #[arg(long = "worker", env = "HEARTH_WORKERS", value_delimiter = ',', required = true)]
    workers: Vec<String>,
    /// How long to wait for workers to come up at start.
    #[arg(long, default_value_t = 120)]
    worker_wait_secs: u64,
    /// This gateway's region (requests may override it with `x-hearth-region`).
    #[arg(long, env = "HEARTH_REGION", default_value = "local")]
    region: String,
    #[command(flatten)]
    routing: RoutingArgs,
    #[arg(long, env = "HEARTH_ADMIN_TOKEN", hide_env_values = true)]
    admin_token: Option<String>,
}

#[derive(Args)]
struct AdminArgs {
    #[command(flatten)]
    data: DataArgs,
    /// Print JSON instead of text.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: AdminCommand,
}

#[derive(Subcommand)]
enum AdminCommand {
    /// Tenants.
    Tenant {
        #[command(subcommand)]
        command: TenantCommand,
    },
    /// API keys.
    Key {
        #[command(subcommand)]
        command: KeyCommand,
    },
    /// Recent usage records.
    Usage {
        #[arg(long)]
        tenant: Option<String>,
        #[arg(long, default_value_t = 20)]
        limit: u32,
    },
}

/// Rate limits; 0 or absent means unlimited.
#[derive(Args, Clone, Copy)]
struct LimitArgs {
    /// Requests per minute.
    #[arg(long, default_value_t = 0)]
    rpm: u32,
    /// Tokens (prompt + completion) per minute.
    #[arg(long, default_value_t = 0)]
    tpm: u32,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 0)]
    concurrent: u32,
}

impl LimitArgs {
    fn limits(self) -> hearth_tenants::Limits {
        let some = |v: u32| (v > 0).then_some(v);
        hearth_tenants::Limits {
            rpm: some(self.rpm),
            tpm: some(self.tpm),
            concurrent: some(self.concurrent),
        }
    }
}

#[derive(Subcommand)]
enum TenantCommand {
    /// Create a tenant.
    Create { name: String },
    /// List tenants.
    List,
    /// Set a tenant's rate limits (running gateways apply them within 5 s).
    Limits {
        name: String,
        #[command(flatten)]
        limits: LimitArgs,
    },
}

#[derive(Subcommand)]
enum KeyCommand {
    /// Create an API key for a tenant; the key is printed once.
    Create {
        #[arg(long)]
        tenant: String,
        #[arg(long, default_value = "")]
        name: String,
    },
    /// List a tenant's keys (never the secrets).
    List {
        #[arg(long)]
        tenant: String,
    },
    /// Revoke a key by its id (or the full key).
    Revoke { key_id: String },
    /// Set a key's rate limits (on top of its tenant's).
    Limits {
        key_id: String,
        #[command(flatten)]
        limits: LimitArgs,
    },
}

#[derive(Subcommand)]
enum ModelCommand {
    /// Fetch a known model into $HEARTH_HOME/models and print its path.
    Fetch {
        #[arg(default_value = DEFAULT_MODEL_ID)]
        model: String,
    },
}

fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("HEARTH_LOG")
        .or_else(|_| tracing_subscriber::EnvFilter::try_from_default_env())
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,sqlx=warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    init_logging();
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async move {
        match cli.command {
            Command::Serve(a) => serve(a).await,
            Command::Worker(a) => worker(a).await,
            Command::Gateway(a) => gateway_cmd(a).await,
            Command::Admin(a) => admin(a).await,
            Command::Model {
                command: ModelCommand::Fetch { model },
            } => {
                let path = ensure_model(&model, &hearth_home(), &mut |m| eprintln!("{m}"))?;
                println!("{}", path.display());
                Ok(())
            }
            Command::Bench {
                command: BenchCommand::Engine { model, quick, json },
            } => bench_engine(model, quick, json).await,
            Command::Bench {
                command:
                    BenchCommand::Routing {
                        workers,
                        quick,
                        seed,
                        json,
                    },
            } => {
                let cfg = hearth_platform::routing_bench::RoutingBenchConfig {
                    workers: workers.clamp(1, 64),
                    quick,
                    seed,
                };
                let report = tokio::task::spawn_blocking(move || hearth_platform::routing_bench::run(cfg)).await?;
                print!("{}", report.table());
                write_json(&report, json)
            }
        }
    })
}

/// Resolves `--model` to a file (fetching a known model if needed) and the id to serve it as.
async fn resolve_model(args: &ModelArgs) -> anyhow::Result<(PathBuf, String)> {
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
            Ok(Arc::new(SimHandle::start(info, CostModel::default(), args.sim_speedup)))
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
        isa = ?hearth_engine::kernels::isa(),
        "engine ready"
    );
    Ok(engine)
}

async fn bench_engine(model: ModelArgs, quick: bool, json: Option<PathBuf>) -> anyhow::Result<()> {
    let (path, id) = resolve_model(&model).await?;
    let cfg = model.engine_config();
    let bench = hearth_engine::bench::BenchConfig {
        threads: cfg.threads,
        kv_cache_mib: cfg.kv_cache_mib,
        quick,
    };
    let report = hearth_engine::bench::run(&path, &id, &bench).await?;
    print!("{}", report.table());
    write_json(&report, json)
}

/// Text for a listing: one line per row, or `empty` when there are none.
fn lines(rows: impl IntoIterator<Item = String>, empty: &str) -> String {
    let v: Vec<String> = rows.into_iter().collect();
    if v.is_empty() {
        empty.to_string()
    } else {
        v.join("\n")
    }
}

fn write_json<T: serde::Serialize>(report: &T, dest: Option<PathBuf>) -> anyhow::Result<()> {
    if let Some(dest) = dest {
        let text = serde_json::to_string_pretty(report)?;
        if dest.as_os_str() == "-" {
            println!("{text}");
        } else {
            std::fs::write(&dest, text + "\n").with_context(|| format!("writing {}", dest.display()))?;
            println!("wrote {}", dest.display());
        }
    }
    Ok(())
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

async fn run_gateway(
    listen: SocketAddr,
    data_dir: &Path,
    workers: Vec<Arc<dyn WorkerClient>>,
    wait: Duration,
    admin_token: Option<String>,
    routing: RoutingConfig,
) -> anyhow::Result<()> {
    let pool = db::open(data_dir).await?;
    let models = ModelRegistry::discover(workers, wait, &routing).await?;
    let gw = Arc::new(Gateway {
        tenants: TenantStore::new(pool.clone()),
        ledger: UsageLedger::new(pool),
        models,
        admin_token: admin_token.filter(|t| !t.is_empty()),
        limiter: Default::default(),
    });
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("cannot listen on {listen}"))?;
    let addr = listener.local_addr()?;
    let served: Vec<String> = gw.models.all().map(|m| m.id.clone()).collect();
    tracing::info!(
        listen = %addr,
        data_dir = %data_dir.display(),
        models = ?served,
        admin_api = gw.admin_token.is_some(),
        "effective configuration"
    );
    println!("Hearth is listening on http://{addr} (models: {})", served.join(", "));
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
    axum::serve(listener, gateway::router(gw))
        .with_graceful_shutdown(shutdown_signal())
        .await?;
    Ok(())
}

async fn serve(a: ServeArgs) -> anyhow::Result<()> {
    let n = a.workers.clamp(1, 64);
    let mut model = a.model.clone();
    let total = model
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    model.threads = Some((total / n).max(1));
    let mut workers: Vec<Arc<dyn WorkerClient>> = Vec::new();
    for i in 0..n {
        let backend = load_backend(&model).await?;
        workers.push(Arc::new(InProcessWorker::new(backend, &format!("local-{i}"))));
    }
    let routing = a.routing.config(&a.model.region)?;
    run_gateway(a.listen, &a.data.dir(), workers, Duration::ZERO, a.admin_token, routing).await
}

async fn worker(a: WorkerArgs) -> anyhow::Result<()> {
    let engine = load_backend(&a.model).await?;
    let listener = tokio::net::TcpListener::bind(a.listen)
        .await
        .with_context(|| format!("cannot listen on {}", a.listen))?;
    let addr = listener.local_addr()?;
    println!("Hearth worker ({}) is listening on http://{addr}", engine.info().model);
    axum::serve(listener, hearth_engine::server::router(engine))
        .with_graceful_shutdown(shutdown_signal())
        .await?;
    Ok(())
}

async fn gateway_cmd(a: GatewayArgs) -> anyhow::Result<()> {
    let workers = a
        .workers
        .iter()
        .map(|u| HttpWorker::new(u).map(|w| Arc::new(w) as Arc<dyn WorkerClient>))
        .collect::<Result<Vec<_>, _>>()?;
    let routing = a.routing.config(&a.region)?;
    run_gateway(
        a.listen,
        &a.data.dir(),
        workers,
        Duration::from_secs(a.worker_wait_secs),
        a.admin_token,
        routing,
    )
    .await
}

async fn admin(a: AdminArgs) -> anyhow::Result<()> {
    let pool = db::open(&a.data.dir()).await?;
    let store = TenantStore::new(pool.clone());
    let json = a.json;
    let print = |v: serde_json::Value, text: String| {
        if json {
            println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
        } else {
            println!("{text}");
        }
    };
    match a.command {
        AdminCommand::Tenant {
            command: TenantCommand::Create { name },
        } => {
            let t = store.create_tenant(&name).await?;
            print(serde_json::json!(t), format!("Created tenant {} ({}).", t.name, t.id));
        }
        AdminCommand::Tenant {
            command: TenantCommand::List,
        } => {
            let ts = store.list_tenants().await?;
            let text = lines(ts.iter().map(|t| format!("{}\t{}", t.id, t.name)), "No tenants.");
            print(serde_json::json!(ts), text);
        }
        AdminCommand::Key {
            command: KeyCommand::Create { tenant, name },
        } => {
            let k = store.create_key(&tenant, &name).await?;
            print(
                serde_json::json!(k),
                format!(
                    "Created API key {} for tenant {}. Copy it now; it is not shown again:\n\n{}\n",
                    k.info.id, k.tenant, k.key
                ),
            );
        }
        AdminCommand::Key {
            command: KeyCommand::List { tenant },
        } => {
            let ks = store.list_keys(&tenant).await?;
            let state = |k: &hearth_tenants::ApiKeyInfo| if k.revoked_at.is_some() { "revoked" } else { "active" };
            let text = lines(
                ks.iter().map(|k| format!("{}\t{}\t{}", k.id, state(k), k.name)),
                "No keys.",
            );
            print(serde_json::json!(ks), text);
        }
        AdminCommand::Tenant {
            command: TenantCommand::Limits { name, limits },
        } => {
            let l = limits.limits();
            let t = store.set_tenant_limits(&name, l).await?;
            print(
                serde_json::json!({"tenant": t.name, "limits": l}),
                format!("Tenant {} limits: {l:?}.", t.name),
            );
        }
        AdminCommand::Key {
            command: KeyCommand::Limits { key_id, limits },
        } => {
            let l = limits.limits();
            store.set_key_limits(&key_id, l).await?;
            print(
                serde_json::json!({"key": key_id, "limits": l}),
                format!("Key {key_id} limits: {l:?}."),
            );
        }
        AdminCommand::Key {
            command: KeyCommand::Revoke { key_id },
        } => {
            let k = store.revoke_key(&key_id).await?;
            print(
                serde_json::json!(k),
                format!("Revoked key {} (running servers stop accepting it within 5 s).", k.id),
            );
        }
        AdminCommand::Usage { tenant, limit } => {
            let tenant_id = match tenant {
                Some(t) => Some(store.tenant(&t).await?.id),
                None => None,
            };
            let rows = UsageLedger::new(pool).recent(tenant_id.as_deref(), limit).await?;
            let text = lines(
                rows.iter().map(|r| {
                    format!(
                        "{}\t{}\t{}\tprompt={} cached={} completion={}\t{}",
                        r.request_id,
                        r.tenant_id,
                        r.model,
                        r.prompt_tokens,
                        r.cached_tokens,
                        r.completion_tokens,
                        r.status
                    )
                }),
                "No usage yet.",
            );
            print(serde_json::json!(rows), text);
        }
    }
    Ok(())
}

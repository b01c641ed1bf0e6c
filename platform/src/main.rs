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
use hearth_platform::limits::{Limiter, RedisLimiter};
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
    /// Manage tenants, API keys, JWT issuers, limits, budgets, prices and usage.
    Admin(AdminArgs),
    /// Tenant processors (WebAssembly components run on requests and responses).
    Processor(ProcessorArgs),
    /// Billing exports.
    Billing {
        #[command(subcommand)]
        command: BillingCommand,
    },
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
    /// Processor overhead per request (WAT, JavaScript, Python guests) and core scaling.
    Processors {
        #[command(flatten)]
        model: ModelArgs,
        /// Where `sdk/processors/build` put the JS/Python guests.
        #[arg(long, default_value = "target/processors")]
        examples: PathBuf,
        #[arg(long, default_value_t = 2000)]
        requests: usize,
        /// Fewer requests (smoke runs).
        #[arg(long)]
        quick: bool,
        /// Write the results as JSON to this file (`-` for stdout).
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Gateway overhead: auth, limits, budget and metering vs none, with an instant worker.
    Gateway {
        #[command(flatten)]
        model: ModelArgs,
        /// Sequential requests per mode (latency).
        #[arg(long, default_value_t = 3000)]
        requests: usize,
        /// Seconds of concurrent load per mode (throughput).
        #[arg(long, default_value_t = 5.0)]
        seconds: f64,
        #[arg(long, default_value_t = 32)]
        concurrency: usize,
        /// Also measure with the limits in Redis.
        #[arg(long, env = "HEARTH_REDIS_URL")]
        redis_url: Option<String>,
        /// Fewer requests (smoke runs).
        #[arg(long)]
        quick: bool,
        /// Write the results as JSON to this file (`-` for stdout).
        #[arg(long)]
        json: Option<PathBuf>,
    },
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
    /// A PostgreSQL database (postgres://…) instead of SQLite in the data directory.
    #[arg(long, env = "HEARTH_DATABASE_URL", global = true, hide_env_values = true)]
    database_url: Option<String>,
}

impl DataArgs {
    fn dir(&self) -> PathBuf {
        self.data_dir.clone().unwrap_or_else(db::default_data_dir)
    }

    async fn open(&self) -> anyhow::Result<hearth_tenants::Db> {
        db::open(&self.dir(), self.database_url.as_deref()).await
    }
}

/// Where rate limits are counted, and where compiled processors are cached.
#[derive(Args, Clone)]
struct LimitStoreArgs {
    /// Compiled processor code, by content hash (default: DATA_DIR/processors).
    #[arg(long, env = "HEARTH_PROCESSOR_CACHE")]
    processor_cache: Option<PathBuf>,
    /// Count rate limits in Redis (redis://HOST:PORT), shared by every gateway using it;
    /// without it each gateway counts alone.
    #[arg(long, env = "HEARTH_REDIS_URL", hide_env_values = true)]
    redis_url: Option<String>,
    /// Prefix of Hearth's Redis keys.
    #[arg(long, env = "HEARTH_REDIS_PREFIX", default_value = "hearth:")]
    redis_prefix: String,
}

impl LimitStoreArgs {
    async fn limiter(&self) -> anyhow::Result<Limiter> {
        match self.redis_url.as_deref().filter(|u| !u.is_empty()) {
            None => Ok(Limiter::default()),
            Some(url) => Ok(Limiter::with_redis(
                RedisLimiter::connect(url, &self.redis_prefix).await?,
            )),
        }
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
    #[command(flatten)]
    limits: LimitStoreArgs,
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
    #[command(flatten)]
    limits: LimitStoreArgs,
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
    /// JWT issuers: a tenant's identity providers.
    Jwt {
        #[command(subcommand)]
        command: JwtCommand,
    },
    /// Model prices (versioned: a change never rewrites history).
    Price {
        #[command(subcommand)]
        command: PriceCommand,
    },
    /// Recent usage records.
    Usage {
        #[arg(long)]
        tenant: Option<String>,
        #[arg(long, default_value_t = 20)]
        limit: u32,
    },
}

#[derive(Subcommand)]
enum JwtCommand {
    /// Register an issuer: tokens with this `iss`, `aud` and algorithm act for the tenant.
    Add {
        #[arg(long)]
        tenant: String,
        /// The `iss` claim.
        #[arg(long)]
        issuer: String,
        /// The `aud` claim Hearth requires.
        #[arg(long)]
        audience: String,
        /// The one accepted algorithm: HS256/384/512, RS256/384/512, PS256/384/512, ES256/384, EdDSA.
        #[arg(long)]
        algorithm: String,
        /// A PEM public key, or (HS*) a file holding the shared secret.
        #[arg(long)]
        key_file: Option<PathBuf>,
        /// A JWKS document.
        #[arg(long)]
        jwks_file: Option<PathBuf>,
        /// A JWKS URL (fetched and cached for 5 minutes).
        #[arg(long)]
        jwks_url: Option<String>,
    },
    /// List issuers.
    List {
        #[arg(long)]
        tenant: Option<String>,
    },
    /// Remove an issuer (its tokens stop working within seconds).
    Remove { id: String },
}

#[derive(Subcommand)]
enum PriceCommand {
    /// Add a price version for a model (`*`: the default for unpriced models). USD per
    /// million tokens.
    Set {
        #[arg(long)]
        model: String,
        #[arg(long)]
        input: String,
        #[arg(long)]
        cached_input: String,
        #[arg(long)]
        output: String,
        /// When it takes effect: YYYY-MM-DD (UTC) or Unix ms; default now (the first price
        /// of a model covers all time).
        #[arg(long)]
        effective_from: Option<String>,
    },
    /// List price versions.
    List {
        #[arg(long)]
        model: Option<String>,
    },
}

#[derive(Args)]
struct ProcessorArgs {
    #[command(flatten)]
    data: DataArgs,
    /// Print JSON instead of text.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: ProcessorCommand,
}

#[derive(Subcommand)]
enum ProcessorCommand {
    /// Validate, precompile and store a new version of a processor.
    Upload {
        #[arg(long)]
        tenant: String,
        #[arg(long)]
        name: String,
        /// The component (.wasm).
        file: PathBuf,
        /// JSON for the guest's `host.config`, or @FILE.
        #[arg(long)]
        config: Option<String>,
        /// Make this the active version at once.
        #[arg(long)]
        activate: bool,
        /// Run only on this API key's requests (default: every request of the tenant).
        #[arg(long)]
        key: Option<String>,
        /// Order among the tenant's processors (pre ascending, post descending).
        #[arg(long)]
        position: Option<i64>,
        /// CPU per call, ms (≤ 1000).
        #[arg(long, default_value_t = 50)]
        cpu_ms: u32,
        /// Memory of the instance, MiB (≤ 256).
        #[arg(long, default_value_t = 128)]
        memory_mib: u32,
    },
    /// List a tenant's processors (every version).
    List {
        #[arg(long)]
        tenant: String,
    },
    /// Make a version the active one of its name.
    Activate { id: String },
    /// Stop running a version.
    Deactivate { id: String },
    /// Run a version only on one key's requests, or (`--tenant-wide`) on all.
    Attach {
        id: String,
        #[arg(long, conflicts_with = "tenant_wide")]
        key: Option<String>,
        #[arg(long)]
        tenant_wide: bool,
    },
    /// Delete a version.
    Delete { id: String },
    /// Print the WIT of the `hearth:processor` world.
    Wit,
    /// Build a component from a WebAssembly text core module (see `sdk/processors`).
    BuildWat {
        file: PathBuf,
        #[arg(short, long)]
        out: PathBuf,
    },
}

#[derive(Subcommand)]
enum BillingCommand {
    /// Export a tenant's usage: per request or per day and model, CSV, JSON Lines or Parquet.
    /// Totals go to stderr.
    Export {
        #[command(flatten)]
        data: DataArgs,
        #[arg(long)]
        tenant: String,
        /// First day (YYYY-MM-DD, UTC, inclusive) or Unix ms.
        #[arg(long)]
        from: String,
        /// End (YYYY-MM-DD, exclusive) or Unix ms; default: now.
        #[arg(long)]
        to: Option<String>,
        /// csv, jsonl or parquet.
        #[arg(long, default_value = "csv")]
        format: String,
        /// request or day.
        #[arg(long, default_value = "request")]
        granularity: String,
        /// Write here instead of stdout.
        #[arg(long)]
        out: Option<PathBuf>,
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
    /// Set a tenant's monthly budget in USD (0 removes it).
    Budget {
        name: String,
        #[arg(long)]
        monthly_usd: String,
        /// Warn (x-hearth-budget-warning) instead of refusing once spent.
        #[arg(long)]
        soft: bool,
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
        /// inference, manage, or both (default: both).
        #[arg(long, default_value = "inference,manage")]
        scopes: String,
        /// Restrict the key to these models (comma-separated).
        #[arg(long, value_delimiter = ',')]
        models: Option<Vec<String>>,
        /// Expire the key after this long: 90s, 30m, 12h, 30d.
        #[arg(long)]
        expires_in: Option<String>,
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
            Command::Billing { command } => billing(command).await,
            Command::Processor(a) => processor(a).await,
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
                    BenchCommand::Processors {
                        model,
                        examples,
                        requests,
                        quick,
                        json,
                    },
            } => {
                let (path, id) = resolve_model(&model).await?;
                let examples = examples.exists().then_some(examples);
                let (requests, seconds) = if quick { (200, 0.5) } else { (requests.max(20), 2.0) };
                let report =
                    hearth_platform::processor_bench::run(examples.as_deref(), &path, &id, requests, seconds).await?;
                print!("{}", report.table());
                write_json(&report, json)
            }
            Command::Bench {
                command:
                    BenchCommand::Gateway {
                        model,
                        requests,
                        seconds,
                        concurrency,
                        redis_url,
                        quick,
                        json,
                    },
            } => {
                let (path, id) = resolve_model(&model).await?;
                let cfg = hearth_platform::gateway_bench::GatewayBenchConfig {
                    requests: if quick { 300 } else { requests.max(10) },
                    seconds: if quick { 1.0 } else { seconds.max(0.5) },
                    concurrency: concurrency.clamp(1, 1024),
                    redis_url: redis_url.filter(|u| !u.is_empty()),
                };
                let report = hearth_platform::gateway_bench::run(&path, &id, cfg).await?;
                print!("{}", report.table());
                write_json(&report, json)
            }
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
    data: &DataArgs,
    workers: Vec<Arc<dyn WorkerClient>>,
    wait: Duration,
    admin_token: Option<String>,
    routing: RoutingConfig,
    limits: &LimitStoreArgs,
) -> anyhow::Result<()> {
    let data_dir = data.dir();
    let db = data.open().await?;
    let limiter = limits.limiter().await?;
    let models = ModelRegistry::discover(workers, wait, &routing).await?;
    let gw = Arc::new(Gateway {
        tenants: TenantStore::new(&db),
        ledger: UsageLedger::with_outbox(&db, &data_dir).await?,
        models,
        admin_token: admin_token.filter(|t| !t.is_empty()),
        limiter,
        budgets: Default::default(),
        processors: Some(hearth_platform::processors::ProcessorHost {
            runtime: Arc::new(hearth_runtime::Runtime::new(Some(
                limits
                    .processor_cache
                    .clone()
                    .unwrap_or_else(|| data_dir.join("processors")),
            ))?),
        }),
        bench_unmetered: false,
    });
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("cannot listen on {listen}"))?;
    let addr = listener.local_addr()?;
    let served: Vec<String> = gw.models.all().map(|m| m.id.clone()).collect();
    tracing::info!(
        listen = %addr,
        data_dir = %data_dir.display(),
        database = db.backend.as_str(),
        rate_limits = if gw.limiter.shared() { "redis" } else { "in-process" },
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
    run_gateway(
        a.listen,
        &a.data,
        workers,
        Duration::ZERO,
        a.admin_token,
        routing,
        &a.limits,
    )
    .await
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
        &a.data,
        workers,
        Duration::from_secs(a.worker_wait_secs),
        a.admin_token,
        routing,
        &a.limits,
    )
    .await
}

/// `YYYY-MM-DD` (UTC midnight) or Unix milliseconds.
fn parse_time(s: &str) -> anyhow::Result<i64> {
    if let Ok(ms) = s.parse::<i64>() {
        return Ok(ms);
    }
    hearth_billing::parse_day(s).ok_or_else(|| anyhow::anyhow!("{s:?} is neither YYYY-MM-DD nor Unix milliseconds"))
}

/// `90s`, `30m`, `12h`, `30d` → milliseconds.
fn parse_duration_ms(s: &str) -> anyhow::Result<i64> {
    let (n, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let n: i64 = n
        .parse()
        .map_err(|_| anyhow::anyhow!("bad duration {s:?}: use 90s, 30m, 12h or 30d"))?;
    let mult = match unit {
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" | "" => 86_400_000,
        _ => bail!("bad duration {s:?}: use 90s, 30m, 12h or 30d"),
    };
    n.checked_mul(mult)
        .filter(|v| *v > 0)
        .ok_or_else(|| anyhow::anyhow!("bad duration {s:?}"))
}

fn usd(s: &str, what: &str) -> anyhow::Result<i64> {
    hearth_billing::parse_usd_micros(s).ok_or_else(|| anyhow::anyhow!("{what}: {s:?} is not a USD amount like 0.15"))
}

async fn processor(a: ProcessorArgs) -> anyhow::Result<()> {
    let json = a.json;
    let show = |p: &hearth_tenants::processors::ProcessorInfo| {
        format!(
            "{}\t{} v{}\t{}\t{}\tposition {}\t{} bytes\tcpu {} ms, memory {} MiB\tsha256 {}",
            p.id,
            p.name,
            p.version,
            if p.active { "active" } else { "inactive" },
            p.key_id
                .as_deref()
                .map_or("tenant-wide".to_string(), |k| format!("key {k}")),
            p.position,
            p.size,
            p.cpu_ms,
            p.memory_mib,
            &p.sha256[..12]
        )
    };
    let print = |v: serde_json::Value, text: String| {
        if json {
            println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
        } else {
            println!("{text}");
        }
    };
    match a.command {
        ProcessorCommand::Wit => {
            print!("{}", hearth_runtime::WIT);
            return Ok(());
        }
        ProcessorCommand::BuildWat { file, out } => {
            let text = std::fs::read_to_string(&file).with_context(|| format!("reading {}", file.display()))?;
            let wasm = hearth_runtime::wat_guest::component(&text)?;
            std::fs::write(&out, &wasm).with_context(|| format!("writing {}", out.display()))?;
            println!("{}: {} bytes", out.display(), wasm.len());
            return Ok(());
        }
        _ => {}
    }
    let db = a.data.open().await?;
    let store = TenantStore::new(&db);
    match a.command {
        ProcessorCommand::Upload {
            tenant,
            name,
            file,
            config,
            activate,
            key,
            position,
            cpu_ms,
            memory_mib,
        } => {
            let wasm = std::fs::read(&file).with_context(|| format!("reading {}", file.display()))?;
            let config = match config {
                Some(c) if c.starts_with('@') => {
                    std::fs::read_to_string(&c[1..]).with_context(|| format!("reading {}", &c[1..]))?
                }
                Some(c) => c,
                None => "{}".into(),
            };
            let limits = hearth_runtime::Limits {
                cpu_ms,
                memory_mib,
                ..Default::default()
            }
            .clamped();
            // Compiling here validates the upload and fills the data dir's code cache that
            // gateways on this machine share.
            let cache = std::env::var_os("HEARTH_PROCESSOR_CACHE")
                .map(PathBuf::from)
                .unwrap_or_else(|| a.data.dir().join("processors"));
            let rt = hearth_runtime::Runtime::new(Some(cache))?;
            let bytes = wasm.clone();
            let compiled = tokio::task::spawn_blocking(move || rt.compile(&bytes)).await??;
            let spec = hearth_tenants::processors::ProcessorSpec {
                name,
                sha256: compiled.sha256.clone(),
                config,
                cpu_ms: limits.cpu_ms,
                memory_mib: limits.memory_mib,
                key_id: key,
                position,
                activate,
            };
            let p = store.add_processor(&tenant, &spec, &wasm).await?;
            print(serde_json::json!(p), format!("Uploaded {}", show(&p)));
        }
        ProcessorCommand::List { tenant } => {
            let ps = store.list_processors(&tenant).await?;
            print(serde_json::json!(ps), lines(ps.iter().map(show), "No processors."));
        }
        ProcessorCommand::Activate { id } => {
            let p = store.set_processor_active(&id, true).await?;
            print(
                serde_json::json!(p),
                format!("Activated {} (gateways follow within 5 s).", show(&p)),
            );
        }
        ProcessorCommand::Deactivate { id } => {
            let p = store.set_processor_active(&id, false).await?;
            print(serde_json::json!(p), format!("Deactivated {}.", show(&p)));
        }
        ProcessorCommand::Attach { id, key, tenant_wide } => {
            if key.is_none() && !tenant_wide {
                bail!("give --key KEY_ID or --tenant-wide");
            }
            let p = store.attach_processor(&id, key.as_deref()).await?;
            print(serde_json::json!(p), format!("Attached {}.", show(&p)));
        }
        ProcessorCommand::Delete { id } => {
            let p = store.delete_processor(&id).await?;
            print(serde_json::json!(p), format!("Deleted {}.", show(&p)));
        }
        ProcessorCommand::Wit | ProcessorCommand::BuildWat { .. } => unreachable!("handled above"),
    }
    Ok(())
}

async fn billing(command: BillingCommand) -> anyhow::Result<()> {
    let BillingCommand::Export {
        data,
        tenant,
        from,
        to,
        format,
        granularity,
        out,
    } = command;
    use hearth_billing::export::{render, Format, Granularity};
    let format = Format::parse(&format).ok_or_else(|| anyhow::anyhow!("--format: csv, jsonl or parquet"))?;
    let granularity =
        Granularity::parse(&granularity).ok_or_else(|| anyhow::anyhow!("--granularity: request or day"))?;
    let from = parse_time(&from)?;
    let to = match to {
        Some(t) => parse_time(&t)?,
        None => hearth_tenants::now_ms() + 1,
    };
    if to <= from {
        bail!("--to must be after --from");
    }
    let db = data.open().await?;
    let t = TenantStore::new(&db).tenant(&tenant).await?;
    let rows = {
        let l = UsageLedger::new(&db);
        l.recover_dir(&data.dir()).await?;
        l
    }
    .rows(&t.id, from, to)
    .await?;
    let e = render(&rows, format, granularity)?;
    match out {
        Some(path) => std::fs::write(&path, &e.bytes).with_context(|| format!("writing {}", path.display()))?,
        None => {
            use std::io::Write;
            std::io::stdout().write_all(&e.bytes)?;
        }
    }
    let tt = &e.totals;
    eprintln!(
        "{} lines; {} requests; tokens: {} uncached input, {} cached input, {} output; cost ${} (input ${}, cached ${}, output ${})",
        e.lines,
        tt.requests,
        tt.uncached_input_tokens,
        tt.cached_input_tokens,
        tt.output_tokens,
        hearth_billing::format_nusd(tt.cost_nusd),
        hearth_billing::format_nusd(tt.cost_input_nusd),
        hearth_billing::format_nusd(tt.cost_cached_nusd),
        hearth_billing::format_nusd(tt.cost_output_nusd),
    );
    Ok(())
}

async fn admin(a: AdminArgs) -> anyhow::Result<()> {
    let db = a.data.open().await?;
    let store = TenantStore::new(&db);
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
            command:
                KeyCommand::Create {
                    tenant,
                    name,
                    scopes,
                    models,
                    expires_in,
                },
        } => {
            let spec = hearth_tenants::KeySpec {
                name,
                scopes: Some(hearth_tenants::Scopes::parse(&scopes)?),
                models,
                expires_at: match expires_in {
                    Some(d) => Some(hearth_tenants::now_ms() + parse_duration_ms(&d)?),
                    None => None,
                },
            };
            let k = store.create_key(&tenant, &spec).await?;
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
        AdminCommand::Tenant {
            command:
                TenantCommand::Budget {
                    name,
                    monthly_usd,
                    soft,
                },
        } => {
            let micros = usd(&monthly_usd, "--monthly-usd")?;
            let b = (micros > 0).then_some(hearth_tenants::Budget {
                monthly_nusd: micros * 1000,
                hard: !soft,
            });
            let t = store.set_budget(&name, b).await?;
            let text = match b {
                Some(b) => format!(
                    "Tenant {} budget: ${} per month ({}).",
                    t.name,
                    hearth_billing::format_nusd(b.monthly_nusd),
                    if b.hard { "hard" } else { "soft" }
                ),
                None => format!("Tenant {} has no budget.", t.name),
            };
            print(serde_json::json!({"tenant": t.name, "budget": b}), text);
        }
        AdminCommand::Jwt {
            command:
                JwtCommand::Add {
                    tenant,
                    issuer,
                    audience,
                    algorithm,
                    key_file,
                    jwks_file,
                    jwks_url,
                },
        } => {
            let read = |p: Option<PathBuf>| -> anyhow::Result<Option<String>> {
                p.map(|p| std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display())))
                    .transpose()
            };
            let key = read(key_file)?.map(|k| {
                if algorithm.starts_with("HS") {
                    k.trim().to_string()
                } else {
                    k
                }
            });
            let spec = hearth_tenants::jwt::IssuerSpec {
                issuer,
                audience,
                algorithm,
                key,
                jwks: read(jwks_file)?,
                jwks_url,
            };
            let i = store.add_issuer(&tenant, &spec).await?;
            print(
                serde_json::json!(i),
                format!(
                    "Registered JWT issuer {} ({}, {}) as {}.",
                    i.issuer, i.algorithm, i.key_source, i.id
                ),
            );
        }
        AdminCommand::Jwt {
            command: JwtCommand::List { tenant },
        } => {
            let is = store.list_issuers(tenant.as_deref()).await?;
            let text = lines(
                is.iter().map(|i| {
                    format!(
                        "{}\t{}\t{}\taud={}\t{}\t{}",
                        i.id, i.tenant_id, i.issuer, i.audience, i.algorithm, i.key_source
                    )
                }),
                "No JWT issuers.",
            );
            print(serde_json::json!(is), text);
        }
        AdminCommand::Jwt {
            command: JwtCommand::Remove { id },
        } => {
            let i = store.remove_issuer(&id).await?;
            print(
                serde_json::json!(i),
                format!("Removed JWT issuer {} ({}).", i.id, i.issuer),
            );
        }
        AdminCommand::Price {
            command:
                PriceCommand::Set {
                    model,
                    input,
                    cached_input,
                    output,
                    effective_from,
                },
        } => {
            let rates = hearth_billing::PriceRates {
                input_micros_per_mtok: usd(&input, "--input")?,
                cached_input_micros_per_mtok: usd(&cached_input, "--cached-input")?,
                output_micros_per_mtok: usd(&output, "--output")?,
            };
            let from = effective_from.as_deref().map(parse_time).transpose()?;
            let p = UsageLedger::new(&db).set_price(&model, rates, from).await?;
            print(
                serde_json::json!(p),
                format!("Price for {} from {}: {:?}.", p.model, p.effective_from, p.rates),
            );
        }
        AdminCommand::Price {
            command: PriceCommand::List { model },
        } => {
            let ps = UsageLedger::new(&db).prices(model.as_deref()).await?;
            let m = |v: i64| hearth_billing::format_nusd(v * 1000);
            let text = lines(
                ps.iter().map(|p| {
                    format!(
                        "{}\tfrom {}\tinput ${}\tcached ${}\toutput ${} per 1M tokens",
                        p.model,
                        p.effective_from,
                        m(p.rates.input_micros_per_mtok),
                        m(p.rates.cached_input_micros_per_mtok),
                        m(p.rates.output_micros_per_mtok)
                    )
                }),
                "No prices.",
            );
            print(serde_json::json!(ps), text);
        }
        AdminCommand::Usage { tenant, limit } => {
            let tenant_id = match tenant {
                Some(t) => Some(store.tenant(&t).await?.id),
                None => None,
            };
            let ledger = UsageLedger::new(&db);
            ledger.recover_dir(&a.data.dir()).await?;
            let rows = ledger.recent(tenant_id.as_deref(), limit).await?;
            let text = lines(
                rows.iter().map(|r| {
                    format!(
                        "{}\t{}\t{}\tprompt={} cached={} completion={}\t{}\t${}",
                        r.rec.request_id,
                        r.rec.tenant_id,
                        r.rec.model,
                        r.rec.prompt_tokens,
                        r.rec.cached_tokens,
                        r.rec.completion_tokens,
                        r.rec.status,
                        hearth_billing::format_nusd(r.cost.total_nusd)
                    )
                }),
                "No usage yet.",
            );
            print(serde_json::json!(rows), text);
        }
    }
    Ok(())
}

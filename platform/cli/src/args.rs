//! The command line's shape: every subcommand and flag (clap derive), with the environment
//! variables that override them. What each command does lives in the other modules.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};
use hearth_engine::formats::fetch::DEFAULT_MODEL_ID;
use hearth_engine::kernels::Isa;
use hearth_engine::kv::pool::KvDtype;
use hearth_engine::EngineConfig;

fn parse_isa(s: &str) -> Result<Isa, String> {
    Isa::parse(s).map_err(|e| e.to_string())
}
use hearth_gateway::policy::limits::{Limiter, RedisLimiter};
use hearth_gateway::server::db;
use hearth_gateway::upstream::registry::RoutingConfig;
use hearth_router::Policy;

#[derive(Parser)]
#[command(name = "hearth", version, about = "Hearth: serverless multi-tenant LLM serving")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
    /// Export trace spans over OTLP/HTTP (JSON) to this collector base URL
    /// (`http://HOST:4318`; spans go to `/v1/traces`). Off when unset.
    #[arg(long, global = true, env = "HEARTH_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
}

// Parsed once at start: the size of the largest variant (`serve`'s flags) does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
pub enum Command {
    /// Gateway + one in-process engine worker + SQLite: everything in one process.
    Serve(ServeArgs),
    /// An engine worker serving one model over HTTP (for `hearth gateway --worker`).
    Worker(WorkerArgs),
    /// The API tier alone, dispatching to `hearth worker` processes.
    Gateway(GatewayArgs),
    /// Manage tenants, API keys, JWT issuers, limits, budgets, prices and usage: on the
    /// database, or through a running gateway with `--gateway-url` and the admin token.
    Admin(AdminArgs),
    /// Tenant processors (WebAssembly components run on requests and responses).
    Processor(ProcessorArgs),
    /// Billing exports (from the database, or a gateway with `--gateway-url`).
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
    /// The book's generated references, printed as Markdown.
    Docs {
        #[command(subcommand)]
        command: DocsCommand,
    },
}

#[derive(Subcommand)]
pub enum DocsCommand {
    /// Every command's flags with their environment variables, defaults and help.
    Config,
    /// Every Prometheus metric of the gateway and the engine, with type, labels and help.
    Metrics,
    /// The OpenAPI 3.1 document of the public and self-service API (`/openapi.json`).
    Openapi {
        /// The admin API's document instead (`/admin/v1/openapi.json`).
        #[arg(long)]
        admin: bool,
    },
    /// Both OpenAPI documents rendered as the book's API reference (Markdown).
    Api,
}

#[derive(Subcommand)]
pub enum BenchCommand {
    /// Processor overhead per request (WAT, JavaScript, Python guests) and core scaling.
    Processors {
        #[command(flatten)]
        model: ModelArgs,
        /// Where `sdk/processors/build` put the JS/Python guests.
        #[arg(long, default_value = "target/processors")]
        examples: PathBuf,
        /// Requests per guest and mode.
        #[arg(long, default_value_t = 2000)]
        requests: usize,
        /// Fewer requests (smoke runs).
        #[arg(long)]
        quick: bool,
        /// Write the results as JSON to this file (`-` for stdout).
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Hours of mixed traffic (chat, streams, abandoned streams, tool calls, schemas,
    /// completions, a processor, malformed requests) through a real gateway and worker,
    /// sampling memory, file descriptors and tasks: what leaks shows as growth.
    Soak {
        #[command(flatten)]
        model: ModelArgs,
        /// How long the traffic runs.
        #[arg(long, default_value_t = 30.0)]
        minutes: f64,
        /// Clients sending requests back to back.
        #[arg(long, default_value_t = 6)]
        concurrency: usize,
        /// Seconds between samples.
        #[arg(long, default_value_t = 30.0)]
        sample_secs: f64,
        /// Seed of the generated workload (the same seed, the same requests).
        #[arg(long, default_value_t = 42)]
        seed: u64,
        /// Write the results as JSON to this file (`-` for stdout).
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// A large batch (OpenAI Batch API) beside interactive load on one engine: the batch's
    /// share of the idle capacity, and the interactive TTFT with and without it.
    Batch {
        #[command(flatten)]
        model: ModelArgs,
        /// Lines in the batch.
        #[arg(long, default_value_t = 2000)]
        lines: usize,
        /// Completion tokens per request (batch lines and interactive requests alike).
        #[arg(long, default_value_t = 8)]
        max_tokens: u32,
        /// Batch lines run at once (the gateway's `--batch-concurrency`).
        #[arg(long, default_value_t = 4)]
        concurrency: usize,
        /// Clients that measure the engine's capacity (enough to fill its batch).
        #[arg(long, default_value_t = 16)]
        capacity_clients: usize,
        /// The interactive load's rate, as a share of the measured capacity.
        #[arg(long, default_value_t = 0.3)]
        interactive_share: f64,
        /// Length of the capacity and the interactive-alone phases, seconds.
        #[arg(long, default_value_t = 30.0)]
        seconds: f64,
        /// Seed of the interactive arrivals.
        #[arg(long, default_value_t = 42)]
        seed: u64,
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
        /// Concurrent clients for the throughput measurement.
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
    /// Fairness between tenants on one saturated worker: a steady tenant beside a flooder,
    /// shares 3:1, interactive beside batch; FIFO vs fair, sim (virtual time) then engine.
    Fairness {
        #[command(flatten)]
        model: ModelArgs,
        /// Seconds of arrivals per sim run (virtual).
        #[arg(long, default_value_t = 240.0)]
        sim_seconds: f64,
        /// The steady tenant's requests per second (sim).
        #[arg(long, default_value_t = 1.0)]
        steady_rps: f64,
        /// The flooder's rate as a multiple of the steady tenant's.
        #[arg(long, default_value_t = 20.0)]
        flood: f64,
        /// The steady tenant's requests on the engine, solo and fair (each in four blocks,
        /// so rounded up to a multiple of four, at least 20; FIFO, the comparison, runs a
        /// quarter of them). `--quick`: 20, a smoke run.
        #[arg(long, default_value_t = 200)]
        engine_requests: usize,
        /// The share of the engine's time the steady tenant's requests take (Poisson
        /// arrivals at this share ÷ one request's time alone, measured first): a tenant well
        /// inside its fair share on any CPU. The engine runs take about 450 requests at
        /// that rate: a lower share, proportionally longer.
        #[arg(long, default_value_t = 0.25)]
        engine_steady_load: f64,
        /// The steady tenant's rate on the engine instead, requests per second (the earlier
        /// figures used 2.5); the request alone is still timed, to report the load.
        #[arg(long)]
        engine_steady_rps: Option<f64>,
        /// How the sim times a step that both prefills and decodes: `overlap` (the longer
        /// of the two, as one batched GPU pass does) or `sum` (the model of the earlier
        /// published figures).
        #[arg(long, default_value = "overlap", value_parser = ["overlap", "sum"])]
        step_cost: String,
        /// Skip the real-engine run.
        #[arg(long)]
        sim_only: bool,
        /// Seed of the generated workload (the same seed, the same requests).
        #[arg(long, default_value_t = 42)]
        seed: u64,
        /// Shorter runs (smoke).
        #[arg(long)]
        quick: bool,
        /// Write the results as JSON to this file (`-` for stdout).
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Agent workloads on the engine: JSON-schema extraction, tool-call turns, document edits
    /// and open chat, decode tokens/s with and without speculative decoding, acceptance,
    /// the grammar mask's cost at batch 8 and schema validity.
    Agent {
        #[command(flatten)]
        model: ModelArgs,
        /// Requests per workload (each run with and without speculation).
        #[arg(long, default_value_t = 8)]
        requests: usize,
        /// Constrained requests at temperature 1.0 (eight at a time) for the mask and validity.
        #[arg(long, default_value_t = 32)]
        seeds: usize,
        /// Seed of the generated workload (the same seed, the same requests).
        #[arg(long, default_value_t = 42)]
        seed: u64,
        /// Fewer requests (smoke).
        #[arg(long)]
        quick: bool,
        /// Write the results as JSON to this file (`-` for stdout).
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Routing policies on simulated workers (virtual time), and the router micro-benchmark.
    Routing {
        /// Simulated workers.
        #[arg(long, default_value_t = 7)]
        workers: usize,
        /// Fewer requests (finishes in seconds).
        #[arg(long)]
        quick: bool,
        /// Seed of the generated workload (the same seed, the same requests).
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
        /// Let decoding speculate (prompt-lookup drafts; off: one token per forward pass,
        /// as llama.cpp decodes).
        #[arg(long)]
        speculative: bool,
        /// Write the results as JSON to this file (`-` for stdout).
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Tokenization: Hearth's tokenizer against Hugging Face's `tokenizers` on the model's
    /// vocabulary (encode and decode throughput, identical ids), one thread.
    Tokenizer {
        #[command(flatten)]
        model: ModelArgs,
        /// A smaller corpus and shorter timing (smoke runs).
        #[arg(long)]
        quick: bool,
        /// Write the results as JSON to this file (`-` for stdout).
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Cold start: a request for an unloaded model → first token, against reading the file
    /// plus one prefill; with and without the pack cache, page cache warm and dropped.
    Coldstart {
        #[command(flatten)]
        model: ModelArgs,
        /// Prompt length.
        #[arg(long, default_value_t = 128)]
        prompt_tokens: usize,
        /// Write the results as JSON to this file (`-` for stdout).
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Prefill/decode disaggregation vs colocated serving at equal worker count, under steady
    /// short streams plus bursts of long prompts: real worker processes, then sim workers.
    Pd {
        #[command(flatten)]
        model: ModelArgs,
        /// Seconds of load per mode (real engines).
        #[arg(long, default_value_t = 60.0)]
        seconds: f64,
        /// Steady short-prompt streams.
        #[arg(long, default_value_t = 4)]
        streams: usize,
        /// Tokens each short request generates.
        #[arg(long, default_value_t = 64)]
        short_tokens: u32,
        /// Words in a long prompt (a few more tokens).
        #[arg(long, default_value_t = 500)]
        long_words: usize,
        /// Seconds between bursts of long prompts.
        #[arg(long, default_value_t = 3.5)]
        burst_every: f64,
        /// The workers' tokens per engine step (decodes and prefill chunks): how long one
        /// prefill chunk stalls the decodes it shares a step with.
        #[arg(long, default_value_t = 16)]
        step_tokens: usize,
        /// Long prompts per burst.
        #[arg(long, default_value_t = 1)]
        burst: usize,
        /// The gateway's `--pd-threshold`.
        #[arg(long, default_value_t = 256)]
        threshold: usize,
        /// The sim's KV transfer rate in GB/s (default: the loopback rate `hearth bench
        /// kv-transfer` measured before the one-copy path, kept so that runs compare; it
        /// measures 1.1–1.4 GB/s now).
        #[arg(long, default_value_t = 0.5)]
        sim_transfer_gbs: f64,
        /// Disaggregated mode's threads for the prefill and the decode worker, as
        /// `PREFILL:DECODE` (default: half of `--threads` each, as each colocated worker
        /// has).
        #[arg(long, value_parser = parse_thread_split)]
        pd_threads: Option<(usize, usize)>,
        /// Disaggregated mode's decode worker: its `--max-running` (a cap on its batch;
        /// default: the worker's own).
        #[arg(long)]
        decode_max_running: Option<usize>,
        /// Shorter runs (smoke).
        #[arg(long)]
        quick: bool,
        /// Write the results as JSON to this file (`-` for stdout).
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// A model's first-ever load (no pack anywhere, page cache warm: parsed and repacked in
    /// memory), several rounds, with the repacking rate; and a prepared pack's cold start
    /// (page cache dropped) against reading its bytes at the drive's measured rate
    /// (`bench/load-compare` runs it beside llama.cpp's load of the same file).
    Load {
        #[command(flatten)]
        model: ModelArgs,
        /// Load rounds (the median is reported).
        #[arg(long, default_value_t = 5)]
        rounds: usize,
        /// Write the results as JSON to this file (`-` for stdout).
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Pipeline parallelism: 2 stages (the leader here, stage 2 its own process) with
    /// half the threads each against one process with all of them, in one run: prefill,
    /// decode of one stream and of 32, the activation channel's hop on loopback, each
    /// stage's share of the weights (the target model: `bench/synth-model --shape
    /// llama-1b --types q4_k_m`).
    Pipeline {
        #[command(flatten)]
        model: ModelArgs,
        /// Write the results as JSON to this file (`-` for stdout).
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// What quantizing float weights at load costs: the KL divergence of the default
    /// (`--float-weights q8_0`) against the float path, along fixed texts, beside
    /// llama.cpp's own Q8_0 file of the same model (`bench/kld-compare` makes the files
    /// for every family).
    Kld {
        /// `LABEL=FLOAT.gguf[,Q8_0.gguf]`, repeated: a float (F16/BF16/F32) GGUF and,
        /// optionally, llama.cpp's Q8_0 quantization of it.
        #[arg(long = "model", required = true, value_parser = hearth_bench::engine::kld::KldModel::parse)]
        models: Vec<hearth_bench::engine::kld::KldModel>,
        /// Write the results as JSON to this file (`-` for stdout).
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// The attention kernels alone, one thread: a head at a time against grouped queries
    /// (a GQA group's heads × consecutive rows), decode- and prefill-shaped, 1k–32k positions.
    Attention {
        /// Shorter runs, fewer contexts (smoke).
        #[arg(long)]
        quick: bool,
        /// Write the results as JSON to this file (`-` for stdout).
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// The KV tier below the pool: time to first token with the prefix recomputed, read back
    /// from disk (page cache warm and dropped) or pulled from a peer, 16–4,096 tokens; and
    /// multi-turn sessions under capacity pressure, pool only against pool + disk.
    KvTiers {
        #[command(flatten)]
        model: ModelArgs,
        /// Fewer lengths, fewer sessions (smoke).
        #[arg(long)]
        quick: bool,
        /// Write the results as JSON to this file (`-` for stdout).
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// LoRA adapters: streams spread over several adapters decoding in shared steps, against
    /// the base model and against serving one adapter at a time; and a cold adapter's first
    /// token against a loaded one's.
    Lora {
        #[command(flatten)]
        model: ModelArgs,
        /// Concurrent streams.
        #[arg(long, default_value_t = 32)]
        streams: usize,
        /// Distinct adapters the streams are spread over.
        #[arg(long, default_value_t = 8)]
        adapters: usize,
        /// The adapters' rank (every q/k/v/o/gate/up/down projection).
        #[arg(long, default_value_t = 16)]
        rank: usize,
        /// Tokens each stream generates.
        #[arg(long, default_value_t = 64)]
        tokens: usize,
        /// Fewer tokens and samples (smoke).
        #[arg(long)]
        quick: bool,
        /// Write the results as JSON to this file (`-` for stdout).
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// KV transfer between engines (prefill/decode disaggregation): in process and worker to
    /// worker over loopback HTTP, in GB/s.
    KvTransfer {
        #[command(flatten)]
        model: ModelArgs,
        /// Prompt length (its full blocks move).
        #[arg(long, default_value_t = 2048)]
        prompt_tokens: usize,
        /// Write the results as JSON to this file (`-` for stdout).
        #[arg(long)]
        json: Option<PathBuf>,
    },
}

#[derive(Args, Clone)]
pub struct DataArgs {
    /// Holds the SQLite database and local state (default: ~/.local/share/hearth).
    #[arg(long, env = "HEARTH_DATA_DIR", global = true)]
    pub data_dir: Option<PathBuf>,
    /// A PostgreSQL database (postgres://…) instead of SQLite in the data directory.
    #[arg(long, env = "HEARTH_DATABASE_URL", global = true, hide_env_values = true)]
    pub database_url: Option<String>,
}

impl DataArgs {
    pub fn dir(&self) -> PathBuf {
        self.data_dir.clone().unwrap_or_else(db::default_data_dir)
    }

    pub async fn open(&self) -> anyhow::Result<hearth_tenants::Db> {
        Ok(db::open(&self.dir(), self.database_url.as_deref()).await?)
    }
}

/// Where rate limits are counted, and where compiled processors are cached.
#[derive(Args, Clone)]
pub struct LimitStoreArgs {
    /// Compiled processor code, by content hash (default: DATA_DIR/processors).
    #[arg(long, env = "HEARTH_PROCESSOR_CACHE")]
    pub processor_cache: Option<PathBuf>,
    /// Instances of each processor version (per configuration and limits) made ahead of
    /// their requests and kept ready, so that instantiating a large guest is off the
    /// request's path; refilled in the background after each request, never reused (at most
    /// 64 in all). 0: each request makes its own.
    #[arg(long, env = "HEARTH_PROCESSOR_WARM", default_value_t = hearth_runtime::DEFAULT_WARM_INSTANCES)]
    pub processor_warm: usize,
    /// Count rate limits in Redis (redis://HOST:PORT), shared by every gateway using it;
    /// without it each gateway counts alone.
    #[arg(long, env = "HEARTH_REDIS_URL", hide_env_values = true)]
    pub redis_url: Option<String>,
    /// Prefix of Hearth's Redis keys.
    #[arg(long, env = "HEARTH_REDIS_PREFIX", default_value = "hearth:")]
    pub redis_prefix: String,
    /// A stream whose worker sends nothing for this long is treated as lost: it continues on
    /// another worker, or ends with `stream_idle_timeout`.
    #[arg(long, env = "HEARTH_STREAM_IDLE_TIMEOUT_SECS", default_value_t = 120)]
    pub stream_idle_timeout_secs: u64,
    /// A request still running after this long ends with `request_timeout` (billed for what
    /// was generated).
    #[arg(long, env = "HEARTH_MAX_REQUEST_SECS", default_value_t = 900)]
    pub max_request_secs: u64,
    /// How long the Responses API keeps a stored response (`store: true`, its default) for
    /// `previous_response_id` and `GET /v1/responses/{id}` (at least 1).
    #[arg(long, env = "HEARTH_RESPONSES_TTL_DAYS", default_value_t = 30)]
    pub responses_ttl_days: u32,
    /// Stored responses kept per tenant; past it a new one drops the tenant's least
    /// recently continued.
    #[arg(long, env = "HEARTH_RESPONSES_PER_TENANT", default_value_t = 10_000)]
    pub responses_per_tenant: u64,
    /// Bytes of stored responses kept per tenant (default 1 GiB); past it a new one drops
    /// the tenant's least recently continued.
    #[arg(long, env = "HEARTH_RESPONSES_TENANT_BYTES", default_value_t = 1 << 30)]
    pub responses_tenant_bytes: u64,
    /// Bytes of files one tenant may store (Files API uploads and batch outputs; default
    /// 1 GiB). An upload that would pass it is refused before its body is read.
    #[arg(long, env = "HEARTH_TENANT_FILE_BYTES", default_value_t = 1 << 30)]
    pub tenant_file_bytes: u64,
    /// Bytes one stored response may hold (default 4 MiB): a `store: true` request whose
    /// body is larger is refused before it runs.
    #[arg(long, env = "HEARTH_RESPONSE_MAX_BYTES", default_value_t = 4 << 20)]
    pub response_max_bytes: u64,
    /// Bytes of a conversation a `previous_response_id` continuation reads (default 16 MiB):
    /// a longer one is refused.
    #[arg(long, env = "HEARTH_CONVERSATION_MAX_BYTES", default_value_t = 16 << 20)]
    pub conversation_max_bytes: u64,
    /// Keep Claude Code's `x-anthropic-billing-header` system block in the prompt (by
    /// default it is dropped: it changes every request and would defeat the prefix cache).
    #[arg(long, env = "HEARTH_KEEP_BILLING_HEADER")]
    pub keep_billing_header: bool,
    /// The completion budget of a request that sets none (default: the room its prompt
    /// leaves in the context). Agent harnesses such as Codex send no limit.
    #[arg(long, env = "HEARTH_DEFAULT_MAX_TOKENS")]
    pub default_max_tokens: Option<u32>,
    /// While the key store (the database) does not answer, credentials checked within this
    /// long keep working from the cache (0: never; then every request fails with 503 until
    /// it is back).
    #[arg(long, env = "HEARTH_AUTH_STALE_SECS", default_value_t = 900)]
    pub auth_stale_secs: u64,
    /// How a usage record is made durable before its response ends: `write` (appended to
    /// the outbox: survives a crash of the process) or `fsync` (also flushed to disk, in
    /// groups: survives a power cut, at a cost measured by `hearth bench gateway`).
    #[arg(long, env = "HEARTH_USAGE_DURABILITY", default_value = "write", value_parser = ["write", "fsync"])]
    pub usage_durability: String,
    /// Batch lines (OpenAI Batch API) this gateway runs at once, over every batch, in the
    /// `batch` class (0: it runs none; other gateways on the database do).
    #[arg(long, env = "HEARTH_BATCH_CONCURRENCY", default_value_t = 4)]
    pub batch_concurrency: usize,
    /// How long a batch line this gateway runs stays its own without a renewal: a line
    /// whose gateway died runs again (metered once) after it.
    #[arg(long, env = "HEARTH_BATCH_LEASE_SECS", default_value_t = 60, value_parser = clap::value_parser!(u64).range(3..))]
    pub batch_lease_secs: u64,
}

/// Connection, header and body limits of the HTTP server (see `hearth_gateway::server::http`).
#[derive(Args, Clone)]
pub struct HttpArgs {
    /// A request's head must arrive within this; an idle keep-alive connection is closed
    /// after it (slow or half-open clients hold a connection at most this long).
    #[arg(long, env = "HEARTH_HEADER_READ_TIMEOUT_SECS", default_value_t = 30)]
    pub header_read_timeout_secs: u64,
    /// The largest request head (request line and headers); larger gets 431.
    #[arg(long, env = "HEARTH_MAX_HEADER_BYTES", default_value_t = 64 * 1024)]
    pub max_header_bytes: usize,
    /// Open connections at most; past it new ones are closed at once.
    #[arg(long, env = "HEARTH_MAX_CONNECTIONS", default_value_t = 4096)]
    pub max_connections: usize,
    /// Open connections from one client address at most.
    #[arg(long, env = "HEARTH_MAX_CONNECTIONS_PER_IP", default_value_t = 512)]
    pub max_connections_per_ip: usize,
    /// The largest request body (processor and adapter uploads excepted); larger gets 413.
    #[arg(long, env = "HEARTH_MAX_BODY_BYTES", default_value_t = 8 * 1024 * 1024)]
    pub max_body_bytes: usize,
    /// A request's body must arrive within this, else 408.
    #[arg(long, env = "HEARTH_BODY_READ_TIMEOUT_SECS", default_value_t = 30)]
    pub body_read_timeout_secs: u64,
}

/// Who may operate a gateway, and where browsers reach it.
#[derive(Args)]
pub struct AccessArgs {
    /// Enables the admin API (`/admin/v1`), `/metrics` and the operator's dashboard for
    /// bearers of this token (all closed without one). At least 16 characters; make it
    /// random (`openssl rand -hex 32`). Wrong tokens are throttled per source address.
    #[arg(long, env = "HEARTH_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    /// The URL browsers reach this gateway at (e.g. `https://hearth.example.com`, behind a
    /// proxy): the dashboard then accepts changes only from pages of exactly this origin
    /// (scheme, host and port) and marks its cookies `Secure` when it is `https`. Without
    /// it, a change must come from the host the request names.
    #[arg(long, env = "HEARTH_PUBLIC_URL")]
    pub public_url: Option<String>,
    /// The operators' OpenID Connect provider (its issuer URL): operators listed in
    /// `--operators` then sign into the dashboard through it (authorization code with PKCE),
    /// as well as with the admin token. Register `<public URL>/dashboard/sso/callback` as
    /// the client's redirect URI.
    #[arg(long, env = "HEARTH_OPERATOR_OIDC_ISSUER", requires_all = ["operator_oidc_client_id", "operators"])]
    pub operator_oidc_issuer: Option<String>,
    /// The client id registered at the operators' provider.
    #[arg(long, env = "HEARTH_OPERATOR_OIDC_CLIENT_ID")]
    pub operator_oidc_client_id: Option<String>,
    /// The client's secret (leave unset for a public client).
    #[arg(long, env = "HEARTH_OPERATOR_OIDC_CLIENT_SECRET", hide_env_values = true)]
    pub operator_oidc_client_secret: Option<String>,
    /// E-mail addresses (comma-separated) that are operators when the operators' provider
    /// vouches for them (its ID token marks the address verified).
    #[arg(long, env = "HEARTH_OPERATORS", value_delimiter = ',')]
    pub operators: Vec<String>,
}

impl AccessArgs {
    /// The admin token (refused when shorter than the minimum) and the public origin.
    pub fn checked(&self) -> anyhow::Result<(Option<String>, Option<String>)> {
        let token = self.admin_token.clone().filter(|t| !t.is_empty());
        if let Some(t) = &token {
            let min = hearth_gateway::state::MIN_ADMIN_TOKEN_LEN;
            anyhow::ensure!(
                t.chars().count() >= min,
                "the admin token (HEARTH_ADMIN_TOKEN) has {} characters; it needs at least {min}: make one with `openssl rand -hex 32`",
                t.chars().count()
            );
        }
        let origin = match self.public_url.as_deref().filter(|u| !u.is_empty()) {
            None => None,
            Some(u) => Some(public_origin(u)?),
        };
        Ok((token, origin))
    }

    /// The operators' identity provider, if one is configured.
    pub fn operator_sso(&self) -> anyhow::Result<Option<hearth_gateway::state::OperatorSso>> {
        let Some(issuer) = self.operator_oidc_issuer.clone().filter(|i| !i.is_empty()) else {
            return Ok(None);
        };
        let provider = hearth_tenants::sso::SsoSpec {
            issuer,
            client_id: self.operator_oidc_client_id.clone().unwrap_or_default(),
            client_secret: self.operator_oidc_client_secret.clone().filter(|s| !s.is_empty()),
        };
        hearth_tenants::sso::check_spec(&provider).map_err(|e| anyhow::anyhow!("--operator-oidc-*: {e}"))?;
        let operators = self
            .operators
            .iter()
            .filter(|e| !e.trim().is_empty())
            .map(|e| hearth_tenants::members::normalise_email(e).map_err(|e| anyhow::anyhow!("--operators: {e}")))
            .collect::<anyhow::Result<Vec<_>>>()?;
        anyhow::ensure!(
            !operators.is_empty(),
            "--operators: name at least one operator's e-mail address"
        );
        anyhow::ensure!(
            self.admin_token.as_deref().is_some_and(|t| !t.is_empty()),
            "--operator-oidc-issuer needs the admin token (HEARTH_ADMIN_TOKEN): the operator routes it signs into are closed without one"
        );
        Ok(Some(hearth_gateway::state::OperatorSso { provider, operators }))
    }
}

/// `scheme://host[:port]` of a public URL (http or https, a host, no path: the dashboard is
/// served at `/dashboard` of that origin).
fn public_origin(url: &str) -> anyhow::Result<String> {
    let parsed = reqwest::Url::parse(url).map_err(|e| anyhow::anyhow!("--public-url {url:?}: {e}"))?;
    anyhow::ensure!(
        matches!(parsed.scheme(), "http" | "https")
            && parsed.host().is_some()
            && parsed.path() == "/"
            && parsed.query().is_none(),
        "--public-url {url:?}: give an http or https origin, like https://hearth.example.com (the dashboard is at its /dashboard; a path prefix is not supported)"
    );
    Ok(parsed.origin().ascii_serialization())
}

impl HttpArgs {
    pub fn limits(&self) -> hearth_gateway::server::http::HttpLimits {
        use std::time::Duration;
        hearth_gateway::server::http::HttpLimits {
            header_read_timeout: Duration::from_secs(self.header_read_timeout_secs.max(1)),
            max_header_bytes: self.max_header_bytes,
            max_connections: self.max_connections.max(1),
            max_connections_per_ip: self.max_connections_per_ip.max(1),
            max_body_bytes: self.max_body_bytes,
            body_read_timeout: Duration::from_secs(self.body_read_timeout_secs.max(1)),
        }
    }
}

impl LimitStoreArgs {
    pub async fn limiter(&self) -> anyhow::Result<Limiter> {
        match self.redis_url.as_deref().filter(|u| !u.is_empty()) {
            None => Ok(Limiter::default()),
            Some(url) => Ok(Limiter::with_redis(
                RedisLimiter::connect(url, &self.redis_prefix).await?,
            )),
        }
    }
}

#[derive(Args, Clone)]
pub struct ModelArgs {
    /// A known model id (fetched into $HEARTH_HOME/models), a GGUF file of a supported family, or a
    /// Hugging Face model directory (config.json, *.safetensors, tokenizer.json).
    #[arg(long, env = "HEARTH_MODEL", default_value = DEFAULT_MODEL_ID)]
    pub model: String,
    /// The id clients use for the model (default: the known id, or the file's stem).
    #[arg(long, env = "HEARTH_MODEL_ID")]
    pub model_id: Option<String>,
    /// Compute threads (default: all cores).
    #[arg(long, env = "HEARTH_THREADS")]
    pub threads: Option<usize>,
    /// KV cache size in MiB (default: a quarter of available memory, at most 1024).
    #[arg(long, env = "HEARTH_KV_CACHE_MIB")]
    pub kv_cache_mib: Option<usize>,
    /// Where the forward pass runs: `cpu`, or `cuda` / `cuda:N` for an NVIDIA GPU (CUDA's
    /// libraries are loaded at start: the driver, NVRTC and cuBLAS on the loader's path).
    /// With `cuda`, `--kv-cache-mib` is device memory (default: half of what the weights
    /// leave, at most 16 GiB).
    #[arg(long, env = "HEARTH_DEVICE", default_value = "cpu", value_parser = hearth_engine::cuda::Device::parse)]
    pub device: hearth_engine::cuda::Device,
    /// With `--device cuda`: replay decode steps from CUDA graphs (`false`: launch every
    /// kernel each step).
    #[arg(long, env = "HEARTH_CUDA_GRAPHS", default_value_t = true, action = clap::ArgAction::Set,
          value_parser = clap::builder::BoolishValueParser::new())]
    pub cuda_graphs: bool,
    /// How the KV cache stores keys and values: f16 (half the memory) or f32.
    #[arg(long, env = "HEARTH_KV_DTYPE", default_value = "f16", value_parser = KvDtype::parse)]
    pub kv_dtype: KvDtype,
    /// How float (F32/F16/BF16) weights are computed: `q8_0` (quantized at load as
    /// llama.cpp's quantizer would, routers and norms kept float, for the integer kernels),
    /// `float` (exact, several times slower), or `auto`: q8_0 for a dense model, float for a
    /// mixture of experts (whose routers' discrete choice 8-bit activations would move).
    #[arg(long, env = "HEARTH_FLOAT_WEIGHTS", default_value = "auto",
          value_parser = hearth_engine::models::FloatWeights::parse)]
    pub float_weights: hearth_engine::models::FloatWeights,
    /// Packs of repacked weights: `read` maps a current pack (from `--pack-dir`, else
    /// beside the model) and never writes; a model without one is repacked in memory at
    /// load. `write` also writes the pack after a repack (for CPUs too slow to repack at
    /// load: it takes as much disk as the model). `off` neither maps nor writes.
    #[arg(long, env = "HEARTH_PACK_CACHE", default_value = "read",
          value_parser = hearth_engine::kernels::pack_cache::PackMode::parse)]
    pub pack_cache: hearth_engine::kernels::pack_cache::PackMode,
    /// A directory of packs prepared by `hearth model pack --out DIR` (a model store shared
    /// by the fleet, possibly read-only), looked in before the model's own directory.
    #[arg(long, env = "HEARTH_PACK_DIR")]
    pub pack_dir: Option<std::path::PathBuf>,
    /// The kernels' instruction set: auto (the best this CPU runs), avx512, avx2 (with
    /// AVX-VNNI where present), avx2-novnni or scalar. Refused if the CPU cannot run it.
    #[arg(long, env = "HEARTH_ISA", default_value = "auto", value_parser = parse_isa)]
    pub isa: Isa,
    /// Tokens per engine step, shared by decodes and prefill chunks.
    #[arg(long, env = "HEARTH_MAX_BATCH_TOKENS", default_value_t = 512)]
    pub max_batch_tokens: usize,
    /// Sequences decoded together.
    #[arg(long, env = "HEARTH_MAX_RUNNING", default_value_t = 64)]
    pub max_running: usize,
    /// The queue limit in prompt tokens not yet computed (default: what the KV cache
    /// holds; 0: unbounded). Gateways shed by it; the engine refuses past it.
    #[arg(long, env = "HEARTH_MAX_QUEUE_TOKENS")]
    pub max_queue_tokens: Option<usize>,
    /// Speculative decoding: at most this many prompt-lookup draft tokens verified per
    /// sequence and step (0: off).
    #[arg(long, env = "HEARTH_SPECULATIVE_TOKENS", default_value_t = hearth_engine::engine::config::DEFAULT_SPECULATIVE_TOKENS)]
    pub speculative_tokens: usize,
    /// Admission order on a busy engine: `fair` (between tenants, by class) or `fifo`.
    #[arg(long, env = "HEARTH_SCHEDULE", default_value = "fair", value_parser = parse_schedule)]
    pub schedule: hearth_engine::step::scheduler::Policy,
    /// Region label of the engine(s).
    #[arg(long, env = "HEARTH_REGION", default_value = "local")]
    pub region: String,
    /// The layers this engine computes, set by `--stage` or `hearth serve --pipeline`.
    #[arg(skip)]
    pub stage: Option<hearth_engine::models::StagePlan>,
    /// A pipeline leader's other stages.
    #[arg(skip)]
    pub pipeline: Option<hearth_engine::pipeline::PipelineConfig>,
    /// The memory this engine's weights and KV cache may take (MiB), from
    /// `--memory-budget-mib`; None: what the machine has available at start.
    #[arg(skip)]
    pub memory_budget_mib: Option<u64>,
    /// `engine` (the real model) or `sim` (the real scheduler and caches, with a cost model
    /// instead of the maths; see `hearth_engine::worker::sim`).
    #[arg(long, env = "HEARTH_BACKEND", default_value = "engine")]
    pub backend: String,
    /// For `--backend sim`: how many times faster than the cost model time runs.
    #[arg(long, default_value_t = 1.0)]
    pub sim_speedup: f64,
    /// A Jinja chat template file to use instead of the model file's (its tool-call and
    /// reasoning formats are then read from it too).
    #[arg(long, env = "HEARTH_CHAT_TEMPLATE", value_parser = read_template)]
    pub chat_template: Option<String>,
    /// Stretch the model's context by RoPE scaling: `yarn:4`, `linear:2`, `llama3:8`
    /// (`KIND:FACTOR[:ORIGINAL_CONTEXT]`; the original defaults to the model's trained
    /// context), or `none` to turn off the file's own. The served context becomes the
    /// original times the factor.
    #[arg(long, env = "HEARTH_ROPE_SCALING", value_parser = hearth_engine::models::RopeScaling::parse)]
    pub rope_scaling: Option<hearth_engine::models::RopeScaling>,
    /// Serve at most this context (prompt + output); beyond the model's own it needs
    /// `--rope-scaling` (default: the model's, stretched by the scaling).
    #[arg(long, env = "HEARTH_CONTEXT_LENGTH")]
    pub context_length: Option<usize>,
    /// Keep KV blocks the engine's pool evicts on local disk under this directory (one
    /// subdirectory per model and KV layout, kept across restarts) and read them back
    /// instead of recomputing a prefix (default: no disk tier).
    #[arg(long, env = "HEARTH_KV_DISK_DIR")]
    pub kv_disk_dir: Option<PathBuf>,
    /// The disk tier's size in GiB per engine (oldest blocks go first).
    #[arg(long, env = "HEARTH_KV_DISK_GIB", default_value_t = 16.0)]
    pub kv_disk_gib: f64,
    /// Each tenant's share of a disk tier, in GiB (0: only the tier's size bounds it).
    #[arg(long, env = "HEARTH_KV_DISK_TENANT_GIB", default_value_t = 0.0)]
    pub kv_disk_tenant_gib: f64,
    /// The LoRA adapter store engines read adapters from (requests name adapters relative
    /// to it; nothing outside it is read). Unset: engines serve no adapters, except under
    /// `hearth serve`, whose gateway keeps tenants' uploads in DATA_DIR/adapters.
    #[arg(long, env = "HEARTH_ADAPTER_DIR")]
    pub adapter_dir: Option<PathBuf>,
    /// LoRA adapters an engine keeps loaded at once (least recently used unloaded first;
    /// 0: serve no adapters).
    #[arg(long, env = "HEARTH_MAX_ADAPTERS", default_value_t = 16)]
    pub max_adapters: usize,
    /// Memory for loaded adapters per engine, in MiB.
    #[arg(long, env = "HEARTH_ADAPTER_MEMORY_MIB", default_value_t = 1024)]
    pub adapter_memory_mib: usize,
    /// The largest adapter rank an engine loads.
    #[arg(long, env = "HEARTH_ADAPTER_MAX_RANK", default_value_t = 64)]
    pub adapter_max_rank: usize,
}

fn read_template(path: &str) -> Result<String, String> {
    std::fs::read_to_string(path).map_err(|e| format!("reading the chat template {path}: {e}"))
}

#[derive(Args, Clone)]
pub struct RoutingArgs {
    /// Routing policy: kv_aware (default), prefix_aware, least_outstanding, random; or
    /// MODEL=POLICY for one model (repeatable).
    #[arg(
        long = "routing-policy",
        env = "HEARTH_ROUTING_POLICY",
        value_delimiter = ',',
        default_value = "kv_aware"
    )]
    pub policies: Vec<String>,
    /// Prefill/decode disaggregation: a request with at least this many prompt tokens not
    /// cached on the best prefill worker is prefilled on a `prefill` worker and decoded on a
    /// `decode` worker (pools without such workers never disaggregate); 0: never.
    #[arg(long, env = "HEARTH_PD_THRESHOLD", default_value_t = hearth_gateway::upstream::registry::DEFAULT_PD_THRESHOLD)]
    pub pd_threshold: usize,
    /// Peer fetch: a worker that lacks at least this many leading prompt tokens another
    /// worker holds in its KV cache pulls them from there instead of computing them (needs
    /// the workers' token); 0: never.
    #[arg(long, env = "HEARTH_KV_FETCH_MIN_TOKENS", default_value_t = hearth_router::DEFAULT_FETCH_MIN_TOKENS)]
    pub kv_fetch_min_tokens: usize,
}

impl RoutingArgs {
    pub fn config(&self, region: &str) -> anyhow::Result<RoutingConfig> {
        let mut cfg = RoutingConfig {
            region: region.to_string(),
            pd_threshold: self.pd_threshold,
            fetch_min_tokens: self.kv_fetch_min_tokens,
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
    pub fn engine_config(&self) -> EngineConfig {
        EngineConfig {
            threads: self
                .threads
                .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())),
            kv_cache_mib: self.kv_cache_mib,
            kv_dtype: self.kv_dtype,
            isa: Some(self.isa),
            max_context: self.context_length,
            rope_scaling: self.rope_scaling,
            pack_cache: hearth_engine::kernels::pack_cache::PackCache {
                mode: self.pack_cache,
                dir: self.pack_dir.clone(),
            },
            float_weights: self.float_weights,
            max_batch_tokens: self.max_batch_tokens,
            max_running: self.max_running,
            region: self.region.clone(),
            max_queue_tokens: self.max_queue_tokens,
            policy: self.schedule,
            speculative_tokens: self.speculative_tokens,
            device: self.device,
            cuda_graphs: self.cuda_graphs,
            chat_template: self.chat_template.clone(),
            stage: self.stage.clone(),
            pipeline: self.pipeline.clone(),
            memory_budget_mib: self.memory_budget_mib,
            kv_disk: self
                .kv_disk_dir
                .as_ref()
                .map(|dir| hearth_engine::kv::tier::DiskTierConfig {
                    dir: dir.clone(),
                    capacity_bytes: gib_bytes(self.kv_disk_gib),
                    tenant_bytes: gib_bytes(self.kv_disk_tenant_gib),
                }),
            adapters: hearth_engine::engine::adapters::AdapterCacheConfig {
                store: self.adapter_dir.clone(),
                max_loaded: self.max_adapters,
                memory_mib: self.adapter_memory_mib,
                limits: hearth_engine::models::LoraLimits {
                    max_rank: self.adapter_max_rank,
                    ..Default::default()
                },
                ..Default::default()
            },
        }
    }
}

fn gib_bytes(g: f64) -> u64 {
    (g.max(0.0) * (1u64 << 30) as f64) as u64
}

fn parse_schedule(s: &str) -> Result<hearth_engine::step::scheduler::Policy, String> {
    hearth_engine::step::scheduler::Policy::parse(s).ok_or_else(|| format!("{s:?} is not a schedule (fair, fifo)"))
}

#[derive(Args)]
pub struct ServeArgs {
    /// The address to listen on (`:0` picks a free port; the chosen one is printed).
    #[arg(long, env = "HEARTH_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    #[command(flatten)]
    pub data: DataArgs,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub access: AccessArgs,
    /// In-process engine workers (each with its own KV cache; threads are shared out).
    #[arg(long, env = "HEARTH_WORKERS_LOCAL", default_value_t = 1)]
    pub workers: usize,
    /// Split the model by layers into this many pipeline stages: the in-process engine
    /// computes the first, and each other stage is a `hearth worker --stage K/N` process on
    /// loopback (restarted if it dies), with the threads shared out. For a model larger
    /// than one worker's `--memory-budget-mib`; across hosts, run `hearth worker --stage`.
    #[arg(long, env = "HEARTH_PIPELINE", default_value_t = 1)]
    pub pipeline: usize,
    /// In-process prefill workers (with `--decode-workers`, a one-command prefill/decode
    /// disaggregated setup; they replace `--workers`).
    #[arg(long, env = "HEARTH_PREFILL_WORKERS", default_value_t = 0)]
    pub prefill_workers: usize,
    /// In-process decode workers (see `--prefill-workers`).
    #[arg(long, env = "HEARTH_DECODE_WORKERS", default_value_t = 0)]
    pub decode_workers: usize,
    /// A model catalogue (TOML; see the book, "The model catalogue"): several models, each loaded on its first
    /// request and unloaded after its idle TTL, within `--memory-budget-mib`. Replaces
    /// `--model`.
    #[arg(long, env = "HEARTH_CATALOGUE")]
    pub catalogue: Option<PathBuf>,
    /// Memory all warm models of the catalogue may use together (file + KV cache each);
    /// the least recently used idle model is unloaded to make room. Default: no limit.
    /// Without a catalogue, what each engine (each pipeline stage) may take: a model past
    /// it is refused, naming `--pipeline` (default: the memory available at start).
    #[arg(long, env = "HEARTH_MEMORY_BUDGET_MIB")]
    pub memory_budget_mib: Option<u64>,
    #[command(flatten)]
    pub routing: RoutingArgs,
    #[command(flatten)]
    pub limits: LimitStoreArgs,
    #[command(flatten)]
    pub lifecycle: LifecycleArgs,
    #[command(flatten)]
    pub http: HttpArgs,
}

#[derive(Args)]
pub struct WorkerArgs {
    /// The address to listen on (`:0` picks a free port; the chosen one is printed).
    #[arg(long, env = "HEARTH_LISTEN", default_value = "127.0.0.1:8081")]
    pub listen: SocketAddr,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub stage: StageArgs,
    /// A model catalogue (TOML, as for `hearth serve`): this worker serves every model in
    /// it, loading each on demand. Replaces `--model`.
    #[arg(long, env = "HEARTH_CATALOGUE")]
    pub catalogue: Option<PathBuf>,
    /// Memory all warm models of the catalogue may use together; without a catalogue, what
    /// the model (this stage of it) may take, weights and KV cache: a model past it is
    /// refused, naming `--pipeline` and `--stage` (default: the memory available at start).
    #[arg(long, env = "HEARTH_MEMORY_BUDGET_MIB")]
    pub memory_budget_mib: Option<u64>,
    /// The workers' shared token: gateways present it to add or remove catalogue models at
    /// runtime (`POST`/`DELETE /v1/worker/models`), workers to move KV blocks between them
    /// (`…/kv/export`, `…/kv/pull`); unset: both are refused.
    #[arg(long, env = "HEARTH_WORKER_TOKEN", hide_env_values = true)]
    pub worker_token: Option<String>,
    /// What the gateway sends this worker: `both` (whole requests), `prefill` (the prompt
    /// and first token of long requests, whose KV blocks decode workers then fetch) or
    /// `decode` (the rest of long requests, and short requests whole).
    #[arg(long, env = "HEARTH_WORKER_ROLE", default_value = "both", value_parser = ["both", "prefill", "decode"])]
    pub role: String,
    /// Register in the worker registry in this Redis (redis://HOST:PORT) and heartbeat
    /// there; gateways started with `--discover` on the same Redis find the worker. Needs
    /// the worker token (registrations are sealed with it).
    #[arg(long, env = "HEARTH_REDIS_URL", hide_env_values = true)]
    pub redis_url: Option<String>,
    /// Prefix of Hearth's Redis keys (the gateways' too).
    #[arg(long, env = "HEARTH_REDIS_PREFIX", default_value = "hearth:")]
    pub redis_prefix: String,
    /// The base URL gateways reach this worker at (default: http:// and the listen
    /// address, or the host name and port when listening on every interface).
    #[arg(long, env = "HEARTH_ADVERTISE_URL")]
    pub advertise_url: Option<String>,
    /// How often the registration is renewed; it expires after three missed heartbeats.
    #[arg(long, env = "HEARTH_HEARTBEAT_MS", default_value_t = 1000)]
    pub heartbeat_ms: u64,
    #[command(flatten)]
    pub lifecycle: LifecycleArgs,
    #[command(flatten)]
    pub http: HttpArgs,
}

/// A worker as one stage of a pipeline group (see the book, "Pipeline parallelism").
#[derive(Args, Clone)]
pub struct StageArgs {
    /// This worker's stage of a model split by layers: `K/N` (the K-th of N stages, cut
    /// to balance each stage's weights read per token, the last counting half the logits'
    /// matrix) or `START..END` (explicit layers, for hosts of unequal sizes). Stage 1 (the
    /// leader, layer 0 on) serves the worker API and needs `--stage-next`; every other
    /// stage listens on `--stage-listen` for the stage before it. Every stage of a group
    /// serves the same file and shares the workers' token.
    #[arg(long, env = "HEARTH_STAGE", value_parser = hearth_engine::models::StagePlan::parse)]
    pub stage: Option<hearth_engine::models::StagePlan>,
    /// A follower stage's address for the stage before it (the activation channel, TCP).
    #[arg(long, env = "HEARTH_STAGE_LISTEN")]
    pub stage_listen: Option<SocketAddr>,
    /// The leader's other stages, in order, comma-separated (`host:port,host:port`).
    #[arg(long, env = "HEARTH_STAGE_NEXT", value_delimiter = ',')]
    pub stage_next: Vec<String>,
    /// Micro-batches a leader cuts each step into, so that its stages compute a long
    /// prefill at once (default: one per 64 rows, at most 8; 1: off). Decode steps overlap
    /// across lanes of sequences instead: as many steps in flight as stages.
    #[arg(long, env = "HEARTH_MICROBATCHES")]
    pub microbatches: Option<usize>,
}

/// How a process shuts down (SIGTERM or Ctrl-C).
#[derive(Args, Clone)]
pub struct LifecycleArgs {
    /// How long requests in flight may take to finish after SIGTERM; those still running
    /// then end with an error (and their usage record).
    #[arg(long, env = "HEARTH_DRAIN_TIMEOUT_SECS", default_value_t = 30)]
    pub drain_timeout_secs: u64,
    /// After SIGTERM, how long the listener stays open while `/readyz` answers 503, so
    /// that load balancers stop sending requests first (Kubernetes: a few seconds).
    #[arg(long, env = "HEARTH_SHUTDOWN_DELAY_SECS", default_value_t = 0)]
    pub shutdown_delay_secs: u64,
}

#[derive(Args)]
pub struct GatewayArgs {
    /// The address to listen on (`:0` picks a free port; the chosen one is printed).
    #[arg(long, env = "HEARTH_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    #[command(flatten)]
    pub data: DataArgs,
    /// A worker's base URL (repeat for several).
    #[arg(
        long = "worker",
        env = "HEARTH_WORKERS",
        value_delimiter = ',',
        required_unless_present = "discover"
    )]
    pub workers: Vec<String>,
    /// Find workers in the worker registry in Redis (`--redis-url`) as they register, and
    /// drop those whose heartbeats stop; with `--worker`, both.
    #[arg(long, env = "HEARTH_DISCOVER")]
    pub discover: bool,
    /// How often the registry is read.
    #[arg(long, env = "HEARTH_DISCOVERY_INTERVAL_MS", default_value_t = 500)]
    pub discovery_interval_ms: u64,
    /// How long to wait for workers to come up at start.
    #[arg(long, default_value_t = 120)]
    pub worker_wait_secs: u64,
    /// This gateway's region (requests may override it with `x-hearth-region`).
    #[arg(long, env = "HEARTH_REGION", default_value = "local")]
    pub region: String,
    #[command(flatten)]
    pub routing: RoutingArgs,
    #[command(flatten)]
    pub access: AccessArgs,
    /// The workers' token, for adding and removing catalogue models at runtime, and for
    /// accepting registrations (`--discover`).
    #[arg(long, env = "HEARTH_WORKER_TOKEN", hide_env_values = true)]
    pub worker_token: Option<String>,
    /// The LoRA adapter store tenants' uploads are written to: a directory the workers read
    /// as their `--adapter-dir` (a shared volume). Unset: no adapters.
    #[arg(long, env = "HEARTH_ADAPTER_DIR")]
    pub adapter_dir: Option<PathBuf>,
    #[command(flatten)]
    pub limits: LimitStoreArgs,
    #[command(flatten)]
    pub lifecycle: LifecycleArgs,
    #[command(flatten)]
    pub http: HttpArgs,
}

#[derive(Args)]
pub struct AdminArgs {
    #[command(flatten)]
    pub data: DataArgs,
    #[command(flatten)]
    pub gateway: GatewayApiArgs,
    /// Print JSON instead of text.
    #[arg(long, global = true)]
    pub json: bool,
    #[command(subcommand)]
    pub command: AdminCommand,
}

#[derive(Subcommand)]
pub enum AdminCommand {
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
    /// A tenant's identity provider (OpenID Connect), through which its members sign into
    /// the dashboard.
    Sso {
        #[command(subcommand)]
        command: SsoCommand,
    },
    /// A tenant's members (the people who sign into the dashboard) and their roles.
    Member {
        #[command(subcommand)]
        command: MemberCommand,
    },
    /// Model prices (versioned: a change never rewrites history).
    Price {
        #[command(subcommand)]
        command: PriceCommand,
    },
    /// Recent usage records.
    Usage {
        /// One tenant's records (name or id); default: everyone's.
        #[arg(long)]
        tenant: Option<String>,
        /// How many records, newest first.
        #[arg(long, default_value_t = 20)]
        limit: u32,
    },
    /// The audit log of management actions (API, dashboard and CLI), newest first.
    Audit {
        /// One tenant's entries (name or id); default: everyone's and the platform's.
        #[arg(long)]
        tenant: Option<String>,
        /// How many entries, newest first.
        #[arg(long, default_value_t = 50)]
        limit: u32,
    },
    /// Sign in to a gateway (`--gateway-url`) through the operators' identity provider in a
    /// browser; later `hearth admin --gateway-url …` commands use that session instead of
    /// the admin token (30 minutes unused, 12 hours at most).
    Login {
        /// Print the link only (do not try to open a browser).
        #[arg(long)]
        no_browser: bool,
    },
    /// Forget the session `hearth admin login` kept for `--gateway-url`.
    Logout,
    /// The model catalogue of a running gateway (always through its admin API, at
    /// `--gateway-url` or http://127.0.0.1:8080): list, add and remove models at runtime.
    Model {
        #[command(subcommand)]
        command: AdminModelCommand,
    },
    /// Tenants' LoRA adapters on a running gateway (always through its admin API, at
    /// `--gateway-url` or http://127.0.0.1:8080: a worker checks each upload).
    Adapter {
        #[command(subcommand)]
        command: AdminAdapterCommand,
    },
}

#[derive(Subcommand)]
pub enum AdminAdapterCommand {
    /// Upload an adapter version: a PEFT directory (adapter_config.json and
    /// adapter_model.safetensors) or a GGUF LoRA file. Requests then use `BASE:NAME`.
    Upload {
        /// The tenant (name or id).
        #[arg(long)]
        tenant: String,
        /// The catalogue model it was trained on.
        #[arg(long)]
        base_model: String,
        /// Its name; uploading a name again adds a version.
        #[arg(long)]
        name: String,
        /// The PEFT directory or the .gguf file.
        path: PathBuf,
    },
    /// A tenant's adapter versions.
    List {
        /// The tenant (name or id).
        #[arg(long)]
        tenant: String,
    },
    /// Delete an adapter version (its id from `list`); its files leave the store when no
    /// version of any tenant uses them.
    Delete {
        /// The version's id (`lora_…`).
        id: String,
    },
}

/// A running gateway's admin API: with `--gateway-url`, `hearth admin` and `hearth billing`
/// act through it (the admin token is all they need) instead of on the database.
#[derive(Args, Debug, Clone)]
pub struct GatewayApiArgs {
    /// Act through this gateway's admin API (its base URL, e.g. https://hearth.example.com)
    /// instead of on the database; `hearth admin model` defaults to http://127.0.0.1:8080.
    #[arg(long = "gateway-url", env = "HEARTH_GATEWAY_URL", global = true)]
    pub url: Option<String>,
    /// The gateway's admin token (with `--gateway-url`).
    #[arg(long, env = "HEARTH_ADMIN_TOKEN", hide_env_values = true, global = true)]
    pub admin_token: Option<String>,
}

#[derive(Subcommand)]
pub enum AdminModelCommand {
    /// Every model served, its state on each worker and who may see it.
    List,
    /// Add a model to every worker catalogue and serve it (it loads on its first request).
    Add {
        /// The name clients use.
        #[arg(long)]
        id: String,
        /// A known model, a GGUF path or a Hugging Face directory (as the worker sees it).
        #[arg(long)]
        source: String,
        /// Unload after this many idle seconds (0: never).
        #[arg(long)]
        idle_ttl_s: Option<f64>,
        /// 1: load now and keep warm.
        #[arg(long, default_value_t = 0)]
        min_warm: u32,
        /// Serve at most this context (beyond the model's own: with --rope-scaling).
        #[arg(long)]
        context_length: Option<usize>,
        /// RoPE scaling instead of the file's: `yarn:4`, `linear:2`, `llama3:8`, `none`.
        #[arg(long)]
        rope_scaling: Option<String>,
        /// MiB it counts against each worker's memory budget.
        #[arg(long)]
        memory_mib: Option<u64>,
        /// Only this tenant (name or id) sees it; repeat for more (default: every tenant).
        #[arg(long = "tenant")]
        tenants: Vec<String>,
        /// A chat template file instead of the model's (a path the workers can read).
        #[arg(long)]
        chat_template: Option<String>,
        /// Its KV disk tier's directory (default: each worker's --kv-disk-dir).
        #[arg(long)]
        kv_disk_dir: Option<String>,
        /// Its KV disk tier's size in GiB (default: each worker's --kv-disk-gib; 0: none).
        #[arg(long)]
        kv_disk_gib: Option<f64>,
    },
    /// Stop serving a model and remove it from every catalogue (requests in flight finish).
    Remove {
        /// The model's id.
        id: String,
    },
}

#[derive(Subcommand)]
pub enum JwtCommand {
    /// Register an issuer: tokens with this `iss`, `aud` and algorithm act for the tenant.
    Add {
        /// The tenant the tokens act for (name or id).
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
        /// One tenant's issuers (name or id); default: everyone's.
        #[arg(long)]
        tenant: Option<String>,
    },
    /// Remove an issuer (its tokens stop working within seconds).
    Remove {
        /// The issuer's id (from `jwt list`).
        id: String,
    },
}

#[derive(Subcommand)]
pub enum SsoCommand {
    /// Set (or replace) a tenant's provider. Register `<public URL>/dashboard/sso/callback`
    /// as the client's redirect URI; members then sign in at `/dashboard/sso?tenant=NAME`
    /// (an invitation to a member's address is taken by the provider's verified address).
    Set {
        /// The tenant (name or id).
        #[arg(long)]
        tenant: String,
        /// The issuer URL (its `/.well-known/openid-configuration` is read).
        #[arg(long)]
        issuer: String,
        /// The client id registered at the provider.
        #[arg(long)]
        client_id: String,
        /// The client's secret (leave unset for a public client; from the environment, not
        /// the command line, so that it stays out of shell history).
        #[arg(long, env = "HEARTH_SSO_CLIENT_SECRET", hide_env_values = true)]
        client_secret: Option<String>,
    },
    /// Show a tenant's provider (never its secret).
    Show {
        /// The tenant (name or id).
        #[arg(long)]
        tenant: String,
    },
    /// Remove a tenant's provider (members keep any password they set).
    Remove {
        /// The tenant (name or id).
        #[arg(long)]
        tenant: String,
    },
}

#[derive(Subcommand)]
pub enum MemberCommand {
    /// Invite someone: prints a link, valid 7 days and shown once, where they choose a
    /// password and join with the role.
    Invite {
        /// The tenant (name or id).
        #[arg(long)]
        tenant: String,
        /// Their e-mail address (their sign-in name).
        #[arg(long)]
        email: String,
        /// owner, admin, developer, billing or viewer.
        #[arg(long, default_value = "developer")]
        role: String,
        /// The gateway's public URL, for the link (on the database; through a gateway the
        /// gateway's own is used).
        #[arg(long, env = "HEARTH_PUBLIC_URL", default_value = "http://127.0.0.1:8080")]
        public_url: String,
    },
    /// A tenant's members.
    List {
        /// The tenant (name or id).
        #[arg(long)]
        tenant: String,
    },
    /// A tenant's open invitations.
    Invitations {
        /// The tenant (name or id).
        #[arg(long)]
        tenant: String,
    },
    /// Change a member's role (takes effect at their next request).
    Role {
        /// The member's id (`mb_…`, from `member list`).
        id: String,
        /// owner, admin, developer, billing or viewer.
        role: String,
    },
    /// Remove a member: their dashboard sessions end at once.
    Remove {
        /// The member's id (`mb_…`).
        id: String,
    },
    /// Withdraw an open invitation (its link stops working).
    Uninvite {
        /// The invitation's id (`inv_…`).
        id: String,
    },
}

#[derive(Subcommand)]
pub enum PriceCommand {
    /// Add a price version for a model (`*`: the default for unpriced models). USD per
    /// million tokens.
    Set {
        /// The model id, or `*` for the default of models without a price of their own.
        #[arg(long)]
        model: String,
        /// USD per million prompt tokens computed.
        #[arg(long)]
        input: String,
        /// USD per million prompt tokens served from the prefix cache.
        #[arg(long)]
        cached_input: String,
        /// USD per million completion tokens.
        #[arg(long)]
        output: String,
        /// Tenant processors' time, USD per CPU-second (default: the model's current rate, or
        /// free).
        #[arg(long)]
        processor: Option<String>,
        /// What a batch's request pays, in percent of these rates, 0–100 (default: the
        /// model's current share, or 50 as OpenAI's Batch API).
        #[arg(long, value_parser = clap::value_parser!(u8).range(0..=100))]
        batch_percent: Option<u8>,
        /// When it takes effect: YYYY-MM-DD (UTC) or Unix ms; default now (the first price
        /// of a model covers all time).
        #[arg(long)]
        effective_from: Option<String>,
    },
    /// List price versions.
    List {
        /// One model's versions; default: every model's.
        #[arg(long)]
        model: Option<String>,
    },
}

#[derive(Args)]
pub struct ProcessorArgs {
    #[command(flatten)]
    pub data: DataArgs,
    /// Print JSON instead of text.
    #[arg(long, global = true)]
    pub json: bool,
    #[command(subcommand)]
    pub command: ProcessorCommand,
}

#[derive(Subcommand)]
pub enum ProcessorCommand {
    /// Validate, precompile and store a new version of a processor.
    Upload {
        /// The tenant it belongs to (name or id).
        #[arg(long)]
        tenant: String,
        /// The processor's name; uploading under an existing name adds a version.
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
        /// The tenant (name or id).
        #[arg(long)]
        tenant: String,
    },
    /// Make a version the active one of its name.
    Activate {
        /// The version's id (from `processor list`).
        id: String,
    },
    /// Stop running a version.
    Deactivate {
        /// The version's id.
        id: String,
    },
    /// Run a version only on one key's requests, or (`--tenant-wide`) on all.
    Attach {
        /// The version's id.
        id: String,
        /// The API key id whose requests it runs on.
        #[arg(long, conflicts_with = "tenant_wide")]
        key: Option<String>,
        /// Run on every request of the tenant.
        #[arg(long)]
        tenant_wide: bool,
    },
    /// Delete a version.
    Delete {
        /// The version's id.
        id: String,
    },
    /// Print the WIT of the `hearth:processor` world.
    Wit,
    /// Build a component from a WebAssembly text core module (see `sdk/processors`).
    BuildWat {
        /// The WebAssembly text file (.wat).
        file: PathBuf,
        /// Where to write the component (.wasm).
        #[arg(short, long)]
        out: PathBuf,
    },
}

#[derive(Subcommand)]
pub enum BillingCommand {
    /// Export a tenant's usage: per request or per day and model, CSV, JSON Lines or Parquet.
    /// Totals go to stderr.
    Export {
        #[command(flatten)]
        data: DataArgs,
        #[command(flatten)]
        gateway: GatewayApiArgs,
        /// The tenant (name or id).
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
pub struct LimitArgs {
    /// Requests per minute.
    #[arg(long, default_value_t = 0)]
    pub rpm: u32,
    /// Tokens (prompt + completion) per minute.
    #[arg(long, default_value_t = 0)]
    pub tpm: u32,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 0)]
    pub concurrent: u32,
    /// A tenant's weight in fair scheduling on saturated workers (default 1; tenants only).
    #[arg(long, default_value_t = 0)]
    pub share: u32,
    /// The class of the requests: interactive (default) or batch (admitted after
    /// interactive work, shed first). A key's class can only lower its tenant's.
    #[arg(long, value_parser = parse_priority)]
    pub priority: Option<hearth_protocol::Priority>,
}

fn parse_priority(s: &str) -> Result<hearth_protocol::Priority, String> {
    hearth_protocol::Priority::parse(s).ok_or_else(|| format!("{s:?} is not a class (interactive, batch)"))
}

impl LimitArgs {
    pub fn limits(self) -> hearth_tenants::Limits {
        let some = |v: u32| (v > 0).then_some(v);
        hearth_tenants::Limits {
            rpm: some(self.rpm),
            tpm: some(self.tpm),
            concurrent: some(self.concurrent),
            share: some(self.share),
            priority: self.priority,
        }
    }
}

#[derive(Subcommand)]
pub enum TenantCommand {
    /// Create a tenant.
    Create {
        /// The tenant's name (unique).
        name: String,
    },
    /// List tenants.
    List,
    /// Suspend a tenant: its API keys, JWTs, sessions and members are refused (403
    /// tenant_suspended) until it is resumed; nothing is deleted.
    Suspend {
        /// The tenant (name or id).
        name: String,
    },
    /// Resume a suspended tenant.
    Resume {
        /// The tenant (name or id).
        name: String,
    },
    /// Set a tenant's rate limits (running gateways apply them within 5 s).
    Limits {
        /// The tenant (name or id).
        name: String,
        #[command(flatten)]
        limits: LimitArgs,
    },
    /// Set a tenant's monthly budget in USD (0 removes it).
    Budget {
        /// The tenant (name or id).
        name: String,
        /// The spend allowed per calendar month (UTC), in USD.
        #[arg(long)]
        monthly_usd: String,
        /// Warn (x-hearth-budget-warning) instead of refusing once spent.
        #[arg(long)]
        soft: bool,
    },
}

#[derive(Subcommand)]
pub enum KeyCommand {
    /// Create an API key for a tenant; the key is printed once.
    Create {
        /// The tenant (name or id).
        #[arg(long)]
        tenant: String,
        /// A label for the key, shown in lists and the audit log.
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
        /// The tenant (name or id).
        #[arg(long)]
        tenant: String,
    },
    /// Revoke a key by its id (or the full key).
    Revoke {
        /// The key's id (`hk_<id>`), or the whole key.
        key_id: String,
    },
    /// Set a key's rate limits (on top of its tenant's).
    Limits {
        /// The key's id, or a JWT principal `jwt:ISSUER_ID:SUB`.
        key_id: String,
        #[command(flatten)]
        limits: LimitArgs,
    },
}

#[derive(Subcommand)]
pub enum ModelCommand {
    /// Fetch a known model into $HEARTH_HOME/models and print its path.
    Fetch {
        /// A known model id.
        #[arg(default_value = DEFAULT_MODEL_ID)]
        model: String,
    },
    /// Write a Hugging Face directory (config.json, tokenizer.json, tokenizer_config.json,
    /// safetensors) from a GGUF model, dequantized: a catalogue `source` Hearth can serve.
    ExportHf {
        /// A known model (fetched if needed) or a GGUF path.
        #[arg(long, default_value = DEFAULT_MODEL_ID)]
        model: String,
        /// Directory to write (created if missing).
        #[arg(long)]
        out: std::path::PathBuf,
        /// Element type of the matrices: f16, bf16 or f32 (norms are always f32).
        #[arg(long, default_value = "f16")]
        dtype: String,
        /// Number of safetensors files (more than one writes model.safetensors.index.json).
        #[arg(long, default_value_t = 1)]
        shards: usize,
    },
    /// Prepare a model once for a fleet: repack its weights for the CPU kernels and write
    /// the pack (`NAME.hearth-pack-vN`) into `--out` (default: beside the model), where
    /// workers started with `--pack-dir` (or finding it beside the model) map it instead of
    /// repacking. A pack is tied to the model file's size and modification time: copy
    /// models with their times kept (`cp -p`, `rsync -t`).
    Pack {
        /// A GGUF file, a Hugging Face directory, or a known model id.
        model: String,
        /// Directory to write the pack into (created if missing).
        #[arg(long)]
        out: Option<std::path::PathBuf>,
        /// How float weights are computed (as the workers will run them: a pack made for
        /// `q8_0` holds float matrices quantized, one for `float` does not; `auto` as the
        /// workers' default).
        #[arg(long, env = "HEARTH_FLOAT_WEIGHTS", default_value = "auto",
              value_parser = hearth_engine::models::FloatWeights::parse)]
        float_weights: hearth_engine::models::FloatWeights,
    },
    /// What a model file or directory is and what Hearth makes of it: architecture, tensor
    /// types, tokenizer, chat template, tool-call and reasoning formats, context length, and
    /// why Hearth would refuse it (metadata only; no weights read).
    Inspect {
        /// A GGUF file, a Hugging Face directory, or a known model id.
        model: String,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
}

/// `PREFILL:DECODE` thread counts, each at least 1.
fn parse_thread_split(s: &str) -> Result<(usize, usize), String> {
    let (p, d) = s.split_once(':').ok_or("expected PREFILL:DECODE, e.g. 1:2")?;
    let n = |x: &str| match x.trim().parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!("`{x}` is not a thread count (1 or more)")),
    };
    Ok((n(p)?, n(d)?))
}

//! The engine loop: one thread owns the model, the paged KV cache and the scheduler, and
//! runs continuous batching — every step, all running sequences advance together in one
//! batched forward pass. Requests arrive on a channel; each streams [`GenerateEvent`]s back.
//! A request whose receiver is dropped is cancelled before the next step and its blocks are
//! freed at once.

use std::collections::{HashMap, VecDeque};
use std::panic::AssertUnwindSafe;
use std::path::Path;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use hearth_protocol::{
    namespace_root, BlockHash, EngineTimings, FinishReason, GenerateEvent, GenerateRequest, KvEvent, LoadReport,
    SamplingParams, Tier, TokenLogprob, Tokenizer, Usage, WorkerInfo,
};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use tokio::sync::{broadcast, oneshot, watch};

use crate::adapters::{AdapterCache, AdapterCacheConfig, AdapterRefused};
use crate::cuda::Device;
use crate::gguf::{tokenizer_spec, GgufError, GgufFile};
use crate::grammar::{Grammar, Grammars};
use crate::kernels::{cpu_features, isa, set_isa, Isa};
use crate::kv::{KvDtype, KvPool};
use crate::kv_tier::{BlockKey, DiskTier, DiskTierConfig, ReadBlock};
use crate::kv_transfer::{ImportError, ImportReport, KvBlock, KvLayout};
use crate::metrics::{EngineMetrics, Phase, StepKind};
use crate::models::{Batch, ForwardScratch, LoadOptions, LoraAdapter, Model, ModelConfig, ModelError};
use crate::sampling::Sampler;
use crate::scheduler::{Policy, Scheduler, SchedulerConfig, StepItem};
use crate::speculative::{Drafter, PromptLookup, Speculation};
use crate::text::TextStream;

/// At most this many alternatives per position (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: u32 = 20;
/// At most this many choices per request.
pub const MAX_N: u32 = 16;
/// How long a prefill worker holds a handed-off prompt's KV blocks for its decode worker
/// (released earlier when the decode worker has fetched them).
pub const HOLD_TTL: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    HuggingFace(#[from] crate::hf::HfError),
    #[error("tokenizer: {0}")]
    Tokenizer(#[from] hearth_protocol::TokenizeError),
    #[error("cannot start the engine: {0}")]
    Start(String),
}

/// Engine settings.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub threads: usize,
    /// KV cache size; `None`: a quarter of available memory, at most 1 GiB.
    pub kv_cache_mib: Option<usize>,
    /// Tokens per forward step (decodes + prefill chunks).
    pub max_batch_tokens: usize,
    /// Sequences decoded together.
    pub max_running: usize,
    /// Region label reported to gateways.
    pub region: String,
    /// How the KV cache stores keys and values.
    pub kv_dtype: KvDtype,
    /// The kernels' instruction set, set before the weights are repacked for it (None:
    /// keep the process's choice, by default the best this CPU runs).
    pub isa: Option<Isa>,
    /// Serve at most this context (prompt + output), at most the model's own, stretched
    /// by `rope_scaling` (None: the model's).
    pub max_context: Option<usize>,
    /// RoPE scaling instead of the file's: stretches the model's context (see
    /// [`crate::models::RopeScaling`]).
    pub rope_scaling: Option<crate::models::RopeScaling>,
    /// Map (or write) the on-disk cache of repacked weights beside the model.
    pub pack_cache: bool,
    /// How float weight matrices are computed (quantized to Q8_0 at load by default).
    pub float_weights: crate::models::FloatWeights,
    /// The queue limit in prompt tokens not yet computed (None: as many as the KV cache
    /// holds; 0: unbounded). Requests past it are refused as `overloaded` (see
    /// [`hearth_protocol::QueueState`]).
    pub max_queue_tokens: Option<usize>,
    /// Admission order: fair between tenants (default) or FIFO.
    pub policy: Policy,
    /// Speculative decoding: at most this many draft tokens (prompt lookup) verified per
    /// sequence and step (0: off for every request; a request opts out with
    /// `speculative: false`).
    pub speculative_tokens: usize,
    /// Where the forward pass runs: the CPU kernels, or a GPU through the CUDA backend
    /// (see [`crate::cuda`]; `kv_cache_mib` is then device memory).
    pub device: Device,
    /// With a CUDA device: replay decode steps from CUDA graphs.
    pub cuda_graphs: bool,
    /// A chat template to use instead of the model file's (the template's text).
    pub chat_template: Option<String>,
    /// The KV tier below the pool: evicted blocks kept on local disk (see
    /// [`crate::kv_tier`]); None: evicted blocks are dropped.
    pub kv_disk: Option<DiskTierConfig>,
    /// LoRA adapters loaded on demand (see [`crate::adapters`]).
    pub adapters: AdapterCacheConfig,
}

/// The most one read-back from the disk tier brings in (the rest of the prompt is computed).
const DISK_READ_MAX_BYTES: usize = 1 << 30;

/// The default draft length (see [`EngineConfig::speculative_tokens`]).
pub const DEFAULT_SPECULATIVE_TOKENS: usize = 6;

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            kv_cache_mib: None,
            max_batch_tokens: 512,
            max_running: 64,
            region: "local".into(),
            kv_dtype: KvDtype::default(),
            isa: None,
            max_context: None,
            rope_scaling: None,
            pack_cache: crate::pack_cache::enabled_by_env(),
            float_weights: Default::default(),
            max_queue_tokens: None,
            policy: Policy::default(),
            speculative_tokens: DEFAULT_SPECULATIVE_TOKENS,
            device: Device::Cpu,
            cuda_graphs: true,
            chat_template: None,
            kv_disk: None,
            adapters: AdapterCacheConfig::default(),
        }
    }
}

fn available_memory_mib() -> Option<usize> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024)
}

/// The text a generated token adds to the output: none for control tokens, unless the
/// request asks for theirs (`special_text`: tool-call delimiters, reasoning markers).
fn shown_bytes<'t>(tokenizer: &'t Tokenizer, tok: u32, special_text: &[u32]) -> &'t [u8] {
    if tokenizer.is_special(tok) && !special_text.contains(&tok) {
        &[]
    } else {
        tokenizer.token_bytes(tok).unwrap_or(&[])
    }
}

/// The KV cache an engine with `cfg` gets: (MiB, blocks).
fn kv_blocks(shape: crate::kv::KvShape, cfg: &EngineConfig) -> (usize, usize) {
    let mib = cfg
        .kv_cache_mib
        .unwrap_or_else(|| available_memory_mib().map_or(512, |m| (m / 4).min(1024)));
    (mib, ((mib << 20) / KvPool::block_bytes(shape, cfg.kv_dtype)).max(2))
}

/// The queue limit: configured, else what the KV cache holds.
fn queue_limit(kv_tokens: usize, cfg: &EngineConfig) -> u64 {
    cfg.max_queue_tokens.unwrap_or(kv_tokens) as u64
}

/// The queue limit ([`WorkerInfo::queue_tokens`]) an engine with `cfg` will have for this
/// model, from its metadata alone (0 when the file does not say enough).
pub fn queue_tokens_for(file: &GgufFile, cfg: &EngineConfig) -> u64 {
    let Ok(c) = ModelConfig::from_gguf(file) else {
        return cfg.max_queue_tokens.unwrap_or(0) as u64;
    };
    let bt = hearth_protocol::DEFAULT_BLOCK_TOKENS;
    queue_limit(kv_blocks(c.kv_shape(bt), cfg).1 * bt, cfg)
}

/// The context an engine with `cfg` serves for a model file, from its metadata alone: the
/// model's (stretched by `cfg.rope_scaling`), or `cfg.max_context` below it. A context
/// past the model's is refused, naming the scaling that would reach it.
pub fn served_context(file: &GgufFile, cfg: &EngineConfig) -> Result<usize, EngineError> {
    let mut c = ModelConfig::from_gguf(file)?;
    if let Some(s) = cfg.rope_scaling {
        c.set_rope_scaling(s);
    }
    Ok(c.served_context(cfg.max_context)?)
}

/// What a worker reports for a model file, from its metadata alone (no weights read): the
/// gateway can list, tokenize for and route to a model before it is loaded.
pub fn file_info(path: &Path, model_id: &str, region: &str) -> Result<WorkerInfo, EngineError> {
    file_info_of(&crate::hf::open_model(path)?, model_id, region)
}

/// [`file_info`] of a model already open.
pub fn file_info_of(file: &GgufFile, model_id: &str, region: &str) -> Result<WorkerInfo, EngineError> {
    let spec = tokenizer_spec(file)?;
    let (arch, context, kv) = match ModelConfig::from_gguf(file) {
        Ok(c) => (
            c.arch.name().to_string(),
            c.context_length as u32,
            Some(c.kv_footprint(KvDtype::default())),
        ),
        Err(_) => {
            let arch = file.get_str("general.architecture").unwrap_or("llama").to_string();
            let context = file.get_u64(&format!("{arch}.context_length")).unwrap_or(8192) as u32;
            (arch, context, None)
        }
    };
    Ok(WorkerInfo {
        model: model_id.to_string(),
        context_length: context,
        parameters: file.tensors.iter().map(|t| t.n_elements()).sum(),
        architecture: arch,
        block_tokens: hearth_protocol::DEFAULT_BLOCK_TOKENS as u32,
        region: region.to_string(),
        role: "both".into(),
        capacity: 0,
        queue_tokens: 0,
        tokenizer: spec,
        tenants: Vec::new(),
        kv,
    })
}

/// Counters the engine publishes after every step.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineStats {
    pub load: LoadReport,
    /// Prefix-cache lookups and hits, in blocks.
    pub prefix_queries: u64,
    pub prefix_hits: u64,
    pub preemptions: u64,
    pub steps: u64,
    /// LoRA adapters loaded now.
    pub adapters_loaded: usize,
    /// Their bytes in memory.
    pub adapter_bytes: usize,
    /// Adapters read from the store so far, and the seconds that took.
    pub adapter_loads: u64,
    pub adapter_load_seconds: f64,
    /// The device failed (CUDA): every request fails until the worker restarts, and the
    /// worker answers `/readyz` with 503.
    pub device_failed: bool,
}

struct Job {
    req: GenerateRequest,
    tx: UnboundedSender<GenerateEvent>,
    /// The engine's own channel, with a disk tier: a request whose prompt continues on disk
    /// comes back through it once the blocks are read.
    resend: Option<mpsc::Sender<Command>>,
}

enum Command {
    Generate(Box<Job>),
    Subscribe(oneshot::Sender<(KvEvent, broadcast::Receiver<KvEvent>)>),
    /// The bytes of the cached blocks with these hashes (None: not cached here).
    ExportBlocks(Vec<BlockHash>, oneshot::Sender<Vec<Option<Vec<u8>>>>),
    /// Which of these hashes are not cached here.
    MissingBlocks(Vec<BlockHash>, oneshot::Sender<Vec<BlockHash>>),
    /// Blocks in chain order, each with why it was already refused (its checksum), and the
    /// block they must follow (see [`EngineHandle::start_import`]).
    ImportBlocks(Vec<ReadBlock>, Option<BlockHash>, oneshot::Sender<ImportReport>),
    /// A request's blocks read back from the disk tier: import them, then admit it.
    DiskRead(Box<Job>, Vec<ReadBlock>),
    /// The decode worker has what a handed-off request held (or gave up on it).
    ReleaseHold(String),
}

/// A cheap, cloneable handle to a running engine.
#[derive(Clone)]
pub struct EngineHandle {
    info: Arc<WorkerInfo>,
    commands: mpsc::Sender<Command>,
    stats: watch::Receiver<EngineStats>,
    metrics: Arc<EngineMetrics>,
    load_seconds: f64,
    kv_capacity_tokens: usize,
    kv_bytes_per_token: usize,
    packed_bytes: usize,
    decode_weight_bytes: usize,
    repack_seconds: f64,
    kv_layout: KvLayout,
    tier: Option<Arc<DiskTier>>,
}

impl std::fmt::Debug for EngineHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineHandle").field("model", &self.info.model).finish()
    }
}

/// How much of a GGUF's start is read ahead before it is parsed where a pack cache holds its
/// matrices: the header and metadata (the default model's, with its vocabulary, are about
/// 2 MiB; a longer header's rest is read by the parse itself).
const GGUF_HEADER_READ_AHEAD: u64 = 8 << 20;

impl EngineHandle {
    /// Loads a GGUF model and starts the engine thread.
    pub fn load(path: &Path, model_id: &str, cfg: &EngineConfig) -> Result<Self, EngineError> {
        let started = Instant::now();
        if let Some(isa) = cfg.isa {
            set_isa(isa).map_err(|e| EngineError::Start(e.to_string()))?;
        }
        // A cold disk's reads overlap the load and the first prefill (see
        // `pack_cache::read_ahead`). Where a current pack cache holds the model's matrices,
        // the model file is read ahead only where the load still reads it: its header
        // (parsed next), then every tensor the cache does not hold (norms, biases, anything
        // not repacked; float matrices too with `--float-weights float`, which computes
        // them from the file), plus the embedding, whose rows are looked up; the cache
        // itself is read ahead as it is mapped. Reading the whole file as well doubled a
        // cold load's reads. (A cache written before `--float-weights` changed for a file
        // that mixes quantized and float matrices is refused when mapped: that one load
        // repacks from a file it did not read ahead.)
        let packed = match (path.is_file(), cfg.device) {
            (true, Device::Cpu) if cfg.pack_cache && isa().is_simd() => crate::pack_cache::cached_tensors(path),
            _ => None,
        };
        match packed {
            Some(_) => crate::pack_cache::read_ahead_parts(vec![(path.to_path_buf(), 0..GGUF_HEADER_READ_AHEAD)]),
            None if path.is_file() => crate::pack_cache::read_ahead(path),
            None => {}
        }
        let file = crate::hf::open_model(path)?;
        if let Some(packed) = &packed {
            let parts = file
                .tensors
                .iter()
                .filter(|t| {
                    let float = cfg.float_weights == crate::models::FloatWeights::Float && !t.ty.is_quantized();
                    !packed.contains(&(t.offset as u64)) || float || t.name == "token_embd.weight"
                })
                .map(|t| (path.to_path_buf(), t.offset as u64..(t.offset + t.len) as u64))
                .collect();
            crate::pack_cache::read_ahead_parts(parts);
        }
        let mut spec = tokenizer_spec(&file)?;
        if let Some(t) = &cfg.chat_template {
            spec.chat_template = Some(t.clone());
        }
        let opts = LoadOptions {
            pack_cache: cfg.pack_cache,
            float_weights: cfg.float_weights,
            rope_scaling: cfg.rope_scaling,
            max_context: cfg.max_context,
        };
        // The tokenizer's tables (a vocabulary and its merges: tens of thousands of strings)
        // are built beside the weights' load; neither needs the other. (A bad vocabulary is
        // then reported after the weights' load, not before it.)
        let (tokenizer, model) = std::thread::scope(|s| {
            let tokenizer = std::thread::Builder::new()
                .name("hearth-tokenizer".into())
                .spawn_scoped(s, || Tokenizer::from_spec(&spec));
            let model = match cfg.device {
                Device::Cpu => Model::load_options(file, opts),
                // The device keeps its own copy of the weights: no CPU repacking.
                Device::Cuda(_) => Model::load_unpacked(file, opts),
            };
            let tokenizer = match tokenizer {
                Ok(t) => t.join().unwrap_or_else(|p| std::panic::resume_unwind(p)),
                Err(_) => Tokenizer::from_spec(&spec),
            };
            (tokenizer, model)
        });
        let tokenizer = Arc::new(tokenizer?);
        let model = model?;
        tracing::info!(
            isa = %isa(),
            pack_cache = model.packed_from_cache(),
            cpu = %cpu_features(),
            repacked_mib = model.packed_bytes() >> 20,
            repack_ms = (model.repack_seconds() * 1000.0) as u64,
            repack_format = crate::kernels::packed::PACK_FORMAT,
            float_weights = cfg.float_weights.name(),
            "kernels"
        );
        let (packed_bytes, repack_seconds) = (model.packed_bytes(), model.repack_seconds());
        let decode_weight_bytes = model.decode_weight_bytes();
        let end_of_generation = tokenizer.end_of_generation().to_vec();
        let bt = hearth_protocol::DEFAULT_BLOCK_TOKENS;
        let c = &model.config;
        let block_bytes = KvPool::block_bytes(model.kv_shape(bt), cfg.kv_dtype);
        let context = model.config.served_context(cfg.max_context)?;
        let (compute, mib, num_blocks) = Compute::new(&model, cfg, bt, context)?;
        let shape = model.kv_shape(bt);
        let kv_layout = KvLayout {
            arch: model.arch(),
            rope: model.rope_fingerprint(),
            n_layers: shape.n_layers as u32,
            kv_dim: shape.kv_dim() as u32,
            head_dim: shape.head_dim as u32,
            block_tokens: bt as u32,
            dtype: cfg.kv_dtype.into(),
            latent: shape.latent,
        };
        let mut sched = Scheduler::new(
            SchedulerConfig {
                block_tokens: bt,
                max_batch_tokens: cfg.max_batch_tokens.max(1),
                max_running: cfg.max_running.max(1),
                policy: cfg.policy,
                ..Default::default()
            },
            num_blocks,
        );
        let queue_tokens = queue_limit(num_blocks * bt, cfg);
        let info = WorkerInfo {
            model: model_id.to_string(),
            architecture: c.arch.name().into(),
            context_length: context as u32,
            parameters: model.n_params(),
            block_tokens: bt as u32,
            region: cfg.region.clone(),
            role: "both".into(),
            capacity: cfg.max_running as u32,
            queue_tokens,
            tokenizer: spec,
            tenants: Vec::new(),
            kv: Some(c.kv_footprint(cfg.kv_dtype)),
        };
        let threads = rayon::ThreadPoolBuilder::new()
            .num_threads(cfg.threads.max(1))
            .thread_name(|i| format!("hearth-compute-{i}"))
            .build()
            .map_err(|e| EngineError::Start(e.to_string()))?;
        let (kv_tx, _) = broadcast::channel(4096);
        let (stats_tx, stats) = watch::channel(EngineStats::default());
        let metrics = Arc::new(EngineMetrics {
            expert_load: model.expert_load(),
            ..EngineMetrics::default()
        });
        let tier = match &cfg.kv_disk {
            None => None,
            Some(d) => {
                let weights = crate::pack_cache::source_id(path)
                    .map_or(0, |id| xxhash_rust::xxh3::xxh3_64(format!("{id:?}").as_bytes()));
                let t = DiskTier::open(d, model_id, weights, &kv_layout, kv_tx.clone(), metrics.kv_disk.clone())
                    .map_err(|e| EngineError::Start(format!("KV disk tier at {}: {e}", d.dir.display())))?;
                let u = t.usage();
                tracing::info!(
                    dir = %t.dir().display(),
                    capacity_gib = d.capacity_bytes as f64 / (1u64 << 30) as f64,
                    blocks = u.blocks,
                    "KV disk tier"
                );
                Some(Arc::new(t))
            }
        };
        sched.blocks.spilling = tier.is_some();
        let kv_capacity_tokens = num_blocks * bt;
        let kv_bytes_per_token = block_bytes / bt;
        let footprint = model.config.kv_footprint(cfg.kv_dtype);
        tracing::info!(
            kv_cache_mib = mib,
            kv_dtype = cfg.kv_dtype.name(),
            blocks = num_blocks,
            tokens = kv_capacity_tokens,
            layout = ?footprint.layout,
            bytes_per_token = footprint.bytes_per_token,
            full_attention_bytes_per_token = footprint.full_attention_bytes_per_token,
            "KV cache"
        );
        let grammars = Grammars::new(tokenizer.clone(), model.config.vocab_size, end_of_generation.clone());
        let mut runner = Runner {
            model,
            context,
            tokenizer,
            grammars,
            drafter: PromptLookup::default(),
            speculative_tokens: cfg.speculative_tokens,
            model_id: model_id.to_string(),
            end_of_generation,
            compute,
            sched,
            requests: HashMap::new(),
            owner: HashMap::new(),
            next_id: 0,
            kv_tx,
            stats_tx,
            metrics: metrics.clone(),
            steps: 0,
            cuts_in_a_row: 0,
            last_load: (LoadReport::default(), Instant::now()),
            last_adapters: (0, 0),
            holds: HashMap::new(),
            queue_tokens,
            tier: tier.clone(),
            adapters: AdapterCache::new(cfg.adapters.clone()),
            adapter_waiting: VecDeque::new(),
            adapter_released: false,
            adapter_retrying: false,
        };
        let (commands, rx) = mpsc::channel::<Command>();
        std::thread::Builder::new()
            .name("hearth-engine".into())
            .spawn(move || threads.install(|| runner.run(rx)))
            .map_err(|e| EngineError::Start(e.to_string()))?;
        Ok(Self {
            info: Arc::new(info),
            commands,
            stats,
            metrics,
            load_seconds: started.elapsed().as_secs_f64(),
            kv_capacity_tokens,
            kv_bytes_per_token,
            packed_bytes,
            decode_weight_bytes,
            repack_seconds,
            kv_layout,
            tier,
        })
    }

    /// What the disk tier holds (None without one).
    pub fn kv_disk_usage(&self) -> Option<crate::kv_tier::TierUsage> {
        self.tier.as_ref().map(|t| t.usage())
    }

    /// The disk tier (tests, benchmarks).
    pub fn kv_disk(&self) -> Option<&DiskTier> {
        self.tier.as_deref()
    }

    /// Seconds of the load spent repacking weights.
    pub fn repack_seconds(&self) -> f64 {
        self.repack_seconds
    }

    /// Bytes of weights repacked for the SIMD kernels.
    pub fn packed_bytes(&self) -> usize {
        self.packed_bytes
    }

    /// Weight bytes one decode step reads (see `Model::decode_weight_bytes`).
    pub fn decode_weight_bytes(&self) -> usize {
        self.decode_weight_bytes
    }

    pub fn info(&self) -> &WorkerInfo {
        &self.info
    }

    /// Seconds from opening the file to ready.
    pub fn load_seconds(&self) -> f64 {
        self.load_seconds
    }

    pub fn kv_capacity_tokens(&self) -> usize {
        self.kv_capacity_tokens
    }

    /// Bytes the KV pool reserves (touched only as it fills).
    pub fn kv_cache_bytes(&self) -> usize {
        self.kv_capacity_tokens * self.kv_bytes_per_token
    }

    pub fn stats(&self) -> EngineStats {
        *self.stats.borrow()
    }

    /// Per-request timing histograms (queue, prefill, decode).
    pub fn metrics(&self) -> Arc<EngineMetrics> {
        self.metrics.clone()
    }

    /// Queues a request; events arrive on the returned channel, ending with `Done` or
    /// `Error`. Dropping the receiver cancels the request.
    pub fn generate(&self, req: GenerateRequest) -> UnboundedReceiver<GenerateEvent> {
        let (tx, rx) = unbounded_channel();
        let resend = self.tier.as_ref().map(|_| self.commands.clone());
        if let Err(mpsc::SendError(Command::Generate(job))) =
            self.commands.send(Command::Generate(Box::new(Job { req, tx, resend })))
        {
            let _ = job.tx.send(GenerateEvent::Error {
                code: "engine_stopped".into(),
                message: "the engine is not running".into(),
            });
        }
        rx
    }

    /// What another engine's KV blocks must match to be imported here.
    pub fn kv_layout(&self) -> KvLayout {
        self.kv_layout
    }

    /// The prefix-cache hashes of a prompt's full blocks (all but its last token), as this
    /// engine and the gateway compute them.
    pub fn prompt_block_hashes(&self, prompt: &[u32], cache_namespace: &str) -> Vec<BlockHash> {
        let root = namespace_root(&self.info.model, cache_namespace);
        hearth_protocol::block_hashes(
            root,
            &prompt[..prompt.len().saturating_sub(1)],
            self.kv_layout.block_tokens as usize,
        )
    }

    /// Copies out the cached blocks with these hashes (None for those not cached), each with
    /// its checksum.
    pub async fn export_blocks(&self, hashes: Vec<BlockHash>) -> Result<Vec<Option<KvBlock>>, ImportError> {
        let (tx, rx) = oneshot::channel();
        self.commands
            .send(Command::ExportBlocks(hashes.clone(), tx))
            .map_err(|_| ImportError::Stopped)?;
        let data = rx.await.map_err(|_| ImportError::Stopped)?;
        Ok(hashes
            .into_iter()
            .zip(data)
            .map(|(h, d)| d.map(|d| KvBlock::new(h, d)))
            .collect())
    }

    /// Which of these hashes this engine does not hold (the blocks worth sending).
    pub async fn missing_blocks(&self, hashes: Vec<BlockHash>) -> Result<Vec<BlockHash>, ImportError> {
        let (tx, rx) = oneshot::channel();
        self.commands
            .send(Command::MissingBlocks(hashes, tx))
            .map_err(|_| ImportError::Stopped)?;
        rx.await.map_err(|_| ImportError::Stopped)
    }

    /// Imports blocks exported by an engine with the same `layout` into the prefix cache
    /// (see [`crate::kv_transfer`]).
    pub async fn import_blocks(&self, layout: KvLayout, blocks: Vec<KvBlock>) -> Result<ImportReport, ImportError> {
        self.start_import(layout, blocks, None)?
            .await
            .map_err(|_| ImportError::Stopped)
    }

    /// Checks the blocks' checksums here (off the engine thread) and queues their import;
    /// the report comes when the engine has written them, so a transfer receives its next
    /// blocks meanwhile. Imports are done in the order they are started. `after`: the
    /// block these continue a chain from — if the engine does not hold it by then (an
    /// earlier import stopped short, or it was evicted), none of these is imported, since
    /// a prefix is reused only up to its first missing block.
    pub fn start_import(
        &self,
        layout: KvLayout,
        blocks: Vec<KvBlock>,
        after: Option<BlockHash>,
    ) -> Result<oneshot::Receiver<ImportReport>, ImportError> {
        if layout != self.kv_layout {
            return Err(ImportError::Layout {
                ours: self.kv_layout,
                theirs: layout,
            });
        }
        let checked = blocks
            .into_iter()
            .map(|b| {
                let why = (!b.intact()).then(|| "checksum mismatch".to_string());
                (b, why, None)
            })
            .collect();
        let (tx, rx) = oneshot::channel();
        self.commands
            .send(Command::ImportBlocks(checked, after, tx))
            .map_err(|_| ImportError::Stopped)?;
        Ok(rx)
    }

    /// Releases the KV blocks a prefill-only request held for its decode worker (see
    /// [`GenerateRequest::prefill_only`]); unknown or expired holds are ignored.
    pub fn release_hold(&self, hold: &str) {
        let _ = self.commands.send(Command::ReleaseHold(hold.to_string()));
    }

    /// The cache's current content (a `Snapshot`) and every change after it, with no gap.
    pub async fn subscribe_kv(&self) -> Option<(KvEvent, broadcast::Receiver<KvEvent>)> {
        let (tx, rx) = oneshot::channel();
        self.commands.send(Command::Subscribe(tx)).ok()?;
        rx.await.ok()
    }
}

fn error(code: &str, message: String) -> GenerateEvent {
    GenerateEvent::Error {
        code: code.into(),
        message,
    }
}

struct Choice {
    seq: Option<u64>,
    sampler: Sampler,
    text: TextStream,
    generated: usize,
    finish: Option<FinishReason>,
    /// Constrained decoding: the choice's own grammar state.
    grammar: Option<Grammar>,
    /// Speculative decoding's draft length for this choice (off: 0).
    spec: Speculation,
}

struct Request {
    request_id: String,
    tx: UnboundedSender<GenerateEvent>,
    params: SamplingParams,
    max_tokens: usize,
    prompt_len: usize,
    cached_tokens: usize,
    n: u32,
    forked: bool,
    /// Ends after the first token with `Handoff` (disaggregated prefill).
    prefill_only: bool,
    /// The LoRA adapter every token runs under.
    adapter: Option<Arc<LoraAdapter>>,
    choices: Vec<Choice>,
    started: Instant,
    /// The first step that computed any of it (queue time ends here).
    scheduled: Option<Instant>,
    first_token: Option<Instant>,
}

/// Where the forward pass runs, with the KV pool it writes.
enum Compute {
    Cpu {
        pool: KvPool,
        scratch: ForwardScratch,
    },
    #[cfg(feature = "cuda")]
    Cuda(Box<crate::cuda::CudaCompute>),
}

impl Compute {
    /// The compute for `cfg.device`, its KV cache's MiB and blocks.
    fn new(model: &Model, cfg: &EngineConfig, bt: usize, context: usize) -> Result<(Self, usize, usize), EngineError> {
        match cfg.device {
            Device::Cpu => {
                let (mib, num_blocks) = kv_blocks(model.kv_shape(bt), cfg);
                let pool = KvPool::new(model.kv_shape(bt), cfg.kv_dtype, num_blocks);
                Ok((
                    Compute::Cpu {
                        pool,
                        scratch: ForwardScratch::default(),
                    },
                    mib,
                    num_blocks,
                ))
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(ordinal) => {
                if cfg.kv_dtype != KvDtype::F16 {
                    return Err(EngineError::Start("the CUDA backend keeps its KV cache in f16".into()));
                }
                // Rows a step carries: at most the token budget (draft tokens share it).
                let max_rows = cfg.max_batch_tokens.max(1);
                let options = crate::cuda::CudaOptions {
                    ordinal,
                    kv_cache_mib: cfg.kv_cache_mib,
                    max_rows,
                    context,
                    block_tokens: bt,
                    graphs: cfg.cuda_graphs,
                };
                let c =
                    crate::cuda::CudaCompute::new(model, &options).map_err(|e| EngineError::Start(e.to_string()))?;
                let (mib, blocks) = (c.report().kv_cache_mib, c.num_blocks());
                Ok((Compute::Cuda(Box::new(c)), mib, blocks))
            }
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(_) => {
                let _ = context; // what the CUDA backend would size its block tables by
                Err(EngineError::Start(
                    "this build has no CUDA backend (build hearth with `--features cuda`)".into(),
                ))
            }
        }
    }

    /// One step; `Ok(None)` if `stop` gave it up between layers (the CPU backend asks
    /// before each layer; a GPU step is short and runs whole).
    fn forward(
        &mut self,
        model: &Model,
        batch: &Batch<'_>,
        stop: &mut dyn FnMut(usize) -> bool,
    ) -> Result<Option<Vec<f32>>, String> {
        match self {
            Compute::Cpu { pool, scratch } => Ok(model.forward_batch_until(batch, pool, scratch, stop)),
            #[cfg(feature = "cuda")]
            Compute::Cuda(c) => {
                let _ = stop;
                c.forward(batch).map(Some).map_err(|e| e.to_string())
            }
        }
    }

    /// Whether the device is out of service (see [`crate::cuda::CudaCompute`]).
    fn failed(&self) -> bool {
        match self {
            Compute::Cpu { .. } => false,
            #[cfg(feature = "cuda")]
            Compute::Cuda(c) => c.failure().is_some(),
        }
    }

    /// A block's bytes (None: the device failed to give them).
    fn read_block(&mut self, block: u32) -> Option<Vec<u8>> {
        match self {
            Compute::Cpu { pool, .. } => Some(pool.read_block(block)),
            #[cfg(feature = "cuda")]
            Compute::Cuda(c) => c
                .read_block(block)
                .inspect_err(|e| tracing::error!(error = %e, "reading a KV block from the device failed"))
                .ok(),
        }
    }

    fn write_block(&mut self, block: u32, data: &crate::kv_transfer::BlockData) -> bool {
        match self {
            Compute::Cpu { pool, .. } => pool.write_block(block, data.parts()),
            #[cfg(feature = "cuda")]
            Compute::Cuda(c) => c
                .write_block(block, &data.to_vec())
                .inspect_err(|e| tracing::error!(error = %e, "writing a KV block to the device failed"))
                .unwrap_or(false),
        }
    }

    /// A failed copy on the device puts the device out of service, so the next step fails
    /// its requests instead of computing on a block that was not copied.
    fn copy_block(&mut self, from: u32, to: u32) {
        match self {
            Compute::Cpu { pool, .. } => pool.copy_block(from, to),
            #[cfg(feature = "cuda")]
            Compute::Cuda(c) => {
                if let Err(e) = c.copy_block(from, to) {
                    tracing::error!(error = %e, "copying a KV block on the device failed");
                }
            }
        }
    }
}

/// What the engine thread owns.
struct Runner {
    model: Model,
    /// The context served (the model's, or less by configuration).
    context: usize,
    tokenizer: Arc<Tokenizer>,
    /// Compiles constrained requests' grammars (tables built on first use).
    grammars: Grammars,
    /// Proposes speculative decoding's draft tokens.
    drafter: PromptLookup,
    /// The most draft tokens per sequence and step (0: no speculation).
    speculative_tokens: usize,
    model_id: String,
    end_of_generation: Vec<u32>,
    compute: Compute,
    sched: Scheduler,
    /// By request key (the id of its first sequence).
    requests: HashMap<u64, Request>,
    /// Sequence → (request key, choice index).
    owner: HashMap<u64, (u64, usize)>,
    next_id: u64,
    kv_tx: broadcast::Sender<KvEvent>,
    stats_tx: watch::Sender<EngineStats>,
    metrics: Arc<EngineMetrics>,
    steps: u64,
    /// Steps cut short in a row (see [`Runner::step`]).
    cuts_in_a_row: u32,
    last_load: (LoadReport, Instant),
    /// Adapter loads and adapters loaded when [`KvEvent::Adapters`] was last sent.
    last_adapters: (u64, usize),
    /// Blocks held for decode workers, by the prefill request's id, until released or
    /// [`HOLD_TTL`] passes.
    holds: HashMap<String, (Vec<u32>, Instant)>,
    /// The queue limit (0: unbounded), as reported in [`WorkerInfo::queue_tokens`].
    queue_tokens: u64,
    /// The KV tier below the pool.
    tier: Option<Arc<DiskTier>>,
    /// LoRA adapters, loaded on demand.
    adapters: AdapterCache,
    /// Requests whose adapter waits for room in the adapter cache, in arrival order.
    adapter_waiting: VecDeque<Job>,
    /// A request holding an adapter ended since the waiting requests were last tried.
    adapter_released: bool,
    /// The waiting requests are being tried (admission order is theirs, not a newcomer's).
    adapter_retrying: bool,
}

impl Runner {
    fn run(&mut self, rx: mpsc::Receiver<Command>) {
        loop {
            // Idle, unless a released adapter lets waiting requests in.
            if self.sched.is_idle() && !self.adapter_released {
                // Holds expire even while nothing runs.
                let cmd = if self.holds.is_empty() {
                    rx.recv().map_err(|_| mpsc::RecvTimeoutError::Disconnected)
                } else {
                    rx.recv_timeout(Duration::from_secs(1))
                };
                match cmd {
                    Ok(cmd) => self.command(cmd),
                    Err(mpsc::RecvTimeoutError::Timeout) => {}
                    Err(mpsc::RecvTimeoutError::Disconnected) => return, // every handle dropped
                }
            }
            let t = Instant::now();
            self.expire_holds();
            self.admit_adapter_waiting();
            self.metrics.spend(Phase::Commands, t.elapsed());
            while let Ok(cmd) = rx.try_recv() {
                self.command(cmd);
            }
            let t = Instant::now();
            self.reap_cancelled();
            self.metrics.spend(Phase::Commands, t.elapsed());
            if self.sched.is_idle() {
                self.publish();
                continue;
            }
            self.step(&rx);
            self.publish();
        }
    }

    /// Once a request holding an adapter has ended, admits the requests that waited for
    /// room in the adapter cache, in order, until one finds none (it and those behind it
    /// wait on; those whose client left are dropped).
    fn admit_adapter_waiting(&mut self) {
        if !std::mem::take(&mut self.adapter_released) {
            return;
        }
        self.adapter_retrying = true;
        for job in std::mem::take(&mut self.adapter_waiting) {
            if job.tx.is_closed() {
                continue;
            }
            if self.adapter_waiting.is_empty() {
                self.admit(job);
            } else {
                self.adapter_waiting.push_back(job);
            }
        }
        self.adapter_retrying = false;
    }

    /// [`Self::apply`], timed as the commands phase.
    fn command(&mut self, cmd: Command) {
        let t = Instant::now();
        self.apply(cmd);
        self.metrics.spend(Phase::Commands, t.elapsed());
    }

    fn apply(&mut self, cmd: Command) {
        match cmd {
            Command::Generate(job) => self.admit(*job),
            Command::Subscribe(reply) => {
                // Subscribe before the snapshot: the disk tier's threads publish too, and an
                // event in between is then replayed (harmless) rather than lost.
                let events = self.kv_tx.subscribe();
                let snap = KvEvent::Snapshot {
                    block_tokens: self.sched.config().block_tokens as u32,
                    blocks: self.sched.blocks.cached_hashes(),
                    load: self.sched.load(),
                    disk: self.tier.as_ref().map_or_else(Vec::new, |t| t.hashes()),
                    adapters: self.adapters.digests(),
                };
                let _ = reply.send((snap, events));
            }
            Command::ExportBlocks(hashes, reply) => {
                // Copies only: checksums are taken off the engine thread.
                let blocks = hashes
                    .into_iter()
                    .map(|h| self.compute.read_block(self.sched.blocks.peek(h)?))
                    .collect();
                let _ = reply.send(blocks);
            }
            Command::MissingBlocks(hashes, reply) => {
                let missing = hashes.into_iter().filter(|h| !self.sched.blocks.contains(*h)).collect();
                let _ = reply.send(missing);
            }
            Command::ImportBlocks(blocks, after, reply) => {
                let report = match after {
                    Some(h) if !self.sched.blocks.contains(h) => ImportReport {
                        rejected: blocks
                            .into_iter()
                            .map(|(b, ..)| (b.hash, "follows a block that is not held".to_string()))
                            .collect(),
                        ..Default::default()
                    },
                    _ => self.import(blocks),
                };
                let _ = reply.send(report);
                // Announce the new cached blocks now, not at the next step (timed as part
                // of this command).
                self.announce();
            }
            Command::DiskRead(job, blocks) => {
                let report = self.import(blocks);
                if !report.rejected.is_empty() {
                    tracing::debug!(request_id = %job.req.request_id, rejected = ?report.rejected, "disk tier read-back cut short; the rest is recomputed");
                }
                self.admit(*job);
            }
            Command::ReleaseHold(id) => {
                if let Some((blocks, _)) = self.holds.remove(&id) {
                    self.release_blocks(blocks);
                }
            }
        }
    }

    /// Tail first, as a finished sequence releases its blocks.
    fn release_blocks(&mut self, blocks: Vec<u32>) {
        for b in blocks.into_iter().rev() {
            self.sched.blocks.release(b);
        }
    }

    fn expire_holds(&mut self) {
        if self.holds.is_empty() {
            return;
        }
        let now = Instant::now();
        let expired: Vec<String> = self
            .holds
            .iter()
            .filter(|(_, (_, until))| *until <= now)
            .map(|(id, _)| id.clone())
            .collect();
        for id in expired {
            tracing::warn!(request_id = %id, "no decode worker fetched the handed-off KV blocks; released");
            if let Some((blocks, _)) = self.holds.remove(&id) {
                self.release_blocks(blocks);
            }
        }
    }

    /// Writes intact blocks not held yet into free (or evicted) blocks and names them in
    /// the prefix cache, unreferenced: reusable by the next request, evictable like any
    /// cached block.
    ///
    /// Blocks are a prompt's chain in order (checksums already verified): the import stops at
    /// the first one it cannot write, since a prefix is reused only up to its first missing
    /// block. The blocks written stay referenced until the end, so that making room for a
    /// later block never evicts an earlier one of the same import; they are then released
    /// last-first, so that the cache evicts a prefix's tail before its head.
    fn import(&mut self, blocks: Vec<ReadBlock>) -> ImportReport {
        let mut report = ImportReport::default();
        let mut held = Vec::new();
        let mut gap = false;
        for (block, rejected, spill) in blocks {
            if gap {
                report
                    .rejected
                    .push((block.hash, "follows a block that could not be imported".into()));
                continue;
            }
            if self.sched.blocks.contains(block.hash) {
                report.already_held += 1;
                continue;
            }
            if let Some(why) = rejected {
                report.rejected.push((block.hash, why));
                gap = true;
                continue;
            }
            let Some(b) = self.sched.blocks.allocate() else {
                report.rejected.push((block.hash, "no free KV block".into()));
                gap = true;
                continue;
            };
            // The block may have been evicted for this: save it before it is overwritten.
            self.spill_evicted();
            if self.compute.write_block(b, &block.data) {
                self.sched.blocks.register_spillable(b, block.hash, spill);
                report.imported += 1;
                report.bytes += block.data.len() as u64;
            } else {
                report.rejected.push((block.hash, "wrong block size".into()));
                gap = true;
            }
            held.push(b);
        }
        for b in held.into_iter().rev() {
            self.sched.blocks.release(b);
        }
        report
    }

    fn validate(&self, req: &GenerateRequest) -> Result<(), GenerateEvent> {
        if req.model != self.model_id {
            return Err(error(
                "model_not_found",
                format!("this worker serves {:?}, not {:?}", self.model_id, req.model),
            ));
        }
        if req.prompt.is_empty() {
            return Err(error("invalid_prompt", "the prompt is empty".into()));
        }
        let vocab = self.model.config.vocab_size as u32;
        if let Some(bad) = req.prompt.iter().find(|&&t| t >= vocab) {
            return Err(error(
                "invalid_prompt",
                format!("token id {bad} is outside the vocabulary (size {vocab})"),
            ));
        }
        let ctx = self.context.min(self.sched.capacity_tokens());
        if req.prompt.len() >= ctx {
            return Err(error(
                "context_length_exceeded",
                format!("the prompt has {} tokens; this worker can hold {ctx}", req.prompt.len()),
            ));
        }
        if req.n == 0 || req.n > MAX_N {
            return Err(error("invalid_request", format!("n must be between 1 and {MAX_N}")));
        }
        if (req.prefill_only || !req.resume.is_empty()) && req.n != 1 {
            return Err(error(
                "invalid_request",
                "a disaggregated request (prefill_only or resume) has n = 1".into(),
            ));
        }
        if let Some(bad) = req.resume.iter().find(|&&t| t >= vocab) {
            return Err(error(
                "invalid_request",
                format!("resumed token id {bad} is outside the vocabulary (size {vocab})"),
            ));
        }
        if req.prompt.len() + req.resume.len() >= ctx || req.resume.len() >= req.sampling.max_tokens.max(1) as usize {
            return Err(error(
                "invalid_request",
                format!(
                    "{} resumed tokens leave nothing to generate (max_tokens {}, context {ctx})",
                    req.resume.len(),
                    req.sampling.max_tokens
                ),
            ));
        }
        if req.sampling.top_logprobs > MAX_TOP_LOGPROBS {
            return Err(error(
                "invalid_request",
                format!("top_logprobs must be at most {MAX_TOP_LOGPROBS}"),
            ));
        }
        Ok(())
    }

    /// Copies the blocks the pool just evicted, or reused for the first time, to the disk
    /// tier (the copy is the engine's only cost: the write happens on the tier's thread).
    fn spill_evicted(&mut self) {
        let evicted = self.sched.blocks.take_evicted();
        let Some(tier) = &self.tier else { return };
        for (b, h, spill) in evicted {
            // Only what the tier lacks (or holds in its older half, about to age out): no
            // copy for a block whose fresh copy is already on disk.
            if tier.wants(&spill.key) {
                if let Some(data) = self.compute.read_block(b) {
                    tier.spill(h, spill, data);
                }
            }
        }
    }

    /// With a disk tier: the run of the prompt's full blocks that the pool lacks and the
    /// disk holds, from the first block the pool lacks.
    fn disk_run(&self, tier: &DiskTier, req: &GenerateRequest) -> Vec<(BlockKey, BlockHash)> {
        let bt = self.sched.config().block_tokens;
        let tokens: Vec<u32> = req.prompt.iter().chain(&req.resume).copied().collect();
        let full = tokens.len().saturating_sub(1) / bt;
        let namespace = req.kv_namespace();
        let mut h = namespace_root(&self.model_id, &namespace);
        let mut key = BlockKey::root(&self.model_id, &namespace);
        let mut run = Vec::new();
        let mut leading = 0;
        // No more than the pool can take without evicting the prompt's own leading blocks
        // (with room for its last, partial block), nor more than 1 GiB in one read.
        let room = self.sched.blocks.available().saturating_sub(2);
        let cap = (DISK_READ_MAX_BYTES / tier.block_bytes().max(1)).max(1);
        for i in 0..full {
            let block = &tokens[i * bt..(i + 1) * bt];
            h = hearth_protocol::chain(h, block);
            key = key.chain(block);
            if run.is_empty() && self.sched.blocks.contains(h) {
                leading += 1;
                continue;
            }
            if run.len() >= cap || run.len() + leading >= room || !tier.contains(&key) {
                break;
            }
            run.push((key, h));
        }
        run
    }

    fn admit(&mut self, mut job: Job) {
        if let Err(e) = self.validate(&job.req) {
            let _ = job.tx.send(e);
            return;
        }
        let adapter = match &job.req.adapter {
            None => None,
            Some(_) if !matches!(self.compute, Compute::Cpu { .. }) => {
                let _ = job.tx.send(error(
                    "adapter_unavailable",
                    "LoRA adapters are served by CPU workers only".into(),
                ));
                return;
            }
            // Behind requests already waiting for room: arrival order is kept.
            Some(_) if !self.adapter_retrying && !self.adapter_waiting.is_empty() => {
                self.adapter_waiting.push_back(job);
                return;
            }
            Some(r) => match self.adapters.get(r, &self.model) {
                Ok(a) => Some(a),
                Err(AdapterRefused::Busy) => {
                    self.adapter_waiting.push_back(job);
                    return;
                }
                Err(AdapterRefused::Failed { code, message }) => {
                    tracing::warn!(request_id = %job.req.request_id, adapter = %r.name, code, error = %message, "adapter refused");
                    let _ = job.tx.send(error(code, message));
                    return;
                }
            },
        };
        if let (Some(tier), Some(resend)) = (self.tier.clone(), job.resend.take()) {
            let run = self.disk_run(&tier, &job.req);
            if !run.is_empty() {
                // The request waits for its blocks off this thread, then comes back.
                let job = Box::new(job);
                tier.read(
                    run,
                    Box::new(move |blocks| {
                        let _ = resend.send(Command::DiskRead(job, blocks));
                    }),
                );
                return;
            }
        }
        let Job { req, tx, .. } = job;
        let namespace = req.kv_namespace().into_owned();
        let queue = self.sched.queue_state(&req.qos.tenant, self.queue_tokens);
        if let Err(shed) = queue.admit(req.qos.priority, req.prompt.len() as u64) {
            self.metrics.shed(req.qos.priority).inc();
            let _ = tx.send(error(
                "overloaded",
                format!(
                    "this worker's queue is full for {} work ({} of {} prompt tokens queued; {} must drain first)",
                    req.qos.priority, queue.queued, queue.limit, shed.excess
                ),
            ));
            return;
        }
        let grammar = match &req.constraint {
            None => None,
            Some(c) => match self.grammars.compile(c) {
                Ok(g) => Some(g),
                Err(e) => {
                    let _ = tx.send(error(e.code(), e.to_string()));
                    return;
                }
            },
        };
        let ctx = self.context.min(self.sched.capacity_tokens());
        let max_tokens = (req.sampling.max_tokens as usize).min(ctx - req.prompt.len()).max(1);
        let id = self.next_id;
        self.next_id += 1;
        // Speculation serves one choice decoding on this worker.
        let draft_tokens = if req.sampling.speculative && req.n == 1 && !req.prefill_only {
            self.speculative_tokens
        } else {
            0
        };
        let mut choices: Vec<Choice> = (0..req.n)
            .map(|i| {
                let mut p = req.sampling.clone();
                p.seed = p.seed.map(|s| s.wrapping_add(i as u64));
                Choice {
                    seq: None,
                    sampler: Sampler::new(&p),
                    text: TextStream::new(&p.stop),
                    generated: 0,
                    finish: None,
                    grammar: grammar.clone(),
                    spec: Speculation::new(draft_tokens),
                }
            })
            .collect();
        // Resumed tokens were sent by the prefill worker: the text stream takes them in
        // (what it releases was sent), so it holds back exactly what the prefill worker's
        // stream held back.
        for &t in &req.resume {
            let c = &mut choices[0];
            c.generated += 1;
            c.sampler.skip();
            if let Some(g) = c.grammar.as_mut() {
                g.advance(t);
            }
            c.text.push(shown_bytes(&self.tokenizer, t, &req.sampling.special_text));
        }
        let mut r = Request {
            request_id: req.request_id,
            tx,
            params: req.sampling,
            max_tokens,
            prompt_len: req.prompt.len(),
            cached_tokens: 0,
            n: req.n,
            forked: req.n == 1,
            prefill_only: req.prefill_only,
            adapter,
            choices,
            started: Instant::now(),
            scheduled: None,
            first_token: None,
        };
        r.choices[0].seq = Some(id);
        self.owner.insert(id, (id, 0));
        let mut tokens = req.prompt;
        tokens.extend_from_slice(&req.resume);
        self.sched
            .add_for(id, tokens, namespace_root(&self.model_id, &namespace), &req.qos);
        if self.tier.is_some() {
            self.sched.set_key_root(id, BlockKey::root(&self.model_id, &namespace));
        }
        self.requests.insert(id, r);
    }

    fn drop_request(&mut self, key: u64) {
        if let Some(r) = self.requests.remove(&key) {
            self.adapter_released |= r.adapter.is_some();
            for c in &r.choices {
                if let Some(s) = c.seq {
                    self.sched.remove(s);
                    self.owner.remove(&s);
                }
            }
        }
    }

    fn reap_cancelled(&mut self) {
        let gone: Vec<u64> = self
            .requests
            .iter()
            .filter(|(_, r)| r.tx.is_closed())
            .map(|(k, _)| *k)
            .collect();
        for key in gone {
            tracing::debug!(request_id = %self.requests[&key].request_id, "consumer gone; generation cancelled");
            self.drop_request(key);
        }
    }

    /// Proposes draft tokens for every decoding sequence that speculates (prompt lookup
    /// over its own tokens, no longer than what it may still generate).
    fn propose_drafts(&mut self) {
        if self.speculative_tokens == 0 {
            return;
        }
        let mut drafts = Vec::new();
        for r in self.requests.values_mut() {
            let room = r.max_tokens.saturating_sub(r.choices[0].generated + 1);
            let ch = &mut r.choices[0];
            let (Some(id), false) = (ch.seq, ch.spec.is_off()) else {
                continue;
            };
            let Some(seq) = self.sched.get(id) else { continue };
            if seq.computed + 1 != seq.tokens.len() {
                continue; // waiting or prefilling
            }
            let k = ch.spec.draft_len().min(room);
            let draft = match ch.grammar.as_mut() {
                None => self.drafter.draft(&seq.tokens, k),
                Some(g) => {
                    // What the grammar forces is certain (a JSON key, its `": "`); the
                    // context's guess follows, cut where the grammar would refuse it.
                    let started = Instant::now();
                    // (Forced tokens are drafted even while the lookup is paused.)
                    let mut draft = g.forced(self.speculative_tokens.min(room));
                    let more = k.saturating_sub(draft.len());
                    if more > 0 {
                        let mut ctx = seq.tokens.clone();
                        ctx.extend_from_slice(&draft);
                        draft.extend(self.drafter.draft(&ctx, more));
                    }
                    let n = g.valid_prefix(&draft);
                    draft.truncate(n);
                    self.metrics
                        .grammar_mask_seconds
                        .inc_by(started.elapsed().as_secs_f64());
                    draft
                }
            };
            if !draft.is_empty() {
                drafts.push((id, draft));
            }
        }
        for (id, draft) in drafts {
            self.sched.set_draft(id, draft);
        }
    }

    /// Plans and runs one step. Commands that arrive while it runs are taken between layers
    /// and carried out after it; one that brings an interactive request while the step
    /// computes prompt tokens of work it outranks — batch work, or a tenant it would preempt
    /// ([`Scheduler::interrupts`]) — cuts the step short, at most
    /// [`crate::scheduler::MAX_CUTS_IN_A_ROW`] steps in a row so that running work always
    /// progresses.
    fn step(&mut self, rx: &mpsc::Receiver<Command>) {
        let planned = Instant::now();
        self.propose_drafts();
        let items = self.sched.schedule();
        // Evicted blocks go to the tier below before this step (or a fork's copy) overwrites them.
        self.spill_evicted();
        for (from, to) in std::mem::take(&mut self.sched.pending_copies) {
            self.compute.copy_block(from, to);
        }
        if items.is_empty() {
            // Only possible when every waiting request is larger than the free cache while
            // nothing runs; validation prevents it, but never spin.
            self.metrics.spend(Phase::Plan, planned.elapsed());
            std::thread::sleep(Duration::from_millis(1));
            return;
        }
        let now = Instant::now();
        for it in &items {
            if let Some(r) = self.owner.get(&it.seq).and_then(|o| self.requests.get_mut(&o.0)) {
                if r.scheduled.is_none() {
                    r.scheduled = Some(now);
                    EngineMetrics::observe(&self.metrics.queue, now - r.started);
                }
            }
        }
        let mut tokens = Vec::new();
        let mut positions = Vec::new();
        let mut row_seq = Vec::new();
        let mut logit_rows = Vec::new();
        // The draft tokens each item verifies (positions past the sequence's tokens).
        let mut drafts: Vec<Vec<u32>> = Vec::with_capacity(items.len());
        for it in &items {
            let Some(seq) = self.sched.get(it.seq) else {
                drafts.push(Vec::new());
                continue;
            };
            let draft = seq.draft[..it.draft.min(seq.draft.len())].to_vec();
            for p in it.start..it.start + it.len {
                let t = match seq.tokens.get(p) {
                    Some(&t) => t,
                    None => draft.get(p - seq.tokens.len()).copied().unwrap_or(0),
                };
                tokens.push(t);
                positions.push(p);
                row_seq.push(it.seq);
            }
            if it.sample {
                // The last real token's row, then one per draft token.
                logit_rows.extend(tokens.len() - 1 - it.draft..tokens.len());
            }
            drafts.push(draft);
        }
        let tables: Vec<&[u32]> = row_seq
            .iter()
            .map(|s| self.sched.get(*s).map_or(&[][..], |q| &q.table[..]))
            .collect();
        // Each row's adapter (none at all when no request of the step has one).
        let adapter_of = |s: &u64| {
            let key = self.owner.get(s)?.0;
            self.requests.get(&key)?.adapter.as_deref()
        };
        let adapters: Vec<Option<&LoraAdapter>> = if row_seq.iter().any(|s| adapter_of(s).is_some()) {
            row_seq.iter().map(adapter_of).collect()
        } else {
            Vec::new()
        };
        let batch = Batch {
            tokens: &tokens,
            positions: &positions,
            tables: &tables,
            logit_rows: &logit_rows,
            adapters: &adapters,
        };
        let (model, compute, sched) = (&self.model, &mut self.compute, &self.sched);
        let may_cut = self.cuts_in_a_row < crate::scheduler::MAX_CUTS_IN_A_ROW;
        let mut arrived = Vec::new();
        let mut stop = |_layer: usize| {
            while let Ok(cmd) = rx.try_recv() {
                let cut = may_cut && matches!(&cmd, Command::Generate(job) if sched.interrupts(&job.req.qos, &items));
                arrived.push(cmd);
                if cut {
                    return true;
                }
            }
            false
        };
        let started = Instant::now();
        self.metrics.spend(Phase::Plan, started - planned);
        let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| compute.forward(model, &batch, &mut stop)));
        let took = started.elapsed();
        self.metrics.spend(Phase::Forward, took);
        drop((tables, adapters));
        let logits = match outcome {
            Ok(Ok(Some(l))) => l,
            Ok(Ok(None)) => {
                // Cut short: nothing of it counts; the new request is admitted and the next
                // step planned with it.
                self.cuts_in_a_row += 1;
                self.metrics.steps_cut.inc();
                for cmd in arrived {
                    self.command(cmd);
                }
                return;
            }
            failed => {
                match failed {
                    Ok(Err(e)) => tracing::error!(error = %e, "a forward step failed; failing that step's requests"),
                    _ => tracing::error!("engine panicked in a forward step; failing that step's requests"),
                }
                let keys: Vec<u64> = items
                    .iter()
                    .filter_map(|it| self.owner.get(&it.seq).map(|o| o.0))
                    .collect();
                for key in keys {
                    if let Some(r) = self.requests.get(&key) {
                        let _ =
                            r.tx.send(error("engine_error", "the engine failed on this request".into()));
                    }
                    self.drop_request(key);
                }
                for cmd in arrived {
                    self.command(cmd);
                }
                return;
            }
        };
        self.steps += 1;
        self.cuts_in_a_row = 0;
        let computes_prompt =
            |i: &StepItem| i.len > 1 + i.draft || self.sched.get(i.seq).is_some_and(|s| i.start < s.prompt_len());
        let kind = if items.iter().any(computes_prompt) {
            StepKind::Prompt
        } else {
            StepKind::Decode
        };
        self.metrics.record_step(kind, tokens.len(), took);
        let sampling = Instant::now();
        self.sched.complete(&items);
        let vocab = self.model.config.vocab_size;
        let mut rows = logits.chunks_exact(vocab);
        for (it, draft) in items.iter().zip(&drafts).filter(|(i, _)| i.sample) {
            let group: Vec<&[f32]> = rows.by_ref().take(1 + it.draft).collect();
            self.on_logits(it, &group, draft);
        }
        self.metrics.spend(Phase::Sample, sampling.elapsed());
        for cmd in arrived {
            self.command(cmd);
        }
    }

    /// A sequence reached its sampling point: `rows` are the logits after its last token
    /// and after each of its `draft` tokens.
    fn on_logits(&mut self, it: &StepItem, rows: &[&[f32]], draft: &[u32]) {
        let Some(&(key, choice)) = self.owner.get(&it.seq) else {
            return;
        };
        let mut targets = vec![choice];
        if let Some(r) = self.requests.get_mut(&key) {
            if r.first_token.is_none() {
                let now = Instant::now();
                r.first_token = Some(now);
                EngineMetrics::observe(&self.metrics.prefill, now - r.scheduled.unwrap_or(r.started));
                r.cached_tokens = self.sched.get(it.seq).map_or(0, |s| s.cached_tokens).min(r.prompt_len);
            }
            if !r.forked {
                // n > 1: the other choices share this prompt's blocks from here on.
                r.forked = true;
                for j in 1..r.n as usize {
                    let child = self.next_id;
                    self.next_id += 1;
                    self.sched.fork(it.seq, child);
                    self.owner.insert(child, (key, j));
                    r.choices[j].seq = Some(child);
                    targets.push(j);
                }
            }
        }
        for c in targets {
            self.sample_choice(key, c, rows, draft);
        }
    }

    /// Emits the choice's next token, and with a draft, verifies it token by token: at each
    /// position the token is sampled exactly as without a draft, and kept as accepted when it
    /// equals the draft token (its K/V is already computed); the first disagreement is
    /// emitted and ends the step, and a fully accepted draft also gets the token after it.
    /// For a draft proposed with certainty (prompt lookup, grammar-forced tokens) this is
    /// rejection sampling — the draft kept with probability p(draft), else a draw from the
    /// rest — with one random draw per emitted token, so a seeded request gives the same
    /// text with speculation or without.
    fn sample_choice(&mut self, key: u64, ci: usize, rows: &[&[f32]], draft: &[u32]) {
        let mut accepted = 0;
        for (i, logits) in rows.iter().enumerate() {
            let proposal = draft.get(i).copied();
            let Some(tok) = self.choose(key, ci, logits) else {
                return;
            };
            let hit = proposal == Some(tok);
            let more = self.emit(key, ci, tok, logits, hit);
            if hit {
                accepted += 1;
            }
            if !more || !hit {
                break;
            }
        }
        if draft.is_empty() {
            return;
        }
        self.metrics.spec_drafted.inc_by(draft.len() as u64);
        self.metrics.spec_accepted.inc_by(accepted as u64);
        if let Some(r) = self.requests.get_mut(&key) {
            r.choices[ci].spec.record(draft.len(), accepted);
        }
    }

    /// The token to emit after `logits`: end-of-sequence suppressed where asked, the
    /// grammar's mask applied, then sampled.
    fn choose(&mut self, key: u64, ci: usize, logits: &[f32]) -> Option<u32> {
        let r = self.requests.get_mut(&key)?;
        let params = &r.params;
        let ch = &mut r.choices[ci];
        ch.seq?;
        let suppress_eos = params.ignore_eos || ch.generated < params.min_tokens as usize;
        let mut masked = None;
        if let Some(g) = ch.grammar.as_mut() {
            let mut l = logits.to_vec();
            let remaining = r.max_tokens.saturating_sub(ch.generated);
            let took = g.mask_within(&mut l, remaining);
            self.metrics.grammar_masks.inc();
            self.metrics.grammar_mask_seconds.inc_by(took.as_secs_f64());
            masked = Some(l);
        }
        if suppress_eos {
            let l = masked.get_or_insert_with(|| logits.to_vec());
            let eog = &self.end_of_generation;
            // A grammar that allows nothing but the end wins over min_tokens / ignore_eos.
            let other = ch.grammar.is_none()
                || l.iter()
                    .enumerate()
                    .any(|(t, v)| v.is_finite() && !eog.contains(&(t as u32)));
            if other {
                for &e in eog {
                    l[e as usize] = f32::NEG_INFINITY;
                }
            }
        }
        let l = masked.as_deref().unwrap_or(logits);
        Some(ch.sampler.sample(l))
    }

    /// Sends `tok` and advances the choice; `kv_ready`: it was a verified draft token (its
    /// K/V is computed). False when the choice has finished.
    fn emit(&mut self, key: u64, ci: usize, tok: u32, logits: &[f32], kv_ready: bool) -> bool {
        let Some(r) = self.requests.get_mut(&key) else {
            return false;
        };
        let params = &r.params;
        let ch = &mut r.choices[ci];
        let Some(seq) = ch.seq else { return false };
        let suppress_eos = params.ignore_eos || ch.generated < params.min_tokens as usize;
        let (logprob, top_logprobs) = if params.logprobs || params.top_logprobs > 0 {
            log_probs(logits, tok, params.top_logprobs as usize)
        } else {
            (None, Vec::new())
        };
        ch.generated += 1;
        // (A grammar offers the end only when it allows nothing else.)
        let eog = (!suppress_eos || ch.grammar.is_some()) && self.end_of_generation.contains(&tok);
        let mut grammar_done = false;
        if let (Some(g), false) = (ch.grammar.as_mut(), eog) {
            g.advance(tok);
            grammar_done = g.is_stopped();
        }
        let bytes = if eog {
            &[][..]
        } else {
            shown_bytes(&self.tokenizer, tok, &r.params.special_text)
        };
        let released = ch.text.push(bytes);
        // A constrained answer closed early to fit its budget was cut short: `length`.
        let closed_early = ch.grammar.as_ref().is_some_and(Grammar::closing);
        let finish = if (eog || grammar_done) && closed_early {
            Some(FinishReason::Length)
        } else if released.stopped || eog || grammar_done {
            Some(FinishReason::Stop)
        } else if ch.generated >= r.max_tokens {
            Some(FinishReason::Length)
        } else if r.prefill_only {
            Some(FinishReason::Handoff)
        } else {
            None
        };
        let mut text = released.text;
        // A handed-off request's held-back text is the decode worker's to release.
        if finish.is_some_and(|f| f != FinishReason::Handoff) && !released.stopped {
            text.push_str(&ch.text.finish());
        }
        let _ = r.tx.send(GenerateEvent::Token {
            index: ci as u32,
            id: tok,
            text,
            logprob,
            top_logprobs,
        });
        let Some(reason) = finish else {
            if kv_ready {
                self.sched.accept_draft(seq, tok);
            } else {
                self.sched.push_token(seq, tok);
            }
            return true;
        };
        ch.finish = Some(reason);
        ch.seq = None;
        let _ = r.tx.send(GenerateEvent::Finish {
            index: ci as u32,
            finish_reason: reason,
        });
        if reason == FinishReason::Handoff {
            // The prompt's cached blocks stay referenced until the decode worker has them.
            let blocks = self.sched.cached_blocks(seq);
            for &b in &blocks {
                self.sched.blocks.share(b);
            }
            let until = Instant::now() + HOLD_TTL;
            if let Some((old, _)) = self.holds.insert(r.request_id.clone(), (blocks, until)) {
                for b in old.into_iter().rev() {
                    self.sched.blocks.release(b);
                }
            }
        }
        self.sched.remove(seq);
        self.owner.remove(&seq);
        if r.choices.iter().all(|c| c.finish.is_some()) {
            let completion: usize = r.choices.iter().map(|c| c.generated).sum();
            let now = Instant::now();
            let total = (now - r.started).as_secs_f64();
            let ttft = r.first_token.map_or(total, |t| (t - r.started).as_secs_f64());
            if let Some(t) = r.first_token.filter(|_| reason != FinishReason::Handoff) {
                EngineMetrics::observe(&self.metrics.decode, now - t);
            }
            let scheduled = r.scheduled.unwrap_or(r.started);
            let first = r.first_token.unwrap_or(now);
            let us = |d: Duration| d.as_micros() as u64;
            let timings = EngineTimings {
                queue_us: us(scheduled - r.started),
                prefill_us: us(first.saturating_duration_since(scheduled)),
                decode_us: us(now - first),
            };
            tracing::info!(
                request_id = %r.request_id,
                prompt_tokens = r.prompt_len,
                cached_tokens = r.cached_tokens,
                completion_tokens = completion,
                ttft_ms = (ttft * 1000.0) as u64,
                decode_tok_s = ((completion as f64 - 1.0).max(0.0) / (total - ttft).max(1e-9)) as u64,
                finish = r.choices[0].finish.map_or("", |f| f.as_str()),
                "request done"
            );
            let _ = r.tx.send(GenerateEvent::Done {
                finish_reason: r.choices[0].finish.unwrap_or(reason),
                usage: Usage {
                    prompt_tokens: r.prompt_len as u32,
                    cached_tokens: r.cached_tokens as u32,
                    completion_tokens: completion as u32,
                },
                timings,
            });
            if let Some(r) = self.requests.remove(&key) {
                self.adapter_released |= r.adapter.is_some();
            }
        }
        false
    }

    /// Sends KV events and (at most every 50 ms, when it changed) the load report.
    /// [`Self::announce`], timed as the publish phase.
    fn publish(&mut self) {
        let t = Instant::now();
        self.announce();
        self.metrics.spend(Phase::Publish, t.elapsed());
    }

    /// Sends the block events since the last call, the load (at most every 50 ms, or when
    /// idle) and the adapter set when it changed, and updates the stats.
    fn announce(&mut self) {
        let ev = self.sched.blocks.take_events();
        if !ev.stored.is_empty() {
            let _ = self.kv_tx.send(KvEvent::Stored {
                blocks: ev.stored,
                tier: Tier::Device,
            });
        }
        if !ev.removed.is_empty() {
            let _ = self.kv_tx.send(KvEvent::Removed {
                blocks: ev.removed,
                tier: Tier::Device,
            });
        }
        let load = self.sched.load();
        if load != self.last_load.0 && (self.last_load.1.elapsed() >= Duration::from_millis(50) || self.sched.is_idle())
        {
            let _ = self.kv_tx.send(KvEvent::Load(load));
            self.last_load = (load, Instant::now());
        }
        let (adapter_loads, adapter_load_seconds) = self.adapters.loads();
        // The set changes only when an adapter is loaded or unloaded, each of which counts.
        let adapter_state = (adapter_loads, self.adapters.loaded());
        if adapter_state != self.last_adapters {
            self.last_adapters = adapter_state;
            let _ = self.kv_tx.send(KvEvent::Adapters {
                loaded: self.adapters.digests(),
            });
        }
        self.stats_tx.send_replace(EngineStats {
            load,
            prefix_queries: self.sched.blocks.queries,
            prefix_hits: self.sched.blocks.hits,
            preemptions: self.sched.preemptions,
            steps: self.steps,
            adapters_loaded: self.adapters.loaded(),
            adapter_bytes: self.adapters.bytes(),
            adapter_loads,
            adapter_load_seconds,
            device_failed: self.compute.failed(),
        });
    }
}

/// The chosen token's log-probability and the `k` most likely alternatives.
fn log_probs(logits: &[f32], chosen: u32, k: usize) -> (Option<f32>, Vec<TokenLogprob>) {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let lse = max + logits.iter().map(|&l| (l - max).exp()).sum::<f32>().ln();
    let mut top = Vec::new();
    if k > 0 {
        let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
        let k = k.min(idx.len());
        idx.select_nth_unstable_by(k - 1, |a, b| logits[*b as usize].total_cmp(&logits[*a as usize]));
        idx.truncate(k);
        idx.sort_by(|a, b| logits[*b as usize].total_cmp(&logits[*a as usize]));
        top = idx
            .into_iter()
            .map(|id| TokenLogprob {
                id,
                logprob: logits[id as usize] - lse,
            })
            .collect();
    }
    (Some(logits[chosen as usize] - lse), top)
}

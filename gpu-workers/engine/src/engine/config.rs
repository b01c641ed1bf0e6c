//! The engine's configuration ([`EngineConfig`], with its defaults and limits), how it
//! fails ([`EngineError`]), and what a configuration makes of a model file from its
//! metadata alone: the KV blocks, the queue limit, the context served and the worker
//! information the gateway lists before the model is loaded.

use std::path::Path;
use std::time::Duration;

use hearth_protocol::WorkerInfo;

use crate::cuda::Device;
use crate::engine::adapters::AdapterCacheConfig;
use crate::formats::gguf::{tokenizer_spec, GgufError, GgufFile};
use crate::kernels::Isa;
use crate::kv::pool::{KvDtype, KvPool};
use crate::kv::tier::DiskTierConfig;
use crate::models::{ModelConfig, ModelError};
use crate::step::scheduler::Policy;

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
    HuggingFace(#[from] crate::formats::hf::error::HfError),
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
    /// Which prepared packs of repacked weights are mapped (a pack directory, else beside
    /// the model), and whether a repack writes one.
    pub pack_cache: crate::kernels::pack_cache::PackCache,
    /// How float weight matrices are computed (by default quantized to Q8_0 at load for a
    /// dense model, as floats for one with routed experts).
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
    /// [`crate::kv::tier`]); None: evicted blocks are dropped.
    pub kv_disk: Option<DiskTierConfig>,
    /// LoRA adapters loaded on demand (see [`crate::engine::adapters`]).
    pub adapters: AdapterCacheConfig,
    /// The layers this engine computes as a pipeline stage (None: every layer).
    pub stage: Option<crate::models::StagePlan>,
    /// A pipeline's leader: the stages after it (see [`crate::pipeline`]).
    pub pipeline: Option<crate::pipeline::PipelineConfig>,
    /// The memory (MiB) this engine's weights and KV cache may take; a model that does not
    /// fit is refused, naming pipeline stages (None: no check).
    pub memory_budget_mib: Option<u64>,
}

/// The most one read-back from the disk tier brings in (the rest of the prompt is computed).
pub(super) const DISK_READ_MAX_BYTES: usize = 1 << 30;

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
            pack_cache: crate::kernels::pack_cache::PackCache::from_env(),
            float_weights: Default::default(),
            max_queue_tokens: None,
            policy: Policy::default(),
            speculative_tokens: DEFAULT_SPECULATIVE_TOKENS,
            device: Device::Cpu,
            cuda_graphs: true,
            chat_template: None,
            kv_disk: None,
            adapters: AdapterCacheConfig::default(),
            stage: None,
            pipeline: None,
            memory_budget_mib: None,
        }
    }
}

/// Refuses a model (this stage of it) whose weights and KV cache do not fit `budget_mib`,
/// naming the flags that split it across workers.
pub fn check_memory(file: &GgufFile, cfg: &EngineConfig, kv_mib: usize) -> Result<(), EngineError> {
    let Some(budget) = cfg
        .memory_budget_mib
        .or_else(|| crate::kv::pool::available_memory_mib().map(|m| m as u64))
    else {
        return Ok(());
    };
    let c = crate::models::ModelConfig::from_gguf(file).map_err(|e| EngineError::Start(e.to_string()))?;
    let span = match &cfg.stage {
        Some(plan) => plan.resolve(file, &c).map_err(|e| EngineError::Start(e.to_string()))?,
        None => crate::models::StageSpan::whole(c.n_layers),
    };
    let weights = crate::models::stage::resident_bytes(file, span) >> 20;
    let need = weights + kv_mib as u64;
    if need > budget {
        let what = match span.is_whole() {
            true => "the model".to_string(),
            false => format!("this stage ({span})"),
        };
        return Err(EngineError::Start(format!(
            "{what} needs {weights} MiB of weights and {kv_mib} MiB of KV cache, over this worker's memory budget of {budget} MiB (--memory-budget-mib; default: the memory available): split it across workers by layers with `hearth serve --pipeline N`, or `hearth worker --stage K/N` on each host"
        )));
    }
    Ok(())
}

/// The KV cache an engine with `cfg` gets: (MiB, blocks).
pub(super) fn kv_blocks(shape: crate::kv::pool::KvShape, cfg: &EngineConfig) -> (usize, usize) {
    let mib = kv_mib(cfg);
    (mib, ((mib << 20) / KvPool::block_bytes(shape, cfg.kv_dtype)).max(2))
}

/// The KV cache's MiB: configured, else a quarter of available memory, at most 1 GiB.
pub fn kv_mib(cfg: &EngineConfig) -> usize {
    cfg.kv_cache_mib.unwrap_or_else(crate::kv::pool::default_kv_cache_mib)
}

/// The queue limit: configured, else what the KV cache holds.
pub(super) fn queue_limit(kv_tokens: usize, cfg: &EngineConfig) -> u64 {
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
    file_info_of(&crate::formats::hf::open_model(path)?, model_id, region)
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

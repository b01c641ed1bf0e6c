//! Loading a model and starting its engine thread ([`EngineHandle::load`]).

use std::collections::{HashMap, VecDeque};
use std::path::Path;
use std::sync::{mpsc, Arc};
use std::time::Instant;

use hearth_protocol::{LoadReport, Tokenizer, TokenizerSpec, WorkerInfo};

use crate::formats::gguf::GgufFile;
use tokio::sync::{broadcast, watch};

use crate::cuda::Device;
use crate::engine::adapters::AdapterCache;
use crate::engine::command::{Command, EngineStats};
use crate::engine::compute::Compute;
use crate::engine::config::{check_memory, kv_mib, queue_limit, EngineConfig, EngineError};
use crate::engine::metrics::EngineMetrics;
use crate::engine::runner::Runner;
use crate::engine::EngineHandle;
use crate::formats::gguf::tokenizer_spec;
use crate::kernels::{cpu_features, isa, set_isa};
use crate::kv::block::KvLayout;
use crate::kv::pool::KvPool;
use crate::kv::tier::DiskTier;
use crate::models::{LoadOptions, Model};
use crate::step::grammar::Grammars;
use crate::step::scheduler::{Scheduler, SchedulerConfig};
use crate::step::speculative::PromptLookup;

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
        let packed = read_ahead(path, cfg);
        let file = crate::formats::hf::open_model(path)?;
        if cfg.device == Device::Cpu {
            check_memory(&file, cfg, kv_mib(cfg))?;
        }
        if let (Some(plan), None, true) = (&cfg.stage, &packed, path.is_file()) {
            read_ahead_stage(path, &file, plan);
        }
        if let Some(packed) = &packed {
            read_ahead_unpacked(path, &file, packed, cfg);
        }
        let mut spec = tokenizer_spec(&file)?;
        if let Some(t) = &cfg.chat_template {
            spec.chat_template = Some(t.clone());
        }
        let (tokenizer, model) = load_model(file, &spec, cfg)?;
        tracing::info!(
            isa = %isa(),
            pack_cache = model.packed_from_cache(),
            cpu = %cpu_features(),
            repacked_mib = model.packed_bytes() >> 20,
            repack_ms = (model.repack_seconds() * 1000.0) as u64,
            repack_format = crate::kernels::packed::PACK_FORMAT,
            float_weights = model.float_weights().name(),
            "kernels"
        );
        let (packed_bytes, repack_seconds) = (model.packed_bytes(), model.repack_seconds());
        let progress = model.load_progress();
        let decode_weight_bytes = model.decode_weight_bytes();
        let end_of_generation = tokenizer.end_of_generation().to_vec();
        let bt = hearth_protocol::DEFAULT_BLOCK_TOKENS;
        let block_bytes = KvPool::block_bytes(model.kv_shape(bt), cfg.kv_dtype);
        let context = model.config.served_context(cfg.max_context)?;
        let (compute, mib, num_blocks) = Compute::new(&model, cfg, bt, context)?;
        let kv_layout = kv_layout(&model, cfg, bt);
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
        let info = worker_info(&model, model_id, cfg, (bt, context), queue_tokens, spec);
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
        let tier = open_disk_tier(path, model_id, cfg, &kv_layout, &kv_tx, &metrics)?;
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
            lanes: VecDeque::new(),
            next_lane: 0,
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
            progress,
        })
    }
}

/// Starts the cold disk's reads ahead of the load, and returns the matrices a current pack
/// cache holds (by offset), if one does.
///
/// A cold disk's reads overlap the load and the first prefill (see
/// `pack_cache::read_ahead`). Where a current pack cache holds the model's matrices,
/// the model file is read ahead only where the load still reads it: its header
/// (parsed next), then every tensor the cache does not hold (norms, biases, anything
/// not repacked; float matrices too with `--float-weights float`, which computes
/// them from the file), plus the embedding, whose rows are looked up; the cache
/// itself is read ahead as it is mapped. Reading the whole file as well doubled a
/// cold load's reads. (A cache written before `--float-weights` changed for a file
/// that mixes quantized and float matrices is refused when mapped: that one load
/// repacks from a file it did not read ahead.)
fn read_ahead(path: &Path, cfg: &EngineConfig) -> Option<std::collections::HashSet<u64>> {
    let packed = match (path.is_file(), cfg.device) {
        (true, Device::Cpu) if isa().is_simd() => crate::kernels::pack_cache::cached_tensors(path, &cfg.pack_cache),
        _ => None,
    };
    match packed {
        // (A pipeline stage reads ahead its own tensors only, once parsed: `read_ahead_stage`.)
        Some(_) => crate::kernels::pack_cache::read_ahead_parts(vec![(path.to_path_buf(), 0..GGUF_HEADER_READ_AHEAD)]),
        None if path.is_file() && cfg.stage.is_some() => {
            crate::kernels::pack_cache::read_ahead_parts(vec![(path.to_path_buf(), 0..GGUF_HEADER_READ_AHEAD)])
        }
        None if path.is_file() => crate::kernels::pack_cache::read_ahead(path),
        None => {}
    }
    packed
}

/// A pipeline stage's read-ahead without a pack: the tensors it computes with, not the
/// rest of a model many times its size.
fn read_ahead_stage(path: &Path, file: &GgufFile, plan: &crate::models::StagePlan) {
    let Ok(span) = crate::models::ModelConfig::from_gguf(file).and_then(|c| plan.resolve(file, &c)) else {
        return; // the load reports it
    };
    let parts = file
        .tensors
        .iter()
        .filter(|t| crate::models::stage::computes_with(file, span, &t.name))
        .map(|t| (path.to_path_buf(), t.offset as u64..(t.offset + t.len) as u64))
        .collect();
    crate::kernels::pack_cache::read_ahead_parts(parts);
}

/// Where a pack cache holds the matrices, reads ahead what the load still reads from the
/// model file: every tensor the cache does not hold, float matrices computed from the file,
/// and the embedding.
fn read_ahead_unpacked(path: &Path, file: &GgufFile, packed: &std::collections::HashSet<u64>, cfg: &EngineConfig) {
    let computes_floats = cfg.float_weights.resolve(file.has_routed_experts()) == crate::models::FloatWeights::Float;
    let parts = file
        .tensors
        .iter()
        .filter(|t| {
            let float = computes_floats && !t.ty.is_quantized();
            !packed.contains(&(t.offset as u64)) || float || t.name == "token_embd.weight"
        })
        .map(|t| (path.to_path_buf(), t.offset as u64..(t.offset + t.len) as u64))
        .collect();
    crate::kernels::pack_cache::read_ahead_parts(parts);
}

/// The model's weights and its tokenizer, built side by side.
fn load_model(
    file: GgufFile,
    spec: &TokenizerSpec,
    cfg: &EngineConfig,
) -> Result<(Arc<Tokenizer>, Model), EngineError> {
    let opts = LoadOptions {
        pack_cache: cfg.pack_cache.clone(),
        float_weights: cfg.float_weights,
        rope_scaling: cfg.rope_scaling,
        max_context: cfg.max_context,
        stage: cfg.stage.clone(),
    };
    // The tokenizer's tables (a vocabulary and its merges: tens of thousands of strings)
    // are built beside the weights' load; neither needs the other. (A bad vocabulary is
    // then reported after the weights' load, not before it.)
    let (tokenizer, model) = std::thread::scope(|s| {
        let tokenizer = std::thread::Builder::new()
            .name("hearth-tokenizer".into())
            .spawn_scoped(s, || Tokenizer::from_spec(spec));
        let model = match cfg.device {
            Device::Cpu => Model::load_options(file, opts),
            // The device keeps its own copy of the weights: no CPU repacking.
            Device::Cuda(_) => Model::load_unpacked(file, opts),
        };
        let tokenizer = match tokenizer {
            Ok(t) => t.join().unwrap_or_else(|p| std::panic::resume_unwind(p)),
            Err(_) => Tokenizer::from_spec(spec),
        };
        (tokenizer, model)
    });
    let tokenizer = Arc::new(tokenizer?);
    let model = model?;
    Ok((tokenizer, model))
}

/// The KV layout this engine's blocks have (what a KV transfer or the disk tier must match).
fn kv_layout(model: &Model, cfg: &EngineConfig, bt: usize) -> KvLayout {
    let shape = model.kv_shape(bt);
    KvLayout {
        arch: model.arch(),
        rope: model.rope_fingerprint(),
        n_layers: shape.n_layers as u32,
        kv_dim: shape.kv_dim() as u32,
        head_dim: shape.head_dim as u32,
        block_tokens: bt as u32,
        dtype: cfg.kv_dtype.into(),
        latent: shape.latent,
    }
}

/// What the worker tells the gateway about this model.
/// `(bt, context)`: the block size and the context served, in tokens.
fn worker_info(
    model: &Model,
    model_id: &str,
    cfg: &EngineConfig,
    (bt, context): (usize, usize),
    queue_tokens: u64,
    spec: TokenizerSpec,
) -> WorkerInfo {
    let c = &model.config;
    WorkerInfo {
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
    }
}

/// The KV disk tier (`--kv-disk`), opened for this model's weights and layout.
fn open_disk_tier(
    path: &Path,
    model_id: &str,
    cfg: &EngineConfig,
    kv_layout: &KvLayout,
    kv_tx: &broadcast::Sender<hearth_protocol::KvEvent>,
    metrics: &EngineMetrics,
) -> Result<Option<Arc<DiskTier>>, EngineError> {
    Ok(match &cfg.kv_disk {
        None => None,
        Some(_) if cfg.pipeline.is_some() => {
            return Err(EngineError::Start(
                "--kv-disk is not yet supported by a pipeline group: a block's layers are spread over its stages"
                    .into(),
            ))
        }
        Some(d) => {
            let weights = crate::kernels::pack_cache::source_id(path)
                .map_or(0, |id| xxhash_rust::xxh3::xxh3_64(format!("{id:?}").as_bytes()));
            let t = DiskTier::open(d, model_id, weights, kv_layout, kv_tx.clone(), metrics.kv_disk.clone())
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
    })
}

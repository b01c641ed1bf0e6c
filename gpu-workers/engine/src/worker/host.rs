//! Several models in one worker within a memory budget: each is loaded on its first
//! request, kept warm while used, unloaded after its idle TTL (scale to zero), and evicted
//! least-recently-used when another needs the room — never while it has requests in
//! flight. Concurrent requests for a model that is loading wait on that one load (a bounded
//! number of them, for a bounded time; then `model_loading`, which the gateway answers with
//! 503 and `retry-after`).
//!
//! [`ModelHost::model`] gives one [`HostedModel`] per catalogue entry: a [`Backend`] whose
//! `info` comes from the file's metadata (no weights read), so a gateway can list, tokenize
//! for and route to a model that is not loaded.

use std::collections::HashMap;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use hearth_protocol::{GenerateEvent, GenerateRequest, WorkerInfo};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};
use tokio::sync::{watch, Notify};

use crate::engine::config::{EngineConfig, EngineError};
use crate::engine::EngineHandle;
use crate::worker::backend::{Backend, KvSubscription};

/// One model the host may serve.
#[derive(Debug, Clone)]
pub struct ModelEntry {
    pub id: String,
    pub path: PathBuf,
    /// Unload after this long without requests (None: stay warm once loaded).
    pub idle_ttl: Option<Duration>,
    /// Keep warm: never unloaded for idleness or evicted for room (load it with
    /// [`ModelHost::preload`]).
    pub pinned: bool,
    /// Serve at most this context (None: the model's, stretched by `rope_scaling`).
    pub context_length: Option<usize>,
    /// RoPE scaling instead of the file's (None: the host's engine setting).
    pub rope_scaling: Option<crate::models::RopeScaling>,
    /// Bytes it counts against the budget (None: its file size plus its KV cache).
    pub memory_bytes: Option<u64>,
    /// Tenants (names or ids) that may see and use it (empty: all); reported in its
    /// `WorkerInfo` for the gateway to enforce.
    pub tenants: Vec<String>,
    /// A chat template to use instead of the file's (its text).
    pub chat_template: Option<String>,
    /// Its KV disk tier's directory instead of the host's.
    pub kv_disk_dir: Option<std::path::PathBuf>,
    /// Its KV disk tier's size instead of the host's (0: none).
    pub kv_disk_gib: Option<f64>,
}

impl ModelEntry {
    /// The host's engine settings with this entry's own in their place.
    fn engine_config(&self, host: &EngineConfig) -> EngineConfig {
        let mut cfg = host.clone();
        cfg.max_context = self.context_length.or(cfg.max_context);
        cfg.rope_scaling = self.rope_scaling.or(cfg.rope_scaling);
        cfg.chat_template = self.chat_template.clone().or(cfg.chat_template);
        let dir = self.kv_disk_dir.clone().or(cfg.kv_disk.as_ref().map(|d| d.dir.clone()));
        cfg.kv_disk = match (dir, self.kv_disk_gib) {
            (_, Some(g)) if g <= 0.0 => None,
            (Some(dir), gib) => Some(crate::kv::tier::DiskTierConfig {
                dir,
                capacity_bytes: gib.map_or_else(
                    || {
                        cfg.kv_disk
                            .as_ref()
                            .map_or(crate::kv::tier::DEFAULT_CAPACITY, |d| d.capacity_bytes)
                    },
                    |g| (g * (1u64 << 30) as f64) as u64,
                ),
                tenant_bytes: cfg.kv_disk.as_ref().map_or(0, |d| d.tenant_bytes),
            }),
            (None, _) => None,
        };
        cfg
    }
}

/// How the host shares out memory and waits.
#[derive(Debug, Clone)]
pub struct HostConfig {
    /// Bytes all warm models may use together (None: no limit). A model's estimate is its
    /// file size plus its KV cache.
    pub memory_budget: Option<u64>,
    /// How long a request waits for its model to load (or for room to load it).
    pub load_timeout: Duration,
    /// Requests that may wait for one model at once; more are answered `model_loading` at once.
    pub max_waiting: usize,
    /// Settings of every engine the host starts.
    pub engine: EngineConfig,
}

impl Default for HostConfig {
    fn default() -> Self {
        Self {
            memory_budget: None,
            load_timeout: Duration::from_secs(60),
            max_waiting: 256,
            engine: EngineConfig::default(),
        }
    }
}

/// A model's state, as listed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum ModelState {
    Cold,
    Loading,
    Warm,
}

impl ModelState {
    pub fn name(self) -> &'static str {
        match self {
            ModelState::Cold => "cold",
            ModelState::Loading => "loading",
            ModelState::Warm => "warm",
        }
    }
}

/// Why a request could not get its model.
#[derive(Debug, Clone, thiserror::Error)]
pub enum HostError {
    #[error("model {0:?} is not in this worker's catalogue")]
    Unknown(String),
    /// Still loading (or no room yet) after the wait; try again after `retry_after`.
    #[error("model {model:?} is loading; retry in {} s", retry_after.as_secs())]
    Loading { model: String, retry_after: Duration },
    #[error("model {model:?} failed to load: {message}")]
    Failed { model: String, message: String },
}

impl HostError {
    /// The error event a request gets.
    pub fn event(&self) -> GenerateEvent {
        let code = match self {
            HostError::Unknown(_) => "model_not_found",
            HostError::Loading { .. } => "model_loading",
            HostError::Failed { .. } => "model_load_failed",
        };
        GenerateEvent::Error {
            code: code.into(),
            message: self.to_string(),
        }
    }
}

enum Slot {
    Cold,
    /// Done when the value becomes `Some` (Ok: warm; Err: the load's error).
    Loading(watch::Receiver<Option<Result<(), String>>>),
    Warm(EngineHandle),
}

impl Slot {
    fn state(&self) -> ModelState {
        match self {
            Slot::Cold => ModelState::Cold,
            Slot::Loading(_) => ModelState::Loading,
            Slot::Warm(_) => ModelState::Warm,
        }
    }
}

/// Why a model could not be added at runtime.
#[derive(Debug, Clone, thiserror::Error)]
pub enum AddError {
    #[error("model {0:?} is already in the catalogue")]
    Exists(String),
    #[error("{0}")]
    Unreadable(String),
}

struct Model {
    /// Unique per catalogue entry: a model removed and added again under the same id is a
    /// new generation, and what the old one's loads, leases and waits report is not
    /// mistaken for the new one's.
    generation: u64,
    entry: ModelEntry,
    info: Arc<WorkerInfo>,
    estimate: u64,
    slot: Slot,
    in_flight: usize,
    waiting: usize,
    last_used: Instant,
    /// The last failed load (fails requests fast for [`FAILURE_BACKOFF`]).
    failed: Option<(Instant, String)>,
}

impl Model {
    /// A cold model from its entry: metadata read (no weights), memory estimated.
    fn prepare(entry: ModelEntry, cfg: &HostConfig) -> Result<Self, EngineError> {
        let file = crate::formats::hf::open_model(&entry.path)?;
        let mut info = crate::engine::config::file_info_of(&file, &entry.id, &cfg.engine.region)?;
        info.capacity = cfg.engine.max_running as u32;
        // What the engine will refuse past, so that gateways shed by the same limit.
        info.queue_tokens = crate::engine::config::queue_tokens_for(&file, &cfg.engine);
        info.context_length = crate::engine::config::served_context(&file, &entry.engine_config(&cfg.engine))? as u32;
        info.tenants = entry.tenants.clone();
        if let Some(t) = entry.chat_template.as_ref().or(cfg.engine.chat_template.as_ref()) {
            info.tokenizer.chat_template = Some(t.clone());
        }
        let kv_bytes = cfg.engine.kv_cache_mib.unwrap_or(1024) as u64 * (1 << 20);
        let estimate = entry
            .memory_bytes
            .unwrap_or(crate::formats::hf::weights_bytes(&entry.path) + kv_bytes);
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        Ok(Model {
            generation: NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            entry,
            info: Arc::new(info),
            estimate,
            slot: Slot::Cold,
            in_flight: 0,
            waiting: 0,
            last_used: Instant::now(),
            failed: None,
        })
    }
}

/// How long a failed load is remembered before a request tries again.
const FAILURE_BACKOFF: Duration = Duration::from_secs(10);

/// A request counted as waiting for its model; uncounted however the wait ends.
struct WaitGuard {
    inner: Arc<Inner>,
    id: String,
    generation: u64,
}

impl Drop for WaitGuard {
    fn drop(&mut self) {
        if let Some(m) = self
            .inner
            .lock()
            .get_mut(&self.id)
            .filter(|m| m.generation == self.generation)
        {
            m.waiting = m.waiting.saturating_sub(1);
        }
    }
}

/// A model removed from the catalogue while it still held memory (requests in flight, or
/// loading): it counts against the budget until they end.
struct Retiring {
    estimate: u64,
    in_flight: usize,
    loading: bool,
}

struct Inner {
    cfg: HostConfig,
    models: Mutex<HashMap<String, Model>>,
    /// Removed models still holding memory, by generation. Locked after `models`, never
    /// before.
    retiring: Mutex<HashMap<u64, Retiring>>,
    /// Signalled whenever a request ends or a model unloads (room may have appeared).
    released: Notify,
    loads: std::sync::atomic::AtomicU64,
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, HashMap<String, Model>> {
        self.models.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn retiring(&self) -> MutexGuard<'_, HashMap<u64, Retiring>> {
        self.retiring.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Memory removed models still hold.
    fn retiring_bytes(&self) -> u64 {
        self.retiring().values().map(|r| r.estimate).sum()
    }

    /// Applies `f` to a removed model's record and forgets it once it holds nothing.
    fn retire_update(&self, generation: u64, f: impl FnOnce(&mut Retiring)) {
        let mut r = self.retiring();
        if let Some(e) = r.get_mut(&generation) {
            f(e);
            if e.in_flight == 0 && !e.loading {
                r.remove(&generation);
            }
        }
    }
}

/// The models of one worker. Cheap to clone.
#[derive(Clone)]
pub struct ModelHost {
    inner: Arc<Inner>,
}

/// A request's hold on a warm model: while any exists the model is not evicted.
struct Lease {
    inner: Arc<Inner>,
    id: String,
    generation: u64,
}

impl Drop for Lease {
    fn drop(&mut self) {
        {
            let mut models = self.inner.lock();
            match models.get_mut(&self.id).filter(|m| m.generation == self.generation) {
                Some(m) => {
                    m.in_flight = m.in_flight.saturating_sub(1);
                    m.last_used = Instant::now();
                }
                None => self
                    .inner
                    .retire_update(self.generation, |r| r.in_flight = r.in_flight.saturating_sub(1)),
            }
        }
        self.inner.released.notify_waiters();
    }
}

impl ModelHost {
    /// A host for `entries` (their metadata is read now; no weights are loaded), with the
    /// entries whose metadata could not be read and why (they are left out; the others
    /// are served). Starts the idle-TTL reaper on the current tokio runtime.
    pub fn new(entries: Vec<ModelEntry>, cfg: HostConfig) -> (Self, Vec<(String, EngineError)>) {
        let mut models = HashMap::new();
        let mut failed = Vec::new();
        for entry in entries {
            match Model::prepare(entry.clone(), &cfg) {
                Ok(m) => {
                    models.insert(entry.id, m);
                }
                Err(e) => {
                    tracing::warn!(model = %entry.id, error = %e, "model left out of the catalogue");
                    failed.push((entry.id, e));
                }
            }
        }
        let host = Self {
            inner: Arc::new(Inner {
                cfg,
                models: Mutex::new(models),
                retiring: Mutex::new(HashMap::new()),
                released: Notify::new(),
                loads: Default::default(),
            }),
        };
        host.start_reaper();
        (host, failed)
    }

    /// Adds a model at runtime (its metadata is read now; it loads on its first request, or
    /// now if pinned — call [`ModelHost::preload`]). Refused if the id is taken.
    pub fn add(&self, entry: ModelEntry) -> Result<HostedModel, AddError> {
        if self.inner.lock().contains_key(&entry.id) {
            return Err(AddError::Exists(entry.id));
        }
        let id = entry.id.clone();
        let m = Model::prepare(entry, &self.inner.cfg).map_err(|e| AddError::Unreadable(e.to_string()))?;
        let info = m.info.clone();
        match self.inner.lock().entry(id.clone()) {
            std::collections::hash_map::Entry::Occupied(_) => return Err(AddError::Exists(id)),
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(m);
            }
        }
        tracing::info!(model = %id, "model added to the catalogue");
        Ok(HostedModel {
            host: self.clone(),
            info,
        })
    }

    /// Removes a model: new requests for it get `model_not_found` at once; requests in
    /// flight finish on the engine they hold, which stops when the last one ends (its
    /// memory counts against the budget until then; a load under way is discarded when it
    /// ends). False if there was no such model.
    pub fn remove(&self, id: &str) -> bool {
        // Under the models lock throughout, so that a lease ending meanwhile finds either
        // the model or its retiring record.
        let mut models = self.inner.lock();
        let Some(m) = models.remove(id) else {
            return false;
        };
        let loading = matches!(m.slot, Slot::Loading(_));
        if m.in_flight > 0 || loading {
            self.inner.retiring().insert(
                m.generation,
                Retiring {
                    estimate: m.estimate,
                    in_flight: m.in_flight,
                    loading,
                },
            );
        }
        drop(models);
        tracing::info!(model = %id, in_flight = m.in_flight, "model removed from the catalogue");
        drop(m);
        self.inner.released.notify_waiters();
        true
    }

    /// The [`Backend`] for one catalogue entry.
    pub fn model(&self, id: &str) -> Option<HostedModel> {
        let info = self.inner.lock().get(id)?.info.clone();
        Some(HostedModel {
            host: self.clone(),
            info,
        })
    }

    /// Every model and its state.
    pub fn states(&self) -> Vec<(String, ModelState)> {
        let mut v: Vec<_> = self
            .inner
            .lock()
            .iter()
            .map(|(id, m)| (id.clone(), m.slot.state()))
            .collect();
        v.sort();
        v
    }

    pub fn state(&self, id: &str) -> Option<ModelState> {
        self.inner.lock().get(id).map(|m| m.slot.state())
    }

    /// Loads a model now (for pinned models at start).
    pub async fn preload(&self, id: &str) -> Result<(), HostError> {
        self.acquire(id, Duration::from_secs(24 * 3600)).await.map(|_| ())
    }

    /// Loads started so far (all models).
    pub fn loads(&self) -> u64 {
        self.inner.loads.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Unloads every idle model whose TTL has passed; returns how many.
    pub fn reap(&self) -> usize {
        let mut n = 0;
        {
            let mut models = self.inner.lock();
            for m in models.values_mut() {
                let expired = !m.entry.pinned && m.entry.idle_ttl.is_some_and(|ttl| m.last_used.elapsed() >= ttl);
                if expired && m.in_flight == 0 && matches!(m.slot, Slot::Warm(_)) {
                    m.slot = Slot::Cold; // dropping the handle stops the engine thread
                    tracing::info!(model = %m.entry.id, "idle TTL passed: model unloaded");
                    n += 1;
                }
            }
        }
        if n > 0 {
            self.inner.released.notify_waiters();
        }
        n
    }

    /// Checks for expired models every quarter of the shortest TTL (50 ms to 5 s; the
    /// catalogue may change, so it is looked up each time).
    fn start_reaper(&self) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let weak = Arc::downgrade(&self.inner);
        rt.spawn(async move {
            loop {
                let every = {
                    let Some(inner) = weak.upgrade() else { return };
                    let ttl = inner.lock().values().filter_map(|m| m.entry.idle_ttl).min();
                    ttl.map_or(Duration::from_secs(5), |t| t / 4)
                        .clamp(Duration::from_millis(50), Duration::from_secs(5))
                };
                tokio::time::sleep(every).await;
                let Some(inner) = weak.upgrade() else { return };
                ModelHost { inner }.reap();
            }
        });
    }

    /// A warm engine for `id` and a lease on it: loads the model if needed (one load for
    /// every concurrent request), evicting least-recently-used idle models to make room.
    /// Waits at most `wait`.
    async fn acquire(&self, id: &str, wait: Duration) -> Result<(EngineHandle, Lease), HostError> {
        let deadline = Instant::now() + wait;
        let loading = |id: &str| HostError::Loading {
            model: id.to_string(),
            retry_after: Duration::from_secs(1),
        };
        let failed = |id: &str, message: String| HostError::Failed {
            model: id.to_string(),
            message,
        };
        let mut waiting: Option<WaitGuard> = None;
        loop {
            let step = {
                let mut models = self.inner.lock();
                let Some(m) = models.get_mut(id) else {
                    return Err(HostError::Unknown(id.to_string()));
                };
                match &m.slot {
                    Slot::Warm(engine) => {
                        m.in_flight += 1;
                        m.last_used = Instant::now();
                        let engine = engine.clone();
                        return Ok((
                            engine,
                            Lease {
                                inner: self.inner.clone(),
                                id: id.to_string(),
                                generation: m.generation,
                            },
                        ));
                    }
                    Slot::Loading(rx) => Some(rx.clone()),
                    Slot::Cold => {
                        // A load that failed lately fails fast (and evicts nobody).
                        if let Some((at, why)) = &m.failed {
                            if at.elapsed() < FAILURE_BACKOFF {
                                return Err(failed(id, why.clone()));
                            }
                        }
                        let need = m.estimate;
                        if let Some(why) = self.never_fits(&models, id, need) {
                            return Err(failed(id, why));
                        }
                        if self.make_room(&mut models, id, need) {
                            let (tx, rx) = watch::channel(None);
                            let Some(m) = models.get_mut(id) else {
                                return Err(HostError::Unknown(id.to_string()));
                            };
                            m.slot = Slot::Loading(rx.clone());
                            self.start_load(m.entry.clone(), m.generation, tx);
                            Some(rx)
                        } else {
                            None // no room yet: wait for a request to end
                        }
                    }
                }
            };
            if waiting.is_none() {
                let mut models = self.inner.lock();
                if let Some(m) = models.get_mut(id) {
                    if m.waiting >= self.inner.cfg.max_waiting {
                        return Err(loading(id));
                    }
                    m.waiting += 1;
                    waiting = Some(WaitGuard {
                        inner: self.inner.clone(),
                        id: id.to_string(),
                        generation: m.generation,
                    });
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(loading(id));
            }
            match step {
                Some(mut rx) => match tokio::time::timeout(left, rx.wait_for(|v| v.is_some())).await {
                    Err(_) => return Err(loading(id)),
                    Ok(Ok(v)) => {
                        if let Some(Err(message)) = v.clone() {
                            return Err(failed(id, message));
                        }
                    }
                    // The loader vanished without a word (cannot happen: it always sends).
                    Ok(Err(_)) => return Err(failed(id, "the load was abandoned".into())),
                },
                None => {
                    // Wake on a release, or look again shortly (a release between the check
                    // above and this wait is not missed for long).
                    let nap = left.min(Duration::from_millis(100));
                    let _ = tokio::time::timeout(nap, self.inner.released.notified()).await;
                }
            }
        }
    }

    /// Why `id` can never be loaded within the budget, if so: it needs more than the budget
    /// less the pinned models.
    fn never_fits(&self, models: &HashMap<String, Model>, id: &str, need: u64) -> Option<String> {
        let budget = self.inner.cfg.memory_budget?;
        let pinned: u64 = models
            .iter()
            .filter(|(k, m)| k.as_str() != id && m.entry.pinned && !matches!(m.slot, Slot::Cold))
            .map(|(_, m)| m.estimate)
            .sum();
        (need + pinned > budget).then(|| {
            format!(
                "it needs {} MiB and the worker's memory budget is {} MiB ({} MiB of it held by pinned models)",
                need >> 20,
                budget >> 20,
                pinned >> 20
            )
        })
    }

    /// Makes room for `need` bytes for `id`, unloading least-recently-used warm models with
    /// nothing in flight; false if that is not enough (nothing is unloaded then).
    fn make_room(&self, models: &mut HashMap<String, Model>, id: &str, need: u64) -> bool {
        let Some(budget) = self.inner.cfg.memory_budget else {
            return true;
        };
        let used: u64 = models
            .values()
            .filter(|m| !matches!(m.slot, Slot::Cold))
            .map(|m| m.estimate)
            .sum::<u64>()
            + self.inner.retiring_bytes();
        if used + need <= budget {
            return true;
        }
        let mut idle: Vec<(Instant, String, u64)> = models
            .iter()
            .filter(|(k, m)| k.as_str() != id && !m.entry.pinned && m.in_flight == 0 && matches!(m.slot, Slot::Warm(_)))
            .map(|(k, m)| (m.last_used, k.clone(), m.estimate))
            .collect();
        idle.sort();
        let mut freed = 0;
        let mut victims = Vec::new();
        for (_, k, est) in idle {
            if used - freed + need <= budget {
                break;
            }
            freed += est;
            victims.push(k);
        }
        if used - freed + need > budget {
            return false;
        }
        for k in victims {
            if let Some(m) = models.get_mut(&k) {
                m.slot = Slot::Cold;
                tracing::info!(model = %k, for_model = %id, "evicted (least recently used) to make room");
            }
        }
        true
    }

    fn start_load(&self, entry: ModelEntry, generation: u64, done: watch::Sender<Option<Result<(), String>>>) {
        self.inner.loads.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let inner = self.inner.clone();
        let cfg = entry.engine_config(&self.inner.cfg.engine);
        tracing::info!(model = %entry.id, "loading on first request");
        let load = move || {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                EngineHandle::load(&entry.path, &entry.id, &cfg)
            }))
            .unwrap_or_else(|_| Err(EngineError::Start("the load panicked".into())));
            let mut models = inner.lock();
            let current = models.get_mut(&entry.id).filter(|m| m.generation == generation);
            let outcome = match (r, current) {
                (Ok(engine), Some(m)) => {
                    tracing::info!(model = %entry.id, load_ms = (engine.load_seconds() * 1000.0) as u64, "model loaded");
                    m.slot = Slot::Warm(engine);
                    m.last_used = Instant::now();
                    m.failed = None;
                    Ok(())
                }
                (Err(e), Some(m)) => {
                    // The details (paths) stay in the worker's log; clients get the kind.
                    tracing::warn!(model = %entry.id, error = %e, "model failed to load");
                    use crate::formats::hf::error::HfError;
                    let why = match e {
                        EngineError::Gguf(_)
                        | EngineError::HuggingFace(
                            HfError::Gguf(_)
                            | HfError::Io { .. }
                            | HfError::Invalid { .. }
                            | HfError::Safetensors { .. },
                        ) => "its model file is unreadable or corrupt (see the worker's log)",
                        EngineError::Model(_)
                        | EngineError::HuggingFace(HfError::Unsupported(_) | HfError::Model(_)) => {
                            "its model is not supported (see the worker's log)"
                        }
                        _ => "see the worker's log",
                    }
                    .to_string();
                    m.slot = Slot::Cold;
                    m.failed = Some((Instant::now(), why.clone()));
                    Err(why)
                }
                // Removed (or removed and added again) while loading: the engine is dropped.
                (r, None) => {
                    inner.retire_update(generation, |r| r.loading = false);
                    r.map(|_| ()).map_err(|e| e.to_string())
                }
            };
            drop(models);
            let _ = done.send(Some(outcome));
            inner.released.notify_waiters();
        };
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn_blocking(load);
            }
            Err(_) => {
                std::thread::spawn(load);
            }
        }
    }
}

/// One catalogue entry as a [`Backend`]: requests load the model when it is cold.
#[derive(Clone)]
pub struct HostedModel {
    host: ModelHost,
    info: Arc<WorkerInfo>,
}

impl HostedModel {
    pub fn state(&self) -> ModelState {
        self.host.state(&self.info.model).unwrap_or(ModelState::Cold)
    }

    fn warm(&self) -> Option<EngineHandle> {
        match &self.host.inner.lock().get(&self.info.model)?.slot {
            Slot::Warm(e) => Some(e.clone()),
            _ => None,
        }
    }
}

impl Backend for HostedModel {
    fn info(&self) -> &WorkerInfo {
        &self.info
    }

    fn generate(&self, req: GenerateRequest) -> UnboundedReceiver<GenerateEvent> {
        let (tx, rx) = unbounded_channel();
        let host = self.host.clone();
        let id = self.info.model.clone();
        tokio::spawn(async move {
            let wait = host.inner.cfg.load_timeout;
            let got = tokio::select! {
                r = host.acquire(&id, wait) => r,
                // The client went away while its model loaded: stop waiting.
                () = tx.closed() => return,
            };
            let (engine, lease) = match got {
                Ok(v) => v,
                Err(e) => {
                    let _ = tx.send(e.event());
                    return;
                }
            };
            let mut events = engine.generate(req);
            loop {
                tokio::select! {
                    ev = events.recv() => match ev {
                        Some(ev) => {
                            let last = matches!(ev, GenerateEvent::Done { .. } | GenerateEvent::Error { .. });
                            if tx.send(ev).is_err() || last {
                                break;
                            }
                        }
                        None => break,
                    },
                    // The client went away: dropping `events` cancels the generation.
                    () = tx.closed() => break,
                }
            }
            // Cancel (or finish) the generation before the model may be evicted.
            drop(events);
            drop(engine);
            drop(lease);
        });
        rx
    }

    fn subscribe_kv(&self) -> Pin<Box<dyn std::future::Future<Output = KvSubscription> + Send + '_>> {
        Box::pin(async move {
            match self.warm() {
                Some(e) => e.subscribe_kv().await,
                None => None,
            }
        })
    }

    fn stats(&self) -> Option<crate::engine::command::EngineStats> {
        self.warm().map(|e| e.stats())
    }

    fn metrics(&self) -> Option<Arc<crate::engine::metrics::EngineMetrics>> {
        self.warm().map(|e| e.metrics())
    }

    fn load_seconds(&self) -> Option<f64> {
        self.warm().map(|e| e.load_seconds())
    }

    fn load_progress(&self) -> Option<Arc<crate::kernels::pack_cache::LoadProgress>> {
        self.warm().map(|e| e.load_progress())
    }

    fn model_state(&self) -> Option<&'static str> {
        Some(self.state().name())
    }

    fn engine(&self) -> Option<EngineHandle> {
        self.warm()
    }

    fn preload(&self) -> bool {
        let (host, id) = (self.host.clone(), self.info.model.clone());
        tokio::spawn(async move {
            match host.acquire(&id, host.inner.cfg.load_timeout).await {
                Ok(_) => tracing::info!(model = %id, "preloaded at the gateway's request"),
                Err(e) => tracing::info!(model = %id, error = %e, "preload did not complete"),
            }
        });
        true
    }
}

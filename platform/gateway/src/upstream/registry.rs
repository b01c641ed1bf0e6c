//! What the gateway serves: models discovered from their workers (each with the tokenizer
//! and chat template the gateway needs to produce the exact token ids the engine expects),
//! and for each model the router that places its requests on its workers.
//!
//! Per worker, two background tasks keep the router current: one follows the worker's KV
//! events into the prefix index (exact mode; while the stream is down the router records
//! its own decisions instead — approximate mode), one checks its health.
//!
//! Models are added and removed at runtime (`POST`/`DELETE /admin/v1/models`, through the
//! workers' catalogues, [`ModelHostClient`]): a removed model's tasks stop and its requests
//! in flight finish on the [`ServedModel`] they hold.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use hearth_protocol::{ChatTemplate, KvEvent, Tokenizer};
use hearth_router::{Policy, Router, RouterConfig};

use crate::upstream::workers::{ModelHostClient, WorkerClient, WorkerError};

/// One model, its workers (by router slot) and its router.
pub struct ServedModel {
    pub id: String,
    pub tokenizer: Tokenizer,
    pub template: Option<ChatTemplate>,
    /// How the model writes tool calls and reasoning (from its template).
    pub tool_format: hearth_protocol::output::ToolFormat,
    pub reasoning_format: Option<hearth_protocol::output::ReasoningFormat>,
    pub context_length: u32,
    pub block_tokens: usize,
    pub created: i64,
    /// Tenants (names or ids) that may see and use it; empty: every tenant.
    pub tenants: Vec<String>,
    /// Clients by router slot. Workers join and leave at runtime (discovery): a slot's
    /// background tasks stop when it no longer holds their client. Lock order: the router,
    /// then this.
    workers: RwLock<Vec<Option<Arc<dyn WorkerClient>>>>,
    router: Mutex<Router>,
    epoch: Instant,
    /// Set when removed from the registry: its background tasks stop at once.
    retired: tokio::sync::watch::Sender<bool>,
    /// When the gateway last asked one more worker to load the model (it was busy).
    pub(crate) last_spread: Mutex<Option<Instant>>,
    /// Loads started on more workers because the model was busy.
    pub spreads: std::sync::atomic::AtomicU64,
    /// See [`RoutingConfig::pd_threshold`].
    pub pd_threshold: usize,
    /// Disaggregated requests by outcome.
    pub pd: PdCounts,
    /// Prompt tokens queued on the pool per tenant, and how fast the queue drains (see
    /// the pipeline's `admit` phase).
    pub queues: crate::upstream::queues::TenantQueues,
}

/// Where a worker of a model's pool is and what it can take, from its `WorkerInfo`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerPlace {
    pub region: String,
    pub role: String,
    pub capacity: u32,
    pub queue_tokens: u64,
}

impl From<&hearth_protocol::WorkerInfo> for WorkerPlace {
    fn from(i: &hearth_protocol::WorkerInfo) -> Self {
        Self {
            region: i.region.clone(),
            role: i.role.clone(),
            capacity: i.capacity,
            queue_tokens: i.queue_tokens,
        }
    }
}

/// What became of disaggregated requests (`hearth_pd_requests{outcome}`).
#[derive(Debug, Default)]
pub struct PdCounts {
    /// Prefill on one worker, decode on another.
    pub disaggregated: std::sync::atomic::AtomicU64,
    /// Finished at the first token (end of sequence, a stop string, `max_tokens`).
    pub prefill_only: std::sync::atomic::AtomicU64,
    /// A worker failed before its part (or could not take it): served by one worker,
    /// which computed the prompt. (A damaged transfer is computed by the decode worker and
    /// counts as disaggregated.)
    pub retried_colocated: std::sync::atomic::AtomicU64,
    /// Failed after tokens were sent (the client got a clean error).
    pub failed: std::sync::atomic::AtomicU64,
}

impl PdCounts {
    pub fn count(c: &std::sync::atomic::AtomicU64) {
        c.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// (outcome, count) for each outcome.
    pub fn snapshot(&self) -> [(&'static str, u64); 4] {
        let get = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
        [
            ("disaggregated", get(&self.disaggregated)),
            ("prefill_only", get(&self.prefill_only)),
            ("retried_colocated", get(&self.retried_colocated)),
            ("failed", get(&self.failed)),
        ]
    }
}

impl ServedModel {
    /// Router time: milliseconds since the gateway started.
    pub fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    pub fn router(&self) -> MutexGuard<'_, Router> {
        self.router.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn client(&self, slot: usize) -> Option<Arc<dyn WorkerClient>> {
        self.clients().get(slot).cloned().flatten()
    }

    fn clients(&self) -> std::sync::RwLockReadGuard<'_, Vec<Option<Arc<dyn WorkerClient>>>> {
        self.workers.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether `slot` still holds `client` (it may have left, and the slot been reused).
    /// Checked under the router lock, the answer holds while that lock is held: slots change
    /// hands only under it.
    pub(crate) fn holds(&self, slot: usize, client: &Arc<dyn WorkerClient>) -> bool {
        self.clients()
            .get(slot)
            .and_then(Option::as_ref)
            .is_some_and(|c| Arc::ptr_eq(c, client))
    }

    /// Router slots (workers, including ones removed since: their slot stays empty).
    pub fn slots(&self) -> usize {
        self.clients().len()
    }

    pub fn worker_count(&self) -> usize {
        self.clients().iter().flatten().count()
    }

    /// Whether a worker of this name serves the model.
    pub fn has_worker(&self, name: &str) -> bool {
        self.clients().iter().flatten().any(|w| w.name() == name)
    }

    /// Adds a worker to the pool at runtime (discovery): a router slot, then its event and
    /// health tasks.
    pub fn add_worker(
        self: &Arc<Self>,
        client: Arc<dyn WorkerClient>,
        place: &WorkerPlace,
    ) -> Result<usize, RegistryError> {
        let slot = {
            let mut r = self.router();
            let slot = r
                .add_worker(client.name(), &place.region, false)
                .ok_or_else(|| RegistryError::Model {
                    model: self.id.clone(),
                    detail: "more than 64 workers".into(),
                })?;
            if let Some(state) = r.worker_mut(slot) {
                state.role = place.role.clone();
                state.capacity = place.capacity;
                state.kv_peer = client.kv_address().is_some();
                state.queue_tokens = place.queue_tokens;
            }
            let mut ws = self.workers.write().unwrap_or_else(|e| e.into_inner());
            if ws.len() <= slot {
                ws.resize(slot + 1, None);
            }
            ws[slot] = Some(client);
            slot
        };
        tokio::spawn(follow_kv_events(self.clone(), slot));
        tokio::spawn(check_health(self.clone(), slot));
        Ok(slot)
    }

    /// Takes the worker named `name` out of the pool: no new requests; those in flight
    /// finish on the client they hold. Whether it was there.
    pub fn remove_worker(&self, name: &str) -> bool {
        let mut r = self.router();
        let Some(slot) = r.slot_of(name) else {
            return false;
        };
        r.remove_worker(slot);
        if let Some(w) = self.workers.write().unwrap_or_else(|e| e.into_inner()).get_mut(slot) {
            *w = None;
        }
        true
    }

    /// Marks the worker named `name` draining (it is shutting down): no new requests.
    pub fn set_draining(&self, name: &str, draining: bool) {
        let mut r = self.router();
        if let Some(slot) = r.slot_of(name) {
            if let Some(w) = r.worker_mut(slot) {
                w.draining = draining;
            }
        }
    }

    /// Whether a tenant may see and use the model (its catalogue entry's `tenants`).
    pub fn visible_to(&self, tenant: &hearth_tenants::TenantContext) -> bool {
        self.tenants.is_empty()
            || self
                .tenants
                .iter()
                .any(|t| *t == tenant.tenant_id || *t == tenant.tenant_name)
    }

    /// Each worker's name and the state it reports for this model.
    pub fn worker_states(&self) -> Vec<(String, Option<String>)> {
        self.clients()
            .iter()
            .flatten()
            .map(|w| (w.name().to_string(), w.model_state()))
            .collect()
    }

    /// The warmest state its workers report (`warm` > `loading` > `cold`), if any reports.
    pub fn state(&self) -> Option<String> {
        let rank = |s: &str| match s {
            "warm" => 2,
            "loading" => 1,
            _ => 0,
        };
        self.clients()
            .iter()
            .flatten()
            .filter_map(|w| w.model_state())
            .max_by_key(|s| rank(s))
    }
}

#[derive(Default)]
pub struct ModelRegistry {
    models: RwLock<HashMap<String, Arc<ServedModel>>>,
    routing: RoutingConfig,
    /// The workers' catalogues, through which models are added and removed at runtime.
    hosts: RwLock<Vec<Arc<dyn ModelHostClient>>>,
    /// Models served because a discovered worker brought them: no longer served when their
    /// last worker leaves.
    discovered: Mutex<std::collections::HashSet<String>>,
}

#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error(transparent)]
    Worker(#[from] WorkerError),
    #[error("model {model}: {detail}")]
    Model { model: String, detail: String },
    #[error("model {0} is already served")]
    Exists(String),
}

/// How the gateway routes.
#[derive(Debug, Clone)]
pub struct RoutingConfig {
    /// The default policy, and per-model overrides.
    pub policy: Policy,
    pub per_model: HashMap<String, Policy>,
    /// The gateway's own region (requests may override it with `x-hearth-region`).
    pub region: String,
    /// Disaggregate a request (prefill on one worker, decode on another) when at least this
    /// many of its prompt tokens are not cached on the prefill worker; 0: never. Only pools
    /// with `prefill` or `decode` workers disaggregate.
    pub pd_threshold: usize,
    /// Peer fetch: a worker lacking at least this many leading prompt tokens that another
    /// worker holds in its KV cache pulls them from there instead of computing them; 0:
    /// never. Needs the workers' token (peers serve KV blocks to its holders only).
    pub fetch_min_tokens: usize,
}

/// Uncached prompt tokens from which a request is disaggregated, by default.
pub const DEFAULT_PD_THRESHOLD: usize = 256;

impl Default for RoutingConfig {
    fn default() -> Self {
        Self {
            policy: Policy::parse("kv_aware").unwrap_or(Policy::Random),
            per_model: HashMap::new(),
            region: "local".into(),
            pd_threshold: DEFAULT_PD_THRESHOLD,
            fetch_min_tokens: hearth_router::DEFAULT_FETCH_MIN_TOKENS,
        }
    }
}

impl ModelRegistry {
    /// Asks each worker what it serves (retrying unreachable workers until `wait` passes),
    /// builds each model's router, and starts the event and health tasks.
    pub async fn discover(
        workers: Vec<Arc<dyn WorkerClient>>,
        wait: Duration,
        routing: &RoutingConfig,
    ) -> Result<Self, RegistryError> {
        let deadline = tokio::time::Instant::now() + wait;
        struct Building {
            info: hearth_protocol::WorkerInfo,
            workers: Vec<Arc<dyn WorkerClient>>,
            regions: Vec<WorkerPlace>,
        }
        let mut building: Vec<Building> = Vec::new();
        for w in workers {
            let info = loop {
                match w.info().await {
                    Ok(info) => break info,
                    Err(WorkerError::Unavailable { .. }) if tokio::time::Instant::now() < deadline => {
                        tracing::info!(worker = w.name(), "waiting for worker");
                        tokio::time::sleep(Duration::from_millis(500)).await;
                    }
                    Err(e) => return Err(e.into()),
                }
            };
            match building.iter_mut().find(|b| b.info.model == info.model) {
                Some(b) => {
                    b.regions.push(WorkerPlace::from(&info));
                    b.workers.push(w);
                }
                None => building.push(Building {
                    regions: vec![WorkerPlace::from(&info)],
                    info,
                    workers: vec![w],
                }),
            }
        }
        let reg = Self {
            routing: routing.clone(),
            ..Default::default()
        };
        for b in building {
            reg.insert(b.info, b.workers, b.regions)?;
        }
        Ok(reg)
    }

    /// Serves a model on `workers` (with each one's place): builds its router and starts
    /// the event and health tasks. Refused if the id is served already.
    pub fn insert(
        &self,
        info: hearth_protocol::WorkerInfo,
        workers: Vec<Arc<dyn WorkerClient>>,
        regions: Vec<WorkerPlace>,
    ) -> Result<Arc<ServedModel>, RegistryError> {
        if self.get(&info.model).is_some() {
            return Err(RegistryError::Exists(info.model));
        }
        let routing = &self.routing;
        {
            let model_err = |detail: String| RegistryError::Model {
                model: info.model.clone(),
                detail,
            };
            let tokenizer = Tokenizer::from_spec(&info.tokenizer).map_err(|e| model_err(e.to_string()))?;
            let template = match &info.tokenizer.chat_template {
                Some(src) => Some(ChatTemplate::for_tokenizer(src, &tokenizer).map_err(|e| model_err(e.to_string()))?),
                None => None,
            };
            let policy = routing.per_model.get(&info.model).copied().unwrap_or(routing.policy);
            let mut router = Router::new(RouterConfig {
                policy,
                home_region: routing.region.clone(),
                block_tokens: info.block_tokens as usize,
                fetch_min_tokens: routing.fetch_min_tokens,
                ..Default::default()
            });
            let mut slots = Vec::new();
            for (w, place) in workers.iter().zip(&regions) {
                let slot = router
                    .add_worker(w.name(), &place.region, false)
                    .ok_or_else(|| model_err("more than 64 workers".into()))?;
                if let Some(state) = router.worker_mut(slot) {
                    state.role = place.role.clone();
                    state.capacity = place.capacity;
                    state.kv_peer = w.kv_address().is_some();
                    state.queue_tokens = place.queue_tokens;
                }
                if slots.len() <= slot {
                    slots.resize(slot + 1, None);
                }
                slots[slot] = Some(w.clone());
            }
            tracing::info!(model = %info.model, workers = workers.len(), policy = policy.name(), context = info.context_length, "serving model");
            let model = Arc::new(ServedModel {
                id: info.model.clone(),
                tokenizer,
                tool_format: hearth_protocol::output::ToolFormat::detect(info.tokenizer.chat_template.as_deref()),
                reasoning_format: hearth_protocol::output::ReasoningFormat::detect(
                    info.tokenizer.chat_template.as_deref(),
                ),
                template,
                context_length: info.context_length,
                block_tokens: info.block_tokens as usize,
                created: hearth_tenants::now_ms() / 1000,
                tenants: info.tenants.clone(),
                workers: RwLock::new(slots),
                router: Mutex::new(router),
                epoch: Instant::now(),
                retired: tokio::sync::watch::Sender::new(false),
                last_spread: Mutex::new(None),
                spreads: Default::default(),
                pd_threshold: routing.pd_threshold,
                pd: PdCounts::default(),
                queues: Default::default(),
            });
            for slot in 0..model.slots() {
                if model.client(slot).is_some() {
                    tokio::spawn(follow_kv_events(model.clone(), slot));
                    tokio::spawn(check_health(model.clone(), slot));
                }
            }
            let mut models = self.models.write().unwrap_or_else(|e| e.into_inner());
            if models.contains_key(&info.model) {
                model.retired.send_replace(true);
                return Err(RegistryError::Exists(info.model));
            }
            models.insert(info.model.clone(), model.clone());
            Ok(model)
        }
    }

    /// Stops serving a model (its requests in flight finish); the model, if it was served.
    pub fn remove(&self, id: &str) -> Option<Arc<ServedModel>> {
        let m = self.models.write().unwrap_or_else(|e| e.into_inner()).remove(id)?;
        m.retired.send_replace(true);
        tracing::info!(model = %id, "model no longer served");
        Some(m)
    }

    pub fn get(&self, id: &str) -> Option<Arc<ServedModel>> {
        self.models.read().unwrap_or_else(|e| e.into_inner()).get(id).cloned()
    }

    /// Every model, by id.
    pub fn all(&self) -> Vec<Arc<ServedModel>> {
        let mut v: Vec<_> = self
            .models
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect();
        v.sort_by(|a, b| a.id.cmp(&b.id));
        v
    }

    /// The catalogues models can be added to at runtime.
    pub fn hosts(&self) -> Vec<Arc<dyn ModelHostClient>> {
        self.hosts.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub fn set_hosts(&self, hosts: Vec<Arc<dyn ModelHostClient>>) {
        *self.hosts.write().unwrap_or_else(|e| e.into_inner()) = hosts;
    }

    /// Adds a discovered worker's catalogue (replacing one of the same name).
    pub fn add_host(&self, host: Arc<dyn ModelHostClient>) {
        let mut hosts = self.hosts.write().unwrap_or_else(|e| e.into_inner());
        hosts.retain(|h| h.name() != host.name());
        hosts.push(host);
    }

    /// A worker joined (discovery): it serves the model `info` names — in that model's
    /// pool, or as a new model. A worker already in the pool (same name) is left as it is.
    pub fn attach(
        &self,
        info: hearth_protocol::WorkerInfo,
        client: Arc<dyn WorkerClient>,
    ) -> Result<(), RegistryError> {
        let place = WorkerPlace::from(&info);
        if let Some(model) = self.get(&info.model) {
            if model.has_worker(client.name()) {
                return Ok(());
            }
            if model.block_tokens != info.block_tokens as usize {
                return Err(RegistryError::Model {
                    model: info.model.clone(),
                    detail: format!(
                        "worker {} uses {}-token KV blocks, the pool {}",
                        client.name(),
                        info.block_tokens,
                        model.block_tokens
                    ),
                });
            }
            model.add_worker(client, &place)?;
            return Ok(());
        }
        let id = info.model.clone();
        self.insert(info, vec![client], vec![place])?;
        self.discovered.lock().unwrap_or_else(|e| e.into_inner()).insert(id);
        Ok(())
    }

    /// A worker left (deregistered, or its heartbeats stopped): out of every pool, and out
    /// of the catalogues. A model only it brought is no longer served.
    pub fn detach(&self, name: &str) {
        self.hosts
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|h| h.name() != name);
        for model in self.all() {
            if model.remove_worker(name) {
                tracing::info!(model = %model.id, worker = name, "worker left the pool");
                let discovered = self
                    .discovered
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .contains(&model.id);
                if discovered && model.worker_count() == 0 {
                    self.remove(&model.id);
                }
            }
        }
    }

    /// Marks a worker draining in every pool.
    pub fn set_draining(&self, name: &str, draining: bool) {
        for model in self.all() {
            model.set_draining(name, draining);
        }
    }
}

/// Feeds one worker's KV events into the model's prefix index, reconnecting when the stream
/// ends; while it is down the router assumes (approximate mode).
async fn follow_kv_events(model: Arc<ServedModel>, slot: usize) {
    let mut retired = model.retired.subscribe();
    tokio::select! {
        () = follow_kv_events_until_retired(&model, slot) => {}
        _ = retired.wait_for(|r| *r) => {}
    }
}

async fn follow_kv_events_until_retired(model: &ServedModel, slot: usize) {
    let Some(client) = model.client(slot) else {
        return;
    };
    while model.holds(slot, &client) {
        match client.kv_events().await {
            Ok(mut events) => {
                while let Some(ev) = events.next().await {
                    let mut r = model.router();
                    if !model.holds(slot, &client) {
                        return; // the worker left; the slot may be another's now
                    }
                    match ev {
                        KvEvent::Snapshot {
                            blocks, disk, adapters, ..
                        } => {
                            r.index.reset_worker_tiers(slot, &blocks, &disk);
                            if let Some(w) = r.worker_mut(slot) {
                                w.exact_events = true;
                                w.adapters = adapters;
                            }
                        }
                        KvEvent::Stored { blocks, tier } => r.index.stored_in(slot, &blocks, tier),
                        KvEvent::Removed { blocks, tier } => r.index.removed_from(slot, &blocks, tier),
                        KvEvent::Load(_) => {}
                        KvEvent::Adapters { loaded } => {
                            if let Some(w) = r.worker_mut(slot) {
                                w.adapters = loaded;
                            }
                        }
                    }
                }
            }
            Err(e) => tracing::debug!(worker = client.name(), error = %e, "no KV events"),
        }
        {
            let mut r = model.router();
            if !model.holds(slot, &client) {
                return;
            }
            if let Some(w) = r.worker_mut(slot) {
                w.exact_events = false;
            }
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// Marks a worker unhealthy while its health check fails.
async fn check_health(model: Arc<ServedModel>, slot: usize) {
    let Some(client) = model.client(slot) else {
        return;
    };
    let mut retired = model.retired.subscribe();
    loop {
        let ok = tokio::select! {
            r = client.health() => r.is_ok(),
            _ = retired.wait_for(|r| *r) => return,
        };
        {
            let mut r = model.router();
            if !model.holds(slot, &client) {
                return;
            }
            if let Some(w) = r.worker_mut(slot) {
                if w.healthy != ok {
                    tracing::warn!(worker = client.name(), healthy = ok, "worker health changed");
                }
                w.healthy = ok;
            }
            r.sweep(model.now_ms());
        }
        tokio::select! {
            () = tokio::time::sleep(Duration::from_secs(2)) => {}
            _ = retired.wait_for(|r| *r) => return,
        }
    }
}

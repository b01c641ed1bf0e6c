//! Phase `route`: which worker gets the request — the model's policy (`kv_aware` by
//! default), session affinity (`x-session-affinity`), region (`x-hearth-region`, else the
//! gateway's), skipping workers already tried. The decision is a [`Placement`], which keeps
//! the router's load accounting until the request ends.
//!
//! Warm replicas come first; when they are busy (outstanding requests at [`SPREAD_AT`] of
//! their capacity) and a catalogue worker has the model cold, that worker is asked to load
//! it in the background ([`spread`]), so the next requests find one more warm replica
//! instead of one request paying the load.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hearth_protocol::{block_hashes, namespace_root, BlockHash};
use hearth_router::{Policy, RouteInput, Router};

use crate::upstream::registry::ServedModel;

/// What the router may use besides the tokens.
#[derive(Clone)]
pub struct RouteHints {
    /// `x-session-affinity`.
    pub session: Option<String>,
    /// `x-hearth-region`, else the gateway's region.
    pub region: Option<String>,
    /// `prefix_aware`'s key: the leading text of the request and its cache namespace.
    pub prefix_key: u64,
    /// The tenant, whose queued tokens the placement accounts for (see
    /// [`crate::upstream::queues::TenantQueues`]).
    pub tenant: String,
    /// The worker (by name) the shared store pins `session` to: another gateway's decision
    /// (see [`crate::upstream::cluster::SharedRouting`]).
    pub pinned: Option<String>,
    /// Where session pins are shared with the other gateways (None: this gateway alone).
    pub shared: Option<Arc<crate::upstream::cluster::SharedRouting>>,
    /// The digest of the request's LoRA adapter (workers with it loaded are preferred).
    pub adapter: Option<String>,
}

/// The request as the router sees it: its prompt's block hashes and hints.
#[derive(Clone)]
pub struct RouteRequest {
    pub hashes: Vec<BlockHash>,
    pub prompt_tokens: usize,
    pub hints: RouteHints,
}

impl RouteRequest {
    pub fn new(model: &ServedModel, prompt: &[u32], namespace: &str, hints: RouteHints) -> Self {
        let root = namespace_root(&model.id, namespace);
        // The engine reuses whole blocks and always computes the last prompt token.
        let hashes = block_hashes(root, &prompt[..prompt.len().saturating_sub(1)], model.block_tokens);
        Self {
            hashes,
            prompt_tokens: prompt.len(),
            hints,
        }
    }
}

/// A request's place on a worker, for the router's load accounting and its tenant's
/// queued tokens; released on drop (completion, failure, cancellation alike).
pub struct Placement {
    model: Arc<ServedModel>,
    pub slot: usize,
    /// The slot's worker when placed (slots are reused after a worker leaves).
    serial: u64,
    uncached: usize,
    started: bool,
    tenant: String,
    /// The peer to pull the prompt's leading KV blocks from ([`hearth_router::Decision::fetch`]).
    pub fetch: Option<hearth_router::Fetch>,
}

impl Placement {
    fn new(model: &Arc<ServedModel>, r: &Router, slot: usize, uncached: usize, tenant: &str) -> Self {
        model.queues.add(tenant, uncached as u64);
        Self {
            model: model.clone(),
            slot,
            serial: r.worker(slot).map_or(0, |w| w.serial),
            uncached,
            started: false,
            tenant: tenant.to_string(),
            fetch: None,
        }
    }

    /// The model's router, when the slot still holds this placement's worker.
    fn router(&self) -> Option<std::sync::MutexGuard<'_, Router>> {
        let r = self.model.router();
        r.worker(self.slot)
            .is_some_and(|w| w.serial == self.serial)
            .then_some(r)
    }

    /// The name of the worker the request went to (None: it has left the pool).
    pub fn worker_name(&self) -> Option<String> {
        self.router()?.worker(self.slot).map(|w| w.name.clone())
    }

    /// The request's usage, for its worker's cache hit rate.
    pub fn usage(&self, prompt_tokens: u32, cached_tokens: u32) {
        if let Some(mut r) = self.router() {
            r.on_usage(self.slot, prompt_tokens, cached_tokens);
        }
    }

    /// The worker was lost mid-request (its stream broke or went silent): out of routing
    /// until its health check passes again — if the slot still holds it.
    pub fn mark_lost(&self) {
        if let Some(mut r) = self.router() {
            if let Some(w) = r.worker_mut(self.slot) {
                w.healthy = false;
            }
        }
    }

    /// The worker produced its first token: its prefill is done.
    pub fn first_token(&mut self) {
        if !self.started {
            self.started = true;
            if let Some(mut r) = self.router() {
                r.on_first_token(self.slot, self.uncached);
            }
            self.model.queues.remove(&self.tenant, self.uncached as u64, true);
        }
    }
}

impl Drop for Placement {
    fn drop(&mut self) {
        if let Some(mut r) = self.router() {
            r.on_finish(self.slot, self.uncached, self.started);
        }
        if !self.started {
            self.model.queues.remove(&self.tenant, self.uncached as u64, false);
        }
    }
}

/// Workers that would have to load the model (they report it `cold` or `loading`), as a
/// slot mask — when at least one other usable worker has it warm; else 0.
fn not_warm(model: &ServedModel, exclude: u64) -> u64 {
    let (mut warm, mut other) = (0u64, 0u64);
    for slot in 0..model.slots() {
        let Some(state) = model.client(slot).and_then(|c| c.model_state()) else {
            continue;
        };
        if state == "warm" {
            warm |= 1 << slot;
        } else {
            other |= 1 << slot;
        }
    }
    if warm & !exclude != 0 {
        other
    } else {
        0
    }
}

/// The best worker not in `exclude` (a bit mask of router slots), or None when none is left.
/// Warm replicas come first: a worker that would have to load the model (catalogue
/// workers report its state) is chosen only when no warm one can take the request; then
/// the policy picks which one loads it.
pub fn run(model: &Arc<ServedModel>, req: &RouteRequest, exclude: u64) -> Option<Placement> {
    run_pinned(model, req, exclude, req.hints.pinned.as_deref())
}

/// [`run`], with the session pinned to the worker named `pinned` (another gateway's choice).
pub fn run_pinned(
    model: &Arc<ServedModel>,
    req: &RouteRequest,
    exclude: u64,
    pinned: Option<&str>,
) -> Option<Placement> {
    let mut r = model.router();
    // Prefill workers serve whole requests only when nothing else can.
    let prefill = role_mask(&r, "prefill");
    let exclude = if usable(&r) & !exclude & !prefill != 0 {
        exclude | prefill
    } else {
        exclude
    };
    // Another gateway's pin for the session (shared affinity) becomes this router's.
    if let (Some(session), Some(pinned)) = (&req.hints.session, pinned) {
        if let Some(slot) = r.slot_of(pinned) {
            r.pin(session, slot, model.now_ms());
        }
    }
    let mut input = RouteInput {
        hashes: &req.hashes,
        prompt_tokens: req.prompt_tokens,
        prefix_key: req.hints.prefix_key,
        session: req.hints.session.as_deref(),
        region: req.hints.region.as_deref(),
        exclude: exclude | not_warm(model, exclude),
        fetch: true,
        adapter: req.hints.adapter.as_deref(),
    };
    let d = match r.route(&input, model.now_ms()) {
        Some(d) => d,
        None => {
            input.exclude = exclude;
            r.route(&input, model.now_ms())?
        }
    };
    let uncached = req.prompt_tokens - d.expected_cached_tokens;
    r.on_dispatch(d.worker, uncached);
    let spread_to = spread_target(model, &r);
    let mut placement = Placement::new(model, &r, d.worker, uncached, &req.hints.tenant);
    placement.fetch = d.fetch;
    drop(r);
    if let Some(slot) = spread_to {
        spread(model, slot);
    }
    tracing::debug!(
        worker = d.worker,
        reason = d.reason.as_str(),
        expected_cached = d.expected_cached_tokens,
        fetch_from = ?d.fetch,
        "routed"
    );
    Some(placement)
}

/// Healthy, not draining workers, as a slot mask.
fn usable(r: &Router) -> u64 {
    r.workers()
        .filter(|(_, w)| w.healthy && !w.draining)
        .fold(0, |m, (i, _)| m | (1 << i))
}

/// Workers with this role, as a slot mask.
fn role_mask(r: &Router, role: &str) -> u64 {
    r.workers()
        .filter(|(_, w)| w.role == role)
        .fold(0, |m, (i, _)| m | (1 << i))
}

/// A disaggregated request's two places: the prefill worker computes the prompt and the
/// first token, the decode worker the rest.
pub struct PdPlacement {
    pub prefill: Placement,
    pub decode: Placement,
}

/// Prefill/decode disaggregation, when it pays: the pool has `prefill` or `decode` workers
/// and at least [`ServedModel::pd_threshold`] of the prompt's tokens are cached on no
/// usable worker. The prefill worker is chosen among `prefill` workers (else `both`)
/// by the model's policy — cache overlap and prefill tokens in flight, for `kv_aware` —
/// and the decode worker among `decode` workers (else `both`, never the same one) by the
/// same policy, which weighs its running sequences and what of the prompt it already
/// holds (only the rest is transferred). None: serve colocated.
pub fn run_pd(model: &Arc<ServedModel>, req: &RouteRequest, exclude: u64) -> Option<PdPlacement> {
    if model.pd_threshold == 0 {
        return None;
    }
    let mut r = model.router();
    let ok = usable(&r) & !exclude;
    let (prefill, decode) = (role_mask(&r, "prefill") & ok, role_mask(&r, "decode") & ok);
    if prefill == 0 && decode == 0 {
        return None;
    }
    // Disjoint sets: a worker is never both halves.
    let both = ok & !prefill & !decode;
    let p_cands = if prefill != 0 { prefill } else { both };
    let d_cands = if decode != 0 { decode } else { both };
    if p_cands == 0 || d_cands == 0 {
        return None;
    }
    // Worth it only for a long part cached nowhere: a worker that holds most of the prompt
    // (the next turn of a conversation it served) computes the rest cheaper than a transfer.
    let now = model.now_ms();
    let matched = r.index.matches(&req.hashes, ok, now);
    let best = (0..64)
        .filter(|i| ok & (1u64 << i) != 0)
        .map(|i| matched[i] as usize * model.block_tokens)
        .max()
        .unwrap_or(0)
        .min(req.prompt_tokens.saturating_sub(1));
    if req.prompt_tokens - best < model.pd_threshold {
        return None;
    }
    // No session pinning: affinity belongs to colocated serving.
    let mut input = RouteInput {
        hashes: &req.hashes,
        prompt_tokens: req.prompt_tokens,
        prefix_key: req.hints.prefix_key,
        session: None,
        region: req.hints.region.as_deref(),
        exclude: !p_cands,
        // The halves move the blocks themselves (the decode half from the prefill half).
        fetch: false,
        adapter: req.hints.adapter.as_deref(),
    };
    let p = r.route(&input, now)?;
    input.exclude = !d_cands;
    let d = r.route(&input, now)?;
    let uncached = req.prompt_tokens - p.expected_cached_tokens;
    // The decode worker computes only the prompt's tail (the rest is transferred).
    let tail = req.prompt_tokens % model.block_tokens.max(1) + 1;
    r.on_dispatch(p.worker, uncached);
    r.on_dispatch(d.worker, tail);
    let place = |slot, uncached| Placement::new(model, &r, slot, uncached, &req.hints.tenant);
    let (prefill, decode) = (place(p.worker, uncached), place(d.worker, tail));
    drop(r);
    tracing::debug!(
        prefill = p.worker,
        decode = d.worker,
        expected_cached = p.expected_cached_tokens,
        "disaggregated"
    );
    Some(PdPlacement { prefill, decode })
}

/// Warm replicas this busy (outstanding ÷ capacity) make the gateway load the model on one
/// more worker.
pub const SPREAD_AT: f64 = 0.75;
/// At most one such load per model in this interval.
const SPREAD_EVERY: Duration = Duration::from_secs(10);

/// The worker that should load the model now, if the model is busy: its warm replicas
/// are at [`SPREAD_AT`] of their capacity, no replica is loading, and a healthy catalogue
/// worker has it cold (the least loaded one is chosen).
fn spread_target(model: &ServedModel, r: &Router) -> Option<usize> {
    let (mut outstanding, mut capacity) = (0u64, 0u64);
    let mut cold: Option<(u32, usize)> = None;
    for (slot, w) in r.workers() {
        if !w.healthy || w.draining {
            continue;
        }
        // A worker that does not load on demand (no state) neither counts nor loads.
        let Some(state) = model.client(slot).and_then(|c| c.model_state()) else {
            continue;
        };
        match state.as_str() {
            "warm" => {
                outstanding += u64::from(w.outstanding);
                capacity += u64::from(w.capacity.max(1));
            }
            "loading" => return None,
            _ => {
                if cold.is_none_or(|(o, _)| w.outstanding < o) {
                    cold = Some((w.outstanding, slot));
                }
            }
        }
    }
    let busy = capacity > 0 && outstanding as f64 >= SPREAD_AT * capacity as f64;
    let target = cold?.1;
    // Checked and claimed together (the router lock is held), so one load per interval.
    let mut last = model.last_spread.lock().unwrap_or_else(|e| e.into_inner());
    if !busy || last.is_some_and(|t| t.elapsed() < SPREAD_EVERY) {
        return None;
    }
    *last = Some(Instant::now());
    Some(target)
}

/// Asks worker `slot` to load the model in the background.
fn spread(model: &Arc<ServedModel>, slot: usize) {
    let Some(client) = model.client(slot) else {
        return;
    };
    model.spreads.fetch_add(1, Ordering::Relaxed);
    tracing::info!(model = %model.id, worker = client.name(), "model busy: loading it on one more worker");
    tokio::spawn(async move {
        if let Err(e) = client.preload().await {
            tracing::warn!(worker = client.name(), error = %e, "could not start the load");
        }
    });
}

/// `prefix_aware`'s key: the first `prefix_length` characters of the request's text and
/// its cache namespace (SageMaker's semantics).
pub fn prefix_key(model: &ServedModel, text: &str, namespace: &str) -> u64 {
    let len = match model.router().cfg.policy {
        Policy::PrefixAware { prefix_length, .. } => prefix_length,
        _ => 2048,
    };
    let lead: String = text.chars().take(len).collect();
    xxhash_rust::xxh3::xxh3_64(format!("{namespace}\0{lead}").as_bytes())
}

#[cfg(test)]
pub(crate) mod tests {
    use std::sync::Mutex;
    use std::time::Duration;

    use futures_util::future::BoxFuture;
    use futures_util::FutureExt;
    use hearth_protocol::{GenerateRequest, WorkerInfo};

    use super::*;
    use crate::upstream::registry::{ModelRegistry, RoutingConfig};
    use crate::upstream::workers::{EventStream, KvEventStream, WorkerClient, WorkerError};

    /// A worker that only reports a model state (and counts requests to load it); its
    /// `info` serves the disaggregation tests' scripted workers too.
    pub(crate) struct Stateful {
        pub(crate) name: String,
        pub(crate) state: Mutex<Option<String>>,
        pub(crate) preloads: std::sync::atomic::AtomicUsize,
        pub(crate) role: &'static str,
    }

    impl WorkerClient for Stateful {
        fn name(&self) -> &str {
            &self.name
        }
        fn info(&self) -> BoxFuture<'_, Result<WorkerInfo, WorkerError>> {
            // GPT-2's byte-level alphabet: printable bytes stand for themselves, the others
            // for 256 + n.
            let mut n = 0;
            let mut tokens: Vec<String> = (0..256u32)
                .map(|b| {
                    let printable = (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
                    let c = if printable {
                        b
                    } else {
                        n += 1;
                        255 + n
                    };
                    char::from_u32(c).unwrap().to_string()
                })
                .collect();
            tokens.resize(1000, "x".into());
            let info = WorkerInfo {
                model: "m".into(),
                architecture: "test".into(),
                context_length: 4096,
                parameters: 0,
                block_tokens: 16,
                region: "local".into(),
                role: self.role.into(),
                capacity: 8,
                queue_tokens: 0,
                tokenizer: hearth_protocol::TokenizerSpec {
                    model: "gpt2".into(),
                    pre: "default".into(),
                    token_types: vec![1; tokens.len()],
                    tokens,
                    ..Default::default()
                },
                tenants: Vec::new(),
                kv: None,
            };
            async move { Ok(info) }.boxed()
        }
        fn generate(&self, _: GenerateRequest) -> BoxFuture<'_, Result<EventStream, WorkerError>> {
            async move {
                Err(WorkerError::Unavailable {
                    worker: self.name.clone(),
                    detail: "test".into(),
                })
            }
            .boxed()
        }
        fn kv_events(&self) -> BoxFuture<'_, Result<KvEventStream, WorkerError>> {
            async move {
                Err(WorkerError::Unavailable {
                    worker: self.name.clone(),
                    detail: "test".into(),
                })
            }
            .boxed()
        }
        fn health(&self) -> BoxFuture<'_, Result<(), WorkerError>> {
            async move { Ok(()) }.boxed()
        }
        fn model_state(&self) -> Option<String> {
            self.state.lock().unwrap().clone()
        }
        fn preload(&self) -> BoxFuture<'_, Result<(), WorkerError>> {
            self.preloads.fetch_add(1, Ordering::Relaxed);
            async move { Ok(()) }.boxed()
        }
    }

    async fn model_on(states: &[&str]) -> (Vec<Arc<Stateful>>, Arc<ServedModel>, ModelRegistry) {
        let workers: Vec<Arc<Stateful>> = states
            .iter()
            .enumerate()
            .map(|(i, s)| {
                Arc::new(Stateful {
                    name: format!("w{i}"),
                    state: Mutex::new(Some(s.to_string())),
                    preloads: Default::default(),
                    role: "both",
                })
            })
            .collect();
        let clients: Vec<Arc<dyn WorkerClient>> = workers.iter().map(|w| w.clone() as Arc<dyn WorkerClient>).collect();
        let cfg = RoutingConfig {
            policy: Policy::parse("least_outstanding").unwrap(),
            ..Default::default()
        };
        let reg = ModelRegistry::discover(clients, Duration::ZERO, &cfg).await.unwrap();
        let model = reg.get("m").unwrap();
        (workers, model, reg)
    }

    /// A model on workers with these roles (no model states: nothing loads on demand).
    async fn model_with_roles(roles: &[&'static str]) -> (Arc<ServedModel>, ModelRegistry) {
        let clients: Vec<Arc<dyn WorkerClient>> = roles
            .iter()
            .enumerate()
            .map(|(i, r)| {
                Arc::new(Stateful {
                    name: format!("w{i}"),
                    state: Mutex::new(None),
                    preloads: Default::default(),
                    role: r,
                }) as Arc<dyn WorkerClient>
            })
            .collect();
        let reg = ModelRegistry::discover(clients, Duration::ZERO, &RoutingConfig::default())
            .await
            .unwrap();
        (reg.get("m").unwrap(), reg)
    }

    fn prompt_of(tokens: usize) -> RouteRequest {
        RouteRequest {
            prompt_tokens: tokens,
            ..req(0)
        }
    }

    #[tokio::test]
    async fn long_prompts_go_to_a_prefill_and_a_decode_worker_short_ones_to_decode() {
        let (model, _reg) = model_with_roles(&["prefill", "decode", "decode"]).await;
        assert_eq!(model.pd_threshold, crate::upstream::registry::DEFAULT_PD_THRESHOLD);
        // Short: colocated, never on the prefill worker.
        assert!(run_pd(&model, &prompt_of(100), 0).is_none());
        let held: Vec<Placement> = (0..4).map(|i| run(&model, &req(i), 0).unwrap()).collect();
        assert!(held.iter().all(|p| p.slot != 0));
        drop(held);
        // Long: the prefill worker, and a decode worker.
        let pd = run_pd(&model, &prompt_of(1000), 0).unwrap();
        assert_eq!(pd.prefill.slot, 0);
        assert!(pd.decode.slot == 1 || pd.decode.slot == 2);
        drop(pd);
        // The prefill worker down: colocated; all decode workers down: colocated on prefill.
        model.router().worker_mut(0).unwrap().healthy = false;
        assert!(run_pd(&model, &prompt_of(1000), 0).is_none());
        model.router().worker_mut(0).unwrap().healthy = true;
        assert!(run_pd(&model, &prompt_of(1000), 0b110).is_none());
        assert_eq!(run(&model, &req(1), 0b110).unwrap().slot, 0);
        let loads: u32 = model.router().workers().map(|(_, w)| w.outstanding).sum();
        assert_eq!(loads, 0, "every placement released its load");
    }

    #[tokio::test]
    async fn pools_without_roles_or_without_a_threshold_never_disaggregate() {
        let (model, _reg) = model_with_roles(&["both", "both"]).await;
        assert!(run_pd(&model, &prompt_of(5000), 0).is_none());
        // A prefill worker with `both` workers: they decode.
        let (model, _reg) = model_with_roles(&["prefill", "both"]).await;
        let pd = run_pd(&model, &prompt_of(5000), 0).unwrap();
        assert_eq!((pd.prefill.slot, pd.decode.slot), (0, 1));
        drop(pd);
        // A lone prefill worker: nothing can decode elsewhere.
        let (model, _reg) = model_with_roles(&["prefill"]).await;
        assert!(run_pd(&model, &prompt_of(5000), 0).is_none());
        assert_eq!(run(&model, &req(0), 0).unwrap().slot, 0);
    }

    fn req(n: u64) -> RouteRequest {
        RouteRequest {
            hashes: vec![],
            prompt_tokens: 10,
            hints: RouteHints {
                session: None,
                region: None,
                prefix_key: n,
                tenant: String::new(),
                pinned: None,
                shared: None,
                adapter: None,
            },
        }
    }

    #[tokio::test]
    async fn a_busy_model_is_loaded_on_one_more_worker() {
        // Capacity 8 per worker: the warm one is busy at 6 outstanding.
        let (workers, model, _reg) = model_on(&["warm", "cold", "cold"]).await;
        let mut held: Vec<Placement> = (0..5).map(|i| run(&model, &req(i), 0).unwrap()).collect();
        let preloads = || {
            workers
                .iter()
                .map(|w| w.preloads.load(Ordering::Relaxed))
                .collect::<Vec<_>>()
        };
        assert_eq!(preloads(), [0, 0, 0], "5 of 8: not busy yet");
        held.push(run(&model, &req(5), 0).unwrap());
        tokio::task::yield_now().await;
        assert!(held.iter().all(|p| p.slot == 0), "requests stay on the warm replica");
        assert_eq!(
            preloads().iter().sum::<usize>(),
            1,
            "one cold worker asked to load: {:?}",
            preloads()
        );
        assert_eq!(preloads()[0], 0);
        assert_eq!(model.spreads.load(Ordering::Relaxed), 1);
        // Still busy moments later: no second load (one per 10 s, and none while loading).
        held.push(run(&model, &req(6), 0).unwrap());
        tokio::task::yield_now().await;
        assert_eq!(preloads().iter().sum::<usize>(), 1);
        *workers[1].state.lock().unwrap() = Some("loading".into());
        *model.last_spread.lock().unwrap() = None;
        held.push(run(&model, &req(7), 0).unwrap());
        tokio::task::yield_now().await;
        assert_eq!(preloads().iter().sum::<usize>(), 1, "a load under way is waited for");
        drop(held);
    }

    #[tokio::test]
    async fn warm_replicas_are_chosen_before_workers_that_must_load() {
        let (workers, model, _reg) = model_on(&["cold", "warm", "cold"]).await;
        // Every request goes to the one warm worker, even as its load grows.
        let held: Vec<Placement> = (0..4).map(|i| run(&model, &req(i), 0).unwrap()).collect();
        assert!(
            held.iter().all(|p| p.slot == 1),
            "{:?}",
            held.iter().map(|p| p.slot).collect::<Vec<_>>()
        );
        // The warm worker excluded (it failed): a cold one loads it.
        let p = run(&model, &req(9), 1 << 1).unwrap();
        assert_ne!(p.slot, 1);
        // Nothing warm: the policy chooses among all (least outstanding: not the busy one).
        *workers[1].state.lock().unwrap() = Some("cold".into());
        let slots: Vec<usize> = (0..3).map(|i| run(&model, &req(i), 0).unwrap().slot).collect();
        assert!(slots.iter().all(|&s| s != 1), "{slots:?}");
        drop(held);
    }
}

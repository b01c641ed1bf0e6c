//! The gateway's Prometheus metrics, every one named here, once (`prometheus-client`).
//! Served at `GET /metrics` behind the admin token (see [`crate::app`]).
//!
//! Where the meaning is vLLM's, the name is vLLM's with Hearth's namespace (`hearth:`
//! instead of `vllm:`), so vLLM dashboards work after a prefix substitution:
//!
//! | Hearth | vLLM | measured |
//! |---|---|---|
//! | `hearth:time_to_first_token_seconds` | `vllm:time_to_first_token_seconds` | request received at the gateway → first token relayed |
//! | `hearth:inter_token_latency_seconds` | `vllm:inter_token_latency_seconds` | between consecutive tokens relayed |
//! | `hearth:e2e_request_latency_seconds` | `vllm:e2e_request_latency_seconds` | request received → last event relayed |
//! | `hearth:prompt_tokens_total` | `vllm:prompt_tokens_total` | prompt tokens of finished requests (engine-reported) |
//! | `hearth:generation_tokens_total` | `vllm:generation_tokens_total` | completion tokens |
//! | `hearth:request_success_total` | `vllm:request_success_total` | finished requests by `finished_reason` |
//!
//! Hearth's own: `hearth_requests_total{model,endpoint,status}` (every answered request by
//! HTTP status), `hearth_prompt_tokens_cached_total` (prompt tokens served from the prefix
//! cache), `hearth_limiter_decisions_total{decision,limit}`,
//! `hearth_processor_seconds{hook}`, `hearth_processor_instances_total{source}` (a
//! processor's instance made ahead or on the request's path), `hearth_token_counts_total{outcome}`
//! (`count_tokens` requests: not billed, under the request limits), per tenant
//! `hearth_stored_responses` and `hearth_stored_response_bytes`, per tenant and class
//! `hearth_shed_requests_total`,
//! `hearth_tenant_time_to_first_token_seconds` and `hearth_tenant_queue_time_seconds`
//! (the engine's queue), and per worker the router's view (in-flight requests,
//! prefill tokens, decoding sequences, cached blocks, health, KV-event mode) and routing
//! decisions. Engine-side metrics (queue, prefill and decode time, KV cache usage, prefix
//! hits, model load time) come from each worker's own `/metrics`; `hearth serve` adds its
//! in-process engines' to this registry through [`Metrics::register_collector`].

use std::sync::Mutex;
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use hearth_billing::UsageLedger;
use hearth_tenants::TenantStore;

use crate::upstream::registry::ModelRegistry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelLabel {
    pub model: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    /// The resolved model, or `unknown` before resolution (never the client's raw text).
    pub model: String,
    pub endpoint: String,
    pub status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FinishLabels {
    pub model: String,
    pub finished_reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LimiterLabels {
    /// `admitted` or `rejected`.
    pub decision: String,
    /// What refused (`requests`, `tokens`, …); empty when admitted.
    pub limit: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HookLabel {
    /// `pre` or `post`.
    pub hook: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SourceLabel {
    /// `warm` (made ahead, taken from the runtime's shelf) or `made` (on the request's path).
    pub source: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabel {
    /// `counted`, or `refused` (a credential, a limit, a bad body).
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WorkerLabels {
    pub model: String,
    pub worker: String,
    pub region: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PdLabels {
    pub model: String,
    /// `disaggregated` (prefill and decode workers), `prefill_only` (finished at its first
    /// token), `retried_colocated` (a failure; served by one worker instead) or `failed`.
    pub outcome: String,
}

/// Per tenant (its name).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TenantLabel {
    pub tenant: String,
}

/// Per tenant and class. The tenant is its name: one series per tenant and class, so a
/// deployment with very many tenants should scrape these at a lower rate or drop them.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TenantClassLabels {
    pub model: String,
    pub tenant: String,
    /// `interactive` or `batch`.
    pub priority: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DecisionLabels {
    pub model: String,
    pub policy: String,
    pub reason: String,
}

type Hist = Family<ModelLabel, Histogram, fn() -> Histogram>;

/// vLLM's bucket boundaries, so that the histograms compare directly.
const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
];
const ITL_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
];
const E2E_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
    1920.0, 7680.0,
];
const PROCESSOR_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
];

fn ttft_histogram() -> Histogram {
    Histogram::new(TTFT_BUCKETS.iter().copied())
}
fn itl_histogram() -> Histogram {
    Histogram::new(ITL_BUCKETS.iter().copied())
}
fn e2e_histogram() -> Histogram {
    Histogram::new(E2E_BUCKETS.iter().copied())
}
fn processor_histogram() -> Histogram {
    Histogram::new(PROCESSOR_BUCKETS.iter().copied())
}

/// Every metric of one gateway process.
pub struct Metrics {
    registry: Registry,
    /// Serialises scrapes: the router gauges are refreshed, then everything encoded.
    render: Mutex<()>,
    pub requests: Family<RequestLabels, Counter>,
    pub ttft: Hist,
    pub itl: Hist,
    pub e2e: Hist,
    pub prompt_tokens: Family<ModelLabel, Counter>,
    pub cached_tokens: Family<ModelLabel, Counter>,
    pub generation_tokens: Family<ModelLabel, Counter>,
    pub finished: Family<FinishLabels, Counter>,
    pub limiter: Family<LimiterLabels, Counter>,
    pub processor: Family<HookLabel, Histogram, fn() -> Histogram>,
    pub processor_instances: Family<SourceLabel, Counter>,
    /// `count_tokens` requests (Anthropic's `/v1/messages/count_tokens`), by outcome: not
    /// billed, but under the request limits.
    pub token_counts: Family<OutcomeLabel, Counter>,
    pub pd: Family<PdLabels, Counter>,
    /// Each tenant's stored responses (Responses API, `store: true`) and their bytes, as
    /// the shared database holds them (every gateway reports the same values).
    pub stored_responses: Family<TenantLabel, Gauge>,
    pub stored_response_bytes: Family<TenantLabel, Gauge>,
    /// Requests shed by admission control.
    pub shed: Family<TenantClassLabels, Counter>,
    /// Registry entries a discovering gateway refused (bad seal, stale, wrong id).
    pub registrations_refused: Counter,
    /// Streams continued on another worker after theirs was lost.
    pub failovers: Counter,
    /// Requests authenticated from a stale cache entry while the key store was unreachable.
    pub auth_stale: Counter,
    /// Credential checks refused because their source sent too many bad credentials.
    pub auth_throttled: Counter,
    /// Batches created, batches finished (completed, expired or cancelled), batch lines
    /// answered by this gateway, and lines sent back to wait (rate limit, overload, budget).
    pub batches_created: Counter,
    pub batches_finished: Counter,
    pub batch_lines: Counter,
    pub batch_lines_sent_back: Counter,
    pub password_checks: Counter,
    /// Usage records the outbox could not append (the disk is full or failing).
    pub outbox_errors: Counter,
    /// The public listener's connections (open, refused at a cap).
    pub connections: crate::server::http::ConnectionMetrics,
    /// Tasks alive in this process's runtime (set when rendered): a leak shows as growth.
    alive_tasks: Gauge,
    /// 1 while the usage outbox cannot be written (set when rendered).
    outbox_failing: Gauge,
    pub tenant_ttft: Family<TenantClassLabels, Histogram, fn() -> Histogram>,
    /// The engine's queue time (arrival at the worker → first scheduled step).
    pub tenant_queue: Family<TenantClassLabels, Histogram, fn() -> Histogram>,
    worker_gauges: [Family<WorkerLabels, Gauge>; 6],
    decisions: Family<DecisionLabels, Counter>,
    index_blocks: Family<ModelLabel, Gauge>,
    fetches: Family<ModelLabel, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        // The registry ends every help text with a full stop: none is written here.
        let mut registry = Registry::default();
        let requests = Family::<RequestLabels, Counter>::default();
        registry.register(
            "hearth_requests",
            "Requests answered, by model, endpoint and HTTP status",
            requests.clone(),
        );
        let ttft: Hist = Family::new_with_constructor(ttft_histogram);
        registry.register(
            "hearth:time_to_first_token_seconds",
            "Time from the request reaching the gateway to its first token",
            ttft.clone(),
        );
        let itl: Hist = Family::new_with_constructor(itl_histogram);
        registry.register(
            "hearth:inter_token_latency_seconds",
            "Time between consecutive tokens of a request",
            itl.clone(),
        );
        let e2e: Hist = Family::new_with_constructor(e2e_histogram);
        registry.register(
            "hearth:e2e_request_latency_seconds",
            "Time from the request reaching the gateway to its last event",
            e2e.clone(),
        );
        let prompt_tokens = Family::<ModelLabel, Counter>::default();
        registry.register(
            "hearth:prompt_tokens",
            "Prompt tokens of finished requests",
            prompt_tokens.clone(),
        );
        let cached_tokens = Family::<ModelLabel, Counter>::default();
        registry.register(
            "hearth_prompt_tokens_cached",
            "Prompt tokens served from the engines' prefix caches",
            cached_tokens.clone(),
        );
        let generation_tokens = Family::<ModelLabel, Counter>::default();
        registry.register(
            "hearth:generation_tokens",
            "Completion tokens of finished requests",
            generation_tokens.clone(),
        );
        let finished = Family::<FinishLabels, Counter>::default();
        registry.register(
            "hearth:request_success",
            "Requests that finished generating, by finish reason",
            finished.clone(),
        );
        let limiter = Family::<LimiterLabels, Counter>::default();
        registry.register(
            "hearth_limiter_decisions",
            "Rate-limit admissions and rejections (by the limit that refused)",
            limiter.clone(),
        );
        let processor: Family<HookLabel, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(processor_histogram);
        registry.register(
            "hearth_processor_seconds",
            "Time in tenant processors per request, by hook",
            processor.clone(),
        );
        let processor_instances = Family::<SourceLabel, Counter>::default();
        registry.register(
            "hearth_processor_instances",
            "Processor instances given to requests, by source: warm (made ahead) or made (on the request's path: an empty shelf, or --processor-warm 0)",
            processor_instances.clone(),
        );
        let token_counts = Family::<OutcomeLabel, Counter>::default();
        registry.register(
            "hearth_token_counts",
            "count_tokens requests (Anthropic Messages), by outcome: counted (not billed; under the tenant's and key's requests per minute and in flight) or refused",
            token_counts.clone(),
        );
        let stored_responses = Family::<TenantLabel, Gauge>::default();
        registry.register(
            "hearth_stored_responses",
            "Stored responses (Responses API, store: true) by tenant, as the shared database holds them (refreshed each minute and on every store)",
            stored_responses.clone(),
        );
        let stored_response_bytes = Family::<TenantLabel, Gauge>::default();
        registry.register(
            "hearth_stored_response_bytes",
            "Bytes of stored responses by tenant (counted against --responses-tenant-bytes)",
            stored_response_bytes.clone(),
        );
        let pd = Family::<PdLabels, Counter>::default();
        registry.register(
            "hearth_pd_requests",
            "Requests sent to a prefill and a decode worker, by outcome",
            pd.clone(),
        );
        let shed = Family::<TenantClassLabels, Counter>::default();
        registry.register(
            "hearth_shed_requests",
            "Requests refused by admission control because the model's pool was at capacity for their class",
            shed.clone(),
        );
        let registrations_refused = Counter::default();
        registry.register(
            "hearth_worker_registrations_refused",
            "Worker registry entries refused: not sealed with this gateway's worker token, stale, or under another worker's id",
            registrations_refused.clone(),
        );
        let failovers = Counter::default();
        registry.register(
            "hearth_failovers",
            "Streams whose worker was lost mid-generation and that continued on another worker",
            failovers.clone(),
        );
        let auth_stale = Counter::default();
        registry.register(
            "hearth_auth_stale",
            "Requests authenticated from a cached credential past its refresh time because the key store did not answer",
            auth_stale.clone(),
        );
        let auth_throttled = Counter::default();
        registry.register(
            "hearth_auth_throttled",
            "Requests refused (429) because their source address sent too many invalid credentials",
            auth_throttled.clone(),
        );
        let counter = |registry: &mut Registry, name: &str, help: &str| {
            let c = Counter::default();
            registry.register(name, help, c.clone());
            c
        };
        let batches_created = counter(
            &mut registry,
            "hearth_batches_created",
            "Batches created (OpenAI Batch API)",
        );
        let batches_finished = counter(
            &mut registry,
            "hearth_batches_finished",
            "Batches this gateway finished: completed, expired or cancelled, their output and error files written",
        );
        let batch_lines = counter(
            &mut registry,
            "hearth_batch_lines",
            "Batch lines this gateway ran and answered (any status)",
        );
        let batch_lines_sent_back = counter(
            &mut registry,
            "hearth_batch_lines_sent_back",
            "Batch lines refused for now (rate limit, overload, a spent hard budget) and sent back to run again later",
        );
        let password_checks = Counter::default();
        registry.register(
            "hearth_dashboard_password_checks",
            "Argon2id password verifications by dashboard sign-ins (an unknown tenant or address verifies a dummy hash, so it counts too)",
            password_checks.clone(),
        );
        let connections = crate::server::http::ConnectionMetrics::default();
        registry.register(
            "hearth_http_connections_open",
            "Client connections the gateway holds open now",
            connections.open.clone(),
        );
        registry.register(
            "hearth_http_connections_refused",
            "Client connections closed at once because the total or per-address connection cap was reached",
            connections.refused.clone(),
        );
        let alive_tasks = Gauge::default();
        registry.register(
            "hearth_runtime_alive_tasks",
            "Tasks alive in the gateway's async runtime (requests, relays, background work)",
            alive_tasks.clone(),
        );
        let outbox_failing = Gauge::default();
        registry.register(
            "hearth_usage_outbox_failing",
            "1 while the usage outbox cannot be written (disk full): records go to the database directly, and requests are refused if it fails too",
            outbox_failing.clone(),
        );
        let outbox_errors = Counter::default();
        registry.register(
            "hearth_usage_outbox_errors",
            "Usage records the local outbox could not append (disk full or failing); each went to the database directly or its request was refused",
            outbox_errors.clone(),
        );
        let tenant_ttft: Family<TenantClassLabels, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(ttft_histogram);
        registry.register(
            "hearth_tenant_time_to_first_token_seconds",
            "Time to first token, by tenant and priority class",
            tenant_ttft.clone(),
        );
        let tenant_queue: Family<TenantClassLabels, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(ttft_histogram);
        registry.register(
            "hearth_tenant_queue_time_seconds",
            "Time waiting in the engine's queue (arrival to first scheduled step), by tenant and priority class",
            tenant_queue.clone(),
        );
        let worker_gauges: [Family<WorkerLabels, Gauge>; 6] = Default::default();
        let gauge_help = [
            (
                "hearth_worker_inflight_requests",
                "Requests dispatched to the worker and not finished",
            ),
            (
                "hearth_worker_inflight_prefill_tokens",
                "Prompt tokens dispatched to the worker and not yet computed (router estimate)",
            ),
            (
                "hearth_worker_decoding_sequences",
                "Requests past their first token on the worker",
            ),
            (
                "hearth_worker_cached_blocks",
                "KV blocks the router's index says the worker holds",
            ),
            ("hearth_worker_healthy", "1 when the worker passes its health check"),
            (
                "hearth_worker_exact_kv_events",
                "1 when the router follows the worker's KV events (else it assumes)",
            ),
        ];
        for (g, (name, help)) in worker_gauges.iter().zip(gauge_help) {
            registry.register(name, help, g.clone());
        }
        let decisions = Family::<DecisionLabels, Counter>::default();
        registry.register(
            "hearth_routing_decisions",
            "Routing decisions by policy and reason",
            decisions.clone(),
        );
        let fetches = Family::<ModelLabel, Counter>::default();
        registry.register(
            "hearth_routing_fetches",
            "Routing decisions that had the chosen worker pull the prompt's prefix from a peer holding it",
            fetches.clone(),
        );
        let index_blocks = Family::<ModelLabel, Gauge>::default();
        registry.register(
            "hearth_router_index_blocks",
            "Distinct KV blocks in the router's index",
            index_blocks.clone(),
        );
        Self {
            registry,
            render: Mutex::new(()),
            requests,
            ttft,
            itl,
            e2e,
            prompt_tokens,
            cached_tokens,
            generation_tokens,
            finished,
            limiter,
            pd,
            shed,
            registrations_refused,
            failovers,
            auth_stale,
            auth_throttled,
            batches_created,
            batches_finished,
            batch_lines,
            batch_lines_sent_back,
            password_checks,
            outbox_errors,
            connections,
            alive_tasks,
            outbox_failing,
            tenant_ttft,
            tenant_queue,
            processor,
            processor_instances,
            token_counts,
            stored_responses,
            stored_response_bytes,
            worker_gauges,
            decisions,
            index_blocks,
            fetches,
        }
    }

    /// Every family with one example series, in the text exposition: the source of the
    /// metrics reference (`hearth docs metrics`). A family without series is not encoded at
    /// all, so each one gets a series here; the label values are placeholders.
    pub fn reference_exposition() -> String {
        let m = Self::new();
        let s = |v: &str| v.to_string();
        let model = Self::model("MODEL");
        let _ = m.requests.get_or_create(&RequestLabels {
            model: s("MODEL"),
            endpoint: s("ENDPOINT"),
            status: 200,
        });
        for h in [&m.ttft, &m.itl, &m.e2e] {
            let _ = h.get_or_create(&model);
        }
        for c in [&m.prompt_tokens, &m.cached_tokens, &m.generation_tokens, &m.fetches] {
            let _ = c.get_or_create(&model);
        }
        let _ = m.index_blocks.get_or_create(&model);
        let _ = m.finished.get_or_create(&FinishLabels {
            model: s("MODEL"),
            finished_reason: s("REASON"),
        });
        let _ = m.limiter.get_or_create(&LimiterLabels {
            decision: s("DECISION"),
            limit: s("LIMIT"),
        });
        let _ = m.processor.get_or_create(&HookLabel { hook: s("HOOK") });
        let _ = m
            .processor_instances
            .get_or_create(&SourceLabel { source: s("SOURCE") });
        let _ = m.token_counts.get_or_create(&OutcomeLabel { outcome: s("OUTCOME") });
        let _ = m.stored_responses.get_or_create(&TenantLabel { tenant: s("TENANT") });
        let _ = m
            .stored_response_bytes
            .get_or_create(&TenantLabel { tenant: s("TENANT") });
        let _ = m.pd.get_or_create(&PdLabels {
            model: s("MODEL"),
            outcome: s("OUTCOME"),
        });
        let tenant = TenantClassLabels {
            model: s("MODEL"),
            tenant: s("TENANT"),
            priority: s("PRIORITY"),
        };
        let _ = m.shed.get_or_create(&tenant);
        let _ = m.tenant_ttft.get_or_create(&tenant);
        let _ = m.tenant_queue.get_or_create(&tenant);
        let worker = WorkerLabels {
            model: s("MODEL"),
            worker: s("WORKER"),
            region: s("REGION"),
        };
        for g in &m.worker_gauges {
            let _ = g.get_or_create(&worker);
        }
        let _ = m.decisions.get_or_create(&DecisionLabels {
            model: s("MODEL"),
            policy: s("POLICY"),
            reason: s("REASON"),
        });
        let mut out = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut out, &m.registry)
            .expect("encoding into a String cannot fail");
        out
    }

    /// Adds metrics collected at scrape time (e.g. an in-process engine's).
    pub fn register_collector(&mut self, collector: Box<dyn Collector>) {
        self.registry.register_collector(collector);
    }

    pub fn model(model: &str) -> ModelLabel {
        ModelLabel {
            model: model.to_string(),
        }
    }

    /// One tenant's stored responses and their bytes, as last read.
    pub fn stored_responses(&self, tenant: &str, count: u64, bytes: u64) {
        let t = TenantLabel {
            tenant: tenant.to_string(),
        };
        self.stored_responses
            .get_or_create(&t)
            .set(i64::try_from(count).unwrap_or(i64::MAX));
        self.stored_response_bytes
            .get_or_create(&t)
            .set(i64::try_from(bytes).unwrap_or(i64::MAX));
    }

    /// Every tenant's stored responses at once (the periodic refresh): tenants with none
    /// left lose their series.
    pub fn set_stored_responses(&self, totals: &[hearth_tenants::responses::ResponseTotals]) {
        self.stored_responses.clear();
        self.stored_response_bytes.clear();
        for t in totals {
            self.stored_responses(&t.tenant_name, t.count, t.bytes);
        }
    }

    /// One processor instance given to a request: made ahead (`warm`) or not.
    pub fn count_processor_instance(&self, warm: bool) {
        let source = if warm { "warm" } else { "made" };
        self.processor_instances
            .get_or_create(&SourceLabel { source: source.into() })
            .inc();
    }

    pub fn observe_processor(&self, hook: &str, took: Duration) {
        self.processor
            .get_or_create(&HookLabel { hook: hook.to_string() })
            .observe(took.as_secs_f64());
    }

    /// The text exposition, with the router's gauges as of now.
    pub fn render(&self, ledger: &UsageLedger, tenants: &TenantStore, models: &ModelRegistry) -> String {
        let _serial = self.render.lock().unwrap_or_else(|e| e.into_inner());
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            self.alive_tasks
                .set(i64::try_from(rt.metrics().num_alive_tasks()).unwrap_or(i64::MAX));
        }
        // Counted where they happen (the ledger, the key store); brought up to date here.
        let catch_up = |c: &Counter, now: u64| c.inc_by(now.saturating_sub(c.get()));
        catch_up(
            &self.outbox_errors,
            ledger.health().outbox_errors.load(std::sync::atomic::Ordering::Relaxed),
        );
        catch_up(&self.auth_stale, tenants.health.stale_served());
        self.outbox_failing.set(i64::from(
            ledger
                .health()
                .outbox_failing
                .load(std::sync::atomic::Ordering::Relaxed),
        ));
        for g in &self.worker_gauges {
            g.clear();
        }
        self.index_blocks.clear();
        for m in models.all() {
            let r = m.router();
            for (slot, w) in r.workers() {
                let labels = WorkerLabels {
                    model: m.id.clone(),
                    worker: w.name.clone(),
                    region: w.region.clone(),
                };
                let values = [
                    w.outstanding as i64,
                    w.inflight_prefill_tokens as i64,
                    w.decoding as i64,
                    r.index.worker_blocks(slot) as i64,
                    i64::from(w.healthy),
                    i64::from(w.exact_events),
                ];
                for (g, v) in self.worker_gauges.iter().zip(values) {
                    g.get_or_create(&labels).set(v);
                }
            }
            for ((policy, reason), n) in r.decisions.iter() {
                let labels = DecisionLabels {
                    model: m.id.clone(),
                    policy: policy.to_string(),
                    reason: reason.as_str().to_string(),
                };
                // The router counts; the counter catches up with it.
                let c = self.decisions.get_or_create(&labels);
                c.inc_by(n.saturating_sub(c.get()));
            }
            let c = self.fetches.get_or_create(&Self::model(&m.id));
            c.inc_by(r.fetches.saturating_sub(c.get()));
            self.index_blocks
                .get_or_create(&Self::model(&m.id))
                .set(r.index.len() as i64);
            drop(r);
            for (outcome, n) in m.pd.snapshot() {
                if n == 0 {
                    continue;
                }
                let c = self.pd.get_or_create(&PdLabels {
                    model: m.id.clone(),
                    outcome: outcome.to_string(),
                });
                c.inc_by(n.saturating_sub(c.get()));
            }
        }
        let mut out = String::new();
        if let Err(e) = prometheus_client::encoding::prometheus_text::encode(&mut out, &self.registry) {
            tracing::error!(error = %e, "metrics encoding failed");
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reference is built from the registry, so a metric is missing from it only when
    /// its family was given no example series: every metric name written in this file must
    /// be in the example exposition.
    #[test]
    fn the_reference_exposition_has_every_metric_named_here() {
        let text = Metrics::reference_exposition();
        let source = include_str!("metrics.rs");
        let mut named = 0;
        let literals = source.match_indices("\"hearth").map(|(i, _)| &source[i + 1..]);
        for quoted in literals.filter_map(|rest| rest.split('"').next()) {
            let is_name = (quoted.starts_with("hearth_") || quoted.starts_with("hearth:"))
                && !quoted.ends_with(['_', ':'])
                && quoted.chars().all(|c| c.is_ascii_lowercase() || c == '_' || c == ':');
            if !is_name {
                continue;
            }
            named += 1;
            let total = format!("{quoted}_total");
            let helped = text
                .lines()
                .filter_map(|l| l.strip_prefix("# HELP ")?.split(' ').next())
                .any(|name| name == quoted || name == total);
            assert!(
                helped,
                "{quoted} is registered but has no example series in the reference"
            );
        }
        assert!(named >= 30, "only {named} metric names found in the source");
        // The registry adds the full stop itself.
        let doubled: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("# HELP ") && l.ends_with(".."))
            .collect();
        assert!(doubled.is_empty(), "help ending in '..': {doubled:?}");
    }
}

//! The OpenAI-compatible API and the life of a request through it.
//!
//! One pipeline, one function per phase, in order:
//! [`authenticate`] (API key or JWT, scope) → [`budget`] → parse (`openai`) →
//! [`resolve`] (and the key's allowed models) → [`tokenize`] → [`limit`] (requests, tokens,
//! in flight: one step) → [`dispatch`] (route + send to a worker) → [`relay`] (stream to the client, meter: the
//! usage record is committed before the client gets the final event). Tenant processors
//! slot in as phases of their own in a later issue.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use futures_util::StreamExt;
use hearth_billing::{format_nusd, month_of, Pending, UsageLedger, UsageRecord, UsageStatus};
use hearth_protocol::{
    block_hashes, cache_namespace, namespace_root, FinishReason, GenerateEvent, GenerateRequest, TokenLogprob, Usage,
};
use hearth_router::{Policy, RouteInput};
use hearth_tenants::{now_ms, AuthError, TenantContext, TenantStore};
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::error::ApiError;
use crate::limits::{InFlight, Limiter, RateState};
use crate::openai::{self, Common, Prompt};
use crate::processors::Chain;
use crate::registry::{ModelRegistry, ServedModel};
use crate::workers::{EventStream, WorkerError};

/// Shared state of one gateway process.
pub struct Gateway {
    pub tenants: TenantStore,
    pub ledger: UsageLedger,
    pub models: ModelRegistry,
    /// `HEARTH_ADMIN_TOKEN`; the admin API is closed without it.
    pub admin_token: Option<String>,
    pub limiter: Limiter,
    pub budgets: BudgetCache,
    /// Tenant processors (None: processors are disabled in this gateway).
    pub processors: Option<crate::processors::ProcessorHost>,
    /// Only `hearth bench gateway` sets this (it is not reachable from any configuration):
    /// requests skip authentication, budgets, limits and metering, so that the benchmark
    /// can time the same request with and without them.
    pub bench_unmetered: bool,
}

/// This request's id, set by the outermost middleware and echoed in `x-request-id`.
#[derive(Debug, Clone)]
pub struct RequestId(pub String);

fn random_id() -> String {
    let mut b = [0u8; 12];
    if getrandom::fill(&mut b).is_err() {
        // Ids must still be unique if the OS source fails: fall back to time + counter.
        static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        b[..8].copy_from_slice(&(now_ms() as u64).to_le_bytes());
        b[8..].copy_from_slice(&(n as u32).to_le_bytes());
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}

async fn request_id(mut req: Request, next: Next) -> Response {
    let id = format!("req_{}", random_id());
    req.extensions_mut().insert(RequestId(id.clone()));
    let mut resp = next.run(req).await;
    if let Ok(v) = HeaderValue::from_str(&id) {
        resp.headers_mut().insert("x-request-id", v);
    }
    resp
}

pub fn router(gw: Arc<Gateway>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(list_models))
        .route("/v1/models/{model}", get(get_model))
        .route("/healthz", get(healthz))
        .route("/metrics", get(crate::metrics::render))
        .nest("/admin/v1", crate::admin::router())
        .nest("/v1/tenant", crate::selfservice::router())
        .fallback(|| async {
            ApiError::not_found("no such endpoint; see /v1/chat/completions, /v1/completions, /v1/models")
        })
        .with_state(gw)
        .layer(middleware::from_fn(request_id))
}

async fn healthz(State(gw): State<Arc<Gateway>>) -> Json<Value> {
    let models: Vec<Value> = gw
        .models
        .all()
        .map(|m| json!({"id": m.id, "workers": m.worker_count()}))
        .collect();
    Json(json!({"status": "ok", "models": models}))
}

// ---- phase: authenticate -------------------------------------------------------------

/// `Authorization: Bearer <API key or JWT>` → who is asking.
pub async fn authenticate(gw: &Gateway, headers: &HeaderMap) -> Result<TenantContext, ApiError> {
    let Some(value) = headers.get(header::AUTHORIZATION) else {
        return Err(ApiError::unauthorized(
            "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'; create one with 'hearth admin key create --tenant NAME'.",
        ));
    };
    let key = value
        .to_str()
        .ok()
        .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")))
        .map(str::trim)
        .unwrap_or("");
    match gw.tenants.authenticate(key).await {
        Ok(ctx) => Ok(ctx),
        Err(AuthError::Store(e)) => {
            tracing::error!(error = %e, "key store unavailable");
            Err(ApiError::unavailable("authentication is temporarily unavailable"))
        }
        Err(AuthError::Revoked) => Err(ApiError::unauthorized("This API key has been revoked.")),
        Err(AuthError::Expired(_)) => Err(ApiError::unauthorized("This API key has expired.")),
        Err(AuthError::Jwt(why)) => Err(ApiError::unauthorized(format!("Invalid bearer token: {why}."))),
        Err(_) => Err(ApiError::unauthorized("Incorrect API key provided.")),
    }
}

/// [`authenticate`], then the scope the endpoint needs.
pub async fn authorize(gw: &Gateway, headers: &HeaderMap, manage: bool) -> Result<TenantContext, ApiError> {
    let ctx = authenticate(gw, headers).await?;
    let (ok, scope) = if manage {
        (ctx.scopes.manage, "manage")
    } else {
        (ctx.scopes.inference, "inference")
    };
    if !ok {
        return Err(ApiError::permission(
            "missing_scope",
            format!("This credential lacks the '{scope}' scope needed here."),
        ));
    }
    Ok(ctx)
}

// ---- phase: budget -------------------------------------------------------------------

/// How long a tenant's month spend is trusted before the ledger is asked again; costs this
/// gateway records are added at once, other gateways' within this time.
const SPEND_TTL: Duration = Duration::from_secs(2);

/// Month-to-date spend per tenant, from the ledger's `tenant_spend`.
#[derive(Default)]
pub struct BudgetCache {
    spend: std::sync::Mutex<std::collections::HashMap<String, (String, i64, std::time::Instant)>>,
}

impl BudgetCache {
    async fn spend(&self, ledger: &UsageLedger, tenant_id: &str, month: &str) -> Result<i64, ApiError> {
        if let Some((m, v, at)) = self.lock().get(tenant_id) {
            if m == month && at.elapsed() < SPEND_TTL {
                return Ok(*v);
            }
        }
        let v = ledger.month_spend(tenant_id, month).await.map_err(|e| {
            tracing::error!(error = %e, "spend lookup failed");
            ApiError::unavailable("budget check temporarily unavailable")
        })?;
        self.lock()
            .insert(tenant_id.to_string(), (month.to_string(), v, std::time::Instant::now()));
        Ok(v)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<String, (String, i64, std::time::Instant)>> {
        self.spend.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds a cost this gateway just recorded.
    fn add(&self, tenant_id: &str, month: &str, nusd: i64) {
        if let Some((m, v, _)) = self.lock().get_mut(tenant_id) {
            if m == month {
                *v += nusd;
            }
        }
    }
}

/// What the budget phase tells the client (`x-hearth-budget-*` headers).
#[derive(Default)]
pub struct BudgetState {
    remaining_nusd: Option<i64>,
    warning: Option<String>,
}

impl BudgetState {
    fn apply(&self, h: &mut HeaderMap) {
        if let Some(r) = self.remaining_nusd {
            if let Ok(v) = HeaderValue::from_str(&format_nusd(r.max(0))) {
                h.insert("x-hearth-budget-remaining-usd", v);
            }
        }
        if let Some(w) = &self.warning {
            if let Ok(v) = HeaderValue::from_str(w) {
                h.insert("x-hearth-budget-warning", v);
            }
        }
    }
}

/// The tenant's monthly budget: a hard one refuses once spent, a soft one warns.
pub async fn budget(gw: &Gateway, tenant: &TenantContext) -> Result<BudgetState, ApiError> {
    let Some(b) = tenant.budget else {
        return Ok(BudgetState::default());
    };
    let month = month_of(now_ms());
    let spent = gw.budgets.spend(&gw.ledger, &tenant.tenant_id, &month).await?;
    let mut state = BudgetState {
        remaining_nusd: Some(b.monthly_nusd - spent),
        warning: None,
    };
    if spent >= b.monthly_nusd {
        let msg = format!(
            "The monthly budget of tenant {} (${}) is spent (${} in {month}).",
            tenant.tenant_name,
            format_nusd(b.monthly_nusd),
            format_nusd(spent)
        );
        if b.hard {
            return Err(ApiError::budget_exceeded(format!(
                "{msg} Raise it with 'hearth admin tenant budget' or wait for the next month."
            )));
        }
        state.warning = Some(msg);
    }
    Ok(state)
}

// ---- phase: resolve ------------------------------------------------------------------

fn resolve<'a>(gw: &'a Gateway, model: &str) -> Result<&'a Arc<ServedModel>, ApiError> {
    gw.models.get(model).ok_or_else(|| ApiError::model_not_found(model))
}

// ---- phase: tokenize -----------------------------------------------------------------

enum Input<'a> {
    Chat(&'a [hearth_protocol::ChatMessage]),
    Prompt(&'a Prompt),
}

/// Templates and tokenizes at the gateway, and fixes `max_tokens` against the context.
fn tokenize(model: &ServedModel, input: Input<'_>, common: &Common) -> Result<(Vec<u32>, u32), ApiError> {
    let ids = match input {
        Input::Chat(messages) => {
            let tmpl = model.template.as_ref().ok_or_else(|| {
                ApiError::invalid(
                    "model",
                    format!("model {} has no chat template; use /v1/completions", model.id),
                )
            })?;
            let text = tmpl
                .render(messages, true)
                .map_err(|e| ApiError::invalid("messages", e.to_string()))?;
            model.tokenizer.encode(&text)
        }
        Input::Prompt(Prompt::Text(t)) => model.tokenizer.encode_prompt(t),
        Input::Prompt(Prompt::Tokens(ids)) => {
            let vocab = model.tokenizer.vocab_size() as u32;
            if let Some(bad) = ids.iter().find(|&&t| t >= vocab) {
                return Err(ApiError::invalid(
                    "prompt",
                    format!("token id {bad} is outside the vocabulary (size {vocab})"),
                ));
            }
            ids.clone()
        }
    };
    if ids.is_empty() {
        return Err(ApiError::invalid("prompt", "the prompt encodes to no tokens"));
    }
    let ctx = model.context_length;
    let prompt = ids.len() as u32;
    let room = ctx.saturating_sub(prompt);
    let max_tokens = match common.max_tokens {
        _ if room == 0 => 0,
        None => room,
        Some(m) if m <= room => m,
        Some(m) => {
            return Err(ApiError::context_length(format!(
                "This model's maximum context length is {ctx} tokens. However, you requested {} tokens ({prompt} in the prompt, {m} in the completion). Reduce the prompt or max_tokens.",
                prompt as u64 + m as u64
            )))
        }
    };
    if max_tokens == 0 {
        return Err(ApiError::context_length(format!(
            "This model's maximum context length is {ctx} tokens; the prompt has {prompt}, leaving no room for a completion."
        )));
    }
    Ok((ids, max_tokens))
}

// ---- phase: route + dispatch ---------------------------------------------------------

/// A request's place on a worker, for the router's load accounting; released on drop
/// (completion, failure, cancellation alike).
pub struct Placement {
    model: Arc<ServedModel>,
    slot: usize,
    uncached: usize,
    started: bool,
}

impl Placement {
    fn first_token(&mut self) {
        if !self.started {
            self.started = true;
            self.model.router().on_first_token(self.slot, self.uncached);
        }
    }
}

impl Drop for Placement {
    fn drop(&mut self) {
        self.model.router().on_finish(self.slot, self.uncached, self.started);
    }
}

/// What the router may use besides the tokens.
pub struct RouteHints {
    /// `x-session-affinity`.
    pub session: Option<String>,
    /// `x-hearth-region`, else the gateway's region.
    pub region: Option<String>,
    /// `prefix_aware`'s key: the leading text of the request and its cache namespace.
    pub prefix_key: u64,
}

/// Routes the request (policy, affinity, region) and sends it to the chosen worker; an
/// unreachable worker is marked unhealthy and the next choice tried (nothing has been
/// streamed yet, so a retry is safe).
async fn dispatch(
    model: &Arc<ServedModel>,
    req: GenerateRequest,
    hints: &RouteHints,
) -> Result<(EventStream, Placement), ApiError> {
    let root = namespace_root(&model.id, &req.cache_namespace);
    // The engine reuses whole blocks and always computes the last prompt token.
    let hashes = block_hashes(root, &req.prompt[..req.prompt.len() - 1], model.block_tokens);
    let mut exclude = 0u64;
    let mut last = None;
    loop {
        let placement = {
            let mut r = model.router();
            let input = RouteInput {
                hashes: &hashes,
                prompt_tokens: req.prompt.len(),
                prefix_key: hints.prefix_key,
                session: hints.session.as_deref(),
                region: hints.region.as_deref(),
                exclude,
            };
            let Some(d) = r.route(&input, model.now_ms()) else {
                break;
            };
            let uncached = req.prompt.len() - d.expected_cached_tokens;
            r.on_dispatch(d.worker, uncached);
            tracing::debug!(
                worker = d.worker,
                reason = d.reason.as_str(),
                expected_cached = d.expected_cached_tokens,
                "routed"
            );
            Placement {
                model: model.clone(),
                slot: d.worker,
                uncached,
                started: false,
            }
        };
        let slot = placement.slot;
        exclude |= 1 << slot;
        let Some(client) = model.client(slot).cloned() else {
            continue;
        };
        match client.generate(req.clone()).await {
            Ok(s) => return Ok((s, placement)),
            Err(e @ WorkerError::Unavailable { .. }) => {
                tracing::warn!(worker = client.name(), error = %e, "worker unavailable; trying the next");
                if let Some(w) = model.router().worker_mut(slot) {
                    w.healthy = false;
                }
                last = Some(e);
            }
            Err(e) => {
                tracing::error!(worker = client.name(), error = %e, "worker failed");
                return Err(ApiError::unavailable(format!("the worker for {} failed", model.id)));
            }
        }
    }
    let detail = last.map_or_else(String::new, |e| format!(": {e}"));
    Err(ApiError::unavailable(format!(
        "no worker for model {} is reachable{detail}",
        model.id
    )))
}

/// `prefix_aware`'s key: the first `prefix_length` characters of the request's text and
/// its cache namespace (SageMaker's semantics).
fn prefix_key(model: &ServedModel, text: &str, namespace: &str) -> u64 {
    let len = match model.router().cfg.policy {
        Policy::PrefixAware { prefix_length, .. } => prefix_length,
        _ => 2048,
    };
    let lead: String = text.chars().take(len).collect();
    xxhash_rust::xxh3::xxh3_64(format!("{namespace}\0{lead}").as_bytes())
}

/// A worker's error event as the client's error.
fn worker_error(code: &str, message: &str) -> ApiError {
    match code {
        "model_not_found" => ApiError::model_not_found(message),
        "invalid_prompt" => ApiError::invalid("prompt", message.to_string()),
        "context_length_exceeded" => ApiError::context_length(message.to_string()),
        "worker_disconnected" | "engine_stopped" => ApiError::unavailable(message.to_string()),
        c if c.starts_with("processor:") => crate::processors::stream_error(&c["processor:".len()..], message),
        _ => ApiError::internal(format!("generation failed: {message}")),
    }
}

// ---- phase: relay + meter ------------------------------------------------------------

/// Forwards worker events to the response, and writes the usage record: before the final
/// event reaches the client (write-before-ack), or as soon as the client goes away
/// (recording what was generated). Runs as its own task, so a vanished client cannot
/// lose a record; dropping `events` cancels the generation.
async fn relay(
    gw: Arc<Gateway>,
    mut rec: UsageRecord,
    mut events: EventStream,
    mut placement: Placement,
    admitted: Admitted,
    tx: mpsc::Sender<GenerateEvent>,
) {
    let mut generated = 0u32;
    let ended = loop {
        let ev = tokio::select! {
            ev = events.next() => ev.unwrap_or_else(|| GenerateEvent::Error {
                code: "worker_disconnected".into(),
                message: "the worker ended the stream without finishing".into(),
            }),
            () = tx.closed() => break None,
        };
        let terminal = match &ev {
            GenerateEvent::Token { .. } => {
                generated += 1;
                placement.first_token();
                false
            }
            GenerateEvent::Finish { .. } => false,
            GenerateEvent::Done { finish_reason, usage } => {
                rec.prompt_tokens = usage.prompt_tokens;
                rec.cached_tokens = usage.cached_tokens;
                rec.completion_tokens = usage.completion_tokens;
                rec.status = UsageStatus::Completed.as_str().into();
                rec.finish_reason = Some(finish_reason.as_str().into());
                true
            }
            GenerateEvent::Error { code, message } => {
                tracing::warn!(request_id = %rec.request_id, code = %code, message = %message, "generation failed");
                rec.completion_tokens = generated;
                rec.status = UsageStatus::Failed.as_str().into();
                rec.error_code = Some(code.clone());
                true
            }
        };
        if terminal {
            let pending = write_usage(&gw, &mut rec).await;
            let _ = tx.send(ev).await;
            break Some(pending);
        }
        if tx.send(ev).await.is_err() {
            break None;
        }
    };
    // The client's response ends here; what follows is bookkeeping.
    drop(tx);
    drop(placement);
    gw.limiter
        .charge_completion(&admitted.tenant, rec.completion_tokens.max(generated))
        .await;
    drop(admitted); // releases the in-flight slots
    let pending = match ended {
        Some(p) => p,
        None => {
            drop(events); // cancels the generation
            rec.completion_tokens = generated;
            rec.status = UsageStatus::Cancelled.as_str().into();
            rec.finish_reason = Some(FinishReason::Cancelled.as_str().into());
            write_usage(&gw, &mut rec).await
        }
    };
    settle(&gw, &rec, pending).await;
}

/// Makes a request's usage record durable (the outbox); returns the handle on its database
/// commit. Called before the client gets the end of its response.
async fn write_usage(gw: &Gateway, rec: &mut UsageRecord) -> Option<Pending> {
    if gw.bench_unmetered {
        return None;
    }
    rec.finished_at = now_ms();
    match gw.ledger.record_durable(rec).await {
        Ok(p) => Some(p),
        Err(e) => {
            tracing::error!(record = ?rec, error = %e, "usage record could not be written");
            None
        }
    }
}

/// Waits for a record's commit and counts its cost towards the tenant's budget at once.
async fn settle(gw: &Gateway, rec: &UsageRecord, pending: Option<Pending>) {
    let Some(p) = pending else { return };
    match p.committed().await {
        Ok(r) if r.inserted => gw
            .budgets
            .add(&rec.tenant_id, &month_of(rec.started_at), r.cost.total_nusd),
        Ok(_) => {}
        Err(e) => tracing::warn!(request_id = %rec.request_id, error = %e, "usage record is waiting in the outbox"),
    }
}

// ---- the endpoints -------------------------------------------------------------------

#[derive(Clone, Copy, PartialEq)]
enum Endpoint {
    Chat,
    Completions,
}

impl Endpoint {
    fn path(self) -> &'static str {
        match self {
            Endpoint::Chat => "/v1/chat/completions",
            Endpoint::Completions => "/v1/completions",
        }
    }
}

async fn chat_completions(
    State(gw): State<Arc<Gateway>>,
    Extension(RequestId(id)): Extension<RequestId>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    handle(gw, id, headers, body, Endpoint::Chat).await
}

async fn completions(
    State(gw): State<Arc<Gateway>>,
    Extension(RequestId(id)): Extension<RequestId>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    handle(gw, id, headers, body, Endpoint::Completions).await
}

async fn handle(
    gw: Arc<Gateway>,
    request_id: String,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
    endpoint: Endpoint,
) -> Response {
    if gw.bench_unmetered {
        return unmetered(&gw, &request_id, &headers, body, endpoint).await;
    }
    let tenant = match authorize(&gw, &headers, false).await {
        Ok(t) => t,
        Err(e) => return e.into_response(),
    };
    let mut rec = UsageRecord::started(
        &request_id,
        &tenant.tenant_id,
        Some(&tenant.key_id),
        endpoint.path(),
        now_ms(),
    );
    let mut rate = RateState::default();
    let mut spend = BudgetState::default();
    let outcome = match budget(&gw, &tenant).await {
        Ok(b) => {
            spend = b;
            run(&gw, &request_id, &headers, body, endpoint, &mut rec, tenant, &mut rate).await
        }
        Err(e) => Err(e),
    };
    let mut resp = match outcome {
        Ok(resp) => resp,
        Err(e) => {
            // Refused before reaching a worker: still one record per request.
            rec.error_code = e.code.map(str::to_string);
            write_usage(&gw, &mut rec).await;
            e.into_response()
        }
    };
    rate.apply(resp.headers_mut());
    spend.apply(resp.headers_mut());
    resp
}

/// The pipeline without authentication, budgets, limits and metering (benchmark baseline).
async fn unmetered(
    gw: &Arc<Gateway>,
    request_id: &str,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
    endpoint: Endpoint,
) -> Response {
    let tenant = TenantContext {
        tenant_id: "bench".into(),
        tenant_name: "bench".into(),
        key_id: "bench".into(),
        scopes: hearth_tenants::Scopes::ALL,
        models: None,
        tenant_limits: Default::default(),
        key_limits: Default::default(),
        budget: None,
    };
    let mut rec = UsageRecord::started(request_id, &tenant.tenant_id, None, endpoint.path(), 0);
    let mut rate = RateState::default();
    run(gw, request_id, headers, body, endpoint, &mut rec, tenant, &mut rate)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

// ---- phase: limit --------------------------------------------------------------------

/// An authenticated request that passed the request limits; holds its in-flight slots
/// until it ends.
pub struct Admitted {
    pub tenant: TenantContext,
    /// Released (dropped) when the request ends.
    _in_flight: InFlight,
}

/// Requests and tokens per minute and requests in flight, for the tenant and the key, in
/// one step (one Redis round trip when the limits are shared). Runs once the prompt is
/// tokenized, so the prompt's tokens are charged at admission.
async fn limit(
    gw: &Gateway,
    tenant: TenantContext,
    request_id: &str,
    prompt_tokens: u32,
    rate: &mut RateState,
) -> Result<Admitted, ApiError> {
    if gw.bench_unmetered {
        return Ok(Admitted {
            tenant,
            _in_flight: InFlight::default(),
        });
    }
    match gw.limiter.admit(&tenant, request_id, prompt_tokens).await {
        Ok((in_flight, state)) => {
            *rate = state;
            Ok(Admitted {
                tenant,
                _in_flight: in_flight,
            })
        }
        Err(l) => {
            *rate = l.state;
            Err(l.error)
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn run(
    gw: &Arc<Gateway>,
    request_id: &str,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
    endpoint: Endpoint,
    rec: &mut UsageRecord,
    tenant: TenantContext,
    rate: &mut RateState,
) -> Result<Response, ApiError> {
    let body = body.map_err(|e| ApiError::invalid("body", e.body_text()))?;
    // Tenant processors: instantiated for this request; pre-processors may rewrite the body.
    let mut chain = match &gw.processors {
        Some(h) if !gw.bench_unmetered => Chain::load(h, &gw.tenants, &tenant, endpoint.path()).await?,
        _ => None,
    };
    let body = match &mut chain {
        Some(c) => c.pre(headers, body).await?,
        None => body,
    };
    let (common, input_chat, input_prompt) = match endpoint {
        Endpoint::Chat => {
            let r = openai::parse_chat(&body)?;
            (r.common, Some(r.messages), None)
        }
        Endpoint::Completions => {
            let r = openai::parse_completion(&body)?;
            (r.common, None, Some(r.prompt))
        }
    };
    rec.model = common.model.clone();
    let model = resolve(gw, &common.model)?.clone();
    if !tenant.allows_model(&model.id) {
        return Err(ApiError::permission(
            "model_not_allowed",
            format!("This credential may not use model {}.", model.id),
        )
        .with_param("model"));
    }
    let input = match (&input_chat, &input_prompt) {
        (Some(m), _) => Input::Chat(m),
        (_, Some(p)) => Input::Prompt(p),
        _ => return Err(ApiError::internal("request without input")),
    };
    let (prompt, max_tokens) = tokenize(&model, input, &common)?;
    rec.prompt_tokens = prompt.len() as u32;
    // Tokens per minute: the prompt now, the completion when known.
    let admitted = limit(gw, tenant, request_id, prompt.len() as u32, rate).await?;
    let mut sampling = common.sampling.clone();
    sampling.max_tokens = max_tokens;
    let req = GenerateRequest {
        request_id: request_id.to_string(),
        model: model.id.clone(),
        prompt,
        sampling,
        cache_namespace: cache_namespace(&rec.tenant_id, common.prompt_cache_key.as_deref()),
        n: common.n,
    };
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
            .filter(|v| !v.is_empty())
    };
    // The leading text, as `prefix_aware` reads it; token-id prompts use their ids.
    let text = match (&input_chat, &input_prompt) {
        (Some(m), _) => m.iter().map(|m| m.content.as_str()).collect::<Vec<_>>().join("\n"),
        (_, Some(Prompt::Text(t))) => t.clone(),
        _ => req
            .prompt
            .iter()
            .take(512)
            .map(|t| t.to_string())
            .collect::<Vec<_>>()
            .join(" "),
    };
    let hints = RouteHints {
        session: header("x-session-affinity"),
        region: header("x-hearth-region"),
        prefix_key: prefix_key(&model, &text, &req.cache_namespace),
    };
    let (events, placement) = dispatch(&model, req, &hints).await?;

    let (tx, mut rx) = mpsc::channel(64);
    tokio::spawn(relay(gw.clone(), rec.clone(), events, placement, admitted, tx));
    // Wait for the first event, so that a refusal becomes an HTTP error, not a broken stream.
    let first = rx
        .recv()
        .await
        .ok_or_else(|| ApiError::internal("the relay ended early"))?;
    if let GenerateEvent::Error { code, message } = &first {
        // The relay has recorded this failure; the caller's second write is a no-op
        // (records are idempotent by request id).
        return Err(worker_error(code, message));
    }
    let shape = Shape {
        endpoint,
        id: request_id.trim_start_matches("req_").to_string(),
        model: model.clone(),
        created: now_ms() / 1000,
        n: common.n as usize,
    };
    let events = futures_util::stream::iter([first])
        .chain(ReceiverStream::new(rx))
        .boxed();
    if common.stream {
        let events = match chain {
            Some(c) => c.stream(events),
            None => events,
        };
        Ok(sse_response(shape, common.include_usage, events))
    } else {
        let mut body = collect_response(&shape, events).await?;
        if let Some(c) = &mut chain {
            body = c.post(&model.id, body).await?;
        }
        Ok(Json(body).into_response())
    }
}

// ---- response shapes -----------------------------------------------------------------

struct Shape {
    endpoint: Endpoint,
    id: String,
    model: Arc<ServedModel>,
    created: i64,
    n: usize,
}

impl Shape {
    fn id(&self) -> String {
        match self.endpoint {
            Endpoint::Chat => format!("chatcmpl-{}", self.id),
            Endpoint::Completions => format!("cmpl-{}", self.id),
        }
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.endpoint, chunk) {
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
            (Endpoint::Completions, _) => "text_completion",
        }
    }

    fn token_text(&self, id: u32) -> (String, Vec<u8>) {
        let bytes = self
            .model
            .tokenizer
            .token_bytes(id)
            .map(<[u8]>::to_vec)
            .unwrap_or_default();
        (String::from_utf8_lossy(&bytes).into_owned(), bytes)
    }

    /// OpenAI's chat logprob entry for one token.
    fn chat_logprob(&self, id: u32, logprob: f32, top: &[TokenLogprob]) -> Value {
        let (token, bytes) = self.token_text(id);
        let top: Vec<Value> = top
            .iter()
            .map(|t| {
                let (token, bytes) = self.token_text(t.id);
                json!({"token": token, "logprob": t.logprob, "bytes": bytes})
            })
            .collect();
        json!({"token": token, "logprob": logprob, "bytes": bytes, "top_logprobs": top})
    }

    fn chunk(&self, choices: Value, usage: Option<Value>, include_usage: bool) -> Value {
        let mut v = json!({
            "id": self.id(), "object": self.object(true), "created": self.created, "model": self.model.id,
            "system_fingerprint": fingerprint(), "choices": choices,
        });
        if include_usage {
            v["usage"] = usage.unwrap_or(Value::Null);
        }
        v
    }
}

fn fingerprint() -> String {
    format!("hearth-{}", env!("CARGO_PKG_VERSION"))
}

fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

/// The legacy completions `logprobs` object, built up token by token.
#[derive(Default)]
struct LegacyLogprobs {
    tokens: Vec<String>,
    token_logprobs: Vec<f32>,
    top_logprobs: Vec<serde_json::Map<String, Value>>,
    text_offset: Vec<usize>,
}

impl LegacyLogprobs {
    fn push(&mut self, shape: &Shape, id: u32, logprob: f32, top: &[TokenLogprob], offset: usize) {
        self.tokens.push(shape.token_text(id).0);
        self.token_logprobs.push(logprob);
        self.top_logprobs.push(
            top.iter()
                .map(|t| (shape.token_text(t.id).0, json!(t.logprob)))
                .collect(),
        );
        self.text_offset.push(offset);
    }

    fn json(&self) -> Value {
        json!({"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs, "text_offset": self.text_offset})
    }
}

/// Server-sent events exactly as OpenAI clients expect: `data: {chunk}` … `data: [DONE]`.
fn sse_response(
    shape: Shape,
    include_usage: bool,
    events: futures_util::stream::BoxStream<'static, GenerateEvent>,
) -> Response {
    let mut started = vec![false; shape.n];
    let mut offsets = vec![0usize; shape.n];
    let body = events
        .map(move |ev| {
            let mut out = Vec::new();
            match ev {
                GenerateEvent::Token { index, id, text, logprob, top_logprobs } => {
                    let i = index as usize;
                    let first = !started.get(i).copied().unwrap_or(true);
                    if first || !text.is_empty() || logprob.is_some() {
                        let choice = match shape.endpoint {
                            Endpoint::Chat => {
                                let mut delta = serde_json::Map::new();
                                if first {
                                    delta.insert("role".into(), json!("assistant"));
                                }
                                delta.insert("content".into(), json!(text));
                                let lp = logprob.map(|lp| json!({"content": [shape.chat_logprob(id, lp, &top_logprobs)]}));
                                json!({"index": index, "delta": delta, "logprobs": lp, "finish_reason": null})
                            }
                            Endpoint::Completions => {
                                let lp = logprob.map(|lp| {
                                    let mut l = LegacyLogprobs::default();
                                    l.push(&shape, id, lp, &top_logprobs, offsets.get(i).copied().unwrap_or(0));
                                    l.json()
                                });
                                json!({"index": index, "text": text, "logprobs": lp, "finish_reason": null})
                            }
                        };
                        out.push(sse(&shape.chunk(json!([choice]), None, include_usage)));
                        if let Some(s) = started.get_mut(i) {
                            *s = true;
                        }
                    }
                    if let Some(o) = offsets.get_mut(i) {
                        *o += text.len();
                    }
                }
                GenerateEvent::Finish { index, finish_reason } => {
                    let choice = match shape.endpoint {
                        Endpoint::Chat => json!({"index": index, "delta": {}, "logprobs": null, "finish_reason": finish_reason.as_str()}),
                        Endpoint::Completions => {
                            json!({"index": index, "text": "", "logprobs": null, "finish_reason": finish_reason.as_str()})
                        }
                    };
                    out.push(sse(&shape.chunk(json!([choice]), None, include_usage)));
                }
                GenerateEvent::Done { usage, .. } => {
                    if include_usage {
                        out.push(sse(&shape.chunk(json!([]), Some(openai::usage_json(&usage)), true)));
                    }
                    out.push(Bytes::from_static(b"data: [DONE]\n\n"));
                }
                GenerateEvent::Error { code, message } => {
                    out.push(sse(&worker_error(&code, &message).body()));
                    out.push(Bytes::from_static(b"data: [DONE]\n\n"));
                }
            }
            futures_util::stream::iter(out.into_iter().map(Ok::<_, Infallible>))
        })
        .flatten();
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .header("x-accel-buffering", "no")
        .body(Body::from_stream(body))
        .unwrap_or_else(|_| ApiError::internal("could not build the stream").into_response())
}

/// One choice of a non-streamed response, as it accumulates.
#[derive(Default)]
struct Collected {
    text: String,
    finish: Option<FinishReason>,
    chat_logprobs: Vec<Value>,
    legacy: LegacyLogprobs,
    any_logprobs: bool,
}

async fn collect_response(
    shape: &Shape,
    mut events: futures_util::stream::BoxStream<'static, GenerateEvent>,
) -> Result<Value, ApiError> {
    let mut choices: Vec<Collected> = (0..shape.n).map(|_| Collected::default()).collect();
    while let Some(ev) = events.next().await {
        match ev {
            GenerateEvent::Token {
                index,
                id,
                text,
                logprob,
                top_logprobs,
            } => {
                let Some(c) = choices.get_mut(index as usize) else {
                    continue;
                };
                if let Some(lp) = logprob {
                    c.any_logprobs = true;
                    match shape.endpoint {
                        Endpoint::Chat => c.chat_logprobs.push(shape.chat_logprob(id, lp, &top_logprobs)),
                        Endpoint::Completions => c.legacy.push(shape, id, lp, &top_logprobs, c.text.len()),
                    }
                }
                c.text.push_str(&text);
            }
            GenerateEvent::Finish { index, finish_reason } => {
                if let Some(c) = choices.get_mut(index as usize) {
                    c.finish = Some(finish_reason);
                }
            }
            GenerateEvent::Done { finish_reason, usage } => {
                return Ok(completion_body(shape, &choices, finish_reason, &usage));
            }
            GenerateEvent::Error { code, message } => return Err(worker_error(&code, &message)),
        }
    }
    Err(ApiError::unavailable("the worker ended the stream without finishing"))
}

fn completion_body(shape: &Shape, choices: &[Collected], default_finish: FinishReason, usage: &Usage) -> Value {
    let choices: Vec<Value> = choices
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let finish = c.finish.unwrap_or(default_finish).as_str();
            match shape.endpoint {
                Endpoint::Chat => {
                    let lp = c.any_logprobs.then(|| json!({"content": c.chat_logprobs}));
                    json!({
                        "index": i, "message": {"role": "assistant", "content": c.text, "refusal": null},
                        "logprobs": lp, "finish_reason": finish,
                    })
                }
                Endpoint::Completions => {
                    let lp = c.any_logprobs.then(|| c.legacy.json());
                    json!({"index": i, "text": c.text, "logprobs": lp, "finish_reason": finish})
                }
            }
        })
        .collect();
    json!({
        "id": shape.id(), "object": shape.object(false), "created": shape.created, "model": shape.model.id,
        "system_fingerprint": fingerprint(), "choices": choices, "usage": openai::usage_json(usage),
    })
}

// ---- models --------------------------------------------------------------------------

fn model_json(m: &ServedModel) -> Value {
    json!({"id": m.id, "object": "model", "created": m.created, "owned_by": "hearth", "context_length": m.context_length})
}

async fn list_models(State(gw): State<Arc<Gateway>>, headers: HeaderMap) -> Result<Json<Value>, ApiError> {
    let ctx = authorize(&gw, &headers, false).await?;
    let data: Vec<Value> = gw
        .models
        .all()
        .filter(|m| ctx.allows_model(&m.id))
        .map(|m| model_json(m))
        .collect();
    Ok(Json(json!({"object": "list", "data": data})))
}

async fn get_model(
    State(gw): State<Arc<Gateway>>,
    headers: HeaderMap,
    Path(model): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let ctx = authorize(&gw, &headers, false).await?;
    if !ctx.allows_model(&model) {
        return Err(ApiError::model_not_found(&model));
    }
    Ok(Json(model_json(resolve(&gw, &model)?)))
}

//! The worker's HTTP server. A worker may serve several models (`hearth worker --catalogue`):
//! `GET /v1/worker/models` lists them with their state, and `/v1/worker/m/{model}/…` has the
//! routes below for each; the unprefixed routes serve the first. Routes: `GET /healthz`, `GET /v1/worker/info`,
//! `POST /v1/worker/generate` (streams [`GenerateEvent`]s as newline-delimited JSON; closing
//! the connection cancels the generation) and `GET /v1/worker/events` (the prefix cache's
//! `KvEvent`s and load reports: a snapshot, then every change; a subscriber that falls
//! behind gets a fresh snapshot) and `GET /metrics` (the engine's Prometheus metrics, see
//! [`crate::worker::metrics`]). A catalogue worker also takes `POST /v1/worker/models` (a
//! [`ModelSpec`]: add a model at runtime), `DELETE /v1/worker/models/{id}` (remove one;
//! its requests in flight finish) and `POST /v1/worker/m/{id}/load` (load it now, in the
//! background: the gateway spreads a busy model to more workers). The worker API is for the
//! gateway on a private network. With the workers' token configured (`HEARTH_WORKER_TOKEN`),
//! every `/v1/worker/*` route needs `Authorization: Bearer <token>` (a generation names any
//! tenant's `cache_namespace`, so an open one would read any tenant's prefix cache); the
//! probes and `/metrics` stay open for the orchestrator and Prometheus. Without a token the
//! worker trusts its network, and catalogue changes and KV transfers are refused.
//!
//! Lifecycle ([`Lifecycle`]): `GET /livez` answers while the process runs; `GET /readyz`
//! (and `/healthz`) answer 503 once the worker drains (SIGTERM): it then refuses new
//! generations with `draining` (the gateway tries another worker), ends its KV event
//! streams, and counts the generations in flight until they finish.

use std::convert::Infallible;

use axum::body::{Body, Bytes};
use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use futures_util::future::BoxFuture;
use futures_util::StreamExt;
use hearth_protocol::{BlockHash, GenerateEvent, GenerateRequest, ModelSpec, TraceParent, TRACEPARENT};
use tokio_stream::wrappers::UnboundedReceiverStream;

use std::sync::Arc;

use crate::kv::transfer::{self, HttpKvTransport, KvTransport};
use crate::worker::backend::Backend;
use crate::worker::metrics::EngineCollector;
use crate::worker::telemetry;

/// Why a runtime catalogue change was refused.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ControlError {
    /// The model id is taken (add) or unknown (remove).
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    NotFound(String),
    /// A bad spec, or a source that cannot be read.
    #[error("{0}")]
    Invalid(String),
}

/// A catalogue worker's models, changed at runtime.
pub trait CatalogueControl: Send + Sync + 'static {
    /// The models served now, by id.
    fn models(&self) -> Vec<(String, Arc<dyn Backend>)>;
    /// One model's backend (without listing them all: every request looks one up).
    fn model(&self, id: &str) -> Option<Arc<dyn Backend>>;
    /// Adds a model; its backend serves the new `/v1/worker/m/{id}/…` routes.
    fn add(&self, spec: ModelSpec) -> BoxFuture<'_, Result<Arc<dyn Backend>, ControlError>>;
    /// Removes a model (requests in flight finish).
    fn remove(&self, id: &str) -> BoxFuture<'_, Result<(), ControlError>>;
}

/// What every handler of one worker shares.
#[derive(Clone)]
struct WorkerState {
    /// The models served, by id (a fixed worker); the first answers the unprefixed routes.
    engines: Arc<Vec<(String, Arc<dyn Backend>)>>,
    /// This worker's name in metrics and traces.
    name: Arc<str>,
    /// A catalogue worker's models (which then replace `engines`), changed at runtime.
    control: Option<Arc<dyn CatalogueControl>>,
    /// The bearer token runtime catalogue changes need (none: they are refused).
    token: Option<Arc<str>>,
    /// How this worker fetches KV blocks from another (`…/kv/pull`).
    transport: Arc<dyn KvTransport>,
    /// KV transfers (exports and pulls) running at once, at most [`MAX_TRANSFERS`].
    transfers: Arc<tokio::sync::Semaphore>,
    /// The role reported in `info` (None: the engine's, `both`).
    role: Option<Arc<str>>,
    lifecycle: Arc<Lifecycle>,
}

/// KV transfers one worker serves at once; more are answered 503 `transfer_busy`.
const MAX_TRANSFERS: usize = 4;

impl WorkerState {
    /// 200 while serving, 503 once draining, once an engine's device has failed, or while
    /// a pipeline's group is incomplete.
    fn readiness(&self) -> Response {
        let unready = self.list().into_iter().find_map(|(model, e)| {
            let s = e.stats()?;
            let status = match (s.device_failed, s.stage_lost) {
                (true, _) => "device_failed",
                (_, true) => "pipeline_incomplete",
                _ => return None,
            };
            Some((model, status))
        });
        if let Some((model, status)) = unready {
            return (
                StatusCode::SERVICE_UNAVAILABLE,
                Json(serde_json::json!({"status": status, "model": model, "in_flight": self.lifecycle.in_flight()})),
            )
                .into_response();
        }
        if self.lifecycle.is_draining() {
            return (
                StatusCode::SERVICE_UNAVAILABLE,
                Json(serde_json::json!({"status": "draining", "in_flight": self.lifecycle.in_flight()})),
            )
                .into_response();
        }
        Json(serde_json::json!({"status": "ok", "in_flight": self.lifecycle.in_flight()})).into_response()
    }

    /// A model's info as this worker reports it (with its role).
    fn info(&self, engine: &dyn Backend) -> hearth_protocol::WorkerInfo {
        let mut info = engine.info().clone();
        if let Some(r) = &self.role {
            info.role = r.to_string();
        }
        info
    }

    fn list(&self) -> Vec<(String, Arc<dyn Backend>)> {
        match &self.control {
            Some(c) => c.models(),
            None => self.engines.to_vec(),
        }
    }

    /// What a KV transfer route needs: the worker token, the model (`None`: the first) and
    /// a place among the transfers running now (else the 503 of a busy worker).
    fn transfer(
        &self,
        headers: &HeaderMap,
        model: Option<&str>,
    ) -> Result<(Arc<dyn Backend>, tokio::sync::OwnedSemaphorePermit), Box<Response>> {
        self.authorized(headers)?;
        let backend = self.backend(model)?;
        let permit = self.transfers.clone().try_acquire_owned().map_err(|_| {
            error_response(
                StatusCode::SERVICE_UNAVAILABLE,
                "transfer_busy",
                format!("this worker is already running {MAX_TRANSFERS} KV transfers"),
            )
        })?;
        Ok((backend, permit))
    }

    /// The model a route names (`None`: the unprefixed routes' first model).
    fn backend(&self, model: Option<&str>) -> Result<Arc<dyn Backend>, Box<Response>> {
        match model {
            Some(m) => self.model(m),
            None => self.first(),
        }
    }

    /// Whether a request carries the workers' token (a worker without one refuses what needs
    /// it: catalogue changes, KV transfers, disaggregated halves).
    fn authorized(&self, headers: &HeaderMap) -> Result<(), Box<Response>> {
        let Some(want) = &self.token else {
            return Err(error_response(
                StatusCode::FORBIDDEN,
                "catalogue_changes_disabled",
                "catalogue changes and KV transfers need the worker token: start the workers and the gateway with HEARTH_WORKER_TOKEN".into(),
            ));
        };
        let got = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or("");
        // Constant time in the token's length.
        let same = got.len() == want.len() && got.bytes().zip(want.bytes()).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0;
        if same {
            Ok(())
        } else {
            Err(error_response(
                StatusCode::UNAUTHORIZED,
                "invalid_worker_token",
                "this route needs Authorization: Bearer <worker token>".into(),
            ))
        }
    }

    /// The first model (for the unprefixed routes), or the 404 of an empty worker.
    fn first(&self) -> Result<Arc<dyn Backend>, Box<Response>> {
        match self.list().into_iter().next() {
            Some((_, e)) => Ok(e),
            None => Err(error_response(
                StatusCode::NOT_FOUND,
                "model_not_found",
                "this worker serves no model".into(),
            )),
        }
    }

    /// The model's backend, or the 404 a request for another model gets.
    fn model(&self, id: &str) -> Result<Arc<dyn Backend>, Box<Response>> {
        let found = match &self.control {
            Some(c) => c.model(id),
            None => self.engines.iter().find(|(m, _)| m == id).map(|(_, e)| e.clone()),
        };
        found.ok_or_else(|| {
            error_response(
                StatusCode::NOT_FOUND,
                "model_not_found",
                format!("this worker does not serve {id:?}"),
            )
        })
    }
}

/// The worker API for `engine`; `name` labels its metrics (`worker="…"`).
pub fn router(engine: Arc<dyn Backend>, name: &str) -> Router {
    router_many(
        vec![(engine.info().model.clone(), engine)],
        name,
        WorkerOptions::default(),
    )
}

fn error_response(status: StatusCode, code: &str, message: String) -> Box<Response> {
    let ev = GenerateEvent::Error {
        code: code.into(),
        message,
    };
    Box::new((status, Json(ev)).into_response())
}

/// A worker's lifecycle: serving, then draining (see the module's docs).
#[derive(Debug)]
pub struct Lifecycle {
    draining: tokio::sync::watch::Sender<bool>,
    in_flight: std::sync::atomic::AtomicUsize,
    idle: tokio::sync::Notify,
}

impl Default for Lifecycle {
    fn default() -> Self {
        Self {
            draining: tokio::sync::watch::Sender::new(false),
            in_flight: Default::default(),
            idle: Default::default(),
        }
    }
}

impl Lifecycle {
    /// Starts draining: not ready, new generations refused, event streams ended.
    pub fn drain(&self) {
        self.draining.send_replace(true);
    }

    pub fn is_draining(&self) -> bool {
        *self.draining.borrow()
    }

    /// Generations streaming now.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Returns when no generation is in flight.
    pub async fn idle(&self) {
        loop {
            let woken = self.idle.notified();
            if self.in_flight() == 0 {
                return;
            }
            woken.await;
        }
    }

    fn start(self: &Arc<Self>) -> InFlight {
        self.in_flight.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        InFlight(self.clone())
    }
}

/// One generation in flight; dropped with its response stream.
struct InFlight(Arc<Lifecycle>);

impl Drop for InFlight {
    fn drop(&mut self) {
        if self.0.in_flight.fetch_sub(1, std::sync::atomic::Ordering::SeqCst) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

/// How a worker presents itself.
#[derive(Debug, Clone, Default)]
pub struct WorkerOptions {
    /// The workers' shared token: KV transfers (`…/kv/export`, `…/kv/pull`, a decode request
    /// with a `kv_source`) and catalogue changes require it (none: they are refused).
    pub token: Option<String>,
    /// `both`, `prefill` or `decode`, reported in `info` for the gateway (None: `both`).
    pub role: Option<String>,
    /// Drained by the launcher on SIGTERM (None: a lifecycle of its own, never drained).
    pub lifecycle: Option<Arc<Lifecycle>>,
}

/// The worker API for several models (at least one).
pub fn router_many(engines: Vec<(String, Arc<dyn Backend>)>, name: &str, opts: WorkerOptions) -> Router {
    assert!(!engines.is_empty(), "a worker serves at least one model");
    router_with(engines, name, None, opts)
}

/// The worker API for a catalogue whose models change at runtime through `control`
/// (`POST`/`DELETE /v1/worker/models` need `Authorization: Bearer <token>`, like every
/// worker route when a token is configured; without one they are refused).
pub fn router_catalogue(name: &str, control: Arc<dyn CatalogueControl>, opts: WorkerOptions) -> Router {
    router_with(Vec::new(), name, Some(control), opts)
}

fn router_with(
    engines: Vec<(String, Arc<dyn Backend>)>,
    name: &str,
    control: Option<Arc<dyn CatalogueControl>>,
    opts: WorkerOptions,
) -> Router {
    let mut registry = prometheus_client::registry::Registry::default();
    let token = opts.token;
    let state = WorkerState {
        engines: Arc::new(engines),
        name: name.into(),
        control,
        token: token.clone().filter(|t| !t.is_empty()).map(Into::into),
        transport: Arc::new(HttpKvTransport::new(token)),
        transfers: Arc::new(tokio::sync::Semaphore::new(MAX_TRANSFERS)),
        role: opts.role.map(Into::into),
        lifecycle: opts.lifecycle.unwrap_or_default(),
    };
    // One model: labelled by the worker; a catalogue: `worker/model`.
    let per_model = state.engines.len() > 1 || state.control.is_some();
    let (listed, worker) = (state.clone(), name.to_string());
    registry.register_collector(Box::new(EngineCollector::dynamic(move || {
        listed
            .list()
            .into_iter()
            .map(|(m, e)| {
                let label = if per_model {
                    format!("{worker}/{m}")
                } else {
                    worker.clone()
                };
                (label, e)
            })
            .collect()
    })));
    let registry = Arc::new(registry);
    Router::new()
        .route("/livez", get(|| async { Json(serde_json::json!({"status": "ok"})) }))
        .route(
            "/healthz",
            get(|State(w): State<WorkerState>| async move { w.readiness() }),
        )
        .route(
            "/readyz",
            get(|State(w): State<WorkerState>| async move { w.readiness() }),
        )
        .route(
            "/metrics",
            get(move || {
                let registry = registry.clone();
                async move {
                    let mut out = String::new();
                    match prometheus_client::encoding::prometheus_text::encode(&mut out, &registry) {
                        Ok(()) => (
                            [(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
                            out,
                        )
                            .into_response(),
                        Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
                    }
                }
            }),
        )
        .route(
            "/v1/worker/info",
            get(|State(w): State<WorkerState>| async move {
                match w.first() {
                    Ok(e) => Json(w.info(&*e)).into_response(),
                    Err(r) => *r,
                }
            }),
        )
        .route(
            "/v1/worker/generate",
            post(|State(w): State<WorkerState>, headers: HeaderMap, body| async move {
                match w.first() {
                    Ok(e) => generate(e, &w, headers, body).await,
                    Err(r) => *r,
                }
            }),
        )
        .route(
            "/v1/worker/events",
            get(|State(w): State<WorkerState>| async move {
                match w.first() {
                    Ok(e) => events(e, &w).await,
                    Err(r) => *r,
                }
            }),
        )
        .route("/v1/worker/models", get(models).post(add_model))
        .route("/v1/worker/models/{model}", delete(remove_model))
        .route(
            "/v1/worker/m/{model}/info",
            get(|State(w): State<WorkerState>, Path(m): Path<String>| async move {
                match w.model(&m) {
                    Ok(e) => Json(w.info(&*e)).into_response(),
                    Err(r) => *r,
                }
            }),
        )
        .route(
            "/v1/worker/m/{model}/generate",
            post(
                |State(w): State<WorkerState>, Path(m): Path<String>, headers: HeaderMap, body| async move {
                    match w.model(&m) {
                        Ok(e) => generate(e, &w, headers, body).await,
                        Err(r) => *r,
                    }
                },
            ),
        )
        .route(
            "/v1/worker/kv/export",
            post(|State(w): State<WorkerState>, headers: HeaderMap, body| async move {
                match w.transfer(&headers, None) {
                    Ok((e, permit)) => kv_export(e, permit, body).await,
                    Err(r) => *r,
                }
            }),
        )
        .route(
            "/v1/worker/m/{model}/kv/export",
            post(
                |State(w): State<WorkerState>, Path(m): Path<String>, headers: HeaderMap, body| async move {
                    match w.transfer(&headers, Some(&m)) {
                        Ok((e, permit)) => kv_export(e, permit, body).await,
                        Err(r) => *r,
                    }
                },
            ),
        )
        .route(
            "/v1/worker/kv/release",
            post(|State(w): State<WorkerState>, headers: HeaderMap, body| async move {
                kv_release(&w, &headers, None, body)
            }),
        )
        .route(
            "/v1/worker/m/{model}/kv/release",
            post(
                |State(w): State<WorkerState>, Path(m): Path<String>, headers: HeaderMap, body| async move {
                    kv_release(&w, &headers, Some(&m), body)
                },
            ),
        )
        .route(
            "/v1/worker/kv/pull",
            post(|State(w): State<WorkerState>, headers: HeaderMap, body| async move {
                match w.transfer(&headers, None) {
                    Ok((e, _permit)) => kv_pull(e, &*w.transport, body).await,
                    Err(r) => *r,
                }
            }),
        )
        .route(
            "/v1/worker/m/{model}/kv/pull",
            post(
                |State(w): State<WorkerState>, Path(m): Path<String>, headers: HeaderMap, body| async move {
                    match w.transfer(&headers, Some(&m)) {
                        Ok((e, _permit)) => kv_pull(e, &*w.transport, body).await,
                        Err(r) => *r,
                    }
                },
            ),
        )
        .route(
            "/v1/worker/m/{model}/load",
            post(|State(w): State<WorkerState>, Path(m): Path<String>| async move {
                match w.model(&m) {
                    Ok(e) => {
                        let started = e.preload();
                        Json(serde_json::json!({"model": m, "loading": started, "state": e.model_state()}))
                            .into_response()
                    }
                    Err(r) => *r,
                }
            }),
        )
        .route(
            "/v1/worker/m/{model}/events",
            get(|State(w): State<WorkerState>, Path(m): Path<String>| async move {
                match w.model(&m) {
                    Ok(e) => events(e, &w).await,
                    Err(r) => *r,
                }
            }),
        )
        .layer(axum::middleware::from_fn_with_state(state.clone(), require_token))
        .with_state(state)
}

/// With a worker token configured, every `/v1/worker/*` route needs it.
async fn require_token(
    State(w): State<WorkerState>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if w.token.is_some() && req.uri().path().starts_with("/v1/worker/") {
        if let Err(r) = w.authorized(req.headers()) {
            return *r;
        }
    }
    next.run(req).await
}

fn control_error(e: ControlError) -> Response {
    let (status, code) = match &e {
        ControlError::Conflict(_) => (StatusCode::CONFLICT, "model_exists"),
        ControlError::NotFound(_) => (StatusCode::NOT_FOUND, "model_not_found"),
        ControlError::Invalid(_) => (StatusCode::BAD_REQUEST, "invalid_model"),
    };
    *error_response(status, code, e.to_string())
}

/// `POST /v1/worker/models`: adds a model; answers its `{"info", "state"}`.
async fn add_model(
    State(w): State<WorkerState>,
    headers: HeaderMap,
    body: Result<Json<ModelSpec>, JsonRejection>,
) -> Response {
    let Some(control) = w.control.clone() else {
        return *error_response(
            StatusCode::METHOD_NOT_ALLOWED,
            "not_a_catalogue",
            "this worker serves a fixed model; start it with --catalogue to add models".into(),
        );
    };
    if let Err(r) = w.authorized(&headers) {
        return *r;
    }
    let spec = match body {
        Ok(Json(s)) => s,
        Err(e) => return *error_response(StatusCode::BAD_REQUEST, "invalid_request", e.body_text()),
    };
    if let Err(e) = spec.validate() {
        return *error_response(StatusCode::BAD_REQUEST, "invalid_model", e);
    }
    match control.add(spec).await {
        Ok(backend) => {
            let body = serde_json::json!({"info": backend.info(), "state": backend.model_state()});
            (StatusCode::CREATED, Json(body)).into_response()
        }
        Err(e) => control_error(e),
    }
}

/// `DELETE /v1/worker/models/{id}`.
async fn remove_model(State(w): State<WorkerState>, headers: HeaderMap, Path(id): Path<String>) -> Response {
    let Some(control) = w.control.clone() else {
        return *error_response(
            StatusCode::METHOD_NOT_ALLOWED,
            "not_a_catalogue",
            "this worker serves a fixed model".into(),
        );
    };
    if let Err(r) = w.authorized(&headers) {
        return *r;
    }
    match control.remove(&id).await {
        Ok(()) => Json(serde_json::json!({"id": id, "deleted": true})).into_response(),
        Err(e) => control_error(e),
    }
}

#[derive(serde::Deserialize)]
struct ExportBody {
    hashes: Vec<u64>,
    /// A prefill-only request's id: its hold on the blocks ends with this stream.
    #[serde(default)]
    release: Option<String>,
}

/// `POST …/kv/export` `{"hashes": [u64]}`: the blocks as a framed stream
/// ([`crate::kv::transfer`]), read from the engine a batch at a time, the next while one
/// is sent (two batches at most: bounded memory; the connection's back-pressure paces the
/// reads).
async fn kv_export(
    backend: Arc<dyn Backend>,
    permit: tokio::sync::OwnedSemaphorePermit,
    body: Result<Json<ExportBody>, JsonRejection>,
) -> Response {
    let Json(body) = match body {
        Ok(b) => b,
        Err(e) => return *error_response(StatusCode::BAD_REQUEST, "invalid_request", e.body_text()),
    };
    let Some(engine) = backend.engine() else {
        return *error_response(
            StatusCode::SERVICE_UNAVAILABLE,
            "model_not_loaded",
            "the model is not loaded here: no KV blocks to export".into(),
        );
    };
    // The hold ends with this stream, or now if the request is refused.
    let hold = transfer::HoldRelease::new(&engine, body.release.clone());
    // A prompt's blocks: at most the longest context's, each once.
    let max = engine.info().context_length as usize / engine.kv_layout().block_tokens.max(1) as usize + 1;
    let mut seen = std::collections::HashSet::new();
    if body.hashes.len() > max || !body.hashes.iter().all(|h| seen.insert(*h)) {
        return *error_response(
            StatusCode::BAD_REQUEST,
            "invalid_request",
            format!("hashes must be distinct and at most {max}"),
        );
    }
    let hashes: Vec<BlockHash> = body.hashes.into_iter().map(BlockHash).collect();
    let header = transfer::encode_header(engine.kv_layout(), hashes.len());
    let batches: Vec<Vec<BlockHash>> = hashes
        .chunks(transfer::TRANSFER_BATCH)
        .map(<[BlockHash]>::to_vec)
        .collect();
    let blocks = futures_util::stream::iter(batches)
        .map(move |batch| {
            let engine = engine.clone();
            async move {
                // A stopped engine ends the stream with an error (the receiver sees it cut).
                let blocks = engine
                    .export_blocks(batch.clone())
                    .await
                    .map_err(std::io::Error::other)?;
                // Each block goes out as its frame head and its own buffer, not copied again.
                let parts: Vec<Result<Bytes, std::io::Error>> = batch
                    .iter()
                    .enumerate()
                    .flat_map(|(i, h)| transfer::block_frame(*h, blocks.get(i).and_then(Option::as_ref)))
                    .map(Ok)
                    .collect();
                Ok::<_, std::io::Error>(futures_util::stream::iter(parts))
            }
        })
        // The next batch is copied out of the pool while this one is being sent.
        .buffered(2)
        .map(|batch| match batch {
            Ok(parts) => parts.left_stream(),
            Err(e) => futures_util::stream::once(async move { Err(e) }).right_stream(),
        })
        .flatten();
    let stream = futures_util::stream::once(async move { Ok::<_, std::io::Error>(Bytes::from(header)) })
        .chain(blocks)
        // The transfer's place (and the prefill's hold on the blocks) is kept until the
        // stream ends or the peer goes away.
        .inspect(move |_| {
            let _held = (&permit, &hold);
        });
    (
        [(header::CONTENT_TYPE, "application/octet-stream")],
        Body::from_stream(stream),
    )
        .into_response()
}

#[derive(serde::Deserialize)]
struct ReleaseBody {
    hold: String,
}

/// `POST …/kv/release` `{"hold"}`: ends a prefill-only request's hold on its KV blocks
/// without exporting them (the decode side gave up on them). Needs the worker token, not
/// a transfer place; an unknown hold is not an error.
fn kv_release(
    w: &WorkerState,
    headers: &HeaderMap,
    model: Option<&str>,
    body: Result<Json<ReleaseBody>, JsonRejection>,
) -> Response {
    if let Err(r) = w.authorized(headers) {
        return *r;
    }
    let backend = match w.backend(model) {
        Ok(b) => b,
        Err(r) => return *r,
    };
    let Json(body) = match body {
        Ok(b) => b,
        Err(e) => return *error_response(StatusCode::BAD_REQUEST, "invalid_request", e.body_text()),
    };
    if let Some(e) = backend.engine() {
        e.release_hold(&body.hold);
    }
    StatusCode::NO_CONTENT.into_response()
}

#[derive(serde::Deserialize)]
struct PullBody {
    /// The worker holding the blocks (its base URL).
    source: String,
    prompt: Vec<u32>,
    #[serde(default)]
    cache_namespace: String,
}

/// `POST …/kv/pull` `{"source", "prompt", "cache_namespace"}`: fetches the prompt's blocks
/// this engine lacks from `source` and imports them; answers the [`transfer::PullReport`]
/// (502 with it when the transfer failed midway: what arrived is kept).
async fn kv_pull(
    backend: Arc<dyn Backend>,
    transport: &dyn KvTransport,
    body: Result<Json<PullBody>, JsonRejection>,
) -> Response {
    let Json(body) = match body {
        Ok(b) => b,
        Err(e) => return *error_response(StatusCode::BAD_REQUEST, "invalid_request", e.body_text()),
    };
    let Some(engine) = backend.engine() else {
        return *error_response(
            StatusCode::SERVICE_UNAVAILABLE,
            "model_not_loaded",
            "the model is not loaded here".into(),
        );
    };
    let report = transfer::pull(
        &engine,
        transport,
        &body.source,
        &body.prompt,
        &body.cache_namespace,
        None,
    )
    .await;
    let status = if report.error.is_some() {
        StatusCode::BAD_GATEWAY
    } else {
        StatusCode::OK
    };
    (status, Json(report)).into_response()
}

/// The models served: `{"models": [{"info": WorkerInfo, "state": "warm"|"loading"|"cold"|null}],
/// "catalogue": bool}` (`catalogue`: models may be added and removed at runtime).
async fn models(State(w): State<WorkerState>) -> Response {
    let models: Vec<serde_json::Value> = w
        .list()
        .iter()
        .map(|(_, e)| serde_json::json!({"info": w.info(&**e), "state": e.model_state()}))
        .collect();
    Json(serde_json::json!({ "models": models, "catalogue": w.control.is_some() })).into_response()
}

/// `POST …/generate`. A request with a `kv_source` (a disaggregated decode half, or a peer
/// fetch) needs the worker token, since it makes this worker fetch from another; its
/// blocks are fetched first (a busy worker, or a model not loaded yet, computes them
/// instead).
async fn generate(
    engine: Arc<dyn Backend>,
    w: &WorkerState,
    headers: HeaderMap,
    body: Result<Json<GenerateRequest>, JsonRejection>,
) -> Response {
    let name = &*w.name;
    // Counted before the check: a drain that starts now either sees this request or
    // refuses it, never neither.
    let in_flight = w.lifecycle.start();
    if w.lifecycle.is_draining() {
        return *error_response(
            StatusCode::SERVICE_UNAVAILABLE,
            "draining",
            "this worker is shutting down; it takes no new requests".into(),
        );
    }
    let Json(req) = match body {
        Ok(b) => b,
        Err(e) => return *error_response(StatusCode::BAD_REQUEST, "invalid_request", e.body_text()),
    };
    // The gateway's trace continues here when it sent `traceparent`.
    let parent = headers
        .get(TRACEPARENT)
        .and_then(|v| v.to_str().ok())
        .and_then(TraceParent::parse)
        .map(|tp| telemetry::parent_from(&tp));
    // Disaggregated halves hold or fetch KV blocks: the workers' token only.
    if req.kv_source.is_some() || req.prefill_only {
        if let Err(r) = w.authorized(&headers) {
            return *r;
        }
    }
    if let Some(src) = &req.kv_source {
        match (engine.engine(), w.transfers.clone().try_acquire_owned()) {
            (Some(e), Ok(_permit)) => {
                let cx = parent.clone().unwrap_or_default();
                transfer::prepare(&e, &*w.transport, &req, name, &cx).await;
            }
            _ => {
                tracing::warn!(request_id = %req.request_id, "KV transfer skipped (busy or not loaded): the prompt is computed here");
                if !src.hold.is_empty() {
                    tokio::spawn(w.transport.release(&src.worker, &req.model, src.hold.clone()));
                }
            }
        }
    }
    let (model, request_id) = (req.model.clone(), req.request_id.clone());
    let events = UnboundedReceiverStream::new(engine.generate(req)).boxed();
    let events = match parent {
        Some(cx) => telemetry::traced(events, cx, name.to_string(), model, request_id).boxed(),
        None => events,
    };
    let events = events.map(move |ev| {
        let _in_flight = &in_flight; // counted until the response stream is dropped
        let mut line = serde_json::to_vec(&ev).unwrap_or_else(|_| b"{}".to_vec());
        line.push(b'\n');
        Ok::<_, Infallible>(Bytes::from(line))
    });
    (
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        Body::from_stream(events),
    )
        .into_response()
}

fn ndjson<T: serde::Serialize>(v: &T) -> Bytes {
    let mut line = serde_json::to_vec(v).unwrap_or_else(|_| b"{}".to_vec());
    line.push(b'\n');
    Bytes::from(line)
}

async fn events(engine: Arc<dyn Backend>, w: &WorkerState) -> Response {
    let Some((snap, rx)) = engine.subscribe_kv().await else {
        return (StatusCode::SERVICE_UNAVAILABLE, "the engine is not running").into_response();
    };
    let stream = futures_util::stream::unfold((engine, Some((Some(snap), rx))), |(engine, mut sub)| async move {
        loop {
            let (snapshot, mut rx) = sub.take()?;
            if let Some(snap) = snapshot {
                return Some((Ok::<_, Infallible>(ndjson(&snap)), (engine, Some((None, rx)))));
            }
            match rx.recv().await {
                Ok(ev) => return Some((Ok(ndjson(&ev)), (engine, Some((None, rx))))),
                Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {
                    // Fell behind: start over from a fresh snapshot, so the consumer stays exact.
                    let (snap, rx) = engine.subscribe_kv().await?;
                    sub = Some((Some(snap), rx));
                }
                Err(tokio::sync::broadcast::error::RecvError::Closed) => return None,
            }
        }
    });
    (
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        // A draining worker ends its streams (gateways stop following it).
        Body::from_stream(stream.take_until(until_draining(&w.lifecycle))),
    )
        .into_response()
}

fn until_draining(l: &Lifecycle) -> impl std::future::Future<Output = ()> + Send + 'static {
    let mut rx = l.draining.subscribe();
    async move {
        let _ = rx.wait_for(|d| *d).await;
    }
}

/// Serves the worker API until the process ends.
pub async fn serve(listener: tokio::net::TcpListener, engine: Arc<dyn Backend>) -> std::io::Result<()> {
    let name = listener.local_addr()?.to_string();
    axum::serve(listener, router(engine, &name)).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use hearth_protocol::WorkerInfo;

    /// An engine whose device has failed: only `stats` matters to readiness.
    struct FailedDevice(WorkerInfo);

    impl Backend for FailedDevice {
        fn info(&self) -> &WorkerInfo {
            &self.0
        }
        fn generate(&self, _: GenerateRequest) -> tokio::sync::mpsc::UnboundedReceiver<hearth_protocol::GenerateEvent> {
            tokio::sync::mpsc::unbounded_channel().1
        }
        fn subscribe_kv(
            &self,
        ) -> std::pin::Pin<Box<dyn std::future::Future<Output = crate::worker::backend::KvSubscription> + Send + '_>>
        {
            Box::pin(async { None })
        }
        fn stats(&self) -> Option<crate::engine::command::EngineStats> {
            Some(crate::engine::command::EngineStats {
                device_failed: true,
                ..Default::default()
            })
        }
    }

    #[test]
    fn a_failed_device_makes_the_worker_not_ready() {
        let info = crate::worker::sim::handle_tests::info();
        let state = |engines: Vec<(String, Arc<dyn Backend>)>| WorkerState {
            engines: Arc::new(engines),
            name: "w".into(),
            control: None,
            token: None,
            transport: Arc::new(HttpKvTransport::new(None)),
            transfers: Arc::new(tokio::sync::Semaphore::new(1)),
            role: None,
            lifecycle: Arc::default(),
        };
        let failed = state(vec![("m".into(), Arc::new(FailedDevice(info)))]);
        assert_eq!(failed.readiness().status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(state(vec![]).readiness().status(), StatusCode::OK);
    }
}

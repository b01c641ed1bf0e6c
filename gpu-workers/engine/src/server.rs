//! The worker's HTTP server. A worker may serve several models (`hearth worker --catalogue`):
//! `GET /v1/worker/models` lists them with their state, and `/v1/worker/m/{model}/…` has the
//! routes below for each; the unprefixed routes serve the first. Routes: `GET /healthz`, `GET /v1/worker/info`,
//! `POST /v1/worker/generate` (streams [`GenerateEvent`]s as newline-delimited JSON; closing
//! the connection cancels the generation) and `GET /v1/worker/events` (the prefix cache's
//! `KvEvent`s and load reports: a snapshot, then every change; a subscriber that falls
//! behind gets a fresh snapshot) and `GET /metrics` (the engine's Prometheus metrics, see
//! [`crate::metrics`]). The worker API is for the gateway on a private network: it has no
//! authentication of its own.

use std::convert::Infallible;

use axum::body::{Body, Bytes};
use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::StreamExt;
use hearth_protocol::{GenerateEvent, GenerateRequest, TraceParent, TRACEPARENT};
use tokio_stream::wrappers::UnboundedReceiverStream;

use std::sync::Arc;

use crate::metrics::EngineCollector;
use crate::telemetry;
use crate::Backend;

/// What every handler of one worker shares.
#[derive(Clone)]
struct WorkerState {
    /// The models served, by id; the first answers the unprefixed routes.
    engines: Arc<Vec<(String, Arc<dyn Backend>)>>,
    /// This worker's name in metrics and traces.
    name: Arc<str>,
}

impl WorkerState {
    fn first(&self) -> Arc<dyn Backend> {
        self.engines[0].1.clone()
    }

    /// The model's backend, or the 404 a request for another model gets.
    fn model(&self, id: &str) -> Result<Arc<dyn Backend>, Box<Response>> {
        self.engines
            .iter()
            .find(|(m, _)| m == id)
            .map(|(_, e)| e.clone())
            .ok_or_else(|| {
                let ev = GenerateEvent::Error {
                    code: "model_not_found".into(),
                    message: format!("this worker does not serve {id:?}"),
                };
                Box::new((StatusCode::NOT_FOUND, Json(ev)).into_response())
            })
    }
}

/// The worker API for `engine`; `name` labels its metrics (`worker="…"`).
pub fn router(engine: Arc<dyn Backend>, name: &str) -> Router {
    router_many(vec![(engine.info().model.clone(), engine)], name)
}

/// The worker API for several models (at least one).
pub fn router_many(engines: Vec<(String, Arc<dyn Backend>)>, name: &str) -> Router {
    assert!(!engines.is_empty(), "a worker serves at least one model");
    let mut registry = prometheus_client::registry::Registry::default();
    let labelled = engines
        .iter()
        .map(|(m, e)| {
            let label = if engines.len() == 1 {
                name.to_string()
            } else {
                format!("{name}/{m}")
            };
            (label, e.clone())
        })
        .collect();
    registry.register_collector(Box::new(EngineCollector::new(labelled)));
    let registry = Arc::new(registry);
    Router::new()
        .route("/healthz", get(|| async { Json(serde_json::json!({"status": "ok"})) }))
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
            get(|State(w): State<WorkerState>| async move { info(w.first()) }),
        )
        .route(
            "/v1/worker/generate",
            post(|State(w): State<WorkerState>, headers: HeaderMap, body| async move {
                generate(w.first(), &w.name, headers, body)
            }),
        )
        .route(
            "/v1/worker/events",
            get(|State(w): State<WorkerState>| events(w.first())),
        )
        .route("/v1/worker/models", get(models))
        .route(
            "/v1/worker/m/{model}/info",
            get(|State(w): State<WorkerState>, Path(m): Path<String>| async move {
                match w.model(&m) {
                    Ok(e) => info(e),
                    Err(r) => *r,
                }
            }),
        )
        .route(
            "/v1/worker/m/{model}/generate",
            post(
                |State(w): State<WorkerState>, Path(m): Path<String>, headers: HeaderMap, body| async move {
                    match w.model(&m) {
                        Ok(e) => generate(e, &w.name, headers, body),
                        Err(r) => *r,
                    }
                },
            ),
        )
        .route(
            "/v1/worker/m/{model}/events",
            get(|State(w): State<WorkerState>, Path(m): Path<String>| async move {
                match w.model(&m) {
                    Ok(e) => events(e).await,
                    Err(r) => *r,
                }
            }),
        )
        .with_state(WorkerState {
            engines: Arc::new(engines),
            name: name.into(),
        })
}

fn info(engine: Arc<dyn Backend>) -> Response {
    Json(engine.info().clone()).into_response()
}

/// The models served: `{"models": [{"info": WorkerInfo, "state": "warm"|"loading"|"cold"|null}]}`.
async fn models(State(w): State<WorkerState>) -> Response {
    let models: Vec<serde_json::Value> = w
        .engines
        .iter()
        .map(|(_, e)| serde_json::json!({"info": e.info(), "state": e.model_state()}))
        .collect();
    Json(serde_json::json!({ "models": models })).into_response()
}

fn generate(
    engine: Arc<dyn Backend>,
    name: &str,
    headers: HeaderMap,
    body: Result<Json<GenerateRequest>, JsonRejection>,
) -> Response {
    let Json(req) = match body {
        Ok(b) => b,
        Err(e) => {
            let ev = GenerateEvent::Error {
                code: "invalid_request".into(),
                message: e.body_text(),
            };
            return (StatusCode::BAD_REQUEST, Json(ev)).into_response();
        }
    };
    // The gateway's trace continues here when it sent `traceparent`.
    let parent = headers
        .get(TRACEPARENT)
        .and_then(|v| v.to_str().ok())
        .and_then(TraceParent::parse)
        .map(|tp| telemetry::parent_from(&tp));
    let (model, request_id) = (req.model.clone(), req.request_id.clone());
    let events = UnboundedReceiverStream::new(engine.generate(req)).boxed();
    let events = match parent {
        Some(cx) => telemetry::traced(events, cx, name.to_string(), model, request_id).boxed(),
        None => events,
    };
    let events = events.map(|ev| {
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

async fn events(engine: Arc<dyn Backend>) -> Response {
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
        Body::from_stream(stream),
    )
        .into_response()
}

/// Serves the worker API until the process ends.
pub async fn serve(listener: tokio::net::TcpListener, engine: Arc<dyn Backend>) -> std::io::Result<()> {
    let name = listener.local_addr()?.to_string();
    axum::serve(listener, router(engine, &name)).await
}

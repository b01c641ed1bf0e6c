//! The worker's HTTP server: `GET /healthz`, `GET /v1/worker/info`,
//! `POST /v1/worker/generate` (streams [`GenerateEvent`]s as newline-delimited JSON; closing
//! the connection cancels the generation) and `GET /v1/worker/events` (the prefix cache's
//! `KvEvent`s and load reports: a snapshot, then every change; a subscriber that falls
//! behind gets a fresh snapshot) and `GET /metrics` (the engine's Prometheus metrics, see
//! [`crate::metrics`]). The worker API is for the gateway on a private network: it has no
//! authentication of its own.

use std::convert::Infallible;

use axum::body::{Body, Bytes};
use axum::extract::rejection::JsonRejection;
use axum::extract::State;
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
    engine: Arc<dyn Backend>,
    /// This worker's name in metrics and traces.
    name: Arc<str>,
}

/// The worker API for `engine`; `name` labels its metrics (`worker="…"`).
pub fn router(engine: Arc<dyn Backend>, name: &str) -> Router {
    let mut registry = prometheus_client::registry::Registry::default();
    registry.register_collector(Box::new(EngineCollector::new(vec![(name.to_string(), engine.clone())])));
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
        .route("/v1/worker/info", get(info))
        .route("/v1/worker/generate", post(generate))
        .route("/v1/worker/events", get(events))
        .with_state(WorkerState {
            engine,
            name: name.into(),
        })
}

async fn info(State(WorkerState { engine, .. }): State<WorkerState>) -> impl IntoResponse {
    Json(engine.info().clone())
}

async fn generate(
    State(WorkerState { engine, name }): State<WorkerState>,
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

async fn events(State(WorkerState { engine, .. }): State<WorkerState>) -> Response {
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

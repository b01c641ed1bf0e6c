//! The app's route table: the public OpenAI API, the tenant self-service API, and the
//! operator routes (admin API, `/metrics`), which all sit behind one admin-token layer —
//! a route added there is protected by construction.

use std::sync::Arc;

use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderValue};
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::{get, post};
use axum::{Json, Router};
use hearth_tenants::now_ms;
use serde_json::{json, Value};

use crate::auth::{require_admin, Caller};
use crate::error::ApiError;
use crate::pipeline;
use crate::registry::ServedModel;
use crate::state::AppState;
use crate::RequestId;

pub fn router(state: Arc<AppState>) -> Router {
    let operator = Router::new()
        .nest("/admin/v1", crate::admin::router())
        .route("/metrics", get(crate::metrics::render))
        .route_layer(middleware::from_fn_with_state(state.clone(), require_admin));
    Router::new()
        .route("/v1/chat/completions", post(pipeline::chat_completions))
        .route("/v1/completions", post(pipeline::completions))
        .route("/v1/responses", post(pipeline::responses))
        .route(
            "/v1/responses/{id}",
            get(crate::responses::retrieve).delete(crate::responses::delete),
        )
        .route("/v1/responses/{id}/input_items", get(crate::responses::input_items))
        .route("/v1/messages", post(pipeline::messages))
        .route("/v1/messages/count_tokens", post(pipeline::count_tokens_handler))
        .route(
            "/v1/files",
            get(crate::batches::list_files).post(crate::batches::upload_file).layer(
                axum::extract::DefaultBodyLimit::max(hearth_tenants::batches::MAX_FILE_BYTES + (1 << 20)),
            ),
        )
        .route(
            "/v1/files/{id}",
            get(crate::batches::get_file).delete(crate::batches::delete_file),
        )
        .route("/v1/files/{id}/content", get(crate::batches::file_content))
        .route(
            "/v1/batches",
            get(crate::batches::list_batches).post(crate::batches::create_batch),
        )
        .route("/v1/batches/{id}", get(crate::batches::get_batch))
        .route("/v1/batches/{id}/cancel", post(crate::batches::cancel_batch))
        .route("/v1/models", get(list_models))
        .route("/v1/models/{model}", get(get_model))
        .route("/healthz", get(healthz))
        .route("/livez", get(livez))
        .route("/readyz", get(readyz))
        .route("/openapi.json", get(openapi_public))
        .nest("/v1/tenant", crate::selfservice::router())
        .nest("/dashboard", crate::dashboard::router())
        .route("/", get(|| async { axum::response::Redirect::to("/dashboard") }))
        .merge(operator)
        .fallback(|| async {
            ApiError::not_found(
                "no such endpoint; see /v1/chat/completions, /v1/completions, /v1/responses, /v1/messages, /v1/models",
            )
        })
        .with_state(state.clone())
        // The body guard enforces the size limits (the routes' own only raise them).
        .layer(axum::extract::DefaultBodyLimit::disable())
        .layer(middleware::from_fn(move |req, next| {
            crate::http::body_guard(state.body_limits.clone(), req, next)
        }))
        .layer(middleware::from_fn(json_errors))
        .layer(middleware::from_fn(security_headers))
        .layer(middleware::from_fn(request_id))
}

/// Errors answered before a handler runs — a path parameter that does not parse, a method
/// the route lacks (405, its `allow` header kept) — come from the framework as plain text or
/// an empty body; they are given the API's own error shape like every handler's (Anthropic's
/// on `/v1/messages`). The dashboard's HTML pages are left alone.
async fn json_errors(req: Request, next: Next) -> Response {
    use axum::response::IntoResponse;
    let path = req.uri().path();
    let (dashboard, anthropic) = (path.starts_with("/dashboard"), path.starts_with("/v1/messages"));
    let resp = next.run(req).await;
    let status = resp.status();
    let json = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.starts_with("application/json"));
    if dashboard || json || !(status.is_client_error() || status.is_server_error()) {
        return resp;
    }
    let (parts, body) = resp.into_parts();
    // The framework's messages are one line; a longer body is replaced by the status's reason.
    let text = axum::body::to_bytes(body, 4096).await.unwrap_or_default();
    let text = String::from_utf8_lossy(&text).trim().to_string();
    let message = if text.is_empty() {
        status.canonical_reason().unwrap_or("error").to_string()
    } else {
        text
    };
    let err = ApiError::framework(status, message);
    let mut out = if anthropic {
        crate::anthropic::error_response(&err)
    } else {
        err.into_response()
    };
    for (k, v) in &parts.headers {
        if k != header::CONTENT_TYPE && k != header::CONTENT_LENGTH {
            out.headers_mut().append(k.clone(), v.clone());
        }
    }
    out
}

/// Headers every response carries: no MIME sniffing, no referrer leaking a URL elsewhere,
/// and no caching of anything the management APIs return (new keys' secrets, usage, keys,
/// processors) by a browser or proxy.
async fn security_headers(req: Request, next: Next) -> Response {
    let private = {
        let p = req.uri().path();
        p.starts_with("/admin/") || p.starts_with("/v1/tenant") || p.starts_with("/dashboard") || p == "/metrics"
    };
    let mut resp = next.run(req).await;
    let h = resp.headers_mut();
    h.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    // The dashboard sets its own (`same-origin`).
    if !h.contains_key(header::REFERRER_POLICY) {
        h.insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    }
    if private {
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    }
    resp
}

pub(crate) fn random_id() -> String {
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

/// The outermost layer: a request id for every request, echoed in `x-request-id`.
pub async fn request_id(mut req: Request, next: Next) -> Response {
    let id = format!("req_{}", random_id());
    req.extensions_mut().insert(RequestId(id.clone()));
    let mut resp = next.run(req).await;
    if let Ok(v) = HeaderValue::from_str(&id) {
        resp.headers_mut().insert("x-request-id", v);
    }
    resp
}

/// The public OpenAPI document (the model APIs, probes and self-service), no auth.
#[utoipa::path(get, path = "/openapi.json", tag = "probes",
    responses((status = 200, description = "This document (OpenAPI 3.1).", body = crate::openapi::AnyObject)))]
pub(crate) async fn openapi_public() -> Response {
    crate::openapi::serve(crate::openapi::public_json())
}

/// Liveness: the process answers.
#[utoipa::path(get, path = "/livez", tag = "probes",
    responses((status = 200, description = "`{\"status\": \"ok\"}`.", body = crate::openapi::Status)))]
pub(crate) async fn livez() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

/// Readiness: not shutting down, and the database answers. (Liveness, `/livez`, is the
/// process answering at all.)
#[utoipa::path(get, path = "/readyz", summary = "Readiness: not draining, and the database answers.", tag = "probes",
    responses(
        (status = 200, description = "Ready, with the number of models and workers.", body = crate::openapi::Status),
        (status = 503, description = "Draining, or the database does not answer.", body = crate::openapi::Status),
    ))]
pub(crate) async fn readyz(State(state): State<Arc<AppState>>) -> axum::response::Response {
    use axum::response::IntoResponse;
    if state.draining.load(std::sync::atomic::Ordering::Relaxed) {
        return (
            axum::http::StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "draining"})),
        )
            .into_response();
    }
    let db = tokio::time::timeout(std::time::Duration::from_secs(2), state.tenants.ping()).await;
    match db {
        Ok(Ok(())) => {
            let workers: usize = state.models.all().iter().map(|m| m.worker_count()).sum();
            Json(json!({"status": "ready", "models": state.models.all().len(), "workers": workers})).into_response()
        }
        Ok(Err(e)) => (
            axum::http::StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "database unavailable", "error": e.to_string()})),
        )
            .into_response(),
        Err(_) => (
            axum::http::StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "database unavailable", "error": "no answer in 2 s"})),
        )
            .into_response(),
    }
}

/// The status and the models served, with their worker counts.
#[utoipa::path(get, path = "/healthz", tag = "probes",
    responses((status = 200, description = "`ok` and the models.", body = crate::openapi::Health)))]
pub(crate) async fn healthz(State(state): State<Arc<AppState>>) -> Json<Value> {
    let models: Vec<Value> = state
        .models
        .all()
        .iter()
        .map(|m| json!({"id": m.id, "workers": m.worker_count()}))
        .collect();
    Json(json!({"status": "ok", "models": models}))
}

fn model_json(m: &ServedModel) -> Value {
    let mut v = json!({"id": m.id, "object": "model", "created": m.created, "owned_by": "hearth", "context_length": m.context_length});
    if let Some(state) = m.state() {
        v["state"] = json!(state);
    }
    v
}

/// The models this credential may use.
#[utoipa::path(get, path = "/v1/models", tag = "models", security(("bearer" = [])),
    responses((status = 200, description = "`{\"object\": \"list\", \"data\": [model]}`.", body = crate::openapi::List<crate::openapi::Model>), crate::error::Errors))]
pub(crate) async fn list_models(State(state): State<Arc<AppState>>, Caller(ctx): Caller) -> Json<Value> {
    let models: Vec<_> = state
        .models
        .all()
        .into_iter()
        .filter(|m| ctx.allows_model(&m.id) && m.visible_to(&ctx))
        .collect();
    let mut data: Vec<Value> = models.iter().map(|m| model_json(m)).collect();
    // The tenant's adapters, as `BASE:NAME` (the latest version of each name).
    match state.tenants.list_adapters(&ctx.tenant_id).await {
        Ok(adapters) => {
            let mut seen = std::collections::HashSet::new();
            for a in adapters.iter().rev() {
                let Some(m) = models.iter().find(|m| m.id == a.base_model) else {
                    continue;
                };
                if seen.insert((&a.base_model, &a.name)) {
                    data.push(adapter_json(m, a));
                }
            }
        }
        Err(e) => tracing::warn!(error = %e, "listing the tenant's adapters failed"),
    }
    Json(json!({"object": "list", "data": data}))
}

/// A tenant's adapter as a model: `BASE:NAME`, its parent the base model.
fn adapter_json(m: &ServedModel, a: &hearth_tenants::adapters::AdapterInfo) -> Value {
    json!({"id": hearth_tenants::adapters::model_name(&m.id, &a.name), "object": "model", "created": a.created_at / 1000,
        "owned_by": a.tenant_id, "context_length": m.context_length, "parent": m.id, "adapter": {"id": a.id, "version": a.version, "digest": a.digest}})
}

/// One model (404 `model_not_found` if the credential may not use it).
#[utoipa::path(get, path = "/v1/models/{model}", tag = "models", security(("bearer" = [])),
    params(("model" = String, Path, description = "A model id.")),
    responses((status = 200, description = "The model.", body = crate::openapi::Model), crate::error::Errors))]
pub(crate) async fn get_model(
    State(state): State<Arc<AppState>>,
    Caller(ctx): Caller,
    Path(model): Path<String>,
) -> Result<Json<Value>, ApiError> {
    if let Some(m) = state.models.get(&model).filter(|m| m.visible_to(&ctx)) {
        if !ctx.allows_model(&model) {
            return Err(ApiError::model_not_found(&model));
        }
        return Ok(Json(model_json(&m)));
    }
    // `BASE:NAME`: one of the tenant's adapters.
    let (base, name) =
        hearth_tenants::adapters::split_model_name(&model).ok_or_else(|| ApiError::model_not_found(&model))?;
    let m = state
        .models
        .get(base)
        .filter(|m| m.visible_to(&ctx) && ctx.allows_model(&m.id))
        .ok_or_else(|| ApiError::model_not_found(&model))?;
    let a = state
        .tenants
        .find_adapter(&ctx.tenant_id, base, name)
        .await
        .map_err(crate::error::store_error)?
        .ok_or_else(|| ApiError::model_not_found(&model))?;
    Ok(Json(adapter_json(&m, &a)))
}

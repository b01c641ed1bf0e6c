//! The small public routes: health, liveness and readiness probes, the models a credential
//! may use, and the operator's Prometheus exposition (`/metrics`, behind the admin token).

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::header;
use axum::response::IntoResponse;
use axum::Json;
use serde_json::{json, Value};

use crate::auth::Caller;
use crate::server::error::ApiError;
use crate::state::AppState;
use crate::upstream::registry::ServedModel;

/// Liveness: the process answers.
#[utoipa::path(get, path = "/livez", tag = "probes",
    responses((status = 200, description = "`{\"status\": \"ok\"}`.", body = crate::api::schema::Status)))]
pub async fn livez() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

/// Readiness: not shutting down, and the database answers. (Liveness, `/livez`, is the
/// process answering at all.)
#[utoipa::path(get, path = "/readyz", summary = "Readiness: not draining, and the database answers.", tag = "probes",
    responses(
        (status = 200, description = "Ready, with the number of models and workers.", body = crate::api::schema::Status),
        (status = 503, description = "Draining, or the database does not answer.", body = crate::api::schema::Status),
    ))]
pub async fn readyz(State(state): State<Arc<AppState>>) -> axum::response::Response {
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
    responses((status = 200, description = "`ok` and the models.", body = crate::api::schema::Health)))]
pub async fn healthz(State(state): State<Arc<AppState>>) -> Json<Value> {
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
    responses((status = 200, description = "`{\"object\": \"list\", \"data\": [model]}`.", body = crate::api::schema::List<crate::api::schema::Model>), crate::server::error::Errors))]
pub async fn list_models(State(state): State<Arc<AppState>>, Caller(ctx): Caller) -> Json<Value> {
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
    responses((status = 200, description = "The model.", body = crate::api::schema::Model), crate::server::error::Errors))]
pub async fn get_model(
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
        .map_err(crate::server::error::store_error)?
        .ok_or_else(|| ApiError::model_not_found(&model))?;
    Ok(Json(adapter_json(&m, &a)))
}

/// The Prometheus exposition (operator-only).
#[utoipa::path(get, path = "/metrics", tag = "operations", operation_id = "render",
    responses((status = 200, description = "Prometheus text format; see the metrics reference.", content_type = "text/plain", body = String), crate::server::error::Errors))]
pub async fn metrics(State(state): State<Arc<AppState>>) -> impl IntoResponse {
    let body = state.metrics.render(&state.ledger, &state.tenants, &state.models);
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
        body,
    )
}

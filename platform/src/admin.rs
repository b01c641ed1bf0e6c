//! The admin API under `/admin/v1/`, guarded by `HEARTH_ADMIN_TOKEN` (closed when unset):
//! tenants, API keys, recent usage. The `hearth admin …` CLI does the same against the
//! database directly.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get};
use axum::{Json, Router};
use hearth_tenants::{constant_time_eq, TenantError};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::gateway::Gateway;
use crate::openai::parse_object;

pub fn router() -> Router<Arc<Gateway>> {
    Router::new()
        .route("/tenants", get(list_tenants).post(create_tenant))
        .route("/tenants/{tenant}/keys", get(list_keys).post(create_key))
        .route("/keys/{key_id}", delete(revoke_key))
        .route(
            "/tenants/{tenant}/limits",
            axum::routing::put(set_tenant_limits).get(get_tenant_limits),
        )
        .route("/keys/{key_id}/limits", axum::routing::put(set_key_limits))
        .route("/usage", get(usage))
        .route("/routing", get(routing))
        .route("/routing/{model}/workers/{slot}/drain", axum::routing::post(drain))
}

fn guard(gw: &Gateway, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(token) = gw.admin_token.as_deref().filter(|t| !t.is_empty()) else {
        return Err(ApiError::forbidden(
            "the admin API is disabled: start Hearth with HEARTH_ADMIN_TOKEN set",
        ));
    };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    if constant_time_eq(given.as_bytes(), token.as_bytes()) {
        Ok(())
    } else {
        Err(ApiError::unauthorized("Missing or incorrect admin token."))
    }
}

fn store_error(e: TenantError) -> ApiError {
    match e {
        TenantError::TenantExists(_) => ApiError::conflict(e.to_string()),
        TenantError::NoSuchTenant(_) | TenantError::NoSuchKey(_) => ApiError::not_found(e.to_string()),
        TenantError::InvalidName(_) => ApiError::invalid("name", e.to_string()),
        TenantError::Db(_) | TenantError::Random(_) => {
            tracing::error!(error = %e, "admin store error");
            ApiError::internal("the tenant store failed")
        }
    }
}

fn name_field(body: &Bytes, required: bool) -> Result<String, ApiError> {
    if body.is_empty() && !required {
        return Ok(String::new());
    }
    let o = parse_object(body)?;
    match o.get("name") {
        Some(Value::String(s)) => Ok(s.clone()),
        None | Some(Value::Null) if !required => Ok(String::new()),
        None | Some(Value::Null) => Err(ApiError::invalid("name", "'name' is required")),
        Some(_) => Err(ApiError::invalid("name", "'name' must be a string")),
    }
}

async fn list_tenants(State(gw): State<Arc<Gateway>>, headers: HeaderMap) -> Result<Json<Value>, ApiError> {
    guard(&gw, &headers)?;
    let tenants = gw.tenants.list_tenants().await.map_err(store_error)?;
    Ok(Json(json!({"object": "list", "data": tenants})))
}

async fn create_tenant(State(gw): State<Arc<Gateway>>, headers: HeaderMap, body: Bytes) -> Result<Response, ApiError> {
    guard(&gw, &headers)?;
    let name = name_field(&body, true)?;
    let t = gw.tenants.create_tenant(&name).await.map_err(store_error)?;
    Ok((StatusCode::CREATED, Json(t)).into_response())
}

async fn list_keys(
    State(gw): State<Arc<Gateway>>,
    headers: HeaderMap,
    Path(tenant): Path<String>,
) -> Result<Json<Value>, ApiError> {
    guard(&gw, &headers)?;
    let keys = gw.tenants.list_keys(&tenant).await.map_err(store_error)?;
    Ok(Json(json!({"object": "list", "data": keys})))
}

async fn create_key(
    State(gw): State<Arc<Gateway>>,
    headers: HeaderMap,
    Path(tenant): Path<String>,
    body: Bytes,
) -> Result<Response, ApiError> {
    guard(&gw, &headers)?;
    let name = name_field(&body, false)?;
    let k = gw.tenants.create_key(&tenant, &name).await.map_err(store_error)?;
    Ok((StatusCode::CREATED, Json(k)).into_response())
}

async fn revoke_key(
    State(gw): State<Arc<Gateway>>,
    headers: HeaderMap,
    Path(key_id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    guard(&gw, &headers)?;
    let k = gw.tenants.revoke_key(&key_id).await.map_err(store_error)?;
    Ok(Json(json!(k)))
}

#[derive(Deserialize)]
struct UsageQuery {
    tenant: Option<String>,
    limit: Option<u32>,
}

async fn usage(
    State(gw): State<Arc<Gateway>>,
    headers: HeaderMap,
    q: Result<Query<UsageQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<Value>, ApiError> {
    guard(&gw, &headers)?;
    let Query(q) = q.map_err(|e| ApiError::invalid("query", e.body_text()))?;
    let tenant_id = match q.tenant {
        Some(t) => Some(gw.tenants.tenant(&t).await.map_err(store_error)?.id),
        None => None,
    };
    let rows = gw
        .ledger
        .recent(tenant_id.as_deref(), q.limit.unwrap_or(100).min(10_000))
        .await
        .map_err(|e| {
            tracing::error!(error = %e, "usage query failed");
            ApiError::internal("the usage store failed")
        })?;
    Ok(Json(json!({"object": "list", "data": rows})))
}

/// Routing state per model: policy, workers and their load, decisions, index size.
async fn routing(State(gw): State<Arc<Gateway>>, headers: HeaderMap) -> Result<Json<Value>, ApiError> {
    guard(&gw, &headers)?;
    let models: Vec<Value> = gw
        .models
        .all()
        .map(|m| {
            let r = m.router();
            let workers: Vec<Value> = r
                .workers()
                .map(|(slot, w)| {
                    let mut v = json!(w);
                    v["slot"] = json!(slot);
                    v["cached_blocks"] = json!(r.index.worker_blocks(slot));
                    v
                })
                .collect();
            let mut decisions: Vec<Value> = r
                .decisions
                .iter()
                .map(|((policy, reason), n)| json!({"policy": policy, "reason": reason, "count": n}))
                .collect();
            decisions.sort_by_key(|d| d["reason"].as_str().unwrap_or("").to_string());
            json!({
                "model": m.id, "policy": r.cfg.policy, "load_factor": r.cfg.load_factor,
                "home_region": r.cfg.home_region, "index_blocks": r.index.len(),
                "workers": workers, "decisions": decisions,
            })
        })
        .collect();
    Ok(Json(json!({"object": "list", "data": models})))
}

/// `{"draining": true|false}`: a draining worker takes no new requests; running ones finish.
async fn drain(
    State(gw): State<Arc<Gateway>>,
    headers: HeaderMap,
    Path((model, slot)): Path<(String, usize)>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    guard(&gw, &headers)?;
    let draining = if body.is_empty() {
        true
    } else {
        parse_object(&body)?
            .get("draining")
            .and_then(Value::as_bool)
            .unwrap_or(true)
    };
    let m = gw.models.get(&model).ok_or_else(|| ApiError::model_not_found(&model))?;
    let mut r = m.router();
    let w = r
        .worker_mut(slot)
        .ok_or_else(|| ApiError::not_found(format!("model {model} has no worker {slot}")))?;
    w.draining = draining;
    Ok(Json(json!({"model": model, "slot": slot, "draining": draining})))
}

/// `{"rpm": N|null, "tpm": N|null, "concurrent": N|null}`; null or 0 is unlimited.
fn limits_body(body: &Bytes) -> Result<hearth_tenants::Limits, ApiError> {
    let o = parse_object(body)?;
    let field = |k: &str| -> Result<Option<u32>, ApiError> {
        match o.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => match v.as_u64().and_then(|n| u32::try_from(n).ok()) {
                Some(0) => Ok(None),
                Some(n) => Ok(Some(n)),
                None => Err(ApiError::invalid(
                    k,
                    format!("'{k}' must be a non-negative integer or null"),
                )),
            },
        }
    };
    Ok(hearth_tenants::Limits {
        rpm: field("rpm")?,
        tpm: field("tpm")?,
        concurrent: field("concurrent")?,
    })
}

async fn set_tenant_limits(
    State(gw): State<Arc<Gateway>>,
    headers: HeaderMap,
    Path(tenant): Path<String>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    guard(&gw, &headers)?;
    let l = limits_body(&body)?;
    let t = gw.tenants.set_tenant_limits(&tenant, l).await.map_err(store_error)?;
    Ok(Json(json!({"tenant": t.name, "limits": l})))
}

async fn get_tenant_limits(
    State(gw): State<Arc<Gateway>>,
    headers: HeaderMap,
    Path(tenant): Path<String>,
) -> Result<Json<Value>, ApiError> {
    guard(&gw, &headers)?;
    let l = gw.tenants.tenant_limits(&tenant).await.map_err(store_error)?;
    Ok(Json(json!({"tenant": tenant, "limits": l})))
}

async fn set_key_limits(
    State(gw): State<Arc<Gateway>>,
    headers: HeaderMap,
    Path(key_id): Path<String>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    guard(&gw, &headers)?;
    let l = limits_body(&body)?;
    gw.tenants.set_key_limits(&key_id, l).await.map_err(store_error)?;
    Ok(Json(json!({"key": key_id, "limits": l})))
}

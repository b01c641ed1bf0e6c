//! The tenant self-service API under `/v1/tenant`, for the dashboard and for tenants'
//! own tooling. Authenticated like the model APIs (an API key or a JWT) and needing the
//! `manage` scope; a tenant only ever sees and changes its own keys and usage.
//!
//! * `GET /v1/tenant` — the tenant, its limits, budget and month-to-date spend;
//! * `GET /v1/tenant/keys`, `POST /v1/tenant/keys`, `DELETE /v1/tenant/keys/{id}`;
//! * `GET /v1/tenant/usage?from&to` — usage and cost by day and model, with totals;
//! * `GET /v1/tenant/usage/export?from&to&format&granularity` — the billing export;
//! * `/v1/tenant/processors` — upload (POST, the `.wasm` as the body), list, activate,
//!   deactivate, attach to a key, delete the tenant's processors.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get};
use axum::{Json, Router};
use hearth_billing::export::{by_day, Totals};
use hearth_billing::{format_nusd, month_of};
use hearth_tenants::now_ms;
use serde_json::{json, Value};

use crate::admin::{budget_json, export_response, key_spec, ledger_error, store_error, window, ExportQuery};
use crate::auth::Manager;
use crate::error::ApiError;
use crate::state::AppState;

pub fn router() -> Router<Arc<AppState>> {
    Router::new()
        .route("/", get(me))
        .route("/keys", get(list_keys).post(create_key))
        .route("/keys/{key_id}", delete(revoke_key))
        .route("/usage", get(usage))
        .route("/usage/export", get(export))
        .route(
            "/processors",
            get(list_processors)
                .post(upload_processor)
                .layer(crate::admin::upload_limit()),
        )
        .route("/processors/{id}", delete(delete_processor))
        .route("/processors/{id}/activate", axum::routing::post(activate_processor))
        .route("/processors/{id}/deactivate", axum::routing::post(deactivate_processor))
        .route("/processors/{id}/attachment", axum::routing::put(attach_processor))
}

async fn me(State(gw): State<Arc<AppState>>, Manager(ctx): Manager) -> Result<Json<Value>, ApiError> {
    let month = month_of(now_ms());
    gw.ledger.flush().await;
    let spent = gw
        .ledger
        .month_spend(&ctx.tenant_id, &month)
        .await
        .map_err(ledger_error)?;
    let mut v = json!({
        "id": ctx.tenant_id, "name": ctx.tenant_name,
        "credential": {"id": ctx.key_id, "scopes": ctx.scopes.names(), "models": ctx.models.as_deref()},
        "limits": {"tenant": ctx.tenant_limits, "credential": ctx.key_limits},
        "spend": {"month": month, "usd": format_nusd(spent), "nusd": spent},
    });
    v["budget"] = budget_json(&ctx.tenant_name, ctx.budget)["budget"].clone();
    Ok(Json(v))
}

async fn list_keys(State(gw): State<Arc<AppState>>, Manager(ctx): Manager) -> Result<Json<Value>, ApiError> {
    let keys = gw.tenants.list_keys(&ctx.tenant_id).await.map_err(store_error)?;
    Ok(Json(json!({"object": "list", "data": keys})))
}

/// A new key for the caller's tenant; it can grant no scope and no model the caller lacks.
async fn create_key(State(gw): State<Arc<AppState>>, Manager(ctx): Manager, body: Bytes) -> Result<Response, ApiError> {
    let mut spec = key_spec(&body)?;
    let scopes = spec.scopes.unwrap_or(ctx.scopes);
    if !scopes.within(ctx.scopes) {
        return Err(ApiError::permission(
            "scope_escalation",
            "A key cannot grant scopes its creator lacks.",
        ));
    }
    spec.scopes = Some(scopes);
    if let Some(allowed) = &ctx.models {
        match &spec.models {
            None => spec.models = Some(allowed.to_vec()),
            Some(m) if m.iter().all(|x| allowed.contains(x)) => {}
            Some(_) => {
                return Err(ApiError::permission(
                    "scope_escalation",
                    "A key cannot allow models its creator may not use.",
                ))
            }
        }
    }
    let k = gw
        .tenants
        .create_key(&ctx.tenant_id, &spec)
        .await
        .map_err(store_error)?;
    Ok((StatusCode::CREATED, Json(k)).into_response())
}

async fn revoke_key(
    State(gw): State<Arc<AppState>>,
    Manager(ctx): Manager,
    Path(key_id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    // Another tenant's key is "not found", never "forbidden": ids are not confirmed.
    let k = gw.tenants.key(&key_id).await.map_err(store_error)?;
    if k.tenant_id != ctx.tenant_id {
        return Err(ApiError::not_found(format!("API key {key_id:?} does not exist")));
    }
    let k = gw.tenants.revoke_key(&k.id).await.map_err(store_error)?;
    Ok(Json(json!(k)))
}

fn totals_json(t: &Totals) -> Value {
    json!({
        "requests": t.requests, "uncached_input_tokens": t.uncached_input_tokens,
        "cached_input_tokens": t.cached_input_tokens, "output_tokens": t.output_tokens,
        "cost_usd": format_nusd(t.cost_nusd), "cost_nusd": t.cost_nusd,
    })
}

async fn usage(
    State(gw): State<Arc<AppState>>,
    Manager(ctx): Manager,
    q: Result<Query<ExportQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<Value>, ApiError> {
    let Query(q) = q.map_err(|e| ApiError::invalid("query", e.body_text()))?;
    let (from, to) = window(&q)?;
    gw.ledger.flush().await;
    let rows = gw.ledger.rows(&ctx.tenant_id, from, to).await.map_err(ledger_error)?;
    let data: Vec<Value> = by_day(&rows)
        .iter()
        .map(|d| {
            let mut v = totals_json(&d.totals);
            v["day"] = json!(d.day);
            v["model"] = json!(d.model);
            v
        })
        .collect();
    Ok(Json(json!({
        "object": "list", "from": from, "to": to, "data": data, "totals": totals_json(&Totals::of(&rows)),
    })))
}

async fn export(
    State(gw): State<Arc<AppState>>,
    Manager(ctx): Manager,
    q: Result<Query<ExportQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(q) = q.map_err(|e| ApiError::invalid("query", e.body_text()))?;
    export_response(&gw, &ctx.tenant_id, &q).await
}

// ---- processors ------------------------------------------------------------------------

/// A processor of the caller's tenant (another tenant's is "not found").
async fn own_processor(
    gw: &AppState,
    ctx: &hearth_tenants::TenantContext,
    id: &str,
) -> Result<hearth_tenants::processors::ProcessorInfo, ApiError> {
    let p = gw.tenants.processor(id).await.map_err(store_error)?;
    if p.tenant_id != ctx.tenant_id {
        return Err(ApiError::not_found(format!("processor {id:?} does not exist")));
    }
    Ok(p)
}

async fn upload_processor(
    State(gw): State<Arc<AppState>>,
    Manager(ctx): Manager,
    q: Result<Query<crate::admin::UploadQuery>, axum::extract::rejection::QueryRejection>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let Query(q) = q.map_err(|e| ApiError::invalid("query", e.body_text()))?;
    crate::admin::upload(&gw, &ctx.tenant_id, q, body).await
}

async fn list_processors(State(gw): State<Arc<AppState>>, Manager(ctx): Manager) -> Result<Json<Value>, ApiError> {
    let ps = gw.tenants.list_processors(&ctx.tenant_id).await.map_err(store_error)?;
    Ok(Json(json!({"object": "list", "data": ps})))
}

async fn set_active(
    gw: &AppState,
    ctx: &hearth_tenants::TenantContext,
    id: &str,
    active: bool,
) -> Result<Json<Value>, ApiError> {
    own_processor(gw, ctx, id).await?;
    let p = gw.tenants.set_processor_active(id, active).await.map_err(store_error)?;
    Ok(Json(json!(p)))
}

async fn activate_processor(
    State(gw): State<Arc<AppState>>,
    Manager(ctx): Manager,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    set_active(&gw, &ctx, &id, true).await
}

async fn deactivate_processor(
    State(gw): State<Arc<AppState>>,
    Manager(ctx): Manager,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    set_active(&gw, &ctx, &id, false).await
}

async fn attach_processor(
    State(gw): State<Arc<AppState>>,
    Manager(ctx): Manager,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    own_processor(&gw, &ctx, &id).await?;
    let key = crate::admin::attachment_body(&body)?;
    let p = gw
        .tenants
        .attach_processor(&id, key.as_deref())
        .await
        .map_err(store_error)?;
    Ok(Json(json!(p)))
}

async fn delete_processor(
    State(gw): State<Arc<AppState>>,
    Manager(ctx): Manager,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    own_processor(&gw, &ctx, &id).await?;
    let p = gw.tenants.delete_processor(&id).await.map_err(store_error)?;
    Ok(Json(json!(p)))
}

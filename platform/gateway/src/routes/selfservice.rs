//! The tenant self-service API under `/v1/tenant`, for the dashboard and for tenants'
//! own tooling. Authenticated like the model APIs (an API key or a JWT) and needing the
//! `manage` scope; a tenant only ever sees and changes its own keys and usage.
//!
//! * `GET /v1/tenant` — the tenant, its limits, budget and month-to-date spend;
//! * `GET /v1/tenant/keys`, `POST /v1/tenant/keys`, `DELETE /v1/tenant/keys/{id}`;
//! * `GET /v1/tenant/usage?from&to` — usage and cost by day and model, with totals;
//! * `GET /v1/tenant/usage/export?from&to&format&granularity` — the billing export;
//! * `/v1/tenant/processors` — upload (POST, the `.wasm` as the body), list, activate,
//!   deactivate, attach to a key, delete the tenant's processors;
//! * `/v1/tenant/adapters` — upload (POST, `multipart/form-data`), list and delete the
//!   tenant's LoRA adapters;
//! * `GET /v1/tenant/audit?limit` — the tenant's audit log (who changed what, when, from where).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get};
use axum::{Json, Router};
use hearth_billing::export::Totals;
use hearth_billing::{format_nusd, month_of};
use hearth_tenants::now_ms;
use serde_json::{json, Value};

use crate::auth::{ClientOrigin, Manager};
use crate::manage::Actor;
use crate::routes::admin::{budget_json, export_response, key_spec, ExportQuery, UploadQuery};
use crate::server::error::ledger_error;
use crate::server::error::ApiError;
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
                .layer(crate::routes::admin::upload_limit()),
        )
        .route("/processors/{id}", delete(delete_processor))
        .route("/processors/{id}/activate", axum::routing::post(activate_processor))
        .route("/processors/{id}/deactivate", axum::routing::post(deactivate_processor))
        .route("/processors/{id}/attachment", axum::routing::put(attach_processor))
        .route(
            "/adapters",
            get(list_adapters)
                .post(upload_adapter)
                .layer(crate::manage::adapters::upload_limit()),
        )
        .route("/adapters/{id}", delete(delete_adapter))
        .route("/audit", get(audit_log))
}

// ---- adapters --------------------------------------------------------------------------

#[utoipa::path(post, path = "/v1/tenant/adapters", summary = "Uploads a LoRA adapter version for a model of the catalogue.", tag = "self-service", security(("bearer" = [])),
    request_body(content = crate::manage::adapters::UploadForm, content_type = "multipart/form-data", description = "`base_model`, `name`, and the adapter's files as `file` parts. A worker serving the base model loads it before it is stored; requests then use `model: \"BASE:NAME\"`."),
    responses((status = 201, description = "The stored version.", body = hearth_tenants::adapters::AdapterInfo), crate::server::error::Errors))]
pub(crate) async fn upload_adapter(
    State(gw): State<Arc<AppState>>,
    Manager(ctx): Manager,
    ClientOrigin(origin): ClientOrigin,
    form: crate::manage::adapters::Form,
) -> Result<Response, ApiError> {
    let up = crate::manage::adapters::read_form(form).await?;
    let a = gw
        .management()
        .via(origin)
        .upload_adapter(Actor::Tenant(&ctx), None, up)
        .await?;
    Ok((StatusCode::CREATED, Json(a)).into_response())
}

#[utoipa::path(get, path = "/v1/tenant/adapters", summary = "The tenant's adapter versions.", tag = "self-service", security(("bearer" = [])),
    responses((status = 200, description = "The tenant's adapter versions.", body = crate::api::schema::List<hearth_tenants::adapters::AdapterInfo>), crate::server::error::Errors))]
pub(crate) async fn list_adapters(
    State(gw): State<Arc<AppState>>,
    Manager(ctx): Manager,
) -> Result<Json<Value>, ApiError> {
    let a = gw.management().list_adapters(Actor::Tenant(&ctx), None).await?;
    Ok(Json(json!({"object": "list", "data": a})))
}

#[utoipa::path(delete, path = "/v1/tenant/adapters/{id}", summary = "Deletes an adapter version (requests running under it finish).", tag = "self-service", security(("bearer" = [])), params(("id" = String, Path, description = "An adapter version's id.")),
    responses((status = 200, description = "The deleted version.", body = hearth_tenants::adapters::AdapterInfo), crate::server::error::Errors))]
pub(crate) async fn delete_adapter(
    State(gw): State<Arc<AppState>>,
    Manager(ctx): Manager,
    ClientOrigin(origin): ClientOrigin,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    Ok(Json(json!(
        gw.management()
            .via(origin)
            .delete_adapter(Actor::Tenant(&ctx), &id)
            .await?
    )))
}

#[derive(serde::Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
struct AuditQuery {
    /// Entries to return: 1 to 1,000 (default 100).
    #[param(minimum = 1, maximum = 1000)]
    limit: Option<u32>,
}

#[utoipa::path(get, path = "/v1/tenant/audit", tag = "self-service", security(("bearer" = [])), params(AuditQuery),
    responses((status = 200, description = "The tenant's audit log, newest first.", body = crate::api::schema::List<hearth_tenants::audit::AuditEntry>), crate::server::error::Errors))]
/// The tenant's audit log, newest first.
async fn audit_log(
    State(gw): State<Arc<AppState>>,
    Manager(ctx): Manager,
    q: Result<Query<AuditQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<Value>, ApiError> {
    let Query(q) = q.map_err(|e| ApiError::invalid("query", e.body_text()))?;
    if q.limit.is_some_and(|l| !(1..=1000).contains(&l)) {
        return Err(ApiError::invalid("limit", "'limit' must be between 1 and 1000"));
    }
    let entries = gw
        .management()
        .audit_log(Actor::Tenant(&ctx), None, q.limit.unwrap_or(100))
        .await?;
    Ok(Json(json!({"object": "list", "data": entries})))
}

#[utoipa::path(get, path = "/v1/tenant", summary = "The caller's tenant: its credential, limits, budget and this month's spend.", tag = "self-service", security(("bearer" = [])),
    responses((status = 200, description = "The tenant: `id`, `name`, the `credential` (id, scopes, models), `limits` (tenant and credential), `budget`, this month's `spend`.", body = crate::api::schema::AnyObject), crate::server::error::Errors))]
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

#[utoipa::path(get, path = "/v1/tenant/keys", summary = "The tenant's keys (never their secrets).", tag = "self-service", security(("bearer" = [])),
    responses((status = 200, description = "The tenant's keys (never their secrets).", body = crate::api::schema::List<hearth_tenants::ApiKeyInfo>), crate::server::error::Errors))]
async fn list_keys(State(gw): State<Arc<AppState>>, Manager(ctx): Manager) -> Result<Json<Value>, ApiError> {
    let keys = gw.management().list_keys(Actor::Tenant(&ctx), None).await?;
    Ok(Json(json!({"object": "list", "data": keys})))
}

#[utoipa::path(post, path = "/v1/tenant/keys", tag = "self-service", security(("bearer" = [])), request_body = Option<crate::api::schema::KeyRequest>,
    responses((status = 201, description = "The key; `key` is shown only here.", body = hearth_tenants::CreatedKey), crate::server::error::Errors))]
/// A new key for the caller's tenant; it can grant no scope and no model the caller lacks.
async fn create_key(
    State(gw): State<Arc<AppState>>,
    Manager(ctx): Manager,
    ClientOrigin(origin): ClientOrigin,
    body: Bytes,
) -> Result<Response, ApiError> {
    let spec = key_spec(&body)?;
    let k = gw
        .management()
        .via(origin)
        .create_key(Actor::Tenant(&ctx), None, spec)
        .await?;
    Ok((StatusCode::CREATED, Json(k)).into_response())
}

#[utoipa::path(delete, path = "/v1/tenant/keys/{key_id}", summary = "Revokes one of the tenant's keys (a key restricted to some models revokes only keys within them).", tag = "self-service", security(("bearer" = [])), params(("key_id" = String, Path, description = "A key id.")),
    responses((status = 200, description = "The revoked key.", body = hearth_tenants::ApiKeyInfo), crate::server::error::Errors))]
async fn revoke_key(
    State(gw): State<Arc<AppState>>,
    Manager(ctx): Manager,
    ClientOrigin(origin): ClientOrigin,
    Path(key_id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    Ok(Json(json!(
        gw.management()
            .via(origin)
            .revoke_key(Actor::Tenant(&ctx), &key_id)
            .await?
    )))
}

fn totals_json(t: &Totals) -> Value {
    json!({
        "requests": t.requests, "uncached_input_tokens": t.uncached_input_tokens,
        "cached_input_tokens": t.cached_input_tokens, "output_tokens": t.output_tokens,
        "cost_usd": format_nusd(t.cost_nusd), "cost_nusd": t.cost_nusd,
    })
}

#[utoipa::path(get, path = "/v1/tenant/usage", summary = "Usage and cost by day and model, with totals.", tag = "self-service", security(("bearer" = [])), params(crate::routes::admin::WindowParams),
    responses((status = 200, description = "Usage and cost by day and model (`data`), with `totals`, `from` and `to`.", body = crate::api::schema::AnyObject), crate::server::error::Errors))]
async fn usage(
    State(gw): State<Arc<AppState>>,
    Manager(ctx): Manager,
    q: Result<Query<ExportQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<Value>, ApiError> {
    let Query(q) = q.map_err(|e| ApiError::invalid("query", e.body_text()))?;
    let window = q.window()?;
    let (days, totals) = gw.management().usage_by_day(Actor::Tenant(&ctx), None, window).await?;
    let data: Vec<Value> = days
        .iter()
        .map(|d| {
            let mut v = totals_json(&d.totals);
            v["day"] = json!(d.day);
            v["model"] = json!(d.model);
            v
        })
        .collect();
    Ok(Json(json!({
        "object": "list", "from": window.from, "to": window.to, "data": data, "totals": totals_json(&totals),
    })))
}

#[utoipa::path(get, path = "/v1/tenant/usage/export", summary = "The tenant's billing export.", tag = "self-service", security(("bearer" = [])), params(crate::routes::admin::ExportQuery),
    responses((status = 200, description = "The billing export as a download (CSV, JSON lines or Parquet); totals in `x-hearth-export-*` headers.", content(("text/csv"), ("application/x-ndjson"), ("application/vnd.apache.parquet"))), crate::server::error::Errors))]
async fn export(
    State(gw): State<Arc<AppState>>,
    Manager(ctx): Manager,
    q: Result<Query<ExportQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(q) = q.map_err(|e| ApiError::invalid("query", e.body_text()))?;
    export_response(&gw, Actor::Tenant(&ctx), &q).await
}

// ---- processors ------------------------------------------------------------------------

#[utoipa::path(post, path = "/v1/tenant/processors", summary = "Uploads a processor version (the body is the component).", tag = "self-service", security(("bearer" = [])), params(crate::routes::admin::UploadQuery),
    request_body(content = crate::api::schema::Wasm, content_type = "application/wasm", description = "The processor, a WebAssembly component (or core module)."),
    responses((status = 201, description = "The stored version.", body = hearth_tenants::processors::ProcessorInfo), crate::server::error::Errors))]
async fn upload_processor(
    State(gw): State<Arc<AppState>>,
    Manager(ctx): Manager,
    ClientOrigin(origin): ClientOrigin,
    q: Result<Query<UploadQuery>, axum::extract::rejection::QueryRejection>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let Query(q) = q.map_err(|e| ApiError::invalid("query", e.body_text()))?;
    let p = gw
        .management()
        .via(origin)
        .upload_processor(Actor::Tenant(&ctx), None, q.upload()?, body.to_vec())
        .await?;
    Ok((StatusCode::CREATED, Json(p)).into_response())
}

#[utoipa::path(get, path = "/v1/tenant/processors", summary = "The tenant's processor versions.", tag = "self-service", security(("bearer" = [])),
    responses((status = 200, description = "The tenant's processor versions.", body = crate::api::schema::List<hearth_tenants::processors::ProcessorInfo>), crate::server::error::Errors))]
async fn list_processors(State(gw): State<Arc<AppState>>, Manager(ctx): Manager) -> Result<Json<Value>, ApiError> {
    let ps = gw.management().list_processors(Actor::Tenant(&ctx), None).await?;
    Ok(Json(json!({"object": "list", "data": ps})))
}

#[utoipa::path(post, path = "/v1/tenant/processors/{id}/activate", summary = "Activates a processor version.", tag = "self-service", security(("bearer" = [])), params(("id" = String, Path, description = "A processor id.")),
    responses((status = 200, description = "The processor, active.", body = hearth_tenants::processors::ProcessorInfo), crate::server::error::Errors))]
async fn activate_processor(
    State(gw): State<Arc<AppState>>,
    Manager(ctx): Manager,
    ClientOrigin(origin): ClientOrigin,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    Ok(Json(json!(
        gw.management()
            .via(origin)
            .set_processor_active(Actor::Tenant(&ctx), &id, true)
            .await?
    )))
}

#[utoipa::path(post, path = "/v1/tenant/processors/{id}/deactivate", summary = "Deactivates a processor version.", tag = "self-service", security(("bearer" = [])), params(("id" = String, Path, description = "A processor id.")),
    responses((status = 200, description = "The processor, inactive.", body = hearth_tenants::processors::ProcessorInfo), crate::server::error::Errors))]
async fn deactivate_processor(
    State(gw): State<Arc<AppState>>,
    Manager(ctx): Manager,
    ClientOrigin(origin): ClientOrigin,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    Ok(Json(json!(
        gw.management()
            .via(origin)
            .set_processor_active(Actor::Tenant(&ctx), &id, false)
            .await?
    )))
}

#[utoipa::path(put, path = "/v1/tenant/processors/{id}/attachment", summary = "Runs a processor for one key's requests, or for the whole tenant's.", tag = "self-service", security(("bearer" = [])), params(("id" = String, Path, description = "A processor id.")), request_body = crate::api::schema::AttachmentRequest,
    responses((status = 200, description = "The processor, attached.", body = hearth_tenants::processors::ProcessorInfo), crate::server::error::Errors))]
async fn attach_processor(
    State(gw): State<Arc<AppState>>,
    Manager(ctx): Manager,
    ClientOrigin(origin): ClientOrigin,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let key = crate::routes::admin::attachment_body(&body)?;
    let p = gw
        .management()
        .via(origin)
        .attach_processor(Actor::Tenant(&ctx), &id, key.as_deref())
        .await?;
    Ok(Json(json!(p)))
}

#[utoipa::path(delete, path = "/v1/tenant/processors/{id}", summary = "Deletes a processor version.", tag = "self-service", security(("bearer" = [])), params(("id" = String, Path, description = "A processor id.")),
    responses((status = 200, description = "The deleted processor.", body = hearth_tenants::processors::ProcessorInfo), crate::server::error::Errors))]
async fn delete_processor(
    State(gw): State<Arc<AppState>>,
    Manager(ctx): Manager,
    ClientOrigin(origin): ClientOrigin,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    Ok(Json(json!(
        gw.management()
            .via(origin)
            .delete_processor(Actor::Tenant(&ctx), &id)
            .await?
    )))
}

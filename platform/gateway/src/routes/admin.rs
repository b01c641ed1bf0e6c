//! The admin API under `/admin/v1/`, behind the admin-token layer of [`crate::app`] (closed
//! when `HEARTH_ADMIN_TOKEN` is unset):
//! tenants, API keys, limits, budgets, JWT issuers, prices, usage and billing exports;
//! and the model catalogue (`/models`: list, add, remove at runtime through the workers'
//! catalogues).
//! The `hearth admin …` / `hearth billing …` CLI does the same against the database
//! directly.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get};
use axum::{Json, Router};
use hearth_billing::{format_nusd, parse_usd_micros, PriceRates};
use hearth_tenants::jwt::IssuerSpec;
use hearth_tenants::members::Role;
use hearth_tenants::{now_ms, Budget, KeySpec, Scopes};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::api::openai::parse_object;
use crate::auth::ClientOrigin;
use crate::manage::{Actor, Upload, Window};
use crate::server::error::{ledger_error, store_error, ApiError};
use crate::state::AppState;

pub fn router() -> Router<Arc<AppState>> {
    Router::new()
        .route("/tenants", get(list_tenants).post(create_tenant))
        .route("/tenants/{tenant}/keys", get(list_keys).post(create_key))
        .route("/keys/{key_id}", delete(revoke_key))
        .route(
            "/tenants/{tenant}/limits",
            axum::routing::put(set_tenant_limits).get(get_tenant_limits),
        )
        .route("/keys/{key_id}/limits", axum::routing::put(set_key_limits))
        .route(
            "/tenants/{tenant}/budget",
            axum::routing::put(set_budget).get(get_budget),
        )
        .route("/tenants/{tenant}/jwt-issuers", get(list_issuers).post(add_issuer))
        .route("/jwt-issuers/{id}", delete(remove_issuer))
        .route("/tenants/{tenant}/suspend", axum::routing::post(suspend_tenant))
        .route("/tenants/{tenant}/resume", axum::routing::post(resume_tenant))
        .route("/tenants/{tenant}/sso", get(get_sso).put(set_sso).delete(remove_sso))
        .route("/tenants/{tenant}/members", get(list_members).post(invite_member))
        .route("/tenants/{tenant}/invitations", get(list_invitations))
        .route("/members/{id}", delete(remove_member))
        .route("/members/{id}/role", axum::routing::put(set_member_role))
        .route("/invitations/{id}", delete(revoke_invitation))
        .route("/prices", get(list_prices).post(set_price))
        .route(
            "/tenants/{tenant}/processors",
            get(list_processors).post(upload_processor).layer(upload_limit()),
        )
        .route("/processors/{id}", delete(delete_processor))
        .route(
            "/tenants/{tenant}/adapters",
            get(list_adapters)
                .post(upload_adapter)
                .layer(crate::manage::adapters::upload_limit()),
        )
        .route("/adapters/{id}", delete(delete_adapter))
        .route("/processors/{id}/activate", axum::routing::post(activate_processor))
        .route("/processors/{id}/deactivate", axum::routing::post(deactivate_processor))
        .route("/processors/{id}/attachment", axum::routing::put(attach_processor))
        .route("/billing/export", get(billing_export))
        .route("/usage", get(usage))
        .route("/routing", get(routing))
        .route("/models", get(list_models).post(add_model))
        .route("/models/{model}", delete(remove_model))
        .route("/routing/{model}/workers/{slot}/drain", axum::routing::post(drain))
        .route("/audit", get(audit_log))
}

#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
struct AuditQuery {
    /// A tenant's name or id (default: every tenant's and the platform's).
    tenant: Option<String>,
    /// Entries to return: 1 to 1,000 (default 100).
    #[param(minimum = 1, maximum = 1000)]
    limit: Option<u32>,
}

#[utoipa::path(get, path = "/admin/v1/audit", summary = "The audit log, newest first (every tenant's and the platform's by default).", tag = "operations", params(AuditQuery),
    responses((status = 200, description = "The audit log, newest first.", body = crate::api::schema::List<hearth_tenants::audit::AuditEntry>), crate::server::error::Errors))]
/// `GET /admin/v1/audit?tenant&limit`: the audit log, newest first (all tenants' and the
/// platform's by default).
async fn audit_log(
    State(gw): State<Arc<AppState>>,
    q: Result<Query<AuditQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<Value>, ApiError> {
    let Query(q) = q.map_err(|e| ApiError::invalid("query", e.body_text()))?;
    if q.limit.is_some_and(|l| !(1..=1000).contains(&l)) {
        return Err(ApiError::invalid("limit", "'limit' must be between 1 and 1000"));
    }
    let entries = gw
        .management()
        .audit_log(Actor::Operator, q.tenant.as_deref(), q.limit.unwrap_or(100))
        .await?;
    Ok(Json(json!({"object": "list", "data": entries})))
}

pub(crate) fn name_field(body: &Bytes, required: bool) -> Result<String, ApiError> {
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

#[utoipa::path(get, path = "/admin/v1/tenants", summary = "Every tenant.", tag = "tenants",
    responses((status = 200, description = "Every tenant.", body = crate::api::schema::List<hearth_tenants::Tenant>), crate::server::error::Errors))]
async fn list_tenants(State(gw): State<Arc<AppState>>) -> Result<Json<Value>, ApiError> {
    let tenants = gw.tenants.list_tenants().await.map_err(store_error)?;
    Ok(Json(json!({"object": "list", "data": tenants})))
}

#[utoipa::path(post, path = "/admin/v1/tenants/{tenant}/suspend", summary = "Suspends a tenant.", tag = "tenants", params(("tenant" = String, Path, description = "A tenant's name or id.")),
    responses((status = 200, description = "The tenant (`suspended_at` set). Its API keys and JWTs get 403 `tenant_suspended` within 5 s; its dashboard sessions and members are refused at their next request. Nothing is deleted.", body = hearth_tenants::Tenant), crate::server::error::Errors))]
async fn suspend_tenant(
    State(gw): State<Arc<AppState>>,
    ClientOrigin(origin): ClientOrigin,
    Path(tenant): Path<String>,
) -> Result<Json<hearth_tenants::Tenant>, ApiError> {
    Ok(Json(gw.management().via(origin).set_suspended(&tenant, true).await?))
}

#[utoipa::path(post, path = "/admin/v1/tenants/{tenant}/resume", summary = "Resumes a suspended tenant.", tag = "tenants", params(("tenant" = String, Path, description = "A tenant's name or id.")),
    responses((status = 200, description = "The tenant, active again.", body = hearth_tenants::Tenant), crate::server::error::Errors))]
async fn resume_tenant(
    State(gw): State<Arc<AppState>>,
    ClientOrigin(origin): ClientOrigin,
    Path(tenant): Path<String>,
) -> Result<Json<hearth_tenants::Tenant>, ApiError> {
    Ok(Json(gw.management().via(origin).set_suspended(&tenant, false).await?))
}

#[utoipa::path(post, path = "/admin/v1/tenants", summary = "Creates a tenant.", tag = "tenants", request_body = crate::api::schema::TenantRequest,
    responses((status = 201, description = "The new tenant.", body = hearth_tenants::Tenant), crate::server::error::Errors))]
async fn create_tenant(
    State(gw): State<Arc<AppState>>,
    ClientOrigin(origin): ClientOrigin,
    body: Bytes,
) -> Result<Response, ApiError> {
    let name = name_field(&body, true)?;
    let t = gw.management().via(origin).create_tenant(&name).await?;
    Ok((StatusCode::CREATED, Json(t)).into_response())
}

#[utoipa::path(get, path = "/admin/v1/tenants/{tenant}/keys", summary = "A tenant's keys.", tag = "tenants", params(("tenant" = String, Path, description = "A tenant's name or id.")),
    responses((status = 200, description = "The tenant's keys (never their secrets).", body = crate::api::schema::List<hearth_tenants::ApiKeyInfo>), crate::server::error::Errors))]
async fn list_keys(State(gw): State<Arc<AppState>>, Path(tenant): Path<String>) -> Result<Json<Value>, ApiError> {
    let keys = gw.management().list_keys(Actor::Operator, Some(&tenant)).await?;
    Ok(Json(json!({"object": "list", "data": keys})))
}

#[utoipa::path(post, path = "/admin/v1/tenants/{tenant}/keys", summary = "Creates a key for a tenant.", tag = "tenants", params(("tenant" = String, Path, description = "A tenant's name or id.")), request_body = Option<crate::api::schema::KeyRequest>,
    responses((status = 201, description = "The key; `key` is shown only here.", body = hearth_tenants::CreatedKey), crate::server::error::Errors))]
async fn create_key(
    State(gw): State<Arc<AppState>>,
    ClientOrigin(origin): ClientOrigin,
    Path(tenant): Path<String>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let spec = key_spec(&body)?;
    let k = gw
        .management()
        .via(origin)
        .create_key(Actor::Operator, Some(&tenant), spec)
        .await?;
    Ok((StatusCode::CREATED, Json(k)).into_response())
}

#[utoipa::path(delete, path = "/admin/v1/keys/{key_id}", summary = "Revokes a key.", tag = "tenants", params(("key_id" = String, Path, description = "A key id.")),
    responses((status = 200, description = "The revoked key.", body = hearth_tenants::ApiKeyInfo), crate::server::error::Errors))]
async fn revoke_key(
    State(gw): State<Arc<AppState>>,
    ClientOrigin(origin): ClientOrigin,
    Path(key_id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let k = gw.management().via(origin).revoke_key(Actor::Operator, &key_id).await?;
    Ok(Json(json!(k)))
}

#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
struct UsageQuery {
    /// A tenant's name or id (default: every tenant).
    tenant: Option<String>,
    /// Rows to return, newest first: 1 to 10,000 (default 100).
    #[param(minimum = 1, maximum = 10000)]
    limit: Option<u32>,
}

#[utoipa::path(get, path = "/admin/v1/usage", summary = "The most recent usage records.", tag = "billing", params(UsageQuery),
    responses((status = 200, description = "The most recent usage records.", body = crate::api::schema::AnyObject), crate::server::error::Errors))]
async fn usage(
    State(gw): State<Arc<AppState>>,
    q: Result<Query<UsageQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<Value>, ApiError> {
    let Query(q) = q.map_err(|e| ApiError::invalid("query", e.body_text()))?;
    if q.limit.is_some_and(|l| !(1..=10_000).contains(&l)) {
        return Err(ApiError::invalid("limit", "'limit' must be between 1 and 10000"));
    }
    let tenant_id = match q.tenant {
        Some(t) => Some(gw.tenants.tenant(&t).await.map_err(store_error)?.id),
        None => None,
    };
    gw.ledger.flush().await;
    let rows = gw
        .ledger
        .recent(tenant_id.as_deref(), q.limit.unwrap_or(100).min(10_000))
        .await
        .map_err(ledger_error)?;
    Ok(Json(json!({"object": "list", "data": rows})))
}

#[utoipa::path(get, path = "/admin/v1/routing", summary = "Routing state per model.", tag = "models",
    responses((status = 200, description = "Per model: the policy, its workers with load and cached blocks, the decisions by reason, PD state.", body = crate::api::schema::AnyObject), crate::server::error::Errors))]
/// Routing state per model: policy, workers and their load, decisions, index size.
async fn routing(State(gw): State<Arc<AppState>>) -> Result<Json<Value>, ApiError> {
    let models: Vec<Value> = gw
        .models
        .all()
        .iter()
        .map(|m| {
            let r = m.router();
            let workers: Vec<Value> = r
                .workers()
                .map(|(slot, w)| {
                    let mut v = json!(w);
                    v["slot"] = json!(slot);
                    v["cached_blocks"] = json!(r.index.worker_blocks(slot));
                    v["disk_blocks"] = json!(r.index.worker_disk_blocks(slot));
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
                "fetch_min_tokens": r.cfg.fetch_min_tokens,
                "workers": workers, "decisions": decisions,
                "pd_threshold": m.pd_threshold,
                "pd": m.pd.snapshot().iter().map(|(k, v)| (k.to_string(), json!(v))).collect::<serde_json::Map<_, _>>(),
            })
        })
        .collect();
    Ok(Json(json!({"object": "list", "data": models})))
}

fn served_json(m: &crate::upstream::registry::ServedModel) -> Value {
    let workers: Vec<Value> = m
        .worker_states()
        .into_iter()
        .map(|(name, state)| json!({"worker": name, "state": state}))
        .collect();
    json!({
        "id": m.id, "context_length": m.context_length, "state": m.state(),
        "tenants": m.tenants, "workers": workers,
        "spread_loads": m.spreads.load(std::sync::atomic::Ordering::Relaxed),
    })
}

#[utoipa::path(get, path = "/admin/v1/models", summary = "Every model served, its state on each worker and who may see it.", tag = "models",
    responses((status = 200, description = "Every model served, its state on each worker and who may see it, and the catalogues (`catalogues`).", body = crate::api::schema::AnyObject), crate::server::error::Errors))]
/// Every model served, with its state on each worker and who may see it.
async fn list_models(State(gw): State<Arc<AppState>>) -> Json<Value> {
    let data: Vec<Value> = gw.models.all().iter().map(|m| served_json(m)).collect();
    let hosts: Vec<String> = gw.models.hosts().iter().map(|h| h.name().to_string()).collect();
    Json(json!({"object": "list", "data": data, "catalogues": hosts}))
}

#[utoipa::path(post, path = "/admin/v1/models", summary = "Adds a model to every worker catalogue and serves it.", tag = "models", request_body = hearth_protocol::ModelSpec,
    responses((status = 201, description = "Added to the catalogues that took it (`refused` lists the others).", body = crate::api::schema::AnyObject), crate::server::error::Errors))]
/// `POST /admin/v1/models` (a catalogue entry: `id`, `source`, `idle_ttl_s`, `min_warm`,
/// `context_length`, `memory_mib`, `tenants`): adds the model to every worker catalogue
/// and serves it. It loads on its first request (at once with `min_warm`). Refused (409)
/// if the id is served already; if no catalogue takes it, the first refusal is answered.
async fn add_model(
    State(gw): State<Arc<AppState>>,
    ClientOrigin(origin): ClientOrigin,
    body: Bytes,
) -> Result<Response, ApiError> {
    let spec: hearth_protocol::ModelSpec = serde_json::from_slice(&body).map_err(|e| {
        if e.is_syntax() || e.is_eof() {
            ApiError::malformed_json(e)
        } else {
            ApiError::invalid("model", format!("invalid model: {e}"))
        }
    })?;
    let body = add_catalogue_model(&gw, origin, spec).await?;
    Ok((StatusCode::CREATED, Json(body)).into_response())
}

/// Adds a model to every worker catalogue and serves it (the admin API's and the operator
/// console's); the answer's body, audited as `model.add`.
pub(crate) async fn add_catalogue_model(
    gw: &AppState,
    origin: crate::manage::Origin,
    spec: hearth_protocol::ModelSpec,
) -> Result<Value, ApiError> {
    spec.validate().map_err(|e| ApiError::invalid("model", e))?;
    if gw.models.get(&spec.id).is_some() {
        return Err(ApiError::conflict(format!("model {} is already served", spec.id)));
    }
    let hosts = gw.models.hosts();
    if hosts.is_empty() {
        return Err(ApiError::unsupported(
            "model",
            "no worker of this gateway has a catalogue: start workers with --catalogue to add models at runtime",
        ));
    }
    let mut added = Vec::new();
    let mut refusals = Vec::new();
    // Catalogues that did not take it (the others serve it): reported in the answer.
    let mut refused: Vec<Value> = Vec::new();
    for h in &hosts {
        match h.add_model(spec.clone()).await {
            Ok(v) => added.push((h.clone(), v)),
            Err(e) => {
                tracing::warn!(catalogue = h.name(), model = %spec.id, error = %e, "catalogue refused a model");
                refused.push(json!({"catalogue": h.name(), "error": e.to_string()}));
                refusals.push(e);
            }
        }
    }
    let Some(info) = added.first().map(|(_, (info, _))| info.clone()) else {
        return Err(refusals
            .into_iter()
            .next()
            .map_or_else(|| ApiError::internal("no catalogue answered"), host_change_error));
    };
    let regions = added
        .iter()
        .map(|(_, (i, _))| crate::upstream::registry::WorkerPlace::from(i))
        .collect();
    let clients = added.iter().map(|(_, (_, c))| c.clone()).collect();
    match gw.models.insert(info, clients, regions) {
        Ok(m) => {
            let mut body = served_json(&m);
            body["refused"] = json!(refused);
            let detail = json!({"source": spec.source, "tenants": spec.tenants, "refused": refused});
            gw.management()
                .via(origin)
                .audit(
                    Actor::Operator,
                    None,
                    "model.add",
                    &format!("model:{}", spec.id),
                    detail,
                )
                .await;
            Ok(body)
        }
        Err(e) => {
            // Added meanwhile by another request, or unusable (its tokenizer or template):
            // undo ours.
            for (h, _) in &added {
                let _ = h.remove_model(&spec.id).await;
            }
            Err(match e {
                crate::upstream::registry::RegistryError::Exists(_) => ApiError::conflict(e.to_string()),
                other => ApiError::invalid("source", other.to_string()),
            })
        }
    }
}

fn host_change_error(e: crate::upstream::workers::HostChangeError) -> ApiError {
    use crate::upstream::workers::HostChangeError;
    match e {
        HostChangeError::Refused {
            status: 409, message, ..
        } => ApiError::conflict(message),
        HostChangeError::Refused {
            status: 404, message, ..
        } => ApiError::not_found(message),
        HostChangeError::Refused {
            status: 401 | 403,
            message,
            ..
        } => ApiError::forbidden(message),
        HostChangeError::Refused { status, message, .. } if (400..500).contains(&status) => {
            ApiError::invalid("source", message)
        }
        other => ApiError::unavailable(other.to_string()),
    }
}

#[utoipa::path(delete, path = "/admin/v1/models/{model}", summary = "Stops serving a model and removes it from every catalogue.", tag = "models", params(("model" = String, Path, description = "A model id.")),
    responses((status = 200, description = "Removed (`errors` lists catalogues that failed to unload it).", body = crate::api::schema::AnyObject), crate::server::error::Errors))]
/// `DELETE /admin/v1/models/{id}`: stops serving the model and removes it from every
/// catalogue; requests in flight finish. A catalogue that could not remove it (it would
/// serve the model again after a restart) is listed in `errors`.
async fn remove_model(
    State(gw): State<Arc<AppState>>,
    ClientOrigin(origin): ClientOrigin,
    Path(model): Path<String>,
) -> Result<Json<Value>, ApiError> {
    remove_catalogue_model(&gw, origin, &model).await.map(Json)
}

/// Stops serving a model and removes it from every catalogue (requests in flight finish);
/// audited as `model.remove`.
pub(crate) async fn remove_catalogue_model(
    gw: &AppState,
    origin: crate::manage::Origin,
    model: &str,
) -> Result<Value, ApiError> {
    gw.models
        .remove(model)
        .ok_or_else(|| ApiError::model_not_found(model))?;
    let mut errors = Vec::new();
    for h in gw.models.hosts() {
        match h.remove_model(model).await {
            Ok(()) | Err(crate::upstream::workers::HostChangeError::Refused { status: 404, .. }) => {}
            Err(e) => errors.push(format!("{}: {e}", h.name())),
        }
    }
    gw.management()
        .via(origin)
        .audit(
            Actor::Operator,
            None,
            "model.remove",
            &format!("model:{model}"),
            json!({"errors": errors}),
        )
        .await;
    Ok(json!({"id": model, "deleted": true, "errors": errors}))
}

#[utoipa::path(post, path = "/admin/v1/routing/{model}/workers/{slot}/drain", summary = "Drains a worker (or undrains it).", tag = "models",
    params(("model" = String, Path, description = "A model id."), ("slot" = usize, Path, description = "The worker's slot in `GET /admin/v1/routing`.")),
    request_body(content = Option<crate::api::schema::DrainRequest>, description = "Empty: drain."),
    responses((status = 200, description = "`{\"model\", \"slot\", \"draining\"}`.", body = crate::api::schema::AnyObject), crate::server::error::Errors))]
/// `{"draining": true|false}`: a draining worker takes no new requests; running ones finish.
async fn drain(
    State(gw): State<Arc<AppState>>,
    ClientOrigin(origin): ClientOrigin,
    Path((model, slot)): Path<(String, usize)>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let draining = if body.is_empty() || body.trim_ascii() == b"null" {
        true
    } else {
        parse_object(&body)?
            .get("draining")
            .and_then(Value::as_bool)
            .unwrap_or(true)
    };
    let m = gw.models.get(&model).ok_or_else(|| ApiError::model_not_found(&model))?;
    let worker = {
        let mut r = m.router();
        let w = r
            .worker_mut(slot)
            .ok_or_else(|| ApiError::not_found(format!("model {model} has no worker {slot}")))?;
        w.draining = draining;
        w.name.clone()
    };
    let detail = json!({"slot": slot, "worker": worker, "draining": draining});
    gw.management()
        .via(origin)
        .audit(Actor::Operator, None, "worker.drain", &format!("model:{model}"), detail)
        .await;
    Ok(Json(json!({"model": model, "slot": slot, "draining": draining})))
}

/// `{"rpm": N|null, "tpm": N|null, "concurrent": N|null, "share": N|null,
/// "priority": "interactive"|"batch"|null}`; null or 0 is unlimited (share 1, interactive).
pub(crate) fn limits_body(body: &Bytes) -> Result<hearth_tenants::Limits, ApiError> {
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
    let priority =
        match o.get("priority") {
            None | Some(Value::Null) => None,
            Some(v) => Some(v.as_str().and_then(hearth_protocol::Priority::parse).ok_or_else(|| {
                ApiError::invalid("priority", "'priority' must be \"interactive\", \"batch\" or null")
            })?),
        };
    Ok(hearth_tenants::Limits {
        rpm: field("rpm")?,
        tpm: field("tpm")?,
        concurrent: field("concurrent")?,
        share: field("share")?,
        priority,
    })
}

#[utoipa::path(put, path = "/admin/v1/tenants/{tenant}/limits", summary = "Sets a tenant's limits, share and class.", tag = "tenants", params(("tenant" = String, Path, description = "A tenant's name or id.")), request_body = hearth_tenants::Limits,
    responses((status = 200, description = "The tenant's limits (null or 0: unlimited).", body = crate::api::schema::LimitsView), crate::server::error::Errors))]
async fn set_tenant_limits(
    State(gw): State<Arc<AppState>>,
    ClientOrigin(origin): ClientOrigin,
    Path(tenant): Path<String>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let l = limits_body(&body)?;
    let t = gw.management().via(origin).set_tenant_limits(&tenant, l).await?;
    Ok(Json(json!({"tenant": t.name, "limits": l})))
}

#[utoipa::path(get, path = "/admin/v1/tenants/{tenant}/limits", summary = "A tenant's limits.", tag = "tenants", params(("tenant" = String, Path, description = "A tenant's name or id.")),
    responses((status = 200, description = "The tenant's limits.", body = crate::api::schema::LimitsView), crate::server::error::Errors))]
async fn get_tenant_limits(
    State(gw): State<Arc<AppState>>,
    Path(tenant): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let l = gw.tenants.tenant_limits(&tenant).await.map_err(store_error)?;
    Ok(Json(json!({"tenant": tenant, "limits": l})))
}

#[utoipa::path(put, path = "/admin/v1/keys/{key_id}/limits", summary = "Sets a key's limits (`{id}` may be a JWT principal `jwt:ISSUER_ID:SUB`).", tag = "tenants", params(("key_id" = String, Path, description = "A key id.")), request_body = hearth_tenants::Limits,
    responses((status = 200, description = "The key's limits.", body = crate::api::schema::LimitsView), crate::server::error::Errors))]
async fn set_key_limits(
    State(gw): State<Arc<AppState>>,
    ClientOrigin(origin): ClientOrigin,
    Path(key_id): Path<String>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let l = limits_body(&body)?;
    gw.management().via(origin).set_key_limits(&key_id, l).await?;
    Ok(Json(json!({"key": key_id, "limits": l})))
}

/// A new key from `{"name", "scopes": ["inference","manage"], "models": [...],
/// "expires_in": seconds | "expires_at": unix ms}`; every field optional.
pub(crate) fn key_spec(body: &Bytes) -> Result<KeySpec, ApiError> {
    if body.is_empty() || body.trim_ascii() == b"null" {
        return Ok(KeySpec::default());
    }
    let o = parse_object(body)?;
    let mut spec = KeySpec {
        name: name_field(body, false)?,
        ..Default::default()
    };
    if o.get("name").and_then(Value::as_str) == Some("") {
        return Err(ApiError::invalid(
            "name",
            "'name' must not be empty (leave it out for none)",
        ));
    }
    match o.get("scopes") {
        None | Some(Value::Null) => {}
        Some(Value::Array(a)) => {
            let words: Vec<&str> = a.iter().filter_map(Value::as_str).collect();
            if words.len() != a.len() {
                return Err(ApiError::invalid("scopes", "'scopes' must be an array of strings"));
            }
            spec.scopes = Some(Scopes::parse(&words.join(",")).map_err(store_error)?);
        }
        Some(Value::String(s)) => spec.scopes = Some(Scopes::parse(s).map_err(store_error)?),
        Some(_) => return Err(ApiError::invalid("scopes", "'scopes' must be an array of strings")),
    }
    match o.get("models") {
        None | Some(Value::Null) => {}
        Some(Value::Array(a)) => {
            let m: Vec<String> = a.iter().filter_map(Value::as_str).map(str::to_string).collect();
            if m.len() != a.len() {
                return Err(ApiError::invalid("models", "'models' must be an array of model ids"));
            }
            spec.models = Some(m);
        }
        Some(_) => return Err(ApiError::invalid("models", "'models' must be an array of model ids")),
    }
    let int = |k: &str| -> Result<Option<i64>, ApiError> {
        match o.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_i64()
                .filter(|v| *v > 0)
                .map(Some)
                .ok_or_else(|| ApiError::invalid(k, format!("'{k}' must be a positive integer"))),
        }
    };
    spec.expires_at = match (int("expires_in")?, int("expires_at")?) {
        (Some(secs), None) => Some(now_ms().saturating_add(secs.saturating_mul(1000))),
        (None, at) => at,
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid(
                "expires_at",
                "give expires_in or expires_at, not both",
            ))
        }
    };
    Ok(spec)
}

#[utoipa::path(put, path = "/admin/v1/tenants/{tenant}/budget", summary = "Sets a tenant's monthly budget.", tag = "tenants", params(("tenant" = String, Path, description = "A tenant's name or id.")), request_body = crate::api::schema::BudgetRequest,
    responses((status = 200, description = "The budget.", body = crate::api::schema::BudgetView), crate::server::error::Errors))]
/// `{"monthly_usd": "12.50" | 12.5 | null, "mode": "hard"|"soft"}`.
async fn set_budget(
    State(gw): State<Arc<AppState>>,
    ClientOrigin(origin): ClientOrigin,
    Path(tenant): Path<String>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let o = parse_object(&body)?;
    let usd = match o.get("monthly_usd") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(Value::Number(n)) => Some(n.to_string()),
        Some(_) => return Err(ApiError::invalid("monthly_usd", "a USD amount like \"12.50\"")),
    };
    let mode = match o.get("mode") {
        None | Some(Value::Null) => None,
        Some(Value::String(m)) => Some(m.as_str()),
        Some(_) => return Err(ApiError::invalid("mode", "'mode' is hard or soft")),
    };
    let b = parse_budget(usd.as_deref(), mode)?;
    let t = gw.management().via(origin).set_budget(&tenant, b).await?;
    Ok(Json(budget_json(&t.name, b)))
}

/// A budget from its USD amount (none, empty or 0: no budget) and mode (`hard`, the
/// default, or `soft`), as the admin API and the dashboard take them.
pub(crate) fn parse_budget(usd: Option<&str>, mode: Option<&str>) -> Result<Option<Budget>, ApiError> {
    let hard = match mode {
        None | Some("hard") => true,
        Some("soft") => false,
        Some(_) => return Err(ApiError::invalid("mode", "'mode' is hard or soft")),
    };
    let Some(text) = usd.map(str::trim).filter(|s| !s.is_empty()) else {
        return Ok(None);
    };
    let monthly_nusd = parse_usd_micros(text)
        .and_then(|m| m.checked_mul(1000))
        .ok_or_else(|| ApiError::invalid("monthly_usd", "a USD amount like \"12.50\""))?;
    Ok((monthly_nusd > 0).then_some(Budget { monthly_nusd, hard }))
}

/// The budget as the admin API shows it (also `hearth admin tenant budget --json`).
pub fn budget_json(tenant: &str, b: Option<Budget>) -> Value {
    match b {
        Some(b) => {
            json!({"tenant": tenant, "budget": {"monthly_usd": format_nusd(b.monthly_nusd), "mode": if b.hard {"hard"} else {"soft"}}})
        }
        None => json!({"tenant": tenant, "budget": null}),
    }
}

#[utoipa::path(get, path = "/admin/v1/tenants/{tenant}/budget", summary = "A tenant's monthly budget.", tag = "tenants", params(("tenant" = String, Path, description = "A tenant's name or id.")),
    responses((status = 200, description = "The budget (null: none).", body = crate::api::schema::BudgetView), crate::server::error::Errors))]
async fn get_budget(State(gw): State<Arc<AppState>>, Path(tenant): Path<String>) -> Result<Json<Value>, ApiError> {
    let b = gw.tenants.budget(&tenant).await.map_err(store_error)?;
    Ok(Json(budget_json(&tenant, b)))
}

#[utoipa::path(get, path = "/admin/v1/tenants/{tenant}/jwt-issuers", summary = "A tenant's JWT issuers.", tag = "tenants", params(("tenant" = String, Path, description = "A tenant's name or id.")),
    responses((status = 200, description = "The tenant's JWT issuers.", body = crate::api::schema::List<hearth_tenants::jwt::IssuerInfo>), crate::server::error::Errors))]
async fn list_issuers(State(gw): State<Arc<AppState>>, Path(tenant): Path<String>) -> Result<Json<Value>, ApiError> {
    let is = gw.tenants.list_issuers(Some(&tenant)).await.map_err(store_error)?;
    Ok(Json(json!({"object": "list", "data": is})))
}

#[utoipa::path(post, path = "/admin/v1/tenants/{tenant}/jwt-issuers", summary = "Registers a JWT issuer for a tenant.", tag = "tenants", params(("tenant" = String, Path, description = "A tenant's name or id.")), request_body = hearth_tenants::jwt::IssuerSpec,
    responses((status = 201, description = "The registered issuer.", body = hearth_tenants::jwt::IssuerInfo), crate::server::error::Errors))]
/// `{"issuer", "audience", "algorithm", "key" | "jwks" | "jwks_url"}`.
async fn add_issuer(
    State(gw): State<Arc<AppState>>,
    ClientOrigin(origin): ClientOrigin,
    Path(tenant): Path<String>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let spec: IssuerSpec = serde_json::from_slice(&body).map_err(|e| ApiError::invalid("body", e.to_string()))?;
    let i = gw.management().via(origin).add_issuer(&tenant, &spec).await?;
    Ok((StatusCode::CREATED, Json(i)).into_response())
}

#[utoipa::path(delete, path = "/admin/v1/jwt-issuers/{id}", summary = "Removes a JWT issuer.", tag = "tenants", params(("id" = String, Path, description = "An issuer id.")),
    responses((status = 200, description = "The removed issuer.", body = hearth_tenants::jwt::IssuerInfo), crate::server::error::Errors))]
async fn remove_issuer(
    State(gw): State<Arc<AppState>>,
    ClientOrigin(origin): ClientOrigin,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let i = gw.management().via(origin).remove_issuer(&id).await?;
    Ok(Json(json!(i)))
}

#[utoipa::path(get, path = "/admin/v1/tenants/{tenant}/sso", summary = "A tenant's identity provider.", tag = "members", params(("tenant" = String, Path, description = "A tenant's name or id.")),
    responses((status = 200, description = "The tenant's OpenID Connect provider (null: none).", body = Option<hearth_tenants::sso::SsoProvider>), crate::server::error::Errors))]
async fn get_sso(State(gw): State<Arc<AppState>>, Path(tenant): Path<String>) -> Result<Json<Value>, ApiError> {
    let p = gw.tenants.sso(&tenant).await.map_err(store_error)?;
    Ok(Json(json!(p)))
}

#[utoipa::path(put, path = "/admin/v1/tenants/{tenant}/sso", summary = "Sets a tenant's identity provider.", tag = "members", params(("tenant" = String, Path, description = "A tenant's name or id.")), request_body = hearth_tenants::sso::SsoSpec,
    responses((status = 200, description = "The provider (never its secret). Its members then sign in at `/dashboard/sso?tenant=NAME`; register `<public URL>/dashboard/sso/callback` as the client's redirect URI.", body = hearth_tenants::sso::SsoProvider), crate::server::error::Errors))]
/// `{"issuer", "client_id", "client_secret"?}`.
async fn set_sso(
    State(gw): State<Arc<AppState>>,
    ClientOrigin(origin): ClientOrigin,
    Path(tenant): Path<String>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let spec: hearth_tenants::sso::SsoSpec =
        serde_json::from_slice(&body).map_err(|e| ApiError::invalid("body", e.to_string()))?;
    let p = gw.management().via(origin).set_sso(&tenant, &spec).await?;
    Ok(Json(json!(p)))
}

#[utoipa::path(delete, path = "/admin/v1/tenants/{tenant}/sso", summary = "Removes a tenant's identity provider.", tag = "members", params(("tenant" = String, Path, description = "A tenant's name or id.")),
    responses((status = 200, description = "The removed provider; members keep any password they set.", body = hearth_tenants::sso::SsoProvider), crate::server::error::Errors))]
async fn remove_sso(
    State(gw): State<Arc<AppState>>,
    ClientOrigin(origin): ClientOrigin,
    Path(tenant): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let p = gw.management().via(origin).remove_sso(&tenant).await?;
    Ok(Json(json!(p)))
}

#[utoipa::path(get, path = "/admin/v1/tenants/{tenant}/members", summary = "A tenant's members.", tag = "members", params(("tenant" = String, Path, description = "A tenant's name or id.")),
    responses((status = 200, description = "The tenant's members, by e-mail.", body = crate::api::schema::List<hearth_tenants::members::Member>), crate::server::error::Errors))]
async fn list_members(State(gw): State<Arc<AppState>>, Path(tenant): Path<String>) -> Result<Json<Value>, ApiError> {
    let (members, _) = gw.management().list_members(Actor::Operator, Some(&tenant)).await?;
    Ok(Json(json!({"object": "list", "data": members})))
}

#[utoipa::path(get, path = "/admin/v1/tenants/{tenant}/invitations", summary = "A tenant's open invitations.", tag = "members", params(("tenant" = String, Path, description = "A tenant's name or id.")),
    responses((status = 200, description = "The open invitations, newest first.", body = crate::api::schema::List<hearth_tenants::members::Invitation>), crate::server::error::Errors))]
async fn list_invitations(
    State(gw): State<Arc<AppState>>,
    Path(tenant): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let (_, invitations) = gw.management().list_members(Actor::Operator, Some(&tenant)).await?;
    Ok(Json(json!({"object": "list", "data": invitations})))
}

/// A role from a JSON body's `role`.
fn role_field(o: &serde_json::Map<String, Value>) -> Result<Role, ApiError> {
    let names = Role::ALL.map(Role::as_str).join(", ");
    match o.get("role") {
        Some(Value::String(r)) => {
            Role::parse(r).ok_or_else(|| ApiError::invalid("role", format!("'role' is one of {names}")))
        }
        _ => Err(ApiError::invalid("role", format!("'role' is required: one of {names}"))),
    }
}

#[utoipa::path(post, path = "/admin/v1/tenants/{tenant}/members", summary = "Invites a member.", tag = "members",
    description = "Creates an invitation link (shown once, valid 7 days). Whoever opens it chooses a password and becomes a member with the role. Inviting an address again replaces its open invitation.",
    params(("tenant" = String, Path, description = "A tenant's name or id.")), request_body = crate::api::schema::InviteRequest,
    responses((status = 201, description = "The invitation and its link.", body = crate::api::schema::CreatedInvitation), crate::server::error::Errors))]
async fn invite_member(
    State(gw): State<Arc<AppState>>,
    ClientOrigin(origin): ClientOrigin,
    headers: axum::http::HeaderMap,
    Path(tenant): Path<String>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let o = parse_object(&body)?;
    let email = match o.get("email") {
        Some(Value::String(e)) => e.clone(),
        _ => return Err(ApiError::invalid("email", "'email' is required")),
    };
    let role = role_field(&o)?;
    let (token, inv) = gw
        .management()
        .via(origin)
        .invite_member(Actor::Operator, Some(&tenant), &email, role)
        .await?;
    let url = gw.invite_link(&headers, &token);
    Ok((
        StatusCode::CREATED,
        Json(json!({"invitation": inv, "token": token, "url": url})),
    )
        .into_response())
}

#[utoipa::path(put, path = "/admin/v1/members/{id}/role", summary = "Changes a member's role.", tag = "members", params(("id" = String, Path, description = "A member id (`mb_…`).")), request_body = crate::api::schema::RoleRequest,
    responses((status = 200, description = "The member with its new role (its sessions use it from their next request).", body = hearth_tenants::members::Member), crate::server::error::Errors))]
async fn set_member_role(
    State(gw): State<Arc<AppState>>,
    ClientOrigin(origin): ClientOrigin,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let role = role_field(&parse_object(&body)?)?;
    let m = gw
        .management()
        .via(origin)
        .set_member_role(Actor::Operator, &id, role)
        .await?;
    Ok(Json(json!(m)))
}

#[utoipa::path(delete, path = "/admin/v1/members/{id}", summary = "Removes a member.", tag = "members", params(("id" = String, Path, description = "A member id (`mb_…`).")),
    responses((status = 200, description = "The removed member; its sessions have ended.", body = hearth_tenants::members::Member), crate::server::error::Errors))]
async fn remove_member(
    State(gw): State<Arc<AppState>>,
    ClientOrigin(origin): ClientOrigin,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let m = gw.management().via(origin).remove_member(Actor::Operator, &id).await?;
    Ok(Json(json!(m)))
}

#[utoipa::path(delete, path = "/admin/v1/invitations/{id}", summary = "Withdraws an invitation.", tag = "members", params(("id" = String, Path, description = "An invitation id (`inv_…`).")),
    responses((status = 200, description = "The withdrawn invitation; its link no longer works.", body = hearth_tenants::members::Invitation), crate::server::error::Errors))]
async fn revoke_invitation(
    State(gw): State<Arc<AppState>>,
    ClientOrigin(origin): ClientOrigin,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let i = gw
        .management()
        .via(origin)
        .revoke_invitation(Actor::Operator, &id)
        .await?;
    Ok(Json(json!(i)))
}

#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
struct PriceQuery {
    /// One model's versions (default: every model's).
    model: Option<String>,
}

#[utoipa::path(get, path = "/admin/v1/prices", summary = "Price versions.", tag = "billing", params(PriceQuery),
    responses((status = 200, description = "Price versions (micro-USD per million tokens).", body = crate::api::schema::List<hearth_billing::Price>), crate::server::error::Errors))]
async fn list_prices(
    State(gw): State<Arc<AppState>>,
    q: Result<Query<PriceQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<Value>, ApiError> {
    let Query(q) = q.map_err(|e| ApiError::invalid("query", e.body_text()))?;
    let ps = gw.ledger.prices(q.model.as_deref()).await.map_err(ledger_error)?;
    Ok(Json(json!({"object": "list", "data": ps})))
}

#[utoipa::path(post, path = "/admin/v1/prices", summary = "Adds a price version.", tag = "billing", request_body = crate::api::schema::PriceRequest,
    responses((status = 201, description = "The new price version.", body = hearth_billing::Price), crate::server::error::Errors))]
/// `{"model", "input", "cached_input", "output"}` in USD per million tokens (strings or
/// numbers), optional `"effective_from"` (Unix ms).
async fn set_price(
    State(gw): State<Arc<AppState>>,
    ClientOrigin(origin): ClientOrigin,
    body: Bytes,
) -> Result<Response, ApiError> {
    let o = parse_object(&body)?;
    let model = o
        .get("model")
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::invalid("model", "'model' is required (a model id, or *)"))?;
    let rate = |k: &str| -> Result<i64, ApiError> {
        let text = match o.get(k) {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Number(n)) => n.to_string(),
            _ => {
                return Err(ApiError::invalid(
                    k,
                    format!("'{k}' (USD per million tokens) is required"),
                ))
            }
        };
        parse_usd_micros(&text).ok_or_else(|| ApiError::invalid(k, format!("'{k}' must be a USD amount like \"0.15\"")))
    };
    // Processor time is optional (USD per CPU-second): left out, the model's current rate
    // carries over (free when it has none).
    let latest = gw.ledger.latest_rates(model).await.map_err(ledger_error)?;
    let processor = match o.get("processor") {
        None | Some(Value::Null) => latest.as_ref().map_or(0, |r| r.processor_micros_per_cpu_s),
        Some(_) => rate("processor")?,
    };
    // So does a batch's share of the price (half when the model never had one).
    let batch_percent = match o.get("batch_percent") {
        None | Some(Value::Null) => latest
            .as_ref()
            .map_or(hearth_billing::DEFAULT_BATCH_PERCENT, |r| r.batch_percent),
        Some(v) => v
            .as_i64()
            .filter(|p| (0..=100).contains(p))
            .ok_or_else(|| ApiError::invalid("batch_percent", "'batch_percent' is a percentage, 0 to 100"))?,
    };
    let rates = PriceRates {
        input_micros_per_mtok: rate("input")?,
        cached_input_micros_per_mtok: rate("cached_input")?,
        output_micros_per_mtok: rate("output")?,
        processor_micros_per_cpu_s: processor,
        batch_percent,
    };
    let from = match o.get("effective_from") {
        None | Some(Value::Null) => None,
        Some(v) => Some(
            v.as_i64()
                .ok_or_else(|| ApiError::invalid("effective_from", "Unix milliseconds"))?,
        ),
    };
    let p = gw.management().via(origin).set_price(model, rates, from).await?;
    Ok((StatusCode::CREATED, Json(p)).into_response())
}

#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub(crate) struct ExportQuery {
    /// A tenant's name or id (admin API; the self-service API exports the caller's).
    pub(crate) tenant: Option<String>,
    /// YYYY-MM-DD or Unix ms (inclusive); default: the start of this month.
    #[param(pattern = r"^([0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])|[0-9]{1,15})?$")]
    from: Option<String>,
    /// YYYY-MM-DD or Unix ms (exclusive); default: now.
    #[param(pattern = r"^([0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])|[0-9]{1,15})?$")]
    to: Option<String>,
    /// `csv` (default), `jsonl` or `parquet`.
    #[param(pattern = "^(csv|jsonl|parquet)$")]
    format: Option<String>,
    /// `request` (default: one line per request) or `day`.
    #[param(pattern = "^(request|day)$")]
    granularity: Option<String>,
}

/// `GET /v1/tenant/usage`'s query, as documented (the window only).
#[derive(utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[allow(dead_code)]
pub(crate) struct WindowParams {
    /// YYYY-MM-DD or Unix ms (inclusive); default: the start of this month.
    #[param(pattern = r"^([0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])|[0-9]{1,15})?$")]
    from: Option<String>,
    /// YYYY-MM-DD or Unix ms (exclusive); default: now.
    #[param(pattern = r"^([0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])|[0-9]{1,15})?$")]
    to: Option<String>,
}

impl ExportQuery {
    pub(crate) fn window(&self) -> Result<Window, ApiError> {
        Ok(Window::parse(self.from.as_deref(), self.to.as_deref())?)
    }
}

/// A tenant's export as a download; totals in `x-hearth-export-*` headers.
pub(crate) async fn export_response(gw: &AppState, actor: Actor<'_>, q: &ExportQuery) -> Result<Response, ApiError> {
    let f = gw
        .management()
        .export(
            actor,
            q.tenant.as_deref(),
            q.window()?,
            q.format.as_deref(),
            q.granularity.as_deref(),
        )
        .await?;
    let (e, t) = (&f.export, &f.export.totals);
    let headers = [
        ("x-hearth-export-lines", e.lines.to_string()),
        ("x-hearth-export-requests", t.requests.to_string()),
        (
            "x-hearth-export-uncached-input-tokens",
            t.uncached_input_tokens.to_string(),
        ),
        ("x-hearth-export-cached-input-tokens", t.cached_input_tokens.to_string()),
        ("x-hearth-export-output-tokens", t.output_tokens.to_string()),
        ("x-hearth-export-processor-us", t.processor_us.to_string()),
        ("x-hearth-export-cost-input-nusd", t.cost_input_nusd.to_string()),
        ("x-hearth-export-cost-cached-nusd", t.cost_cached_nusd.to_string()),
        ("x-hearth-export-cost-output-nusd", t.cost_output_nusd.to_string()),
        ("x-hearth-export-cost-processor-nusd", t.cost_processor_nusd.to_string()),
        ("x-hearth-export-cost-nusd", t.cost_nusd.to_string()),
        ("x-hearth-export-cost-usd", format_nusd(t.cost_nusd)),
    ];
    let mut resp = (
        [
            (header::CONTENT_TYPE, f.format.content_type().to_string()),
            (
                header::CONTENT_DISPOSITION,
                format!("attachment; filename=\"{}\"", f.file_name),
            ),
        ],
        f.export.bytes,
    )
        .into_response();
    let h = resp.headers_mut();
    for (k, v) in headers {
        if let Ok(v) = axum::http::HeaderValue::from_str(&v) {
            h.insert(k, v);
        }
    }
    Ok(resp)
}

#[utoipa::path(get, path = "/admin/v1/billing/export", summary = "A tenant's billing export (or every tenant's).", tag = "billing", params(ExportQuery),
    responses((status = 200, description = "The billing export as a download (CSV, JSON lines or Parquet); totals in `x-hearth-export-*` headers.", content(("text/csv"), ("application/x-ndjson"), ("application/vnd.apache.parquet"))), crate::server::error::Errors))]
async fn billing_export(
    State(gw): State<Arc<AppState>>,
    q: Result<Query<ExportQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(q) = q.map_err(|e| ApiError::invalid("query", e.body_text()))?;
    export_response(&gw, Actor::Operator, &q).await
}

// ---- processors ------------------------------------------------------------------------

/// Uploads may be large (language runtimes are 10-20 MB components).
pub(crate) fn upload_limit() -> axum::extract::DefaultBodyLimit {
    axum::extract::DefaultBodyLimit::max(hearth_tenants::processors::MAX_PROCESSOR_BYTES + (1 << 20))
}

#[derive(Deserialize, Default, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub(crate) struct UploadQuery {
    /// The processor's name (required); a new upload under a name is its next version.
    #[param(required = true, min_length = 1)]
    name: Option<String>,
    /// JSON for the guest's `host.config` (default `{}`).
    config: Option<String>,
    /// Activate it at once (default false).
    activate: Option<bool>,
    /// Run it only for this key's requests (default: every request of the tenant).
    key_id: Option<String>,
    /// Its place in the chain (lower runs first).
    position: Option<i64>,
    /// CPU time per call, in ms (default and ceiling: the gateway's).
    cpu_ms: Option<u32>,
    /// Memory, in MiB (default and ceiling: the gateway's).
    memory_mib: Option<u32>,
}

impl UploadQuery {
    pub(crate) fn upload(self) -> Result<Upload, ApiError> {
        Ok(Upload {
            name: self
                .name
                .filter(|n| !n.is_empty())
                .ok_or_else(|| ApiError::invalid("name", "'name' is required (query parameter)"))?,
            config: self.config,
            activate: self.activate.unwrap_or(false),
            key_id: self.key_id,
            position: self.position,
            cpu_ms: self.cpu_ms,
            memory_mib: self.memory_mib,
        })
    }
}

#[utoipa::path(post, path = "/admin/v1/tenants/{tenant}/processors", summary = "Uploads a processor version for a tenant (the body is the component).", tag = "processors", params(("tenant" = String, Path, description = "A tenant's name or id."), UploadQuery),
    request_body(content = crate::api::schema::Wasm, content_type = "application/wasm", description = "The processor, a WebAssembly component (or core module)."),
    responses((status = 201, description = "The stored version.", body = hearth_tenants::processors::ProcessorInfo), crate::server::error::Errors))]
async fn upload_processor(
    State(gw): State<Arc<AppState>>,
    ClientOrigin(origin): ClientOrigin,
    Path(tenant): Path<String>,
    q: Result<Query<UploadQuery>, axum::extract::rejection::QueryRejection>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let Query(q) = q.map_err(|e| ApiError::invalid("query", e.body_text()))?;
    let p = gw
        .management()
        .via(origin)
        .upload_processor(Actor::Operator, Some(&tenant), q.upload()?, body.to_vec())
        .await?;
    Ok((StatusCode::CREATED, Json(p)).into_response())
}

#[utoipa::path(get, path = "/admin/v1/tenants/{tenant}/processors", summary = "A tenant's processor versions.", tag = "processors", params(("tenant" = String, Path, description = "A tenant's name or id.")),
    responses((status = 200, description = "The tenant's processor versions.", body = crate::api::schema::List<hearth_tenants::processors::ProcessorInfo>), crate::server::error::Errors))]
async fn list_processors(State(gw): State<Arc<AppState>>, Path(tenant): Path<String>) -> Result<Json<Value>, ApiError> {
    let ps = gw.management().list_processors(Actor::Operator, Some(&tenant)).await?;
    Ok(Json(json!({"object": "list", "data": ps})))
}

#[utoipa::path(post, path = "/admin/v1/processors/{id}/activate", summary = "Activates a processor version.", tag = "processors", params(("id" = String, Path, description = "A processor id.")),
    responses((status = 200, description = "The processor, active.", body = hearth_tenants::processors::ProcessorInfo), crate::server::error::Errors))]
async fn activate_processor(
    State(gw): State<Arc<AppState>>,
    ClientOrigin(origin): ClientOrigin,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    Ok(Json(json!(
        gw.management()
            .via(origin)
            .set_processor_active(Actor::Operator, &id, true)
            .await?
    )))
}

#[utoipa::path(post, path = "/admin/v1/processors/{id}/deactivate", summary = "Deactivates a processor version.", tag = "processors", params(("id" = String, Path, description = "A processor id.")),
    responses((status = 200, description = "The processor, inactive.", body = hearth_tenants::processors::ProcessorInfo), crate::server::error::Errors))]
async fn deactivate_processor(
    State(gw): State<Arc<AppState>>,
    ClientOrigin(origin): ClientOrigin,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    Ok(Json(json!(
        gw.management()
            .via(origin)
            .set_processor_active(Actor::Operator, &id, false)
            .await?
    )))
}

/// `{"key_id": "…"}` attaches to one key; `{"key_id": null}` to the whole tenant.
pub(crate) fn attachment_body(body: &Bytes) -> Result<Option<String>, ApiError> {
    let o = parse_object(body)?;
    match o.get("key_id") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(ApiError::invalid("key_id", "'key_id' is a key id or null")),
    }
}

#[utoipa::path(put, path = "/admin/v1/processors/{id}/attachment", summary = "Runs a processor for one key's requests, or for the whole tenant's.", tag = "processors", params(("id" = String, Path, description = "A processor id.")), request_body = crate::api::schema::AttachmentRequest,
    responses((status = 200, description = "The processor, attached.", body = hearth_tenants::processors::ProcessorInfo), crate::server::error::Errors))]
async fn attach_processor(
    State(gw): State<Arc<AppState>>,
    ClientOrigin(origin): ClientOrigin,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let key = attachment_body(&body)?;
    let p = gw
        .management()
        .via(origin)
        .attach_processor(Actor::Operator, &id, key.as_deref())
        .await?;
    Ok(Json(json!(p)))
}

#[utoipa::path(delete, path = "/admin/v1/processors/{id}", summary = "Deletes a processor version.", tag = "processors", params(("id" = String, Path, description = "A processor id.")),
    responses((status = 200, description = "The deleted processor.", body = hearth_tenants::processors::ProcessorInfo), crate::server::error::Errors))]
async fn delete_processor(
    State(gw): State<Arc<AppState>>,
    ClientOrigin(origin): ClientOrigin,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    Ok(Json(json!(
        gw.management()
            .via(origin)
            .delete_processor(Actor::Operator, &id)
            .await?
    )))
}

// ---- adapters --------------------------------------------------------------------------

#[utoipa::path(post, path = "/admin/v1/tenants/{tenant}/adapters", summary = "Uploads a LoRA adapter version for a tenant.", tag = "adapters", params(("tenant" = String, Path, description = "A tenant's name or id.")),
    request_body(content = crate::manage::adapters::UploadForm, content_type = "multipart/form-data", description = "`base_model`, `name`, and the adapter's files as `file` parts."),
    responses((status = 201, description = "The stored version.", body = hearth_tenants::adapters::AdapterInfo), crate::server::error::Errors))]
async fn upload_adapter(
    State(gw): State<Arc<AppState>>,
    ClientOrigin(origin): ClientOrigin,
    Path(tenant): Path<String>,
    form: crate::manage::adapters::Form,
) -> Result<Response, ApiError> {
    let up = crate::manage::adapters::read_form(form).await?;
    let a = gw
        .management()
        .via(origin)
        .upload_adapter(Actor::Operator, Some(&tenant), up)
        .await?;
    Ok((StatusCode::CREATED, Json(a)).into_response())
}

#[utoipa::path(get, path = "/admin/v1/tenants/{tenant}/adapters", summary = "A tenant's adapter versions.", tag = "adapters", params(("tenant" = String, Path, description = "A tenant's name or id.")),
    responses((status = 200, description = "The tenant's adapter versions.", body = crate::api::schema::List<hearth_tenants::adapters::AdapterInfo>), crate::server::error::Errors))]
async fn list_adapters(State(gw): State<Arc<AppState>>, Path(tenant): Path<String>) -> Result<Json<Value>, ApiError> {
    let a = gw.management().list_adapters(Actor::Operator, Some(&tenant)).await?;
    Ok(Json(json!({"object": "list", "data": a})))
}

#[utoipa::path(delete, path = "/admin/v1/adapters/{id}", summary = "Deletes an adapter version.", tag = "adapters", params(("id" = String, Path, description = "An adapter version's id.")),
    responses((status = 200, description = "The deleted version.", body = hearth_tenants::adapters::AdapterInfo), crate::server::error::Errors))]
async fn delete_adapter(
    State(gw): State<Arc<AppState>>,
    ClientOrigin(origin): ClientOrigin,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    Ok(Json(json!(
        gw.management().via(origin).delete_adapter(Actor::Operator, &id).await?
    )))
}

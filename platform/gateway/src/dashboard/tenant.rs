//! A tenant's pages: overview, requests, keys, processors, adapters, batches, exports,
//! audit.
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use axum::{Form, Json};
use hearth_billing::{format_nusd, month_of};
use hearth_tenants::{now_ms, KeySpec, Scopes};
use minijinja::context;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::manage::{Actor, Permission, Upload};
use crate::server::error::ApiError;
use crate::state::AppState;

use super::session::{csrf_ok, operator_only, same_origin, CsrfForm, Visitor};
use super::views;
use super::{page, PageError};

#[derive(Deserialize, Default)]
pub(super) struct RangeQuery {
    range: Option<String>,
}

pub(super) async fn overview(gw: &AppState, v: &Visitor, q: &RangeQuery) -> Result<Response, PageError> {
    let ctx = v.tenant()?;
    let range = views::Range::parse(q.range.as_deref());
    let now = now_ms();
    let (from, to) = range.window(now);
    // The same ledger rows as `GET /v1/tenant/usage`, after pending records are written.
    gw.ledger.flush().await;
    let rows = gw
        .ledger
        .rows(&ctx.tenant_id, from, to)
        .await
        .map_err(crate::server::error::ledger_error)?;
    let prices = gw
        .ledger
        .prices(None)
        .await
        .map_err(crate::server::error::ledger_error)?;
    let view = views::usage_view(&rows, &prices, range, now);
    let month = month_of(now);
    let spent = gw
        .ledger
        .month_spend(&ctx.tenant_id, &month)
        .await
        .map_err(crate::server::error::ledger_error)?;
    let budget = ctx.budget.map(|b| {
        json!({
            "monthly_usd": format_nusd(b.monthly_nusd), "mode": if b.hard {"hard"} else {"soft"},
            "used": format!("{:.1} %", spent as f64 * 100.0 / b.monthly_nusd.max(1) as f64),
        })
    });
    let limits = |l: hearth_tenants::Limits| {
        json!({
            "rpm": l.rpm, "tpm": l.tpm, "concurrent": l.concurrent, "share": l.share,
            "priority": l.priority.map(|p| p.as_str()),
        })
    };
    // The Responses API's stored responses, against the tenant's byte quota.
    let (count, bytes) = gw
        .tenants
        .response_usage(&ctx.tenant_id)
        .await
        .map_err(crate::server::error::store_error)?;
    let mib = |b: u64| format!("{:.1}", b as f64 / f64::from(1 << 20));
    let stored = json!({
        "count": count, "mib": mib(bytes),
        "quota_mib": mib(gw.response_retention.max_tenant_bytes),
    });
    Ok(page(
        StatusCode::OK,
        "overview.html",
        context! {
            base => v.base(), page => "overview", usage => view, stored => stored,
            month => month, spent_usd => format_nusd(spent), budget => budget,
            tenant_limits => limits(ctx.tenant_limits), key_limits => limits(ctx.key_limits),
            from => from, to => to,
        },
    ))
}

pub(super) async fn requests(v: Visitor, State(gw): State<Arc<AppState>>) -> Result<Response, PageError> {
    let ctx = v.tenant()?;
    gw.ledger.flush().await;
    let rows = gw
        .ledger
        .recent(Some(&ctx.tenant_id), 100)
        .await
        .map_err(crate::server::error::ledger_error)?;
    let data: Vec<Value> = rows
        .iter()
        .map(|r| {
            json!({
                "id": r.rec.request_id, "at": r.rec.started_at, "model": r.rec.model, "adapter": r.rec.adapter,
                "status": r.rec.status, "finish_reason": r.rec.finish_reason, "error": r.rec.error_code,
                "prompt": r.rec.prompt_tokens, "cached": r.rec.cached_tokens, "completion": r.rec.completion_tokens,
                "cost_usd": format_nusd(r.cost.total_nusd), "ttft_ms": r.rec.ttft_ms,
                "latency_ms": r.rec.finished_at - r.rec.started_at, "key_id": r.rec.key_id,
            })
        })
        .collect();
    Ok(page(
        StatusCode::OK,
        "requests.html",
        context! {base => v.base(), page => "requests", rows => data},
    ))
}

pub(super) async fn keys(v: Visitor, State(gw): State<Arc<AppState>>) -> Result<Response, PageError> {
    v.tenant()?;
    let list = gw.management().list_keys(v.actor(), None).await?;
    let now = now_ms();
    let data: Vec<Value> = list
        .iter()
        .map(|k| {
            let state = if k.revoked_at.is_some() {
                "revoked"
            } else if k.expires_at.is_some_and(|e| e <= now) {
                "expired"
            } else {
                "active"
            };
            json!({
                "id": k.id, "name": k.name, "scopes": k.scopes.join(", "),
                "models": k.models.as_ref().map_or("all".to_string(), |m| m.join(", ")),
                "created_at": k.created_at, "expires_at": k.expires_at, "state": state,
                "current": v.tenant().is_ok_and(|t| t.key_id == k.id),
            })
        })
        .collect();
    Ok(page(
        StatusCode::OK,
        "keys.html",
        context! {base => v.base(), page => "keys", keys => data},
    ))
}

#[derive(Deserialize)]
pub(super) struct NewKeyForm {
    pub(super) csrf: Option<String>,
    pub(super) name: Option<String>,
    pub(super) scope_inference: Option<String>,
    pub(super) scope_manage: Option<String>,
    pub(super) models: Option<String>,
    pub(super) expires_days: Option<String>,
}

pub(super) async fn create_key(
    v: Visitor,
    State(gw): State<Arc<AppState>>,
    headers: HeaderMap,
    Form(f): Form<NewKeyForm>,
) -> Result<Response, PageError> {
    csrf_ok(&gw, &v, &headers, f.csrf.as_deref())?;
    v.tenant()?;
    let spec = key_spec(f)?;
    let created = gw
        .management()
        .via(v.origin.clone())
        .create_key(v.actor(), None, spec)
        .await?;
    Ok(page(
        StatusCode::CREATED,
        "key_created.html",
        context! {base => v.base(), page => "keys", key => created.key, id => created.info.id, name => created.info.name},
    ))
}

/// The key a key form describes.
pub(super) fn key_spec(f: NewKeyForm) -> Result<KeySpec, ApiError> {
    let models: Vec<String> = f
        .models
        .as_deref()
        .unwrap_or("")
        .split([',', ' ', '\n'])
        .map(str::trim)
        .filter(|m| !m.is_empty())
        .map(str::to_string)
        .collect();
    let expires_at = match f.expires_days.as_deref().map(str::trim).filter(|d| !d.is_empty()) {
        None => None,
        Some(d) => match d.parse::<u32>() {
            Ok(days) if (1..=3650).contains(&days) => Some(now_ms() + i64::from(days) * views::DAY_MS),
            _ => {
                return Err(ApiError::invalid(
                    "expires_days",
                    "expiry must be 1 to 3650 days, or empty",
                ))
            }
        },
    };
    let scopes = Scopes {
        inference: f.scope_inference.is_some(),
        manage: f.scope_manage.is_some(),
    };
    if scopes == Scopes::default() {
        return Err(ApiError::invalid("scopes", "choose at least one scope"));
    }
    Ok(KeySpec {
        name: f.name.unwrap_or_default().trim().to_string(),
        scopes: Some(scopes),
        models: (!models.is_empty()).then_some(models),
        expires_at,
    })
}

pub(super) async fn revoke_key(
    v: Visitor,
    State(gw): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(id): Path<String>,
    Form(f): Form<CsrfForm>,
) -> Result<Response, PageError> {
    csrf_ok(&gw, &v, &headers, f.csrf.as_deref())?;
    v.tenant()?;
    gw.management().via(v.origin.clone()).revoke_key(v.actor(), &id).await?;
    Ok(Redirect::to("/dashboard/keys").into_response())
}

pub(super) async fn processors(v: Visitor, State(gw): State<Arc<AppState>>) -> Result<Response, PageError> {
    v.tenant()?;
    processors_page(&gw, &v, v.actor(), None).await
}

/// `GET /dashboard/tenants/{tenant}/processors`: a tenant's processors, for the operator.
pub(super) async fn tenant_processors(
    v: Visitor,
    State(gw): State<Arc<AppState>>,
    Path(tenant): Path<String>,
) -> Result<Response, PageError> {
    operator_only(&v)?;
    let t = gw
        .tenants
        .tenant(&tenant)
        .await
        .map_err(crate::server::error::store_error)?;
    processors_page(&gw, &v, Actor::Operator, Some(&t)).await
}

/// The processors page: the visitor's own tenant's, or (`tenant`) one the operator opened.
async fn processors_page(
    gw: &AppState,
    v: &Visitor,
    actor: Actor<'_>,
    tenant: Option<&hearth_tenants::Tenant>,
) -> Result<Response, PageError> {
    let enabled = gw.processors.is_some();
    let tenant_id = tenant.map(|t| t.id.as_str());
    let list = gw.management().list_processors(actor, tenant_id).await?;
    let keys: Vec<Value> = gw
        .management()
        .list_keys(actor, tenant_id)
        .await?
        .iter()
        .filter(|k| k.revoked_at.is_none())
        .map(|k| json!({"id": k.id, "name": k.name}))
        .collect();
    Ok(page(
        StatusCode::OK,
        "processors.html",
        context! {
            base => v.base(), page => "processors", processors => list, keys => keys, enabled => enabled,
            tenant => tenant,
            prefix => tenant.map_or("/dashboard".to_string(), |t| format!("/dashboard/tenants/{}", t.id)),
        },
    ))
}

#[derive(Deserialize)]
pub(super) struct UploadQuery {
    name: Option<String>,
    activate: Option<bool>,
}

/// The dashboard's upload: the component as the raw body (sent by `app.js` with the CSRF
/// header); answers JSON like the API.
pub(super) async fn upload_processor(
    v: Visitor,
    State(gw): State<Arc<AppState>>,
    headers: HeaderMap,
    q: Result<Query<UploadQuery>, axum::extract::rejection::QueryRejection>,
    body: Bytes,
) -> Result<Response, ApiError> {
    csrf_ok(&gw, &v, &headers, None)?;
    let Query(q) = q.map_err(|e| ApiError::invalid("query", e.body_text()))?;
    if !v.is_tenant() {
        return Err(ApiError::forbidden(
            "the operator uploads a tenant's processors from its page (/dashboard/tenants/{tenant}/processors)",
        ));
    }
    upload(&gw, &v, v.actor(), None, q, body).await
}

/// `POST /dashboard/tenants/{tenant}/processors`: the operator uploads a tenant's processor.
pub(super) async fn tenant_upload_processor(
    v: Visitor,
    State(gw): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(tenant): Path<String>,
    q: Result<Query<UploadQuery>, axum::extract::rejection::QueryRejection>,
    body: Bytes,
) -> Result<Response, ApiError> {
    csrf_ok(&gw, &v, &headers, None)?;
    let Query(q) = q.map_err(|e| ApiError::invalid("query", e.body_text()))?;
    if v.is_tenant() {
        return Err(ApiError::forbidden("this page is the operator's"));
    }
    let t = gw
        .tenants
        .tenant(&tenant)
        .await
        .map_err(crate::server::error::store_error)?;
    upload(&gw, &v, Actor::Operator, Some(&t.id), q, body).await
}

async fn upload(
    gw: &AppState,
    v: &Visitor,
    actor: Actor<'_>,
    tenant: Option<&str>,
    q: UploadQuery,
    body: Bytes,
) -> Result<Response, ApiError> {
    let up = Upload {
        name: q.name.unwrap_or_default(),
        activate: q.activate.unwrap_or(false),
        ..Default::default()
    };
    let p = gw
        .management()
        .via(v.origin.clone())
        .upload_processor(actor, tenant, up, body.to_vec())
        .await?;
    Ok((StatusCode::CREATED, Json(p)).into_response())
}

#[derive(Deserialize)]
pub(super) struct ProcessorForm {
    csrf: Option<String>,
    key_id: Option<String>,
}

pub(super) async fn processor_action(
    v: Visitor,
    State(gw): State<Arc<AppState>>,
    headers: HeaderMap,
    Path((id, action)): Path<(String, String)>,
    Form(f): Form<ProcessorForm>,
) -> Result<Response, PageError> {
    csrf_ok(&gw, &v, &headers, f.csrf.as_deref())?;
    v.tenant()?;
    act_on_processor(&gw, &v, v.actor(), &id, &action, f).await?;
    Ok(Redirect::to("/dashboard/processors").into_response())
}

/// `POST /dashboard/tenants/{tenant}/processors/{id}/{action}`: the operator's.
pub(super) async fn tenant_processor_action(
    v: Visitor,
    State(gw): State<Arc<AppState>>,
    headers: HeaderMap,
    Path((tenant, id, action)): Path<(String, String, String)>,
    Form(f): Form<ProcessorForm>,
) -> Result<Response, PageError> {
    csrf_ok(&gw, &v, &headers, f.csrf.as_deref())?;
    operator_only(&v)?;
    let t = gw
        .tenants
        .tenant(&tenant)
        .await
        .map_err(crate::server::error::store_error)?;
    let p = gw
        .tenants
        .processor(&id)
        .await
        .map_err(crate::server::error::store_error)?;
    if p.tenant_id != t.id {
        return Err(ApiError::not_found(format!("processor {id:?} does not exist")).into());
    }
    act_on_processor(&gw, &v, Actor::Operator, &id, &action, f).await?;
    Ok(Redirect::to(&format!("/dashboard/tenants/{}/processors", t.id)).into_response())
}

async fn act_on_processor(
    gw: &AppState,
    v: &Visitor,
    actor: Actor<'_>,
    id: &str,
    action: &str,
    f: ProcessorForm,
) -> Result<(), PageError> {
    let m = gw.management().via(v.origin.clone());
    match action {
        "activate" => m.set_processor_active(actor, id, true).await.map(drop),
        "deactivate" => m.set_processor_active(actor, id, false).await.map(drop),
        "delete" => m.delete_processor(actor, id).await.map(drop),
        "attach" => {
            let key = f.key_id.filter(|k| !k.is_empty());
            m.attach_processor(actor, id, key.as_deref()).await.map(drop)
        }
        _ => return Err(ApiError::not_found(format!("no processor action {action:?}")).into()),
    }?;
    Ok(())
}

/// `GET /dashboard/adapters`: the tenant's LoRA adapters, and the upload form.
pub(super) async fn adapters(v: Visitor, State(gw): State<Arc<AppState>>) -> Result<Response, PageError> {
    let t = v.tenant()?;
    let list = gw.management().list_adapters(v.actor(), None).await?;
    let models: Vec<String> = gw
        .models
        .all()
        .iter()
        .filter(|m| m.visible_to(t) && t.allows_model(&m.id))
        .map(|m| m.id.clone())
        .collect();
    Ok(page(
        StatusCode::OK,
        "adapters.html",
        context! {
            base => v.base(), page => "adapters", adapters => list, models => models,
            enabled => gw.adapter_dir.is_some(),
        },
    ))
}

/// `POST /dashboard/adapters`: the upload form (`multipart/form-data`, the CSRF token a
/// field of it).
pub(super) async fn upload_adapter(
    v: Visitor,
    State(gw): State<Arc<AppState>>,
    headers: HeaderMap,
    form: crate::manage::adapters::Form,
) -> Result<Response, PageError> {
    // The origin before the form is read; the token (a field of the form) once it is.
    if !same_origin(&gw, &headers) {
        return Err(ApiError::permission("csrf_failed", "This request did not come from a dashboard page.").into());
    }
    let (up, csrf) = crate::manage::adapters::read_form_with_csrf(form).await?;
    csrf_ok(&gw, &v, &headers, csrf.as_deref())?;
    v.tenant()?;
    gw.management()
        .via(v.origin.clone())
        .upload_adapter(v.actor(), None, up)
        .await?;
    Ok(Redirect::to("/dashboard/adapters").into_response())
}

pub(super) async fn delete_adapter(
    v: Visitor,
    State(gw): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(id): Path<String>,
    Form(f): Form<CsrfForm>,
) -> Result<Response, PageError> {
    csrf_ok(&gw, &v, &headers, f.csrf.as_deref())?;
    v.tenant()?;
    gw.management()
        .via(v.origin.clone())
        .delete_adapter(v.actor(), &id)
        .await?;
    Ok(Redirect::to("/dashboard/adapters").into_response())
}

/// `GET /dashboard/batches`: the tenant's batches with progress and cost so far.
pub(super) async fn batches(v: Visitor, State(gw): State<Arc<AppState>>) -> Result<Response, PageError> {
    let t = v.tenant()?;
    v.actor().require(Permission::Read)?;
    let list = crate::routes::batches::tenant_batches(&gw, t).await?;
    Ok(page(
        StatusCode::OK,
        "batches.html",
        context! { base => v.base(), page => "batches", batches => list },
    ))
}

pub(super) async fn cancel_batch(
    v: Visitor,
    State(gw): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(id): Path<String>,
    Form(f): Form<CsrfForm>,
) -> Result<Response, PageError> {
    csrf_ok(&gw, &v, &headers, f.csrf.as_deref())?;
    let t = v.tenant()?;
    gw.management()
        .via(v.origin.clone())
        .cancel_batch(v.actor(), &t.tenant_id, &id)
        .await?;
    Ok(Redirect::to("/dashboard/batches").into_response())
}

/// `GET /dashboard/files/{id}`: a batch's output or error file (or an input), downloaded.
pub(super) async fn download_file(
    v: Visitor,
    State(gw): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<Response, PageError> {
    let t = v.tenant()?;
    v.actor().require(Permission::ManageKeys)?;
    // A model-restricted key's session downloads only its own (see `auth::own_objects`).
    crate::routes::batches::visible_file(t, gw.tenants.file(&t.tenant_id, &id).await)?;
    let (f, bytes) = gw
        .tenants
        .file_content(&t.tenant_id, &id)
        .await
        .map_err(crate::server::error::store_error)?;
    Ok(crate::routes::batches::download(&f, bytes))
}

/// The billing export, exactly as `GET /v1/tenant/usage/export` renders it.
pub(super) async fn export(
    v: Visitor,
    State(gw): State<Arc<AppState>>,
    q: Result<Query<crate::routes::admin::ExportQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, PageError> {
    v.tenant()?;
    let Query(q) = q.map_err(|e| ApiError::invalid("query", e.body_text()))?;
    Ok(crate::routes::admin::export_response(&gw, v.actor(), &q).await?)
}

pub(super) async fn audit(v: Visitor, State(gw): State<Arc<AppState>>) -> Result<Response, PageError> {
    let entries = gw.management().audit_log(v.actor(), None, 200).await?;
    Ok(page(
        StatusCode::OK,
        "audit.html",
        context! {base => v.base(), page => "audit", entries => entries},
    ))
}

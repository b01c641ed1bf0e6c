//! The operator's console: tenants, prices, models, and one tenant's page with its actions.
use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use axum::Form;
use hearth_billing::{format_nusd, month_of};
use hearth_tenants::members::Role;
use hearth_tenants::now_ms;
use minijinja::context;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::manage::Actor;
use crate::server::error::ApiError;
use crate::state::AppState;

use super::members::{role_field, MemberForm};
use super::session::{csrf_ok, operator_only, CsrfForm, Visitor};
use super::tenant::{key_spec, NewKeyForm};
use super::views;
use super::{page, PageError};

pub(super) async fn operator(gw: &AppState, v: &Visitor) -> Result<Response, PageError> {
    let month = month_of(now_ms());
    gw.ledger.flush().await;
    let spends = gw
        .ledger
        .month_spends(&month)
        .await
        .map_err(crate::server::error::ledger_error)?;
    let tenants = gw
        .tenants
        .list_tenants()
        .await
        .map_err(crate::server::error::store_error)?;
    let budgets = gw.tenants.budgets().await.map_err(crate::server::error::store_error)?;
    let mut rows = Vec::new();
    for t in &tenants {
        let (cost, reqs) = spends
            .iter()
            .find(|(id, _, _)| *id == t.id)
            .map_or((0, 0), |(_, c, r)| (*c, *r));
        let budget = budgets.get(&t.id);
        rows.push(json!({
            "id": t.id, "name": t.name, "created_at": t.created_at, "spend_usd": format_nusd(cost),
            "suspended": t.suspended_at.is_some(),
            "spend_nusd": cost, "requests": reqs,
            "budget": budget.map(|b| format!("${} ({})", format_nusd(b.monthly_nusd), if b.hard {"hard"} else {"soft"})),
        }));
    }
    rows.sort_by_key(|r| std::cmp::Reverse(r["spend_nusd"].as_i64().unwrap_or(0)));
    let models: Vec<Value> = gw
        .models
        .all()
        .iter()
        .map(|m| {
            let r = m.router();
            let workers: Vec<Value> = r
                .workers()
                .map(|(slot, w)| {
                    json!({
                        "slot": slot, "name": w.name, "role": w.role, "region": w.region,
                        "health": if !w.healthy {"unhealthy"} else if w.draining {"draining"} else {"healthy"},
                        "outstanding": w.outstanding, "decoding": w.decoding, "capacity": w.capacity,
                        "prefill_tokens": w.inflight_prefill_tokens,
                        "cache_hit": if w.prompt_tokens == 0 { "–".to_string() } else {
                            format!("{:.1} %", w.cached_tokens as f64 * 100.0 / w.prompt_tokens as f64)
                        },
                        "cached_blocks": r.index.worker_blocks(slot),
                        "disk_blocks": r.index.worker_disk_blocks(slot),
                        "fetches": w.fetches,
                        "events": if w.exact_events {"exact"} else {"approximate"},
                    })
                })
                .collect();
            json!({
                "id": m.id, "state": m.state(), "context_length": m.context_length,
                "policy": r.cfg.policy.to_string(), "index_blocks": r.index.len(),
                "tenants": if m.tenants.is_empty() { "all".to_string() } else { m.tenants.join(", ") },
                "workers": workers,
            })
        })
        .collect();
    let catalogues: Vec<String> = gw.models.hosts().iter().map(|h| h.name().to_string()).collect();
    let prices: Vec<Value> = gw
        .ledger
        .prices(None)
        .await
        .map_err(crate::server::error::ledger_error)?
        .iter()
        .map(|p| {
            let usd = |micros: i64| format_nusd(micros * 1000);
            json!({
                "model": p.model, "effective_from": p.effective_from,
                "input": usd(p.rates.input_micros_per_mtok), "cached_input": usd(p.rates.cached_input_micros_per_mtok),
                "output": usd(p.rates.output_micros_per_mtok), "processor": usd(p.rates.processor_micros_per_cpu_s),
            })
        })
        .collect();
    Ok(page(
        StatusCode::OK,
        "operator.html",
        context! {
            base => v.base(), page => "overview", month => month, tenants => rows, models => models,
            prices => prices, catalogues => catalogues,
        },
    ))
}

#[derive(Deserialize)]
pub(super) struct NameForm {
    csrf: Option<String>,
    name: String,
}

pub(super) async fn create_tenant(
    v: Visitor,
    State(gw): State<Arc<AppState>>,
    headers: HeaderMap,
    Form(f): Form<NameForm>,
) -> Result<Response, PageError> {
    csrf_ok(&gw, &v, &headers, f.csrf.as_deref())?;
    operator_only(&v)?;
    let t = gw
        .management()
        .via(v.origin.clone())
        .create_tenant(f.name.trim())
        .await?;
    Ok(Redirect::to(&format!("/dashboard/tenants/{}", t.id)).into_response())
}

#[derive(Deserialize)]
pub(super) struct PriceForm {
    csrf: Option<String>,
    model: String,
    input: String,
    cached_input: String,
    output: String,
    processor: Option<String>,
}

/// A new price version from now (the admin API's `POST /admin/v1/prices`; an empty
/// processor rate carries the model's current one over).
pub(super) async fn set_price(
    v: Visitor,
    State(gw): State<Arc<AppState>>,
    headers: HeaderMap,
    Form(f): Form<PriceForm>,
) -> Result<Response, PageError> {
    csrf_ok(&gw, &v, &headers, f.csrf.as_deref())?;
    operator_only(&v)?;
    let model = f.model.trim();
    if model.is_empty() {
        return Err(ApiError::invalid("model", "'model' is required (a model id, or *)").into());
    }
    let usd = |text: &str, field: &'static str| {
        hearth_billing::parse_usd_micros(text.trim())
            .ok_or_else(|| ApiError::invalid(field, format!("'{field}' must be a USD amount like 0.15")))
    };
    let latest = gw
        .ledger
        .latest_rates(model)
        .await
        .map_err(crate::server::error::ledger_error)?;
    let processor = match f.processor.as_deref().map(str::trim).filter(|p| !p.is_empty()) {
        Some(p) => usd(p, "processor")?,
        None => latest.as_ref().map_or(0, |r| r.processor_micros_per_cpu_s),
    };
    let rates = hearth_billing::PriceRates {
        input_micros_per_mtok: usd(&f.input, "input")?,
        cached_input_micros_per_mtok: usd(&f.cached_input, "cached_input")?,
        output_micros_per_mtok: usd(&f.output, "output")?,
        processor_micros_per_cpu_s: processor,
        batch_percent: latest
            .as_ref()
            .map_or(hearth_billing::DEFAULT_BATCH_PERCENT, |r| r.batch_percent),
    };
    gw.management()
        .via(v.origin.clone())
        .set_price(model, rates, None)
        .await?;
    Ok(Redirect::to("/dashboard").into_response())
}

#[derive(Deserialize)]
pub(super) struct ModelForm {
    csrf: Option<String>,
    id: Option<String>,
    source: Option<String>,
    /// Tenants (names or ids, comma-separated) that may see it; empty: every tenant.
    tenants: Option<String>,
    /// "1": load now and keep warm.
    warm: Option<String>,
    idle_ttl_s: Option<String>,
}

/// `POST /dashboard/models`: the operator adds a model to every worker catalogue.
pub(super) async fn add_model(
    v: Visitor,
    State(gw): State<Arc<AppState>>,
    headers: HeaderMap,
    Form(f): Form<ModelForm>,
) -> Result<Response, PageError> {
    csrf_ok(&gw, &v, &headers, f.csrf.as_deref())?;
    operator_only(&v)?;
    let idle_ttl_s = match text_field(&f.idle_ttl_s) {
        None => None,
        Some(s) => Some(
            s.parse::<f64>()
                .ok()
                .filter(|t| t.is_finite() && *t >= 0.0)
                .ok_or_else(|| ApiError::invalid("idle_ttl_s", "seconds, or empty for never"))?,
        ),
    };
    let tenants: Vec<String> = f
        .tenants
        .as_deref()
        .unwrap_or("")
        .split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(str::to_string)
        .collect();
    let spec: hearth_protocol::ModelSpec = serde_json::from_value(json!({
        "id": text_field(&f.id).unwrap_or_default(), "source": text_field(&f.source).unwrap_or_default(),
        "tenants": tenants, "min_warm": u32::from(f.warm.as_deref() == Some("1")), "idle_ttl_s": idle_ttl_s,
    }))
    .map_err(|e| ApiError::invalid("model", e.to_string()))?;
    crate::routes::admin::add_catalogue_model(&gw, v.origin.clone(), spec).await?;
    Ok(Redirect::to("/dashboard#models").into_response())
}

/// `POST /dashboard/models/{model}/remove`.
pub(super) async fn remove_model(
    v: Visitor,
    State(gw): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(model): Path<String>,
    Form(f): Form<CsrfForm>,
) -> Result<Response, PageError> {
    csrf_ok(&gw, &v, &headers, f.csrf.as_deref())?;
    operator_only(&v)?;
    crate::routes::admin::remove_catalogue_model(&gw, v.origin.clone(), &model).await?;
    Ok(Redirect::to("/dashboard#models").into_response())
}

/// The operator's view of one tenant: the last 30 days' usage, cost, cache hit rate,
/// latency and errors by code; its budget and limits (editable), keys (revocable), members
/// (invite), identity provider and JWT issuers (set, remove), and suspension.
pub(super) async fn tenant_page(
    v: Visitor,
    State(gw): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(tenant): Path<String>,
) -> Result<Response, PageError> {
    operator_only(&v)?;
    let t = gw
        .tenants
        .tenant(&tenant)
        .await
        .map_err(crate::server::error::store_error)?;
    let now = now_ms();
    let range = views::Range::parse(Some("30d"));
    let (from, to) = range.window(now);
    gw.ledger.flush().await;
    let rows = gw
        .ledger
        .rows(&t.id, from, to)
        .await
        .map_err(crate::server::error::ledger_error)?;
    let prices = gw
        .ledger
        .prices(None)
        .await
        .map_err(crate::server::error::ledger_error)?;
    let usage = views::usage_view(&rows, &prices, range, now);
    let mut errors = std::collections::BTreeMap::<String, u64>::new();
    for r in &rows {
        if let Some(code) = r.rec.error_code.as_deref() {
            *errors.entry(code.to_string()).or_default() += 1;
        }
    }
    let errors: Vec<Value> = errors
        .iter()
        .map(|(code, count)| json!({"code": code, "count": count}))
        .collect();
    let month = month_of(now);
    let spent = gw
        .ledger
        .month_spend(&t.id, &month)
        .await
        .map_err(crate::server::error::ledger_error)?;
    let budget = gw
        .tenants
        .budget(&t.id)
        .await
        .map_err(crate::server::error::store_error)?
        .map(|b| json!({"monthly_usd": format_nusd(b.monthly_nusd), "mode": if b.hard {"hard"} else {"soft"}}));
    let limits = gw
        .tenants
        .tenant_limits(&t.id)
        .await
        .map_err(crate::server::error::store_error)?;
    let m = gw.management();
    let keys = m.list_keys(Actor::Operator, Some(&t.id)).await?;
    let (members, _) = m.list_members(Actor::Operator, Some(&t.id)).await?;
    let sso = gw.tenants.sso(&t.id).await.map_err(crate::server::error::store_error)?;
    let issuers = gw
        .tenants
        .list_issuers(Some(&t.id))
        .await
        .map_err(crate::server::error::store_error)?;
    let callback = gw.link_base(&headers).map_or_else(
        || "<public URL>/dashboard/sso/callback (start the gateway with --public-url)".to_string(),
        |b| format!("{b}/dashboard/sso/callback"),
    );
    Ok(page(
        StatusCode::OK,
        "tenant.html",
        context! {
            base => v.base(), page => "overview", tenant => t, usage => usage, errors => errors,
            month => month, spent_usd => format_nusd(spent), budget => budget,
            limits => json!({
                "rpm": limits.rpm, "tpm": limits.tpm, "concurrent": limits.concurrent, "share": limits.share,
                "priority": limits.priority.map(|p| p.as_str()),
            }),
            keys => keys, members => members, roles => Role::ALL, sso => sso, issuers => issuers,
            callback => callback,
        },
    ))
}

#[derive(Deserialize)]
pub(super) struct TenantForm {
    csrf: Option<String>,
    monthly_usd: Option<String>,
    mode: Option<String>,
    rpm: Option<String>,
    tpm: Option<String>,
    concurrent: Option<String>,
    share: Option<String>,
    priority: Option<String>,
    email: Option<String>,
    role: Option<String>,
    /// Identity provider / JWT issuer fields.
    issuer: Option<String>,
    client_id: Option<String>,
    client_secret: Option<String>,
    audience: Option<String>,
    algorithm: Option<String>,
    jwks_url: Option<String>,
    key: Option<String>,
    issuer_id: Option<String>,
}

/// A form's text field, trimmed; None when empty.
fn text_field(v: &Option<String>) -> Option<String> {
    v.as_deref()
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_string)
}

/// A form's optional whole number (empty or 0: none).
fn count_field(v: Option<&str>, field: &'static str) -> Result<Option<u32>, ApiError> {
    match v.map(str::trim).filter(|s| !s.is_empty()) {
        None => Ok(None),
        Some(s) => s
            .parse::<u32>()
            .map(|n| (n > 0).then_some(n))
            .map_err(|_| ApiError::invalid(field, format!("'{field}' is a whole number, or empty for none"))),
    }
}

pub(super) async fn tenant_action(
    v: Visitor,
    State(gw): State<Arc<AppState>>,
    headers: HeaderMap,
    Path((tenant, action)): Path<(String, String)>,
    Form(f): Form<TenantForm>,
) -> Result<Response, PageError> {
    csrf_ok(&gw, &v, &headers, f.csrf.as_deref())?;
    operator_only(&v)?;
    let t = gw
        .tenants
        .tenant(&tenant)
        .await
        .map_err(crate::server::error::store_error)?;
    let m = gw.management().via(v.origin.clone());
    match action.as_str() {
        "budget" => {
            let b = crate::routes::admin::parse_budget(f.monthly_usd.as_deref(), f.mode.as_deref())?;
            m.set_budget(&t.id, b).await?;
        }
        "limits" => {
            let priority = match f.priority.as_deref().unwrap_or("interactive") {
                "interactive" => None,
                p => Some(
                    hearth_tenants::Priority::parse(p)
                        .ok_or_else(|| ApiError::invalid("priority", "interactive or batch"))?,
                ),
            };
            let share = count_field(f.share.as_deref(), "share")?;
            if share.is_some_and(|s| s > hearth_tenants::MAX_SHARE) {
                return Err(
                    ApiError::invalid("share", format!("'share' is 1 to {}", hearth_tenants::MAX_SHARE)).into(),
                );
            }
            let l = hearth_tenants::Limits {
                rpm: count_field(f.rpm.as_deref(), "rpm")?,
                tpm: count_field(f.tpm.as_deref(), "tpm")?,
                concurrent: count_field(f.concurrent.as_deref(), "concurrent")?,
                share,
                priority,
            };
            m.set_tenant_limits(&t.id, l).await?;
        }
        "invite" => {
            let role = role_field(f.role.as_deref())?;
            let (token, inv) = m
                .invite_member(Actor::Operator, Some(&t.id), f.email.as_deref().unwrap_or(""), role)
                .await?;
            let link = gw.invite_link(&headers, &token);
            return Ok(page(
                StatusCode::CREATED,
                "invited.html",
                context! {base => v.base(), page => "overview", link => link, token => token, invitation => inv},
            ));
        }
        "sso" => {
            let spec = hearth_tenants::sso::SsoSpec {
                issuer: text_field(&f.issuer).unwrap_or_default(),
                client_id: text_field(&f.client_id).unwrap_or_default(),
                client_secret: text_field(&f.client_secret),
            };
            m.set_sso(&t.id, &spec).await?;
        }
        "suspend" | "resume" => {
            m.set_suspended(&t.id, action == "suspend").await?;
        }
        "sso-remove" => {
            m.remove_sso(&t.id).await?;
        }
        "jwt" => {
            let spec = hearth_tenants::jwt::IssuerSpec {
                issuer: text_field(&f.issuer).unwrap_or_default(),
                audience: text_field(&f.audience).unwrap_or_default(),
                algorithm: text_field(&f.algorithm).unwrap_or_default(),
                key: text_field(&f.key),
                jwks: None,
                jwks_url: text_field(&f.jwks_url),
            };
            m.add_issuer(&t.id, &spec).await?;
        }
        "jwt-remove" => {
            let id = text_field(&f.issuer_id).unwrap_or_default();
            // Only this tenant's issuers are removed from its page.
            let issuer = gw
                .tenants
                .issuer(&id)
                .await
                .map_err(crate::server::error::store_error)?;
            if issuer.tenant_id != t.id {
                return Err(ApiError::not_found(format!("JWT issuer {id:?} does not exist")).into());
            }
            m.remove_issuer(&id).await?;
        }
        _ => return Err(ApiError::not_found(format!("no tenant action {action:?}")).into()),
    }
    Ok(Redirect::to(&format!("/dashboard/tenants/{}", t.id)).into_response())
}

/// `POST /dashboard/tenants/{tenant}/keys`: the operator creates a key for a tenant (shown
/// once, like a tenant's own).
pub(super) async fn tenant_create_key(
    v: Visitor,
    State(gw): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(tenant): Path<String>,
    Form(f): Form<NewKeyForm>,
) -> Result<Response, PageError> {
    csrf_ok(&gw, &v, &headers, f.csrf.as_deref())?;
    operator_only(&v)?;
    let t = gw
        .tenants
        .tenant(&tenant)
        .await
        .map_err(crate::server::error::store_error)?;
    let created = gw
        .management()
        .via(v.origin.clone())
        .create_key(Actor::Operator, Some(&t.id), key_spec(f)?)
        .await?;
    Ok(page(
        StatusCode::CREATED,
        "key_created.html",
        context! {
            base => v.base(), page => "overview", key => created.key, id => created.info.id,
            name => created.info.name, back => format!("/dashboard/tenants/{}", t.id),
        },
    ))
}

/// `POST /dashboard/tenants/{tenant}/members/{id}/role|remove`: the operator changes or
/// removes one of the tenant's members.
pub(super) async fn tenant_member_action(
    v: Visitor,
    State(gw): State<Arc<AppState>>,
    headers: HeaderMap,
    Path((tenant, id, action)): Path<(String, String, String)>,
    Form(f): Form<MemberForm>,
) -> Result<Response, PageError> {
    csrf_ok(&gw, &v, &headers, f.csrf.as_deref())?;
    operator_only(&v)?;
    let t = gw
        .tenants
        .tenant(&tenant)
        .await
        .map_err(crate::server::error::store_error)?;
    let member = gw
        .tenants
        .member(&id)
        .await
        .map_err(crate::server::error::store_error)?;
    if member.tenant_id != t.id {
        return Err(ApiError::not_found(format!("member {id:?} does not exist")).into());
    }
    let m = gw.management().via(v.origin.clone());
    match action.as_str() {
        "role" => {
            m.set_member_role(Actor::Operator, &id, role_field(f.role.as_deref())?)
                .await?;
        }
        "remove" => {
            m.remove_member(Actor::Operator, &id).await?;
        }
        _ => return Err(ApiError::not_found(format!("no member action {action:?}")).into()),
    }
    Ok(Redirect::to(&format!("/dashboard/tenants/{}", t.id)).into_response())
}

/// `GET /dashboard/tenants/{tenant}/export`: a tenant's billing export, for the operator.
pub(super) async fn tenant_export(
    v: Visitor,
    State(gw): State<Arc<AppState>>,
    Path(tenant): Path<String>,
    q: Result<Query<crate::routes::admin::ExportQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, PageError> {
    operator_only(&v)?;
    let t = gw
        .tenants
        .tenant(&tenant)
        .await
        .map_err(crate::server::error::store_error)?;
    let Query(mut q) = q.map_err(|e| ApiError::invalid("query", e.body_text()))?;
    q.tenant = Some(t.id);
    Ok(crate::routes::admin::export_response(&gw, Actor::Operator, &q).await?)
}

pub(super) async fn tenant_revoke_key(
    v: Visitor,
    State(gw): State<Arc<AppState>>,
    headers: HeaderMap,
    Path((tenant, key)): Path<(String, String)>,
    Form(f): Form<CsrfForm>,
) -> Result<Response, PageError> {
    csrf_ok(&gw, &v, &headers, f.csrf.as_deref())?;
    operator_only(&v)?;
    let t = gw
        .tenants
        .tenant(&tenant)
        .await
        .map_err(crate::server::error::store_error)?;
    let k = gw.tenants.key(&key).await.map_err(crate::server::error::store_error)?;
    if k.tenant_id != t.id {
        return Err(ApiError::not_found(format!("API key {key:?} does not exist")).into());
    }
    gw.management()
        .via(v.origin.clone())
        .revoke_key(Actor::Operator, &key)
        .await?;
    Ok(Redirect::to(&format!("/dashboard/tenants/{}", t.id)).into_response())
}

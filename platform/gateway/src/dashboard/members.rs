//! Invitations and members: accepting an invitation, the members page and its actions.
use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use axum::Form;
use hearth_tenants::members::Role;
use minijinja::context;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::auth::client_address;
use crate::manage::{allows, Origin, Permission};
use crate::server::error::ApiError;
use crate::state::AppState;

use super::login::{open_member_session, pre_session_checks, session_opened, sign_in_failed};
use super::session::{cookie, csrf_ok, set_cookie, signed_form, CsrfForm, Visitor, Who};
use super::{page, PageError, SESSION_COOKIE};

pub(super) async fn invitation_form(
    State(gw): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(token): Path<String>,
) -> Response {
    invitation_page(&gw, &headers, &token, StatusCode::OK, None).await
}

async fn invitation_page(
    gw: &AppState,
    headers: &HeaderMap,
    token: &str,
    status: StatusCode,
    error: Option<&str>,
) -> Response {
    let inv = match gw.tenants.invitation(token).await {
        Ok(Some(inv)) => inv,
        Ok(None) => {
            return PageError {
                status: StatusCode::NOT_FOUND,
                message: "This invitation link is unknown, already used or expired: ask for a new one.".into(),
            }
            .into_response()
        }
        Err(e) => return PageError::from(crate::server::error::store_error(e)).into_response(),
    };
    let tenant = gw
        .tenants
        .tenant(&inv.tenant_id)
        .await
        .map_or_else(|_| inv.tenant_id.clone(), |t| t.name);
    let ctx = context! {
        error => error, email => inv.email, role => inv.role, tenant => tenant, token => token,
        min_password => hearth_tenants::members::MIN_PASSWORD_CHARS,
    };
    signed_form(gw, headers, status, "invite.html", ctx).await
}

#[derive(Deserialize)]
pub(super) struct AcceptForm {
    password: String,
    confirm: String,
    login_csrf: String,
}

pub(super) async fn accept_invitation(
    State(gw): State<Arc<AppState>>,
    headers: HeaderMap,
    extensions: axum::http::Extensions,
    Path(token): Path<String>,
    form: Result<Form<AcceptForm>, axum::extract::rejection::FormRejection>,
) -> Response {
    let headers = &headers;
    let Ok(Form(form)) = form else {
        return invitation_page(
            &gw,
            headers,
            &token,
            StatusCode::BAD_REQUEST,
            Some("The form was incomplete."),
        )
        .await;
    };
    if let Err((status, why)) = pre_session_checks(&gw, headers, &extensions, &form.login_csrf).await {
        return invitation_page(&gw, headers, &token, status, Some(why)).await;
    }
    if form.password != form.confirm {
        return invitation_page(
            &gw,
            headers,
            &token,
            StatusCode::BAD_REQUEST,
            Some("The two passwords differ."),
        )
        .await;
    }
    let origin = Origin::dashboard(client_address(&extensions));
    let m = gw.management().via(origin.clone());
    match m.accept_invitation(&token, &form.password).await {
        Ok(Some(member)) => {
            let opened = open_member_session(&gw, &member, origin, "password").await;
            session_opened(&gw, headers, opened, false).await
        }
        Ok(None) => {
            sign_in_failed(&gw, &extensions);
            invitation_page(&gw, headers, &token, StatusCode::NOT_FOUND, None).await
        }
        Err(e) => {
            let e = ApiError::from(e);
            invitation_page(&gw, headers, &token, e.status, Some(&e.message)).await
        }
    }
}

/// A form's role, or a 400.
pub(super) fn role_field(role: Option<&str>) -> Result<Role, ApiError> {
    Role::parse(role.unwrap_or("")).ok_or_else(|| ApiError::invalid("role", "unknown role"))
}

pub(super) async fn members(v: Visitor, State(gw): State<Arc<AppState>>) -> Result<Response, PageError> {
    v.tenant()?;
    let (list, invitations) = gw.management().list_members(v.actor(), None).await?;
    let me = match &v.who {
        Who::Member(m) => Some(m.member.id.clone()),
        _ => None,
    };
    let roles: Vec<&str> = Role::ALL
        .iter()
        .filter(|r| **r != Role::Owner || v.can(Permission::ManageOwners))
        .map(|r| r.as_str())
        .collect();
    Ok(page(
        StatusCode::OK,
        "members.html",
        context! {
            base => v.base(), page => "members", members => list, invitations => invitations,
            me => me, roles => roles, role_table => role_table(),
        },
    ))
}

/// The management service's role table, for people.
pub(super) fn role_table() -> Value {
    let rows: Vec<Value> = Permission::ALL
        .iter()
        .map(|p| {
            let allowed: Vec<bool> = Role::ALL.iter().map(|r| allows(*r, *p)).collect();
            let what = p.describe();
            json!({"what": format!("{}{}", what[..1].to_uppercase(), &what[1..]), "allowed": allowed})
        })
        .collect();
    json!({"roles": Role::ALL, "rows": rows})
}

#[derive(Deserialize)]
pub(super) struct InviteForm {
    csrf: Option<String>,
    email: String,
    role: String,
}

pub(super) async fn invite_member(
    v: Visitor,
    State(gw): State<Arc<AppState>>,
    headers: HeaderMap,
    Form(f): Form<InviteForm>,
) -> Result<Response, PageError> {
    csrf_ok(&gw, &v, &headers, f.csrf.as_deref())?;
    v.tenant()?;
    let role = role_field(Some(&f.role))?;
    let (token, inv) = gw
        .management()
        .via(v.origin.clone())
        .invite_member(v.actor(), None, &f.email, role)
        .await?;
    let link = gw.invite_link(&headers, &token);
    Ok(page(
        StatusCode::CREATED,
        "invited.html",
        context! {base => v.base(), page => "members", link => link, token => token, invitation => inv},
    ))
}

#[derive(Deserialize)]
pub(super) struct MemberForm {
    pub(super) csrf: Option<String>,
    pub(super) role: Option<String>,
}

pub(super) async fn member_action(
    v: Visitor,
    State(gw): State<Arc<AppState>>,
    headers: HeaderMap,
    Path((id, action)): Path<(String, String)>,
    Form(f): Form<MemberForm>,
) -> Result<Response, PageError> {
    csrf_ok(&gw, &v, &headers, f.csrf.as_deref())?;
    v.tenant()?;
    let m = gw.management().via(v.origin.clone());
    match action.as_str() {
        "role" => {
            let role = role_field(f.role.as_deref())?;
            m.set_member_role(v.actor(), &id, role).await?;
        }
        "remove" => {
            m.remove_member(v.actor(), &id).await?;
        }
        _ => return Err(ApiError::not_found(format!("no member action {action:?}")).into()),
    }
    Ok(Redirect::to("/dashboard/members").into_response())
}

pub(super) async fn revoke_invitation(
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
        .revoke_invitation(v.actor(), &id)
        .await?;
    Ok(Redirect::to("/dashboard/members").into_response())
}

pub(super) async fn logout(
    v: Visitor,
    State(gw): State<Arc<AppState>>,
    headers: HeaderMap,
    Form(f): Form<CsrfForm>,
) -> Response {
    if let Err(e) = csrf_ok(&gw, &v, &headers, f.csrf.as_deref()) {
        return PageError::from(e).into_response();
    }
    let token = cookie(&headers, SESSION_COOKIE).unwrap_or("");
    if let Err(e) = gw.tenants.end_session(token).await {
        tracing::error!(error = %e, "dashboard session could not be ended");
        return PageError::from(ApiError::unavailable("sign-out failed; try again")).into_response();
    }
    let tenant = v.tenant().ok().map(|t| t.tenant_id.clone());
    gw.management()
        .via(v.origin.clone())
        .audit(v.actor(), tenant.as_deref(), "session.sign_out", "dashboard", json!({}))
        .await;
    let mut resp = Redirect::to("/dashboard/login").into_response();
    resp.headers_mut()
        .append(header::SET_COOKIE, set_cookie(&gw, &headers, SESSION_COOKIE, "", 0));
    resp
}

//! Signing in: the form and its double-submit token, the checks before a session opens
//! (throttle, suspension), opening the session for a key, a member or the operator.
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use axum::Form;
use hearth_tenants::sessions::{admin_fingerprint, Session, SessionKind};
use hearth_tenants::{constant_time_eq, now_ms, AuthError};
use serde::Deserialize;
use serde_json::json;

use crate::auth::client_address;
use crate::manage::{Actor, Origin};
use crate::server::error::ApiError;
use crate::state::AppState;

use super::session::{
    cookie, login_page, login_token, refuse_if_suspended, same_origin, set_cookie, suspended_message,
};
use super::{LOGIN_COOKIE, SESSION_COOKIE};

pub(super) async fn login_form(State(gw): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    login_page(&gw, &headers, StatusCode::OK, None).await
}

#[derive(Deserialize)]
pub(super) struct LoginForm {
    /// An API key, JWT or the admin token.
    credential: Option<String>,
    /// A member's sign-in: tenant name, e-mail and password.
    tenant: Option<String>,
    email: Option<String>,
    password: Option<String>,
    login_csrf: String,
}

/// Why a form posted before there is a session is refused before its content is looked at:
/// its token is not this server's, or the address is throttled.
pub(super) async fn pre_session_checks(
    gw: &AppState,
    headers: &HeaderMap,
    extensions: &axum::http::Extensions,
    login_csrf: &str,
) -> Result<(), (StatusCode, &'static str)> {
    let expected = cookie(headers, LOGIN_COOKIE).unwrap_or("");
    if expected.is_empty()
        || !same_origin(gw, headers)
        || !constant_time_eq(expected.as_bytes(), login_csrf.as_bytes())
        || !login_token::valid(gw, expected, now_ms()).await
    {
        return Err((
            StatusCode::FORBIDDEN,
            "The form expired or came from another site: try again.",
        ));
    }
    // Guessing credentials (API keys, JWTs, the admin token or passwords) through the
    // dashboard is throttled per address like the API's bearer tokens.
    let peer = crate::auth::peer_ip(extensions);
    if let (Some(ip), Some(throttle)) = (peer, gw.auth_throttle.as_ref()) {
        if throttle.check(ip).is_err() {
            gw.metrics.auth_throttled.inc();
            return Err((
                StatusCode::TOO_MANY_REQUESTS,
                "Too many failed sign-ins from this address; wait a few seconds.",
            ));
        }
    }
    Ok(())
}

/// Counts a failed sign-in against the address's throttle.
pub(super) fn sign_in_failed(gw: &AppState, extensions: &axum::http::Extensions) {
    if let (Some(ip), Some(throttle)) = (crate::auth::peer_ip(extensions), gw.auth_throttle.as_ref()) {
        throttle.failed(ip);
    }
}

/// Sets the session cookie of a session just opened and goes to the dashboard. After an
/// identity provider's redirect (`via_provider`), the way on is a page of ours rather than a
/// redirect: a browser does not send the SameSite=Strict cookie on a redirect chain that
/// another site started, but does on a navigation our own page starts.
pub(super) async fn session_opened(
    gw: &AppState,
    headers: &HeaderMap,
    opened: Result<(String, Session), hearth_tenants::TenantError>,
    via_provider: bool,
) -> Response {
    // Sessions nobody reads again (closed tabs) are deleted here; live ones are checked on read.
    if let Err(e) = gw.tenants.purge_sessions().await {
        tracing::warn!(error = %e, "expired dashboard sessions could not be purged");
    }
    match opened {
        Ok((token, s)) => {
            let mut resp = if via_provider {
                super::continue_page("Signed in", "/dashboard")
            } else {
                Redirect::to("/dashboard").into_response()
            };
            let age = (s.expires_at - now_ms()) / 1000;
            let h = resp.headers_mut();
            h.append(
                header::SET_COOKIE,
                set_cookie(gw, headers, SESSION_COOKIE, &token, age.max(1)),
            );
            h.append(header::SET_COOKIE, set_cookie(gw, headers, LOGIN_COOKIE, "", 0));
            resp
        }
        Err(e) => {
            tracing::error!(error = %e, "dashboard session could not be created");
            login_page(
                gw,
                headers,
                StatusCode::SERVICE_UNAVAILABLE,
                Some("Sign-in is temporarily unavailable."),
            )
            .await
        }
    }
}

/// Opens a member's session and audits it.
pub(super) async fn open_member_session(
    gw: &AppState,
    member: &hearth_tenants::members::Member,
    origin: Origin,
    method: &str,
) -> Result<(String, Session), hearth_tenants::TenantError> {
    let kind = SessionKind::Member {
        tenant_id: member.tenant_id.clone(),
        member_id: member.id.clone(),
    };
    let opened = gw.tenants.create_session(kind, None, origin.address.as_deref()).await?;
    if let Ok(mc) = gw.tenants.session_member(&opened.1).await {
        gw.management()
            .via(origin)
            .audit(
                Actor::Member(&mc),
                Some(&member.tenant_id),
                "session.sign_in",
                "dashboard",
                json!({"method": method}),
            )
            .await;
    }
    Ok(opened)
}

pub(super) async fn login(
    State(gw): State<Arc<AppState>>,
    headers: HeaderMap,
    extensions: axum::http::Extensions,
    form: Result<Form<LoginForm>, axum::extract::rejection::FormRejection>,
) -> Response {
    let headers = &headers;
    let Ok(Form(form)) = form else {
        return login_page(
            &gw,
            headers,
            StatusCode::BAD_REQUEST,
            Some("The sign-in form was incomplete."),
        )
        .await;
    };
    if let Err((status, why)) = pre_session_checks(&gw, headers, &extensions, &form.login_csrf).await {
        return login_page(&gw, headers, status, Some(why)).await;
    }
    let address = client_address(&extensions);
    let origin = Origin::dashboard(address.clone());
    if form.email.as_deref().is_some_and(|e| !e.trim().is_empty()) {
        return member_sign_in(&gw, headers, &extensions, form, origin).await;
    }
    let credential = form.credential.as_deref().unwrap_or("").trim();
    let admin = gw.admin_token.as_deref().filter(|t| !t.is_empty());
    let opened = if admin.is_some_and(|t| constant_time_eq(credential.as_bytes(), t.as_bytes())) {
        operator_session(&gw, credential, address.as_deref(), origin).await
    } else {
        match key_session(&gw, headers, &extensions, credential, address.as_deref(), origin).await {
            Ok(opened) => opened,
            Err(refused) => return refused,
        }
    };
    session_opened(&gw, headers, opened, false).await
}

/// A member signs in with its tenant, e-mail address and password.
async fn member_sign_in(
    gw: &AppState,
    headers: &HeaderMap,
    extensions: &axum::http::Extensions,
    form: LoginForm,
    origin: Origin,
) -> Response {
    let tenant = form.tenant.as_deref().unwrap_or("").trim();
    let email = form.email.as_deref().unwrap_or("");
    let password = form.password.unwrap_or_default();
    let found = match gw.tenants.member_for_sign_in(tenant, email).await {
        Ok(found) => found,
        Err(e) => {
            tracing::error!(error = %e, "member store unavailable");
            return login_page(
                gw,
                headers,
                StatusCode::SERVICE_UNAVAILABLE,
                Some("Sign-in is temporarily unavailable."),
            )
            .await;
        }
    };
    // An unknown tenant or address costs the same Argon2id verification as a wrong
    // password (against a dummy hash), so the answer's time does not tell.
    let (member, hash) = found.map_or((None, None), |(m, h)| (Some(m), h));
    gw.metrics.password_checks.inc();
    let ok = match crate::manage::password_work(move || {
        hearth_tenants::members::verify_password(hash.as_deref(), &password)
    })
    .await
    {
        Ok(ok) => ok,
        Err(e) => {
            let e = ApiError::from(e);
            return login_page(gw, headers, e.status, Some(&e.message)).await;
        }
    };
    let Some(member) = member.filter(|_| ok) else {
        sign_in_failed(gw, extensions);
        return login_page(
            gw,
            headers,
            StatusCode::UNAUTHORIZED,
            Some("Wrong tenant, e-mail address or password."),
        )
        .await;
    };
    if let Some(refused) = refuse_if_suspended(gw, headers, &member.tenant_id).await {
        return refused;
    }
    let opened = open_member_session(gw, &member, origin, "password").await;
    session_opened(gw, headers, opened, false).await
}

/// The operator signs in with the admin token.
async fn operator_session(
    gw: &AppState,
    credential: &str,
    address: Option<&str>,
    origin: Origin,
) -> Result<(String, Session), hearth_tenants::TenantError> {
    let kind = SessionKind::Operator {
        admin_fp: admin_fingerprint(credential),
    };
    let s = gw.tenants.create_session(kind, None, address).await;
    if s.is_ok() {
        gw.management()
            .via(origin)
            .audit(Actor::Operator, None, "session.sign_in", "dashboard", json!({}))
            .await;
    }
    s
}

/// A tenant's credential (an API key or JWT with the `manage` scope) opens a session, while
/// the tenant has no members; refused with the sign-in page otherwise.
async fn key_session(
    gw: &AppState,
    headers: &HeaderMap,
    extensions: &axum::http::Extensions,
    credential: &str,
    address: Option<&str>,
    origin: Origin,
) -> Result<Result<(String, Session), hearth_tenants::TenantError>, Response> {
    let ctx = match gw.tenants.authenticate(credential).await {
        Ok(ctx) => ctx,
        Err(AuthError::Store(e)) => {
            tracing::error!(error = %e, "key store unavailable");
            return Err(login_page(
                gw,
                headers,
                StatusCode::SERVICE_UNAVAILABLE,
                Some("Sign-in is temporarily unavailable."),
            )
            .await);
        }
        Err(AuthError::Suspended(t)) => {
            return Err(login_page(gw, headers, StatusCode::FORBIDDEN, Some(&suspended_message(&t))).await);
        }
        Err(e) => {
            sign_in_failed(gw, extensions);
            let why = match e {
                AuthError::Revoked => "This API key has been revoked.",
                AuthError::Expired(_) => "This credential has expired.",
                _ => "That is not a valid API key, JWT or admin token.",
            };
            return Err(login_page(gw, headers, StatusCode::UNAUTHORIZED, Some(why)).await);
        }
    };
    if !ctx.scopes.manage {
        return Err(login_page(
            gw,
            headers,
            StatusCode::FORBIDDEN,
            Some("This credential lacks the 'manage' scope the dashboard needs."),
        )
        .await);
    }
    // Once a tenant has members, people sign in as themselves: its keys are for programs.
    match gw.tenants.has_members(&ctx.tenant_id).await {
        Ok(false) => {}
        Ok(true) => return Err(login_page(
            gw,
            headers,
            StatusCode::FORBIDDEN,
            Some("This tenant has members: sign in with your e-mail address and password. API keys are for programs."),
        )
        .await),
        Err(e) => {
            tracing::error!(error = %e, "member store unavailable");
            return Err(login_page(
                gw,
                headers,
                StatusCode::SERVICE_UNAVAILABLE,
                Some("Sign-in is temporarily unavailable."),
            )
            .await);
        }
    }
    let kind = SessionKind::Tenant {
        tenant_id: ctx.tenant_id.clone(),
        credential: ctx.key_id.clone(),
        scopes: ctx.scopes,
        models: ctx.models.as_ref().map(|m| m.to_vec()),
    };
    let s = gw.tenants.create_session(kind, ctx.expires_at, address).await;
    if s.is_ok() {
        gw.management()
            .via(origin)
            .audit(
                Actor::Tenant(&ctx),
                Some(&ctx.tenant_id),
                "session.sign_in",
                "dashboard",
                json!({}),
            )
            .await;
    }
    Ok(s)
}

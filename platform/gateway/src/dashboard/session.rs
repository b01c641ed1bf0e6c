//! Sessions: the cookie, the signed-in visitor (a tenant's key or member, or the operator)
//! as an extractor, and the same-origin and CSRF checks every POST passes.
use std::sync::Arc;

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use hearth_tenants::members::MemberContext;
use hearth_tenants::sessions::{admin_fingerprint, Session, SessionKind};
use hearth_tenants::{constant_time_eq, now_ms, AuthError, TenantContext};
use minijinja::context;
use serde::Deserialize;

use crate::auth::client_address;
use crate::manage::{allows, Actor, Origin, Permission};
use crate::server::error::ApiError;
use crate::state::AppState;

use super::{page, PageError, LOGIN_COOKIE, SESSION_COOKIE};

pub(super) fn cookie<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|c| c.trim().split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v)
}

pub(super) fn set_cookie(gw: &AppState, headers: &HeaderMap, name: &str, value: &str, max_age_s: i64) -> HeaderValue {
    let secure = if gw.over_tls(headers) { "; Secure" } else { "" };
    HeaderValue::from_str(&format!(
        "{name}={value}; Path=/dashboard; HttpOnly; SameSite=Strict; Max-Age={max_age_s}{secure}"
    ))
    .unwrap_or_else(|_| HeaderValue::from_static(""))
}

/// A signed-in visitor: its session and, for a tenant, its credential (or member) as it
/// stands now.
pub struct Visitor {
    pub session: Session,
    pub who: Who,
    pub origin: Origin,
}

pub enum Who {
    Operator,
    /// A tenant credential (API key or JWT with the `manage` scope).
    Credential(TenantContext),
    Member(MemberContext),
}

impl Visitor {
    pub(super) fn actor(&self) -> Actor<'_> {
        match &self.who {
            Who::Operator => Actor::Operator,
            Who::Credential(ctx) => Actor::Tenant(ctx),
            Who::Member(m) => Actor::Member(m),
        }
    }

    pub(super) fn is_tenant(&self) -> bool {
        !matches!(self.who, Who::Operator)
    }

    pub(super) fn tenant(&self) -> Result<&TenantContext, PageError> {
        let ctx = match &self.who {
            Who::Operator => None,
            Who::Credential(ctx) => Some(ctx),
            Who::Member(m) => Some(&m.ctx),
        };
        ctx.ok_or(PageError {
            status: StatusCode::FORBIDDEN,
            message: "This page is a tenant's; the operator's pages are on the dashboard's home.".into(),
        })
    }

    /// Whether the visitor may do what `p` names (pages hide what it may not).
    pub(super) fn can(&self, p: Permission) -> bool {
        match &self.who {
            Who::Member(m) => allows(m.member.role, p),
            _ => true,
        }
    }

    pub(super) fn base(&self) -> minijinja::Value {
        let can = context! {
            export => self.can(Permission::Export), manage_keys => self.can(Permission::ManageKeys),
            manage_processors => self.can(Permission::ManageProcessors), audit => self.can(Permission::ReadAudit),
            manage_adapters => self.can(Permission::ManageAdapters),
            // Batch answers are read, and batches cancelled, by the roles that may create
            // keys (and so run requests themselves).
            batch_outputs => self.can(Permission::ManageKeys),
            manage_members => self.can(Permission::ManageMembers), manage_owners => self.can(Permission::ManageOwners),
        };
        match &self.who {
            Who::Credential(t) => context! {
                kind => "tenant", tenant_name => t.tenant_name, tenant_id => t.tenant_id,
                credential => t.key_id, csrf => self.session.csrf, can => can,
            },
            Who::Member(m) => context! {
                kind => "tenant", tenant_name => m.ctx.tenant_name, tenant_id => m.ctx.tenant_id,
                member => m.member.email, role => m.member.role, member_id => m.member.id,
                csrf => self.session.csrf, can => can,
            },
            Who::Operator => context! {kind => "operator", csrf => self.session.csrf, can => can},
        }
    }
}

pub(super) fn suspended_message(tenant: &str) -> String {
    format!("Tenant {tenant:?} is suspended: ask the platform's operator.")
}

/// Refuses a member of a suspended tenant at sign-in (a good password or identity, so it
/// does not count against the throttle).
pub(super) async fn refuse_if_suspended(gw: &AppState, headers: &HeaderMap, tenant_id: &str) -> Option<Response> {
    match gw.tenants.tenant(tenant_id).await {
        Ok(t) if t.suspended_at.is_some() => {
            Some(login_page(gw, headers, StatusCode::FORBIDDEN, Some(&suspended_message(&t.name))).await)
        }
        Ok(_) => None,
        Err(e) => {
            tracing::error!(error = %e, "tenant store unavailable");
            Some(
                login_page(
                    gw,
                    headers,
                    StatusCode::SERVICE_UNAVAILABLE,
                    Some("Sign-in is temporarily unavailable."),
                )
                .await,
            )
        }
    }
}

/// No session: pages redirect to the sign-in form, other requests get a 401.
pub enum Unauthenticated {
    Redirect,
    Refused(ApiError),
}

impl IntoResponse for Unauthenticated {
    fn into_response(self) -> Response {
        match self {
            Unauthenticated::Redirect => Redirect::to("/dashboard/login").into_response(),
            Unauthenticated::Refused(e) => e.into_response(),
        }
    }
}

impl FromRequestParts<Arc<AppState>> for Visitor {
    type Rejection = Unauthenticated;

    async fn from_request_parts(parts: &mut Parts, gw: &Arc<AppState>) -> Result<Self, Unauthenticated> {
        let refuse = |e: ApiError| {
            if parts.method == axum::http::Method::GET {
                Unauthenticated::Redirect
            } else {
                Unauthenticated::Refused(e)
            }
        };
        let token = cookie(&parts.headers, SESSION_COOKIE).unwrap_or("");
        let session = match gw.tenants.session(token).await {
            Ok(Some(s)) => s,
            Ok(None) => return Err(refuse(ApiError::unauthorized("Sign in to the dashboard first."))),
            Err(e) => {
                tracing::error!(error = %e, "dashboard session store unavailable");
                return Err(Unauthenticated::Refused(ApiError::unavailable(
                    "sessions are temporarily unavailable",
                )));
            }
        };
        let mut operator = None;
        let who = match &session.kind {
            SessionKind::OperatorSso { email } => {
                // Signed in through the operators' identity provider: still an operator while
                // the address is on the gateway's list.
                if !gw.operator_sso.as_ref().is_some_and(|o| o.operators.contains(email)) {
                    let _ = gw.tenants.end_session(token).await;
                    return Err(refuse(ApiError::unauthorized(
                        "You are no longer one of this installation's operators.",
                    )));
                }
                operator = Some(email.to_string());
                Who::Operator
            }
            SessionKind::Operator { admin_fp } => {
                let current = gw.admin_token.as_deref().map(admin_fingerprint);
                if current
                    .as_deref()
                    .is_none_or(|c| !constant_time_eq(c.as_bytes(), admin_fp.as_bytes()))
                {
                    let _ = gw.tenants.end_session(token).await;
                    return Err(refuse(ApiError::unauthorized(
                        "The admin token has changed: sign in again.",
                    )));
                }
                Who::Operator
            }
            SessionKind::Member { .. } => match gw.tenants.session_member(&session).await {
                Ok(m) => Who::Member(m),
                Err(AuthError::Suspended(t)) => {
                    let _ = gw.tenants.end_session(token).await;
                    return Err(refuse(ApiError::permission("tenant_suspended", suspended_message(&t))));
                }
                Err(AuthError::Store(e)) => {
                    tracing::error!(error = %e, "dashboard member check unavailable");
                    return Err(Unauthenticated::Refused(ApiError::unavailable(
                        "authentication is temporarily unavailable",
                    )));
                }
                Err(_) => {
                    let _ = gw.tenants.end_session(token).await;
                    return Err(refuse(ApiError::unauthorized(
                        "This membership has ended: ask the tenant's owner.",
                    )));
                }
            },
            SessionKind::Tenant { .. } => match gw.tenants.session_context(&session).await {
                // A key's session ends when its tenant gets members: people sign in as themselves.
                Ok(ctx) if gw.tenants.has_members(&ctx.tenant_id).await.unwrap_or(true) => {
                    let _ = gw.tenants.end_session(token).await;
                    return Err(refuse(ApiError::unauthorized(
                        "This tenant has members now: sign in with your e-mail address and password.",
                    )));
                }
                Ok(ctx) => Who::Credential(ctx),
                Err(AuthError::Suspended(t)) => {
                    let _ = gw.tenants.end_session(token).await;
                    return Err(refuse(ApiError::permission("tenant_suspended", suspended_message(&t))));
                }
                Err(AuthError::Store(e)) => {
                    tracing::error!(error = %e, "dashboard credential check unavailable");
                    return Err(Unauthenticated::Refused(ApiError::unavailable(
                        "authentication is temporarily unavailable",
                    )));
                }
                Err(_) => {
                    // The key was revoked or expired, or the issuer removed: the session ends.
                    let _ = gw.tenants.end_session(token).await;
                    return Err(refuse(ApiError::unauthorized(
                        "This session's credential is no longer valid: sign in again.",
                    )));
                }
            },
        };
        Ok(Visitor {
            session,
            who,
            origin: Origin {
                operator,
                ..Origin::dashboard(client_address(&parts.extensions))
            },
        })
    }
}

/// The request came from this site (`Origin` and `Sec-Fetch-Site`, where the browser sent
/// them). An opaque `Origin: null` (sent under some referrer policies and from sandboxed
/// frames) counts only with `Sec-Fetch-Site: same-origin`. With a public URL configured,
/// `Origin` must be there and be exactly that origin (scheme, host and port: browsers send
/// it on every POST); without one, its host and port must be the request's `Host` (which
/// the client chose, so a proxy should be told the public URL).
pub(super) fn same_origin(gw: &AppState, headers: &HeaderMap) -> bool {
    let site = headers.get("sec-fetch-site").and_then(|v| v.to_str().ok());
    if site.is_some_and(|s| !matches!(s, "same-origin" | "none")) {
        return false;
    }
    let origin = headers.get(header::ORIGIN).and_then(|v| v.to_str().ok());
    if let Some(public) = &gw.public_origin {
        return origin.is_some_and(|o| o.eq_ignore_ascii_case(public));
    }
    let Some(origin) = origin else {
        return true;
    };
    if origin == "null" {
        return site == Some("same-origin");
    }
    let host = headers.get(header::HOST).and_then(|v| v.to_str().ok()).unwrap_or("");
    let bare = origin
        .strip_prefix("http://")
        .or_else(|| origin.strip_prefix("https://"))
        .unwrap_or("");
    !host.is_empty() && bare == host
}

pub(super) fn csrf_ok(
    gw: &AppState,
    v: &Visitor,
    headers: &HeaderMap,
    presented: Option<&str>,
) -> Result<(), ApiError> {
    let given = presented
        .or_else(|| headers.get("x-csrf-token").and_then(|h| h.to_str().ok()))
        .unwrap_or("");
    if !same_origin(gw, headers) || !constant_time_eq(given.as_bytes(), v.session.csrf.as_bytes()) {
        return Err(ApiError::permission(
            "csrf_failed",
            "This request did not come from a dashboard page (missing or wrong CSRF token): reload the page and try again.",
        ));
    }
    Ok(())
}

pub(super) async fn login_page(
    gw: &AppState,
    headers: &HeaderMap,
    status: StatusCode,
    error: Option<&str>,
) -> Response {
    let operator_sso = gw.operator_sso.is_some();
    signed_form(
        gw,
        headers,
        status,
        "login.html",
        context! {error => error, operator_sso => operator_sso},
    )
    .await
}

/// A page with a form posted before there is a session (sign-in, accepting an invitation):
/// it carries a fresh [`login_token`] (as `login_csrf`) and sets the same in a cookie.
pub(super) async fn signed_form(
    gw: &AppState,
    headers: &HeaderMap,
    status: StatusCode,
    template: &str,
    ctx: minijinja::Value,
) -> Response {
    let token = match login_token::issue(gw, now_ms()).await {
        Ok(t) => t,
        Err(why) => {
            tracing::error!(error = %why, "the sign-in form's token could not be issued");
            return (StatusCode::SERVICE_UNAVAILABLE, "Sign-in is temporarily unavailable.").into_response();
        }
    };
    let mut resp = page(status, template, context! {login_csrf => token, ..ctx});
    resp.headers_mut().append(
        header::SET_COOKIE,
        set_cookie(gw, headers, LOGIN_COOKIE, &token, login_token::LIFETIME_MS / 1000),
    );
    resp
}

/// The sign-in form's anti-CSRF token: `ISSUED_MS.NONCE.MAC`, the MAC an HMAC-SHA256 of the
/// rest under the installation's `dashboard-login` secret. The form carries it and a cookie
/// set with the form carries it again (double submit); a POST is taken only when both are
/// the same token, this server issued it (a client cannot pick its own) and it is younger
/// than [`LIFETIME_MS`].
pub(super) mod login_token {
    use hmac::{Hmac, Mac};
    use sha2::Sha256;

    use crate::state::AppState;

    pub const LIFETIME_MS: i64 = 10 * 60 * 1000;

    async fn key(gw: &AppState) -> Result<&str, String> {
        gw.login_key
            .get_or_try_init(|| async { gw.tenants.server_secret("dashboard-login").await })
            .await
            .map(String::as_str)
            .map_err(|e| e.to_string())
    }

    /// The MAC of `body` for one purpose (a token made for one is no use for another).
    fn mac_for(key: &str, purpose: &str, body: &str) -> String {
        // HMAC takes a key of any length: `new_from_slice` cannot fail.
        let Ok(mut m) = <Hmac<Sha256> as Mac>::new_from_slice(key.as_bytes()) else {
            return String::new();
        };
        m.update(purpose.as_bytes());
        m.update(b"\0");
        m.update(body.as_bytes());
        m.finalize().into_bytes().iter().map(|b| format!("{b:02x}")).collect()
    }

    fn mac(key: &str, body: &str) -> String {
        mac_for(key, "hearth-dashboard-login", body)
    }

    /// `BODY.MAC` for `purpose` (BODY without dots at its end is returned by [`unseal`]).
    pub async fn seal(gw: &AppState, purpose: &str, body: &str) -> Result<String, String> {
        Ok(format!("{body}.{}", mac_for(key(gw).await?, purpose, body)))
    }

    /// The body of a token [`seal`]ed for `purpose` by this installation.
    pub async fn unseal<'t>(gw: &AppState, purpose: &str, token: &'t str) -> Option<&'t str> {
        let (body, given) = token.rsplit_once('.')?;
        let want = mac_for(key(gw).await.ok()?, purpose, body);
        (!want.is_empty() && hearth_tenants::constant_time_eq(want.as_bytes(), given.as_bytes())).then_some(body)
    }

    /// A token issued at `now` with `nonce`.
    pub(super) fn sign(key: &str, now: i64, nonce: &str) -> String {
        let body = format!("{now}.{nonce}");
        format!("{body}.{}", mac(key, &body))
    }

    pub async fn issue(gw: &AppState, now: i64) -> Result<String, String> {
        let mut nonce = [0u8; 16];
        getrandom::fill(&mut nonce).map_err(|e| e.to_string())?;
        let nonce: String = nonce.iter().map(|b| format!("{b:02x}")).collect();
        Ok(sign(key(gw).await?, now, &nonce))
    }

    /// Whether `token` was signed with `key`, is not from the future (a minute of clock
    /// skew between gateways allowed) and is younger than [`LIFETIME_MS`] at `now`.
    pub(super) fn check(key: &str, token: &str, now: i64) -> bool {
        let Some((body, given)) = token.rsplit_once('.') else {
            return false;
        };
        let Some(issued) = body.split_once('.').and_then(|(t, _)| t.parse::<i64>().ok()) else {
            return false;
        };
        let want = mac(key, body);
        !want.is_empty()
            && hearth_tenants::constant_time_eq(want.as_bytes(), given.as_bytes())
            && issued <= now + 60_000
            && now.saturating_sub(issued) < LIFETIME_MS
    }

    /// Whether `token` is one this installation issued, not expired at `now`.
    pub async fn valid(gw: &AppState, token: &str, now: i64) -> bool {
        match key(gw).await {
            Ok(key) => check(key, token, now),
            Err(_) => false,
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn only_fresh_tokens_signed_with_the_key_pass() {
            let (key, now) = ("k".repeat(64), 1_800_000_000_000);
            let t = sign(&key, now, "00ff");
            assert!(check(&key, &t, now));
            assert!(check(&key, &t, now + LIFETIME_MS - 1));
            assert!(!check(&key, &t, now + LIFETIME_MS), "expired");
            assert!(!check(&key, &sign(&key, now + 120_000, "00ff"), now), "from the future");
            assert!(!check(&"j".repeat(64), &t, now), "another key");
            let (body, mac) = t.rsplit_once('.').unwrap();
            let flipped = format!("{body}.{}{}", if mac.starts_with('0') { "1" } else { "0" }, &mac[1..]);
            assert!(!check(&key, &flipped, now), "altered MAC");
            let moved = t.replacen(&now.to_string(), &(now + 1).to_string(), 1);
            assert!(!check(&key, &moved, now + 5), "altered time");
            for junk in [
                "",
                "aaaa",
                "1.2",
                "x.00ff.",
                &format!("{t}.extra"),
                &format!("{now}.00ff.{mac}.x"),
            ] {
                assert!(!check(&key, junk, now), "{junk:?}");
            }
        }
    }
}

/// Refuses a tenant's session on an operator page.
pub(super) fn operator_only(v: &Visitor) -> Result<(), PageError> {
    if v.is_tenant() {
        return Err(PageError {
            status: StatusCode::FORBIDDEN,
            message: "This page is the operator's.".into(),
        });
    }
    Ok(())
}

#[derive(Deserialize)]
pub(super) struct CsrfForm {
    pub(super) csrf: Option<String>,
}

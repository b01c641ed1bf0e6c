//! The dashboard: server-rendered pages for tenants and the operator, served by the gateway
//! under `/dashboard` and built into the binary (templates, stylesheet and script are
//! `include_str!`ed; charts are SVG drawn on the server).
//!
//! * **Sign-in**: a tenant's member signs in with its tenant, e-mail and password (Argon2id;
//!   [`hearth_tenants::members`]), having joined through an invitation link; the operator
//!   with the admin token. An API key or JWT with the `manage` scope still opens a session
//!   for a tenant that has no members yet (bootstrap, installations without people
//!   accounts); once a tenant has members its keys are for programs only. Each sign-in
//!   becomes a server-side session ([`hearth_tenants::sessions`]): the cookie
//!   `hearth_session` holds a random token (HttpOnly, SameSite=Strict, Path=/dashboard, and
//!   Secure when the request came over TLS: `X-Forwarded-Proto: https`); the database holds
//!   its hash. Sessions end on sign-out, after 30 minutes idle, after 12 hours, or with their
//!   credential (a revoked key, a JWT's `exp`, a changed admin token, a removed member).
//! * **Roles**: a member's session acts as [`Actor::Member`]; the management service's role
//!   table decides, and pages hide what the role may not do.
//! * **CSRF**: every POST carries the session's token (a form field or `x-csrf-token`),
//!   compared in constant time, and is refused when `Origin` or `Sec-Fetch-Site` says it
//!   came from another site. Sign-in and accepting an invitation carry a token the server
//!   issued, from a cookie set with the form (double submit), so a third party cannot sign a
//!   browser into its own account.
//! * **CSP**: `default-src 'none'`; scripts, styles and images only from the dashboard
//!   itself, no inline script, no framing. Every value a template prints is HTML-escaped
//!   (minijinja's auto-escaping for `.html` templates); nothing is marked safe.
//! * **Isolation**: a tenant session acts as [`Actor::Tenant`] through the management
//!   service and reads the ledger by its own tenant id only; operator pages need an operator
//!   session.
//!
//! Every change goes through [`crate::management::Management`] with the dashboard's
//! [`Origin`], so it lands in the audit log like the API's and the CLI's.

mod sso;
pub mod views;

use std::sync::{Arc, OnceLock};

use axum::body::Bytes;
use axum::extract::{FromRequestParts, Path, Query, Request, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::{Form, Json, Router};
use hearth_billing::{format_nusd, month_of};
use hearth_tenants::members::{MemberContext, Role};
use hearth_tenants::sessions::{admin_fingerprint, Session, SessionKind};
use hearth_tenants::{constant_time_eq, now_ms, AuthError, KeySpec, Scopes, TenantContext};
use minijinja::{context, Environment};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::auth::client_address;
use crate::error::ApiError;
use crate::management::{allows, Actor, Origin, Permission, Upload};
use crate::state::AppState;

const SESSION_COOKIE: &str = "hearth_session";
const LOGIN_COOKIE: &str = "hearth_login";

/// The policy on every dashboard response: nothing inline, nothing from elsewhere.
pub const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
     connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'";

pub fn router() -> Router<Arc<AppState>> {
    Router::new()
        .route("/", get(home))
        .route("/login", get(login_form).post(login))
        .route("/logout", post(logout))
        .route("/sso", get(sso::start_tenant))
        .route("/sso/operator", get(sso::start_operator))
        .route("/sso/callback", get(sso::callback))
        .route("/sso/cli-token", post(sso::cli_token))
        .route("/sso/cli-logout", post(sso::cli_logout))
        .route("/invite/{token}", get(invitation_form).post(accept_invitation))
        .route("/members", get(members).post(invite_member))
        .route("/members/{id}/{action}", post(member_action))
        .route("/invitations/{id}/revoke", post(revoke_invitation))
        .route("/tenants", post(create_tenant))
        .route("/prices", post(set_price))
        .route("/models", post(add_model))
        .route("/models/{model}/remove", post(remove_model))
        .route("/tenants/{tenant}", get(tenant_page))
        .route("/tenants/{tenant}/{action}", post(tenant_action))
        .route("/tenants/{tenant}/keys", post(tenant_create_key))
        .route("/tenants/{tenant}/keys/{key}/revoke", post(tenant_revoke_key))
        .route("/tenants/{tenant}/members/{id}/{action}", post(tenant_member_action))
        .route("/tenants/{tenant}/export", get(tenant_export))
        .route(
            "/tenants/{tenant}/processors",
            get(tenant_processors)
                .post(tenant_upload_processor)
                .layer(crate::admin::upload_limit()),
        )
        .route(
            "/tenants/{tenant}/processors/{id}/{action}",
            post(tenant_processor_action),
        )
        .route("/requests", get(requests))
        .route("/keys", get(keys).post(create_key))
        .route("/keys/{id}/revoke", post(revoke_key))
        .route(
            "/processors",
            get(processors)
                .post(upload_processor)
                .layer(crate::admin::upload_limit()),
        )
        .route("/processors/{id}/{action}", post(processor_action))
        .route(
            "/adapters",
            get(adapters)
                .post(upload_adapter)
                .layer(crate::adapters::upload_limit()),
        )
        .route("/adapters/{id}/delete", post(delete_adapter))
        .route("/batches", get(batches))
        .route("/batches/{id}/cancel", post(cancel_batch))
        .route("/files/{id}", get(download_file))
        .route("/export", get(export))
        .route("/audit", get(audit))
        .route("/static/app.css", get(css))
        .route("/static/app.js", get(js))
        .layer(middleware::from_fn(headers))
}

/// Headers on every dashboard response.
async fn headers(req: Request, next: Next) -> Response {
    let mut resp = next.run(req).await;
    let h = resp.headers_mut();
    h.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(CSP));
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    // Browsers then send a real `Origin` on the dashboard's own form posts (under
    // `no-referrer` it is "null"); nothing leaks to other sites.
    h.insert(header::REFERRER_POLICY, HeaderValue::from_static("same-origin"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert("cross-origin-opener-policy", HeaderValue::from_static("same-origin"));
    resp
}

// ---- templates ---------------------------------------------------------------------------

fn env() -> &'static Environment<'static> {
    static ENV: OnceLock<Environment<'static>> = OnceLock::new();
    ENV.get_or_init(|| {
        let mut env = Environment::new();
        // `.html` templates escape every printed value (minijinja's default callback).
        for (name, src) in [
            ("base.html", include_str!("templates/base.html")),
            ("login.html", include_str!("templates/login.html")),
            ("continue.html", include_str!("templates/continue.html")),
            ("invite.html", include_str!("templates/invite.html")),
            ("members.html", include_str!("templates/members.html")),
            ("invited.html", include_str!("templates/invited.html")),
            ("overview.html", include_str!("templates/overview.html")),
            ("chart.html", include_str!("templates/chart.html")),
            ("requests.html", include_str!("templates/requests.html")),
            ("keys.html", include_str!("templates/keys.html")),
            ("key_created.html", include_str!("templates/key_created.html")),
            ("processors.html", include_str!("templates/processors.html")),
            ("adapters.html", include_str!("templates/adapters.html")),
            ("batches.html", include_str!("templates/batches.html")),
            ("audit.html", include_str!("templates/audit.html")),
            ("operator.html", include_str!("templates/operator.html")),
            ("tenant.html", include_str!("templates/tenant.html")),
            ("error.html", include_str!("templates/error.html")),
        ] {
            env.add_template(name, src).expect("dashboard templates parse");
        }
        env.add_filter("time", |ms: i64| iso_time(ms));
        env
    })
}

fn iso_time(ms: i64) -> String {
    let secs = ms.rem_euclid(86_400_000) / 1000;
    format!(
        "{} {:02}:{:02}:{:02}",
        hearth_billing::day_of(ms),
        secs / 3600,
        secs / 60 % 60,
        secs % 60
    )
}

fn page(status: StatusCode, name: &str, ctx: minijinja::Value) -> Response {
    match env().get_template(name).and_then(|t| t.render(ctx)) {
        Ok(html) => (status, [(header::CONTENT_TYPE, "text/html; charset=utf-8")], html).into_response(),
        Err(e) => {
            tracing::error!(template = name, error = %e, "dashboard template failed");
            (StatusCode::INTERNAL_SERVER_ERROR, "the page could not be rendered").into_response()
        }
    }
}

/// A page-level error: an HTML page with the message (escaped) and the status.
struct PageError {
    status: StatusCode,
    message: String,
}

impl From<ApiError> for PageError {
    fn from(e: ApiError) -> Self {
        Self {
            status: e.status,
            message: e.message,
        }
    }
}

impl From<crate::management::ManageError> for PageError {
    fn from(e: crate::management::ManageError) -> Self {
        ApiError::from(e).into()
    }
}

impl IntoResponse for PageError {
    fn into_response(self) -> Response {
        page(
            self.status,
            "error.html",
            context! {message => self.message, status => self.status.as_u16()},
        )
    }
}

// ---- sessions ----------------------------------------------------------------------------

fn cookie<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|c| c.trim().split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v)
}

/// Whether the client reached us over TLS: a terminating proxy says so, or the public URL
/// is `https`.
fn over_tls(gw: &AppState, headers: &HeaderMap) -> bool {
    gw.public_origin.as_deref().is_some_and(|o| o.starts_with("https://"))
        || headers
            .get("x-forwarded-proto")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.eq_ignore_ascii_case("https"))
}

fn set_cookie(gw: &AppState, headers: &HeaderMap, name: &str, value: &str, max_age_s: i64) -> HeaderValue {
    let secure = if over_tls(gw, headers) { "; Secure" } else { "" };
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
    fn actor(&self) -> Actor<'_> {
        match &self.who {
            Who::Operator => Actor::Operator,
            Who::Credential(ctx) => Actor::Tenant(ctx),
            Who::Member(m) => Actor::Member(m),
        }
    }

    fn is_tenant(&self) -> bool {
        !matches!(self.who, Who::Operator)
    }

    fn tenant(&self) -> Result<&TenantContext, PageError> {
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
    fn can(&self, p: Permission) -> bool {
        match &self.who {
            Who::Member(m) => allows(m.member.role, p),
            _ => true,
        }
    }

    fn base(&self) -> minijinja::Value {
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

fn suspended_message(tenant: &str) -> String {
    format!("Tenant {tenant:?} is suspended: ask the platform's operator.")
}

/// Refuses a member of a suspended tenant at sign-in (a good password or identity, so it
/// does not count against the throttle).
async fn refuse_if_suspended(gw: &AppState, headers: &HeaderMap, tenant_id: &str) -> Option<Response> {
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
fn same_origin(gw: &AppState, headers: &HeaderMap) -> bool {
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

fn csrf_ok(gw: &AppState, v: &Visitor, headers: &HeaderMap, presented: Option<&str>) -> Result<(), ApiError> {
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

// ---- sign-in -------------------------------------------------------------------------------

async fn home(v: Result<Visitor, Unauthenticated>, State(gw): State<Arc<AppState>>, q: Query<RangeQuery>) -> Response {
    match v {
        Err(e) => e.into_response(),
        Ok(v) if v.is_tenant() => overview(&gw, &v, &q).await.into_response(),
        Ok(v) => operator(&gw, &v).await.into_response(),
    }
}

async fn login_page(gw: &AppState, headers: &HeaderMap, status: StatusCode, error: Option<&str>) -> Response {
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
async fn signed_form(
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
mod login_token {
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

async fn login_form(State(gw): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    login_page(&gw, &headers, StatusCode::OK, None).await
}

#[derive(Deserialize)]
struct LoginForm {
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
async fn pre_session_checks(
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
fn sign_in_failed(gw: &AppState, extensions: &axum::http::Extensions) {
    if let (Some(ip), Some(throttle)) = (crate::auth::peer_ip(extensions), gw.auth_throttle.as_ref()) {
        throttle.failed(ip);
    }
}

/// Sets the session cookie of a session just opened and goes to the dashboard. After an
/// identity provider's redirect (`via_provider`), the way on is a page of ours rather than a
/// redirect: a browser does not send the SameSite=Strict cookie on a redirect chain that
/// another site started, but does on a navigation our own page starts.
async fn session_opened(
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
                sso::continue_page("Signed in", "/dashboard")
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
async fn open_member_session(
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

async fn login(
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
    if let Some(email) = form.email.as_deref().filter(|e| !e.trim().is_empty()) {
        let tenant = form.tenant.as_deref().unwrap_or("").trim();
        let password = form.password.unwrap_or_default();
        let found = match gw.tenants.member_for_sign_in(tenant, email).await {
            Ok(found) => found,
            Err(e) => {
                tracing::error!(error = %e, "member store unavailable");
                return login_page(
                    &gw,
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
        let ok = match crate::management::password_work(move || {
            hearth_tenants::members::verify_password(hash.as_deref(), &password)
        })
        .await
        {
            Ok(ok) => ok,
            Err(e) => {
                let e = ApiError::from(e);
                return login_page(&gw, headers, e.status, Some(&e.message)).await;
            }
        };
        let Some(member) = member.filter(|_| ok) else {
            sign_in_failed(&gw, &extensions);
            return login_page(
                &gw,
                headers,
                StatusCode::UNAUTHORIZED,
                Some("Wrong tenant, e-mail address or password."),
            )
            .await;
        };
        if let Some(refused) = refuse_if_suspended(&gw, headers, &member.tenant_id).await {
            return refused;
        }
        let opened = open_member_session(&gw, &member, origin, "password").await;
        return session_opened(&gw, headers, opened, false).await;
    }
    let credential = form.credential.as_deref().unwrap_or("").trim();
    let admin = gw.admin_token.as_deref().filter(|t| !t.is_empty());
    let opened = if admin.is_some_and(|t| constant_time_eq(credential.as_bytes(), t.as_bytes())) {
        let kind = SessionKind::Operator {
            admin_fp: admin_fingerprint(credential),
        };
        let s = gw.tenants.create_session(kind, None, address.as_deref()).await;
        if s.is_ok() {
            gw.management()
                .via(origin)
                .audit(Actor::Operator, None, "session.sign_in", "dashboard", json!({}))
                .await;
        }
        s
    } else {
        let ctx = match gw.tenants.authenticate(credential).await {
            Ok(ctx) => ctx,
            Err(AuthError::Store(e)) => {
                tracing::error!(error = %e, "key store unavailable");
                return login_page(
                    &gw,
                    headers,
                    StatusCode::SERVICE_UNAVAILABLE,
                    Some("Sign-in is temporarily unavailable."),
                )
                .await;
            }
            Err(AuthError::Suspended(t)) => {
                return login_page(&gw, headers, StatusCode::FORBIDDEN, Some(&suspended_message(&t))).await;
            }
            Err(e) => {
                sign_in_failed(&gw, &extensions);
                let why = match e {
                    AuthError::Revoked => "This API key has been revoked.",
                    AuthError::Expired(_) => "This credential has expired.",
                    _ => "That is not a valid API key, JWT or admin token.",
                };
                return login_page(&gw, headers, StatusCode::UNAUTHORIZED, Some(why)).await;
            }
        };
        if !ctx.scopes.manage {
            return login_page(
                &gw,
                headers,
                StatusCode::FORBIDDEN,
                Some("This credential lacks the 'manage' scope the dashboard needs."),
            )
            .await;
        }
        // Once a tenant has members, people sign in as themselves: its keys are for programs.
        match gw.tenants.has_members(&ctx.tenant_id).await {
            Ok(false) => {}
            Ok(true) => {
                return login_page(
                    &gw,
                    headers,
                    StatusCode::FORBIDDEN,
                    Some("This tenant has members: sign in with your e-mail address and password. API keys are for programs."),
                )
                .await
            }
            Err(e) => {
                tracing::error!(error = %e, "member store unavailable");
                return login_page(
                    &gw,
                    headers,
                    StatusCode::SERVICE_UNAVAILABLE,
                    Some("Sign-in is temporarily unavailable."),
                )
                .await;
            }
        }
        let kind = SessionKind::Tenant {
            tenant_id: ctx.tenant_id.clone(),
            credential: ctx.key_id.clone(),
            scopes: ctx.scopes,
            models: ctx.models.as_ref().map(|m| m.to_vec()),
        };
        let s = gw
            .tenants
            .create_session(kind, ctx.expires_at, address.as_deref())
            .await;
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
        s
    };
    session_opened(&gw, headers, opened, false).await
}

// ---- invitations and members -------------------------------------------------------------

async fn invitation_form(State(gw): State<Arc<AppState>>, headers: HeaderMap, Path(token): Path<String>) -> Response {
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
        Err(e) => return PageError::from(crate::error::store_error(e)).into_response(),
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
struct AcceptForm {
    password: String,
    confirm: String,
    login_csrf: String,
}

async fn accept_invitation(
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
fn role_field(role: Option<&str>) -> Result<Role, ApiError> {
    Role::parse(role.unwrap_or("")).ok_or_else(|| ApiError::invalid("role", "unknown role"))
}

/// The link that accepts an invitation: `<link base>/dashboard/invite/<token>`.
pub(crate) fn invite_link(gw: &AppState, headers: &HeaderMap, token: &str) -> String {
    format!("{}/dashboard/invite/{token}", link_base(gw, headers))
}

/// The base of links this gateway hands out: the public URL, else the request's own
/// scheme and `Host`.
fn link_base(gw: &AppState, headers: &HeaderMap) -> String {
    if let Some(o) = &gw.public_origin {
        return o.clone();
    }
    let host = headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .unwrap_or("localhost");
    let scheme = if over_tls(gw, headers) { "https" } else { "http" };
    format!("{scheme}://{host}")
}

async fn members(v: Visitor, State(gw): State<Arc<AppState>>) -> Result<Response, PageError> {
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
fn role_table() -> Value {
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
struct InviteForm {
    csrf: Option<String>,
    email: String,
    role: String,
}

async fn invite_member(
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
    let link = invite_link(&gw, &headers, &token);
    Ok(page(
        StatusCode::CREATED,
        "invited.html",
        context! {base => v.base(), page => "members", link => link, invitation => inv},
    ))
}

#[derive(Deserialize)]
struct MemberForm {
    csrf: Option<String>,
    role: Option<String>,
}

async fn member_action(
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

async fn revoke_invitation(
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

#[derive(Deserialize)]
struct CsrfForm {
    csrf: Option<String>,
}

async fn logout(v: Visitor, State(gw): State<Arc<AppState>>, headers: HeaderMap, Form(f): Form<CsrfForm>) -> Response {
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

// ---- tenant pages ----------------------------------------------------------------------------

#[derive(Deserialize, Default)]
struct RangeQuery {
    range: Option<String>,
}

async fn overview(gw: &AppState, v: &Visitor, q: &RangeQuery) -> Result<Response, PageError> {
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
        .map_err(crate::error::ledger_error)?;
    let prices = gw.ledger.prices(None).await.map_err(crate::error::ledger_error)?;
    let view = views::usage_view(&rows, &prices, range, now);
    let month = month_of(now);
    let spent = gw
        .ledger
        .month_spend(&ctx.tenant_id, &month)
        .await
        .map_err(crate::error::ledger_error)?;
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
    Ok(page(
        StatusCode::OK,
        "overview.html",
        context! {
            base => v.base(), page => "overview", usage => view,
            month => month, spent_usd => format_nusd(spent), budget => budget,
            tenant_limits => limits(ctx.tenant_limits), key_limits => limits(ctx.key_limits),
            from => from, to => to,
        },
    ))
}

async fn requests(v: Visitor, State(gw): State<Arc<AppState>>) -> Result<Response, PageError> {
    let ctx = v.tenant()?;
    gw.ledger.flush().await;
    let rows = gw
        .ledger
        .recent(Some(&ctx.tenant_id), 100)
        .await
        .map_err(crate::error::ledger_error)?;
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

async fn keys(v: Visitor, State(gw): State<Arc<AppState>>) -> Result<Response, PageError> {
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
struct NewKeyForm {
    csrf: Option<String>,
    name: Option<String>,
    scope_inference: Option<String>,
    scope_manage: Option<String>,
    models: Option<String>,
    expires_days: Option<String>,
}

async fn create_key(
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
fn key_spec(f: NewKeyForm) -> Result<KeySpec, ApiError> {
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

async fn revoke_key(
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

async fn processors(v: Visitor, State(gw): State<Arc<AppState>>) -> Result<Response, PageError> {
    v.tenant()?;
    processors_page(&gw, &v, v.actor(), None).await
}

/// `GET /dashboard/tenants/{tenant}/processors`: a tenant's processors, for the operator.
async fn tenant_processors(
    v: Visitor,
    State(gw): State<Arc<AppState>>,
    Path(tenant): Path<String>,
) -> Result<Response, PageError> {
    operator_only(&v)?;
    let t = gw.tenants.tenant(&tenant).await.map_err(crate::error::store_error)?;
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
struct UploadQuery {
    name: Option<String>,
    activate: Option<bool>,
}

/// The dashboard's upload: the component as the raw body (sent by `app.js` with the CSRF
/// header); answers JSON like the API.
async fn upload_processor(
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
async fn tenant_upload_processor(
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
    let t = gw.tenants.tenant(&tenant).await.map_err(crate::error::store_error)?;
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
struct ProcessorForm {
    csrf: Option<String>,
    key_id: Option<String>,
}

async fn processor_action(
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
async fn tenant_processor_action(
    v: Visitor,
    State(gw): State<Arc<AppState>>,
    headers: HeaderMap,
    Path((tenant, id, action)): Path<(String, String, String)>,
    Form(f): Form<ProcessorForm>,
) -> Result<Response, PageError> {
    csrf_ok(&gw, &v, &headers, f.csrf.as_deref())?;
    operator_only(&v)?;
    let t = gw.tenants.tenant(&tenant).await.map_err(crate::error::store_error)?;
    let p = gw.tenants.processor(&id).await.map_err(crate::error::store_error)?;
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
async fn adapters(v: Visitor, State(gw): State<Arc<AppState>>) -> Result<Response, PageError> {
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
async fn upload_adapter(
    v: Visitor,
    State(gw): State<Arc<AppState>>,
    headers: HeaderMap,
    form: crate::adapters::Form,
) -> Result<Response, PageError> {
    // The origin before the form is read; the token (a field of the form) once it is.
    if !same_origin(&gw, &headers) {
        return Err(ApiError::permission("csrf_failed", "This request did not come from a dashboard page.").into());
    }
    let (up, csrf) = crate::adapters::read_form_with_csrf(form).await?;
    csrf_ok(&gw, &v, &headers, csrf.as_deref())?;
    v.tenant()?;
    gw.management()
        .via(v.origin.clone())
        .upload_adapter(v.actor(), None, up)
        .await?;
    Ok(Redirect::to("/dashboard/adapters").into_response())
}

async fn delete_adapter(
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
async fn batches(v: Visitor, State(gw): State<Arc<AppState>>) -> Result<Response, PageError> {
    let t = v.tenant()?;
    v.actor().require(Permission::Read)?;
    let list = crate::batches::tenant_batches(&gw, t).await?;
    Ok(page(
        StatusCode::OK,
        "batches.html",
        context! { base => v.base(), page => "batches", batches => list },
    ))
}

async fn cancel_batch(
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
async fn download_file(
    v: Visitor,
    State(gw): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<Response, PageError> {
    let t = v.tenant()?;
    v.actor().require(Permission::ManageKeys)?;
    let (f, bytes) = gw
        .tenants
        .file_content(&t.tenant_id, &id)
        .await
        .map_err(crate::error::store_error)?;
    Ok(crate::batches::download(&f, bytes))
}

/// The billing export, exactly as `GET /v1/tenant/usage/export` renders it.
async fn export(
    v: Visitor,
    State(gw): State<Arc<AppState>>,
    q: Result<Query<crate::admin::ExportQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, PageError> {
    v.tenant()?;
    let Query(q) = q.map_err(|e| ApiError::invalid("query", e.body_text()))?;
    Ok(crate::admin::export_response(&gw, v.actor(), &q).await?)
}

async fn audit(v: Visitor, State(gw): State<Arc<AppState>>) -> Result<Response, PageError> {
    let entries = gw.management().audit_log(v.actor(), None, 200).await?;
    Ok(page(
        StatusCode::OK,
        "audit.html",
        context! {base => v.base(), page => "audit", entries => entries},
    ))
}

// ---- operator -----------------------------------------------------------------------------

async fn operator(gw: &AppState, v: &Visitor) -> Result<Response, PageError> {
    let month = month_of(now_ms());
    gw.ledger.flush().await;
    let spends = gw
        .ledger
        .month_spends(&month)
        .await
        .map_err(crate::error::ledger_error)?;
    let tenants = gw.tenants.list_tenants().await.map_err(crate::error::store_error)?;
    let budgets = gw.tenants.budgets().await.map_err(crate::error::store_error)?;
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
        .map_err(crate::error::ledger_error)?
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

/// Refuses a tenant's session on an operator page.
fn operator_only(v: &Visitor) -> Result<(), PageError> {
    if v.is_tenant() {
        return Err(PageError {
            status: StatusCode::FORBIDDEN,
            message: "This page is the operator's.".into(),
        });
    }
    Ok(())
}

#[derive(Deserialize)]
struct NameForm {
    csrf: Option<String>,
    name: String,
}

async fn create_tenant(
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
struct PriceForm {
    csrf: Option<String>,
    model: String,
    input: String,
    cached_input: String,
    output: String,
    processor: Option<String>,
}

/// A new price version from now (the admin API's `POST /admin/v1/prices`; an empty
/// processor rate carries the model's current one over).
async fn set_price(
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
        .map_err(crate::error::ledger_error)?;
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
struct ModelForm {
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
async fn add_model(
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
    crate::admin::add_catalogue_model(&gw, v.origin.clone(), spec).await?;
    Ok(Redirect::to("/dashboard#models").into_response())
}

/// `POST /dashboard/models/{model}/remove`.
async fn remove_model(
    v: Visitor,
    State(gw): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(model): Path<String>,
    Form(f): Form<CsrfForm>,
) -> Result<Response, PageError> {
    csrf_ok(&gw, &v, &headers, f.csrf.as_deref())?;
    operator_only(&v)?;
    crate::admin::remove_catalogue_model(&gw, v.origin.clone(), &model).await?;
    Ok(Redirect::to("/dashboard#models").into_response())
}

/// The operator's view of one tenant: the last 30 days' usage, cost, cache hit rate,
/// latency and errors by code; its budget and limits (editable), keys (revocable), members
/// (invite), identity provider and JWT issuers (set, remove), and suspension.
async fn tenant_page(
    v: Visitor,
    State(gw): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(tenant): Path<String>,
) -> Result<Response, PageError> {
    operator_only(&v)?;
    let t = gw.tenants.tenant(&tenant).await.map_err(crate::error::store_error)?;
    let now = now_ms();
    let range = views::Range::parse(Some("30d"));
    let (from, to) = range.window(now);
    gw.ledger.flush().await;
    let rows = gw
        .ledger
        .rows(&t.id, from, to)
        .await
        .map_err(crate::error::ledger_error)?;
    let prices = gw.ledger.prices(None).await.map_err(crate::error::ledger_error)?;
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
        .map_err(crate::error::ledger_error)?;
    let budget = gw
        .tenants
        .budget(&t.id)
        .await
        .map_err(crate::error::store_error)?
        .map(|b| json!({"monthly_usd": format_nusd(b.monthly_nusd), "mode": if b.hard {"hard"} else {"soft"}}));
    let limits = gw
        .tenants
        .tenant_limits(&t.id)
        .await
        .map_err(crate::error::store_error)?;
    let m = gw.management();
    let keys = m.list_keys(Actor::Operator, Some(&t.id)).await?;
    let (members, _) = m.list_members(Actor::Operator, Some(&t.id)).await?;
    let sso = gw.tenants.sso(&t.id).await.map_err(crate::error::store_error)?;
    let issuers = gw
        .tenants
        .list_issuers(Some(&t.id))
        .await
        .map_err(crate::error::store_error)?;
    let callback = format!("{}/dashboard/sso/callback", link_base(&gw, &headers));
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
struct TenantForm {
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

async fn tenant_action(
    v: Visitor,
    State(gw): State<Arc<AppState>>,
    headers: HeaderMap,
    Path((tenant, action)): Path<(String, String)>,
    Form(f): Form<TenantForm>,
) -> Result<Response, PageError> {
    csrf_ok(&gw, &v, &headers, f.csrf.as_deref())?;
    operator_only(&v)?;
    let t = gw.tenants.tenant(&tenant).await.map_err(crate::error::store_error)?;
    let m = gw.management().via(v.origin.clone());
    match action.as_str() {
        "budget" => {
            let b = crate::admin::parse_budget(f.monthly_usd.as_deref(), f.mode.as_deref())?;
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
            let link = invite_link(&gw, &headers, &token);
            return Ok(page(
                StatusCode::CREATED,
                "invited.html",
                context! {base => v.base(), page => "overview", link => link, invitation => inv},
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
            let issuer = gw.tenants.issuer(&id).await.map_err(crate::error::store_error)?;
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
async fn tenant_create_key(
    v: Visitor,
    State(gw): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(tenant): Path<String>,
    Form(f): Form<NewKeyForm>,
) -> Result<Response, PageError> {
    csrf_ok(&gw, &v, &headers, f.csrf.as_deref())?;
    operator_only(&v)?;
    let t = gw.tenants.tenant(&tenant).await.map_err(crate::error::store_error)?;
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
async fn tenant_member_action(
    v: Visitor,
    State(gw): State<Arc<AppState>>,
    headers: HeaderMap,
    Path((tenant, id, action)): Path<(String, String, String)>,
    Form(f): Form<MemberForm>,
) -> Result<Response, PageError> {
    csrf_ok(&gw, &v, &headers, f.csrf.as_deref())?;
    operator_only(&v)?;
    let t = gw.tenants.tenant(&tenant).await.map_err(crate::error::store_error)?;
    let member = gw.tenants.member(&id).await.map_err(crate::error::store_error)?;
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
async fn tenant_export(
    v: Visitor,
    State(gw): State<Arc<AppState>>,
    Path(tenant): Path<String>,
    q: Result<Query<crate::admin::ExportQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, PageError> {
    operator_only(&v)?;
    let t = gw.tenants.tenant(&tenant).await.map_err(crate::error::store_error)?;
    let Query(mut q) = q.map_err(|e| ApiError::invalid("query", e.body_text()))?;
    q.tenant = Some(t.id);
    Ok(crate::admin::export_response(&gw, Actor::Operator, &q).await?)
}

async fn tenant_revoke_key(
    v: Visitor,
    State(gw): State<Arc<AppState>>,
    headers: HeaderMap,
    Path((tenant, key)): Path<(String, String)>,
    Form(f): Form<CsrfForm>,
) -> Result<Response, PageError> {
    csrf_ok(&gw, &v, &headers, f.csrf.as_deref())?;
    operator_only(&v)?;
    let t = gw.tenants.tenant(&tenant).await.map_err(crate::error::store_error)?;
    let k = gw.tenants.key(&key).await.map_err(crate::error::store_error)?;
    if k.tenant_id != t.id {
        return Err(ApiError::not_found(format!("API key {key:?} does not exist")).into());
    }
    gw.management()
        .via(v.origin.clone())
        .revoke_key(Actor::Operator, &key)
        .await?;
    Ok(Redirect::to(&format!("/dashboard/tenants/{}", t.id)).into_response())
}

// ---- assets -------------------------------------------------------------------------------

async fn css() -> Response {
    (
        [(header::CONTENT_TYPE, "text/css; charset=utf-8")],
        include_str!("static/app.css"),
    )
        .into_response()
}

async fn js() -> Response {
    (
        [(header::CONTENT_TYPE, "text/javascript; charset=utf-8")],
        include_str!("static/app.js"),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    /// Every template parses (a syntax error would otherwise surface as a panic on the
    /// first page view), and the role table renders one row per permission.
    #[test]
    fn templates_parse_and_the_role_table_renders() {
        let env = super::env();
        assert!(env.templates().count() >= 14);
        let t = super::role_table();
        assert_eq!(
            t["rows"].as_array().unwrap().len(),
            crate::management::Permission::ALL.len()
        );
        assert_eq!(t["roles"][4], "viewer");
    }
}

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
//! * **Roles**: a member's session acts as [`Actor::Member`](crate::manage::Actor::Member); the management service's role
//!   table decides, and pages hide what the role may not do.
//! * **CSRF**: every POST carries the session's token (a form field or `x-csrf-token`),
//!   compared in constant time, and is refused when `Origin` or `Sec-Fetch-Site` says it
//!   came from another site. Sign-in and accepting an invitation carry a token the server
//!   issued, from a cookie set with the form (double submit), so a third party cannot sign a
//!   browser into its own account.
//! * **CSP**: `default-src 'none'`; scripts, styles and images only from the dashboard
//!   itself, no inline script, no framing. Every value a template prints is HTML-escaped
//!   (minijinja's auto-escaping for `.html` templates); nothing is marked safe.
//! * **Isolation**: a tenant session acts as [`Actor::Tenant`](crate::manage::Actor::Tenant) through the management
//!   service and reads the ledger by its own tenant id only; operator pages need an operator
//!   session.
//!
//! Every change goes through [`crate::manage::Management`] with the dashboard's
//! [`Origin`](crate::manage::Origin), so it lands in the audit log like the API's and the CLI's.

pub(super) mod login;
mod members;
mod operator;
mod session;
mod sso;
mod tenant;
pub mod views;

use login::{login, login_form};
use members::{accept_invitation, invitation_form, invite_member, logout, member_action, members, revoke_invitation};
use operator::{
    add_model, create_tenant, operator, remove_model, set_price, tenant_action, tenant_create_key, tenant_export,
    tenant_member_action, tenant_page, tenant_revoke_key,
};
use session::{Unauthenticated, Visitor};
use tenant::{
    adapters, audit, batches, cancel_batch, create_key, delete_adapter, download_file, export, keys, overview,
    processor_action, processors, requests, revoke_key, tenant_processor_action, tenant_processors,
    tenant_upload_processor, upload_adapter, upload_processor, RangeQuery,
};

use std::sync::{Arc, OnceLock};

use axum::extract::{Query, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use minijinja::{context, Environment};

use crate::server::error::ApiError;
use crate::state::AppState;

pub(super) const SESSION_COOKIE: &str = "hearth_session";
pub(super) const LOGIN_COOKIE: &str = "hearth_login";

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
                .layer(crate::routes::admin::upload_limit()),
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
                .layer(crate::routes::admin::upload_limit()),
        )
        .route("/processors/{id}/{action}", post(processor_action))
        .route(
            "/adapters",
            get(adapters)
                .post(upload_adapter)
                .layer(crate::manage::adapters::upload_limit()),
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

pub(super) fn page(status: StatusCode, name: &str, ctx: minijinja::Value) -> Response {
    match env().get_template(name).and_then(|t| t.render(ctx)) {
        Ok(html) => (status, [(header::CONTENT_TYPE, "text/html; charset=utf-8")], html).into_response(),
        Err(e) => {
            tracing::error!(template = name, error = %e, "dashboard template failed");
            (StatusCode::INTERNAL_SERVER_ERROR, "the page could not be rendered").into_response()
        }
    }
}

/// A page-level error: an HTML page with the message (escaped) and the status.
pub(super) struct PageError {
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

impl From<crate::manage::ManageError> for PageError {
    fn from(e: crate::manage::ManageError) -> Self {
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

async fn home(v: Result<Visitor, Unauthenticated>, State(gw): State<Arc<AppState>>, q: Query<RangeQuery>) -> Response {
    match v {
        Err(e) => e.into_response(),
        Ok(v) if v.is_tenant() => overview(&gw, &v, &q).await.into_response(),
        Ok(v) => operator(&gw, &v).await.into_response(),
    }
}

/// A page that moves the browser on to `url` (a refresh, and a link for browsers that do
/// not follow it).
fn continue_page(title: &str, url: &str) -> Response {
    page(StatusCode::OK, "continue.html", context! {title => title, url => url})
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

/// The body gate's check for a dashboard upload (see [`crate::gate`]): the visitor is
/// signed in (else the refusal the page would give), and the body is its tenant's (or the
/// operator's).
pub async fn upload_owner(
    gw: &Arc<AppState>,
    parts: &mut axum::http::request::Parts,
) -> Result<crate::server::http::BodyOwner, Response> {
    use crate::server::http::BodyOwner;
    use axum::extract::FromRequestParts;
    let v = Visitor::from_request_parts(parts, gw)
        .await
        .map_err(IntoResponse::into_response)?;
    Ok(match v.tenant() {
        Ok(t) if v.is_tenant() => BodyOwner::Tenant(t.tenant_id.clone()),
        _ => BodyOwner::Operator,
    })
}

#[cfg(test)]
mod tests {
    /// Every template parses (a syntax error would otherwise surface as a panic on the
    /// first page view), and the role table renders one row per permission.
    #[test]
    fn templates_parse_and_the_role_table_renders() {
        let env = super::env();
        assert!(env.templates().count() >= 14);
        let t = super::members::role_table();
        assert_eq!(
            t["rows"].as_array().unwrap().len(),
            crate::manage::Permission::ALL.len()
        );
        assert_eq!(t["roles"][4], "viewer");
    }
}

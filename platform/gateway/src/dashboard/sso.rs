//! Signing into the dashboard through an OpenID Connect provider: a tenant's own
//! (`/dashboard/sso?tenant=NAME`) or the operators' (`/dashboard/sso/operator`).
//!
//! The authorization-code flow with PKCE. Starting it sets the `hearth_sso` cookie, sealed
//! with the installation's sign-in key: when it was issued, whose provider, `state`, `nonce`
//! and the PKCE verifier. The cookie is `SameSite=Lax` (the provider's redirect back is a
//! cross-site navigation, which a strict cookie would miss) and lives ten minutes. The
//! callback takes the code only when the `state` it carries is the cookie's, from a cookie
//! this installation sealed; the ID token is checked by [`hearth_tenants::sso`] (signature
//! under the provider's JWKS, issuer, audience, expiry, this sign-in's nonce, not used
//! before). Then a tenant's identity becomes its member ([`TenantStore::sso_member`]: linked,
//! or an invitation to its verified address) and an operator's verified address must be on
//! the gateway's `--operators` list.
//!
//! Both the way out and the way back are pages with a refresh rather than redirects: the
//! dashboard's CSP (`form-action 'self'`) stops a form's redirect to another site, and a
//! browser does not send the strict session cookie on a redirect chain another site began.
//!
//! [`TenantStore::sso_member`]: hearth_tenants::TenantStore::sso_member

use super::login::{open_member_session, session_opened, sign_in_failed};
use super::session::{cookie, login_page, login_token};
use super::{continue_page, page};

use std::sync::Arc;

use axum::extract::{Query, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::Response;
use hearth_tenants::sessions::SessionKind;
use hearth_tenants::sso::{Pkce, SsoError, SsoMatch, SsoSpec};
use hearth_tenants::{constant_time_eq, now_ms, TenantError};
use minijinja::context;
use serde::Deserialize;
use serde_json::json;

use crate::auth::client_address;
use crate::manage::{Actor, Origin};
use crate::state::AppState;

const SSO_COOKIE: &str = "hearth_sso";
const PURPOSE: &str = "hearth-dashboard-sso";
const FLOW_LIFETIME_MS: i64 = 10 * 60 * 1000;
/// Whose sign-in a flow is, as the flow cookie carries it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum FlowOwner {
    /// A tenant's member, through the tenant's provider (the tenant's id).
    Tenant(String),
    /// An operator, into the dashboard.
    Operator,
    /// An operator, for `hearth admin login` listening on `port` with its PKCE `challenge`.
    Cli { port: u16, challenge: String },
}

impl FlowOwner {
    /// The cookie's field: a tenant id (`tn_…`), `operator` or `cli-<port>-<challenge>`
    /// (none holds a dot, the cookie's separator).
    fn encode(&self) -> String {
        match self {
            FlowOwner::Tenant(id) => id.clone(),
            FlowOwner::Operator => "operator".into(),
            FlowOwner::Cli { port, challenge } => format!("cli-{port}-{challenge}"),
        }
    }

    fn decode(s: &str) -> Option<FlowOwner> {
        if s == "operator" {
            return Some(FlowOwner::Operator);
        }
        if let Some(rest) = s.strip_prefix("cli-") {
            let (port, challenge) = rest.split_once('-')?;
            return Some(FlowOwner::Cli {
                port: port.parse().ok()?,
                challenge: challenge.to_string(),
            });
        }
        s.starts_with("tn_").then(|| FlowOwner::Tenant(s.to_string()))
    }
}

fn flow_cookie(gw: &AppState, headers: &HeaderMap, value: &str, max_age_s: i64) -> HeaderValue {
    let secure = if gw.over_tls(headers) { "; Secure" } else { "" };
    HeaderValue::from_str(&format!(
        "{SSO_COOKIE}={value}; Path=/dashboard/sso; HttpOnly; SameSite=Lax; Max-Age={max_age_s}{secure}"
    ))
    .unwrap_or_else(|_| HeaderValue::from_static(""))
}

/// The callback address the identity provider is given; None without `--public-url` (see
/// [`AppState::link_base`]).
fn redirect_uri(gw: &AppState, headers: &HeaderMap) -> Option<String> {
    Some(format!("{}/dashboard/sso/callback", gw.link_base(headers)?))
}

const NO_PUBLIC_URL: &str =
    "this gateway has no --public-url, and single sign-on's callback address is not built from a request's Host header";

#[derive(Deserialize)]
pub(super) struct StartQuery {
    tenant: Option<String>,
}

/// `GET /dashboard/sso?tenant=NAME`: off to the tenant's identity provider.
pub(super) async fn start_tenant(
    State(gw): State<Arc<AppState>>,
    headers: HeaderMap,
    Query(q): Query<StartQuery>,
) -> Response {
    let name = q.tenant.as_deref().unwrap_or("").trim();
    let not_here = || format!("Tenant {name:?} does not sign in through an identity provider.");
    let tenant = match gw.tenants.tenant(name).await {
        Ok(t) => t,
        Err(TenantError::NoSuchTenant(_) | TenantError::InvalidTenantName(_)) => {
            return login_page(&gw, &headers, StatusCode::NOT_FOUND, Some(&not_here())).await
        }
        Err(e) => return unavailable(&gw, &headers, &e.to_string()).await,
    };
    match gw.tenants.sso_spec(&tenant.id).await {
        Ok(Some((_, spec))) => start(&gw, &headers, &FlowOwner::Tenant(tenant.id), &spec).await,
        Ok(None) => login_page(&gw, &headers, StatusCode::NOT_FOUND, Some(&not_here())).await,
        Err(e) => unavailable(&gw, &headers, &e.to_string()).await,
    }
}

#[derive(Deserialize)]
pub(super) struct OperatorQuery {
    /// `hearth admin login`: the port of its loopback listener, and its PKCE challenge.
    cli_port: Option<u16>,
    cli_challenge: Option<String>,
}

/// `GET /dashboard/sso/operator`: off to the operators' identity provider (for the
/// dashboard, or for `hearth admin login` with `cli_port` and `cli_challenge`).
pub(super) async fn start_operator(
    State(gw): State<Arc<AppState>>,
    headers: HeaderMap,
    Query(q): Query<OperatorQuery>,
) -> Response {
    let whose = match (q.cli_port, q.cli_challenge) {
        (None, None) => FlowOwner::Operator,
        (Some(port), Some(c))
            if port > 0 && c.len() == 43 && c.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_') =>
        {
            FlowOwner::Cli { port, challenge: c }
        }
        _ => {
            return login_page(
                &gw,
                &headers,
                StatusCode::BAD_REQUEST,
                Some("A command-line sign-in needs cli_port and a 43-character S256 cli_challenge."),
            )
            .await
        }
    };
    match &gw.operator_sso {
        Some(o) => start(&gw, &headers, &whose, &o.provider.clone()).await,
        None => {
            login_page(
                &gw,
                &headers,
                StatusCode::NOT_FOUND,
                Some("Operators sign in with the admin token here: no identity provider is configured."),
            )
            .await
        }
    }
}

async fn unavailable(gw: &AppState, headers: &HeaderMap, why: &str) -> Response {
    tracing::error!(error = %why, "single sign-on unavailable");
    login_page(
        gw,
        headers,
        StatusCode::SERVICE_UNAVAILABLE,
        Some("Sign-in is temporarily unavailable."),
    )
    .await
}

/// The provider could not be used: the page says so, the log says why (what a provider or
/// its endpoints answered is not shown to whoever asked).
async fn provider_down(gw: &AppState, headers: &HeaderMap, why: &str) -> Response {
    tracing::warn!(error = %why, "identity provider unusable");
    login_page(
        gw,
        headers,
        StatusCode::BAD_GATEWAY,
        Some("The identity provider could not be reached or answered something unusable; the gateway's log says why."),
    )
    .await
}

async fn start(gw: &AppState, headers: &HeaderMap, whose: &FlowOwner, spec: &SsoSpec) -> Response {
    let d = match gw.tenants.discover(&spec.issuer).await {
        Ok(d) => d,
        Err(e) => return provider_down(gw, headers, &e.to_string()).await,
    };
    let (pkce, state, nonce) = match (
        Pkce::new(),
        hearth_tenants::sso::random_value(),
        hearth_tenants::sso::random_value(),
    ) {
        (Ok(p), Ok(s), Ok(n)) => (p, s, n),
        _ => return unavailable(gw, headers, "the OS random source failed").await,
    };
    let body = format!("{}.{}.{state}.{nonce}.{}", now_ms(), whose.encode(), pkce.verifier);
    let sealed = match login_token::seal(gw, PURPOSE, &body).await {
        Ok(s) => s,
        Err(e) => return unavailable(gw, headers, &e).await,
    };
    let Some(callback) = redirect_uri(gw, headers) else {
        return unavailable(gw, headers, NO_PUBLIC_URL).await;
    };
    let mut url = match reqwest::Url::parse(&d.authorization_endpoint) {
        Ok(u) => u,
        Err(e) => return provider_down(gw, headers, &format!("its authorization endpoint: {e}")).await,
    };
    url.query_pairs_mut()
        .append_pair("response_type", "code")
        .append_pair("client_id", &spec.client_id)
        .append_pair("redirect_uri", &callback)
        .append_pair("scope", "openid email profile")
        .append_pair("state", &state)
        .append_pair("nonce", &nonce)
        .append_pair("code_challenge", &pkce.challenge)
        .append_pair("code_challenge_method", "S256");
    let mut resp = continue_page("Continuing to your identity provider", url.as_str());
    resp.headers_mut().append(
        header::SET_COOKIE,
        flow_cookie(gw, headers, &sealed, FLOW_LIFETIME_MS / 1000),
    );
    resp
}

#[derive(Deserialize)]
pub(super) struct CallbackQuery {
    code: Option<String>,
    state: Option<String>,
    error: Option<String>,
    error_description: Option<String>,
}

/// A flow the callback may finish: from this installation's cookie, fresh, for this state.
struct Flow {
    whose: FlowOwner,
    nonce: String,
    verifier: String,
}

async fn flow(gw: &AppState, headers: &HeaderMap, state: &str) -> Option<Flow> {
    let sealed = cookie(headers, SSO_COOKIE)?;
    let body = login_token::unseal(gw, PURPOSE, sealed).await?;
    let [issued, whose, want_state, nonce, verifier]: [&str; 5] =
        body.split('.').collect::<Vec<_>>().try_into().ok()?;
    let issued: i64 = issued.parse().ok()?;
    let age = now_ms().saturating_sub(issued);
    (age < FLOW_LIFETIME_MS
        && age > -60_000
        && !state.is_empty()
        && constant_time_eq(want_state.as_bytes(), state.as_bytes()))
    .then_some(())?;
    Some(Flow {
        whose: FlowOwner::decode(whose)?,
        nonce: nonce.to_string(),
        verifier: verifier.to_string(),
    })
}

/// `GET /dashboard/sso/callback`: the provider's answer.
pub(super) async fn callback(
    State(gw): State<Arc<AppState>>,
    headers: HeaderMap,
    extensions: axum::http::Extensions,
    Query(q): Query<CallbackQuery>,
) -> Response {
    let headers = &headers;
    let mut resp = finish(&gw, headers, &extensions, q).await;
    // The flow is over either way.
    resp.headers_mut()
        .append(header::SET_COOKIE, flow_cookie(&gw, headers, "", 0));
    resp
}

async fn finish(gw: &AppState, headers: &HeaderMap, extensions: &axum::http::Extensions, q: CallbackQuery) -> Response {
    let Some(flow) = flow(gw, headers, q.state.as_deref().unwrap_or("")).await else {
        return login_page(
            gw,
            headers,
            StatusCode::FORBIDDEN,
            Some("The sign-in expired or did not start here: try again."),
        )
        .await;
    };
    if let Some(error) = q.error {
        let detail = q.error_description.map(|d| format!(" ({d})")).unwrap_or_default();
        return login_page(
            gw,
            headers,
            StatusCode::UNAUTHORIZED,
            Some(&format!("The identity provider did not sign you in: {error}{detail}")),
        )
        .await;
    }
    let code = q.code.unwrap_or_default();
    let tenant_id = match &flow.whose {
        FlowOwner::Tenant(id) => Some(id.as_str()),
        FlowOwner::Operator | FlowOwner::Cli { .. } => None,
    };
    let spec = match tenant_id {
        None => match &gw.operator_sso {
            Some(o) => o.provider.clone(),
            None => return provider_gone(gw, headers).await,
        },
        Some(id) => match gw.tenants.sso_spec(id).await {
            Ok(Some((_, spec))) => spec,
            Ok(None) => return provider_gone(gw, headers).await,
            Err(e) => return unavailable(gw, headers, &e.to_string()).await,
        },
    };
    let Some(callback) = redirect_uri(gw, headers) else {
        return unavailable(gw, headers, NO_PUBLIC_URL).await;
    };
    let who = match gw
        .tenants
        .complete_sso(&spec, &code, &flow.verifier, &callback, &flow.nonce)
        .await
    {
        Ok(who) => who,
        Err(SsoError::Provider(why)) => return provider_down(gw, headers, &why).await,
        Err(SsoError::Refused(why)) => {
            sign_in_failed(gw, extensions);
            tracing::warn!(reason = %why, "single sign-on refused");
            return login_page(gw, headers, StatusCode::UNAUTHORIZED, Some(&why)).await;
        }
        Err(SsoError::Store(e)) => return unavailable(gw, headers, &e.to_string()).await,
    };
    let address = client_address(extensions);
    let origin = Origin::dashboard(address.clone());
    let email = who.verified_email.clone();
    let Some(tenant_id) = tenant_id else {
        let allowed = email.as_deref().filter(|e| {
            gw.operator_sso
                .as_ref()
                .is_some_and(|o| o.operators.iter().any(|op| op == e))
        });
        let Some(email) = allowed else {
            return login_page(
                gw,
                headers,
                StatusCode::FORBIDDEN,
                Some(&format!(
                    "{} is not one of this installation's operators.",
                    email.as_deref().unwrap_or("This identity (no verified e-mail address)")
                )),
            )
            .await;
        };
        if let FlowOwner::Cli { port, challenge } = &flow.whose {
            // Back to the CLI's loopback listener with a one-time code bound to its
            // challenge; the CLI trades it for a session (`cli_token`).
            // Not followed by itself: a link someone else made would sign *their* command line
            // in as this operator, so the operator confirms the code their own CLI printed.
            return match gw.tenants.create_cli_grant(email, challenge).await {
                Ok(code) => page(
                    StatusCode::OK,
                    "continue.html",
                    context! {
                        title => format!("Sign the command line on this computer in as {email}"),
                        url => format!("http://127.0.0.1:{port}/callback?code={code}"),
                        confirm => format!(
                            "Continue only if `hearth admin login` on this computer printed the code {}.",
                            hearth_tenants::sso::cli_code(challenge)
                        ),
                    },
                ),
                Err(e) => unavailable(gw, headers, &e.to_string()).await,
            };
        }
        let kind = SessionKind::OperatorSso {
            email: email.to_string(),
        };
        let opened = gw.tenants.create_session(kind, None, address.as_deref()).await;
        if opened.is_ok() {
            let origin = Origin {
                operator: Some(email.to_string()),
                ..origin
            };
            gw.management()
                .via(origin)
                .audit(
                    Actor::Operator,
                    None,
                    "session.sign_in",
                    "dashboard",
                    json!({"method": "oidc", "issuer": who.issuer}),
                )
                .await;
        }
        return session_opened(gw, headers, opened, true).await;
    };
    // A suspended tenant takes no one in (and its invitations stay for when it resumes).
    if let Some(refused) = super::session::refuse_if_suspended(gw, headers, tenant_id).await {
        return refused;
    }
    match gw.tenants.sso_member(tenant_id, &who).await {
        Ok(Some((member, how))) => {
            let (action, detail) = match how {
                SsoMatch::Linked => (None, json!({})),
                SsoMatch::LinkedNow => (
                    Some("member.link"),
                    json!({"issuer": who.issuer, "subject": who.subject}),
                ),
                SsoMatch::Joined => (
                    Some("member.join"),
                    json!({"email": member.email, "role": member.role, "issuer": who.issuer}),
                ),
            };
            if let Some(action) = action {
                if let Ok(mc) = gw.tenants.member_context(&member.id, &member.tenant_id, now_ms()).await {
                    gw.management()
                        .via(origin.clone())
                        .audit(
                            Actor::Member(&mc),
                            Some(&member.tenant_id),
                            action,
                            &format!("member:{}", member.id),
                            detail,
                        )
                        .await;
                }
            }
            let opened = open_member_session(gw, &member, origin, "oidc").await;
            session_opened(gw, headers, opened, true).await
        }
        Ok(None) => {
            login_page(
                gw,
                headers,
                StatusCode::FORBIDDEN,
                Some(&format!(
                    "{} is not a member of this tenant: ask one of its owners for an invitation.",
                    email.as_deref().unwrap_or("This identity (no verified e-mail address)")
                )),
            )
            .await
        }
        Err(e) => unavailable(gw, headers, &e.to_string()).await,
    }
}

/// The provider the flow began with was removed meanwhile.
async fn provider_gone(gw: &AppState, headers: &HeaderMap) -> Response {
    login_page(
        gw,
        headers,
        StatusCode::NOT_FOUND,
        Some("This identity provider is no longer configured here."),
    )
    .await
}

#[derive(Deserialize)]
pub(super) struct CliTokenRequest {
    code: String,
    verifier: String,
}

/// `POST /dashboard/sso/cli-token` `{"code", "verifier"}`: `hearth admin login` trades the
/// code the browser brought back (with the PKCE verifier only it holds) for an operator
/// session token, which the admin API takes as a bearer token like the admin token. The
/// session lives like a dashboard session (30 minutes idle, 12 hours at most) and ends when
/// the address leaves `--operators`.
pub(super) async fn cli_token(
    State(gw): State<Arc<AppState>>,
    extensions: axum::http::Extensions,
    body: axum::body::Bytes,
) -> Response {
    use axum::response::IntoResponse;
    let peer = crate::auth::peer_ip(&extensions);
    if let (Some(ip), Some(throttle)) = (peer, gw.admin_throttle.as_ref()) {
        if let Err(wait) = throttle.check(ip) {
            gw.metrics.auth_throttled.inc();
            return crate::server::error::ApiError::rate_limited(
                "auth_failures",
                "Too many invalid codes; wait.",
                wait,
            )
            .into_response();
        }
    }
    let req: CliTokenRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return crate::server::error::ApiError::invalid("body", e.to_string()).into_response(),
    };
    let email = match gw.tenants.take_cli_grant(&req.code, &req.verifier).await {
        Ok(e) => e,
        Err(e) => {
            tracing::error!(error = %e, "cli grant store unavailable");
            return crate::server::error::ApiError::unavailable("sign-in is temporarily unavailable").into_response();
        }
    };
    let Some(email) = email.filter(|e| {
        gw.operator_sso
            .as_ref()
            .is_some_and(|o| o.operators.iter().any(|op| op == e))
    }) else {
        if let (Some(ip), Some(throttle)) = (peer, gw.admin_throttle.as_ref()) {
            throttle.failed(ip);
        }
        return crate::server::error::ApiError::unauthorized(
            "Unknown, used or expired code, or not this sign-in's verifier.",
        )
        .into_response();
    };
    let kind = SessionKind::OperatorSso { email: email.clone() };
    let address = client_address(&extensions);
    match gw.tenants.create_session(kind, None, address.as_deref()).await {
        Ok((token, s)) => {
            let origin = Origin {
                operator: Some(email.clone()),
                ..Origin::api(address)
            };
            gw.management()
                .via(origin)
                .audit(
                    Actor::Operator,
                    None,
                    "session.sign_in",
                    "cli",
                    json!({"method": "oidc"}),
                )
                .await;
            axum::Json(json!({"token": token, "expires_at": s.expires_at, "operator": email})).into_response()
        }
        Err(e) => {
            tracing::error!(error = %e, "operator session could not be created");
            crate::server::error::ApiError::unavailable("sign-in is temporarily unavailable").into_response()
        }
    }
}

/// `POST /dashboard/sso/cli-logout` with the session as bearer token: `hearth admin logout`
/// ends the operator session it holds (200 whether or not there was one).
pub(super) async fn cli_logout(State(gw): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    use axum::response::IntoResponse;
    if let Some(token) = crate::auth::bearer(&headers) {
        if let Ok(Some(s)) = gw.tenants.session(token).await {
            if matches!(s.kind, SessionKind::OperatorSso { .. }) {
                if let Err(e) = gw.tenants.end_session(token).await {
                    tracing::error!(error = %e, "operator session could not be ended");
                    return crate::server::error::ApiError::unavailable("sign-out is temporarily unavailable")
                        .into_response();
                }
            }
        }
    }
    axum::Json(json!({"signed_out": true})).into_response()
}

#[cfg(test)]
mod tests {
    use super::FlowOwner;

    #[test]
    fn flow_owners_round_trip_through_the_cookie_field() {
        let challenge = "E9Melhoa2OwvFrEMTJguCHaoeK1t8URWbuGJSstw-cM".to_string();
        for owner in [
            FlowOwner::Tenant("tn_0123456789abcdef".into()),
            FlowOwner::Operator,
            FlowOwner::Cli { port: 41234, challenge },
        ] {
            let field = owner.encode();
            assert!(!field.contains('.'), "{field}");
            assert_eq!(FlowOwner::decode(&field), Some(owner));
        }
        for junk in ["", "admin", "cli-", "cli-x-abc", "cli-70000-abc", "tenant"] {
            assert_eq!(FlowOwner::decode(junk), None, "{junk:?}");
        }
    }
}

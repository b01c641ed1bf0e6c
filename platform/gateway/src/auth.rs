//! Who is asking: one bearer-token parser, the tenant credential check (API key or JWT,
//! then the scope an endpoint needs) and the operator check (the admin token).
//!
//! Both checks are applied by construction, not by each handler: the self-service
//! handlers take a [`Manager`] extractor, and every admin route sits behind
//! [`require_admin`] as a route layer (see [`crate::app`]).

use std::sync::Arc;

use axum::extract::{FromRequestParts, Request, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use hearth_tenants::{constant_time_eq, AuthError, TenantContext};

use crate::manage::Origin;
use crate::server::error::ApiError;
use crate::state::AppState;

/// The token of an `Authorization: Bearer <token>` header (the scheme is
/// case-insensitive); `None` when the header is absent or not a bearer token.
pub fn bearer(headers: &HeaderMap) -> Option<&str> {
    let v = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = v.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

/// The tenant credential a request presents: `Authorization: Bearer <key>`, or (Anthropic's
/// clients) `x-api-key: <key>`. With both, `Authorization` is the credential (a client
/// configured with two credentials may send both; which one counts must not depend on
/// which is valid). `None`: neither header is there.
pub fn credential(headers: &HeaderMap) -> Option<&str> {
    if headers.contains_key(header::AUTHORIZATION) {
        return Some(bearer(headers).unwrap_or(""));
    }
    headers.get("x-api-key").map(|v| v.to_str().unwrap_or("").trim())
}

/// `Authorization: Bearer <API key or JWT>` (or `x-api-key`) → the tenant credential
/// asking; `peer` is the client's address, throttled when it sends too many bad credentials.
pub async fn authenticate(
    state: &AppState,
    headers: &HeaderMap,
    peer: Option<std::net::IpAddr>,
) -> Result<TenantContext, ApiError> {
    let Some(key) = credential(headers) else {
        return Err(ApiError::unauthorized(
            "You didn't provide an API key. Send it as 'Authorization: Bearer <key>' (or 'x-api-key: <key>'); create one with 'hearth admin key create --tenant NAME'.",
        ));
    };
    if let (Some(ip), Some(throttle)) = (peer, state.auth_throttle.as_ref()) {
        // A key known to be good passes even from a throttled address (another client
        // behind the same proxy or NAT may be the one sending bad ones).
        match throttle.check(ip) {
            Err(wait) if !state.tenants.cached_valid(key) => {
                state.metrics.auth_throttled.inc();
                return Err(ApiError::rate_limited(
                    "auth_failures",
                    "Too many invalid credentials from this address; wait before trying again.",
                    wait,
                ));
            }
            _ => {}
        }
    }
    let result = state.tenants.authenticate(key).await;
    if let (Err(e), Some(ip), Some(throttle)) = (&result, peer, state.auth_throttle.as_ref()) {
        if !matches!(e, AuthError::Store(_) | AuthError::Suspended(_)) {
            throttle.failed(ip);
        }
    }
    auth_result(result)
}

fn auth_result(result: Result<TenantContext, AuthError>) -> Result<TenantContext, ApiError> {
    match result {
        Ok(ctx) => Ok(ctx),
        Err(AuthError::Store(e)) => {
            tracing::error!(error = %e, "key store unavailable");
            Err(ApiError::unavailable("authentication is temporarily unavailable"))
        }
        Err(AuthError::Revoked) => Err(ApiError::unauthorized("This API key has been revoked.")),
        Err(AuthError::Suspended(tenant)) => Err(ApiError::permission(
            "tenant_suspended",
            format!("Tenant {tenant:?} is suspended: ask the platform's operator."),
        )),
        Err(AuthError::Expired(_)) => Err(ApiError::unauthorized("This API key has expired.")),
        Err(AuthError::Jwt(why)) => Err(ApiError::unauthorized(format!("Invalid bearer token: {why}."))),
        Err(_) => Err(ApiError::unauthorized("Incorrect API key provided.")),
    }
}

/// The scope an endpoint needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// The model APIs.
    Inference,
    /// `/v1/tenant`: the tenant's own keys, usage, processors.
    Manage,
}

/// [`authenticate`], then `scope`.
pub async fn authorize(
    state: &AppState,
    headers: &HeaderMap,
    peer: Option<std::net::IpAddr>,
    scope: Scope,
) -> Result<TenantContext, ApiError> {
    let ctx = authenticate(state, headers, peer).await?;
    require_scope(ctx, scope)
}

/// The credential a batch's lines run under: the API key that created the batch, as it is
/// now — revoked, expired or suspended refused as for a presented key — with the
/// `inference` scope.
pub async fn batch_credential(state: &AppState, key_id: &str) -> Result<TenantContext, ApiError> {
    require_scope(auth_result(state.tenants.key_context(key_id).await)?, Scope::Inference)
}

fn require_scope(ctx: TenantContext, scope: Scope) -> Result<TenantContext, ApiError> {
    let (ok, name) = match scope {
        Scope::Inference => (ctx.scopes.inference, "inference"),
        Scope::Manage => (ctx.scopes.manage, "manage"),
    };
    if !ok {
        return Err(ApiError::permission(
            "missing_scope",
            format!("This credential lacks the '{name}' scope needed here."),
        ));
    }
    Ok(ctx)
}

/// The key whose own files, batches and stored responses a credential sees: a key
/// restricted to some models sees only what it created itself; None: an unrestricted key
/// sees all of its tenant's.
pub fn own_objects(ctx: &TenantContext) -> Option<&str> {
    ctx.models.is_some().then_some(ctx.key_id.as_str())
}

/// Whether `ctx` sees an object created by `key_id` (see [`own_objects`]).
pub fn sees(ctx: &TenantContext, key_id: Option<&str>) -> bool {
    own_objects(ctx).is_none_or(|own| key_id == Some(own))
}

/// A credential with the `manage` scope: the self-service API's extractor.
pub struct Manager(pub TenantContext);

impl FromRequestParts<Arc<AppState>> for Manager {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &Arc<AppState>) -> Result<Self, ApiError> {
        authorize(state, &parts.headers, peer_ip(&parts.extensions), Scope::Manage)
            .await
            .map(Manager)
    }
}

/// A credential with the `inference` scope (the model listing endpoints).
pub struct Caller(pub TenantContext);

impl FromRequestParts<Arc<AppState>> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &Arc<AppState>) -> Result<Self, ApiError> {
        authorize(state, &parts.headers, peer_ip(&parts.extensions), Scope::Inference)
            .await
            .map(Caller)
    }
}

/// The client's address: the TCP peer (the launchers serve with connect info). A proxy's
/// `X-Forwarded-For` is not trusted: any client can send one.
pub fn client_address(extensions: &axum::http::Extensions) -> Option<String> {
    extensions
        .get::<axum::extract::ConnectInfo<std::net::SocketAddr>>()
        .map(|c| c.0.ip().to_string())
}

/// The client's address as an IP (see [`client_address`]).
pub fn peer_ip(extensions: &axum::http::Extensions) -> Option<std::net::IpAddr> {
    crate::server::http::peer(extensions)
}

/// Where an API management call comes from, for the audit log.
pub struct ClientOrigin(pub Origin);

impl<S: Send + Sync> FromRequestParts<S> for ClientOrigin {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        Ok(Self(Origin {
            operator: parts.extensions.get::<OperatorSignedIn>().map(|o| o.0.clone()),
            ..Origin::api(client_address(&parts.extensions))
        }))
    }
}

/// On an operator route, the operator's address when the bearer token is the session of an
/// operator who signed in through the operators' identity provider (`hearth admin login`)
/// rather than the admin token.
#[derive(Clone)]
pub struct OperatorSignedIn(pub String);

/// The operator an operator session token names, while the address is on `--operators`.
async fn operator_session(state: &AppState, headers: &HeaderMap) -> Option<String> {
    let sso = state.operator_sso.as_ref()?;
    let token = bearer(headers)?;
    let session = state.tenants.session(token).await.ok()??;
    let hearth_tenants::sessions::SessionKind::OperatorSso { email } = session.kind else {
        return None;
    };
    sso.operators.contains(&email).then_some(email)
}

/// The operator check: `Authorization: Bearer $HEARTH_ADMIN_TOKEN`, compared in constant
/// time. Without a configured token every operator route is closed.
pub fn check_admin(state: &AppState, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(token) = state.admin_token.as_deref().filter(|t| !t.is_empty()) else {
        return Err(ApiError::forbidden(
            "the admin API is disabled: start Hearth with HEARTH_ADMIN_TOKEN set",
        ));
    };
    let given = bearer(headers).unwrap_or("");
    if constant_time_eq(given.as_bytes(), token.as_bytes()) {
        Ok(())
    } else {
        Err(ApiError::unauthorized("Missing or incorrect admin token."))
    }
}

/// Route layer in front of every operator route (`/admin/v1/*`, `/metrics`). Wrong admin
/// tokens count against their source address in the operators' own budget
/// (`AppState::admin_throttle`, the same rates as [`AuthThrottle`](crate::policy::throttle::AuthThrottle)); a throttled address gets
/// 429 before its token is compared, even for the right one (else the answer would still tell
/// a guesser when it guessed right). A request without a token is not a guess.
pub async fn require_admin(State(state): State<Arc<AppState>>, mut req: Request, next: Next) -> Response {
    match admit_operator(&state, &mut req).await {
        Ok(()) => next.run(req).await,
        Err(refused) => refused,
    }
}

/// [`require_admin`]'s check (the body gate runs it before a large body is read): marks an
/// operator signed in through the identity provider on the request.
pub async fn admit_operator(state: &AppState, req: &mut Request) -> Result<(), Response> {
    let peer = peer_ip(req.extensions());
    if let (Some(ip), Some(throttle)) = (peer, state.admin_throttle.as_ref()) {
        if let Err(wait) = throttle.check(ip) {
            state.metrics.auth_throttled.inc();
            return Err(ApiError::rate_limited(
                "auth_failures",
                "Too many invalid admin tokens from this address; wait before trying again.",
                wait,
            )
            .into_response());
        }
    }
    match check_admin(state, req.headers()) {
        Ok(()) => Ok(()),
        Err(e) if state.admin_token.is_some() => match operator_session(state, req.headers()).await {
            Some(email) => {
                req.extensions_mut().insert(OperatorSignedIn(email));
                Ok(())
            }
            None => {
                if let (true, Some(ip), Some(throttle)) =
                    (bearer(req.headers()).is_some(), peer, state.admin_throttle.as_ref())
                {
                    throttle.failed(ip);
                }
                Err(e.into_response())
            }
        },
        Err(e) => {
            let guessed = bearer(req.headers()).is_some() && state.admin_token.is_some();
            if let (true, Some(ip), Some(throttle)) = (guessed, peer, state.admin_throttle.as_ref()) {
                throttle.failed(ip);
            }
            Err(e.into_response())
        }
    }
}

/// The tenant a request's credential names, checked quietly (no bad-credential counting:
/// its handler checks it again and answers); None if it names none.
pub async fn quiet_tenant(state: &AppState, headers: &HeaderMap) -> Option<TenantContext> {
    state.tenants.authenticate(credential(headers)?).await.ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_tokens_parse_one_way() {
        let h = |v: &str| {
            let mut m = HeaderMap::new();
            m.insert(header::AUTHORIZATION, v.parse().unwrap());
            m
        };
        assert_eq!(bearer(&h("Bearer abc")), Some("abc"));
        assert_eq!(bearer(&h("bearer abc ")), Some("abc"));
        assert_eq!(bearer(&h("BEARER abc")), Some("abc"));
        assert_eq!(bearer(&h("Basic abc")), None);
        assert_eq!(bearer(&h("Bearer")), None);
        assert_eq!(bearer(&HeaderMap::new()), None);
    }

    /// `Authorization` wins over `x-api-key`: a wrong bearer token beside a good `x-api-key`
    /// is refused, and a malformed `Authorization` is not replaced by `x-api-key`.
    #[test]
    fn authorization_wins_over_x_api_key() {
        let h = |auth: Option<&str>, key: Option<&str>| {
            let mut m = HeaderMap::new();
            if let Some(a) = auth {
                m.insert(header::AUTHORIZATION, a.parse().unwrap());
            }
            if let Some(k) = key {
                m.insert("x-api-key", k.parse().unwrap());
            }
            m
        };
        assert_eq!(credential(&h(None, None)), None);
        assert_eq!(credential(&h(Some("Bearer a"), None)), Some("a"));
        assert_eq!(credential(&h(None, Some(" a "))), Some("a"));
        assert_eq!(credential(&h(Some("Bearer a"), Some("b"))), Some("a"));
        assert_eq!(credential(&h(Some("Basic a"), Some("b"))), Some(""));
    }
}

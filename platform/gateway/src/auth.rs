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

use crate::error::ApiError;
use crate::management::Origin;
use crate::state::AppState;

/// The token of an `Authorization: Bearer <token>` header (the scheme is
/// case-insensitive); `None` when the header is absent or not a bearer token.
pub fn bearer(headers: &HeaderMap) -> Option<&str> {
    let v = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = v.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

/// `Authorization: Bearer <API key or JWT>` → the tenant credential asking.
pub async fn authenticate(state: &AppState, headers: &HeaderMap) -> Result<TenantContext, ApiError> {
    if headers.get(header::AUTHORIZATION).is_none() {
        return Err(ApiError::unauthorized(
            "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'; create one with 'hearth admin key create --tenant NAME'.",
        ));
    }
    let key = bearer(headers).unwrap_or("");
    match state.tenants.authenticate(key).await {
        Ok(ctx) => Ok(ctx),
        Err(AuthError::Store(e)) => {
            tracing::error!(error = %e, "key store unavailable");
            Err(ApiError::unavailable("authentication is temporarily unavailable"))
        }
        Err(AuthError::Revoked) => Err(ApiError::unauthorized("This API key has been revoked.")),
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
pub async fn authorize(state: &AppState, headers: &HeaderMap, scope: Scope) -> Result<TenantContext, ApiError> {
    let ctx = authenticate(state, headers).await?;
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

/// A credential with the `manage` scope: the self-service API's extractor.
pub struct Manager(pub TenantContext);

impl FromRequestParts<Arc<AppState>> for Manager {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &Arc<AppState>) -> Result<Self, ApiError> {
        authorize(state, &parts.headers, Scope::Manage).await.map(Manager)
    }
}

/// A credential with the `inference` scope (the model listing endpoints).
pub struct Caller(pub TenantContext);

impl FromRequestParts<Arc<AppState>> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &Arc<AppState>) -> Result<Self, ApiError> {
        authorize(state, &parts.headers, Scope::Inference).await.map(Caller)
    }
}

/// The client's address: the TCP peer (the launchers serve with connect info). A proxy's
/// `X-Forwarded-For` is not trusted: any client can send one.
pub fn client_address(extensions: &axum::http::Extensions) -> Option<String> {
    extensions
        .get::<axum::extract::ConnectInfo<std::net::SocketAddr>>()
        .map(|c| c.0.ip().to_string())
}

/// Where an API management call comes from, for the audit log.
pub struct ClientOrigin(pub Origin);

impl<S: Send + Sync> FromRequestParts<S> for ClientOrigin {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        Ok(Self(Origin::api(client_address(&parts.extensions))))
    }
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

/// Route layer in front of every operator route (`/admin/v1/*`, `/metrics`).
pub async fn require_admin(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    match check_admin(&state, req.headers()) {
        Ok(()) => next.run(req).await,
        Err(e) => e.into_response(),
    }
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
}

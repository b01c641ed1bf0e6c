//! Credentials before bodies. A request that sends a large body (over [`SMALL_BODY`], or of
//! unknown length) to a route that needs a credential has the credential checked here,
//! before any byte of the body is read: a missing or wrong credential gets its 401, a
//! missing scope its 403, an upload past the tenant's file quota its 413, at once (the
//! connection then closes). The body is charged to that tenant, or to the operator, in the
//! body budget ([`BodyOwner`]): one tenant cannot hold more than its share, and clients
//! without a credential only the share of their address.
//!
//! A body announced over the route's limit is the body guard's (413, read into no memory).
//! A small body passes on to its handler, which checks the credential again and answers as
//! it always has (the same errors, metrics and bad-credential counting); it is charged to
//! the tenant whose credential is good, else to the client's address.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, Method};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::auth::{self, Scope};
use crate::server::error::ApiError;
use crate::server::http::BodyOwner;
use crate::state::AppState;

/// Bodies at most this large are read before their credential is checked (by their handler).
pub const SMALL_BODY: u64 = 64 << 10;

/// Middleware in front of the body guard (see the module's docs).
pub async fn credentials_first(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let chunked = req.headers().contains_key(header::TRANSFER_ENCODING);
    if declared.unwrap_or(0) == 0 && !chunked {
        return next.run(req).await;
    }
    // A body announced over the route's limit is refused by its size, whoever sends it: the
    // body guard answers 413 at once under `Expect: 100-continue`, else after discarding
    // what arrives (never held in memory).
    if declared.is_some_and(|n| n > state.body_limits.limit_for(req.method(), req.uri().path()) as u64) {
        return next.run(req).await;
    }
    let large = declared.is_none_or(|n| n > SMALL_BODY);
    let path = req.uri().path().to_string();
    let peer = auth::peer_ip(req.extensions());
    let (mut parts, body) = req.into_parts();
    let owner = if path.starts_with("/admin/") || path == "/metrics" {
        let mut probe = Request::from_parts(parts, axum::body::Body::empty());
        let admitted = if large {
            match auth::admit_operator(&state, &mut probe).await {
                Ok(()) => true,
                Err(refused) => return closing(refused),
            }
        } else {
            auth::check_admin(&state, probe.headers()).is_ok()
        };
        parts = probe.into_parts().0;
        if admitted {
            BodyOwner::Operator
        } else {
            BodyOwner::Address(peer)
        }
    } else if path.starts_with("/v1/") {
        let scope = if path == "/v1/tenant" || path.starts_with("/v1/tenant/") {
            Scope::Manage
        } else {
            Scope::Inference
        };
        if large {
            let refuse = |e: ApiError| {
                closing(if path.starts_with("/v1/messages") {
                    crate::api::anthropic::error_response(&e)
                } else {
                    e.into_response()
                })
            };
            let ctx = match auth::authorize(&state, &parts.headers, peer, scope).await {
                Ok(ctx) => ctx,
                Err(e) => return refuse(e),
            };
            if parts.method == Method::POST && path == "/v1/files" {
                if let Some(n) = declared {
                    let used = state.tenants.file_bytes(&ctx.tenant_id).await.unwrap_or(0);
                    let quota = state.tenants.file_quota;
                    if used.saturating_add(n as i64) > quota {
                        return refuse(ApiError::payload_too_large(format!(
                            "The tenant's files hold {used} bytes; this upload of {n} would pass the quota of {quota} bytes (delete files no longer needed)."
                        )));
                    }
                }
            }
            BodyOwner::Tenant(ctx.tenant_id)
        } else {
            match auth::quiet_tenant(&state, &parts.headers).await {
                Some(ctx) => BodyOwner::Tenant(ctx.tenant_id),
                None => BodyOwner::Address(peer),
            }
        }
    } else if path.starts_with("/dashboard/") && large && state.body_limits.is_upload(&parts.method, &path) {
        match crate::dashboard::upload_owner(&state, &mut parts).await {
            Ok(owner) => owner,
            Err(refused) => return closing(refused),
        }
    } else {
        BodyOwner::Address(peer)
    };
    parts.extensions.insert(owner);
    next.run(Request::from_parts(parts, body)).await
}

/// A refusal sent before the body was read: the connection is not reused.
fn closing(mut resp: Response) -> Response {
    resp.headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    resp
}

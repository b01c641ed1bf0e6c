//! The app's route table: the public OpenAI API, the tenant self-service API, and the
//! operator routes (admin API, `/metrics`), which all sit behind one admin-token layer —
//! a route added there is protected by construction.

use std::sync::Arc;

use axum::extract::Request;
use axum::http::{header, HeaderValue};
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::{get, post};
use axum::Router;
use hearth_tenants::now_ms;

use crate::auth::require_admin;
use crate::pipeline;
use crate::server::error::ApiError;
use crate::state::AppState;
use crate::RequestId;

pub fn router(state: Arc<AppState>) -> Router {
    let gate_state = state.clone();
    let operator = Router::new()
        .nest("/admin/v1", crate::routes::admin::router())
        .route("/metrics", get(crate::routes::public::metrics))
        .route("/admin/v1/openapi.json", get(crate::routes::openapi::openapi_admin))
        .route_layer(middleware::from_fn_with_state(state.clone(), require_admin));
    Router::new()
        .route("/v1/chat/completions", post(pipeline::chat_completions))
        .route("/v1/completions", post(pipeline::completions))
        .route("/v1/responses", post(pipeline::responses))
        .route(
            "/v1/responses/{id}",
            get(crate::api::responses::retrieve).delete(crate::api::responses::delete),
        )
        .route(
            "/v1/responses/{id}/input_items",
            get(crate::api::responses::input_items),
        )
        .route("/v1/messages", post(pipeline::messages))
        .route("/v1/messages/count_tokens", post(pipeline::count_tokens_handler))
        .route(
            "/v1/files",
            get(crate::routes::batches::list_files)
                .post(crate::routes::batches::upload_file)
                .layer(axum::extract::DefaultBodyLimit::max(
                    hearth_tenants::batches::MAX_FILE_BYTES + (1 << 20),
                )),
        )
        .route(
            "/v1/files/{id}",
            get(crate::routes::batches::get_file).delete(crate::routes::batches::delete_file),
        )
        .route("/v1/files/{id}/content", get(crate::routes::batches::file_content))
        .route(
            "/v1/batches",
            get(crate::routes::batches::list_batches).post(crate::routes::batches::create_batch),
        )
        .route("/v1/batches/{id}", get(crate::routes::batches::get_batch))
        .route("/v1/batches/{id}/cancel", post(crate::routes::batches::cancel_batch))
        .route("/v1/models", get(crate::routes::public::list_models))
        .route("/v1/models/{model}", get(crate::routes::public::get_model))
        .route("/healthz", get(crate::routes::public::healthz))
        .route("/livez", get(crate::routes::public::livez))
        .route("/readyz", get(crate::routes::public::readyz))
        .route("/openapi.json", get(crate::routes::openapi::openapi_public))
        .nest("/v1/tenant", crate::routes::selfservice::router())
        .nest("/dashboard", crate::dashboard::router())
        .route("/", get(|| async { axum::response::Redirect::to("/dashboard") }))
        .merge(operator)
        .fallback(|| async {
            ApiError::not_found(
                "no such endpoint; see /v1/chat/completions, /v1/completions, /v1/responses, /v1/messages, /v1/models",
            )
        })
        .with_state(state.clone())
        // The body guard enforces the size limits (the routes' own only raise them).
        .layer(axum::extract::DefaultBodyLimit::disable())
        .layer(middleware::from_fn(move |req, next| {
            crate::server::http::body_guard(state.body_limits.clone(), req, next)
        }))
        // Credentials before large bodies; whose share of the body budget a body takes.
        .layer(middleware::from_fn_with_state(
            gate_state,
            crate::gate::credentials_first,
        ))
        .layer(middleware::from_fn(json_errors))
        .layer(middleware::from_fn(security_headers))
        .layer(middleware::from_fn(request_id))
}

/// Errors answered before a handler runs — a path parameter that does not parse, a method
/// the route lacks (405, its `allow` header kept) — come from the framework as plain text or
/// an empty body; they are given the API's own error shape like every handler's (Anthropic's
/// on `/v1/messages`). The dashboard's HTML pages are left alone.
async fn json_errors(req: Request, next: Next) -> Response {
    use axum::response::IntoResponse;
    let path = req.uri().path();
    let (dashboard, anthropic) = (path.starts_with("/dashboard"), path.starts_with("/v1/messages"));
    let resp = next.run(req).await;
    let status = resp.status();
    let json = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.starts_with("application/json"));
    if dashboard || json || !(status.is_client_error() || status.is_server_error()) {
        return resp;
    }
    let (parts, body) = resp.into_parts();
    // The framework's messages are one line; a longer body is replaced by the status's reason.
    let text = axum::body::to_bytes(body, 4096).await.unwrap_or_default();
    let text = String::from_utf8_lossy(&text).trim().to_string();
    let message = if text.is_empty() {
        status.canonical_reason().unwrap_or("error").to_string()
    } else {
        text
    };
    let err = ApiError::framework(status, message);
    let mut out = if anthropic {
        crate::api::anthropic::error_response(&err)
    } else {
        err.into_response()
    };
    for (k, v) in &parts.headers {
        if k != header::CONTENT_TYPE && k != header::CONTENT_LENGTH {
            out.headers_mut().append(k.clone(), v.clone());
        }
    }
    out
}

/// Headers every response carries: no MIME sniffing, no referrer leaking a URL elsewhere,
/// and no caching of anything the management APIs return (new keys' secrets, usage, keys,
/// processors) by a browser or proxy.
async fn security_headers(req: Request, next: Next) -> Response {
    let private = {
        let p = req.uri().path();
        p.starts_with("/admin/") || p.starts_with("/v1/tenant") || p.starts_with("/dashboard") || p == "/metrics"
    };
    let mut resp = next.run(req).await;
    let h = resp.headers_mut();
    h.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    // The dashboard sets its own (`same-origin`).
    if !h.contains_key(header::REFERRER_POLICY) {
        h.insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    }
    if private {
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    }
    resp
}

pub(crate) fn random_id() -> String {
    let mut b = [0u8; 12];
    if getrandom::fill(&mut b).is_err() {
        // Ids must still be unique if the OS source fails: fall back to time + counter.
        static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        b[..8].copy_from_slice(&(now_ms() as u64).to_le_bytes());
        b[8..].copy_from_slice(&(n as u32).to_le_bytes());
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The outermost layer: a request id for every request, echoed in `x-request-id`.
pub async fn request_id(mut req: Request, next: Next) -> Response {
    let id = format!("req_{}", random_id());
    req.extensions_mut().insert(RequestId(id.clone()));
    let mut resp = next.run(req).await;
    if let Ok(v) = HeaderValue::from_str(&id) {
        resp.headers_mut().insert("x-request-id", v);
    }
    resp
}

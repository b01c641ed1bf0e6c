//! Every error a client can see, in OpenAI's shape:
//! `{"error": {"message", "type", "param", "code"}}` with a stable `type`/`code`.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use hearth_billing::BillingError;
use hearth_tenants::TenantError;
use serde::Serialize;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds for a `retry-after` header (rate limits).
    pub retry_after: Option<u64>,
}

/// OpenAI's error shape, `{"error": {"message", "type", "param", "code"}}`.
#[derive(Serialize, utoipa::ToSchema)]
#[schema(as = Error)]
pub(crate) struct Body<'a> {
    error: Inner<'a>,
}

#[derive(Serialize, utoipa::ToSchema)]
#[schema(as = ErrorDetail)]
pub(crate) struct Inner<'a> {
    message: &'a str,
    /// `invalid_request_error`, `authentication_error`, `permission_error`,
    /// `insufficient_quota`, `requests`/`tokens` (rate limits), `server_error`, …
    #[serde(rename = "type")]
    kind: &'a str,
    /// The parameter at fault, if one is.
    param: Option<&'a str>,
    /// A stable code: `invalid_value`, `invalid_api_key`, `model_not_found`, …
    code: Option<&'a str>,
}

/// The error answers every operation may give: OpenAI's shape.
#[derive(utoipa::IntoResponses)]
#[allow(dead_code)]
pub(crate) enum Errors<'a> {
    /// A bad request, credential, scope, model, limit or budget (the body says which).
    #[response(status = "4XX")]
    Client(Body<'a>),
    /// The database or every worker for the model is unavailable (503, `retry-after` may say
    /// when), or a tenant processor failed (500/503, `processor_*` codes).
    #[response(status = "5XX")]
    Server(Body<'a>),
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, code: Option<&'static str>, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            kind,
            param: None,
            code,
            retry_after: None,
        }
    }

    pub fn with_param(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
        self
    }

    /// 400: a parameter is missing, of the wrong type or out of range.
    pub fn invalid(param: &str, message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            Some("invalid_value"),
            message,
        )
        .with_param(param)
    }

    /// 403: the credential is valid but does not allow this (a scope, a model).
    pub fn permission(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, "permission_error", Some(code), message)
    }

    /// 402: the tenant's hard monthly budget is spent.
    pub fn budget_exceeded(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::PAYMENT_REQUIRED,
            "insufficient_quota",
            Some("budget_exceeded"),
            message,
        )
    }

    /// 400: a valid OpenAI parameter Hearth does not implement (yet).
    pub fn unsupported(param: &str, message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            Some("unsupported_parameter"),
            message,
        )
        .with_param(param)
    }

    /// 400: the body is not JSON.
    pub fn malformed_json(detail: impl std::fmt::Display) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            Some("invalid_json"),
            format!("We could not parse the JSON body of your request: {detail}"),
        )
    }

    pub fn context_length(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            Some("context_length_exceeded"),
            message,
        )
        .with_param("messages")
    }

    /// 401.
    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            Some("invalid_api_key"),
            message,
        )
    }

    /// 404: unknown model.
    pub fn model_not_found(model: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            Some("model_not_found"),
            format!("The model `{model}` does not exist or you do not have access to it."),
        )
        .with_param("model")
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            Some("not_found"),
            message,
        )
    }

    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, "invalid_request_error", Some("conflict"), message)
    }

    pub fn forbidden(message: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, "permission_error", Some("forbidden"), message)
    }

    /// 503: no worker can take the request.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            Some("service_unavailable"),
            message,
        )
    }

    /// 503 with its own code (e.g. `usage_unavailable`).
    pub fn unavailable_code(code: &'static str, message: impl Into<String>) -> Self {
        let mut e = Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", Some(code), message);
        e.retry_after = Some(1);
        e
    }

    /// 503 with `retry-after`: the model is loading (or waiting for room to load).
    pub fn model_loading(message: impl Into<String>) -> Self {
        let mut e = Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            Some("model_loading"),
            message,
        );
        e.retry_after = Some(1);
        e
    }

    /// 503 with `retry-after`: the model's pool is at capacity for this request's class
    /// (admission control shed it before it queued).
    pub fn overloaded(message: impl Into<String>, retry_after: u64) -> Self {
        let mut e = Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            Some("overloaded"),
            message,
        );
        e.retry_after = Some(retry_after.max(1));
        e
    }

    /// 429 with `retry-after`, outside the tenant limits (e.g. `auth_failures`: too many
    /// bad credentials from one address).
    pub fn rate_limited(code: &'static str, message: impl Into<String>, retry_after: u64) -> Self {
        let mut e = Self::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", Some(code), message);
        e.retry_after = Some(retry_after.max(1));
        e
    }

    /// 413: the request body is over the server's limit.
    pub fn payload_too_large(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            Some("request_too_large"),
            message,
        )
    }

    /// 408: the client did not send its request in time.
    pub fn request_timeout(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            Some("request_timeout"),
            message,
        )
    }

    /// 504: the request ran past a time limit (`request_timeout`: its total duration;
    /// `stream_idle_timeout`: its worker went quiet and no other could continue it).
    pub fn timed_out(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::GATEWAY_TIMEOUT, "server_error", Some(code), message)
    }

    /// 500: Hearth's fault; the message says what failed, never internals a client can abuse.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            Some("internal_error"),
            message,
        )
    }

    /// An error the framework answered before any handler ran (a path parameter that does
    /// not parse, a method the route lacks), with its status and message.
    pub fn framework(status: StatusCode, message: impl Into<String>) -> Self {
        let (kind, code) = match status.as_u16() {
            404 => ("invalid_request_error", "not_found"),
            405 => ("invalid_request_error", "method_not_allowed"),
            415 => ("invalid_request_error", "unsupported_media_type"),
            400..=499 => ("invalid_request_error", "invalid_value"),
            _ => ("server_error", "internal_error"),
        };
        Self::new(status, kind, Some(code), message)
    }

    /// The JSON body, also used for in-stream SSE errors.
    pub fn body(&self) -> serde_json::Value {
        serde_json::to_value(Body {
            error: Inner {
                message: &self.message,
                kind: self.kind,
                param: self.param.as_deref(),
                code: self.code,
            },
        })
        .unwrap_or_default()
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut resp = (self.status, Json(self.body())).into_response();
        if let Some(secs) = self.retry_after {
            resp.headers_mut().insert(axum::http::header::RETRY_AFTER, secs.into());
        }
        resp
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} ({}): {}",
            self.status.as_u16(),
            self.code.unwrap_or(self.kind),
            self.message
        )
    }
}

/// A store failure as the client sees it.
pub fn store_error(e: TenantError) -> ApiError {
    match e {
        TenantError::TenantExists(_) => ApiError::conflict(e.to_string()),
        TenantError::NoSuchTenant(_) | TenantError::NoSuchKey(_) => ApiError::not_found(e.to_string()),
        TenantError::InvalidName(_) => ApiError::invalid("name", e.to_string()),
        TenantError::InvalidTenantName(_) => ApiError::invalid("name", e.to_string()),
        TenantError::NoSuchIssuer(_)
        | TenantError::NoSuchProcessor(_)
        | TenantError::NoSuchAdapter(_)
        | TenantError::NoSuchFile(_)
        | TenantError::NoSuchBatch(_)
        | TenantError::NoSuchMember(_)
        | TenantError::NoSuchInvitation(_)
        | TenantError::NoSuchProvider(_) => ApiError::not_found(e.to_string()),
        TenantError::IssuerExists(_) | TenantError::Conflict(_) => ApiError::conflict(e.to_string()),
        TenantError::Invalid { field, .. } => ApiError::invalid(field, e.to_string()),
        TenantError::Db(_) | TenantError::Random(_) | TenantError::Password(_) => {
            tracing::error!(error = %e, "admin store error");
            ApiError::internal("the tenant store failed")
        }
    }
}

/// A ledger failure as the client sees it.
pub fn ledger_error(e: BillingError) -> ApiError {
    match e {
        BillingError::Invalid { field, .. } => ApiError::invalid(field, e.to_string()),
        e => {
            tracing::error!(error = %e, "ledger error");
            ApiError::internal("the usage ledger failed")
        }
    }
}

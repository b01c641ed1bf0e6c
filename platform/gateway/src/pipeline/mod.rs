//! The pipeline: the life of one generation request — `/v1/chat/completions`,
//! `/v1/completions`, `/v1/responses` (OpenAI Responses) or `/v1/messages` (Anthropic
//! Messages) — as a fixed list of named phases over one per-request [`RequestContext`]
//! (Pingora's shape). The Responses and Messages APIs are translations: `parse` turns their
//! bodies into the same typed request, `postprocess` renders the same events in their
//! shapes, and errors take each API's own shape ([`render_error`]). Each phase is a
//! function in its own module; read [`run`] top to bottom for the whole request:
//!
//! [`authenticate`] → [`budget`] → [`preprocess`] → [`parse`] → [`recall`] → [`resolve`] →
//! [`tokenize`] → [`limit`] → [`admit`] → [`budget::reserve`] → [`route`] + [`dispatch`] (or
//! [`disaggregate`]) → [`relay`] → [`postprocess`],
//! with [`meter`] writing the usage record: from the relay before the client gets the final
//! event (write-before-ack), or from [`handle`] for a request refused before dispatch.
//!
//! The phases are public so that other compositions can be built from them — the gateway
//! benchmark's baseline runs the same pipeline without authentication, limits and metering.

pub mod admit;
pub mod authenticate;
pub mod budget;
pub mod disaggregate;
pub mod dispatch;
pub mod limit;
pub mod meter;
pub mod parse;
pub mod postprocess;
pub mod preprocess;
pub mod recall;
pub mod relay;
pub mod resolve;
pub mod route;
pub mod tokenize;

use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Extension;
use hearth_billing::UsageRecord;
use hearth_tenants::TenantContext;
use tracing::{info_span, Instrument};

use crate::policy::limits::RateState;
use crate::policy::processors::Chain;
use crate::server::error::ApiError;
use crate::server::metrics::RequestLabels;
use crate::state::AppState;
use crate::upstream::registry::ServedModel;
use crate::RequestId;

/// Which endpoint a request came in on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completions,
    /// OpenAI's Responses API.
    Responses,
    /// Anthropic's Messages API.
    Messages,
    /// Anthropic's `count_tokens` (the pipeline up to `tokenize`; nothing is generated).
    CountTokens,
}

impl Endpoint {
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Chat => "/v1/chat/completions",
            Endpoint::Completions => "/v1/completions",
            Endpoint::Responses => "/v1/responses",
            Endpoint::Messages => "/v1/messages",
            Endpoint::CountTokens => "/v1/messages/count_tokens",
        }
    }

    /// The GenAI operation (the root span's name).
    pub fn operation(self) -> &'static str {
        match self {
            Endpoint::Completions => "text_completion",
            Endpoint::CountTokens => "count_tokens",
            _ => "chat",
        }
    }
}

/// A batch's line in the pipeline: who runs it and for which batch.
#[derive(Debug, Clone)]
pub struct LineRun {
    pub batch_id: String,
    /// The API key that created the batch.
    pub key_id: String,
    /// The line's last run: a refusal is its answer, not sent back.
    pub last_try: bool,
}

impl LineRun {
    /// Whether this run, refused with `e`, waits and runs again (so the refusal is not its
    /// usage record).
    pub fn sent_back(&self, e: &ApiError) -> bool {
        !self.last_try && sent_back(e.status, e.code)
    }
}

/// Whether a refusal with `status` and `code` is one that waiting may end: rate limited
/// (not a request larger than the limit allows at all), unavailable or overloaded, or over
/// a hard budget.
pub fn sent_back(status: axum::http::StatusCode, code: Option<&str>) -> bool {
    match status {
        axum::http::StatusCode::TOO_MANY_REQUESTS => code != Some("tokens_over_limit"),
        axum::http::StatusCode::SERVICE_UNAVAILABLE | axum::http::StatusCode::PAYMENT_REQUIRED => true,
        _ => false,
    }
}

/// An error in the endpoint's own shape: Anthropic's for the Messages API, OpenAI's for the rest.
pub fn render_error(endpoint: Endpoint, e: ApiError) -> Response {
    match endpoint {
        Endpoint::Messages | Endpoint::CountTokens => crate::api::anthropic::error_response(&e),
        // A schema the worker refused names chat's parameter: this API's is `text.format`.
        Endpoint::Responses if e.param.as_deref() == Some("response_format") => {
            e.with_param("text.format").into_response()
        }
        _ => e.into_response(),
    }
}

/// Everything one request carries through the phases. Each phase fills in what it
/// produces; a later phase reads it through the accessors, which fail with an internal
/// error (never a panic) if the phases were composed out of order.
pub struct RequestContext {
    /// `req_<hex>`, also the usage record's idempotency key and `x-request-id`.
    pub request_id: String,
    pub endpoint: Endpoint,
    pub headers: HeaderMap,
    /// The client's address (None without connect info, e.g. a test's router).
    pub peer: Option<std::net::IpAddr>,
    /// A batch's line: it runs under the key that created the batch (no credential is
    /// presented), and its usage record names the batch.
    pub batch: Option<LineRun>,
    pub received: Instant,
    /// The request body: raw, then as rewritten by the pre-processors.
    pub body: Result<Bytes, BytesRejection>,
    /// authenticate: who is asking.
    pub tenant: Option<TenantContext>,
    /// authenticate: the request's usage record, filled in by the later phases.
    pub usage: Option<UsageRecord>,
    /// budget: what the client is told about the tenant's budget, and (after tokenize)
    /// the request's reservation against a hard budget.
    pub budget: crate::policy::budget::BudgetState,
    pub budget_hold: Option<crate::policy::budget::BudgetHold>,
    /// preprocess: the tenant's processors, kept for the response; and (from the relay)
    /// where post-processing reports its time.
    pub chain: Option<Chain>,
    pub post_done: Option<crate::policy::processors::PostDoneSender>,
    /// parse: the validated request.
    pub request: Option<parse::Parsed>,
    /// resolve: the model served.
    pub model: Option<Arc<ServedModel>>,
    /// resolve: the tenant's LoRA adapter it runs under (`model: "BASE:ADAPTER"`).
    pub adapter: Option<hearth_protocol::AdapterRef>,
    /// tokenize: the prompt's token ids and the completion's token budget.
    pub prompt: Vec<u32>,
    /// tokenize: the prompt's length (the ids go to the worker; this stays).
    pub prompt_tokens: u32,
    /// The completion budget when the request sets none (None: the room left).
    pub default_max_tokens: Option<u32>,
    /// tokenize: how the answers are read (tool calls, reasoning).
    pub output: hearth_protocol::output::OutputSpec,
    pub max_tokens: u32,
    /// limit: the rate-limit state (response headers) and the admission held until the
    /// request ends.
    pub rate: RateState,
    pub lease: Option<limit::Admitted>,
    /// authenticate: this request counted among those whose usage is not recorded yet (the
    /// relay takes it over); the launcher waits for them before the last flush.
    pub unrecorded: Option<crate::state::TaskGuard>,
    /// admit: the tenant, its share and the request's class, sent to the worker.
    pub qos: hearth_protocol::Qos,
    /// The request's root span; every phase's span is its child. The relay keeps a clone,
    /// so that a streamed request's span ends with its stream.
    pub span: tracing::Span,
}

impl RequestContext {
    pub fn new(
        request_id: String,
        endpoint: Endpoint,
        headers: HeaderMap,
        body: Result<Bytes, BytesRejection>,
    ) -> Self {
        Self {
            request_id,
            endpoint,
            headers,
            peer: None,
            batch: None,
            received: Instant::now(),
            body,
            tenant: None,
            usage: None,
            budget: Default::default(),
            budget_hold: None,
            chain: None,
            post_done: None,
            request: None,
            model: None,
            adapter: None,
            prompt: Vec::new(),
            prompt_tokens: 0,
            output: Default::default(),
            default_max_tokens: None,
            max_tokens: 0,
            rate: RateState::default(),
            lease: None,
            unrecorded: None,
            qos: Default::default(),
            span: tracing::Span::none(),
        }
    }

    pub fn tenant(&self) -> Result<&TenantContext, ApiError> {
        self.tenant.as_ref().ok_or_else(|| out_of_order("authenticate"))
    }

    pub fn usage_mut(&mut self) -> Result<&mut UsageRecord, ApiError> {
        self.usage.as_mut().ok_or_else(|| out_of_order("authenticate"))
    }

    pub fn request(&self) -> Result<&parse::Parsed, ApiError> {
        self.request.as_ref().ok_or_else(|| out_of_order("parse"))
    }

    pub fn model(&self) -> Result<&Arc<ServedModel>, ApiError> {
        self.model.as_ref().ok_or_else(|| out_of_order("resolve"))
    }

    /// A request header as text, if present and not empty.
    pub fn header(&self, name: &str) -> Option<String> {
        self.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
            .filter(|v| !v.is_empty())
    }
}

fn out_of_order(phase: &str) -> ApiError {
    ApiError::internal(format!("pipeline phase '{phase}' did not run"))
}

/// The whole pipeline, phase by phase, each in its own span.
async fn run(state: &Arc<AppState>, ctx: &mut RequestContext) -> Result<Response, ApiError> {
    authenticate::run(state, ctx)
        .instrument(info_span!("authenticate"))
        .await?;
    budget::run(state, ctx).instrument(info_span!("budget")).await?;
    preprocess::run(state, ctx).instrument(info_span!("preprocess")).await?;
    info_span!("parse").in_scope(|| parse::run(ctx, state.keep_billing_header))?;
    recall::run(state, ctx).instrument(info_span!("recall")).await?;
    resolve::run(state, ctx).instrument(info_span!("resolve")).await?;
    info_span!("tokenize").in_scope(|| tokenize::run(ctx))?;
    limit::run(state, ctx).instrument(info_span!("limit")).await?;
    info_span!("admit").in_scope(|| admit::run(state, ctx))?;
    budget::reserve(state, ctx).instrument(info_span!("reserve")).await?;
    let events = dispatch::run(state, ctx).instrument(info_span!("dispatch")).await?;
    let events = relay::start(state.clone(), state.clone(), ctx, events).await?;
    postprocess::run(state, ctx, events)
        .instrument(info_span!("postprocess"))
        .await
}

/// Runs the pipeline for one request; a refusal becomes its OpenAI-shaped error (and, once
/// the request is authenticated, still one usage record).
pub async fn handle(state: Arc<AppState>, mut ctx: RequestContext) -> Response {
    ctx.span = crate::server::telemetry::request_span(ctx.endpoint.operation(), ctx.endpoint.path(), &ctx.request_id);
    ctx.default_max_tokens = state.default_max_tokens;
    let span = ctx.span.clone();
    let mut resp = match run(&state, &mut ctx).instrument(span.clone()).await {
        Ok(resp) => resp,
        Err(e) => {
            span.record("error.type", e.code.unwrap_or(e.kind));
            if ctx.batch.as_ref().is_some_and(|b| b.sent_back(&e)) {
                // The batch runs this line again later, under a new request id: this
                // refusal is not the line's record.
                ctx.usage = None;
            }
            meter::refused(&*state, &mut ctx, &e)
                .instrument(info_span!(parent: &span, "meter"))
                .await;
            render_error(ctx.endpoint, e)
        }
    };
    span.record("http.response.status_code", i64::from(resp.status().as_u16()));
    ctx.rate.apply(resp.headers_mut());
    ctx.budget.apply(resp.headers_mut());
    state
        .metrics
        .requests
        .get_or_create(&RequestLabels {
            model: ctx
                .model
                .as_ref()
                .map_or_else(|| "unknown".to_string(), |m| m.id.clone()),
            endpoint: ctx.endpoint.path().to_string(),
            status: resp.status().as_u16(),
        })
        .inc();
    resp
}

macro_rules! endpoint_handler {
    ($(#[$doc:meta])* $name:ident, $endpoint:expr, $run:ident) => {
        $(#[$doc])*
        pub(crate) async fn $name(
            State(state): State<Arc<AppState>>,
            Extension(RequestId(id)): Extension<RequestId>,
            extensions: axum::http::Extensions,
            headers: HeaderMap,
            body: Result<Bytes, BytesRejection>,
        ) -> Response {
            let mut ctx = RequestContext::new(id, $endpoint, headers, body);
            ctx.peer = crate::auth::peer_ip(&extensions);
            $run(state, ctx).await
        }
    };
}

endpoint_handler!(
    /// `POST /v1/chat/completions`.
    #[utoipa::path(post, path = "/v1/chat/completions", summary = "Chat completions (OpenAI): the assistant's next message.", tag = "inference", security(("bearer" = [])),
        request_body = crate::api::schema::ChatCompletionRequest,
        responses(
            (status = 200, description = "The completion, or with `stream: true` server-sent `chat.completion.chunk` events ending in `data: [DONE]`.", content((crate::api::schema::ChatCompletion = "application/json"), (crate::api::schema::SseEvent = "text/event-stream"))),
            crate::server::error::Errors
        ))]
    chat_completions,
    Endpoint::Chat,
    handle
);
endpoint_handler!(
    /// `POST /v1/completions`.
    #[utoipa::path(post, path = "/v1/completions", summary = "Completions (OpenAI, legacy): a prompt continued.", tag = "inference", security(("bearer" = [])),
        request_body = crate::api::schema::CompletionRequest,
        responses(
            (status = 200, description = "The completion, or with `stream: true` server-sent chunks ending in `data: [DONE]`.", content((crate::api::schema::Completion = "application/json"), (crate::api::schema::SseEvent = "text/event-stream"))),
            crate::server::error::Errors
        ))]
    completions,
    Endpoint::Completions,
    handle
);
endpoint_handler!(
    /// `POST /v1/responses` (OpenAI Responses).
    #[utoipa::path(post, path = "/v1/responses", summary = "Responses (OpenAI): a response to input items, stored for `previous_response_id`.", tag = "inference", security(("bearer" = [])),
        request_body = crate::api::schema::ResponseRequest,
        responses(
            (status = 200, description = "The response, or with `stream: true` its typed server-sent events.", content((crate::api::schema::ResponseObject = "application/json"), (crate::api::schema::SseEvent = "text/event-stream"))),
            crate::server::error::Errors
        ))]
    responses,
    Endpoint::Responses,
    handle
);
endpoint_handler!(
    /// `POST /v1/messages` (Anthropic Messages).
    #[utoipa::path(post, path = "/v1/messages", summary = "Messages (Anthropic): the assistant's next message.", tag = "inference", security(("x_api_key" = []), ("bearer" = [])),
        request_body = crate::api::schema::MessagesRequest,
        responses(
            (status = 200, description = "The message, or with `stream: true` its server-sent events.", content((crate::api::schema::MessageObject = "application/json"), (crate::api::schema::SseEvent = "text/event-stream"))),
            (status = "4XX", description = "Anthropic's error shape.", body = crate::api::schema::AnthropicError), (status = "5XX", description = "No worker or database (503), overloaded (529, `retry-after`), or a processor failed.", body = crate::api::schema::AnthropicError)
        ))]
    messages,
    Endpoint::Messages,
    handle
);
endpoint_handler!(
    /// `POST /v1/messages/count_tokens`.
    #[utoipa::path(post, path = "/v1/messages/count_tokens", summary = "Counts a Messages request's input tokens as a generation would see them.", tag = "inference",
        security(("x_api_key" = []), ("bearer" = [])),
        request_body = crate::api::schema::CountTokensRequest,
        responses(
            (status = 200, description = "The prompt's tokens as a generation would see them.", body = crate::api::schema::TokenCount),
            (status = "4XX", description = "Anthropic's error shape.", body = crate::api::schema::AnthropicError),
            (status = "5XX", description = "No worker or database, or a processor failed.", body = crate::api::schema::AnthropicError),
        ))]
    count_tokens_handler,
    Endpoint::CountTokens,
    count_tokens
);

/// `count_tokens`: the request's prompt as a generation would see it — authenticated,
/// through the tenant's pre-processors, parsed, templated and tokenized — counted, not run.
/// Nothing is generated, so nothing is metered.
async fn count_tokens(state: Arc<AppState>, mut ctx: RequestContext) -> Response {
    ctx.span = crate::server::telemetry::request_span(ctx.endpoint.operation(), ctx.endpoint.path(), &ctx.request_id);
    let span = ctx.span.clone();
    let counted = async {
        authenticate::run(&state, &mut ctx).await?;
        limit::count(&state, &mut ctx).await?;
        preprocess::run(&state, &mut ctx).await?;
        parse::run(&mut ctx, state.keep_billing_header)?;
        resolve::run(&state, &mut ctx).await?;
        tokenize::run(&mut ctx)?;
        Ok::<_, ApiError>(ctx.prompt_tokens)
    }
    .instrument(span)
    .await;
    // Not a generation: no usage record. A count that ran is one request per minute (its
    // in-flight slot goes now); a refused one gives its admission back.
    ctx.usage = None;
    ctx.unrecorded = None;
    if let (Some(lease), true) = (ctx.lease.take(), counted.is_ok()) {
        lease.finish(0).await;
    }
    state
        .metrics
        .token_counts
        .get_or_create(&crate::server::metrics::OutcomeLabel {
            outcome: if counted.is_ok() { "counted" } else { "refused" }.into(),
        })
        .inc();
    let mut resp = match counted {
        Ok(n) => axum::Json(crate::api::anthropic::count_json(n)).into_response(),
        Err(e) => render_error(ctx.endpoint, e),
    };
    ctx.rate.apply(resp.headers_mut());
    resp
}

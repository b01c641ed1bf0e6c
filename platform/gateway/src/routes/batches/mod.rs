//! OpenAI's Files and Batch APIs, and the runner that works batches off.
//!
//! * `/v1/files` — upload (`multipart/form-data`, `purpose=batch`), list, retrieve,
//!   `…/content`, delete. A file's bytes are in the database (`hearth_tenants::batches`), so
//!   every gateway sharing it serves them.
//! * `/v1/batches` — create from an uploaded JSONL file, retrieve, list, cancel. Each line is
//!   checked when the batch is created; a line that is not a request for the batch's
//!   endpoint goes to the error file, the batch runs the rest.
//! * [`runner::run`] — each gateway's runner: it claims lines of open batches (a conditional update,
//!   so gateways sharing the database never run one twice), runs each through the same
//!   pipeline as an API request — in the `batch` class, under the key that created the
//!   batch, with its limits, budget and processors — and keeps the answer as the line's
//!   output. A line refused for now (rate limit, overload, a spent budget) waits and runs
//!   again under a new request id; a line whose gateway died runs again under the same one,
//!   so its usage is recorded once. A batch with every line answered (or cancelled, or past
//!   its window) is finished in one transaction: output and error files, final status.

use std::collections::HashSet;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::Json;
use hearth_tenants::batches::{self as store, BatchInfo, FileInfo, NewLine, Page};
use hearth_tenants::{TenantContext, TenantError};
use serde_json::{json, Value};

use crate::auth::{own_objects, sees, Caller, ClientOrigin};
use crate::manage::{Actor, ManageError, Management, Permission};
use crate::server::error::{store_error, ApiError};
use crate::state::AppState;

pub mod runner;

/// The endpoints a batch may run.
pub const ENDPOINTS: [&str; 3] = ["/v1/chat/completions", "/v1/completions", "/v1/responses"];

// ---- files ------------------------------------------------------------------------------

/// `multipart/form-data` of a file upload.
#[derive(utoipa::ToSchema)]
#[allow(dead_code)]
pub struct FileUpload {
    /// `batch`.
    #[schema(pattern = "^batch$")]
    purpose: String,
    /// The JSONL file, one request per line (`custom_id`, `method`, `url`, `body`).
    #[schema(value_type = String, format = Binary)]
    file: Vec<u8>,
}

/// A file, as OpenAI's Files API shows it.
#[derive(utoipa::ToSchema)]
#[allow(dead_code)]
pub struct FileObject {
    id: String,
    /// `file`.
    object: String,
    bytes: i64,
    /// Unix seconds.
    created_at: i64,
    filename: String,
    /// `batch` (an upload) or `batch_output` (a batch's output or error file).
    purpose: String,
    /// `processed`.
    status: String,
    /// Always null: files are kept until deleted.
    expires_at: Option<i64>,
    /// Always null.
    status_details: Option<String>,
}

fn file_json(f: &FileInfo) -> Value {
    json!({"id": f.id, "object": "file", "bytes": f.bytes, "created_at": f.created_at / 1000,
        "filename": f.filename, "purpose": f.purpose, "status": "processed", "expires_at": null, "status_details": null})
}

fn list_json(data: Vec<Value>, has_more: bool) -> Value {
    json!({"object": "list", "first_id": data.first().map(|v| v["id"].clone()),
        "last_id": data.last().map(|v| v["id"].clone()), "has_more": has_more, "data": data})
}

/// The query of `GET /v1/files` and `GET /v1/batches` (their documents: [`FileListParams`],
/// [`BatchListParams`]).
#[derive(serde::Deserialize)]
pub struct ListQuery {
    limit: Option<i64>,
    after: Option<String>,
    order: Option<String>,
    purpose: Option<String>,
}

/// `GET /v1/files`'s query, as documented.
#[derive(utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[allow(dead_code)]
pub struct FileListParams {
    /// 1 to 10,000 (default 10,000), as OpenAI's.
    #[param(minimum = 1, maximum = 10000)]
    limit: Option<i64>,
    /// An id: list the files after it (newest first).
    after: Option<String>,
    /// `desc` (the default and the only order offered).
    #[param(pattern = "^desc$")]
    order: Option<String>,
    /// Those of one purpose.
    #[param(pattern = "^(batch|batch_output)$")]
    purpose: Option<String>,
}

/// `GET /v1/batches`'s query, as documented.
#[derive(utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[allow(dead_code)]
pub struct BatchListParams {
    /// 1 to 100 (default 20), as OpenAI's.
    #[param(minimum = 1, maximum = 100)]
    limit: Option<i64>,
    /// An id: list the batches after it (newest first).
    after: Option<String>,
    /// `desc` (the default and the only order offered).
    #[param(pattern = "^desc$")]
    order: Option<String>,
}

impl ListQuery {
    fn page(&self, default: i64, max: i64) -> Result<Page, ApiError> {
        if let Some(o) = self.order.as_deref().filter(|o| *o != "desc") {
            return Err(ApiError::invalid(
                "order",
                format!("'order' may only be desc, got {o:?}"),
            ));
        }
        let limit = self.limit.unwrap_or(default);
        if !(1..=max).contains(&limit) {
            return Err(ApiError::invalid(
                "limit",
                format!("'limit' must be between 1 and {max}"),
            ));
        }
        // One more than asked: whether there are more.
        Ok(Page {
            after: self.after.clone(),
            limit: limit + 1,
        })
    }
}

type QueryResult = Result<Query<ListQuery>, axum::extract::rejection::QueryRejection>;

fn query(q: QueryResult) -> Result<ListQuery, ApiError> {
    q.map(|Query(q)| q)
        .map_err(|e| ApiError::invalid("query", e.body_text()))
}

/// Another tenant's object is not found, as a missing one.
fn not_found(e: TenantError) -> ApiError {
    match e {
        TenantError::NoSuchFile(id) => ApiError::not_found(format!("No such File object: {id}")),
        TenantError::NoSuchBatch(id) => ApiError::not_found(format!("No batch found with id '{id}'.")),
        e => store_error(e),
    }
}

/// `POST /v1/files`.
#[utoipa::path(post, path = "/v1/files", summary = "Uploads a file (OpenAI Files API): a batch's JSONL input.", tag = "batches", security(("bearer" = [])),
    request_body(content = FileUpload, content_type = "multipart/form-data", description = "`purpose` (`batch`) and the file as the `file` part, at most 100 MiB."),
    responses((status = 200, description = "The stored file.", body = FileObject), crate::server::error::Errors))]
pub async fn upload_file(
    State(gw): State<Arc<AppState>>,
    Caller(ctx): Caller,
    form: crate::manage::adapters::Form,
) -> Result<Json<Value>, ApiError> {
    let mut form = form.map_err(|e| ApiError::invalid("file", e.body_text()))?;
    let bad = |e: axum::extract::multipart::MultipartError| ApiError::invalid("file", e.body_text());
    let (mut purpose, mut file) = (None, None);
    while let Some(field) = form.next_field().await.map_err(bad)? {
        match field.name().unwrap_or_default() {
            "purpose" => purpose = Some(field.text().await.map_err(bad)?),
            "file" => {
                let name = field.file_name().unwrap_or("upload.jsonl").to_string();
                file = Some((name, field.bytes().await.map_err(bad)?));
            }
            other => {
                return Err(ApiError::invalid(
                    "file",
                    format!("unknown form field {other:?} (expected purpose and file)"),
                ))
            }
        }
    }
    match purpose.as_deref() {
        Some("batch") => {}
        Some(p) => {
            return Err(ApiError::invalid(
                "purpose",
                format!("purpose {p:?} is not offered here; files are for batches (purpose 'batch')"),
            ))
        }
        None => return Err(ApiError::invalid("purpose", "'purpose' is required ('batch')")),
    }
    let (name, bytes) = file.ok_or_else(|| ApiError::invalid("file", "'file' is required"))?;
    if bytes.is_empty() {
        return Err(ApiError::invalid("file", "the file is empty"));
    }
    if name.is_empty() || name.len() > 255 || name.chars().any(char::is_control) {
        return Err(ApiError::invalid(
            "file",
            "the file's name must be 1-255 characters without control characters",
        ));
    }
    let f = gw
        .tenants
        .add_file(&ctx.tenant_id, Some(&ctx.key_id), "batch", &name, &bytes)
        .await
        .map_err(store_error)?;
    Ok(Json(file_json(&f)))
}

/// `GET /v1/files`.
#[utoipa::path(get, path = "/v1/files", summary = "Lists the tenant's files, newest first.", tag = "batches", security(("bearer" = [])),
    params(FileListParams),
    responses((status = 200, description = "`{\"object\": \"list\", \"data\": [file…], \"first_id\", \"last_id\", \"has_more\"}`.", body = crate::api::schema::AnyObject), crate::server::error::Errors))]
pub async fn list_files(
    State(gw): State<Arc<AppState>>,
    Caller(ctx): Caller,
    q: QueryResult,
) -> Result<Json<Value>, ApiError> {
    let q = query(q)?;
    if let Some(p) = q.purpose.as_deref().filter(|p| !matches!(*p, "batch" | "batch_output")) {
        return Err(ApiError::invalid(
            "purpose",
            format!("'purpose' is batch or batch_output, got {p:?}"),
        ));
    }
    let page = q.page(10_000, 10_000)?;
    let mut files = gw
        .tenants
        .list_files(&ctx.tenant_id, own_objects(&ctx), q.purpose.as_deref(), &page)
        .await
        .map_err(not_found)?;
    let more = files.len() as i64 == page.limit;
    files.truncate(page.limit as usize - 1);
    Ok(Json(list_json(files.iter().map(file_json).collect(), more)))
}

/// `GET /v1/files/{id}`.
#[utoipa::path(get, path = "/v1/files/{id}", summary = "A file's description.", tag = "batches", security(("bearer" = [])),
    params(("id" = String, Path, description = "A file id (`file-…`).")),
    responses((status = 200, description = "The file.", body = FileObject), crate::server::error::Errors))]
pub async fn get_file(
    State(gw): State<Arc<AppState>>,
    Caller(ctx): Caller,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let f = visible_file(&ctx, gw.tenants.file(&ctx.tenant_id, &id).await)?;
    Ok(Json(file_json(&f)))
}

/// `GET /v1/files/{id}/content`.
#[utoipa::path(get, path = "/v1/files/{id}/content", summary = "A file's bytes (a batch's output and error files are JSONL).", tag = "batches", security(("bearer" = [])),
    params(("id" = String, Path, description = "A file id (`file-…`).")),
    responses((status = 200, description = "The file's bytes.", content_type = "application/octet-stream", body = String), crate::server::error::Errors))]
pub async fn file_content(
    State(gw): State<Arc<AppState>>,
    Caller(ctx): Caller,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    visible_file(&ctx, gw.tenants.file(&ctx.tenant_id, &id).await)?;
    let (f, bytes) = gw.tenants.file_content(&ctx.tenant_id, &id).await.map_err(not_found)?;
    Ok(download(&f, bytes))
}

/// A file's bytes as a download (the API's `…/content` and the dashboard's link). A name
/// that cannot be a header value is left out of the header.
pub(crate) fn download(f: &FileInfo, bytes: Vec<u8>) -> Response {
    let mut resp = bytes.into_response();
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    if let Ok(v) = HeaderValue::from_str(&format!("attachment; filename=\"{}\"", attachment_name(&f.filename))) {
        h.insert(header::CONTENT_DISPOSITION, v);
    }
    resp
}

/// A file's name as a `Content-Disposition` filename: quotes, backslashes, control
/// characters and the invisible and bidirectional-formatting ones (U+202E makes
/// `report\u{202E}fdp.exe` display as `reportexe.pdf`) each become `_`.
fn attachment_name(name: &str) -> String {
    let hidden = |c: char| matches!(c, '\u{061C}' | '\u{200B}'..='\u{200F}' | '\u{202A}'..='\u{202E}' | '\u{2060}'..='\u{2069}' | '\u{FEFF}');
    name.chars()
        .map(|c| {
            if c == '"' || c == '\\' || c.is_control() || hidden(c) {
                '_'
            } else {
                c
            }
        })
        .collect()
}

/// `DELETE /v1/files/{id}`.
#[utoipa::path(delete, path = "/v1/files/{id}", summary = "Deletes a file.", tag = "batches", security(("bearer" = [])),
    params(("id" = String, Path, description = "A file id (`file-…`).")),
    responses((status = 200, description = "`{\"id\", \"object\": \"file\", \"deleted\": true}`.", body = crate::api::schema::AnyObject), crate::server::error::Errors))]
pub async fn delete_file(
    State(gw): State<Arc<AppState>>,
    Caller(ctx): Caller,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    visible_file(&ctx, gw.tenants.file(&ctx.tenant_id, &id).await)?;
    let f = gw.tenants.delete_file(&ctx.tenant_id, &id).await.map_err(not_found)?;
    Ok(Json(json!({"id": f.id, "object": "file", "deleted": true})))
}

/// A file the credential sees (another key's, for a model-restricted key, is not found).
pub(crate) fn visible_file(ctx: &TenantContext, f: Result<FileInfo, TenantError>) -> Result<FileInfo, ApiError> {
    let f = f.map_err(not_found)?;
    if !sees(ctx, f.key_id.as_deref()) {
        return Err(not_found(TenantError::NoSuchFile(f.id)));
    }
    Ok(f)
}

// ---- batches ----------------------------------------------------------------------------

/// A batch's creation.
#[derive(utoipa::ToSchema)]
#[allow(dead_code)]
pub struct BatchRequest {
    /// A file uploaded with purpose `batch`: JSONL, one `{"custom_id", "method": "POST", "url", "body"}` per line.
    input_file_id: String,
    /// `/v1/chat/completions`, `/v1/completions` or `/v1/responses`: every line's `url`.
    #[schema(pattern = "^/v1/(chat/completions|completions|responses)$")]
    endpoint: String,
    /// `24h`.
    #[schema(pattern = "^24h$")]
    completion_window: String,
    /// Up to 16 string pairs, kept with the batch.
    #[schema(value_type = Option<Object>)]
    metadata: Option<Value>,
}

/// A batch, as OpenAI's Batch API shows it.
#[derive(utoipa::ToSchema)]
#[allow(dead_code)]
pub struct BatchObject {
    id: String,
    /// `batch`.
    object: String,
    endpoint: String,
    input_file_id: String,
    completion_window: String,
    /// `in_progress`, `finalizing`, `completed`, `expired`, `cancelling` or `cancelled`.
    status: String,
    output_file_id: Option<String>,
    error_file_id: Option<String>,
    /// Unix seconds, as every `…_at`.
    created_at: i64,
    expires_at: i64,
    /// `{total, completed, failed}`: lines answered with a 2xx status, and the others.
    #[schema(value_type = Object)]
    request_counts: Value,
    /// Why no line runs now (Hearth's: a spent hard budget), or null.
    paused_reason: Option<String>,
}

fn secs(ms: Option<i64>) -> Value {
    ms.map_or(Value::Null, |v| json!(v / 1000))
}

/// A batch in OpenAI's shape, with its usage so far when known.
pub fn batch_json(b: &BatchInfo, usage: Option<&hearth_billing::BatchUsage>) -> Value {
    let metadata = b
        .metadata
        .as_deref()
        .and_then(|m| serde_json::from_str::<Value>(m).ok())
        .unwrap_or(Value::Null);
    let mut v = json!({
        "id": b.id, "object": "batch", "endpoint": b.endpoint, "errors": null,
        "input_file_id": b.input_file_id, "completion_window": b.completion_window, "status": b.status,
        "output_file_id": b.output_file_id, "error_file_id": b.error_file_id,
        "created_at": b.created_at / 1000, "in_progress_at": secs(b.in_progress_at), "expires_at": b.expires_at / 1000,
        "finalizing_at": secs(b.finalizing_at), "completed_at": secs(b.completed_at), "failed_at": null,
        "expired_at": secs(b.expired_at), "cancelling_at": secs(b.cancelling_at), "cancelled_at": secs(b.cancelled_at),
        "request_counts": {"total": b.counts.total, "completed": b.counts.completed, "failed": b.counts.failed},
        "metadata": metadata, "paused_reason": b.paused_reason,
    });
    if let Some(u) = usage {
        v["usage"] = json!({
            "input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt_tokens + u.completion_tokens,
        });
        v["cost_usd"] = json!(hearth_billing::format_nusd(u.cost_nusd));
    }
    v
}

async fn batch_with_usage(gw: &AppState, b: &BatchInfo) -> Value {
    let usage = gw.ledger.batch_usage(&b.tenant_id, &b.id).await;
    if let Err(e) = &usage {
        tracing::warn!(batch = %b.id, error = %e, "a batch's usage could not be read");
    }
    batch_json(b, usage.ok().as_ref())
}

/// The lines of a batch's input file, each checked against the batch's endpoint.
pub fn read_lines(content: &[u8], endpoint: &str) -> Result<Vec<NewLine>, ApiError> {
    let text = std::str::from_utf8(content)
        .map_err(|_| ApiError::invalid("input_file_id", "the input file is not UTF-8 text (JSONL)"))?;
    let mut seen = HashSet::new();
    let mut lines = Vec::new();
    for raw in text.lines().filter(|l| !l.trim().is_empty()) {
        if lines.len() == store::MAX_BATCH_LINES {
            return Err(ApiError::invalid(
                "input_file_id",
                format!(
                    "the input file has more than {} lines, a batch's most",
                    store::MAX_BATCH_LINES
                ),
            ));
        }
        lines.push(read_line(raw, endpoint, &mut seen));
    }
    if lines.is_empty() {
        return Err(ApiError::invalid("input_file_id", "the input file has no lines"));
    }
    Ok(lines)
}

fn read_line(raw: &str, endpoint: &str, seen: &mut HashSet<String>) -> NewLine {
    let refused = |custom_id: Option<String>, code: &'static str, message: String| NewLine::Refused {
        custom_id,
        code,
        message,
    };
    let Ok(Value::Object(o)) = serde_json::from_str::<Value>(raw) else {
        return refused(None, "invalid_json", "The line is not a JSON object.".into());
    };
    let custom_id = match o.get("custom_id") {
        Some(Value::String(s)) if !s.is_empty() && s.len() <= 512 => s.clone(),
        _ => {
            return refused(
                None,
                "missing_custom_id",
                "The line needs a 'custom_id': a string of 1-512 characters.".into(),
            )
        }
    };
    let id = Some(custom_id.clone());
    if !seen.insert(custom_id.clone()) {
        return refused(
            id,
            "duplicate_custom_id",
            format!("custom_id {custom_id:?} is on an earlier line; each line's must be unique."),
        );
    }
    if o.get("method").and_then(Value::as_str) != Some("POST") {
        return refused(id, "invalid_method", "The line's 'method' must be POST.".into());
    }
    match o.get("url").and_then(Value::as_str) {
        Some(u) if u == endpoint => {}
        Some(u) => {
            return refused(
                id,
                "invalid_url",
                format!("The line's 'url' ({u}) is not the batch's endpoint {endpoint}."),
            )
        }
        None => {
            return refused(
                id,
                "invalid_url",
                format!("The line has no 'url' string; it must be the batch's endpoint {endpoint}."),
            )
        }
    }
    let Some(body @ Value::Object(b)) = o.get("body") else {
        return refused(id, "invalid_body", "The line's 'body' must be a JSON object.".into());
    };
    if b.get("stream").and_then(Value::as_bool) == Some(true) {
        return refused(
            id,
            "invalid_body",
            "'stream' is not available in a batch: each answer is kept whole.".into(),
        );
    }
    let mut body = body.clone();
    if endpoint == "/v1/responses" && !b.contains_key("store") {
        // A batch's responses are its output file: not kept among the tenant's stored
        // responses (whose oldest a large batch would push out) unless the line asks.
        body["store"] = json!(false);
    }
    NewLine::Request {
        custom_id,
        body: body.to_string(),
    }
}

/// `POST /v1/batches`.
#[utoipa::path(post, path = "/v1/batches", summary = "Creates a batch (OpenAI Batch API): the input file's requests, run in the batch class within 24 h at the batch price.", tag = "batches", security(("bearer" = [])),
    request_body = BatchRequest,
    responses((status = 200, description = "The batch, `in_progress`.", body = BatchObject), crate::server::error::Errors))]
pub async fn create_batch(
    State(gw): State<Arc<AppState>>,
    Caller(ctx): Caller,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let Ok(Value::Object(o)) = serde_json::from_slice::<Value>(&body) else {
        return Err(ApiError::invalid("body", "the body must be a JSON object"));
    };
    let field = |k: &str| o.get(k).and_then(Value::as_str);
    let input =
        field("input_file_id").ok_or_else(|| ApiError::invalid("input_file_id", "'input_file_id' is required"))?;
    let endpoint = field("endpoint").ok_or_else(|| ApiError::invalid("endpoint", "'endpoint' is required"))?;
    if !ENDPOINTS.contains(&endpoint) {
        return Err(ApiError::invalid(
            "endpoint",
            format!(
                "endpoint {endpoint:?} cannot be batched here; use one of {}",
                ENDPOINTS.join(", ")
            ),
        ));
    }
    match field("completion_window") {
        Some("24h") => {}
        _ => {
            return Err(ApiError::invalid(
                "completion_window",
                "'completion_window' must be \"24h\"",
            ))
        }
    }
    let metadata = crate::api::openai::metadata(o.get("metadata"))?.map(|m| Value::Object(m).to_string());
    if ctx.key_id.starts_with("jwt:") {
        return Err(ApiError::invalid(
            "authorization",
            "A batch runs for up to 24 hours under the credential that created it: create it with an API key, not a JWT.",
        ));
    }
    let (file, content) = gw
        .tenants
        .file_content(&ctx.tenant_id, input)
        .await
        .map_err(|e| match e {
            TenantError::NoSuchFile(_) => ApiError::invalid("input_file_id", format!("No such File object: {input}")),
            e => store_error(e),
        })?;
    if !sees(&ctx, file.key_id.as_deref()) {
        return Err(ApiError::invalid(
            "input_file_id",
            format!("No such File object: {input}"),
        ));
    }
    if file.purpose != "batch" {
        return Err(ApiError::invalid(
            "input_file_id",
            format!(
                "file {input} has purpose {:?}; a batch's input has purpose 'batch'",
                file.purpose
            ),
        ));
    }
    let lines = read_lines(&content, endpoint)?;
    let b = gw
        .tenants
        .create_batch(&ctx.tenant_id, &ctx.key_id, endpoint, input, metadata, &lines)
        .await
        .map_err(store_error)?;
    gw.metrics.batches_created.inc();
    tracing::info!(batch = %b.id, tenant = %ctx.tenant_name, lines = b.counts.total, refused = b.counts.failed, "batch created");
    Ok(Json(batch_json(&b, None)))
}

/// `GET /v1/batches/{id}`.
#[utoipa::path(get, path = "/v1/batches/{id}", summary = "A batch, with its progress and usage so far.", tag = "batches", security(("bearer" = [])),
    params(("id" = String, Path, description = "A batch id (`batch_…`).")),
    responses((status = 200, description = "The batch.", body = BatchObject), crate::server::error::Errors))]
pub async fn get_batch(
    State(gw): State<Arc<AppState>>,
    Caller(ctx): Caller,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let b = visible_batch(&ctx, gw.tenants.batch(&ctx.tenant_id, &id).await)?;
    Ok(Json(batch_with_usage(&gw, &b).await))
}

/// A batch the credential sees (another key's, for a model-restricted key, is not found).
fn visible_batch(ctx: &TenantContext, b: Result<BatchInfo, TenantError>) -> Result<BatchInfo, ApiError> {
    let b = b.map_err(not_found)?;
    if !sees(ctx, Some(&b.key_id)) {
        return Err(not_found(TenantError::NoSuchBatch(b.id)));
    }
    Ok(b)
}

/// `GET /v1/batches`.
#[utoipa::path(get, path = "/v1/batches", summary = "Lists the tenant's batches, newest first.", tag = "batches", security(("bearer" = [])),
    params(BatchListParams),
    responses((status = 200, description = "`{\"object\": \"list\", \"data\": [batch…], \"first_id\", \"last_id\", \"has_more\"}`.", body = crate::api::schema::AnyObject), crate::server::error::Errors))]
pub async fn list_batches(
    State(gw): State<Arc<AppState>>,
    Caller(ctx): Caller,
    q: QueryResult,
) -> Result<Json<Value>, ApiError> {
    let q = query(q)?;
    if q.purpose.is_some() {
        return Err(ApiError::invalid("purpose", "'purpose' filters files, not batches"));
    }
    let page = q.page(20, 100)?;
    let mut batches = gw
        .tenants
        .list_batches(&ctx.tenant_id, own_objects(&ctx), &page)
        .await
        .map_err(not_found)?;
    let more = batches.len() as i64 == page.limit;
    batches.truncate(page.limit as usize - 1);
    Ok(Json(list_json(
        batches.iter().map(|b| batch_json(b, None)).collect(),
        more,
    )))
}

/// `POST /v1/batches/{id}/cancel`.
#[utoipa::path(post, path = "/v1/batches/{id}/cancel", summary = "Cancels a batch: no new line starts; it is `cancelled` once the lines running have finished.", tag = "batches", security(("bearer" = [])),
    params(("id" = String, Path, description = "A batch id (`batch_…`).")),
    responses((status = 200, description = "The batch, `cancelling` (or already `cancelled`).", body = BatchObject), crate::server::error::Errors))]
pub async fn cancel_batch(
    State(gw): State<Arc<AppState>>,
    Caller(ctx): Caller,
    ClientOrigin(origin): ClientOrigin,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let b = gw
        .management()
        .via(origin)
        .cancel_batch(Actor::Tenant(&ctx), &ctx.tenant_id, &id)
        .await
        .map_err(|e| match e {
            ManageError::Store(e) => not_found(e),
            e => e.into(),
        })?;
    Ok(Json(batch_json(&b, None)))
}

impl Management<'_> {
    /// Cancels a tenant's batch (see [`hearth_tenants::TenantStore::cancel_batch`]),
    /// audited as `batch.cancel`. A member needs the role that may create keys.
    pub async fn cancel_batch(&self, actor: Actor<'_>, tenant_id: &str, id: &str) -> Result<BatchInfo, ManageError> {
        actor.require(Permission::ManageKeys)?;
        // A model-restricted key cancels only its own (see `auth::own_objects`).
        if let Actor::Tenant(ctx) = actor {
            let b = self.tenants.batch(tenant_id, id).await?;
            if !sees(ctx, Some(&b.key_id)) {
                return Err(TenantError::NoSuchBatch(id.to_string()).into());
            }
        }
        let b = self.tenants.cancel_batch(tenant_id, id).await?;
        self.audit(
            actor,
            Some(tenant_id),
            "batch.cancel",
            &format!("batch:{id}"),
            json!({"completed": b.counts.completed, "failed": b.counts.failed, "total": b.counts.total}),
        )
        .await;
        Ok(b)
    }
}

/// The dashboard's view of a tenant's batches: each with its usage and cost so far.
pub async fn tenant_batches(gw: &AppState, tenant: &TenantContext) -> Result<Vec<Value>, ApiError> {
    let page = Page { after: None, limit: 50 };
    let batches = gw
        .tenants
        .list_batches(&tenant.tenant_id, own_objects(tenant), &page)
        .await
        .map_err(store_error)?;
    let mut out = Vec::with_capacity(batches.len());
    for b in &batches {
        out.push(batch_with_usage(gw, b).await);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn download_names_lose_quotes_controls_and_bidirectional_formatting() {
        assert_eq!(attachment_name("report\u{202E}fdp.exe"), "report_fdp.exe");
        assert_eq!(attachment_name("a\"b\\c\r\nd\u{2066}e\u{200B}f"), "a_b_c__d_e_f");
        assert_eq!(attachment_name("données 2026.jsonl"), "données 2026.jsonl");
    }

    #[test]
    fn a_wrong_url_is_named_as_written() {
        let lines = read_lines(
            b"{\"custom_id\": \"a\", \"method\": \"POST\", \"url\": \"/admin/v1/tenants\", \"body\": {}}\n{\"custom_id\": \"b\", \"method\": \"POST\", \"body\": {}}",
            "/v1/chat/completions",
        )
        .unwrap();
        let messages: Vec<String> = lines
            .iter()
            .map(|l| match l {
                NewLine::Refused { message, .. } => message.clone(),
                NewLine::Request { .. } => String::new(),
            })
            .collect();
        assert!(
            messages[0].contains("The line's 'url' (/admin/v1/tenants) is not"),
            "{messages:?}"
        );
        assert!(messages[1].contains("has no 'url' string"), "{messages:?}");
        assert!(messages.iter().all(|m| !m.contains("Some(")), "{messages:?}");
    }
}

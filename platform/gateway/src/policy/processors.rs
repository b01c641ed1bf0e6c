//! Tenant processors in the request pipeline (the sandbox itself is `hearth-runtime`).
//!
//! For each request of a tenant with active processors (tenant-wide, or attached to the
//! request's key), every processor gets a fresh instance (made ahead of the request by the
//! runtime, never used before); the same instance then sees the answer. Order: pre-processors run by ascending `position`, post-processors by
//! descending `position` (the first to see the request is the last to see the answer).
//!
//! * **pre** (`on-request`): the raw JSON body, before parsing; may replace it or reject
//!   the request;
//! * **post**, non-streamed (`on-response`): the whole JSON response;
//! * **post**, streamed (`on-chunk` per text delta, `on-stream-end`): may rewrite each
//!   delta, append text at the end, or end the stream with an error event.
//!
//! A processor that traps, runs out of CPU or memory, or returns too much fails only its
//! request, with an OpenAI-shaped error naming the processor and the limit. Usage is
//! metered from the worker's events whatever the processors do to the text.

use std::sync::Arc;

use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode};
use futures_util::StreamExt;
use hearth_protocol::GenerateEvent;
use hearth_runtime::{Action, Compiled, Header, Instance, Limits, ProcessorError, Request, Response, Runtime};
use hearth_tenants::processors::ActiveProcessor;
use hearth_tenants::{TenantContext, TenantStore};
use serde_json::Value;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;

use crate::server::error::ApiError;
use crate::upstream::workers::EventStream;

/// The gateway's processor runtime.
pub struct ProcessorHost {
    pub runtime: Arc<Runtime>,
}

impl ProcessorHost {
    /// Compiled code for a stored processor: from the runtime's caches, else fetched from
    /// the database and compiled on a blocking thread.
    pub async fn compiled(&self, store: &TenantStore, p: &ActiveProcessor) -> Result<Arc<Compiled>, ApiError> {
        if let Some(c) = self.runtime.lookup(&p.sha256, || None) {
            return Ok(c);
        }
        let wasm = store
            .processor_wasm(&p.sha256)
            .await
            .map_err(|e| {
                tracing::error!(error = %e, "processor store failed");
                ApiError::unavailable("processors are temporarily unavailable")
            })?
            .ok_or_else(|| failure(p, &ProcessorError::Instantiate("its code is missing".into())))?;
        let rt = self.runtime.clone();
        tokio::task::spawn_blocking(move || rt.compile(&wasm))
            .await
            .map_err(|_| ApiError::internal("compiling a processor failed"))?
            .map_err(|e| failure(p, &e))
    }
}

fn label(p: &ActiveProcessor) -> String {
    format!("processor '{}' v{} ({})", p.name, p.version, p.id)
}

/// A processor failure as the client sees it.
pub fn failure(p: &ActiveProcessor, e: &ProcessorError) -> ApiError {
    let status = match e {
        ProcessorError::Instantiate(_) => StatusCode::SERVICE_UNAVAILABLE,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    ApiError {
        status,
        message: format!("The tenant's {} {e}.", label(p)),
        kind: "processor_error",
        param: None,
        code: Some(e.code()),
        retry_after: None,
    }
}

fn rejection(p: &ActiveProcessor, status: u16, message: &str) -> ApiError {
    let status = StatusCode::from_u16(status)
        .ok()
        .filter(|s| s.is_client_error() || s.is_server_error())
        .unwrap_or(StatusCode::BAD_REQUEST);
    let message: String = message.chars().take(1000).collect();
    ApiError {
        status,
        message: format!("{message} (rejected by {})", label(p)),
        kind: "invalid_request_error",
        param: None,
        code: Some("processor_rejected"),
        retry_after: None,
    }
}

fn add_spent(spent: &std::sync::atomic::AtomicU64, d: std::time::Duration) {
    spent.fetch_add(d.as_micros() as u64, std::sync::atomic::Ordering::Relaxed);
}

/// The processors of one request, instantiated, in pre order.
pub struct Chain {
    items: Vec<(ActiveProcessor, Instance)>,
    tenant: String,
    endpoint: &'static str,
    /// Microseconds spent in guest calls so far (metered and priced as processor time);
    /// shared with the relay, which meters it however the request ends.
    spent: Arc<std::sync::atomic::AtomicU64>,
}

impl Chain {
    /// The chain for a request, or None when the tenant (and key) have no active processor.
    pub async fn load(
        host: &ProcessorHost,
        store: &TenantStore,
        ctx: &TenantContext,
        endpoint: &'static str,
    ) -> Result<Option<Self>, ApiError> {
        let active = store
            .active_processors(&ctx.tenant_id, &ctx.key_id)
            .await
            .map_err(|e| {
                tracing::error!(error = %e, "processor store failed");
                ApiError::unavailable("processors are temporarily unavailable")
            })?;
        if active.is_empty() {
            return Ok(None);
        }
        let mut items = Vec::with_capacity(active.len());
        for p in active {
            let compiled = host.compiled(store, &p).await?;
            let limits = Limits {
                cpu_ms: p.cpu_ms,
                memory_mib: p.memory_mib,
                ..Default::default()
            };
            let inst = host
                .runtime
                .instantiate(&compiled, &p.config, limits)
                .await
                .map_err(|e| failure(&p, &e))?;
            items.push((p, inst));
        }
        Ok(Some(Self {
            items,
            tenant: ctx.tenant_name.clone(),
            endpoint,
            spent: Arc::default(),
        }))
    }

    /// For each processor, whether its instance was made ahead of the request.
    pub fn instances_warm(&self) -> impl Iterator<Item = bool> + '_ {
        self.items.iter().map(|(_, i)| i.was_warm())
    }

    /// Microseconds spent in guest calls so far.
    pub fn spent_us(&self) -> u64 {
        self.spent.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The running total, for whoever meters the request.
    pub fn spent_handle(&self) -> Arc<std::sync::atomic::AtomicU64> {
        self.spent.clone()
    }

    fn flush_logs(&self) {
        for (p, i) in &self.items {
            let logs = i.logs();
            if !logs.is_empty() {
                tracing::info!(target: "hearth::processor", processor = %p.name, version = p.version, tenant = %self.tenant, logs = %logs.trim_end(), "processor log");
            }
        }
    }

    /// `on-request` through every processor, in order; returns the body to parse.
    pub async fn pre(&mut self, headers: &HeaderMap, body: Bytes) -> Result<Bytes, ApiError> {
        let mut text =
            String::from_utf8(body.to_vec()).map_err(|_| ApiError::malformed_json("the body is not UTF-8"))?;
        let selected: Vec<Header> = headers
            .iter()
            .filter(|(n, _)| {
                let n = n.as_str();
                n == "content-type" || n == "user-agent" || (n.starts_with("x-") && n != "x-api-key")
            })
            .filter_map(|(n, v)| {
                Some(Header {
                    name: n.as_str().to_string(),
                    value: v.to_str().ok()?.to_string(),
                })
            })
            .collect();
        let model_of = |text: &str| {
            serde_json::from_str::<Value>(text)
                .ok()
                .and_then(|v| v.get("model").and_then(Value::as_str).map(str::to_string))
                .unwrap_or_default()
        };
        let mut model = model_of(&text);
        let mut changed = false;
        for (p, inst) in &mut self.items {
            let req = Request {
                tenant: self.tenant.clone(),
                model: model.clone(),
                endpoint: self.endpoint.to_string(),
                body: text.clone(),
                headers: selected.clone(),
            };
            let started = std::time::Instant::now();
            let outcome = inst.on_request(&req).await;
            add_spent(&self.spent, started.elapsed());
            match outcome {
                Ok(Action::Continue) => {}
                Ok(Action::Replace(b)) => {
                    if !serde_json::from_str::<Value>(&b).is_ok_and(|v| v.is_object()) {
                        return Err(failure(
                            p,
                            &ProcessorError::Trap("returned a request body that is not a JSON object".into()),
                        ));
                    }
                    text = b;
                    model = model_of(&text);
                    changed = true;
                }
                Ok(Action::Reject(r)) => return Err(rejection(p, r.status, &r.message)),
                Err(e) => return Err(failure(p, &e)),
            }
        }
        self.flush_logs();
        Ok(if changed { Bytes::from(text) } else { body })
    }

    /// `on-response` through every processor, in reverse order.
    pub async fn post(&mut self, model: &str, body: Value) -> Result<Value, ApiError> {
        let mut text = body.to_string();
        let mut changed = false;
        for (p, inst) in self.items.iter_mut().rev() {
            let resp = Response {
                tenant: self.tenant.clone(),
                model: model.to_string(),
                endpoint: self.endpoint.to_string(),
                body: text.clone(),
            };
            let started = std::time::Instant::now();
            let outcome = inst.on_response(&resp).await;
            add_spent(&self.spent, started.elapsed());
            match outcome {
                Ok(Action::Continue) => {}
                Ok(Action::Replace(b)) => {
                    if serde_json::from_str::<Value>(&b).is_err() {
                        return Err(failure(
                            p,
                            &ProcessorError::Trap("returned a response that is not JSON".into()),
                        ));
                    }
                    text = b;
                    changed = true;
                }
                Ok(Action::Reject(r)) => return Err(rejection(p, r.status, &r.message)),
                Err(e) => return Err(failure(p, &e)),
            }
        }
        self.flush_logs();
        if changed {
            serde_json::from_str(&text).map_err(|_| ApiError::internal("a processor response failed to parse"))
        } else {
            Ok(body)
        }
    }

    /// Streams: every text delta through `on-chunk` (reverse order), `on-stream-end` before
    /// the last event. A failure or rejection ends the stream with an error event. Once the
    /// end hooks ran, the chain's time goes to `post_done` (the relay meters it) and the
    /// last event waits until the usage record is durable.
    pub fn stream(mut self, mut events: EventStream, mut post_done: Option<PostDoneSender>) -> EventStream {
        let (tx, rx) = mpsc::channel::<GenerateEvent>(64);
        tokio::spawn(async move {
            while let Some(ev) = events.next().await {
                let out = match ev {
                    GenerateEvent::Token {
                        index,
                        id,
                        text,
                        logprob,
                        top_logprobs,
                    } => match self.chunk(index, text).await {
                        Ok(text) => vec![GenerateEvent::Token {
                            index,
                            id,
                            text,
                            logprob,
                            top_logprobs,
                        }],
                        Err(e) => vec![e],
                    },
                    GenerateEvent::Done {
                        finish_reason,
                        usage,
                        timings,
                    } => {
                        let mut v = match self.end().await {
                            Ok(Some(tail)) => vec![GenerateEvent::Token {
                                index: 0,
                                id: u32::MAX,
                                text: tail,
                                logprob: None,
                                top_logprobs: Vec::new(),
                            }],
                            Ok(None) => Vec::new(),
                            Err(e) => vec![e],
                        };
                        if !matches!(v.last(), Some(GenerateEvent::Error { .. })) {
                            v.push(GenerateEvent::Done {
                                finish_reason,
                                usage,
                                timings,
                            });
                        }
                        if let Some(tx) = post_done.take() {
                            report_post(tx, self.spent_us()).await;
                        }
                        v
                    }
                    other => vec![other],
                };
                let stop = out
                    .iter()
                    .any(|e| matches!(e, GenerateEvent::Error { .. } | GenerateEvent::Done { .. }));
                for e in out {
                    if tx.send(e).await.is_err() {
                        return; // the client went away; dropping `events` cancels upstream
                    }
                }
                if stop {
                    break;
                }
            }
            self.flush_logs();
        });
        ReceiverStream::new(rx).boxed()
    }

    async fn chunk(&mut self, index: u32, mut text: String) -> Result<String, GenerateEvent> {
        for (p, inst) in self.items.iter_mut().rev() {
            let started = std::time::Instant::now();
            let outcome = inst.on_chunk(index, &text).await;
            add_spent(&self.spent, started.elapsed());
            match outcome {
                Ok(Action::Continue) => {}
                Ok(Action::Replace(t)) => text = t,
                Ok(Action::Reject(r)) => return Err(error_event(&rejection(p, r.status, &r.message))),
                Err(e) => return Err(error_event(&failure(p, &e))),
            }
        }
        Ok(text)
    }

    async fn end(&mut self) -> Result<Option<String>, GenerateEvent> {
        let mut tail = String::new();
        for (p, inst) in self.items.iter_mut().rev() {
            // What an earlier (outer) processor appends still passes the later ones' chunks.
            if !tail.is_empty() {
                let started = std::time::Instant::now();
                let outcome = inst.on_chunk(0, &tail).await;
                add_spent(&self.spent, started.elapsed());
                match outcome {
                    Ok(Action::Replace(t)) => tail = t,
                    Ok(Action::Continue) => {}
                    Ok(Action::Reject(r)) => return Err(error_event(&rejection(p, r.status, &r.message))),
                    Err(e) => return Err(error_event(&failure(p, &e))),
                }
            }
            let started = std::time::Instant::now();
            let outcome = inst.on_stream_end().await;
            add_spent(&self.spent, started.elapsed());
            match outcome {
                Ok(Action::Continue) => {}
                Ok(Action::Replace(t)) => tail.push_str(&t),
                Ok(Action::Reject(r)) => return Err(error_event(&rejection(p, r.status, &r.message))),
                Err(e) => return Err(error_event(&failure(p, &e))),
            }
        }
        Ok((!tail.is_empty()).then_some(tail))
    }
}

/// An error for the SSE stream: `code` `processor:<json of the ApiError>` so the response
/// writer can render it exactly.
fn error_event(e: &ApiError) -> GenerateEvent {
    GenerateEvent::Error {
        code: format!("processor:{}", e.code.unwrap_or("processor_error")),
        message: e.message.clone(),
    }
}

/// The error of a processor's `error_event`, for the response writer.
pub fn stream_error(code: &str, message: &str) -> ApiError {
    let code: &'static str = match code {
        "processor_rejected" => "processor_rejected",
        "processor_cpu_limit" => "processor_cpu_limit",
        "processor_memory_limit" => "processor_memory_limit",
        "processor_input_too_large" => "processor_input_too_large",
        "processor_output_too_large" => "processor_output_too_large",
        "processor_trap" => "processor_trap",
        "processor_unavailable" => "processor_unavailable",
        _ => "processor_error",
    };
    ApiError {
        status: StatusCode::INTERNAL_SERVER_ERROR,
        message: message.to_string(),
        kind: if code == "processor_rejected" {
            "invalid_request_error"
        } else {
            "processor_error"
        },
        param: None,
        code: Some(code),
        retry_after: None,
    }
}

/// What post-processing reports to the pipeline's relay: the processors' total time, and where to
/// say that the record is durable.
pub struct PostDone {
    pub processor_us: u64,
    pub written: oneshot::Sender<()>,
}

pub type PostDoneSender = oneshot::Sender<PostDone>;

/// Reports post-processing's time and waits until the usage record is durable.
pub async fn report_post(tx: PostDoneSender, processor_us: u64) {
    let (written, durable) = oneshot::channel();
    if tx.send(PostDone { processor_us, written }).is_ok() {
        let _ = durable.await;
    }
}

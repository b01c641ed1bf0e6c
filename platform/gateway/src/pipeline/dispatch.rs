//! Phase `dispatch`: the engine request, sent to the worker [`route`](super::route) chose —
//! or, for a long prompt on a pool with prefill and decode workers, to two workers
//! ([`disaggregate`](super::disaggregate)), whose streams become one. An unreachable worker
//! is marked unhealthy and the next choice tried — nothing has been streamed yet, so a retry
//! is safe.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;

use hearth_protocol::{cache_namespace, GenerateEvent, GenerateRequest};

use super::route::{self, Placement, RouteHints, RouteRequest};
use super::RequestContext;
use crate::error::ApiError;
use crate::registry::ServedModel;
use crate::workers::{EventStream, WorkerError};

/// The worker's event stream and the request's place on it (None when disaggregated: the
/// stitching task holds both places).
pub struct Dispatched {
    pub events: EventStream,
    pub placement: Option<Placement>,
}

pub async fn run(state: &crate::state::AppState, ctx: &mut RequestContext) -> Result<Dispatched, ApiError> {
    let model = ctx.model()?.clone();
    let tenant_id = ctx.tenant()?.tenant_id.clone();
    let prompt = std::mem::take(&mut ctx.prompt);
    let request = ctx.request()?;
    let mut sampling = request.common.sampling.clone();
    sampling.max_tokens = ctx.max_tokens;
    let req = GenerateRequest {
        request_id: ctx.request_id.clone(),
        model: model.id.clone(),
        prompt,
        sampling,
        cache_namespace: cache_namespace(&tenant_id, request.common.prompt_cache_key.as_deref()),
        n: request.common.n,
        prefill_only: false,
        resume: Vec::new(),
        kv_source: None,
        qos: ctx.qos.clone(),
        constraint: request.common.constraint.clone(),
    };
    // Sessions are the tenant's own: equal header values of two tenants are two sessions.
    let session = ctx
        .header("x-session-affinity")
        .map(|s| format!("{tenant_id}\u{1f}{s}"));
    // The session's pin, shared by every gateway (one Redis read; none without Redis).
    let (shared, pinned) = match (&state.shared_routing, &session) {
        (Some(sh), Some(s)) => (Some(sh.clone()), sh.pinned(&model.id, s).await),
        _ => (None, None),
    };
    let hints = RouteHints {
        session,
        region: ctx.header("x-hearth-region"),
        prefix_key: route::prefix_key(&model, &request.routing_text(), &req.cache_namespace),
        tenant: ctx.qos.tenant.clone(),
        pinned,
        shared,
    };
    let routed = RouteRequest::new(&model, &req.prompt, &req.cache_namespace, hints);
    // One completion only: `n` choices share one prompt on one worker.
    if req.n == 1 && req.sampling.max_tokens > 1 {
        let pd = tracing::info_span!("route").in_scope(|| route::run_pd(&model, &routed, 0));
        if let Some(pd) = pd {
            match super::disaggregate::start(&model, req, routed, pd).await {
                Ok(d) => return Ok(d),
                Err((req, routed, exclude)) => return colocated(&model, &req, &routed, exclude).await,
            }
        }
    }
    colocated(&model, &req, &routed, 0).await
}

/// How long dispatch waits for a worker's first event to see whether its queue refused the
/// request (a refusal comes at once; a first token takes longer and is passed on).
const REFUSAL_WAIT: Duration = Duration::from_millis(50);

/// Sends `req` to the best worker not in `exclude` (a mask of router slots), then the next
/// best while workers are unreachable or their own queues refuse it (`overloaded`: another
/// gateway filled them; nothing has been streamed, so trying the next is safe).
pub async fn colocated(
    model: &Arc<ServedModel>,
    req: &GenerateRequest,
    routed: &RouteRequest,
    mut exclude: u64,
) -> Result<Dispatched, ApiError> {
    let mut last = None;
    let mut refused = None;
    let mut pinned = routed.hints.pinned.clone();
    // A session's placement is claimed in the shared store: if another gateway pinned the
    // session elsewhere meanwhile, the request follows that pin instead — and if that
    // worker cannot take it here (not usable, over its bound), the second claim, naming it
    // as the previous owner, moves the pin to where the request went.
    let mut claims = 2;
    while let Some(placement) =
        tracing::info_span!("route").in_scope(|| route::run_pinned(model, routed, exclude, pinned.as_deref()))
    {
        let slot = placement.slot;
        if let (Some(shared), Some(session), true) = (&routed.hints.shared, &routed.hints.session, claims > 0) {
            claims -= 1;
            if let Some(name) = placement.worker_name() {
                let owner = shared.claim(&model.id, session, &name, pinned.as_deref()).await;
                if let Some(owner) = owner.filter(|o| *o != name && claims > 0) {
                    tracing::debug!(worker = %owner, "session pinned by another gateway");
                    pinned = Some(owner);
                    drop(placement);
                    continue;
                }
                claims = 0;
            }
        }
        exclude |= 1 << slot;
        let Some(client) = model.client(slot) else {
            continue;
        };
        match client.generate(req.clone()).await {
            Ok(mut events) => {
                match tokio::time::timeout(REFUSAL_WAIT, events.next()).await {
                    Ok(Some(GenerateEvent::Error { code, message })) if code == "overloaded" => {
                        tracing::info!(worker = client.name(), "worker's queue is full; trying the next");
                        refused = Some(message);
                        continue; // the placement is released
                    }
                    Ok(Some(first)) => events = futures_util::stream::iter([first]).chain(events).boxed(),
                    // Ended (the relay reports it), or still queued.
                    Ok(None) | Err(_) => {}
                }
                return Ok(Dispatched {
                    events,
                    placement: Some(placement),
                });
            }
            Err(e @ WorkerError::Unavailable { .. }) => {
                tracing::warn!(worker = client.name(), error = %e, "worker unavailable; trying the next");
                mark_unhealthy(model, slot, &client);
                last = Some(e);
            }
            Err(e) => {
                tracing::error!(worker = client.name(), error = %e, "worker failed");
                return Err(ApiError::unavailable(format!("the worker for {} failed", model.id)));
            }
        }
    }
    if let Some(message) = refused {
        let queued = super::admit::pool_queue(model, &req.qos.tenant).queued;
        return Err(ApiError::overloaded(message, model.queues.retry_after(queued)));
    }
    let detail = last.map_or_else(String::new, |e| format!(": {e}"));
    Err(ApiError::unavailable(format!(
        "no worker for model {} is reachable{detail}",
        model.id
    )))
}

/// Until its health check passes again — if `slot` still holds `client` (the worker may
/// have left, and the slot been reused, while the request was on its way).
pub fn mark_unhealthy(model: &ServedModel, slot: usize, client: &std::sync::Arc<dyn crate::workers::WorkerClient>) {
    let mut r = model.router();
    if model.holds(slot, client) {
        if let Some(w) = r.worker_mut(slot) {
            w.healthy = false;
        }
    }
}

//! Phase `dispatch`: the engine request, sent to the worker [`route`](super::route) chose —
//! or, for a long prompt on a pool with prefill and decode workers, to two workers
//! ([`disaggregate`](super::disaggregate)), whose streams become one. An unreachable worker
//! is marked unhealthy and the next choice tried — nothing has been streamed yet, so a retry
//! is safe.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;

use hearth_protocol::{cache_namespace, GenerateEvent, GenerateRequest, KvSource};

use super::route::{self, Placement, RouteHints, RouteRequest};
use super::RequestContext;
use crate::server::error::ApiError;
use crate::upstream::registry::ServedModel;
use crate::upstream::workers::{EventStream, WorkerError};

/// The worker's event stream and the request's place on it (None when disaggregated: the
/// stitching task holds both places), and how to continue it elsewhere if its worker is lost.
pub struct Dispatched {
    pub events: EventStream,
    pub placement: Option<Placement>,
    pub failover: Option<Failover>,
}

/// Mid-stream failover: the request as sent, to continue on another worker after the tokens
/// the client has already been sent (`resume`: the worker takes them in as its own — they
/// count against `max_tokens`, stop strings, the grammar and the sampler's stream — and
/// sends only what follows). The new worker's prefix cache makes re-reading the prompt
/// cheap; its `Done` reports the usage of the whole request once. One completion (`n = 1`)
/// only: several choices have no single continuation point.
pub struct Failover {
    model: Arc<ServedModel>,
    req: GenerateRequest,
    routed: RouteRequest,
    /// Workers already lost by this request (a slot mask).
    exclude: u64,
    /// Failovers left.
    left: u32,
}

/// How many times one request moves to another worker before the client gets the error.
const FAILOVERS: u32 = 2;

/// Whether an event ending a stream means the worker was lost (its connection broke, it
/// went silent, it ended without finishing) rather than refusing or failing the request.
pub fn worker_lost(code: &str) -> bool {
    matches!(code, "worker_disconnected" | "stream_idle_timeout" | "stage_lost")
}

impl Failover {
    fn new(model: &Arc<ServedModel>, req: GenerateRequest, routed: RouteRequest) -> Option<Self> {
        (req.n == 1 && !req.prefill_only).then(|| Self {
            model: model.clone(),
            req,
            routed,
            exclude: 0,
            left: FAILOVERS,
        })
    }

    /// Continues the request on another worker after `sent` (choice 0's tokens the client
    /// was sent); `lost` is where it was.
    pub async fn resume(&mut self, sent: &[u32], lost: Option<&Placement>) -> Resumed {
        if let Some(p) = lost {
            p.mark_lost();
            self.exclude |= 1 << p.slot;
        }
        let resume: Vec<u32> = self.req.resume.iter().chain(sent).copied().collect();
        // Nothing left to generate: the answer was complete (at its length limit).
        if resume.len() >= self.req.sampling.max_tokens.max(1) as usize
            || self.req.prompt.len() + resume.len() >= self.model.context_length as usize
        {
            return Resumed::Complete;
        }
        if self.left == 0 {
            return Resumed::Unavailable;
        }
        self.left -= 1;
        let mut req = self.req.clone();
        req.resume = resume;
        req.kv_source = None;
        match colocated(&self.model, &req, &self.routed, self.exclude).await {
            Ok(mut d) => {
                tracing::warn!(
                    resumed_tokens = req.resume.len(),
                    "worker lost mid-stream; continuing on another"
                );
                if let Some(p) = &d.placement {
                    self.exclude |= 1 << p.slot;
                }
                d.failover = None;
                Resumed::On(Box::new(d))
            }
            Err(e) => {
                tracing::warn!(error = %e.message, "worker lost mid-stream and no other can continue the request");
                Resumed::Unavailable
            }
        }
    }
}

/// What a failover came to.
pub enum Resumed {
    /// The request continues on another worker.
    On(Box<Dispatched>),
    /// Nothing was left to generate (`max_tokens` or the context reached): the answer ends
    /// as complete, at its length limit.
    Complete,
    /// No worker can take it, or it has moved too often: the stream ends with the error.
    Unavailable,
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
        adapter: ctx.adapter.clone(),
    };
    // Sessions are the tenant's own: equal header values of two tenants are two sessions.
    // Without the header, the request's own session key (`prompt_cache_key`, Claude Code's
    // session) pins it.
    let session = ctx
        .header("x-session-affinity")
        .or_else(|| request.common.session.clone())
        .map(|s| format!("{tenant_id}\u{1f}{s}"));
    // The session's pin, shared by every gateway (one Redis read; none without Redis).
    let (shared, pinned) = match (&state.shared_routing, &session) {
        (Some(sh), Some(s)) => (Some(sh.clone()), sh.pinned(&model.id, s).await),
        _ => (None, None),
    };
    let hints = RouteHints {
        session,
        region: ctx.header("x-hearth-region"),
        prefix_key: route::prefix_key(&model, &request.routing_text(), &req.kv_namespace()),
        tenant: ctx.qos.tenant.clone(),
        pinned,
        shared,
        adapter: req.adapter.as_ref().map(|a| a.digest.clone()),
    };
    let routed = RouteRequest::new(&model, &req.prompt, &req.kv_namespace(), hints);
    // One completion only: `n` choices share one prompt on one worker.
    if req.n == 1 && req.sampling.max_tokens > 1 {
        let pd = tracing::info_span!("route").in_scope(|| route::run_pd(&model, &routed, 0));
        if let Some(pd) = pd {
            // The stitching task takes the request; the failover keeps its own copy.
            let failover = Failover::new(&model, req.clone(), routed.clone());
            let (req, routed, exclude) = match super::disaggregate::start(&model, req, routed, pd).await {
                Ok(mut d) => {
                    d.failover = failover;
                    return Ok(d);
                }
                Err(not_started) => not_started,
            };
            let mut d = colocated(&model, &req, &routed, exclude).await?;
            d.failover = Failover::new(&model, req, routed);
            return Ok(d);
        }
    }
    let mut d = colocated(&model, &req, &routed, 0).await?;
    d.failover = Failover::new(&model, req, routed);
    Ok(d)
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
        match client.generate(with_fetch(model, req, &placement)).await {
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
                    failover: None,
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

/// The request as sent to its worker: with the peer to pull the prompt's cached prefix
/// from, when the router named one (the worker imports what arrives and computes the rest:
/// a peer that is slow or gone costs a recompute, never an error).
fn with_fetch(model: &ServedModel, req: &GenerateRequest, placement: &Placement) -> GenerateRequest {
    let mut req = req.clone();
    let Some(fetch) = placement.fetch else { return req };
    let peer = model.client(fetch.from).and_then(|c| c.kv_address());
    if let (None, Some(worker)) = (&req.kv_source, peer) {
        req.kv_source = Some(KvSource {
            worker,
            hold: String::new(),
            tokens: fetch.held_tokens as u32,
        });
    }
    req
}

/// Until its health check passes again — if `slot` still holds `client` (the worker may
/// have left, and the slot been reused, while the request was on its way).
pub fn mark_unhealthy(
    model: &ServedModel,
    slot: usize,
    client: &std::sync::Arc<dyn crate::upstream::workers::WorkerClient>,
) {
    let mut r = model.router();
    if model.holds(slot, client) {
        if let Some(w) = r.worker_mut(slot) {
            w.healthy = false;
        }
    }
}

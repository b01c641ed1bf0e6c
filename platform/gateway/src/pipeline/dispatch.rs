//! Phase `dispatch`: the engine request, sent to the worker [`route`](super::route) chose.
//! An unreachable worker is marked unhealthy and the next choice tried — nothing has been
//! streamed yet, so a retry is safe.

use hearth_protocol::{cache_namespace, GenerateRequest};

use super::route::{self, Placement, RouteHints, RouteRequest};
use super::RequestContext;
use crate::error::ApiError;
use crate::workers::{EventStream, WorkerError};

/// The worker's event stream and the request's place on it.
pub struct Dispatched {
    pub events: EventStream,
    pub placement: Placement,
}

pub async fn run(ctx: &mut RequestContext) -> Result<Dispatched, ApiError> {
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
    };
    let hints = RouteHints {
        session: ctx.header("x-session-affinity"),
        region: ctx.header("x-hearth-region"),
        prefix_key: route::prefix_key(&model, &request.routing_text(), &req.cache_namespace),
    };
    let routed = RouteRequest::new(&model, &req.prompt, &req.cache_namespace, hints);
    let mut exclude = 0u64;
    let mut last = None;
    while let Some(placement) = tracing::info_span!("route").in_scope(|| route::run(&model, &routed, exclude)) {
        let slot = placement.slot;
        exclude |= 1 << slot;
        let Some(client) = model.client(slot).cloned() else {
            continue;
        };
        match client.generate(req.clone()).await {
            Ok(events) => return Ok(Dispatched { events, placement }),
            Err(e @ WorkerError::Unavailable { .. }) => {
                tracing::warn!(worker = client.name(), error = %e, "worker unavailable; trying the next");
                if let Some(w) = model.router().worker_mut(slot) {
                    w.healthy = false;
                }
                last = Some(e);
            }
            Err(e) => {
                tracing::error!(worker = client.name(), error = %e, "worker failed");
                return Err(ApiError::unavailable(format!("the worker for {} failed", model.id)));
            }
        }
    }
    let detail = last.map_or_else(String::new, |e| format!(": {e}"));
    Err(ApiError::unavailable(format!(
        "no worker for model {} is reachable{detail}",
        model.id
    )))
}

//! Phase `admit`: the request's scheduling class and the pool's queue.
//!
//! The class is the credential's (its tenant's, lowered by its key's; see
//! [`hearth_tenants::TenantContext::priority`]), lowered again by the request if it asks — the
//! `x-hearth-priority` header or OpenAI's `service_tier` (`flex` = batch). It travels to the
//! worker with the tenant and its share ([`Qos`]), where the engine schedules fairly by it.
//!
//! Admission control: a model's pool queues at most the sum of its usable workers' queue
//! limits ([`WorkerInfo::queue_tokens`](hearth_protocol::WorkerInfo)), in prompt tokens not
//! yet computed — the router's per-worker account, the same measure the engine refuses by.
//! [`QueueState::admit`] decides, as the engine does: batch work is shed past half the
//! queue, interactive work past all of it unless its tenant holds less than its part. A
//! shed request gets a 503 `overloaded` with a `retry-after` from how fast the pool has
//! been draining its queue. A worker that refuses a request itself (another gateway filled
//! its queue) is skipped for the next one (see [`super::dispatch`]).

use hearth_protocol::{Priority, Qos, QueueState};

use super::RequestContext;
use crate::server::error::ApiError;
use crate::server::metrics::TenantClassLabels;
use crate::state::AppState;
use crate::upstream::registry::ServedModel;

/// The request header that lowers a request's class (`batch`).
pub const PRIORITY_HEADER: &str = "x-hearth-priority";

pub fn run(state: &AppState, ctx: &mut RequestContext) -> Result<(), ApiError> {
    let asked = match ctx.header(PRIORITY_HEADER) {
        Some(h) => Some(Priority::parse(&h).ok_or_else(|| {
            ApiError::invalid(
                PRIORITY_HEADER,
                format!("{PRIORITY_HEADER} must be interactive or batch, not {h:?}"),
            )
        })?),
        None => None,
    };
    let tenant = ctx.tenant()?;
    let priority = tenant
        .priority()
        .lowered_by(asked)
        .lowered_by(ctx.request()?.common.service_tier);
    let qos = Qos {
        tenant: tenant.tenant_id.clone(),
        priority,
        share: tenant.share(),
    };
    let name = tenant.tenant_name.clone();
    ctx.qos = qos;
    let model = ctx.model()?;
    let queue = pool_queue(model, &ctx.qos.tenant);
    if let Err(shed) = queue.admit(priority, ctx.prompt.len() as u64) {
        state.metrics.shed.get_or_create(&labels(model, &name, priority)).inc();
        let retry = model.queues.retry_after(shed.excess);
        tracing::info!(
            model = %model.id,
            tenant = %name,
            priority = %priority,
            queued = queue.queued,
            limit = queue.limit,
            "shed"
        );
        return Err(ApiError::overloaded(
            format!(
                "{} is at capacity for {priority} requests ({} of {} queued prompt tokens); retry after {retry} s",
                model.id, queue.queued, queue.limit
            ),
            retry,
        ));
    }
    Ok(())
}

/// The per-tenant, per-class metrics' labels.
pub fn labels(model: &ServedModel, tenant: &str, priority: Priority) -> TenantClassLabels {
    TenantClassLabels {
        model: model.id.clone(),
        tenant: tenant.to_string(),
        priority: priority.as_str().to_string(),
    }
}

/// The pool's queue as a request of `tenant` would join it: its usable workers' queued
/// prompt tokens against the sum of their limits (unbounded if any has none).
pub fn pool_queue(model: &ServedModel, tenant: &str) -> QueueState {
    let (mut limit, mut queued, mut bounded, mut any) = (0u64, 0u64, true, false);
    for (_, w) in model.router().workers().filter(|(_, w)| w.healthy && !w.draining) {
        any = true;
        bounded &= w.queue_tokens > 0;
        limit = limit.saturating_add(w.queue_tokens);
        queued = queued.saturating_add(w.inflight_prefill_tokens);
    }
    let (tenant_queued, others) = model.queues.tenant(tenant);
    QueueState {
        // No usable worker: dispatch answers that; no limit: nothing to shed by.
        limit: if any && bounded { limit } else { 0 },
        queued,
        tenant_queued,
        tenants: others + 1,
    }
}

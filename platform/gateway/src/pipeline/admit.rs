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

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use hearth_protocol::{Priority, Qos, QueueState};

use super::RequestContext;
use crate::error::ApiError;
use crate::metrics::TenantClassLabels;
use crate::registry::ServedModel;
use crate::state::AppState;

/// The request header that lowers a request's class (`batch`).
pub const PRIORITY_HEADER: &str = "x-hearth-priority";

/// How long one bucket of the drain-rate estimate spans.
const DRAIN_BUCKET: Duration = Duration::from_secs(5);

/// `retry-after` when nothing drained lately: the pool is stalled, or nothing measured yet.
const STALLED_RETRY_S: u64 = 5;

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

/// Per model: prompt tokens dispatched and not yet computed, by tenant (what the router
/// counts per worker), and how fast they drain.
#[derive(Debug, Default)]
pub struct TenantQueues {
    inner: Mutex<Queues>,
}

#[derive(Debug, Default)]
struct Queues {
    queued: HashMap<String, u64>,
    /// Tokens drained since `bucket` began, and in the bucket before it (over its span).
    bucket: Option<Instant>,
    current: u64,
    previous: u64,
    previous_span: Duration,
}

impl TenantQueues {
    fn lock(&self) -> std::sync::MutexGuard<'_, Queues> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A request of `tenant` was dispatched with `tokens` to compute.
    pub fn add(&self, tenant: &str, tokens: u64) {
        *self.lock().queued.entry(tenant.to_string()).or_default() += tokens;
    }

    /// The request left the queue: `computed` (its first token arrived: it counts towards
    /// the drain rate) or not (it failed or was cancelled first).
    pub fn remove(&self, tenant: &str, tokens: u64, computed: bool) {
        let mut q = self.lock();
        if let Some(t) = q.queued.get_mut(tenant) {
            *t = t.saturating_sub(tokens);
            if *t == 0 {
                q.queued.remove(tenant);
            }
        }
        if computed {
            let now = Instant::now();
            match q.bucket {
                Some(b) if now - b < DRAIN_BUCKET => {}
                Some(b) => {
                    let span = now - b;
                    (q.previous, q.previous_span) = if span < 2 * DRAIN_BUCKET {
                        (q.current, span)
                    } else {
                        (0, Duration::ZERO)
                    };
                    q.current = 0;
                    q.bucket = Some(now);
                }
                None => q.bucket = Some(now),
            }
            q.current += tokens;
        }
    }

    /// `tenant`'s queued tokens, and how many other tenants have some queued.
    pub fn tenant(&self, tenant: &str) -> (u64, u64) {
        let q = self.lock();
        let mine = q.queued.get(tenant).copied().unwrap_or(0);
        let others = q.queued.len() as u64 - u64::from(q.queued.contains_key(tenant));
        (mine, others)
    }

    /// Prompt tokens per second the pool has computed lately (None: nothing measured).
    pub fn drain_rate(&self) -> Option<f64> {
        let q = self.lock();
        let b = q.bucket?;
        let age = b.elapsed();
        if age >= 2 * DRAIN_BUCKET {
            return None;
        }
        let (tokens, span) = if q.previous > 0 {
            (q.previous + q.current, q.previous_span + age)
        } else {
            (q.current, age.max(Duration::from_millis(100)))
        };
        (tokens > 0).then(|| tokens as f64 / span.as_secs_f64())
    }

    /// Seconds until `excess` queued tokens have drained at the recent rate (1 to 60;
    /// [`STALLED_RETRY_S`] when nothing drained in the last 5–10 s).
    pub fn retry_after(&self, excess: u64) -> u64 {
        match self.drain_rate() {
            Some(rate) => (excess as f64 / rate).ceil().clamp(1.0, 60.0) as u64,
            None => STALLED_RETRY_S,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenants_queue_and_drain() {
        let q = TenantQueues::default();
        q.add("a", 300);
        q.add("b", 100);
        assert_eq!(q.tenant("a"), (300, 1));
        assert_eq!(q.tenant("c"), (0, 2));
        assert_eq!(q.retry_after(1000), STALLED_RETRY_S, "nothing measured yet");
        q.remove("a", 300, true);
        q.remove("b", 100, false);
        assert_eq!(q.tenant("a"), (0, 0));
        let rate = q.drain_rate().expect("a rate once tokens drained");
        assert!(rate > 0.0);
        // 300 tokens in at most 0.1 s: ten times the queue drains in seconds, not minutes.
        assert!(q.retry_after(3000) <= 60);
        assert!(q.retry_after(u64::MAX / 2) == 60);
    }
}

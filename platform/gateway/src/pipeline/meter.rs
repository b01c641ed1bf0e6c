//! Phase `meter`: one usage record per request, keyed by its request id (idempotent).
//! The record is made durable (the ledger's outbox) before the client gets the end of its
//! response; its database commit is then awaited in the background and its cost counted
//! towards the tenant's budget at once.

use futures_util::future::BoxFuture;
use futures_util::FutureExt;
use hearth_billing::{month_of, Pending, UsageRecord};
use hearth_tenants::now_ms;

use super::RequestContext;
use crate::server::error::ApiError;
use crate::state::AppState;

/// Where finished requests' usage goes. The gateway meters into its ledger; a composition
/// without metering (the benchmark's baseline) supplies its own.
pub trait Meter: Send + Sync + 'static {
    /// A dispatched request's admission mark (see `hearth_billing::outbox`), held until its
    /// final record is durable: a process that dies meanwhile leaves the request to be
    /// recorded as `interrupted` by the next one. None: not kept.
    fn admit(&self, _rec: &UsageRecord) -> Option<hearth_billing::Admitted> {
        None
    }
    /// Makes `rec` durable; returns the handle on its commit.
    fn record<'a>(&'a self, rec: &'a mut UsageRecord) -> BoxFuture<'a, Option<Pending>>;
    /// After the response: waits for the commit and accounts for its cost.
    fn settle<'a>(&'a self, rec: &'a UsageRecord, pending: Option<Pending>) -> BoxFuture<'a, ()>;
}

impl Meter for AppState {
    fn admit(&self, rec: &UsageRecord) -> Option<hearth_billing::Admitted> {
        self.ledger.admit(rec)
    }

    fn record<'a>(&'a self, rec: &'a mut UsageRecord) -> BoxFuture<'a, Option<Pending>> {
        async move {
            rec.finished_at = now_ms();
            match self.ledger.record_durable(rec).await {
                Ok(p) => Some(p),
                Err(e) => {
                    tracing::error!(record = ?rec, error = %e, "usage record could not be written");
                    None
                }
            }
        }
        .boxed()
    }

    fn settle<'a>(&'a self, rec: &'a UsageRecord, pending: Option<Pending>) -> BoxFuture<'a, ()> {
        async move {
            let Some(p) = pending else { return };
            match p.committed().await {
                Ok(r) if r.inserted => self
                    .budgets
                    .add(&rec.tenant_id, &month_of(rec.started_at), r.cost.total_nusd),
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(request_id = %rec.request_id, error = %e, "usage record is waiting in the outbox")
                }
            }
        }
        .boxed()
    }
}

/// A request refused before it reached a worker (400/401/402/403/413/429, a processor's
/// refusal, no worker): still one record per authenticated request, for audit, with the
/// refusal's code — and no tokens or processor time, so it costs nothing. Once dispatched, the relay meters
/// it instead: what the engine reports, or for a client that went away, the prompt and what
/// was generated until then (the work was done).
pub async fn refused(meter: &dyn Meter, ctx: &mut RequestContext, error: &ApiError) {
    if let Some(rec) = ctx.usage.as_mut() {
        rec.error_code = error.code.map(str::to_string);
        rec.prompt_tokens = 0;
        rec.cached_tokens = 0;
        rec.completion_tokens = 0;
        rec.processor_us = 0;
        meter.record(rec).await;
    }
}

//! Phase `authenticate`: the bearer credential (API key or JWT) with the `inference` scope,
//! or for a batch's line the key that created the batch; opens the request's usage record.

use hearth_billing::UsageRecord;
use hearth_tenants::now_ms;

use super::RequestContext;
use crate::auth::{authorize, Scope};
use crate::server::error::ApiError;
use crate::state::AppState;

pub async fn run(state: &AppState, ctx: &mut RequestContext) -> Result<(), ApiError> {
    let tenant = match &ctx.batch {
        Some(b) => crate::auth::batch_credential(state, &b.key_id).await?,
        None => authorize(state, &ctx.headers, ctx.peer, Scope::Inference).await?,
    };
    if !state.ledger.accepting() {
        // Neither the usage outbox (disk full) nor the database takes records: nothing is
        // served that could not be billed.
        return Err(ApiError::unavailable_code(
            "usage_unavailable",
            "Usage cannot be recorded right now (the outbox's disk and the database are both failing); try again shortly.",
        ));
    }
    ctx.unrecorded = Some(state.unrecorded.start());
    let mut usage = UsageRecord::started(
        &ctx.request_id,
        &tenant.tenant_id,
        Some(&tenant.key_id),
        ctx.endpoint.path(),
        now_ms(),
    );
    usage.batch_id = ctx.batch.as_ref().map(|b| b.batch_id.clone());
    ctx.usage = Some(usage);
    ctx.span.record("hearth.tenant", tenant.tenant_name.as_str());
    ctx.tenant = Some(tenant);
    Ok(())
}

//! Phase `authenticate`: the bearer credential (API key or JWT) with the `inference` scope;
//! opens the request's usage record.

use hearth_billing::UsageRecord;
use hearth_tenants::now_ms;

use super::RequestContext;
use crate::auth::{authorize, Scope};
use crate::error::ApiError;
use crate::state::AppState;

pub async fn run(state: &AppState, ctx: &mut RequestContext) -> Result<(), ApiError> {
    let tenant = authorize(state, &ctx.headers, Scope::Inference).await?;
    ctx.unrecorded = Some(state.unrecorded.start());
    ctx.usage = Some(UsageRecord::started(
        &ctx.request_id,
        &tenant.tenant_id,
        Some(&tenant.key_id),
        ctx.endpoint.path(),
        now_ms(),
    ));
    ctx.span.record("hearth.tenant", tenant.tenant_name.as_str());
    ctx.tenant = Some(tenant);
    Ok(())
}

//! Phase `preprocess`: the tenant's processors, instantiated for this request; their
//! pre-processors may rewrite the raw body (or refuse the request). The chain is kept in
//! the context for the response.

use super::RequestContext;
use crate::policy::processors::Chain;
use crate::server::error::ApiError;
use crate::state::AppState;

pub async fn run(state: &AppState, ctx: &mut RequestContext) -> Result<(), ApiError> {
    let body = match &ctx.body {
        Ok(b) => b.clone(),
        Err(e) => return Err(ApiError::invalid("body", e.body_text())),
    };
    let Some(host) = &state.processors else {
        return Ok(());
    };
    let tenant = ctx.tenant()?;
    let Some(mut chain) = Chain::load(host, &state.tenants, tenant, ctx.endpoint.path()).await? else {
        return Ok(());
    };
    for warm in chain.instances_warm() {
        state.metrics.count_processor_instance(warm);
    }
    let started = std::time::Instant::now();
    let rewritten = chain.pre(&ctx.headers, body).await;
    state.metrics.observe_processor("pre", started.elapsed());
    if let Some(u) = ctx.usage.as_mut() {
        u.processor_us = chain.spent_us();
    }
    ctx.body = Ok(rewritten?);
    ctx.chain = Some(chain);
    Ok(())
}

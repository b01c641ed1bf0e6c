//! Phase `limit`: requests and tokens per minute and requests in flight, for the tenant
//! and the key, in one step (all or nothing). Runs once the prompt is tokenized, so that
//! the request's worst case is known and reserved: its prompt and `n × max_tokens`
//! completion tokens. The [`Admission`] goes with the request and, when it ends, gives
//! back what was not used.
//!
//! A request that did not set `max_tokens` gets at most what a full minute of the
//! tightest tokens-per-minute limit leaves after its prompt; one that set more than that
//! is refused (429) rather than silently shortened.

use super::RequestContext;
use crate::policy::limits::Admission;
use crate::server::error::ApiError;
use crate::server::metrics::LimiterLabels;
use crate::state::AppState;

pub async fn run(state: &AppState, ctx: &mut RequestContext) -> Result<(), ApiError> {
    let tenant = ctx.tenant()?.clone();
    let common = &ctx.request()?.common;
    let n = common.n.max(1);
    let prompt = ctx.prompt.len() as u32;
    let tightest = [tenant.tenant_limits.tpm, tenant.key_limits.tpm]
        .into_iter()
        .flatten()
        .min();
    if let (None, Some(tpm)) = (common.max_tokens, tightest) {
        let cap = tpm.saturating_sub(prompt) / n;
        if cap >= 1 && ctx.max_tokens > cap {
            ctx.max_tokens = cap;
        }
    }
    let worst = prompt.saturating_add(ctx.max_tokens.saturating_mul(n));
    admit(state, ctx, worst).await
}

/// A `count_tokens` request: counted against the tenant's and the key's requests per minute
/// and in flight like any request (tokenizing a long prompt costs CPU), with no tokens
/// reserved — counting generates none, and is never billed. Runs before the body is
/// parsed and tokenized, so that a refused count costs no tokenizer time.
pub async fn count(state: &AppState, ctx: &mut RequestContext) -> Result<(), ApiError> {
    admit(state, ctx, 0).await
}

async fn admit(state: &AppState, ctx: &mut RequestContext, worst: u32) -> Result<(), ApiError> {
    let tenant = ctx.tenant()?.clone();
    match state.limiter.admit(&tenant, &ctx.request_id, worst).await {
        Ok((admission, rate)) => {
            ctx.rate = rate;
            state
                .metrics
                .limiter
                .get_or_create(&LimiterLabels {
                    decision: "admitted".into(),
                    limit: String::new(),
                })
                .inc();
            ctx.lease = Some(admission);
            Ok(())
        }
        Err(l) => {
            ctx.rate = l.state;
            state
                .metrics
                .limiter
                .get_or_create(&LimiterLabels {
                    decision: "rejected".into(),
                    limit: l.error.kind.to_string(),
                })
                .inc();
            Err(l.error)
        }
    }
}

/// What a request holds from this phase until it ends.
pub type Admitted = Admission;

//! Phase `limit`: requests and tokens per minute and requests in flight, for the tenant
//! and the key, in one step (one Redis round trip when the limits are shared). Runs once
//! the prompt is tokenized, so the prompt's tokens are charged at admission; the
//! completion's are charged when it ends (see [`Admitted::finish`]).

use hearth_tenants::TenantContext;

use super::RequestContext;
use crate::error::ApiError;
use crate::limits::{InFlight, Limiter};
use crate::metrics::LimiterLabels;
use crate::state::AppState;

/// A request that passed the limits; holds its in-flight slots until it ends.
pub struct Admitted {
    tenant: TenantContext,
    /// Released (dropped) when the request ends.
    _in_flight: InFlight,
}

impl Admitted {
    /// Charges the completion's tokens, then releases the in-flight slots.
    pub async fn finish(self, limiter: &Limiter, completion_tokens: u32) {
        limiter.charge_completion(&self.tenant, completion_tokens).await;
    }
}

pub async fn run(state: &AppState, ctx: &mut RequestContext) -> Result<(), ApiError> {
    let tenant = ctx.tenant()?.clone();
    match state
        .limiter
        .admit(&tenant, &ctx.request_id, ctx.prompt.len() as u32)
        .await
    {
        Ok((in_flight, rate)) => {
            ctx.rate = rate;
            state
                .metrics
                .limiter
                .get_or_create(&LimiterLabels {
                    decision: "admitted".into(),
                    limit: String::new(),
                })
                .inc();
            ctx.lease = Some(Admitted {
                tenant,
                _in_flight: in_flight,
            });
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

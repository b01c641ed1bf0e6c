//! Phase `budget`, in two steps. First, before any work: a hard budget already spent
//! refuses (402), a soft one warns (`x-hearth-budget-*` headers). Then, once the prompt is
//! tokenized ([`reserve`]): the request's worst case — every prompt token uncached and
//! `n × max_tokens` completion tokens at the current price (a batch line's at the batch
//! price) — is reserved against a hard
//! budget, together with every other request in flight, so that concurrency cannot spend
//! past it. The reservation ([`BudgetHold`](crate::policy::budget::BudgetHold)) is released when the request's real cost has
//! been counted.
//!
//! The reservations themselves, in memory or in Redis, are [`crate::policy::budget`]'s.

use hearth_billing::{format_nusd, month_of, price_of, rate, UsageRecord};
use hearth_tenants::now_ms;

use super::RequestContext;
use crate::policy::budget::{Reservation, ReserveError};
use crate::server::error::ApiError;
use crate::state::AppState;

/// Step one: a hard budget already spent refuses; a soft one warns.
pub async fn run(state: &AppState, ctx: &mut RequestContext) -> Result<(), ApiError> {
    let tenant = ctx.tenant()?.clone();
    let Some(b) = tenant.budget else {
        return Ok(());
    };
    let month = month_of(now_ms());
    let spent = state.budgets.spent(&state.ledger, &tenant.tenant_id, &month).await?;
    ctx.budget.remaining_nusd = Some(b.monthly_nusd - spent);
    if spent >= b.monthly_nusd {
        let msg = format!(
            "The monthly budget of tenant {} (${}) is spent (${} in {month}).",
            tenant.tenant_name,
            format_nusd(b.monthly_nusd),
            format_nusd(spent)
        );
        if b.hard {
            return Err(ApiError::budget_exceeded(format!(
                "{msg} Raise it with 'hearth admin tenant budget' or wait for the next month."
            )));
        }
        ctx.budget.warning = Some(msg);
    }
    Ok(())
}

/// Step two (after `tokenize`): reserves the request's worst-case cost against a hard
/// budget, or refuses (402) when it cannot fit beside the spend and every request in flight.
pub async fn reserve(state: &AppState, ctx: &mut RequestContext) -> Result<(), ApiError> {
    let tenant = ctx.tenant()?.clone();
    let Some(b) = tenant.budget.filter(|b| b.hard) else {
        return Ok(());
    };
    let model = ctx.model()?.id.clone();
    let n = ctx.request()?.common.n.max(1);
    let now = now_ms();
    let prices = state.budgets.prices(&state.ledger).await?;
    let worst = UsageRecord {
        model: model.clone(),
        prompt_tokens: ctx.prompt.len() as u32,
        cached_tokens: 0,
        completion_tokens: ctx.max_tokens.saturating_mul(n),
        adapter: ctx.usage.as_ref().and_then(|u| u.adapter.clone()),
        // A batch's line is held at the batch price it will pay, not the list price.
        batch_id: ctx.batch.as_ref().map(|b| b.batch_id.clone()),
        ..UsageRecord::started(&ctx.request_id, &tenant.tenant_id, None, "", now)
    };
    let nusd = rate(&worst, price_of(&prices, &worst)).total_nusd;
    if nusd == 0 {
        return Ok(());
    }
    let month = month_of(now);
    let spent = state.budgets.spent(&state.ledger, &tenant.tenant_id, &month).await?;
    let refuse = |held: i64| {
        ApiError::budget_exceeded(format!(
            "This request could cost up to ${} ({} prompt tokens and up to {} completion tokens), more than the ${} left of tenant {}'s monthly budget of ${} (${} spent, ${} held by requests in flight). Lower max_tokens, wait for requests in flight, or raise the budget.",
            format_nusd(nusd),
            worst.prompt_tokens,
            worst.completion_tokens,
            format_nusd((b.monthly_nusd - spent - held).max(0)),
            tenant.tenant_name,
            format_nusd(b.monthly_nusd),
            format_nusd(spent),
            format_nusd(held),
        ))
    };
    let reservation = Reservation {
        tenant_id: &tenant.tenant_id,
        month: &month,
        request_id: &ctx.request_id,
        nusd,
        spent,
        limit_nusd: b.monthly_nusd,
        now_ms: now,
    };
    match state.budgets.reserve(reservation).await {
        Ok(hold) => ctx.budget_hold = Some(hold),
        Err(ReserveError::Full { held }) => return Err(refuse(held)),
        // Money is not spent on a guess: without the shared holds, refuse.
        Err(ReserveError::Unavailable) => return Err(ApiError::unavailable("budget check temporarily unavailable")),
    }
    Ok(())
}

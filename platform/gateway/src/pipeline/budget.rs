//! Phase `budget`: the tenant's monthly budget — a hard one refuses once spent, a soft one
//! warns (`x-hearth-budget-*` headers).

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use axum::http::{HeaderMap, HeaderValue};
use hearth_billing::{format_nusd, month_of, UsageLedger};
use hearth_tenants::now_ms;

use super::RequestContext;
use crate::error::ApiError;
use crate::state::AppState;

/// How long a tenant's month spend is trusted before the ledger is asked again; costs this
/// gateway records are added at once, other gateways' within this time.
const SPEND_TTL: Duration = Duration::from_secs(2);

/// Month-to-date spend per tenant, from the ledger's `tenant_spend`.
#[derive(Default)]
pub struct BudgetCache {
    spend: Mutex<HashMap<String, (String, i64, Instant)>>,
}

impl BudgetCache {
    async fn spend(&self, ledger: &UsageLedger, tenant_id: &str, month: &str) -> Result<i64, ApiError> {
        if let Some((m, v, at)) = self.lock().get(tenant_id) {
            if m == month && at.elapsed() < SPEND_TTL {
                return Ok(*v);
            }
        }
        let v = ledger.month_spend(tenant_id, month).await.map_err(|e| {
            tracing::error!(error = %e, "spend lookup failed");
            ApiError::unavailable("budget check temporarily unavailable")
        })?;
        self.lock()
            .insert(tenant_id.to_string(), (month.to_string(), v, Instant::now()));
        Ok(v)
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, (String, i64, Instant)>> {
        self.spend.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds a cost this gateway just recorded.
    pub fn add(&self, tenant_id: &str, month: &str, nusd: i64) {
        if let Some((m, v, _)) = self.lock().get_mut(tenant_id) {
            if m == month {
                *v += nusd;
            }
        }
    }
}

/// What the budget phase tells the client (`x-hearth-budget-*` headers).
#[derive(Default)]
pub struct BudgetState {
    remaining_nusd: Option<i64>,
    warning: Option<String>,
}

impl BudgetState {
    pub fn apply(&self, h: &mut HeaderMap) {
        if let Some(r) = self.remaining_nusd {
            if let Ok(v) = HeaderValue::from_str(&format_nusd(r.max(0))) {
                h.insert("x-hearth-budget-remaining-usd", v);
            }
        }
        if let Some(w) = &self.warning {
            if let Ok(v) = HeaderValue::from_str(w) {
                h.insert("x-hearth-budget-warning", v);
            }
        }
    }
}

pub async fn run(state: &AppState, ctx: &mut RequestContext) -> Result<(), ApiError> {
    let tenant = ctx.tenant()?.clone();
    let Some(b) = tenant.budget else {
        return Ok(());
    };
    let month = month_of(now_ms());
    let spent = state.budgets.spend(&state.ledger, &tenant.tenant_id, &month).await?;
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

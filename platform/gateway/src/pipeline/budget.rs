//! Phase `budget`, in two steps. First, before any work: a hard budget already spent
//! refuses (402), a soft one warns (`x-hearth-budget-*` headers). Then, once the prompt is
//! tokenized ([`reserve`]): the request's worst case — every prompt token uncached and
//! `n × max_tokens` completion tokens at the current price — is reserved against a hard
//! budget, together with every other request in flight, so that concurrency cannot spend
//! past it. The reservation ([`BudgetHold`]) is released when the request's real cost has
//! been counted.
//!
//! Where reservations live: in this gateway's memory, or with `--redis-url` in Redis (one
//! hash of amounts and one sorted set of expiries per tenant and month), so that every
//! gateway sees every other's requests in flight. Spend itself comes from the ledger
//! (cached [`SPEND_TTL`]); in Redis mode a hold is kept that long after its cost is
//! counted, so that other gateways' caches have caught up when it goes.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use axum::http::{HeaderMap, HeaderValue};
use hearth_billing::{format_nusd, month_of, price_of, rate, Price, UsageLedger, UsageRecord};
use hearth_tenants::now_ms;

use super::RequestContext;
use crate::error::ApiError;
use crate::state::AppState;

/// How long a tenant's month spend (and the price list) is trusted before the ledger is
/// asked again; costs this gateway records are added at once, other gateways' within this
/// time.
pub const SPEND_TTL: Duration = Duration::from_secs(2);

/// How long a reservation in Redis survives a gateway that died holding it.
const HOLD_TTL_MS: i64 = 15 * 60 * 1000;

/// Reserves `ARGV[2]` (nUSD) for request `ARGV[1]` unless `ARGV[3]` (spent) + every live
/// reservation + it exceeds `ARGV[4]` (the budget). KEYS: amounts hash, expiries zset.
/// ARGV[5]: now (ms), ARGV[6]: expiry (ms). Returns {1, reserved before} or {0, reserved}.
const RESERVE_SCRIPT: &str = r#"
local now = tonumber(ARGV[5])
local dead = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)
for _, id in ipairs(dead) do
  redis.call('HDEL', KEYS[1], id)
  redis.call('ZREM', KEYS[2], id)
end
local held = 0
for _, v in ipairs(redis.call('HVALS', KEYS[1])) do held = held + tonumber(v) end
if tonumber(ARGV[3]) + held + tonumber(ARGV[2]) > tonumber(ARGV[4]) then
  return {0, held}
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[6], ARGV[1])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[6]) - now + 60000)
redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[6]) - now + 60000)
return {1, held}
"#;

#[derive(Default)]
struct TenantSpend {
    month: String,
    spent: i64,
    fetched: Option<Instant>,
    /// This gateway's reservations (in-process mode).
    reserved: i64,
}

/// Month-to-date spend per tenant, from the ledger's `tenant_spend`; the prices; and the
/// reservations of requests in flight.
#[derive(Default)]
pub struct BudgetCache {
    spend: Mutex<HashMap<String, TenantSpend>>,
    prices: Mutex<Option<(Arc<[Price]>, Instant)>>,
    /// Shared reservations (`--redis-url`): connection and key prefix.
    redis: Option<(redis::aio::ConnectionManager, String, redis::Script)>,
    /// The limiter's view of that Redis: while it is down, hard budgets refuse at once.
    pub health: Option<Arc<crate::redis_conn::RedisHealth>>,
}

impl BudgetCache {
    /// Reservations shared by every gateway on this Redis.
    pub fn with_redis(conn: redis::aio::ConnectionManager, prefix: &str) -> Self {
        Self {
            redis: Some((conn, prefix.to_string(), redis::Script::new(RESERVE_SCRIPT))),
            ..Default::default()
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, TenantSpend>> {
        self.spend.lock().unwrap_or_else(|e| e.into_inner())
    }

    async fn spent(&self, ledger: &UsageLedger, tenant_id: &str, month: &str) -> Result<i64, ApiError> {
        if let Some(t) = self.lock().get(tenant_id) {
            if t.month == month && t.fetched.is_some_and(|at| at.elapsed() < SPEND_TTL) {
                return Ok(t.spent);
            }
        }
        // Stamped before the query: what committed after this instant may be missing.
        let asked = Instant::now();
        let v = ledger.month_spend(tenant_id, month).await.map_err(|e| {
            tracing::error!(error = %e, "spend lookup failed");
            ApiError::unavailable("budget check temporarily unavailable")
        })?;
        let mut map = self.lock();
        let t = map.entry(tenant_id.to_string()).or_default();
        if t.month != month {
            t.month = month.to_string();
            t.reserved = 0;
            t.spent = 0;
        }
        // Spend only grows within a month: a read that started before this gateway added a
        // cost must not take it away again.
        t.spent = t.spent.max(v);
        t.fetched = Some(asked);
        Ok(t.spent)
    }

    async fn prices(&self, ledger: &UsageLedger) -> Result<Arc<[Price]>, ApiError> {
        if let Some((p, at)) = &*self.prices.lock().unwrap_or_else(|e| e.into_inner()) {
            if at.elapsed() < SPEND_TTL {
                return Ok(p.clone());
            }
        }
        let p: Arc<[Price]> = ledger
            .prices(None)
            .await
            .map_err(|e| {
                tracing::error!(error = %e, "price lookup failed");
                ApiError::unavailable("budget check temporarily unavailable")
            })?
            .into();
        *self.prices.lock().unwrap_or_else(|e| e.into_inner()) = Some((p.clone(), Instant::now()));
        Ok(p)
    }

    /// Adds a cost this gateway just recorded.
    pub fn add(&self, tenant_id: &str, month: &str, nusd: i64) {
        if let Some(t) = self.lock().get_mut(tenant_id) {
            if t.month == month {
                t.spent += nusd;
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

/// A request's reservation against its tenant's hard budget; released on drop.
pub struct BudgetHold {
    cache: Arc<BudgetCache>,
    tenant_id: String,
    month: String,
    request_id: String,
    nusd: i64,
}

impl Drop for BudgetHold {
    fn drop(&mut self) {
        match &self.cache.redis {
            None => {
                if let Some(t) = self.cache.lock().get_mut(&self.tenant_id) {
                    if t.month == self.month {
                        t.reserved -= self.nusd;
                    }
                }
            }
            Some((conn, prefix, _)) => {
                let (mut conn, keys) = (conn.clone(), hold_keys(prefix, &self.tenant_id, &self.month));
                let id = std::mem::take(&mut self.request_id);
                if let Ok(rt) = tokio::runtime::Handle::try_current() {
                    rt.spawn(async move {
                        // Other gateways see this request's cost in their spend within
                        // SPEND_TTL of its commit: keep the hold until then.
                        tokio::time::sleep(SPEND_TTL).await;
                        let mut p = redis::pipe();
                        p.hdel(&keys[0], &id).ignore().zrem(&keys[1], &id).ignore();
                        if let Err(e) = p.query_async::<()>(&mut conn).await {
                            tracing::warn!(error = %e, "releasing a budget hold in Redis failed (it expires by itself)");
                        }
                    });
                }
            }
        }
    }
}

fn hold_keys(prefix: &str, tenant_id: &str, month: &str) -> [String; 2] {
    [
        format!("{prefix}budget:{tenant_id}:{month}:held"),
        format!("{prefix}budget:{tenant_id}:{month}:expiry"),
    ]
}

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
    match &state.budgets.redis {
        None => {
            let mut map = state.budgets.lock();
            let t = map.entry(tenant.tenant_id.clone()).or_default();
            // Checked and taken under one lock, against the freshest spend.
            let spent = spent.max(t.spent);
            if spent + t.reserved + nusd > b.monthly_nusd {
                return Err(refuse(t.reserved));
            }
            t.reserved += nusd;
        }
        Some(_) if state.budgets.health.as_ref().is_some_and(|h| h.is_down()) => {
            // Money is not spent on a guess: without the shared holds, refuse (at once).
            return Err(ApiError::unavailable("budget check temporarily unavailable"));
        }
        Some((conn, prefix, script)) => {
            let keys = hold_keys(prefix, &tenant.tenant_id, &month);
            let mut conn = conn.clone();
            let reply: Result<Vec<i64>, _> = script
                .key(&keys[0])
                .key(&keys[1])
                .arg(&ctx.request_id)
                .arg(nusd)
                .arg(spent)
                .arg(b.monthly_nusd)
                .arg(now)
                .arg(now + HOLD_TTL_MS)
                .invoke_async(&mut conn)
                .await;
            match reply {
                Ok(v) if v.first() == Some(&1) => {}
                Ok(v) => return Err(refuse(v.get(1).copied().unwrap_or(0))),
                Err(e) => {
                    // The script may have run with its reply lost: take back its hold.
                    if let Some(h) = &state.budgets.health {
                        h.failed(&conn, &e.to_string());
                    }
                    let (mut conn, id) = (conn.clone(), ctx.request_id.clone());
                    tokio::spawn(async move {
                        let mut p = redis::pipe();
                        p.hdel(&keys[0], &id).ignore().zrem(&keys[1], &id).ignore();
                        let _ = p.query_async::<()>(&mut conn).await;
                    });
                    // Money is not spent on a guess: without the shared holds, refuse.
                    tracing::error!(error = %e, "budget reservation in Redis failed");
                    return Err(ApiError::unavailable("budget check temporarily unavailable"));
                }
            }
        }
    }
    ctx.budget_hold = Some(BudgetHold {
        cache: state.budgets.clone(),
        tenant_id: tenant.tenant_id,
        month,
        request_id: ctx.request_id.clone(),
        nusd,
    });
    Ok(())
}

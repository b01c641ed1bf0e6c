//! Spending budgets: each tenant's spend this month (from the ledger, cached [`SPEND_TTL`]),
//! the prices, and reservations of a request's worst-case cost against a hard budget
//! ([`BudgetCache::reserve`]), taken together with every other request in flight so that
//! concurrency cannot spend past it. A reservation ([`BudgetHold`]) is released when the
//! request's real cost has been counted. The pipeline's `budget` phase decides with them.
//!
//! Where reservations live: in this gateway's memory, or with `--redis-url` in Redis (one
//! hash of amounts and one sorted set of expiries per tenant and month), so that every
//! gateway sees every other's requests in flight. In Redis mode a hold is kept
//! [`SPEND_TTL`] after its cost is counted, so that other gateways' caches have caught up
//! when it goes.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use axum::http::{HeaderMap, HeaderValue};
use hearth_billing::{format_nusd, Price, UsageLedger};

use crate::server::error::ApiError;

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
    pub health: Option<Arc<crate::server::redis_conn::RedisHealth>>,
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

    pub async fn spent(&self, ledger: &UsageLedger, tenant_id: &str, month: &str) -> Result<i64, ApiError> {
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

    pub async fn prices(&self, ledger: &UsageLedger) -> Result<Arc<[Price]>, ApiError> {
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
    pub remaining_nusd: Option<i64>,
    pub warning: Option<String>,
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

/// Why a reservation was not taken.
#[derive(Debug)]
pub enum ReserveError {
    /// It does not fit beside the spend: this much is held by requests in flight.
    Full { held: i64 },
    /// The shared holds are unreachable (Redis): money is not spent on a guess.
    Unavailable,
}

/// One request's worst-case cost, to reserve against a tenant's hard budget.
#[derive(Debug)]
pub struct Reservation<'a> {
    pub tenant_id: &'a str,
    pub month: &'a str,
    pub request_id: &'a str,
    pub nusd: i64,
    /// The month's spend as last read from the ledger.
    pub spent: i64,
    pub limit_nusd: i64,
    pub now_ms: i64,
}

impl BudgetCache {
    /// Reserves `r.nusd` if it fits beside the spend and every hold in flight (checked and
    /// taken at once: under one lock, or in one Redis script).
    pub async fn reserve(self: &Arc<Self>, r: Reservation<'_>) -> Result<BudgetHold, ReserveError> {
        match &self.redis {
            None => {
                let mut map = self.lock();
                let t = map.entry(r.tenant_id.to_string()).or_default();
                // Checked and taken under one lock, against the freshest spend.
                let spent = r.spent.max(t.spent);
                if spent + t.reserved + r.nusd > r.limit_nusd {
                    return Err(ReserveError::Full { held: t.reserved });
                }
                t.reserved += r.nusd;
            }
            Some(_) if self.health.as_ref().is_some_and(|h| h.is_down()) => {
                // Without the shared holds, refuse (at once).
                return Err(ReserveError::Unavailable);
            }
            Some((conn, prefix, script)) => {
                let keys = hold_keys(prefix, r.tenant_id, r.month);
                let mut conn = conn.clone();
                let reply: Result<Vec<i64>, _> = script
                    .key(&keys[0])
                    .key(&keys[1])
                    .arg(r.request_id)
                    .arg(r.nusd)
                    .arg(r.spent)
                    .arg(r.limit_nusd)
                    .arg(r.now_ms)
                    .arg(r.now_ms + HOLD_TTL_MS)
                    .invoke_async(&mut conn)
                    .await;
                match reply {
                    Ok(v) if v.first() == Some(&1) => {}
                    Ok(v) => {
                        return Err(ReserveError::Full {
                            held: v.get(1).copied().unwrap_or(0),
                        })
                    }
                    Err(e) => {
                        // The script may have run with its reply lost: take back its hold.
                        if let Some(h) = &self.health {
                            h.failed(&conn, &e.to_string());
                        }
                        let (mut conn, id) = (conn.clone(), r.request_id.to_string());
                        tokio::spawn(async move {
                            let mut p = redis::pipe();
                            p.hdel(&keys[0], &id).ignore().zrem(&keys[1], &id).ignore();
                            let _ = p.query_async::<()>(&mut conn).await;
                        });
                        tracing::error!(error = %e, "budget reservation in Redis failed");
                        return Err(ReserveError::Unavailable);
                    }
                }
            }
        }
        Ok(BudgetHold {
            cache: self.clone(),
            tenant_id: r.tenant_id.to_string(),
            month: r.month.to_string(),
            request_id: r.request_id.to_string(),
            nusd: r.nusd,
        })
    }
}

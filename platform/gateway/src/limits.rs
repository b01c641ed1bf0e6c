//! Rate limits per tenant and per API key (or JWT principal): requests/minute and
//! tokens/minute (GCRA), and requests in flight.
//!
//! Two implementations behind one [`Limiter`]:
//! * in-process (`governor`): each gateway counts alone — right for one gateway;
//! * Redis (`--redis-url`): one Lua script per phase does every check of the phase
//!   atomically (GCRA on Redis' own clock, in-flight leases in a sorted set), so the limits
//!   hold across any number of gateway replicas. If Redis cannot be reached, the gateway
//!   falls back to its in-process limits (and says so in the log) rather than failing
//!   requests.
//!
//! Tokens are charged as prompt tokens at admission and completion tokens once known (the
//! latter best effort: a completion never fails after the fact, it only uses up the budget
//! of later requests).

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::http::{HeaderMap, HeaderValue, StatusCode};
use governor::clock::{Clock, DefaultClock};
use governor::middleware::StateInformationMiddleware;
use governor::state::{InMemoryState, NotKeyed};
use governor::{Quota, RateLimiter};
use hearth_tenants::{Limits, TenantContext};

use crate::error::ApiError;

type Gcra = RateLimiter<NotKeyed, InMemoryState, DefaultClock, StateInformationMiddleware>;

/// One limited quantity of one subject, rebuilt when its quota changes.
struct Bucket {
    per_minute: u32,
    gcra: Gcra,
}

impl Bucket {
    fn new(per_minute: u32) -> Option<Self> {
        let n = NonZeroU32::new(per_minute)?;
        Some(Self {
            per_minute,
            gcra: RateLimiter::direct(Quota::per_minute(n)).with_middleware(),
        })
    }
}

#[derive(Default)]
struct Subject {
    requests: Option<Arc<Bucket>>,
    tokens: Option<Arc<Bucket>>,
    in_flight: Arc<AtomicU32>,
}

/// What the `x-ratelimit-*` headers say (the tightest of tenant and key).
#[derive(Debug, Clone, Copy, Default)]
pub struct RateState {
    pub limit_requests: Option<u32>,
    pub remaining_requests: Option<u32>,
    pub limit_tokens: Option<u32>,
    pub remaining_tokens: Option<u32>,
}

impl RateState {
    fn merge(&mut self, limit: u32, remaining: u32, tokens: bool) {
        let (l, r) = if tokens {
            (&mut self.limit_tokens, &mut self.remaining_tokens)
        } else {
            (&mut self.limit_requests, &mut self.remaining_requests)
        };
        if r.is_none_or(|cur| remaining < cur) {
            *l = Some(limit);
            *r = Some(remaining);
        }
    }

    /// `x-ratelimit-{limit,remaining,reset}-{requests,tokens}` (reset: time to refill one unit).
    pub fn apply(&self, h: &mut HeaderMap) {
        let mut set = |name: &'static str, v: String| {
            if let Ok(v) = HeaderValue::from_str(&v) {
                h.insert(name, v);
            }
        };
        if let (Some(l), Some(r)) = (self.limit_requests, self.remaining_requests) {
            set("x-ratelimit-limit-requests", l.to_string());
            set("x-ratelimit-remaining-requests", r.to_string());
            set("x-ratelimit-reset-requests", format!("{:.3}s", 60.0 / l as f64));
        }
        if let (Some(l), Some(r)) = (self.limit_tokens, self.remaining_tokens) {
            set("x-ratelimit-limit-tokens", l.to_string());
            set("x-ratelimit-remaining-tokens", r.to_string());
            set("x-ratelimit-reset-tokens", format!("{:.3}s", 60.0 / l as f64));
        }
    }
}

/// Holds a request's in-flight slots (local counters or Redis leases); released on drop.
#[derive(Default)]
pub struct InFlight {
    local: Vec<Arc<AtomicU32>>,
    redis: Option<(redis::aio::ConnectionManager, Vec<String>, String)>,
}

impl std::fmt::Debug for InFlight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InFlight")
            .field("local", &self.local.len())
            .field("redis", &self.redis.as_ref().map(|r| &r.1))
            .finish()
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        for c in &self.local {
            c.fetch_sub(1, Ordering::AcqRel);
        }
        if let Some((mut conn, keys, id)) = self.redis.take() {
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(async move {
                    let mut p = redis::pipe();
                    for k in &keys {
                        p.zrem(k, &id).ignore();
                    }
                    if let Err(e) = p.query_async::<()>(&mut conn).await {
                        tracing::warn!(error = %e, "releasing an in-flight lease in Redis failed (it expires by itself)");
                    }
                });
            }
        }
    }
}

/// A refusal: the error (429, OpenAI's shape) and how long to wait.
#[derive(Debug)]
pub struct Limited {
    pub error: ApiError,
    pub retry_after: Duration,
    pub state: RateState,
}

/// The in-process limiter.
#[derive(Default)]
pub struct LocalLimiter {
    subjects: Mutex<HashMap<String, Subject>>,
}

fn limited(kind: &'static str, what: &str, who: &str, limit: u32, wait: Duration, state: RateState) -> Box<Limited> {
    let secs = wait.as_secs_f64().ceil().max(1.0);
    let error = ApiError {
        status: StatusCode::TOO_MANY_REQUESTS,
        message: format!("Rate limit reached for {what} on {who}: limit {limit}. Please retry after {secs:.0} s."),
        kind,
        param: None,
        code: Some("rate_limit_exceeded"),
        retry_after: Some(secs as u64),
    };
    Box::new(Limited {
        error,
        retry_after: Duration::from_secs_f64(secs),
        state,
    })
}

impl LocalLimiter {
    fn subject(&self, id: &str, l: &Limits) -> (Option<Arc<Bucket>>, Option<Arc<Bucket>>, Arc<AtomicU32>) {
        let mut map = self.subjects.lock().unwrap_or_else(|e| e.into_inner());
        let s = map.entry(id.to_string()).or_default();
        // A changed quota starts a fresh bucket.
        if s.requests.as_ref().map(|b| b.per_minute) != l.rpm {
            s.requests = l.rpm.and_then(Bucket::new).map(Arc::new);
        }
        if s.tokens.as_ref().map(|b| b.per_minute) != l.tpm {
            s.tokens = l.tpm.and_then(Bucket::new).map(Arc::new);
        }
        (s.requests.clone(), s.tokens.clone(), s.in_flight.clone())
    }

    fn subjects(ctx: &TenantContext) -> [(String, &Limits, String); 2] {
        [
            (
                format!("t:{}", ctx.tenant_id),
                &ctx.tenant_limits,
                format!("tenant {}", ctx.tenant_name),
            ),
            (
                format!("k:{}", ctx.key_id),
                &ctx.key_limits,
                format!("API key {}", ctx.key_id),
            ),
        ]
    }

    /// The request phase: one request and one in-flight slot, for tenant and key.
    pub fn admit_request(&self, ctx: &TenantContext) -> Result<(InFlight, RateState), Box<Limited>> {
        let mut state = RateState::default();
        let mut held = InFlight::default();
        for (id, limits, who) in Self::subjects(ctx) {
            let (requests, _, in_flight) = self.subject(&id, limits);
            if let Some(b) = requests {
                match b.gcra.check() {
                    Ok(snap) => state.merge(b.per_minute, snap.remaining_burst_capacity(), false),
                    Err(not_until) => {
                        state.merge(b.per_minute, 0, false);
                        let wait = not_until.wait_time_from(DefaultClock::default().now());
                        return Err(limited(
                            "requests",
                            "requests per minute",
                            &who,
                            b.per_minute,
                            wait,
                            state,
                        ));
                    }
                }
            }
            if let Some(max) = limits.concurrent {
                if in_flight.fetch_add(1, Ordering::AcqRel) >= max {
                    in_flight.fetch_sub(1, Ordering::AcqRel);
                    return Err(limited(
                        "requests",
                        "concurrent requests",
                        &who,
                        max,
                        Duration::from_secs(1),
                        state,
                    ));
                }
                held.local.push(in_flight);
            }
        }
        Ok((held, state))
    }

    /// The token phase: charges the prompt's tokens (refused if the budget cannot cover it).
    pub fn admit_tokens(&self, ctx: &TenantContext, tokens: u32, state: &mut RateState) -> Result<(), Box<Limited>> {
        for (id, limits, who) in Self::subjects(ctx) {
            let (_, Some(b), _) = self.subject(&id, limits) else {
                continue;
            };
            let n = NonZeroU32::new(tokens.max(1)).unwrap_or(NonZeroU32::MIN);
            match b.gcra.check_n(n) {
                Ok(Ok(snap)) => state.merge(b.per_minute, snap.remaining_burst_capacity(), true),
                Ok(Err(not_until)) => {
                    state.merge(b.per_minute, 0, true);
                    let wait = not_until.wait_time_from(DefaultClock::default().now());
                    return Err(limited("tokens", "tokens per minute", &who, b.per_minute, wait, *state));
                }
                Err(_) => {
                    let mut e = limited(
                        "tokens",
                        "tokens per minute",
                        &who,
                        b.per_minute,
                        Duration::from_secs(60),
                        *state,
                    );
                    e.error.message = format!(
                        "This request needs {tokens} tokens, more than the {} tokens per minute allowed for {who}.",
                        b.per_minute
                    );
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// Charges tokens generated after admission (best effort).
    pub fn charge_completion(&self, ctx: &TenantContext, tokens: u32) {
        let Some(n) = NonZeroU32::new(tokens) else { return };
        for (id, limits, _) in Self::subjects(ctx) {
            if let (_, Some(b), _) = self.subject(&id, limits) {
                let _ = b.gcra.check_n(n);
            }
        }
    }
}

// ---- Redis ------------------------------------------------------------------------------

/// Admission, atomically for tenant and key: GCRA on requests/minute and on tokens/minute
/// (the prompt's), then the in-flight leases; nothing is consumed unless everything passes.
/// KEYS: tenant rpm TAT, key rpm TAT, tenant tpm TAT, key tpm TAT, tenant in-flight set,
/// key in-flight set.
/// ARGV: tenant rpm, key rpm, tenant tpm, key tpm, tenant max in flight, key max in flight,
/// prompt tokens, request id, lease ms.
/// Returns {allowed, failing subject (1-6), wait µs (-1: can never fit), remaining for
/// each of the four rates}.
const ADMIT_SCRIPT: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local rem = {-1, -1, -1, -1}
local tats = {}
local n = tonumber(ARGV[7])
for i = 1, 4 do
  local limit = tonumber(ARGV[i])
  if limit > 0 then
    local units = 1
    if i > 2 then units = n end
    if units > limit then return {0, i, -1, 0, 0, 0, 0} end
    local step = 60000000 / limit
    local tat = tonumber(redis.call('GET', KEYS[i]) or now)
    if tat < now then tat = now end
    local new_tat = tat + units * step
    if new_tat - now > 60000000 then
      return {0, i, math.ceil(new_tat - 60000000 - now), 0, 0, 0, 0}
    end
    tats[i] = new_tat
    rem[i] = math.floor((60000000 - (new_tat - now)) / step)
  end
end
local now_ms = math.floor(now / 1000)
for i = 5, 6 do
  local limit = tonumber(ARGV[i])
  if limit > 0 then
    redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', now_ms)
    if redis.call('ZCARD', KEYS[i]) >= limit then
      return {0, i, 1000000, 0, 0, 0, 0}
    end
  end
end
for i = 1, 4 do
  if tats[i] then
    redis.call('SET', KEYS[i], string.format('%.0f', tats[i]), 'PX', math.ceil((tats[i] - now) / 1000) + 1000)
  end
end
for i = 5, 6 do
  if tonumber(ARGV[i]) > 0 then
    redis.call('ZADD', KEYS[i], now_ms + tonumber(ARGV[9]), ARGV[8])
    redis.call('PEXPIRE', KEYS[i], tonumber(ARGV[9]))
  end
end
return {1, 0, 0, rem[1], rem[2], rem[3], rem[4]}
"#;

/// Tokens after the fact (completion tokens): GCRA on tokens/minute for tenant and key,
/// `n` at once. With ARGV[4] = 1 they are charged without a check.
/// KEYS: tenant tpm TAT, key tpm TAT. ARGV: tenant tpm, key tpm, n, force.
/// Returns {allowed, failing subject, wait µs (-1: never fits), tenant remaining, key remaining}.
const TOKEN_SCRIPT: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local n = tonumber(ARGV[3])
local force = tonumber(ARGV[4]) == 1
local rem = {-1, -1}
local tats = {}
for i = 1, 2 do
  local limit = tonumber(ARGV[i])
  if limit > 0 then
    local step = 60000000 / limit
    local tat = tonumber(redis.call('GET', KEYS[i]) or now)
    if tat < now then tat = now end
    local new_tat = tat + n * step
    if not force then
      if n > limit then return {0, i, -1, 0, 0} end
      if new_tat - now > 60000000 then
        return {0, i, math.ceil(new_tat - 60000000 - now), 0, 0}
      end
    end
    tats[i] = new_tat
    rem[i] = math.max(0, math.floor((60000000 - (new_tat - now)) / step))
  end
end
for i = 1, 2 do
  if tats[i] then
    redis.call('SET', KEYS[i], string.format('%.0f', tats[i]), 'PX', math.ceil((tats[i] - now) / 1000) + 1000)
  end
end
return {1, 0, 0, rem[1], rem[2]}
"#;

/// How long an in-flight lease lives if its release is lost (a crashed gateway).
const LEASE_MS: u64 = 15 * 60 * 1000;

#[derive(Debug, thiserror::Error)]
pub enum RedisConnectError {
    #[error("bad Redis URL: {0}")]
    Url(redis::RedisError),
    #[error("cannot reach Redis at {url}: {source}")]
    Unreachable { url: String, source: redis::RedisError },
}

/// Limits shared through Redis.
pub struct RedisLimiter {
    conn: redis::aio::ConnectionManager,
    admit: redis::Script,
    tokens: redis::Script,
    prefix: String,
}

impl RedisLimiter {
    pub async fn connect(url: &str, prefix: &str) -> Result<Self, RedisConnectError> {
        let client = redis::Client::open(url).map_err(RedisConnectError::Url)?;
        let cfg = redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(2)))
            .set_response_timeout(Some(Duration::from_millis(500)))
            .set_number_of_retries(2);
        let conn = redis::aio::ConnectionManager::new_with_config(client, cfg)
            .await
            .map_err(|source| RedisConnectError::Unreachable {
                url: url.to_string(),
                source,
            })?;
        Ok(Self {
            conn,
            admit: redis::Script::new(ADMIT_SCRIPT),
            tokens: redis::Script::new(TOKEN_SCRIPT),
            prefix: prefix.to_string(),
        })
    }

    /// The connection and key prefix, for other state shared through the same Redis.
    pub fn connection(&self) -> (redis::aio::ConnectionManager, &str) {
        (self.conn.clone(), &self.prefix)
    }

    fn key(&self, subject: &str, what: &str) -> String {
        format!("{}rl:{subject}:{what}", self.prefix)
    }
}

fn opt(v: Option<u32>) -> u32 {
    v.unwrap_or(0)
}

/// Rate limits, in-process or through Redis.
pub struct Limiter {
    local: LocalLimiter,
    redis: Option<RedisLimiter>,
    last_redis_error: Mutex<Option<std::time::Instant>>,
}

impl Default for Limiter {
    fn default() -> Self {
        Self {
            local: LocalLimiter::default(),
            redis: None,
            last_redis_error: Mutex::new(None),
        }
    }
}

impl Limiter {
    pub fn with_redis(redis: RedisLimiter) -> Self {
        Self {
            redis: Some(redis),
            ..Default::default()
        }
    }

    /// The Redis the limits live in, if any.
    pub fn redis(&self) -> Option<&RedisLimiter> {
        self.redis.as_ref()
    }

    pub fn shared(&self) -> bool {
        self.redis.is_some()
    }

    fn redis_failed(&self, e: &redis::RedisError) {
        let mut last = self.last_redis_error.lock().unwrap_or_else(|e| e.into_inner());
        if last.is_none_or(|t| t.elapsed() > Duration::from_secs(10)) {
            tracing::error!(error = %e, "Redis is unavailable: rate limits fall back to this gateway's own counts");
            *last = Some(std::time::Instant::now());
        }
    }

    fn subjects(ctx: &TenantContext) -> [String; 2] {
        [format!("t:{}", ctx.tenant_id), format!("k:{}", ctx.key_id)]
    }

    fn who(ctx: &TenantContext, i: usize) -> String {
        if i == 0 {
            format!("tenant {}", ctx.tenant_name)
        } else {
            format!("API key {}", ctx.key_id)
        }
    }

    /// Admission: one request, the prompt's tokens and an in-flight slot, for tenant and key.
    pub async fn admit(
        &self,
        ctx: &TenantContext,
        request_id: &str,
        prompt_tokens: u32,
    ) -> Result<(InFlight, RateState), Box<Limited>> {
        let (t, k) = (&ctx.tenant_limits, &ctx.key_limits);
        let local = || -> Result<(InFlight, RateState), Box<Limited>> {
            let (held, mut state) = self.local.admit_request(ctx)?;
            self.local.admit_tokens(ctx, prompt_tokens, &mut state)?;
            Ok((held, state))
        };
        let Some(r) = &self.redis else {
            return local();
        };
        if *t == Limits::default() && *k == Limits::default() {
            return Ok((InFlight::default(), RateState::default()));
        }
        let [ts, ks] = Self::subjects(ctx);
        let keys = [
            r.key(&ts, "rpm"),
            r.key(&ks, "rpm"),
            r.key(&ts, "tpm"),
            r.key(&ks, "tpm"),
            r.key(&ts, "inflight"),
            r.key(&ks, "inflight"),
        ];
        let mut conn = r.conn.clone();
        let mut call = r.admit.prepare_invoke();
        for key in &keys {
            call.key(key);
        }
        call.arg(opt(t.rpm))
            .arg(opt(k.rpm))
            .arg(opt(t.tpm))
            .arg(opt(k.tpm))
            .arg(opt(t.concurrent))
            .arg(opt(k.concurrent))
            .arg(prompt_tokens.max(1))
            .arg(request_id)
            .arg(LEASE_MS);
        let v: Vec<i64> = match call.invoke_async::<Vec<i64>>(&mut conn).await {
            Ok(v) if v.len() == 7 => v,
            Ok(v) => {
                tracing::error!(reply = ?v, "unexpected Redis reply");
                return local();
            }
            Err(e) => {
                self.redis_failed(&e);
                return local();
            }
        };
        let rates = [t.rpm, k.rpm, t.tpm, k.tpm];
        let mut state = RateState::default();
        for (i, l) in rates.into_iter().enumerate() {
            if let Some(l) = l {
                state.merge(l, if v[0] == 1 { v[3 + i].max(0) as u32 } else { 0 }, i >= 2);
            }
        }
        if v[0] != 1 {
            let i = (v[1] - 1).clamp(0, 5) as usize;
            let who = Self::who(ctx, i % 2);
            let wait = Duration::from_micros(v[2].max(0) as u64);
            return Err(match i {
                0 | 1 => limited(
                    "requests",
                    "requests per minute",
                    &who,
                    rates[i].unwrap_or(0),
                    wait,
                    state,
                ),
                2 | 3 => {
                    let limit = rates[i].unwrap_or(0);
                    if v[2] < 0 {
                        let mut e = limited(
                            "tokens",
                            "tokens per minute",
                            &who,
                            limit,
                            Duration::from_secs(60),
                            state,
                        );
                        e.error.message = format!(
                            "This request needs {prompt_tokens} tokens, more than the {limit} tokens per minute allowed for {who}."
                        );
                        e
                    } else {
                        limited("tokens", "tokens per minute", &who, limit, wait, state)
                    }
                }
                _ => limited(
                    "requests",
                    "concurrent requests",
                    &who,
                    [t.concurrent, k.concurrent][i - 4].unwrap_or(0),
                    wait,
                    state,
                ),
            });
        }
        let leases: Vec<String> = [(t.concurrent, &keys[4]), (k.concurrent, &keys[5])]
            .into_iter()
            .filter(|(c, _)| c.is_some())
            .map(|(_, key)| key.clone())
            .collect();
        let held = InFlight {
            local: Vec::new(),
            redis: (!leases.is_empty()).then(|| (r.conn.clone(), leases, request_id.to_string())),
        };
        Ok((held, state))
    }

    async fn redis_tokens(
        &self,
        r: &RedisLimiter,
        ctx: &TenantContext,
        n: u32,
        force: bool,
    ) -> Result<Vec<i64>, redis::RedisError> {
        let [ts, ks] = Self::subjects(ctx);
        let mut conn = r.conn.clone();
        r.tokens
            .key(r.key(&ts, "tpm"))
            .key(r.key(&ks, "tpm"))
            .arg(opt(ctx.tenant_limits.tpm))
            .arg(opt(ctx.key_limits.tpm))
            .arg(n)
            .arg(u8::from(force))
            .invoke_async(&mut conn)
            .await
    }

    /// Charges tokens generated after admission (best effort, never blocks the request).
    pub async fn charge_completion(&self, ctx: &TenantContext, tokens: u32) {
        if tokens == 0 || (ctx.tenant_limits.tpm.is_none() && ctx.key_limits.tpm.is_none()) {
            return;
        }
        match &self.redis {
            None => self.local.charge_completion(ctx, tokens),
            Some(r) => {
                if let Err(e) = self.redis_tokens(r, ctx, tokens, true).await {
                    self.redis_failed(&e);
                    self.local.charge_completion(ctx, tokens);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx(tenant: Limits, key: Limits) -> TenantContext {
        TenantContext {
            tenant_id: "t1".into(),
            tenant_name: "acme".into(),
            key_id: "k1".into(),
            scopes: hearth_tenants::Scopes::ALL,
            models: None,
            tenant_limits: tenant,
            key_limits: key,
            budget: None,
            expires_at: None,
        }
    }

    #[test]
    fn requests_per_minute_and_concurrency() {
        let l = LocalLimiter::default();
        let c = ctx(
            Limits {
                rpm: Some(3),
                ..Default::default()
            },
            Limits {
                concurrent: Some(2),
                ..Default::default()
            },
        );
        let (a, s) = l.admit_request(&c).unwrap();
        assert_eq!((s.limit_requests, s.remaining_requests), (Some(3), Some(2)));
        let (b, _) = l.admit_request(&c).unwrap();
        // Two in flight: the key's concurrency limit refuses a third…
        let e = l.admit_request(&c).unwrap_err();
        assert_eq!(e.error.status, StatusCode::TOO_MANY_REQUESTS);
        assert!(e.error.message.contains("concurrent"), "{}", e.error.message);
        drop(a);
        drop(b);
        // …the per-minute budget (3, one spent by the refused attempt) runs out next.
        let _c = l.admit_request(&c);
        let e = l.admit_request(&c).unwrap_err();
        assert!(
            e.error.message.contains("requests per minute") && e.retry_after >= Duration::from_secs(1),
            "{}",
            e.error.message
        );
    }

    #[test]
    fn tokens_per_minute() {
        let l = LocalLimiter::default();
        let c = ctx(
            Limits {
                tpm: Some(100),
                ..Default::default()
            },
            Limits::default(),
        );
        let mut s = RateState::default();
        l.admit_tokens(&c, 60, &mut s).unwrap();
        assert_eq!(s.remaining_tokens, Some(40));
        l.charge_completion(&c, 30);
        assert!(l.admit_tokens(&c, 20, &mut s).is_err());
        let e = l.admit_tokens(&c, 500, &mut s).unwrap_err();
        assert!(e.error.message.contains("more than the 100 tokens per minute"));
    }

    /// Two limiters sharing one Redis act as one: a 10 requests/minute tenant gets exactly
    /// 10 admissions in total, the in-flight cap holds across both and is released on drop,
    /// and tokens per minute are shared too. Needs `REDIS_URL` (set by the test script).
    #[tokio::test]
    async fn redis_limits_are_shared_across_limiters() {
        let Ok(url) = std::env::var("REDIS_URL") else {
            eprintln!("REDIS_URL is not set; skipping");
            return;
        };
        let prefix = format!("hearth-test-{}-{}:", std::process::id(), hearth_tenants::now_ms());
        let a = Limiter::with_redis(RedisLimiter::connect(&url, &prefix).await.unwrap());
        let b = Limiter::with_redis(RedisLimiter::connect(&url, &prefix).await.unwrap());
        let c = ctx(
            Limits {
                rpm: Some(10),
                tpm: Some(1000),
                ..Default::default()
            },
            Limits {
                concurrent: Some(2),
                ..Default::default()
            },
        );
        let mut ok = 0;
        let mut held = Vec::new();
        let mut concurrency_refusals = 0;
        for i in 0..30 {
            let l = if i % 2 == 0 { &a } else { &b };
            match l.admit(&c, &format!("req{i}"), 1).await {
                Ok((f, s)) => {
                    ok += 1;
                    assert_eq!(s.limit_requests, Some(10));
                    held.push(f);
                }
                Err(e) if e.error.message.contains("concurrent") => {
                    concurrency_refusals += 1;
                    held.clear();
                    // Leases are released asynchronously.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => {
                    assert!(e.error.message.contains("requests per minute"), "{}", e.error.message);
                    assert!(e.retry_after >= Duration::from_secs(1));
                }
            }
        }
        assert_eq!(
            ok, 10,
            "exactly the tenant's 10 requests per minute, across both limiters"
        );
        assert!(
            concurrency_refusals > 0,
            "the key's in-flight cap of 2 must have bitten"
        );
        // Tokens: 600 on one, 300 on the other, then 200 more is over 1000.
        let mut c = ctx(
            Limits {
                tpm: Some(1000),
                ..Default::default()
            },
            Limits::default(),
        );
        (c.tenant_id, c.key_id) = ("t2".into(), "k2".into());
        let (_, s) = a.admit(&c, "t1", 600).await.unwrap();
        assert_eq!(s.remaining_tokens, Some(400));
        let (_, s) = b.admit(&c, "t2", 300).await.unwrap();
        assert_eq!(s.remaining_tokens, Some(100));
        let e = a.admit(&c, "t3", 200).await.unwrap_err();
        assert!(e.error.message.contains("tokens per minute"));
        let e = b.admit(&c, "t4", 5000).await.unwrap_err();
        assert!(e.error.message.contains("more than the 1000"), "{}", e.error.message);
        // A completion charge is taken even past the limit, and later requests wait.
        b.charge_completion(&c, 50).await;
        assert!(a.admit(&c, "t5", 60).await.is_err());
    }
}

//! Rate limits per tenant and per API key: requests/minute and tokens/minute (GCRA, via
//! `governor`), and requests in flight. In-process: each gateway counts alone (limits shared
//! across gateways through Redis come with the tenants-at-scale work).
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

/// Holds a request's in-flight slots; released on drop.
#[derive(Debug, Default)]
pub struct InFlight(Vec<Arc<AtomicU32>>);

impl Drop for InFlight {
    fn drop(&mut self) {
        for c in &self.0 {
            c.fetch_sub(1, Ordering::AcqRel);
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

#[derive(Default)]
pub struct Limiter {
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

impl Limiter {
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
                held.0.push(in_flight);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx(tenant: Limits, key: Limits) -> TenantContext {
        TenantContext {
            tenant_id: "t1".into(),
            tenant_name: "acme".into(),
            key_id: "k1".into(),
            tenant_limits: tenant,
            key_limits: key,
        }
    }

    #[test]
    fn requests_per_minute_and_concurrency() {
        let l = Limiter::default();
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
        let l = Limiter::default();
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
}

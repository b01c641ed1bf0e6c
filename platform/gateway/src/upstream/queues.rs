//! Per model, the prompt tokens dispatched to its pool and not yet computed, by tenant,
//! and how fast the pool drains them: what admission control (the pipeline's `admit`
//! phase) sheds by and what its `retry-after` is computed from.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long one bucket of the drain-rate estimate spans.
const DRAIN_BUCKET: Duration = Duration::from_secs(5);

/// `retry-after` when nothing drained lately: the pool is stalled, or nothing measured yet.
const STALLED_RETRY_S: u64 = 5;

/// Per model: prompt tokens dispatched and not yet computed, by tenant (what the router
/// counts per worker), and how fast they drain.
#[derive(Debug, Default)]
pub struct TenantQueues {
    inner: Mutex<Queues>,
}

#[derive(Debug, Default)]
struct Queues {
    queued: HashMap<String, u64>,
    /// Tokens drained since `bucket` began, and in the bucket before it (over its span).
    bucket: Option<Instant>,
    current: u64,
    previous: u64,
    previous_span: Duration,
}

impl TenantQueues {
    fn lock(&self) -> std::sync::MutexGuard<'_, Queues> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A request of `tenant` was dispatched with `tokens` to compute.
    pub fn add(&self, tenant: &str, tokens: u64) {
        *self.lock().queued.entry(tenant.to_string()).or_default() += tokens;
    }

    /// The request left the queue: `computed` (its first token arrived: it counts towards
    /// the drain rate) or not (it failed or was cancelled first).
    pub fn remove(&self, tenant: &str, tokens: u64, computed: bool) {
        let mut q = self.lock();
        if let Some(t) = q.queued.get_mut(tenant) {
            *t = t.saturating_sub(tokens);
            if *t == 0 {
                q.queued.remove(tenant);
            }
        }
        if computed {
            let now = Instant::now();
            match q.bucket {
                Some(b) if now - b < DRAIN_BUCKET => {}
                Some(b) => {
                    let span = now - b;
                    (q.previous, q.previous_span) = if span < 2 * DRAIN_BUCKET {
                        (q.current, span)
                    } else {
                        (0, Duration::ZERO)
                    };
                    q.current = 0;
                    q.bucket = Some(now);
                }
                None => q.bucket = Some(now),
            }
            q.current += tokens;
        }
    }

    /// `tenant`'s queued tokens, and how many other tenants have some queued.
    pub fn tenant(&self, tenant: &str) -> (u64, u64) {
        let q = self.lock();
        let mine = q.queued.get(tenant).copied().unwrap_or(0);
        let others = q.queued.len() as u64 - u64::from(q.queued.contains_key(tenant));
        (mine, others)
    }

    /// Prompt tokens per second the pool has computed lately (None: nothing measured).
    pub fn drain_rate(&self) -> Option<f64> {
        let q = self.lock();
        let b = q.bucket?;
        let age = b.elapsed();
        if age >= 2 * DRAIN_BUCKET {
            return None;
        }
        let (tokens, span) = if q.previous > 0 {
            (q.previous + q.current, q.previous_span + age)
        } else {
            (q.current, age.max(Duration::from_millis(100)))
        };
        (tokens > 0).then(|| tokens as f64 / span.as_secs_f64())
    }

    /// Seconds until `excess` queued tokens have drained at the recent rate (1 to 60;
    /// [`STALLED_RETRY_S`] when nothing drained in the last 5–10 s).
    pub fn retry_after(&self, excess: u64) -> u64 {
        match self.drain_rate() {
            Some(rate) => (excess as f64 / rate).ceil().clamp(1.0, 60.0) as u64,
            None => STALLED_RETRY_S,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenants_queue_and_drain() {
        let q = TenantQueues::default();
        q.add("a", 300);
        q.add("b", 100);
        assert_eq!(q.tenant("a"), (300, 1));
        assert_eq!(q.tenant("c"), (0, 2));
        assert_eq!(q.retry_after(1000), STALLED_RETRY_S, "nothing measured yet");
        q.remove("a", 300, true);
        q.remove("b", 100, false);
        assert_eq!(q.tenant("a"), (0, 0));
        let rate = q.drain_rate().expect("a rate once tokens drained");
        assert!(rate > 0.0);
        // 300 tokens in at most 0.1 s: ten times the queue drains in seconds, not minutes.
        assert!(q.retry_after(3000) <= 60);
        assert!(q.retry_after(u64::MAX / 2) == 60);
    }
}

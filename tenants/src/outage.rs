//! How the credential caches behave when the database misbehaves or is attacked.
//!
//! * **Stale while the store is down.** A cached entry is fresh for [`crate::KEY_CACHE_TTL`];
//!   after that it is looked up again. If that lookup fails (the database is down or does
//!   not answer within [`REFRESH_TIMEOUT`]), an entry checked within the store's stale limit
//!   (`--auth-stale-secs`, 15 min by default) keeps working: keys that worked a moment ago
//!   keep working through a database restart. A revocation made during the outage takes
//!   effect once the database is back.
//! * **No request waits on a down store.** Once a lookup has failed the store is *down*:
//!   requests are answered from the cache (or, for a credential never seen, refused with
//!   503 at once) while a background probe, at most once a second, finds out when it is
//!   back.
//! * **Negative cache.** An unknown key id (or JWT issuer) is remembered for
//!   [`NEGATIVE_TTL`], so a flood of random keys costs one query per distinct id per
//!   interval, not one per request; the gateway also throttles sources that keep sending
//!   bad credentials.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long an unknown key id or issuer is remembered as unknown. Key ids are random: a
/// key created later cannot have been probed before, short of guessing its id (and creating
/// or changing keys in this process clears the cache anyway).
pub const NEGATIVE_TTL: Duration = Duration::from_secs(30);

/// How often a down store is probed (by a request that needs it).
pub const PROBE_INTERVAL: Duration = Duration::from_secs(1);

/// How long a refresh of a cached entry may take before the cached entry is used.
pub const REFRESH_TIMEOUT: Duration = Duration::from_secs(1);

/// Entries remembered as unknown at most (the map is cleared when full).
const NEGATIVE_MAX: usize = 100_000;

/// The store's health as the caches see it.
#[derive(Debug)]
pub struct StoreHealth {
    down: AtomicBool,
    probing: AtomicBool,
    /// When the last probe of a down store started.
    last_probe: Mutex<Option<Instant>>,
    stale_served: AtomicU64,
    /// How long past its refresh time a cached entry may serve while the store is down.
    pub stale_limit: Mutex<Duration>,
}

impl Default for StoreHealth {
    fn default() -> Self {
        Self {
            down: AtomicBool::new(false),
            probing: AtomicBool::new(false),
            last_probe: Mutex::new(None),
            stale_served: AtomicU64::new(0),
            stale_limit: Mutex::new(Duration::from_secs(900)),
        }
    }
}

impl StoreHealth {
    pub fn is_down(&self) -> bool {
        self.down.load(Ordering::Acquire)
    }

    /// Whether a request may query the store now. While it is down no request does: they
    /// answer from the cache (or refuse), and a background probe — one at a time, at most
    /// once per [`PROBE_INTERVAL`], with [`PROBE_TIMEOUT`] — finds out when it is back.
    pub fn lookup(self: &Arc<Self>, pool: &sqlx::AnyPool) -> bool {
        if !self.is_down() {
            return true;
        }
        let due = {
            let mut last = self.last_probe.lock().unwrap_or_else(|e| e.into_inner());
            let due = last.is_none_or(|t| t.elapsed() >= PROBE_INTERVAL) && !self.probing.swap(true, Ordering::AcqRel);
            if due {
                *last = Some(Instant::now());
            }
            due
        };
        if due {
            let (health, pool) = (self.clone(), pool.clone());
            match tokio::runtime::Handle::try_current() {
                Ok(rt) => {
                    rt.spawn(async move {
                        let ping = sqlx::query("SELECT 1").execute(&pool);
                        if let Ok(Ok(_)) = tokio::time::timeout(PROBE_TIMEOUT, ping).await {
                            health.answered();
                        }
                        health.probing.store(false, Ordering::Release);
                    });
                }
                Err(_) => self.probing.store(false, Ordering::Release),
            }
        }
        false
    }

    pub fn failed(&self, what: &str, error: &str) {
        if !self.down.swap(true, Ordering::AcqRel) {
            tracing::error!(error = %error, lookup = what, "the key store is unreachable: credentials checked recently keep working from the cache");
        }
    }

    pub fn answered(&self) {
        if self.down.swap(false, Ordering::AcqRel) {
            tracing::info!("the key store answers again");
        }
    }

    /// Whether an entry fetched at `at` may still serve while the store is down.
    pub fn usable_stale(&self, at: Instant, fresh: Duration) -> bool {
        let limit = *self.stale_limit.lock().unwrap_or_else(|e| e.into_inner());
        at.elapsed() < fresh + limit
    }

    pub fn served_stale(&self) {
        self.stale_served.fetch_add(1, Ordering::Relaxed);
    }

    /// Requests answered from a stale entry so far.
    pub fn stale_served(&self) -> u64 {
        self.stale_served.load(Ordering::Relaxed)
    }
}

/// Ids recently found not to exist.
#[derive(Debug, Default)]
pub struct NegativeCache(Mutex<HashMap<String, Instant>>);

impl NegativeCache {
    pub fn contains(&self, id: &str) -> bool {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(id)
            .is_some_and(|at| at.elapsed() < NEGATIVE_TTL)
    }

    pub fn insert(&self, id: &str) {
        let mut m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if m.len() >= NEGATIVE_MAX {
            m.retain(|_, at| at.elapsed() < NEGATIVE_TTL);
            if m.len() >= NEGATIVE_MAX {
                m.clear();
            }
        }
        m.insert(id.to_string(), Instant::now());
    }

    pub fn clear(&self) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }
}

/// How long the background probe of a down store may take.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// Runs a store query; with a cached answer to fall back on (`fallback`) it may take at most
/// [`REFRESH_TIMEOUT`].
pub async fn query<T>(
    fallback: bool,
    fut: impl std::future::Future<Output = Result<T, sqlx::Error>>,
) -> Result<T, sqlx::Error> {
    if fallback {
        tokio::time::timeout(REFRESH_TIMEOUT, fut)
            .await
            .unwrap_or(Err(sqlx::Error::PoolTimedOut))
    } else {
        fut.await
    }
}

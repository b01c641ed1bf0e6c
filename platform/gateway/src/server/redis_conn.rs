//! Redis as every shared state uses it (rate limits, budget holds, routing state, worker
//! registration): one way to connect, with timeouts that never hold a request long, and one
//! view of whether it answers.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum RedisConnectError {
    #[error("bad Redis URL: {0}")]
    Url(redis::RedisError),
    #[error("cannot reach Redis at {url}: {source}")]
    Unreachable { url: String, source: redis::RedisError },
}

/// Connects to Redis at `url` with short timeouts: a slow Redis never holds a request long.
pub async fn connect(url: &str) -> Result<redis::aio::ConnectionManager, RedisConnectError> {
    let client = redis::Client::open(url).map_err(RedisConnectError::Url)?;
    let cfg = redis::aio::ConnectionManagerConfig::new()
        .set_connection_timeout(Some(Duration::from_secs(2)))
        .set_response_timeout(Some(Duration::from_millis(500)))
        .set_number_of_retries(2);
    redis::aio::ConnectionManager::new_with_config(client, cfg)
        .await
        .map_err(|source| RedisConnectError::Unreachable {
            url: url.to_string(),
            source,
        })
}

/// Whether Redis answers, as the limiter sees it. After a failure the limits fall back to
/// this gateway's own counts at once — no request waits on a dead or frozen Redis — while
/// one background probe pings Redis every [`PROBE_INTERVAL`]; its first answer switches
/// the limits back. Shared with the budget holds and the routing state on the same Redis.
#[derive(Debug, Default)]
pub struct RedisHealth {
    down: std::sync::atomic::AtomicBool,
    probing: std::sync::atomic::AtomicBool,
}

/// How often a down Redis is probed.
pub const PROBE_INTERVAL: Duration = Duration::from_millis(500);

impl RedisHealth {
    pub fn is_down(&self) -> bool {
        self.down.load(Ordering::Acquire)
    }

    /// A Redis call failed: fall back until the probe gets an answer.
    pub fn failed(self: &Arc<Self>, conn: &redis::aio::ConnectionManager, error: &str) {
        if !self.down.swap(true, Ordering::AcqRel) {
            tracing::error!(error = %error, "Redis is unavailable: rate limits fall back to this gateway's own counts until it answers");
        }
        if self.probing.swap(true, Ordering::AcqRel) {
            return;
        }
        let (health, mut conn) = (self.clone(), conn.clone());
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                loop {
                    tokio::time::sleep(PROBE_INTERVAL).await;
                    let cmd = redis::cmd("PING");
                    let ping = cmd.query_async::<String>(&mut conn);
                    if let Ok(Ok(_)) = tokio::time::timeout(PROBE_INTERVAL, ping).await {
                        health.down.store(false, Ordering::Release);
                        health.probing.store(false, Ordering::Release);
                        tracing::info!("Redis answers again: rate limits are shared again");
                        return;
                    }
                }
            });
        } else {
            self.probing.store(false, Ordering::Release);
        }
    }
}

//! Scale-out through Redis: workers that register themselves and gateways that discover
//! them ([`Registrar`], [`Discovery`]), and the routing state every gateway shares
//! ([`SharedRouting`]: session affinity and load).
//!
//! **Registration.** A worker writes a [`WorkerRecord`] (address, models, region, role,
//! capacity, draining) under `{prefix}worker:{id}` with a time to live of three heartbeats,
//! and its id into the set `{prefix}workers`; it rewrites both every heartbeat. The record
//! is sealed with an HMAC-SHA256 under the workers' shared token (`HEARTH_WORKER_TOKEN`):
//! a gateway accepts only records sealed with its own token and at most
//! [`MAX_RECORD_AGE`] old, so a process without the token cannot join a pool even with
//! write access to Redis. A record whose key expired (three missed heartbeats) is a dead
//! worker: gateways drop it from every pool at their next poll.
//!
//! **Shared routing.** The `x-session-affinity` pin lives in Redis
//! (`{prefix}aff:{model}:{hash of the session}`): before routing a session's request a
//! gateway reads it (and pins its own router to that worker), after choosing it claims the
//! key with one script that keeps an owner chosen concurrently by another gateway (the
//! request is then routed to that owner). Each gateway publishes its requests in flight per
//! worker (`{prefix}load:{model}`, one field per gateway and worker) every sync interval and
//! adds the other gateways' fresh entries to its router's load, so the load bound and the
//! policies see every gateway's work. What stays per gateway: the KV prefix index (each
//! gateway follows every worker's event stream itself, which is exact; sharing it would
//! only add a hop) and the per-worker health view (each checks for itself).
//!
//! Redis failing degrades to per-gateway affinity and load; requests are never refused
//! for it.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hmac::{Hmac, Mac};
use redis::aio::ConnectionManager;
use serde::{Deserialize, Serialize};
use sha2::Sha256;

use crate::registry::ModelRegistry;
use crate::workers::{HttpWorker, ModelHostClient, WorkerClient};

/// How old (by the worker's clock) a record may be: a replayed record is refused after this.
pub const MAX_RECORD_AGE: Duration = Duration::from_secs(60);

/// What a worker says about itself in the registry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerRecord {
    /// Unique per worker process (its name and a random suffix).
    pub id: String,
    /// The base URL gateways dispatch to.
    pub url: String,
    pub models: Vec<String>,
    pub region: String,
    /// `both`, `prefill` or `decode`.
    pub role: String,
    /// Sequences the worker runs at once.
    pub capacity: u32,
    /// Shutting down: gateways send it nothing new.
    pub draining: bool,
    /// Unix milliseconds (the worker's clock).
    pub started_ms: i64,
    pub heartbeat_ms: i64,
}

/// Why a registry entry was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RecordError {
    #[error("not a sealed worker record")]
    Malformed,
    #[error("the record's seal does not match this gateway's worker token")]
    BadSeal,
    #[error("the record is stale (heartbeat {age_s} s ago)")]
    Stale { age_s: i64 },
}

#[derive(Serialize, Deserialize)]
struct Sealed {
    record: String,
    mac: String,
}

fn mac(token: &str, bytes: &[u8]) -> Hmac<Sha256> {
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(token.as_bytes()).expect("HMAC takes any key length");
    m.update(bytes);
    m
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// The record as stored: its JSON and an HMAC-SHA256 of that JSON under `token`.
pub fn seal(token: &str, record: &WorkerRecord) -> String {
    let json = serde_json::to_string(record).expect("a record serializes");
    let tag = hex(&mac(token, json.as_bytes()).finalize().into_bytes());
    serde_json::to_string(&Sealed { record: json, mac: tag }).expect("serializes")
}

/// The record in `stored`, if sealed with `token` (compared in constant time) and at most
/// [`MAX_RECORD_AGE`] old at `now_ms`.
pub fn open(token: &str, stored: &str, now_ms: i64) -> Result<WorkerRecord, RecordError> {
    let sealed: Sealed = serde_json::from_str(stored).map_err(|_| RecordError::Malformed)?;
    let tag = unhex(&sealed.mac).ok_or(RecordError::Malformed)?;
    mac(token, sealed.record.as_bytes())
        .verify_slice(&tag)
        .map_err(|_| RecordError::BadSeal)?;
    let record: WorkerRecord = serde_json::from_str(&sealed.record).map_err(|_| RecordError::Malformed)?;
    let age = now_ms - record.heartbeat_ms;
    if age > MAX_RECORD_AGE.as_millis() as i64 {
        return Err(RecordError::Stale { age_s: age / 1000 });
    }
    Ok(record)
}

fn now_ms() -> i64 {
    hearth_tenants::now_ms()
}

/// Connects to Redis with the limits' timeouts (a slow Redis never holds a request long).
pub async fn connect(url: &str) -> Result<ConnectionManager, crate::limits::RedisConnectError> {
    crate::limits::RedisLimiter::connect(url, "")
        .await
        .map(|l| l.connection().0)
}

/// A worker's registration: its heartbeat task writes the sealed record every interval.
pub struct Registrar {
    conn: ConnectionManager,
    prefix: String,
    token: String,
    record: Mutex<WorkerRecord>,
    interval: Duration,
    stopped: tokio::sync::watch::Sender<bool>,
}

impl Registrar {
    /// Registers `record` (written at once; an unreachable Redis is an error here, and only
    /// a logged warning once running).
    pub async fn start(
        conn: ConnectionManager,
        prefix: &str,
        token: &str,
        record: WorkerRecord,
        interval: Duration,
    ) -> redis::RedisResult<Arc<Self>> {
        let r = Arc::new(Self {
            conn,
            prefix: prefix.to_string(),
            token: token.to_string(),
            record: Mutex::new(record),
            interval,
            stopped: tokio::sync::watch::Sender::new(false),
        });
        r.beat().await?;
        let beating = r.clone();
        tokio::spawn(async move {
            let mut stopped = beating.stopped.subscribe();
            loop {
                tokio::select! {
                    () = tokio::time::sleep(beating.interval) => {}
                    _ = stopped.wait_for(|s| *s) => return,
                }
                if let Err(e) = beating.beat().await {
                    tracing::warn!(error = %e, "registry heartbeat failed (retrying)");
                }
            }
        });
        Ok(r)
    }

    fn key(&self, id: &str) -> String {
        format!("{}worker:{id}", self.prefix)
    }

    /// Writes the record now (expiring after three heartbeats).
    pub async fn beat(&self) -> redis::RedisResult<()> {
        if *self.stopped.borrow() {
            return Ok(());
        }
        let (id, sealed) = {
            let mut rec = self.record.lock().unwrap_or_else(|e| e.into_inner());
            rec.heartbeat_ms = now_ms();
            (rec.id.clone(), seal(&self.token, &rec))
        };
        let ttl = (self.interval * 3).as_millis() as u64;
        redis::pipe()
            .cmd("SET")
            .arg(self.key(&id))
            .arg(sealed)
            .arg("PX")
            .arg(ttl.max(1))
            .ignore()
            .cmd("SADD")
            .arg(format!("{}workers", self.prefix))
            .arg(&id)
            .ignore()
            .query_async::<()>(&mut self.conn.clone())
            .await
    }

    /// Announces the drain: gateways stop sending new requests at their next poll.
    pub async fn drain(&self) {
        self.record.lock().unwrap_or_else(|e| e.into_inner()).draining = true;
        if let Err(e) = self.beat().await {
            tracing::warn!(error = %e, "could not announce the drain (gateways see the worker refuse instead)");
        }
    }

    /// Stops the heartbeat and removes the record.
    pub async fn deregister(&self) {
        self.stopped.send_replace(true);
        let id = self.record.lock().unwrap_or_else(|e| e.into_inner()).id.clone();
        let done = redis::pipe()
            .cmd("DEL")
            .arg(self.key(&id))
            .ignore()
            .cmd("SREM")
            .arg(format!("{}workers", self.prefix))
            .arg(&id)
            .ignore()
            .query_async::<()>(&mut self.conn.clone())
            .await;
        match done {
            Ok(()) => tracing::info!(worker = %id, "deregistered"),
            Err(e) => tracing::warn!(error = %e, "could not deregister (the record expires)"),
        }
    }
}

/// What a gateway knows of one registered worker.
struct Known {
    url: String,
    draining: bool,
}

/// A gateway's view of the registry: polls it and keeps the model registry's pools in step.
pub struct Discovery {
    conn: ConnectionManager,
    prefix: String,
    token: String,
    known: HashMap<String, Known>,
    /// Ids already warned about (bad seal, unreachable), so each is logged once.
    warned: HashSet<String>,
    /// Registrations refused (bad seal, stale, another's id): `hearth_worker_registrations_refused`.
    pub refused: prometheus_client::metrics::counter::Counter,
}

impl Discovery {
    pub fn new(conn: ConnectionManager, prefix: &str, token: &str) -> Self {
        Self {
            conn,
            prefix: prefix.to_string(),
            token: token.to_string(),
            known: HashMap::new(),
            warned: HashSet::new(),
            refused: Default::default(),
        }
    }

    /// Polls every `interval` until the process ends.
    pub async fn run(mut self, state: Arc<crate::state::AppState>, interval: Duration) {
        loop {
            if let Err(e) = self.poll(&state.models).await {
                tracing::warn!(error = %e, "worker registry unreachable (keeping the pools as they are)");
            }
            tokio::time::sleep(interval).await;
        }
    }

    /// The live, correctly sealed records.
    async fn records(&mut self) -> redis::RedisResult<Vec<WorkerRecord>> {
        let set = format!("{}workers", self.prefix);
        let ids: Vec<String> = redis::cmd("SMEMBERS").arg(&set).query_async(&mut self.conn).await?;
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let keys: Vec<String> = ids.iter().map(|id| format!("{}worker:{id}", self.prefix)).collect();
        let values: Vec<Option<String>> = redis::cmd("MGET").arg(&keys).query_async(&mut self.conn).await?;
        let now = now_ms();
        let mut out = Vec::new();
        let mut expired = Vec::new();
        for (id, v) in ids.into_iter().zip(values) {
            let Some(v) = v else {
                expired.push(id); // three heartbeats missed
                continue;
            };
            match open(&self.token, &v, now) {
                Ok(rec) if rec.id == id => out.push(rec),
                Ok(_) | Err(_) if !self.warned.insert(id.clone()) => {
                    self.refused.inc();
                }
                Ok(rec) => {
                    self.refused.inc();
                    tracing::warn!(entry = %id, claimed = %rec.id, "registry entry under another worker's id: ignored");
                }
                Err(e) => {
                    self.refused.inc();
                    tracing::warn!(entry = %id, error = %e, "worker registration refused");
                }
            }
        }
        if !expired.is_empty() {
            redis::cmd("SREM")
                .arg(&set)
                .arg(&expired)
                .query_async::<()>(&mut self.conn)
                .await?;
        }
        Ok(out)
    }

    /// One poll: new workers join their models' pools, draining ones get nothing new, gone
    /// ones leave.
    pub async fn poll(&mut self, models: &ModelRegistry) -> redis::RedisResult<()> {
        let records = self.records().await?;
        let live: HashSet<&str> = records.iter().map(|r| r.id.as_str()).collect();
        let gone: Vec<String> = self
            .known
            .keys()
            .filter(|id| !live.contains(id.as_str()))
            .cloned()
            .collect();
        for id in gone {
            if let Some(k) = self.known.remove(&id) {
                tracing::info!(worker = %id, url = %k.url, "worker left the registry");
                models.detach(&worker_name(&k.url));
            }
        }
        for rec in &records {
            if let Some(k) = self.known.get_mut(&rec.id) {
                if k.draining != rec.draining {
                    k.draining = rec.draining;
                    tracing::info!(worker = %rec.id, draining = rec.draining, "worker drain state");
                    models.set_draining(&worker_name(&k.url), rec.draining);
                }
                continue;
            }
            if rec.draining {
                continue; // never joins while shutting down
            }
            match tokio::time::timeout(Duration::from_secs(5), self.attach(models, rec)).await {
                Ok(Ok(n)) => {
                    tracing::info!(worker = %rec.id, url = %rec.url, region = %rec.region, role = %rec.role, models = n, "worker joined");
                    self.warned.remove(&rec.id);
                    self.known.insert(
                        rec.id.clone(),
                        Known {
                            url: rec.url.clone(),
                            draining: false,
                        },
                    );
                }
                Ok(Err(e)) if self.warned.insert(rec.id.clone()) => {
                    tracing::warn!(worker = %rec.id, url = %rec.url, error = %e, "registered worker not usable yet (retrying)");
                }
                Err(_) if self.warned.insert(rec.id.clone()) => {
                    tracing::warn!(worker = %rec.id, url = %rec.url, "registered worker did not answer in 5 s (retrying)");
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Asks the worker what it serves and adds it to those models' pools.
    async fn attach(&self, models: &ModelRegistry, rec: &WorkerRecord) -> Result<usize, String> {
        let token = Some(self.token.clone());
        let (clients, host) = HttpWorker::discover(&rec.url).await.map_err(|e| e.to_string())?;
        let mut joined = 0;
        for c in clients {
            let c: Arc<dyn WorkerClient> = Arc::new(c.with_token(token.clone()));
            let info = c.info().await.map_err(|e| e.to_string())?;
            models.attach(info, c).map_err(|e| e.to_string())?;
            joined += 1;
        }
        if let Some(h) = host {
            models.add_host(Arc::new(h.with_token(token)) as Arc<dyn ModelHostClient>);
        }
        Ok(joined)
    }
}

/// How a gateway names an HTTP worker (as [`HttpWorker`] does).
fn worker_name(url: &str) -> String {
    HttpWorker::new(url).map_or_else(|_| url.to_string(), |w| w.name().to_string())
}

/// Keeps `owner` when another gateway pinned the session first; else writes `chosen`.
/// KEYS[1] the pin; ARGV: chosen, the pin this gateway routed by ('' for none), TTL ms.
const CLAIM_SCRIPT: &str = r"
local cur = redis.call('GET', KEYS[1])
if (not cur) or cur == ARGV[1] or (ARGV[2] ~= '' and cur == ARGV[2]) then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
  return ARGV[1]
end
return cur
";

/// Routing state shared by every gateway through Redis: session pins and load.
pub struct SharedRouting {
    conn: ConnectionManager,
    prefix: String,
    /// This gateway's id in the load entries.
    gateway: String,
    claim: redis::Script,
    /// How long a session pin lives without requests.
    pub affinity_ttl: Duration,
}

/// A load entry older than this is another gateway that stopped publishing: not counted.
const LOAD_FRESH_MS: i64 = 3_000;

impl SharedRouting {
    pub fn new(conn: ConnectionManager, prefix: &str, gateway: &str) -> Self {
        Self {
            conn,
            prefix: prefix.to_string(),
            gateway: gateway.to_string(),
            claim: redis::Script::new(CLAIM_SCRIPT),
            affinity_ttl: Duration::from_secs(600),
        }
    }

    pub fn gateway(&self) -> &str {
        &self.gateway
    }

    fn pin_key(&self, model: &str, session: &str) -> String {
        let h = xxhash_rust::xxh3::xxh3_128(session.as_bytes());
        format!("{}aff:{model}:{h:032x}", self.prefix)
    }

    /// The worker (by name) the session is pinned to, if any. Redis failing: None.
    pub async fn pinned(&self, model: &str, session: &str) -> Option<String> {
        let got: redis::RedisResult<Option<String>> = redis::cmd("GET")
            .arg(self.pin_key(model, session))
            .query_async(&mut self.conn.clone())
            .await;
        got.unwrap_or_else(|e| {
            tracing::debug!(error = %e, "shared affinity unavailable");
            None
        })
    }

    /// Pins the session to `chosen` unless another gateway pinned it elsewhere since this
    /// one read `previous`; the pin's worker afterwards. Redis failing: None.
    pub async fn claim(&self, model: &str, session: &str, chosen: &str, previous: Option<&str>) -> Option<String> {
        let got: redis::RedisResult<String> = self
            .claim
            .key(self.pin_key(model, session))
            .arg(chosen)
            .arg(previous.unwrap_or(""))
            .arg(self.affinity_ttl.as_millis() as u64)
            .invoke_async(&mut self.conn.clone())
            .await;
        got.map_err(|e| tracing::debug!(error = %e, "shared affinity unavailable"))
            .ok()
    }

    /// Publishes this gateway's load on each worker and takes in the others', every
    /// `interval`, until the process ends.
    pub async fn sync_load(self: Arc<Self>, state: Arc<crate::state::AppState>, interval: Duration) {
        loop {
            for model in state.models.all() {
                if let Err(e) = self.sync_model(&model).await {
                    tracing::debug!(model = %model.id, error = %e, "shared load unavailable");
                }
            }
            tokio::time::sleep(interval).await;
        }
    }

    /// One exchange for one model's pool.
    pub async fn sync_model(&self, model: &crate::registry::ServedModel) -> redis::RedisResult<()> {
        let key = format!("{}load:{}", self.prefix, model.id);
        let now = now_ms();
        let mine: Vec<(String, String)> = model
            .router()
            .workers()
            .map(|(_, w)| {
                (
                    format!("{}|{}", self.gateway, w.name),
                    format!("{} {} {} {now}", w.outstanding, w.inflight_prefill_tokens, w.decoding),
                )
            })
            .collect();
        let mut pipe = redis::pipe();
        if !mine.is_empty() {
            pipe.cmd("HSET").arg(&key).arg(&mine).ignore();
            pipe.cmd("PEXPIRE").arg(&key).arg(60_000).ignore();
        }
        pipe.cmd("HGETALL").arg(&key);
        let (all,): (HashMap<String, String>,) = pipe.query_async(&mut self.conn.clone()).await?;
        let mut remote: HashMap<&str, (u32, u64, u32)> = HashMap::new();
        let mut stale = Vec::new();
        let own = format!("{}|", self.gateway);
        for (field, v) in &all {
            if field.starts_with(&own) {
                continue;
            }
            let Some((_, worker)) = field.split_once('|') else {
                continue;
            };
            let n: Vec<i64> = v.split(' ').filter_map(|x| x.parse().ok()).collect();
            let [o, p, d, at] = n[..] else { continue };
            if now - at > LOAD_FRESH_MS {
                if now - at > 10 * LOAD_FRESH_MS {
                    stale.push(field.clone());
                }
                continue;
            }
            let e = remote.entry(worker).or_default();
            e.0 += o.max(0) as u32;
            e.1 += p.max(0) as u64;
            e.2 += d.max(0) as u32;
        }
        {
            let mut r = model.router();
            let slots: Vec<usize> = r.workers().map(|(i, _)| i).collect();
            for slot in slots {
                if let Some(w) = r.worker_mut(slot) {
                    let (o, p, d) = remote.get(w.name.as_str()).copied().unwrap_or_default();
                    w.remote_outstanding = o;
                    w.remote_prefill_tokens = p;
                    w.remote_decoding = d;
                }
            }
        }
        if !stale.is_empty() {
            redis::cmd("HDEL")
                .arg(&key)
                .arg(&stale)
                .query_async::<()>(&mut self.conn.clone())
                .await?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> WorkerRecord {
        WorkerRecord {
            id: "w1-abc".into(),
            url: "http://10.0.0.7:8081".into(),
            models: vec!["m".into()],
            region: "eu".into(),
            role: "both".into(),
            capacity: 8,
            draining: false,
            started_ms: 1,
            heartbeat_ms: 1_000_000,
        }
    }

    #[test]
    fn records_open_only_with_the_token_they_were_sealed_with() {
        let sealed = seal("secret", &record());
        assert_eq!(open("secret", &sealed, 1_000_500), Ok(record()));
        assert_eq!(open("other", &sealed, 1_000_500), Err(RecordError::BadSeal));
        // Any change to the record breaks the seal.
        let forged = sealed.replace("10.0.0.7", "10.6.6.6");
        assert_eq!(open("secret", &forged, 1_000_500), Err(RecordError::BadSeal));
        // A replayed old record is refused.
        assert_eq!(
            open("secret", &sealed, 1_000_000 + 61_000),
            Err(RecordError::Stale { age_s: 61 })
        );
        assert_eq!(open("secret", "{}", 0), Err(RecordError::Malformed));
        assert_eq!(open("secret", "not json", 0), Err(RecordError::Malformed));
    }

    /// Against the Redis the test suite starts (`REDIS_URL`); skipped without one.
    #[tokio::test]
    async fn registration_heartbeats_expiry_and_shared_pins() {
        let Some(url) = std::env::var("REDIS_URL").ok() else {
            eprintln!("REDIS_URL is not set; skipping");
            return;
        };
        let conn = connect(&url).await.unwrap();
        let prefix = format!("hearth-test-{}-{}:", std::process::id(), now_ms());
        let mut rec = record();
        rec.heartbeat_ms = now_ms();
        let reg = Registrar::start(conn.clone(), &prefix, "tok", rec.clone(), Duration::from_millis(100))
            .await
            .unwrap();
        let mut good = Discovery::new(conn.clone(), &prefix, "tok");
        let mut stray = Discovery::new(conn.clone(), &prefix, "not-the-token");
        let ids = |v: Vec<WorkerRecord>| v.into_iter().map(|r| r.id).collect::<Vec<_>>();
        assert_eq!(ids(good.records().await.unwrap()), ["w1-abc"]);
        // A gateway with another token sees nothing, and counts the refusal.
        assert!(stray.records().await.unwrap().is_empty());
        assert_eq!(stray.refused.get(), 1);
        // A record written without the token is refused too.
        let mut forged = rec.clone();
        forged.id = "intruder".into();
        redis::pipe()
            .cmd("SET")
            .arg(format!("{prefix}worker:intruder"))
            .arg(seal("guess", &forged))
            .ignore()
            .cmd("SADD")
            .arg(format!("{prefix}workers"))
            .arg("intruder")
            .ignore()
            .query_async::<()>(&mut conn.clone())
            .await
            .unwrap();
        assert_eq!(ids(good.records().await.unwrap()), ["w1-abc"]);
        // Heartbeats keep it alive past its TTL; drained, it says so.
        tokio::time::sleep(Duration::from_millis(450)).await;
        reg.drain().await;
        let live = good.records().await.unwrap();
        assert_eq!(live.len(), 1);
        assert!(live[0].draining);
        // Deregistered: gone at once. Stopped without deregistering: gone after its TTL.
        reg.deregister().await;
        assert!(good.records().await.unwrap().is_empty());
        let reg2 = Registrar::start(conn.clone(), &prefix, "tok", rec, Duration::from_millis(100))
            .await
            .unwrap();
        assert_eq!(good.records().await.unwrap().len(), 1);
        reg2.stopped.send_replace(true); // as if SIGKILLed: no more heartbeats
        tokio::time::sleep(Duration::from_millis(350)).await;
        assert!(good.records().await.unwrap().is_empty());

        // Shared pins: the first claim wins; a later gateway keeps it; moving it needs the
        // previous owner named.
        let a = SharedRouting::new(conn.clone(), &prefix, "gw-a");
        let b = SharedRouting::new(conn.clone(), &prefix, "gw-b");
        assert_eq!(a.pinned("m", "s1").await, None);
        assert_eq!(a.claim("m", "s1", "w1", None).await.as_deref(), Some("w1"));
        assert_eq!(b.claim("m", "s1", "w2", None).await.as_deref(), Some("w1"));
        assert_eq!(b.pinned("m", "s1").await.as_deref(), Some("w1"));
        assert_eq!(b.claim("m", "s1", "w2", Some("w1")).await.as_deref(), Some("w2"));
        assert_eq!(a.pinned("m", "s1").await.as_deref(), Some("w2"));
    }
}

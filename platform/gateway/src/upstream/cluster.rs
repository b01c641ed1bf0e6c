//! Scale-out through Redis: workers that register themselves and gateways that discover
//! them ([`Registrar`], [`Discovery`]), and the routing state every gateway shares
//! ([`SharedRouting`]: session affinity and load).
//!
//! **Registration.** A worker writes a [`WorkerRecord`] (address, models, region, role,
//! capacity, draining) under `{prefix}worker:{id}` with a time to live of three heartbeats,
//! and its id into the sorted set `{prefix}worker-index` (scored by the heartbeat's time);
//! it rewrites both every heartbeat. The record is sealed with an HMAC-SHA256 of the key
//! prefix and the record under the workers' shared token (`HEARTH_WORKER_TOKEN`): a gateway
//! accepts only records sealed with its own token for its own prefix, whose heartbeat is
//! within the record's time to live (± [`MAX_SKEW_MS`]), so a process without the token
//! cannot join a pool even with write access to Redis, and a replayed record dies with its
//! time to live. An indexed id whose record expired (three missed heartbeats, or deleted at
//! deregistration) is a gone worker: every gateway drops it from every pool at its next
//! poll. A worker missing from the index altogether (Redis restarted empty) is dropped only
//! after [`MISSING_GRACE`]: live workers re-register within a heartbeat. Workers are known
//! by address: one restarted at the same address is the same pool member.
//!
//! **Shared routing.** The `x-session-affinity` pin lives in Redis
//! (`{prefix}aff:{model}:{hash of the session}`): before routing a session's request a
//! gateway reads it (and pins its own router to that worker), after choosing it claims the
//! key with one script that keeps an owner chosen concurrently by another gateway (the
//! request is then routed to that owner; if the owner cannot take it, a second claim moves
//! the pin to where the request went). Each gateway publishes its requests in flight per
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

use crate::upstream::registry::ModelRegistry;
use crate::upstream::workers::{base_url, HttpWorker, ModelHostClient, WorkerClient};

/// Clock skew allowed between a worker and a gateway: a record whose heartbeat is older
/// than its time to live plus this, or later than now plus this, is refused (a replayed
/// record dies with its time to live).
pub const MAX_SKEW_MS: i64 = 5_000;

/// How long a registered worker may be missing from the registry set (not expired: gone,
/// as when Redis restarts empty) before gateways drop it; live workers re-register within a
/// heartbeat.
pub const MISSING_GRACE: Duration = Duration::from_secs(5);

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
    /// The record's time to live (three heartbeats).
    pub ttl_ms: i64,
}

/// Why a registry entry was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RecordError {
    #[error("not a sealed worker record")]
    Malformed,
    #[error("the record's seal does not match this gateway's worker token")]
    BadSeal,
    #[error("the record is stale (heartbeat {age_ms} ms ago, time to live {ttl_ms} ms)")]
    Stale { age_ms: i64, ttl_ms: i64 },
}

#[derive(Serialize, Deserialize)]
struct Sealed {
    record: String,
    mac: String,
}

/// The seal covers the key prefix too: a record is valid only in the registry it was
/// written to.
fn mac(token: &str, prefix: &str, bytes: &[u8]) -> Hmac<Sha256> {
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(token.as_bytes()).expect("HMAC takes any key length");
    m.update(prefix.as_bytes());
    m.update(b"\0");
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

/// The record as stored under `prefix`: its JSON and an HMAC-SHA256 of the prefix and that
/// JSON under `token`.
pub fn seal(token: &str, prefix: &str, record: &WorkerRecord) -> String {
    let json = serde_json::to_string(record).expect("a record serializes");
    let tag = hex(&mac(token, prefix, json.as_bytes()).finalize().into_bytes());
    serde_json::to_string(&Sealed { record: json, mac: tag }).expect("serializes")
}

/// The record in `stored` (read under `prefix`), if sealed with `token` (compared in
/// constant time) and its heartbeat is within its time to live of `now_ms` (give or take
/// [`MAX_SKEW_MS`]).
pub fn open(token: &str, prefix: &str, stored: &str, now_ms: i64) -> Result<WorkerRecord, RecordError> {
    let sealed: Sealed = serde_json::from_str(stored).map_err(|_| RecordError::Malformed)?;
    let tag = unhex(&sealed.mac).ok_or(RecordError::Malformed)?;
    mac(token, prefix, sealed.record.as_bytes())
        .verify_slice(&tag)
        .map_err(|_| RecordError::BadSeal)?;
    let record: WorkerRecord = serde_json::from_str(&sealed.record).map_err(|_| RecordError::Malformed)?;
    let age = now_ms - record.heartbeat_ms;
    if age > record.ttl_ms.max(0) + MAX_SKEW_MS || age < -MAX_SKEW_MS {
        return Err(RecordError::Stale {
            age_ms: age,
            ttl_ms: record.ttl_ms,
        });
    }
    Ok(record)
}

fn now_ms() -> i64 {
    hearth_tenants::now_ms()
}

/// A worker's registration: its heartbeat task writes the sealed record every interval.
pub struct Registrar {
    conn: ConnectionManager,
    prefix: String,
    token: String,
    record: Mutex<WorkerRecord>,
    interval: Duration,
    stopped: tokio::sync::watch::Sender<bool>,
    /// One write at a time: a heartbeat in flight never lands after a drain or a
    /// deregistration it predates.
    writing: tokio::sync::Mutex<()>,
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
            writing: tokio::sync::Mutex::new(()),
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
        let _writing = self.writing.lock().await;
        if *self.stopped.borrow() {
            return Ok(());
        }
        let ttl = (self.interval * 3).as_millis() as u64;
        let (id, sealed) = {
            let mut rec = self.record.lock().unwrap_or_else(|e| e.into_inner());
            rec.heartbeat_ms = now_ms();
            rec.ttl_ms = ttl as i64;
            (rec.id.clone(), seal(&self.token, &self.prefix, &rec))
        };
        redis::pipe()
            .cmd("SET")
            .arg(self.key(&id))
            .arg(sealed)
            .arg("PX")
            .arg(ttl.max(1))
            .ignore()
            .cmd("ZADD")
            .arg(index_key(&self.prefix))
            .arg(now_ms())
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

    /// Stops the heartbeat and removes the record. (The id stays in the index: every gateway
    /// sees its record gone, as if expired, and drops the worker at its next poll.)
    pub async fn deregister(&self) {
        self.stopped.send_replace(true);
        let _writing = self.writing.lock().await; // a heartbeat in flight lands first
        let id = self.record.lock().unwrap_or_else(|e| e.into_inner()).id.clone();
        let done = redis::cmd("DEL")
            .arg(self.key(&id))
            .query_async::<()>(&mut self.conn.clone())
            .await;
        match done {
            Ok(()) => tracing::info!(worker = %id, "deregistered"),
            Err(e) => tracing::warn!(error = %e, "could not deregister (the record expires)"),
        }
    }
}

/// What a gateway knows of one registered worker (by its address: a worker restarted at
/// the same address is the same pool member).
struct Known {
    /// The newest registration at this address.
    id: String,
    draining: bool,
    /// Its record's time to live.
    ttl: Duration,
    /// Since when a successful read has not found it (None: found by the last one).
    missing_since: Option<std::time::Instant>,
}

/// What one read of the registry found.
#[derive(Default)]
struct Read {
    /// Live, correctly sealed records.
    live: Vec<WorkerRecord>,
    /// Ids whose record expired: their workers missed three heartbeats.
    expired: Vec<String>,
}

/// A gateway's view of the registry: polls it and keeps the model registry's pools in step.
pub struct Discovery {
    conn: ConnectionManager,
    prefix: String,
    token: String,
    /// By worker name (its normalised URL).
    known: HashMap<String, Known>,
    /// Addresses that could not be attached, and when to try again.
    backoff: HashMap<String, std::time::Instant>,
    /// When the registry was last read (a longer gap is an outage: workers could not
    /// heartbeat either, so their records may have expired).
    last_read: Option<std::time::Instant>,
    /// How often it is read.
    interval: Duration,
    /// Entries already warned about (bad seal, unreachable), so each is logged once.
    warned: HashSet<String>,
    /// Registrations refused (bad seal, stale, another's id), counted per poll:
    /// `hearth_worker_registrations_refused`.
    pub refused: prometheus_client::metrics::counter::Counter,
}

/// How long a registered worker has to answer `models`/`info` before the next poll.
const ATTACH_TIMEOUT: Duration = Duration::from_secs(2);
/// How long an address that could not be attached waits before the next try.
const ATTACH_BACKOFF: Duration = Duration::from_secs(5);

impl Discovery {
    pub fn new(conn: ConnectionManager, prefix: &str, token: &str) -> Self {
        Self {
            conn,
            prefix: prefix.to_string(),
            token: token.to_string(),
            known: HashMap::new(),
            backoff: HashMap::new(),
            last_read: None,
            interval: Duration::from_millis(500),
            warned: HashSet::new(),
            refused: Default::default(),
        }
    }

    /// Polls every `interval` until the process ends.
    pub async fn run<S: AsRef<ModelRegistry>>(mut self, state: Arc<S>, interval: Duration) {
        self.interval = interval;
        loop {
            if let Err(e) = self.poll((*state).as_ref()).await {
                tracing::warn!(error = %e, "worker registry unreachable (keeping the pools as they are)");
            }
            tokio::time::sleep(interval).await;
        }
    }

    /// The registry now: live, correctly sealed records and expired ids.
    async fn read(&mut self) -> redis::RedisResult<Read> {
        let index = index_key(&self.prefix);
        // Ids that have not heartbeaten for an hour leave the index (every gateway has long
        // seen their record expire); until then an expired record reads as expired to all.
        let (ids,): (Vec<String>,) = redis::pipe()
            .cmd("ZREMRANGEBYSCORE")
            .arg(&index)
            .arg("-inf")
            .arg(now_ms() - INDEX_RETENTION_MS)
            .ignore()
            .cmd("ZRANGE")
            .arg(&index)
            .arg(0)
            .arg(-1)
            .query_async(&mut self.conn)
            .await?;
        if ids.is_empty() {
            return Ok(Read::default());
        }
        let keys: Vec<String> = ids.iter().map(|id| format!("{}worker:{id}", self.prefix)).collect();
        let values: Vec<Option<String>> = redis::cmd("MGET").arg(&keys).query_async(&mut self.conn).await?;
        let now = now_ms();
        let mut read = Read::default();
        for (id, v) in ids.into_iter().zip(values) {
            let Some(v) = v else {
                read.expired.push(id); // three heartbeats missed
                continue;
            };
            let refusal = match open(&self.token, &self.prefix, &v, now) {
                Ok(rec) if rec.id == id => {
                    read.live.push(rec);
                    continue;
                }
                Ok(rec) => format!("registry entry under another worker's id ({})", rec.id),
                Err(e) => e.to_string(),
            };
            self.refused.inc();
            if self.warned.insert(format!("refused:{id}")) {
                tracing::warn!(entry = %id, error = %refusal, "worker registration refused");
            }
        }
        Ok(read)
    }

    /// For tests: the live records.
    #[cfg(test)]
    async fn records(&mut self) -> redis::RedisResult<Vec<WorkerRecord>> {
        Ok(self.read().await?.live)
    }

    /// One poll: new workers join their models' pools, draining ones get nothing new,
    /// expired ones leave at once, missing ones (not indexed at all, as when Redis restarts
    /// empty) after a grace — [`MISSING_GRACE`], or their time to live and two polls if
    /// longer; after an outage of the registry longer than a worker's time to live, its
    /// expired record counts as missing (it could not heartbeat either).
    pub async fn poll(&mut self, models: &ModelRegistry) -> redis::RedisResult<()> {
        let read = self.read().await?;
        let now = std::time::Instant::now();
        let gap = self.last_read.map_or(Duration::ZERO, |t| now.duration_since(t));
        self.last_read = Some(now);
        // The newest registration per address.
        let mut newest: HashMap<String, &WorkerRecord> = HashMap::new();
        for rec in &read.live {
            let name = base_url(&rec.url);
            if newest.get(&name).is_none_or(|r| r.started_ms < rec.started_ms) {
                newest.insert(name, rec);
            }
        }
        let expired: HashSet<&str> = read.expired.iter().map(String::as_str).collect();
        let names: Vec<String> = self.known.keys().cloned().collect();
        for name in names {
            if newest.contains_key(&name) {
                continue;
            }
            let Some(k) = self.known.get_mut(&name) else { continue };
            let grace = MISSING_GRACE.max(k.ttl + 2 * self.interval);
            let missing_since = *k.missing_since.get_or_insert(now);
            let expired_now = expired.contains(k.id.as_str()) && gap <= k.ttl;
            if expired_now || now.duration_since(missing_since) >= grace {
                tracing::info!(worker = %k.id, url = %name, "worker left the registry");
                self.known.remove(&name);
                models.detach(&name);
            }
        }
        for (name, rec) in newest {
            if let Some(k) = self.known.get_mut(&name) {
                k.missing_since = None;
                k.ttl = Duration::from_millis(rec.ttl_ms.max(0) as u64);
                k.id = rec.id.clone();
                if k.draining != rec.draining {
                    k.draining = rec.draining;
                    tracing::info!(worker = %rec.id, draining = rec.draining, "worker drain state");
                    models.set_draining(&name, rec.draining);
                }
                continue;
            }
            if rec.draining || self.backoff.get(&name).is_some_and(|t| now < *t) {
                continue; // never joins while shutting down; retried after a failure
            }
            match tokio::time::timeout(ATTACH_TIMEOUT, self.attach(models, rec)).await {
                Ok((joined, _)) if joined > 0 => {
                    tracing::info!(worker = %rec.id, url = %rec.url, region = %rec.region, role = %rec.role, models = joined, "worker joined");
                    self.backoff.remove(&name);
                    self.warned.remove(&format!("attach:{name}"));
                    self.known.insert(
                        name,
                        Known {
                            id: rec.id.clone(),
                            draining: false,
                            ttl: Duration::from_millis(rec.ttl_ms.max(0) as u64),
                            missing_since: None,
                        },
                    );
                }
                outcome => {
                    let why = match outcome {
                        Ok((_, Some(e))) => e,
                        Ok((_, None)) => "it serves no model".into(),
                        Err(_) => format!("no answer in {ATTACH_TIMEOUT:?}"),
                    };
                    self.backoff.insert(name.clone(), now + ATTACH_BACKOFF);
                    // Models that joined before the failure (or the timeout) leave again:
                    // only a known worker is followed (drained, detached).
                    models.detach(&name);
                    if self.warned.insert(format!("attach:{name}")) {
                        tracing::warn!(worker = %rec.id, url = %rec.url, error = %why, "registered worker not usable yet (retrying)");
                    }
                }
            }
        }
        Ok(())
    }

    /// Asks the worker what it serves and adds it to those models' pools: how many joined,
    /// and the first failure (a model that failed is retried by nobody: the worker is
    /// known once one of its models joined).
    async fn attach(&self, models: &ModelRegistry, rec: &WorkerRecord) -> (usize, Option<String>) {
        let (clients, host) = match HttpWorker::discover(&rec.url, Some(self.token.clone())).await {
            Ok(found) => found,
            Err(e) => return (0, Some(e.to_string())),
        };
        let (mut joined, mut failed) = (0, None);
        for c in clients {
            let c: Arc<dyn WorkerClient> = Arc::new(c);
            let attached = match c.info().await {
                Ok(info) => models.attach(info, c).map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            match attached {
                Ok(()) => joined += 1,
                Err(e) => {
                    tracing::warn!(url = %rec.url, error = %e, "a model of a registered worker could not join");
                    failed.get_or_insert(e);
                }
            }
        }
        if let Some(h) = host {
            models.add_host(Arc::new(h) as Arc<dyn ModelHostClient>);
        }
        (joined, failed)
    }
}

/// The index of registered ids: a sorted set scored by each id's last heartbeat.
fn index_key(prefix: &str) -> String {
    format!("{prefix}worker-index")
}

/// How long an id stays in the index after its last heartbeat.
const INDEX_RETENTION_MS: i64 = 3_600_000;

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
    /// How long a request waits for Redis about its pin ([`PIN_TIMEOUT`]).
    pub pin_timeout: Duration,
    /// The limiter's view of this Redis: while it is down, pins are not asked for.
    pub health: Option<Arc<crate::server::redis_conn::RedisHealth>>,
}

/// How long a request waits for a session pin from Redis before routing without it.
pub const PIN_TIMEOUT: Duration = Duration::from_millis(50);

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
            pin_timeout: PIN_TIMEOUT,
            health: None,
        }
    }

    fn down(&self) -> bool {
        self.health.as_ref().is_some_and(|h| h.is_down())
    }

    fn failed(&self, e: &redis::RedisError) {
        tracing::debug!(error = %e, "shared affinity unavailable");
        if let Some(h) = &self.health {
            h.failed(&self.conn, &e.to_string());
        }
    }

    pub fn gateway(&self) -> &str {
        &self.gateway
    }

    fn pin_key(&self, model: &str, session: &str) -> String {
        let h = xxhash_rust::xxh3::xxh3_128(session.as_bytes());
        format!("{}aff:{model}:{h:032x}", self.prefix)
    }

    /// The worker (by name) the session is pinned to, if any. Redis failing or slower than
    /// [`PIN_TIMEOUT`]: None (this gateway's own pin holds).
    pub async fn pinned(&self, model: &str, session: &str) -> Option<String> {
        if self.down() {
            return None;
        }
        let mut conn = self.conn.clone();
        let mut cmd = redis::cmd("GET");
        cmd.arg(self.pin_key(model, session));
        match tokio::time::timeout(self.pin_timeout, cmd.query_async::<Option<String>>(&mut conn)).await {
            Ok(Ok(pin)) => pin,
            Ok(Err(e)) => {
                self.failed(&e);
                None
            }
            Err(_) => {
                tracing::debug!("shared affinity too slow");
                None
            }
        }
    }

    /// Pins the session to `chosen` unless another gateway pinned it elsewhere since this
    /// one read `previous`; the pin's worker afterwards. Redis failing: None.
    pub async fn claim(&self, model: &str, session: &str, chosen: &str, previous: Option<&str>) -> Option<String> {
        if self.down() {
            return None;
        }
        let mut conn = self.conn.clone();
        let mut invocation = self.claim.key(self.pin_key(model, session));
        invocation
            .arg(chosen)
            .arg(previous.unwrap_or(""))
            .arg(self.affinity_ttl.as_millis() as u64);
        let claimed = invocation.invoke_async::<String>(&mut conn);
        match tokio::time::timeout(self.pin_timeout, claimed).await {
            Ok(Ok(owner)) => Some(owner),
            Ok(Err(e)) => {
                self.failed(&e);
                None
            }
            Err(_) => None,
        }
    }

    /// Publishes this gateway's load on each worker and takes in the others', every
    /// `interval`, until the process ends.
    pub async fn sync_load<S: AsRef<ModelRegistry>>(self: Arc<Self>, state: Arc<S>, interval: Duration) {
        loop {
            for model in (*state).as_ref().all() {
                if let Err(e) = self.sync_model(&model).await {
                    tracing::debug!(model = %model.id, error = %e, "shared load unavailable");
                }
            }
            tokio::time::sleep(interval).await;
        }
    }

    /// One exchange for one model's pool.
    pub async fn sync_model(&self, model: &crate::upstream::registry::ServedModel) -> redis::RedisResult<()> {
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
            ttl_ms: 3_000,
        }
    }

    #[test]
    fn records_open_only_with_the_token_they_were_sealed_with() {
        let sealed = seal("secret", "p:", &record());
        assert_eq!(open("secret", "p:", &sealed, 1_000_500), Ok(record()));
        assert_eq!(open("other", "p:", &sealed, 1_000_500), Err(RecordError::BadSeal));
        // Valid only in the registry it was written to.
        assert_eq!(open("secret", "q:", &sealed, 1_000_500), Err(RecordError::BadSeal));
        // Any change to the record breaks the seal.
        let forged = sealed.replace("10.0.0.7", "10.6.6.6");
        assert_eq!(open("secret", "p:", &forged, 1_000_500), Err(RecordError::BadSeal));
        // A replayed record dies with its time to live (plus the allowed skew); one from the
        // future is refused too.
        assert!(open("secret", "p:", &sealed, 1_000_000 + 3_000 + MAX_SKEW_MS).is_ok());
        assert_eq!(
            open("secret", "p:", &sealed, 1_000_000 + 3_001 + MAX_SKEW_MS),
            Err(RecordError::Stale {
                age_ms: 3_001 + MAX_SKEW_MS,
                ttl_ms: 3_000
            })
        );
        assert!(open("secret", "p:", &sealed, 1_000_000 - MAX_SKEW_MS - 1).is_err());
        assert_eq!(open("secret", "p:", "{}", 0), Err(RecordError::Malformed));
        assert_eq!(open("secret", "p:", "not json", 0), Err(RecordError::Malformed));
    }

    /// Against the Redis the test suite starts (`REDIS_URL`); skipped without one.
    #[tokio::test]
    async fn registration_heartbeats_expiry_and_shared_pins() {
        let Some(url) = std::env::var("REDIS_URL").ok() else {
            eprintln!("REDIS_URL is not set; skipping");
            return;
        };
        let conn = crate::server::redis_conn::connect(&url).await.unwrap();
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
            .arg(seal("guess", &prefix, &forged))
            .ignore()
            .cmd("ZADD")
            .arg(index_key(&prefix))
            .arg(now_ms())
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
        tokio::time::sleep(Duration::from_millis(700)).await; // past its 300 ms time to live
        assert!(good.records().await.unwrap().is_empty());

        // Shared pins: the first claim wins; a later gateway keeps it; moving it needs the
        // previous owner named.
        // A loaded machine's Redis may take longer than a request would wait.
        let mut a = SharedRouting::new(conn.clone(), &prefix, "gw-a");
        let mut b = SharedRouting::new(conn.clone(), &prefix, "gw-b");
        a.pin_timeout = Duration::from_secs(5);
        b.pin_timeout = Duration::from_secs(5);
        assert_eq!(a.pinned("m", "s1").await, None);
        assert_eq!(a.claim("m", "s1", "w1", None).await.as_deref(), Some("w1"));
        assert_eq!(b.claim("m", "s1", "w2", None).await.as_deref(), Some("w1"));
        assert_eq!(b.pinned("m", "s1").await.as_deref(), Some("w1"));
        assert_eq!(b.claim("m", "s1", "w2", Some("w1")).await.as_deref(), Some("w2"));
        assert_eq!(a.pinned("m", "s1").await.as_deref(), Some("w2"));
    }
}

//! Prices, rating, and the usage ledger.
//!
//! * **Prices** are per model, per million tokens, for three disjoint token classes: uncached
//!   input, cached input, output. They are versioned: a change is a new row with a later
//!   `effective_from`, so history is never rewritten and every usage row is rated with the
//!   price in force when its request started. Model `*` is the default for models without
//!   a price of their own; a model with neither costs nothing.
//! * **Money** is integer: prices in micro-USD per million tokens, costs in nano-USD. Each
//!   class of each request is rounded once (half up); totals are sums of those integers, so
//!   exports reconcile exactly.
//! * **Ledger**: one row per request, keyed by request id (a replay changes nothing), rated
//!   at ingestion; the same transaction adds the cost to the tenant's monthly spend, which
//!   budgets are checked against.
//! * **Durability: an outbox, written before the response ends.** The gateway hands a
//!   request's record to [`UsageLedger::record_durable`], which appends it to a local
//!   append-only [`outbox`] segment, and sends the client its final event only after that.
//!   A writer task then commits records to the database in batches (group commit: one
//!   transaction per batch) and deletes segments once all their records are in. A process
//!   that dies leaves its segments behind; the next process on that directory replays them
//!   (idempotently). Without an outbox (the CLI, tests), [`UsageLedger::record`] returns
//!   after the database commit.

pub mod export;
pub mod outbox;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use hearth_tenants::{now_ms, Db};
use serde::{Deserialize, Serialize};
use sqlx::any::AnyRow;
use sqlx::{AnyPool, Row};
use tokio::sync::{mpsc, oneshot};

use crate::outbox::Outbox;

#[derive(Debug, thiserror::Error)]
pub enum BillingError {
    #[error("database error: {0}")]
    Db(#[from] sqlx::Error),
    #[error("invalid {field}: {message}")]
    Invalid { field: &'static str, message: String },
    #[error("the usage writer has stopped")]
    WriterGone,
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("export failed: {0}")]
    Export(String),
}

/// How a request ended, for billing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum UsageStatus {
    Completed,
    /// The client went away; what was generated is still recorded.
    Cancelled,
    Failed,
    /// The gateway died while serving it (found on replaying its outbox): the prompt is
    /// billed; what was streamed before the crash is not known.
    Interrupted,
}

impl UsageStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Completed => "completed",
            Self::Cancelled => "cancelled",
            Self::Failed => "failed",
            Self::Interrupted => "interrupted",
        }
    }
}

/// One request's usage. `prompt_tokens` includes `cached_tokens`; the billed classes are
/// [`UsageRecord::uncached_input_tokens`], `cached_tokens` and `completion_tokens`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UsageRecord {
    pub request_id: String,
    pub tenant_id: String,
    pub key_id: Option<String>,
    pub model: String,
    pub endpoint: String,
    pub prompt_tokens: u32,
    pub cached_tokens: u32,
    pub completion_tokens: u32,
    pub status: String,
    pub finish_reason: Option<String>,
    pub error_code: Option<String>,
    pub started_at: i64,
    pub finished_at: i64,
    /// Time the tenant's processors ran for this request (µs of guest execution).
    #[serde(default)]
    pub processor_us: u64,
    /// Milliseconds from the request's arrival at the gateway to its first token relayed;
    /// None when no token was.
    #[serde(default)]
    pub ttft_ms: Option<u32>,
    /// The tenant's LoRA adapter the request ran under (its name; None: the base model).
    #[serde(default)]
    pub adapter: Option<String>,
    /// The batch the request was a line of (None: not a batch's); rated at the price's
    /// `batch_percent`.
    #[serde(default)]
    pub batch_id: Option<String>,
}

impl UsageRecord {
    /// A request's record as it starts: no tokens yet, `failed` until it ends otherwise.
    pub fn started(request_id: &str, tenant_id: &str, key_id: Option<&str>, endpoint: &str, at: i64) -> Self {
        Self {
            request_id: request_id.to_string(),
            tenant_id: tenant_id.to_string(),
            key_id: key_id.map(str::to_string),
            model: String::new(),
            endpoint: endpoint.to_string(),
            prompt_tokens: 0,
            cached_tokens: 0,
            completion_tokens: 0,
            status: UsageStatus::Failed.as_str().into(),
            finish_reason: None,
            error_code: None,
            started_at: at,
            finished_at: at,
            processor_us: 0,
            ttft_ms: None,
            adapter: None,
            batch_id: None,
        }
    }

    pub fn uncached_input_tokens(&self) -> u32 {
        self.prompt_tokens.saturating_sub(self.cached_tokens)
    }
}

/// A price version, per million tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PriceRates {
    pub input_micros_per_mtok: i64,
    pub cached_input_micros_per_mtok: i64,
    pub output_micros_per_mtok: i64,
    /// Tenant processors' time, per CPU-second (0: free).
    #[serde(default)]
    pub processor_micros_per_cpu_s: i64,
    /// What a batch's request pays, in percent of these rates (OpenAI's Batch API: 50).
    #[serde(default = "default_batch_percent")]
    pub batch_percent: i64,
}

/// A batch request's share of the price when none is set: half, as OpenAI's Batch API.
pub const DEFAULT_BATCH_PERCENT: i64 = 50;

fn default_batch_percent() -> i64 {
    DEFAULT_BATCH_PERCENT
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Price {
    pub model: String,
    pub effective_from: i64,
    #[serde(flatten)]
    pub rates: PriceRates,
    pub created_at: i64,
}

/// A batch's recorded usage: its lines' requests, tokens and cost.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct BatchUsage {
    pub requests: i64,
    pub prompt_tokens: i64,
    pub cached_tokens: i64,
    pub completion_tokens: i64,
    pub cost_nusd: i64,
}

/// A request's cost, per class, in nano-USD.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Cost {
    /// The `effective_from` of the price used; None when no price applied.
    pub price_effective_from: Option<i64>,
    pub input_nusd: i64,
    pub cached_nusd: i64,
    pub output_nusd: i64,
    /// Tenant processors' time.
    pub processor_nusd: i64,
    pub total_nusd: i64,
}

fn class_cost(tokens: u32, micros_per_mtok: i64) -> i64 {
    // tokens × (µUSD / 1e6 tokens) = µUSD·1e-6 … × 1e3 → nUSD: tokens × rate / 1000.
    let v = (tokens as i128 * micros_per_mtok as i128 + 500).div_euclid(1000);
    v.clamp(0, i64::MAX as i128) as i64
}

/// Rates a record with a price (None: free).
pub fn rate(rec: &UsageRecord, price: Option<&Price>) -> Cost {
    let Some(p) = price else { return Cost::default() };
    // A batch's line pays its share of every rate.
    let share = |rate: i64| match rec.batch_id {
        Some(_) => ((rate as i128 * p.rates.batch_percent.clamp(0, 100) as i128) / 100) as i64,
        None => rate,
    };
    let input = class_cost(rec.uncached_input_tokens(), share(p.rates.input_micros_per_mtok));
    let cached = class_cost(rec.cached_tokens, share(p.rates.cached_input_micros_per_mtok));
    let output = class_cost(rec.completion_tokens, share(p.rates.output_micros_per_mtok));
    // µs × (µUSD / s) = 1e-6 µUSD = 1e-3 nUSD.
    let processor = ((rec.processor_us as i128 * share(p.rates.processor_micros_per_cpu_s) as i128 + 500)
        .div_euclid(1000))
    .clamp(0, i64::MAX as i128) as i64;
    Cost {
        price_effective_from: Some(p.effective_from),
        input_nusd: input,
        cached_nusd: cached,
        output_nusd: output,
        processor_nusd: processor,
        total_nusd: input + cached + output + processor,
    }
}

/// The price in force for `model` at `at_ms`: the model's own, else `*`'s.
pub fn price_at<'a>(prices: &'a [Price], model: &str, at_ms: i64) -> Option<&'a Price> {
    let pick = |m: &str| {
        prices
            .iter()
            .filter(|p| p.model == m && p.effective_from <= at_ms)
            .max_by_key(|p| p.effective_from)
    };
    pick(model).or_else(|| pick("*"))
}

/// The price a record is rated with: under an adapter, `MODEL:ADAPTER`'s if one is set,
/// else as [`price_at`] (the base model's, else `*`'s).
pub fn price_of<'a>(prices: &'a [Price], rec: &UsageRecord) -> Option<&'a Price> {
    let own = rec.adapter.as_ref().and_then(|a| {
        let name = format!("{}:{a}", rec.model);
        prices
            .iter()
            .filter(|p| p.model == name && p.effective_from <= rec.started_at)
            .max_by_key(|p| p.effective_from)
    });
    own.or_else(|| price_at(prices, &rec.model, rec.started_at))
}

/// USD as a decimal string → micro-USD (exact; at most 6 decimals).
pub fn parse_usd_micros(s: &str) -> Option<i64> {
    let s = s.trim().trim_start_matches('$');
    let (int, frac) = s.split_once('.').unwrap_or((s, ""));
    if int.is_empty() && frac.is_empty()
        || frac.len() > 6
        || !int.bytes().chain(frac.bytes()).all(|b| b.is_ascii_digit())
    {
        return None;
    }
    let int: i64 = if int.is_empty() { 0 } else { int.parse().ok()? };
    let frac: i64 = format!("{frac:0<6}").parse().ok()?;
    int.checked_mul(1_000_000)?.checked_add(frac)
}

/// nano-USD → "12.345678901" USD.
pub fn format_nusd(n: i64) -> String {
    let sign = if n < 0 { "-" } else { "" };
    let n = n.unsigned_abs();
    format!("{sign}{}.{:09}", n / 1_000_000_000, n % 1_000_000_000)
}

/// `YYYY-MM-DD` of a Unix-ms time (UTC).
pub fn day_of(ms: i64) -> String {
    let (y, m, d) = civil(ms.div_euclid(86_400_000));
    format!("{y:04}-{m:02}-{d:02}")
}

/// `YYYY-MM` of a Unix-ms time (UTC): the budget month.
pub fn month_of(ms: i64) -> String {
    let (y, m, _) = civil(ms.div_euclid(86_400_000));
    format!("{y:04}-{m:02}")
}

/// Days since 1970-01-01 → (year, month, day), proleptic Gregorian.
fn civil(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// `YYYY-MM-DD` (UTC midnight) → Unix ms.
pub fn parse_day(s: &str) -> Option<i64> {
    let mut it = s.split('-');
    let y: i64 = it.next()?.parse().ok()?;
    let m: i64 = it.next()?.parse().ok()?;
    let d: i64 = it.next()?.parse().ok()?;
    if it.next().is_some() || !(1..=12).contains(&m) || !(1..=31).contains(&d) {
        return None;
    }
    let (yy, mm) = if m <= 2 { (y - 1, m + 9) } else { (y, m - 3) };
    let era = yy.div_euclid(400);
    let yoe = yy - era * 400;
    let doy = (153 * mm + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    (day_of(days * 86_400_000) == s).then_some(days * 86_400_000)
}

/// What recording did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Recorded {
    /// False for a replay of a request id already in the ledger.
    pub inserted: bool,
    pub cost: Cost,
}

struct Job {
    rec: UsageRecord,
    /// The outbox segment holding it, if any.
    seg: Option<u64>,
    ack: Option<oneshot::Sender<Result<Recorded, String>>>,
}

const USAGE_COLUMNS: &str = "request_id, tenant_id, key_id, model, endpoint, prompt_tokens, cached_tokens, \
     completion_tokens, status, finish_reason, error_code, started_at, finished_at, price_effective_from, \
     cost_input_nusd, cost_cached_nusd, cost_output_nusd, cost_nusd, processor_us, cost_processor_nusd, ttft_ms, adapter, batch_id";

/// A ledger row: the record and its rating.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LedgerRow {
    #[serde(flatten)]
    pub rec: UsageRecord,
    pub cost: Cost,
}

fn ledger_row(r: &AnyRow) -> LedgerRow {
    let u32_at = |i: usize| u32::try_from(r.get::<i64, _>(i)).unwrap_or(u32::MAX);
    LedgerRow {
        rec: UsageRecord {
            request_id: r.get(0),
            tenant_id: r.get(1),
            key_id: r.get(2),
            model: r.get(3),
            endpoint: r.get(4),
            prompt_tokens: u32_at(5),
            cached_tokens: u32_at(6),
            completion_tokens: u32_at(7),
            status: r.get(8),
            finish_reason: r.get(9),
            error_code: r.get(10),
            started_at: r.get(11),
            finished_at: r.get(12),
            processor_us: u64::try_from(r.get::<i64, _>(18)).unwrap_or(0),
            ttft_ms: r
                .get::<Option<i64>, _>(20)
                .map(|v| u32::try_from(v).unwrap_or(u32::MAX)),
            adapter: r.get(21),
            batch_id: r.get(22),
        },
        cost: Cost {
            price_effective_from: r.get(13),
            input_nusd: r.get(14),
            cached_nusd: r.get(15),
            output_nusd: r.get(16),
            processor_nusd: r.get(19),
            total_nusd: r.get(17),
        },
    }
}

async fn load_prices<'e, E>(ex: E) -> Result<Vec<Price>, sqlx::Error>
where
    E: sqlx::Executor<'e, Database = sqlx::Any>,
{
    let rows = sqlx::query(
        "SELECT model, effective_from, input_micros_per_mtok, cached_input_micros_per_mtok, output_micros_per_mtok, \
         created_at, processor_micros_per_cpu_s, batch_percent FROM prices ORDER BY model, effective_from",
    )
    .fetch_all(ex)
    .await?;
    Ok(rows
        .iter()
        .map(|r| Price {
            model: r.get(0),
            effective_from: r.get(1),
            rates: PriceRates {
                input_micros_per_mtok: r.get(2),
                cached_input_micros_per_mtok: r.get(3),
                output_micros_per_mtok: r.get(4),
                processor_micros_per_cpu_s: r.get(6),
                batch_percent: r.get(7),
            },
            created_at: r.get(5),
        })
        .collect())
}

/// One transaction for a batch: rate each record, insert it unless its request id is
/// already there, and add inserted costs to the tenant's monthly spend.
///
/// The prices are read just before the transaction, so that its first statement is a
/// write: on SQLite a transaction that reads first and then writes fails at once
/// (SQLITE_BUSY, no busy wait) when another connection — another process, or this one's
/// outbox replay — committed in between; under load that deferred whole batches to the
/// outbox. As before, a batch is rated with the price versions committed when it is
/// written (a read inside the transaction saw the same snapshot); versions are never
/// updated.
async fn write_batch(pool: &AnyPool, recs: &[&UsageRecord]) -> Result<Vec<Recorded>, sqlx::Error> {
    let prices = load_prices(pool).await?;
    let mut tx = pool.begin().await?;
    let mut out = Vec::with_capacity(recs.len());
    for u in recs {
        let cost = rate(u, price_of(&prices, u));
        let res = sqlx::query(&format!(
            "INSERT INTO usage_records ({USAGE_COLUMNS}) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, $19, $20, $21, $22, $23) \
             ON CONFLICT (request_id) DO NOTHING"
        ))
        .bind(&u.request_id)
        .bind(&u.tenant_id)
        .bind(&u.key_id)
        .bind(&u.model)
        .bind(&u.endpoint)
        .bind(i64::from(u.prompt_tokens))
        .bind(i64::from(u.cached_tokens))
        .bind(i64::from(u.completion_tokens))
        .bind(&u.status)
        .bind(&u.finish_reason)
        .bind(&u.error_code)
        .bind(u.started_at)
        .bind(u.finished_at)
        .bind(cost.price_effective_from)
        .bind(cost.input_nusd)
        .bind(cost.cached_nusd)
        .bind(cost.output_nusd)
        .bind(cost.total_nusd)
        .bind(i64::try_from(u.processor_us).unwrap_or(i64::MAX))
        .bind(cost.processor_nusd)
        .bind(u.ttft_ms.map(i64::from))
        .bind(&u.adapter)
        .bind(&u.batch_id)
        .execute(&mut *tx)
        .await?;
        let inserted = res.rows_affected() == 1;
        if inserted {
            sqlx::query(
                "INSERT INTO tenant_spend (tenant_id, month, cost_nusd, requests) VALUES ($1, $2, $3, 1) \
                 ON CONFLICT (tenant_id, month) DO UPDATE SET cost_nusd = tenant_spend.cost_nusd + excluded.cost_nusd, \
                 requests = tenant_spend.requests + 1",
            )
            .bind(&u.tenant_id)
            .bind(month_of(u.started_at))
            .bind(cost.total_nusd)
            .execute(&mut *tx)
            .await?;
        }
        out.push(Recorded { inserted, cost });
    }
    tx.commit().await?;
    Ok(out)
}

const BATCH: usize = 256;

/// Writes records in batches (idempotent); the number written.
async fn replay(pool: &AnyPool, recs: &[UsageRecord]) -> Result<usize, sqlx::Error> {
    for chunk in recs.chunks(BATCH) {
        let refs: Vec<&UsageRecord> = chunk.iter().collect();
        write_batch(pool, &refs).await?;
    }
    Ok(recs.len())
}

/// Replays this process's deferred segments (final records only: its admitted requests
/// may still be running) and other (dead) processes' segments.
async fn recover(pool: &AnyPool, outbox: &Outbox) -> Result<usize, String> {
    let mut n = 0;
    for (seq, path) in outbox.deferred_segments().map_err(|e| e.to_string())? {
        let recs = outbox::read_segments(&[path]).map_err(|e| e.to_string())?;
        n += replay(pool, &recs.into_records(false))
            .await
            .map_err(|e| e.to_string())?;
        outbox.replayed(seq);
    }
    n += recover_abandoned(pool, outbox.abandoned()).await?;
    Ok(n)
}

/// Replays dead processes' segments, read together (a request's admission mark and its
/// final record may be in different segments): final records, and requests admitted but
/// never finished as `interrupted`.
async fn recover_abandoned(pool: &AnyPool, segments: Vec<(PathBuf, std::fs::File)>) -> Result<usize, String> {
    if segments.is_empty() {
        return Ok(0);
    }
    let paths: Vec<PathBuf> = segments.iter().map(|(p, _)| p.clone()).collect();
    let replay_of = outbox::read_segments(&paths).map_err(|e| e.to_string())?;
    let interrupted = replay_of.unfinished.len();
    let n = replay(pool, &replay_of.into_records(true))
        .await
        .map_err(|e| e.to_string())?;
    if interrupted > 0 {
        tracing::warn!(
            requests = interrupted,
            "requests admitted by a process that died before finishing them recorded as interrupted"
        );
    }
    for (path, lock) in segments {
        std::fs::remove_file(&path).map_err(|e| e.to_string())?;
        drop(lock);
    }
    Ok(n)
}

enum Msg {
    Record(Box<Job>),
    /// Acknowledged once everything sent before it is committed (or has failed).
    Flush(oneshot::Sender<()>),
}

async fn writer(pool: AnyPool, mut rx: mpsc::Receiver<Msg>, outbox: Option<Arc<Outbox>>, health: Arc<LedgerHealth>) {
    while let Some(first) = rx.recv().await {
        let mut batch = Vec::new();
        let mut flushes = Vec::new();
        let mut next = Some(first);
        while let Some(m) = next.take() {
            match m {
                Msg::Record(j) => batch.push(*j),
                Msg::Flush(f) => flushes.push(f),
            }
            if batch.len() < BATCH {
                next = rx.try_recv().ok();
            }
        }
        if batch.is_empty() {
            for f in flushes {
                let _ = f.send(());
            }
            continue;
        }
        let recs: Vec<&UsageRecord> = batch.iter().map(|j| &j.rec).collect();
        let mut attempt = 0u32;
        let result = loop {
            match write_batch(&pool, &recs).await {
                Ok(r) => break Ok(r),
                Err(e) if attempt < 4 => {
                    tracing::warn!(attempt, error = %e, records = recs.len(), "usage write failed; retrying");
                    tokio::time::sleep(Duration::from_millis(50 << attempt)).await;
                    attempt += 1;
                }
                Err(e) => break Err(e.to_string()),
            }
        };
        health
            .db_failing
            .store(result.is_err(), std::sync::atomic::Ordering::Relaxed);
        match result {
            Ok(rs) => {
                for (j, r) in batch.into_iter().zip(rs) {
                    if let (Some(o), Some(seg)) = (&outbox, j.seg) {
                        o.committed(seg);
                    }
                    if let Some(ack) = j.ack {
                        let _ = ack.send(Ok(r));
                    }
                }
            }
            Err(e) => {
                for j in batch {
                    match (&outbox, j.seg) {
                        (Some(o), Some(seg)) => {
                            tracing::error!(request_id = %j.rec.request_id, error = %e, "usage record kept in the outbox until the database is back");
                            o.defer(seg);
                        }
                        _ => tracing::error!(record = ?j.rec, error = %e, "usage record could not be written"),
                    }
                    if let Some(ack) = j.ack {
                        let _ = ack.send(Err(e.clone()));
                    }
                }
            }
        }
        for f in flushes {
            let _ = f.send(());
        }
    }
}

/// A record that is durable, on its way to the database.
pub struct Pending(PendingInner);

enum PendingInner {
    Done(Result<Recorded, String>),
    Waiting(oneshot::Receiver<Result<Recorded, String>>),
}

impl Pending {
    /// Waits for the database commit (rating included).
    pub async fn committed(self) -> Result<Recorded, BillingError> {
        let r = match self.0 {
            PendingInner::Done(r) => r,
            PendingInner::Waiting(rx) => rx.await.map_err(|_| BillingError::WriterGone)?,
        };
        r.map_err(|e| BillingError::Db(sqlx::Error::Protocol(e)))
    }
}

/// The ledger: prices, rated usage rows, monthly spend.
#[derive(Clone)]
pub struct UsageLedger {
    pool: AnyPool,
    tx: mpsc::Sender<Msg>,
    outbox: Option<Arc<Outbox>>,
    health: Arc<LedgerHealth>,
}

/// Whether the outbox and the database take records, for the decision to admit requests.
#[derive(Debug, Default)]
pub struct LedgerHealth {
    /// The last outbox append failed (the disk is full or failing).
    pub outbox_failing: std::sync::atomic::AtomicBool,
    /// The last database write failed.
    pub db_failing: std::sync::atomic::AtomicBool,
    /// Outbox appends that failed.
    pub outbox_errors: std::sync::atomic::AtomicU64,
    /// While both fail: when (Unix ms) a request was last let through to find out whether
    /// either recovered.
    last_probe_ms: std::sync::atomic::AtomicI64,
}

/// A request's admission mark in the outbox (see [`outbox`]): dropped once the request's
/// final record is appended, or when it no longer needs one.
pub struct Admitted {
    outbox: Option<Arc<Outbox>>,
    seg: u64,
}

impl Admitted {
    /// The request's final record could not be made durable: the mark stays in the outbox
    /// (its segment is kept), so the request is recorded as interrupted on replay rather
    /// than lost.
    pub fn abandon(mut self) {
        self.outbox = None;
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        if let Some(o) = self.outbox.take() {
            o.resolved(self.seg);
        }
    }
}

impl std::fmt::Debug for UsageLedger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UsageLedger").finish_non_exhaustive()
    }
}

impl UsageLedger {
    /// A ledger whose records are durable once committed to the database (needs a Tokio
    /// runtime for its writer).
    pub fn new(db: &Db) -> Self {
        Self::start(db, None)
    }

    fn start(db: &Db, outbox: Option<Arc<Outbox>>) -> Self {
        let (tx, rx) = mpsc::channel(8192);
        let pool = db.pool.clone();
        let health = Arc::new(LedgerHealth::default());
        tokio::spawn(writer(pool.clone(), rx, outbox.clone(), health.clone()));
        Self {
            pool,
            tx,
            outbox,
            health,
        }
    }

    /// Whether the outbox and the database take records.
    pub fn health(&self) -> &LedgerHealth {
        &self.health
    }

    /// Whether a new request can be admitted with its usage recorded: its record can be
    /// made durable in the outbox or, the outbox failing (a full disk), in the database.
    /// Refusing only when neither takes records is the documented decision: a full disk
    /// alone slows responses (each waits for its database commit) but loses nothing.
    ///
    /// While both fail, one request a second is let through: its record is the probe whose
    /// success (in either) clears the state.
    pub fn accepting(&self) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        let h = &self.health;
        if !(h.outbox_failing.load(Relaxed) && h.db_failing.load(Relaxed)) {
            return true;
        }
        let now = now_ms();
        let last = h.last_probe_ms.load(Relaxed);
        now - last >= 1000 && h.last_probe_ms.compare_exchange(last, now, Relaxed, Relaxed).is_ok()
    }

    /// How records are made durable ([`outbox::Durability`]).
    pub fn durability(&self) -> outbox::Durability {
        self.outbox.as_ref().map_or_else(Default::default, |o| o.durability)
    }

    /// Writes a request's admission mark (see [`outbox`]); None without an outbox, or when
    /// the outbox cannot take it (its final record will still be recorded).
    pub fn admit(&self, u: &UsageRecord) -> Option<Admitted> {
        let ob = self.outbox.as_ref()?;
        match ob.admit(u) {
            Ok((seg, _)) => Some(Admitted {
                outbox: Some(ob.clone()),
                seg,
            }),
            Err(e) => {
                self.outbox_failed(&e);
                None
            }
        }
    }

    fn outbox_failed(&self, e: &std::io::Error) {
        use std::sync::atomic::Ordering::Relaxed;
        self.health.outbox_errors.fetch_add(1, Relaxed);
        if !self.health.outbox_failing.swap(true, Relaxed) {
            tracing::error!(error = %e, "the usage outbox cannot be written (disk full?): records go to the database directly until it can");
        }
    }

    /// A ledger with an outbox in `dir`: records are durable once appended there (see
    /// [`outbox`]). Segments left by dead processes are replayed first; this process's
    /// own leftovers are retried every few seconds.
    pub async fn with_outbox(db: &Db, dir: &Path) -> Result<Self, BillingError> {
        Self::with_outbox_durability(db, dir, outbox::Durability::Write).await
    }

    /// [`UsageLedger::with_outbox`], flushing records to disk as `durability` says.
    pub async fn with_outbox_durability(
        db: &Db,
        dir: &Path,
        durability: outbox::Durability,
    ) -> Result<Self, BillingError> {
        let n = recover_abandoned(&db.pool, outbox::abandoned_in(dir, None))
            .await
            .map_err(|e| BillingError::Db(sqlx::Error::Protocol(e)))?;
        if n > 0 {
            tracing::info!(records = n, "usage outbox of a previous process replayed");
        }
        let mut ob = Outbox::open(dir)?;
        ob.durability = durability;
        if durability == outbox::Durability::Fsync {
            ob.sync_dir()?;
        }
        let ob = Arc::new(ob);
        let ledger = Self::start(db, Some(ob.clone()));
        let pool = db.pool.clone();
        let weak = Arc::downgrade(&ob);
        drop(ob);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(5)).await;
                let Some(ob) = weak.upgrade() else { break };
                match recover(&pool, &ob).await {
                    Ok(0) => {}
                    Ok(n) => tracing::info!(records = n, "usage outbox replayed"),
                    Err(e) => tracing::warn!(error = %e, "usage outbox replay failed; will retry"),
                }
            }
        });
        Ok(ledger)
    }

    /// Replays outbox segments in `dir` whose process is gone (for tools that read the
    /// ledger, such as the admin CLI). Returns the number of records replayed.
    pub async fn recover_dir(&self, dir: &Path) -> Result<usize, BillingError> {
        recover_abandoned(&self.pool, outbox::abandoned_in(dir, None))
            .await
            .map_err(|e| BillingError::Db(sqlx::Error::Protocol(e)))
    }

    pub fn pool(&self) -> &AnyPool {
        &self.pool
    }

    /// Makes a request's record durable — appended to the outbox, or without one committed
    /// to the database — and returns a handle on its database commit. Idempotent by request
    /// id: a replay changes nothing.
    pub async fn record_durable(&self, u: &UsageRecord) -> Result<Pending, BillingError> {
        let Some(ob) = &self.outbox else {
            let r = self.commit(u, None).await;
            return Ok(Pending(PendingInner::Done(r)));
        };
        let (seg, ticket) = match ob.append(u) {
            Ok(appended) => {
                self.health
                    .outbox_failing
                    .store(false, std::sync::atomic::Ordering::Relaxed);
                appended
            }
            Err(e) => {
                // A full or failing disk: the record goes to the database directly, and the
                // response waits for the commit.
                self.outbox_failed(&e);
                let r = self.commit(u, None).await;
                return match r {
                    Ok(r) => Ok(Pending(PendingInner::Done(Ok(r)))),
                    Err(db) => Err(BillingError::Io(std::io::Error::other(format!(
                        "neither the outbox ({e}) nor the database ({db}) took the record"
                    )))),
                };
            }
        };
        if ob.durability == outbox::Durability::Fsync {
            let ob = ob.clone();
            tokio::task::spawn_blocking(move || ob.sync_to(ticket))
                .await
                .map_err(|e| BillingError::Io(std::io::Error::other(e)))??;
        }
        let (ack, done) = oneshot::channel();
        let job = Job {
            rec: u.clone(),
            seg: Some(seg),
            ack: Some(ack),
        };
        if self.tx.try_send(Msg::Record(Box::new(job))).is_err() {
            // The writer is far behind (the database is slow or down): the record waits in
            // the outbox and is replayed from there.
            ob.defer(seg);
            return Ok(Pending(PendingInner::Done(Err("deferred to the outbox".into()))));
        }
        Ok(Pending(PendingInner::Waiting(done)))
    }

    async fn commit(&self, u: &UsageRecord, seg: Option<u64>) -> Result<Recorded, String> {
        let (ack, done) = oneshot::channel();
        self.tx
            .send(Msg::Record(Box::new(Job {
                rec: u.clone(),
                seg,
                ack: Some(ack),
            })))
            .await
            .map_err(|_| "the usage writer has stopped".to_string())?;
        done.await.map_err(|_| "the usage writer has stopped".to_string())?
    }

    /// Returns once every record this process handed over before the call is committed (or
    /// has failed): reads after it see this process's own usage.
    pub async fn flush(&self) {
        let (tx, rx) = oneshot::channel();
        if self.tx.send(Msg::Flush(tx)).await.is_ok() {
            let _ = rx.await;
        }
    }

    /// Records a request's usage and returns once it is committed to the database.
    pub async fn record(&self, u: &UsageRecord) -> Result<Recorded, BillingError> {
        self.record_durable(u).await?.committed().await
    }

    /// Adds a price version. `effective_from` may not be in the past (history is never
    /// rewritten) — except for a model's very first price.
    pub async fn set_price(
        &self,
        model: &str,
        rates: PriceRates,
        effective_from: Option<i64>,
    ) -> Result<Price, BillingError> {
        if model.is_empty() || model.len() > 128 {
            return Err(BillingError::Invalid {
                field: "model",
                message: "a model id, or * for the default".into(),
            });
        }
        if [
            rates.input_micros_per_mtok,
            rates.cached_input_micros_per_mtok,
            rates.output_micros_per_mtok,
            rates.processor_micros_per_cpu_s,
        ]
        .iter()
        .any(|r| *r < 0)
        {
            return Err(BillingError::Invalid {
                field: "price",
                message: "prices cannot be negative".into(),
            });
        }
        if !(0..=100).contains(&rates.batch_percent) {
            return Err(BillingError::Invalid {
                field: "batch_percent",
                message: "a batch request's share of the price is a percentage, 0 to 100".into(),
            });
        }
        let now = now_ms();
        let existing: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM prices WHERE model = $1")
            .bind(model)
            .fetch_one(&self.pool)
            .await?;
        let effective_from = match effective_from {
            Some(t) if t < now - 1000 && existing > 0 => {
                return Err(BillingError::Invalid {
                    field: "effective_from",
                    message: "a price change cannot take effect in the past; history is never rewritten".into(),
                })
            }
            Some(t) => t,
            None if existing == 0 => 0,
            None => now,
        };
        let p = Price {
            model: model.to_string(),
            effective_from,
            rates,
            created_at: now,
        };
        let res = sqlx::query(
            "INSERT INTO prices (model, effective_from, input_micros_per_mtok, cached_input_micros_per_mtok, \
             output_micros_per_mtok, created_at, processor_micros_per_cpu_s, batch_percent) VALUES ($1, $2, $3, $4, $5, $6, $7, $8) \
             ON CONFLICT (model, effective_from) DO NOTHING",
        )
        .bind(&p.model)
        .bind(p.effective_from)
        .bind(rates.input_micros_per_mtok)
        .bind(rates.cached_input_micros_per_mtok)
        .bind(rates.output_micros_per_mtok)
        .bind(p.created_at)
        .bind(rates.processor_micros_per_cpu_s)
        .bind(rates.batch_percent)
        .execute(&self.pool)
        .await?;
        if res.rows_affected() == 0 {
            return Err(BillingError::Invalid {
                field: "effective_from",
                message: format!("{model} already has a price effective from {effective_from}"),
            });
        }
        Ok(p)
    }

    /// Every price version (of one model, or all), oldest first.
    /// The newest price version of exactly `model` (not the `*` default), if any: what a
    /// new version leaves unsaid is inherited from it.
    pub async fn latest_rates(&self, model: &str) -> Result<Option<PriceRates>, BillingError> {
        Ok(self
            .prices(Some(model))
            .await?
            .into_iter()
            .filter(|p| p.model == model)
            .max_by_key(|p| p.effective_from)
            .map(|p| p.rates))
    }

    pub async fn prices(&self, model: Option<&str>) -> Result<Vec<Price>, BillingError> {
        let all = load_prices(&self.pool).await?;
        Ok(all.into_iter().filter(|p| model.is_none_or(|m| p.model == m)).collect())
    }

    /// A batch's usage as recorded so far (records still in the outbox are not counted yet).
    pub async fn batch_usage(&self, tenant_id: &str, batch_id: &str) -> Result<BatchUsage, BillingError> {
        let r = sqlx::query(
            "SELECT COUNT(*), CAST(COALESCE(SUM(prompt_tokens), 0) AS BIGINT), CAST(COALESCE(SUM(cached_tokens), 0) AS BIGINT), \
             CAST(COALESCE(SUM(completion_tokens), 0) AS BIGINT), CAST(COALESCE(SUM(cost_nusd), 0) AS BIGINT) \
             FROM usage_records WHERE tenant_id = $1 AND batch_id = $2",
        )
        .bind(tenant_id)
        .bind(batch_id)
        .fetch_one(&self.pool)
        .await?;
        Ok(BatchUsage {
            requests: r.get(0),
            prompt_tokens: r.get(1),
            cached_tokens: r.get(2),
            completion_tokens: r.get(3),
            cost_nusd: r.get(4),
        })
    }

    /// A tenant's spend in a calendar month (`YYYY-MM`), nano-USD.
    pub async fn month_spend(&self, tenant_id: &str, month: &str) -> Result<i64, BillingError> {
        let v: Option<i64> =
            sqlx::query_scalar("SELECT cost_nusd FROM tenant_spend WHERE tenant_id = $1 AND month = $2")
                .bind(tenant_id)
                .bind(month)
                .fetch_optional(&self.pool)
                .await?;
        Ok(v.unwrap_or(0))
    }

    /// Every tenant's spend and request count in a month (`YYYY-MM`), by tenant id.
    pub async fn month_spends(&self, month: &str) -> Result<Vec<(String, i64, i64)>, BillingError> {
        let rows = sqlx::query("SELECT tenant_id, cost_nusd, requests FROM tenant_spend WHERE month = $1")
            .bind(month)
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.iter().map(|r| (r.get(0), r.get(1), r.get(2))).collect())
    }

    /// The most recent rows, newest first, optionally for one tenant id.
    pub async fn recent(&self, tenant_id: Option<&str>, limit: u32) -> Result<Vec<LedgerRow>, BillingError> {
        let rows = sqlx::query(&format!(
            "SELECT {USAGE_COLUMNS} FROM usage_records WHERE ($1 IS NULL OR tenant_id = $1) \
             ORDER BY started_at DESC, request_id LIMIT $2"
        ))
        .bind(tenant_id)
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.iter().map(ledger_row).collect())
    }

    /// A tenant's rows with `from <= started_at < to`, oldest first.
    pub async fn rows(&self, tenant_id: &str, from_ms: i64, to_ms: i64) -> Result<Vec<LedgerRow>, BillingError> {
        let rows = sqlx::query(&format!(
            "SELECT {USAGE_COLUMNS} FROM usage_records WHERE tenant_id = $1 AND started_at >= $2 AND started_at < $3 \
             ORDER BY started_at, request_id"
        ))
        .bind(tenant_id)
        .bind(from_ms)
        .bind(to_ms)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.iter().map(ledger_row).collect())
    }
}

/// Shared handle type for the gateway.
pub type SharedLedger = Arc<UsageLedger>;

#[cfg(test)]
mod tests;

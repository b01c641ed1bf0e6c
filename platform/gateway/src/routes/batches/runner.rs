//! Each gateway's batch runner: it claims lines of open batches (a conditional update, so
//! gateways sharing the database never run one twice), runs each through the same pipeline
//! as an API request — in the `batch` class, under the key that created the batch — and
//! keeps the answer as the line's output (see the module above for the whole contract).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use hearth_tenants::batches::{self as store, ClaimedLine, LineResult};
use hearth_tenants::{now_ms, TenantError};
use serde_json::{json, Value};

use crate::pipeline::{self, sent_back, Endpoint, LineRun, RequestContext};
use crate::state::AppState;

/// Runs of one line, at most: the refusal of the last one (rate limited, unavailable, over
/// budget) is kept as its answer.
pub const MAX_ATTEMPTS: i64 = 20;

/// Works batches off until the gateway drains: claims lines of open batches within
/// `gw.batches.concurrency`, renews their leases, and finishes batches that are done.
/// `owner` names this gateway in the lines' leases (unique per process).
pub async fn run(gw: Arc<AppState>, owner: String) {
    let settings = gw.batches.clone();
    if settings.concurrency == 0 {
        return;
    }
    let owner: Arc<str> = owner.into();
    let slots = Arc::new(tokio::sync::Semaphore::new(settings.concurrency));
    // The lines this runner is running: only theirs are renewed.
    let running: Running = Default::default();
    let mut renewed = Instant::now();
    // Batches that were sent back (rate limit, budget): not claimed from until then.
    let waits: Arc<std::sync::Mutex<HashMap<String, Instant>>> = Default::default();
    // A line that ends wakes the runner at once, so a free slot is filled without waiting for
    // the next poll.
    let wake = Arc::new(tokio::sync::Notify::new());
    let mut every = tokio::time::interval(settings.poll);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = every.tick() => {}
            () = wake.notified() => {}
        }
        if renewed.elapsed() >= settings.lease / 3 {
            renewed = Instant::now();
            renew(&gw, &owner, &running, settings.lease).await;
        }
        if gw.draining.load(std::sync::atomic::Ordering::SeqCst) {
            // Lines running finish (their leases renewed meanwhile); none starts. If this
            // process ends first, their leases run out and another gateway (or this one,
            // restarted) runs them.
            if lock(&running).is_empty() {
                return;
            }
            continue;
        }
        let open = match gw.tenants.open_batches().await {
            Ok(o) => o,
            Err(e) => {
                tracing::warn!(error = %e, "open batches could not be read");
                continue;
            }
        };
        let now = Instant::now();
        lock(&waits).retain(|_, until| *until > now);
        let mut runnable = Vec::new();
        for b in &open {
            let claimable = b.status == store::status::IN_PROGRESS && b.expires_at > now_ms();
            if !claimable {
                finish(&gw, &b.id).await;
                continue;
            }
            if !lock(&waits).contains_key(&b.id) {
                runnable.push(b);
            }
        }
        // Free slots shared out between tenants first: each may hold its fair share of the
        // slots (the concurrency over the tenants with runnable batches) while another
        // waits; what no one else wants goes to whoever has lines left. Within a tenant, its
        // batches oldest first.
        let mut free = slots.available_permits();
        let tenant_of: HashMap<&str, &str> = open.iter().map(|b| (b.id.as_str(), b.tenant_id.as_str())).collect();
        let mut held: HashMap<String, usize> = HashMap::new();
        for (batch, _) in lock(&running).keys() {
            if let Some(t) = tenant_of.get(batch.as_str()) {
                *held.entry(t.to_string()).or_default() += 1;
            }
        }
        let mut tenants: Vec<(&str, Vec<&&store::OpenBatch>)> = Vec::new();
        for b in &runnable {
            match tenants.iter_mut().find(|(t, _)| *t == b.tenant_id) {
                Some((_, list)) => list.push(b),
                None => tenants.push((&b.tenant_id, vec![b])),
            }
        }
        let fair = settings.concurrency.div_ceil(tenants.len().max(1));
        let mut exhausted: std::collections::HashSet<&str> = Default::default();
        for cap in [fair, usize::MAX] {
            // The tenant holding fewest slots first.
            tenants.sort_by_key(|(t, _)| held.get(*t).copied().unwrap_or(0));
            for (tenant, batches) in &tenants {
                for b in batches {
                    let holding = held.get(*tenant).copied().unwrap_or(0);
                    let want = free.min(cap.saturating_sub(holding));
                    if want == 0 {
                        break;
                    }
                    if exhausted.contains(b.id.as_str()) {
                        continue;
                    }
                    let until = now_ms() + settings.lease.as_millis() as i64;
                    let lines = match gw.tenants.claim_lines(&b.id, &owner, want as i64, until).await {
                        Ok(l) => l,
                        Err(e) => {
                            tracing::warn!(batch = %b.id, error = %e, "batch lines could not be claimed");
                            exhausted.insert(&b.id);
                            continue;
                        }
                    };
                    if lines.len() < want {
                        exhausted.insert(&b.id);
                    }
                    if lines.is_empty() {
                        // Every line answered, or running (while one runs here, the batch is
                        // not done: no need to ask the store).
                        if !lock(&running).keys().any(|(batch, _)| *batch == b.id) {
                            finish(&gw, &b.id).await;
                        }
                        continue;
                    }
                    free -= lines.len();
                    *held.entry(tenant.to_string()).or_default() += lines.len();
                    for line in lines {
                        // Claims stay within the free slots, and only this loop takes slots.
                        let Ok(permit) = slots.clone().try_acquire_owned() else {
                            debug_assert!(false, "a batch line was claimed without a free slot");
                            continue;
                        };
                        let (gw, owner, waits, key) = (gw.clone(), owner.clone(), waits.clone(), b.key_id.clone());
                        let (endpoint, wake) = (b.endpoint.clone(), wake.clone());
                        let guard = InFlight::new(&running, &line);
                        tokio::spawn(async move {
                            run_line(&gw, &owner, &line, &key, &endpoint, &waits).await;
                            // Dropped even if the line's task panics: the line is renewed no more.
                            drop(guard);
                            drop(permit);
                            wake.notify_one();
                        });
                    }
                }
            }
        }
    }
}

type Running = Arc<std::sync::Mutex<HashMap<(String, i64), ClaimedLine>>>;

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A line among those this runner runs, for as long as the guard lives.
struct InFlight {
    running: Running,
    key: (String, i64),
}

impl InFlight {
    fn new(running: &Running, line: &ClaimedLine) -> Self {
        let key = (line.batch_id.clone(), line.line);
        lock(running).insert(key.clone(), line.clone());
        Self {
            running: running.clone(),
            key,
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        lock(&self.running).remove(&self.key);
    }
}

/// Extends the leases of the lines this runner is running.
async fn renew(gw: &AppState, owner: &str, running: &Running, lease: Duration) {
    let lines: Vec<ClaimedLine> = lock(running).values().cloned().collect();
    let until = now_ms() + lease.as_millis() as i64;
    for l in lines {
        match gw.tenants.renew_lease(&l, owner, until).await {
            Ok(true) => {}
            // Not held: it ended since the map was read, or (still in the map) it was lost.
            Ok(false) if lock(running).contains_key(&(l.batch_id.clone(), l.line)) => {
                tracing::warn!(batch = %l.batch_id, line = l.line, "a batch line's lease was lost while it ran")
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(batch = %l.batch_id, line = l.line, error = %e, "a batch line's lease could not be renewed")
            }
        }
    }
}

async fn finish(gw: &AppState, id: &str) {
    match gw.tenants.finish_batch(id).await {
        Ok(Some(b)) => {
            gw.metrics.batches_finished.inc();
            tracing::info!(batch = %b.id, status = %b.status, completed = b.counts.completed, failed = b.counts.failed, "batch finished");
        }
        Ok(None) => {}
        Err(e) => tracing::warn!(batch = %id, error = %e, "a batch could not be finished"),
    }
}

fn endpoint_of(path: &str) -> Endpoint {
    match path {
        "/v1/completions" => Endpoint::Completions,
        "/v1/responses" => Endpoint::Responses,
        _ => Endpoint::Chat,
    }
}

/// Runs one claimed line through the pipeline and keeps its answer, or sends it back.
async fn run_line(
    gw: &Arc<AppState>,
    owner: &str,
    line: &ClaimedLine,
    key_id: &str,
    endpoint: &str,
    waits: &std::sync::Mutex<HashMap<String, Instant>>,
) {
    let request_id = line.request_id();
    let mut headers = HeaderMap::new();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    headers.insert(
        crate::pipeline::admit::PRIORITY_HEADER,
        HeaderValue::from_static("batch"),
    );
    let mut ctx = RequestContext::new(
        request_id.clone(),
        endpoint_of(endpoint),
        headers,
        Ok(Bytes::from(line.body.clone())),
    );
    let run = LineRun {
        batch_id: line.batch_id.clone(),
        key_id: key_id.to_string(),
        last_try: line.attempt + 1 >= MAX_ATTEMPTS,
    };
    let last_try = run.last_try;
    ctx.batch = Some(run);
    let resp = pipeline::handle(gw.clone(), ctx).await;
    let status = resp.status();
    let retry_after = resp
        .headers()
        .get(header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(1)
        .clamp(1, 600);
    let body = axum::body::to_bytes(resp.into_body(), store::MAX_RESULT_BYTES).await;
    let (status, body): (StatusCode, Value) = match &body {
        Ok(b) => (
            status,
            serde_json::from_slice(b).unwrap_or_else(|_| Value::String(String::from_utf8_lossy(b).into_owned())),
        ),
        Err(_) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            json!({"error": {"message": format!("the answer is larger than a batch keeps ({} bytes)", store::MAX_RESULT_BYTES),
                "type": "server_error", "code": "answer_too_large"}}),
        ),
    };
    let code = body["error"]["code"].as_str();
    let wait_until = |secs: u64| now_ms() + secs as i64 * 1000;
    let send_back = |secs: u64| {
        lock(waits).insert(line.batch_id.clone(), Instant::now() + Duration::from_secs(secs));
    };
    let outcome = match status {
        s if last_try || !sent_back(s, code) => keep(gw, owner, line, &request_id, status, body).await,
        StatusCode::PAYMENT_REQUIRED => {
            // A spent hard budget: the batch waits (and says why) until the budget allows.
            let reason = body["error"]["message"]
                .as_str()
                .unwrap_or("The tenant's hard monthly budget is spent.")
                .to_string();
            send_back(30);
            gw.metrics.batch_lines_sent_back.inc();
            if let Err(e) = gw.tenants.set_batch_paused(&line.batch_id, Some(&reason)).await {
                tracing::warn!(batch = %line.batch_id, error = %e, "a batch's pause could not be recorded");
            }
            stored(|| gw.tenants.release_line(line, owner, wait_until(30))).await
        }
        _ => {
            send_back(retry_after);
            gw.metrics.batch_lines_sent_back.inc();
            stored(|| gw.tenants.release_line(line, owner, wait_until(retry_after))).await
        }
    };
    if let Err(e) = outcome {
        // Its lease runs out and the line runs again (under the same request id: metered once).
        tracing::warn!(batch = %line.batch_id, line = line.line, error = %e, "a batch line's outcome could not be stored");
    }
}

/// A store write, tried again twice after a failure (a busy database).
async fn stored<F, Fut, T>(write: F) -> Result<T, TenantError>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<T, TenantError>>,
{
    let mut last = None;
    for wait in [0, 200, 1000] {
        tokio::time::sleep(Duration::from_millis(wait)).await;
        match write().await {
            Ok(v) => return Ok(v),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| TenantError::Conflict("no attempt made".into())))
}

/// Keeps an answer as the line's output (if this runner still holds the line).
async fn keep(
    gw: &AppState,
    owner: &str,
    line: &ClaimedLine,
    request_id: &str,
    status: StatusCode,
    body: Value,
) -> Result<(), TenantError> {
    let result = json!({
        "id": request_id, "custom_id": line.custom_id,
        "response": {"status_code": status.as_u16(), "request_id": request_id, "body": body},
        "error": null,
    });
    let r = LineResult {
        status_code: Some(i64::from(status.as_u16())),
        result: result.to_string(),
    };
    if stored(|| gw.tenants.finish_line(line, owner, &r)).await? {
        gw.metrics.batch_lines.inc();
        if status.is_success() {
            // A batch that was paused (budget) runs again: it says so no more.
            stored(|| gw.tenants.set_batch_paused(&line.batch_id, None)).await?;
        }
    } else {
        tracing::warn!(batch = %line.batch_id, line = line.line, "a batch line's lease was lost while it ran; its answer is not kept");
    }
    Ok(())
}

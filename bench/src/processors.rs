//! `hearth bench processors`: what a trivial pre + post processor adds to a request, per
//! guest language, and whether processor work scales across cores.
//!
//! * **Per request** (in the runtime, as the gateway does it): a fresh instance,
//!   `on-request`, `on-response`, drop. P50/P99 over sequential requests, with the P50 of
//!   the minor page faults the two calls take (pages of a fresh instance that are not
//!   resident), two ways:
//!   - *warm* (the default): the instance comes from the runtime's shelf of instances made
//!     ahead, refilled in the background; requests are paced (one per `PACE`) so that the
//!     shelf can keep up, and the share that found their instance ready is printed;
//!   - *made*: shelves off, the instance made on the request's path (the cost without
//!     them; its release is still handed to the maker thread).
//! * **CPU per request**: the process's CPU time over the back-to-back 1-task run, divided by
//!   its requests: what a request costs the machine, background instantiation included.
//! * **Through the gateway** (the WAT guest): the same instant-worker gateway as
//!   `hearth bench gateway`, two metered tenants, one with the processor as pre + post;
//!   requests alternate between them over HTTP; the added P50 is the difference.
//! * **Scaling**: requests/s of the per-request loop back to back (shelves on) with 1 and 2
//!   concurrent tasks on a 2-thread runtime.
//!
//! Guests: the WAT trivial processor (built in-process; the "compiled language" figure —
//! no language runtime at all), and the JavaScript and Python trivial processors from
//! `sdk/processors/build` when their directory is given.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hearth_runtime::{Action, Compiled, Limits, Request, Response, Runtime};
use serde::Serialize;

/// The gap between the paced warm requests' starts.
const PACE: Duration = Duration::from_millis(2);

#[derive(Debug, Clone, Serialize)]
pub struct GuestResult {
    pub guest: String,
    pub bytes: usize,
    /// Validation + compilation at upload (first time; later loads come from the cache).
    pub compile_ms: f64,
    /// Per request, the instance taken from the shelf.
    pub warm: Latency,
    /// The share of those requests that found their instance ready.
    pub warm_share: f64,
    /// Per request, the instance made on the request's path (shelves off).
    pub made: Latency,
    /// The process's CPU time per request, back to back, background instantiation included.
    pub cpu_us_per_request: f64,
    /// The share of the back-to-back 1-task requests that found their instance ready.
    pub back_to_back_warm_share: f64,
    pub per_s_1_task: f64,
    pub per_s_2_tasks: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct ProcessorBenchReport {
    pub requests: usize,
    pub guests: Vec<GuestResult>,
    /// P50 through the gateway without and with the WAT processor, µs.
    pub gateway_plain_p50_us: f64,
    pub gateway_processor_p50_us: f64,
}

impl ProcessorBenchReport {
    pub fn table(&self) -> String {
        let mut s = format!(
            "processor overhead per request: instance + on-request + on-response + drop \
             (up to {} sequential requests per guest and mode, {} ms apart)\n\
             warm: the instance made ahead, taken from the shelf (ready: the share that found one); \
             made: made on the request's path (shelves off)\n\n",
            self.requests,
            PACE.as_millis()
        );
        s += &format!(
            "{:<8} {:<5} {:>9} {:>9} {:>10} {:>9} {:>8} {:>7} {:>6}\n",
            "guest", "mode", "p50 µs", "p99 µs", "instance", "calls", "drop", "faults", "ready"
        );
        for g in &self.guests {
            for (mode, l, ready) in [
                ("warm", &g.warm, format!("{:.0}%", g.warm_share * 100.0)),
                ("made", &g.made, String::new()),
            ] {
                s += &format!(
                    "{:<8} {:<5} {:>9.1} {:>9.1} {:>10.1} {:>9.1} {:>8.1} {:>7} {:>6}\n",
                    g.guest,
                    mode,
                    l.p50_us,
                    l.p99_us,
                    l.instance_p50_us,
                    l.calls_p50_us,
                    l.drop_p50_us,
                    l.calls_faults_p50.map_or("–".to_string(), |f| format!("{f:.0}")),
                    ready
                );
            }
        }
        s += "(instance, calls, drop: the P50 of each part; drop: releasing the instance, its store dropped on the maker thread; \
              faults: the P50 of the minor page faults taken during the calls)\n\n";
        s += "back to back, shelves on (CPU/req: the process's CPU time per request, background instantiation included; \
              ready: the share of 1-task requests that found their instance made)\n";
        s += &format!(
            "{:<8} {:>10} {:>11} {:>11} {:>6} {:>10} {:>11} {:>8}\n",
            "guest", "bytes", "compile ms", "CPU/req µs", "ready", "1 task /s", "2 tasks /s", "scaling"
        );
        for g in &self.guests {
            s += &format!(
                "{:<8} {:>10} {:>11.0} {:>11.0} {:>5.0}% {:>10.0} {:>11.0} {:>7.2}×\n",
                g.guest,
                g.bytes,
                g.compile_ms,
                g.cpu_us_per_request,
                g.back_to_back_warm_share * 100.0,
                g.per_s_1_task,
                g.per_s_2_tasks,
                g.per_s_2_tasks / g.per_s_1_task.max(1e-9)
            );
        }
        s += &format!(
            "\nthrough the gateway (HTTP, instant worker, metered): p50 {:.1} µs without, {:.1} µs with the WAT pre+post processor: +{:.1} µs (target ≤ 50)\n",
            self.gateway_plain_p50_us,
            self.gateway_processor_p50_us,
            self.gateway_processor_p50_us - self.gateway_plain_p50_us
        );
        s
    }
}

use crate::percentile;

fn request() -> Request {
    Request {
        tenant: "bench".into(),
        model: "m".into(),
        endpoint: "/v1/chat/completions".into(),
        body: r#"{"model":"m","messages":[{"role":"user","content":"Say something short about the sea."}]}"#.into(),
        headers: Vec::new(),
    }
}

fn response() -> Response {
    Response {
        tenant: "bench".into(),
        model: "m".into(),
        endpoint: "/v1/chat/completions".into(),
        body: r#"{"choices":[{"index":0,"message":{"role":"assistant","content":"The sea is wide."}}]}"#.into(),
    }
}

/// This thread's minor page faults so far (`getrusage`; None off Linux or on failure).
/// Per thread: the paced requests (the only ones whose faults are kept) run in the CLI's
/// `block_on` future, on one thread throughout.
fn minor_faults() -> Option<u64> {
    #[cfg(target_os = "linux")]
    {
        let mut u = std::mem::MaybeUninit::<libc::rusage>::zeroed();
        // SAFETY: getrusage writes the whole struct on success; zeroed is a valid rusage.
        if unsafe { libc::getrusage(libc::RUSAGE_THREAD, u.as_mut_ptr()) } == 0 {
            // SAFETY: initialised (zeroed, then written by the call).
            return Some(unsafe { u.assume_init() }.ru_minflt as u64);
        }
    }
    None
}

/// One request's processor work: the instance, the two calls, the drop; and the minor page
/// faults taken during the calls.
async fn one(rt: &Runtime, c: &Arc<Compiled>, limits: Limits) -> anyhow::Result<([Duration; 3], Option<u64>)> {
    let t0 = Instant::now();
    let mut i = rt.instantiate(c, "{}", limits).await?;
    let f0 = minor_faults();
    let t1 = Instant::now();
    let a = i.on_request(&request()).await?;
    let b = i.on_response(&response()).await?;
    let t2 = Instant::now();
    let faults = minor_faults().zip(f0).map(|(b, a)| b.saturating_sub(a));
    anyhow::ensure!(
        a == Action::Continue && b == Action::Continue,
        "a trivial guest must continue"
    );
    drop(i);
    Ok(([t1 - t0, t2 - t1, t2.elapsed()], faults))
}

/// This process's user + system CPU time (`/proc/self/stat`, in clock ticks: USER_HZ, 100
/// on Linux).
fn cpu_time() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command's closing parenthesis: state is 3rd; utime, stime 14th, 15th.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    Some(Duration::from_millis(ticks * 10))
}

/// Per-request latencies of one mode, µs.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Latency {
    pub p50_us: f64,
    pub p99_us: f64,
    /// The P50s of the request's parts: getting the instance (taken or made), the two calls,
    /// dropping it.
    pub instance_p50_us: f64,
    pub calls_p50_us: f64,
    pub drop_p50_us: f64,
    /// The P50 of the minor page faults taken during the two calls (the pages a fresh
    /// instance's guest touches that are not resident); None where they cannot be counted.
    pub calls_faults_p50: Option<f64>,
}

/// `requests` sequential requests, each `PACE` after the last one's start.
async fn latencies(rt: &Runtime, c: &Arc<Compiled>, limits: Limits, requests: usize) -> anyhow::Result<Latency> {
    let mut total = Vec::with_capacity(requests);
    let mut parts: [Vec<f64>; 3] = Default::default();
    let mut faults = Vec::with_capacity(requests);
    let mut next = tokio::time::Instant::now();
    for _ in 0..requests {
        tokio::time::sleep_until(next).await;
        next += PACE;
        let t = Instant::now();
        let (ds, f) = one(rt, c, limits).await?;
        total.push(t.elapsed().as_secs_f64() * 1e6);
        faults.extend(f.map(|f| f as f64));
        for (v, d) in parts.iter_mut().zip(ds) {
            v.push(d.as_secs_f64() * 1e6);
        }
    }
    for v in parts.iter_mut().chain([&mut total, &mut faults]) {
        v.sort_by(f64::total_cmp);
    }
    let [i, c, d] = &parts;
    let p50 = |v: &[f64]| percentile(v, 0.5);
    Ok(Latency {
        p50_us: p50(&total),
        p99_us: percentile(&total, 0.99),
        instance_p50_us: p50(i),
        calls_p50_us: p50(c),
        drop_p50_us: p50(d),
        calls_faults_p50: (faults.len() == requests).then(|| p50(&faults)),
    })
}

async fn guest(
    warm: &Arc<Runtime>,
    made: &Runtime,
    name: &str,
    wasm: Vec<u8>,
    requests: usize,
    seconds: f64,
) -> anyhow::Result<GuestResult> {
    let t = Instant::now();
    let bytes = wasm.len();
    let rt2 = warm.clone();
    let wasm = Arc::new(wasm);
    let w2 = wasm.clone();
    let c = tokio::task::spawn_blocking(move || rt2.compile(&w2)).await??;
    let compile_ms = t.elapsed().as_secs_f64() * 1e3;
    // The second runtime loads the first's compiled code from the shared disk cache.
    let c_made = made.compile(&wasm)?;
    let limits = Limits {
        cpu_ms: 1000,
        memory_mib: 256,
        ..Default::default()
    };
    for _ in 0..requests.min(50) {
        one(made, &c_made, limits).await?;
    }
    let made_path = latencies(made, &c_made, limits, requests).await?;
    for _ in 0..requests.min(50) {
        one(warm, &c, limits).await?;
        tokio::time::sleep(PACE).await;
    }
    let before = warm.warm_stats();
    let warm_path = latencies(warm, &c, limits, requests).await?;
    let after = warm.warm_stats();
    let warm_share = (after.warm - before.warm) as f64 / requests.max(1) as f64;
    let mut rates = [0.0; 2];
    let mut cpu_us_per_request = 0.0;
    let mut back_to_back_warm_share = 0.0;
    for (k, tasks) in [1usize, 2].into_iter().enumerate() {
        let deadline = Instant::now() + Duration::from_secs_f64(seconds);
        let started = Instant::now();
        let cpu0 = cpu_time();
        let stats0 = warm.warm_stats();
        let mut hs = Vec::new();
        for _ in 0..tasks {
            let (rt, c) = (warm.clone(), c.clone());
            hs.push(tokio::spawn(async move {
                let mut n = 0usize;
                while Instant::now() < deadline {
                    if one(&rt, &c, limits).await.is_ok() {
                        n += 1;
                    }
                }
                n
            }));
        }
        let mut n = 0;
        for h in hs {
            n += h.await?;
        }
        rates[k] = n as f64 / started.elapsed().as_secs_f64();
        if let (0, Some(a), Some(b)) = (k, cpu0, cpu_time()) {
            cpu_us_per_request = (b - a).as_secs_f64() * 1e6 / n.max(1) as f64;
            back_to_back_warm_share = (warm.warm_stats().warm - stats0.warm) as f64 / n.max(1) as f64;
        }
    }
    Ok(GuestResult {
        guest: name.to_string(),
        bytes,
        compile_ms,
        warm: warm_path,
        warm_share,
        made: made_path,
        cpu_us_per_request,
        back_to_back_warm_share,
        per_s_1_task: rates[0],
        per_s_2_tasks: rates[1],
    })
}

/// Runs the benchmark. `examples`: the directory `sdk/processors/build` wrote (for the JS and
/// Python guests); `model_path`/`model_id`: the tokenizer for the gateway part.
pub async fn run(
    examples: Option<&Path>,
    model_path: &Path,
    model_id: &str,
    requests: usize,
    seconds: f64,
) -> anyhow::Result<ProcessorBenchReport> {
    // A fresh disk cache: the compile column is the cold upload cost; the shelf-less
    // runtime then loads the same compiled code from it.
    let cache = std::env::temp_dir().join(format!("hearth-bench-processors-{}", std::process::id()));
    let warm = Arc::new(Runtime::new(Some(cache.clone()))?);
    let made = Runtime::new(Some(cache.clone()))?.with_warm(0);
    let mut guests = vec![
        guest(
            &warm,
            &made,
            "wat",
            hearth_runtime::wat_guest::trivial(),
            requests,
            seconds,
        )
        .await,
    ];
    if let Some(dir) = examples {
        for (name, file) in [("js", "trivial.wasm"), ("python", "trivial-py.wasm")] {
            let path = dir.join(file);
            match std::fs::read(&path) {
                Ok(wasm) => guests.push(guest(&warm, &made, name, wasm, (requests / 4).max(20), seconds).await),
                Err(e) => tracing::warn!(path = %path.display(), error = %e, "guest not built; skipped"),
            }
        }
    }
    let _ = std::fs::remove_dir_all(&cache);
    let guests = guests.into_iter().collect::<anyhow::Result<Vec<_>>>()?;
    let (plain, with) = crate::gateway::processor_overhead(model_path, model_id, requests).await?;
    Ok(ProcessorBenchReport {
        requests,
        guests,
        gateway_plain_p50_us: plain,
        gateway_processor_p50_us: with,
    })
}

//! `hearth bench fairness`: one saturated worker shared by tenants, FIFO against fair
//! scheduling, in one run.
//!
//! **Sim** (the engine's real scheduler and KV cache, the model's time from the sim's cost
//! model, virtual time): requests of ~450 prompt tokens and 32 output tokens (the issue's
//! shape) on one worker whose KV cache holds about 32 of them. Mixed steps are timed as the
//! longer of their prefill and decode parts (`--step-cost overlap`, as one batched GPU pass)
//! or their sum (`--step-cost sum`, the earlier figures' model); an arrival cuts the step in
//! progress when the engine would ([`SimWorker::step_before`]).
//! - `flood`: a steady tenant at a low rate plus a flooder at `flood`× its rate: the steady
//!   tenant's TTFT against its solo run, FIFO, fair, and fair with the queue limit
//!   (admission control as the gateway applies it: [`QueueState::admit`]);
//! - `shares`: two tenants with shares 3 and 1, both backlogged: the split of the weighted
//!   service while both are backlogged, against 75/25;
//! - `classes`: an interactive tenant at the steady rate plus a batch tenant saturating the
//!   worker: the interactive TTFT against its solo run.
//!
//! **Engine** (unless `--sim-only`): the same steady-plus-flooder shape on the real engine,
//! small (short prompts, a KV cache that holds a few requests), FIFO against fair, with
//! `--engine-requests` steady requests solo and fair (200: a stable P90), the two modes
//! alternating in blocks on fresh engines. The steady rate keeps the engine busy a set share
//! of the time (`--engine-steady-load`, from a request's time alone, measured first), so the
//! steady tenant is as light on a slow CPU as on a fast one; the report splits its
//! first-token time into the step in progress, the queue and the prefill.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use hearth_engine::step::scheduler::{FairWeights, Policy, SchedulerConfig, Served};
use hearth_engine::worker::sim::{CostModel, MixedStep, SimWorker};
use hearth_protocol::{namespace_root, GenerateEvent, GenerateRequest, Priority, Qos, QueueState, SamplingParams};
use serde::Serialize;

use crate::routing::percentile;
use crate::Rng;

#[derive(Debug, Clone)]
pub struct FairnessConfig {
    /// Seconds of arrivals (virtual) per sim run.
    pub sim_seconds: f64,
    /// The steady tenant's rate, requests per second.
    pub steady_rps: f64,
    /// How many times the steady rate the flooder sends.
    pub flood: f64,
    pub seed: u64,
    /// How the sim times a step that both prefills and decodes.
    pub mixed: MixedStep,
    /// The real-engine run.
    pub engine: Option<EngineRun>,
}

#[derive(Debug, Clone)]
pub struct EngineRun {
    pub model: std::path::PathBuf,
    pub model_id: String,
    pub threads: usize,
    /// The steady tenant's requests in the solo and fair modes (FIFO, the comparison, runs a
    /// quarter of them).
    pub requests: usize,
    /// Its rate (Poisson arrivals), requests per second; `None`: from `steady_load`.
    pub steady_rps: Option<f64>,
    /// The share of the engine's time the steady tenant's requests would take on their own,
    /// one at a time (each request's time alone × the rate): what sets the rate unless
    /// `steady_rps` is given. A steady tenant is one well inside its fair share (half the
    /// engine beside one flooder); a fixed rate is that on one CPU and past it on a slower one.
    pub steady_load: f64,
}

/// One tenant's outcome in one run.
#[derive(Debug, Clone, Serialize)]
pub struct TenantResult {
    pub tenant: String,
    pub priority: String,
    pub share: u32,
    pub requests: usize,
    pub completed: usize,
    /// Refused by the queue limit.
    pub shed: usize,
    pub ttft_p50_ms: f64,
    pub ttft_p90_ms: f64,
    pub ttft_p99_ms: f64,
    /// Output tokens per second over the arrival window (engine runs: over the blocks, the
    /// flooder's lead-in and drain included).
    pub output_tok_s: f64,
    /// Its share of the worker's weighted service (prefill + 2 × decode tokens): the sim's
    /// over the arrival window, the engine's over the requests that ended while the steady
    /// tenant was sending or had requests in flight.
    pub service_share: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct RunResult {
    pub backend: String,
    pub scenario: String,
    pub policy: String,
    pub queue_limit: bool,
    pub tenants: Vec<TenantResult>,
    /// Steps cut short between layers for an arriving request.
    pub steps_cut: u64,
    /// Engine runs: where the steady tenant's first-token time went, for its requests up to
    /// its P90 and above it.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub steady_ttft_parts: Vec<TtftParts>,
}

/// Means over a group of one tenant's engine requests: their TTFT split into the wait for the
/// engine to take the request (the step in progress, unless an arrival cuts it), the queue
/// (taken → first scheduled) and the prefill (first scheduled → first token, including
/// preemptions and the steps it shared).
#[derive(Debug, Clone, Serialize)]
pub struct TtftParts {
    /// `to_p90` or `above_p90`.
    pub group: String,
    pub requests: usize,
    pub ttft_ms: f64,
    pub before_engine_ms: f64,
    pub queue_ms: f64,
    pub prefill_ms: f64,
    /// The tenant's own requests still in flight when each was sent.
    pub own_in_flight: f64,
}

impl TtftParts {
    fn of(group: &str, samples: &[&Sample]) -> Self {
        let n = samples.len().max(1) as f64;
        let mean = |f: &dyn Fn(&Sample) -> f64| samples.iter().map(|s| f(s)).sum::<f64>() / n;
        TtftParts {
            group: group.into(),
            requests: samples.len(),
            ttft_ms: mean(&|s| s.ttft_ms),
            before_engine_ms: mean(&|s| (s.ttft_ms - s.queue_ms - s.prefill_ms).max(0.0)),
            queue_ms: mean(&|s| s.queue_ms),
            prefill_ms: mean(&|s| s.prefill_ms),
            own_in_flight: mean(&|s| s.in_flight as f64),
        }
    }

    /// The groups up to and above the `p90` TTFT.
    fn split(samples: &[Sample], p90: f64) -> Vec<TtftParts> {
        let (low, high): (Vec<&Sample>, Vec<&Sample>) = samples.iter().partition(|s| s.ttft_ms <= p90);
        vec![Self::of("to_p90", &low), Self::of("above_p90", &high)]
    }
}

/// Engine solo and fair runs alternate in this many blocks each.
const ROUNDS: usize = 4;

/// How long the engine is left idle before each calibration request.
const CALIBRATION_IDLE: Duration = Duration::from_millis(500);

/// The steady tenant's requests in each solo and fair block (at least 5), and under FIFO (a
/// quarter of `--engine-requests`, at least 5).
fn engine_requests(e: &EngineRun) -> (usize, usize) {
    (e.requests.div_ceil(ROUNDS).max(5), (e.requests / 4).max(5))
}

/// One finished engine request.
#[derive(Debug, Clone)]
struct Sample {
    ttft_ms: f64,
    /// Send to the last event.
    total_ms: f64,
    /// The last event.
    finished: Instant,
    tokens: u64,
    queue_ms: f64,
    prefill_ms: f64,
    in_flight: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct FairnessReport {
    pub isa: String,
    pub cpu: String,
    pub workload: String,
    /// How the sim timed mixed steps (`overlap` or `sum`).
    pub sim_mixed_step: String,
    /// The flooder's rate ÷ the steady tenant's.
    pub flood: f64,
    pub runs: Vec<RunResult>,
    /// Steady tenant's P90 TTFT with the flooder ÷ solo: fair (target ≤ 1.5), FIFO beside.
    pub sim_steady_p90_vs_solo_fair: f64,
    pub sim_steady_p90_vs_solo_fifo: f64,
    pub sim_steady_p90_vs_solo_fair_limited: f64,
    /// Shares 3:1, both backlogged: the first tenant's service share (target 0.75 ± 10%).
    pub sim_share_split_fair: f64,
    pub sim_share_split_fifo: f64,
    /// Interactive P90 TTFT beside a saturating batch class ÷ solo (target ≤ 1.2).
    pub sim_interactive_p90_vs_solo_fair: f64,
    pub sim_interactive_p90_vs_solo_fifo: f64,
    pub engine_steady_p90_vs_solo_fair: Option<f64>,
    pub engine_steady_p90_vs_solo_fifo: Option<f64>,
    /// One steady request alone on the engine, send to last token (the calibration's median).
    pub engine_request_alone_ms: Option<f64>,
    /// The steady tenant's rate on the engine, requests per second.
    pub engine_steady_rps: Option<f64>,
    /// The share of the engine's time it takes: the rate × a request's time alone.
    pub engine_steady_load: Option<f64>,
    /// The same from the solo run: the rate × the median time of its requests sent while
    /// none of the tenant's others was in flight (a shared machine's speed varies).
    pub engine_steady_load_solo: Option<f64>,
}

impl FairnessReport {
    pub fn table(&self) -> String {
        let mut out = format!(
            "Fairness on one saturated worker (ISA {}; {})\n{}\n\n",
            self.isa, self.cpu, self.workload
        );
        out += "| backend | scenario | policy | queue limit | tenant | class | share | requests | completed | shed | TTFT P50/P90/P99 ms | output tok/s | service share | steps cut |\n";
        out += "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
        for r in &self.runs {
            for t in &r.tenants {
                out += &format!(
                    "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.0}/{:.0}/{:.0} | {:.1} | {:.3} | {} |\n",
                    r.backend,
                    r.scenario,
                    r.policy,
                    if r.queue_limit { "yes" } else { "no" },
                    t.tenant,
                    t.priority,
                    t.share,
                    t.requests,
                    t.completed,
                    t.shed,
                    t.ttft_p50_ms,
                    t.ttft_p90_ms,
                    t.ttft_p99_ms,
                    t.output_tok_s,
                    t.service_share,
                    r.steps_cut
                );
            }
        }
        let parts: Vec<(&RunResult, &TtftParts)> = self
            .runs
            .iter()
            .flat_map(|r| r.steady_ttft_parts.iter().map(move |p| (r, p)))
            .collect();
        if !parts.is_empty() {
            out += "\nEngine, the steady tenant's TTFT by part (means, ms): waiting for the engine to take it (the step in progress), queued, prefilling\n\n";
            out += "| scenario | policy | requests | group | TTFT | before the engine | queued | prefill | own in flight at send |\n";
            out += "|---|---|---|---|---|---|---|---|---|\n";
            for (r, p) in parts {
                out += &format!(
                    "| {} | {} | {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2} |\n",
                    r.scenario,
                    r.policy,
                    p.requests,
                    p.group.replace('_', " "),
                    p.ttft_ms,
                    p.before_engine_ms,
                    p.queue_ms,
                    p.prefill_ms,
                    p.own_in_flight
                );
            }
        }
        let engine = match (self.engine_steady_p90_vs_solo_fair, self.engine_steady_p90_vs_solo_fifo) {
            (Some(fair), Some(fifo)) => format!("; engine: fair {fair:.2}×, FIFO {fifo:.2}×"),
            _ => String::new(),
        };
        out += &format!(
            "\nSteady tenant P90 TTFT beside a {:.0}× flooder ÷ solo: sim fair {:.2}× (with the queue limit {:.2}×), FIFO {:.2}×{engine} (target ≤ 1.5×)\n\
             Service split with shares 3:1, both backlogged: fair {:.3}, FIFO {:.3} (target 0.75 ± 0.075)\n\
             Interactive P90 TTFT beside a saturating batch class ÷ solo: fair {:.2}×, FIFO {:.2}× (target ≤ 1.2×)\n",
            self.flood,
            self.sim_steady_p90_vs_solo_fair,
            self.sim_steady_p90_vs_solo_fair_limited,
            self.sim_steady_p90_vs_solo_fifo,
            self.sim_share_split_fair,
            self.sim_share_split_fifo,
            self.sim_interactive_p90_vs_solo_fair,
            self.sim_interactive_p90_vs_solo_fifo,
        );
        out
    }
}

/// A tenant's traffic in a sim run.
#[derive(Debug, Clone)]
struct Traffic {
    qos: Qos,
    rps: f64,
}

/// The sim's pool: the default cost model with a cache for about 32 requests of the
/// workload, 512-token steps (chunked prefill's usual size: a step's time grows with its
/// tokens, so this is how long an arrival can wait for the step in progress).
fn sim_pool(policy: Policy, mixed: MixedStep) -> SimWorker {
    SimWorker::with_scheduler(
        CostModel {
            kv_tokens: 16_384,
            mixed,
            ..CostModel::default()
        },
        SchedulerConfig {
            max_batch_tokens: 512,
            max_running: 256,
            policy,
            ..SchedulerConfig::default()
        },
    )
}

const PROMPT: (usize, usize) = (400, 500);
const OUTPUT: usize = 32;

/// Runs tenants' Poisson traffic for `seconds` (virtual) on one sim worker, then drains it.
fn sim_run(scenario: &str, policy: Policy, limit: bool, traffic: &[Traffic], cfg: &FairnessConfig) -> RunResult {
    let (seconds, seed) = (cfg.sim_seconds, cfg.seed);
    let mut rng = Rng(seed | 1);
    // (arrival, tenant index, prompt length)
    let mut arrivals: Vec<(f64, usize, usize)> = Vec::new();
    for (i, t) in traffic.iter().enumerate() {
        let mut at = rng.gap(t.rps);
        while at < seconds {
            let len = PROMPT.0 + (rng.next() as usize) % (PROMPT.1 - PROMPT.0);
            arrivals.push((at, i, len));
            at += rng.gap(t.rps);
        }
    }
    arrivals.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut w = sim_pool(policy, cfg.mixed);
    let root = namespace_root("sim", "");
    let n = traffic.len();
    let mut ttft: Vec<Vec<f64>> = vec![Vec::new(); n];
    let (mut requests, mut completed, mut shed, mut tokens) = (vec![0; n], vec![0; n], vec![0; n], vec![0u64; n]);
    let mut owner: HashMap<u64, (usize, f64)> = HashMap::new();
    let mut window_service: Vec<f64> = vec![0.0; n];
    let mut t = 0.0;
    let mut next = 0usize;
    let mut id = 0u64;
    let limit_tokens = w.scheduler().capacity_tokens() as u64;
    let mut steps_cut = 0u64;
    loop {
        while next < arrivals.len() && arrivals[next].0 <= t {
            let (at, i, len) = arrivals[next];
            next += 1;
            requests[i] += 1;
            let q = &traffic[i].qos;
            if limit {
                let state: QueueState = w.scheduler().queue_state(&q.tenant, limit_tokens);
                if state.admit(q.priority, len as u64).is_err() {
                    shed[i] += 1;
                    continue;
                }
            }
            // Distinct random tokens: no prefix sharing between requests.
            let prompt = (0..len).map(|_| 17 + (rng.next() % 40_000) as u32).collect();
            w.submit_for(id, prompt, root, OUTPUT, q);
            owner.insert(id, (i, at));
            id += 1;
        }
        if w.is_idle() {
            match arrivals.get(next) {
                Some(a) => {
                    t = a.0;
                    continue;
                }
                None => break,
            }
        }
        let before: Vec<f64> = traffic
            .iter()
            .map(|tr| {
                w.scheduler()
                    .account(&tr.qos.tenant)
                    .map_or(0.0, |a| weighted(a.served))
            })
            .collect();
        // The next arrival may cut the step short, as on the engine.
        let upcoming = arrivals.get(next).map(|a| (a.0 - t, &traffic[a.1].qos));
        let Some(step) = w.step_before(upcoming) else { break };
        t += step.seconds;
        if step.cut {
            steps_cut += 1;
            continue;
        }
        if t <= seconds {
            for (i, tr) in traffic.iter().enumerate() {
                let after = w
                    .scheduler()
                    .account(&tr.qos.tenant)
                    .map_or(0.0, |a| weighted(a.served));
                window_service[i] += after - before[i];
            }
        }
        for (sid, _) in &step.first_tokens {
            if let Some(&(i, at)) = owner.get(sid) {
                ttft[i].push((t - at) * 1000.0);
            }
        }
        for sid in &step.sampled {
            if let Some(&(i, _)) = owner.get(sid) {
                if t <= seconds {
                    tokens[i] += 1;
                }
            }
        }
        for sid in &step.finished {
            if let Some((i, _)) = owner.remove(sid) {
                completed[i] += 1;
            }
        }
    }
    let total: f64 = window_service.iter().sum::<f64>().max(1e-9);
    let tenants = traffic
        .iter()
        .enumerate()
        .map(|(i, tr)| TenantResult {
            tenant: tr.qos.tenant.clone(),
            priority: tr.qos.priority.as_str().into(),
            share: tr.qos.share,
            requests: requests[i],
            completed: completed[i],
            shed: shed[i],
            ttft_p50_ms: percentile(&mut ttft[i], 0.5),
            ttft_p90_ms: percentile(&mut ttft[i], 0.9),
            ttft_p99_ms: percentile(&mut ttft[i], 0.99),
            output_tok_s: tokens[i] as f64 / seconds,
            service_share: window_service[i] / total,
        })
        .collect();
    RunResult {
        backend: "sim".into(),
        scenario: scenario.into(),
        policy: policy.as_str().into(),
        queue_limit: limit,
        tenants,
        steps_cut,
        steady_ttft_parts: Vec::new(),
    }
}

/// Tokens served, weighted as the scheduler charges them (both backends run its default
/// weights).
fn weighted(s: Served) -> f64 {
    let w = FairWeights::default();
    s.prefill as f64 * w.prefill + s.decode as f64 * w.decode + s.cached as f64 * w.cached
}

fn qos(tenant: &str, priority: Priority, share: u32) -> Qos {
    Qos {
        tenant: tenant.into(),
        priority,
        share,
    }
}

pub async fn run(cfg: FairnessConfig) -> anyhow::Result<FairnessReport> {
    let sim_cfg = cfg.clone();
    let mut runs = tokio::task::spawn_blocking(move || sim_runs(&sim_cfg)).await?;
    let (mut engine_fair, mut engine_fifo, mut alone, mut rate, mut solo_load) = (None, None, None, None, None);
    let mut engine_desc = "not run".to_string();
    if let Some(e) = &cfg.engine {
        let t = request_alone(e, &cfg).await?;
        let rps = e.steady_rps.unwrap_or(e.steady_load / t);
        tracing::info!(
            request_alone_ms = t * 1000.0,
            rps,
            load = rps * t,
            "the steady tenant's rate"
        );
        (alone, rate) = (Some(t), Some(rps));
        // Solo and fair in alternating blocks, so that both see the same spells of a shared
        // machine's speed; FIFO, the comparison, once.
        let (per, fifo_requests) = engine_requests(e);
        // Each block's arrivals from a well-mixed seed (a small xorshift seed draws a first
        // gap of zero: a burst at every block's start).
        let gaps = |r: usize| mix(cfg.seed.wrapping_add(7), r as u64);
        let arrivals = |requests: usize, r: usize| Arrivals {
            rps,
            requests,
            first: (r * per) as u64,
            gaps_seed: gaps(r),
        };
        let fifo = engine_block(e, arrivals(fifo_requests, 0), Policy::Fifo, true, &cfg).await?;
        let (mut solo, mut fair) = (Vec::new(), Vec::new());
        for r in 0..ROUNDS {
            solo.push(engine_block(e, arrivals(per, r), Policy::Fair, false, &cfg).await?);
            fair.push(engine_block(e, arrivals(per, r), Policy::Fair, true, &cfg).await?);
        }
        // The share of the engine the steady tenant took alone: its rate × the median time
        // of its solo requests sent while none of its others was in flight (the measure of
        // the calibration, on requests that arrive to an idle engine).
        let mut lone: Vec<f64> = (solo.iter().flat_map(|b| &b.steady))
            .filter(|s| s.in_flight == 0)
            .map(|s| s.total_ms / 1000.0)
            .collect();
        solo_load = (!lone.is_empty()).then(|| rps * percentile(&mut lone, 0.5));
        engine_desc = format!(
            "{} steady requests solo and fair (alternating, {ROUNDS} blocks each), {fifo_requests} FIFO; Poisson, {rps:.2} req/s: {:.0} % of the engine's time (a request alone took {:.0} ms; {} by the solo run's), {} threads; see the engine rows",
            per * ROUNDS,
            100.0 * rps * t,
            1000.0 * t,
            solo_load.map_or_else(|| "no lone request".to_string(), |l| format!("{:.0} %", 100.0 * l)),
            e.threads
        );
        let (solo, fifo, fair) = (
            engine_result(Policy::Fair, false, &solo),
            engine_result(Policy::Fifo, true, std::slice::from_ref(&fifo)),
            engine_result(Policy::Fair, true, &fair),
        );
        let p90 = |r: &RunResult| r.tenants[0].ttft_p90_ms;
        engine_fifo = Some(p90(&fifo) / p90(&solo).max(1e-9));
        engine_fair = Some(p90(&fair) / p90(&solo).max(1e-9));
        runs.extend([solo, fifo, fair]);
    }
    let find = |scenario: &str, policy: &str, limit: bool| {
        runs.iter()
            .find(|r| r.backend == "sim" && r.scenario == scenario && r.policy == policy && r.queue_limit == limit)
            .map(|r| r.tenants[0].clone())
    };
    let solo = find("solo", "fair", false).map_or(1.0, |t| t.ttft_p90_ms).max(1e-9);
    let ratio =
        |scenario: &str, policy: &str, limit: bool| find(scenario, policy, limit).map_or(0.0, |t| t.ttft_p90_ms / solo);
    let split = |policy: &str| find("shares", policy, false).map_or(0.0, |t| t.service_share);
    Ok(FairnessReport {
        isa: hearth_engine::kernels::isa().name().to_string(),
        cpu: hearth_engine::kernels::cpu_features(),
        sim_mixed_step: cfg.mixed.as_str().into(),
        workload: format!(
            "sim: one worker (the sim's default cost model, mixed steps timed as the {} of prefill and decode, 16,384 KV tokens, 512-token steps), prompts {}-{} tokens, {OUTPUT} out, {:.0} s of Poisson arrivals; steady tenant {:.1} req/s, flooder {:.0}× that; engine: {}",
            cfg.mixed.as_str(),
            PROMPT.0,
            PROMPT.1,
            cfg.sim_seconds,
            cfg.steady_rps,
            cfg.flood,
            engine_desc
        ),
        flood: cfg.flood,
        sim_steady_p90_vs_solo_fair: ratio("flood", "fair", false),
        sim_steady_p90_vs_solo_fifo: ratio("flood", "fifo", false),
        sim_steady_p90_vs_solo_fair_limited: ratio("flood", "fair", true),
        sim_share_split_fair: split("fair"),
        sim_share_split_fifo: split("fifo"),
        sim_interactive_p90_vs_solo_fair: ratio("classes", "fair", false),
        sim_interactive_p90_vs_solo_fifo: ratio("classes", "fifo", false),
        engine_steady_p90_vs_solo_fair: engine_fair,
        engine_steady_p90_vs_solo_fifo: engine_fifo,
        engine_request_alone_ms: alone.map(|t| t * 1000.0),
        engine_steady_rps: rate,
        engine_steady_load: rate.zip(alone).map(|(r, t)| r * t),
        engine_steady_load_solo: solo_load,
        runs,
    })
}

fn sim_runs(cfg: &FairnessConfig) -> Vec<RunResult> {
    let steady = Traffic {
        qos: qos("steady", Priority::Interactive, 1),
        rps: cfg.steady_rps,
    };
    let flooder = Traffic {
        qos: qos("flooder", Priority::Interactive, 1),
        rps: cfg.steady_rps * cfg.flood,
    };
    let mut runs = vec![sim_run("solo", Policy::Fair, false, std::slice::from_ref(&steady), cfg)];
    for (policy, limit) in [(Policy::Fifo, false), (Policy::Fair, false), (Policy::Fair, true)] {
        runs.push(sim_run("flood", policy, limit, &[steady.clone(), flooder.clone()], cfg));
    }
    // Both far past the worker's capacity: backlogged throughout.
    let heavy = cfg.steady_rps * cfg.flood;
    let shares = [
        Traffic {
            qos: qos("gold", Priority::Interactive, 3),
            rps: heavy,
        },
        Traffic {
            qos: qos("bronze", Priority::Interactive, 1),
            rps: heavy,
        },
    ];
    for policy in [Policy::Fifo, Policy::Fair] {
        runs.push(sim_run("shares", policy, false, &shares, cfg));
    }
    let classes = [
        steady.clone(),
        Traffic {
            qos: qos("batch", Priority::Batch, 1),
            rps: heavy,
        },
    ];
    for policy in [Policy::Fifo, Policy::Fair] {
        runs.push(sim_run("classes", policy, false, &classes, cfg));
    }
    runs
}

/// A well-spread seed for stream `i` of `seed` (consecutive small seeds give the xorshift
/// generator correlated first draws; a small one draws a first gap of zero).
fn mix(seed: u64, i: u64) -> u64 {
    seed ^ (i + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// An engine request's prompt tokens.
const ENGINE_PROMPT: u64 = 96;

/// One engine request: [`ENGINE_PROMPT`] pseudo-random ordinary tokens, distinct per n (and
/// tenants' cache namespaces differ), so no prefix is shared; 16 greedy tokens.
fn engine_request(seed: u64, model_id: &str, vocab: u32, tenant: &str, n: u64) -> GenerateRequest {
    let mut rng = Rng(mix(seed, n) | 1);
    GenerateRequest {
        request_id: format!("{tenant}-{n}"),
        model: model_id.to_string(),
        prompt: (0..ENGINE_PROMPT)
            .map(|_| 300 + (rng.next() % u64::from(vocab - 400)) as u32)
            .collect(),
        sampling: SamplingParams {
            max_tokens: 16,
            temperature: 0.0,
            ignore_eos: true,
            ..Default::default()
        },
        cache_namespace: tenant.into(),
        n: 1,
        prefill_only: false,
        resume: Vec::new(),
        kv_source: None,
        qos: qos(tenant, Priority::Interactive, 1),
        constraint: None,
        adapter: None,
    }
}

/// The engine of the engine runs: short prompts on a KV cache for a few requests.
fn fresh_engine(e: &EngineRun, policy: Policy) -> anyhow::Result<hearth_engine::EngineHandle> {
    let ecfg = hearth_engine::EngineConfig {
        threads: e.threads,
        kv_cache_mib: Some(8),
        max_batch_tokens: 128,
        max_running: 8,
        policy,
        max_queue_tokens: Some(0),
        ..Default::default()
    };
    Ok(hearth_engine::EngineHandle::load(&e.model, &e.model_id, &ecfg)?)
}

/// One request, sent while `in_flight` others of its tenant were (None if it failed).
async fn one(engine: hearth_engine::EngineHandle, req: GenerateRequest, in_flight: usize) -> Option<Sample> {
    let sent = Instant::now();
    let mut rx = engine.generate(req);
    let (mut first, mut tokens) = (None, 0u64);
    while let Some(ev) = rx.recv().await {
        match ev {
            GenerateEvent::Token { .. } => {
                tokens += 1;
                first.get_or_insert(sent.elapsed().as_secs_f64() * 1000.0);
            }
            GenerateEvent::Done { timings, .. } => {
                let finished = Instant::now();
                return first.map(|ttft_ms| Sample {
                    ttft_ms,
                    total_ms: (finished - sent).as_secs_f64() * 1000.0,
                    finished,
                    tokens,
                    queue_ms: timings.queue_us as f64 / 1000.0,
                    prefill_ms: timings.prefill_us as f64 / 1000.0,
                    in_flight,
                });
            }
            GenerateEvent::Error { .. } => return None,
            GenerateEvent::Finish { .. } => {}
        }
    }
    None
}

/// One request sent while nothing else is on the engine (the calibration's, a block's
/// warm-up); its failure fails the run.
async fn sole(engine: &hearth_engine::EngineHandle, req: GenerateRequest) -> anyhow::Result<Sample> {
    let id = req.request_id.clone();
    (one(engine.clone(), req, 0).await).ok_or_else(|| anyhow::anyhow!("request {id} alone on the engine failed"))
}

/// A steady request's time alone on the engine, send to last token, in seconds: the median
/// of twelve sent one at a time, after two that warm it up. Each is sent after the engine
/// has been idle for [`CALIBRATION_IDLE`], as the steady tenant's requests arrive at a
/// quarter of the engine: back to back they read faster than the solo run's lone requests,
/// so the load came out above the one aimed at (the book's fairness benchmark page has
/// the figures).
async fn request_alone(e: &EngineRun, cfg: &FairnessConfig) -> anyhow::Result<f64> {
    let engine = fresh_engine(e, Policy::Fair)?;
    let vocab = engine.info().tokenizer.tokens.len() as u32;
    let mut times = Vec::new();
    for n in 0..14u64 {
        tokio::time::sleep(CALIBRATION_IDLE).await;
        let s = sole(&engine, engine_request(cfg.seed, &e.model_id, vocab, "alone", n)).await?;
        if n >= 2 {
            times.push(s.total_ms / 1000.0);
        }
    }
    Ok(percentile(&mut times, 0.5))
}

/// What one engine block measured.
struct Block {
    steady: Vec<Sample>,
    flooder: Vec<Sample>,
    /// The steady tenant's first send to its last request's end: the service shares are
    /// counted over the requests that end in it (the flooder runs alone before and after).
    steady_span: (Instant, Instant),
    seconds: f64,
    steps_cut: u64,
}

/// A block's steady tenant: `requests` Poisson arrivals at `rps`, numbered from `first`,
/// their gaps drawn from `gaps_seed`.
struct Arrivals {
    rps: f64,
    requests: usize,
    first: u64,
    gaps_seed: u64,
}

/// One block on a fresh engine: the steady tenant's `arrivals` and, with `flood`, a flooder
/// keeping eight requests in flight until the steady tenant is done.
async fn engine_block(
    e: &EngineRun,
    arrivals: Arrivals,
    policy: Policy,
    flood: bool,
    cfg: &FairnessConfig,
) -> anyhow::Result<Block> {
    let Arrivals {
        rps,
        requests,
        first,
        gaps_seed,
    } = arrivals;
    let engine = fresh_engine(e, policy)?;
    let vocab = engine.info().tokenizer.tokens.len() as u32;
    // A fresh engine's first requests are slow: two, one at a time, before either tenant
    // (as the calibration's), so that a solo block does not open on a cold engine while a
    // fair one opens on an engine the flooder has warmed.
    for n in 0..2 {
        sole(&engine, engine_request(cfg.seed, &e.model_id, vocab, "warm-up", n)).await?;
    }
    tokio::time::sleep(CALIBRATION_IDLE).await;
    let started = Instant::now();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (seed, model_id) = (cfg.seed, e.model_id.clone());
    let request = move |tenant: &str, n: u64| engine_request(seed, &model_id, vocab, tenant, n);
    let mut flooders = Vec::new();
    if flood {
        for c in 0..8u64 {
            let (engine, done, request) = (engine.clone(), done.clone(), request.clone());
            flooders.push(tokio::spawn(async move {
                let mut out = Vec::new();
                for k in 0.. {
                    if done.load(std::sync::atomic::Ordering::Relaxed) {
                        break;
                    }
                    // Numbered by block too, so each block's flooder sends other prompts.
                    let n = (first * 8 + c) * 1_000_000 + k;
                    out.extend(one(engine.clone(), request("flooder", n), 0).await);
                }
                out
            }));
        }
        // The flooder is saturating the engine before the first steady request.
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    let mut gaps = Rng(gaps_seed | 1);
    let mut steady = Vec::new();
    let in_flight = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let steady_start = Instant::now();
    for k in first..first + requests as u64 {
        let (engine, req, in_flight) = (engine.clone(), request("steady", k), in_flight.clone());
        // Counted here, at send: a task may start after the next one is sent.
        let before = in_flight.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        steady.push(tokio::spawn(async move {
            let sample = one(engine, req, before).await;
            in_flight.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
            sample
        }));
        tokio::time::sleep(Duration::from_secs_f64(gaps.gap(rps))).await;
    }
    let mut samples = Vec::new();
    for h in steady {
        samples.extend(h.await?);
    }
    let steady_end = samples.iter().map(|x| x.finished).max().unwrap_or(steady_start);
    let mut block = Block {
        steady: samples,
        flooder: Vec::new(),
        steady_span: (steady_start, steady_end),
        seconds: 0.0,
        steps_cut: 0,
    };
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    for h in flooders {
        block.flooder.extend(h.await?);
    }
    block.seconds = started.elapsed().as_secs_f64();
    block.steps_cut = engine.metrics().steps_cut.get();
    Ok(block)
}

/// An engine mode's result from its blocks.
fn engine_result(policy: Policy, flood: bool, blocks: &[Block]) -> RunResult {
    let seconds: f64 = blocks.iter().map(|b| b.seconds).sum::<f64>().max(1e-9);
    let steady: Vec<Sample> = blocks.iter().flat_map(|b| b.steady.iter().cloned()).collect();
    let flooder: Vec<Sample> = blocks.iter().flat_map(|b| b.flooder.iter().cloned()).collect();
    // Each tenant's service over the requests that ended within the steady tenant's span, as
    // the scheduler charges a finished request: its prompt, then a decode step for each
    // token after the first (the prefill gives the first).
    let service = |tenant: fn(&Block) -> &[Sample]| -> f64 {
        let ended_in_span = |b: &Block, x: &Sample| (b.steady_span.0..=b.steady_span.1).contains(&x.finished);
        blocks
            .iter()
            .flat_map(|b| tenant(b).iter().filter(move |x| ended_in_span(b, x)))
            .map(|x| {
                weighted(Served {
                    prefill: ENGINE_PROMPT,
                    decode: x.tokens.saturating_sub(1),
                    cached: 0,
                })
            })
            .sum()
    };
    let [steady_served, flooder_served] = [service(|b| &b.steady), service(|b| &b.flooder)];
    let total = (steady_served + flooder_served).max(1e-9);
    let mut steady_ttft: Vec<f64> = steady.iter().map(|x| x.ttft_ms).collect();
    let steady_ttft_parts = TtftParts::split(&steady, percentile(&mut steady_ttft, 0.9));
    let tenants = [("steady", steady, steady_served), ("flooder", flooder, flooder_served)]
        .into_iter()
        .filter(|(name, r, _)| *name == "steady" || !r.is_empty())
        .map(|(name, r, served)| {
            let mut ttft: Vec<f64> = r.iter().map(|x| x.ttft_ms).collect();
            TenantResult {
                tenant: name.into(),
                priority: "interactive".into(),
                share: 1,
                requests: r.len(),
                completed: r.len(),
                shed: 0,
                ttft_p50_ms: percentile(&mut ttft, 0.5),
                ttft_p90_ms: percentile(&mut ttft, 0.9),
                ttft_p99_ms: percentile(&mut ttft, 0.99),
                output_tok_s: r.iter().map(|x| x.tokens).sum::<u64>() as f64 / seconds,
                service_share: served / total,
            }
        })
        .collect();
    RunResult {
        backend: "engine".into(),
        scenario: if flood { "flood" } else { "solo" }.into(),
        policy: policy.as_str().into(),
        queue_limit: false,
        tenants,
        steps_cut: blocks.iter().map(|b| b.steps_cut).sum(),
        steady_ttft_parts,
    }
}

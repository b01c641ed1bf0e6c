//! `hearth bench routing`: routing policies compared on simulated workers, in virtual time.
//!
//! N `sim` workers (the real scheduler and prefix cache with a cost model; see
//! `hearth_engine::worker::sim`) serve a seeded workload; their KV events feed the real router's
//! index, exactly as live workers' `/v1/worker/events` do. Every policy sees the same
//! request stream. Workloads:
//! * `long_prefix` — SageMaker's setup: groups of 8,000-token shared prefixes with short
//!   distinct suffixes, Poisson arrivals;
//! * `conversations` — multi-turn chats of varying lengths; each turn resends the history
//!   and arrives a think-time after the previous answer.
//!
//! Also a router micro-benchmark: decision time with 64 workers and 1M indexed blocks, and
//! KV-event ingestion rate.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::time::Instant;

use hearth_engine::step::sampling::Rng;
use hearth_engine::worker::sim::{generated_token, CostModel, SimStep, SimWorker};
use hearth_protocol::{block_hashes, namespace_root, BlockHash, Tier};
use hearth_router::{Policy, RouteInput, Router, RouterConfig};
use serde::Serialize;

const MODEL: &str = "sim-70b";

#[derive(Debug, Clone, Copy)]
pub struct RoutingBenchConfig {
    pub workers: usize,
    pub quick: bool,
    pub seed: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct PolicyResult {
    pub workload: String,
    pub policy: String,
    pub requests: usize,
    pub kv_hit_rate: f64,
    pub ttft_p50_ms: f64,
    pub ttft_p90_ms: f64,
    pub throughput_req_s: f64,
    pub output_tok_s: f64,
    pub share_min: f64,
    pub share_max: f64,
    pub share: Vec<f64>,
    pub route_p50_us: f64,
    pub route_p99_us: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct MicroResult {
    pub workers: usize,
    pub indexed_blocks: usize,
    pub request_blocks: usize,
    pub decision_p50_us: f64,
    pub decision_p99_us: f64,
    pub ingest_blocks_per_s: f64,
    /// The same, with every chain also on 1–3 other workers' disk tiers (the index then
    /// matches the pool and the pool-or-disk separately).
    pub tiers_disk_blocks: usize,
    pub tiers_decision_p50_us: f64,
    pub tiers_decision_p99_us: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct RoutingReport {
    pub workers: usize,
    pub cost_model: String,
    pub results: Vec<PolicyResult>,
    pub micro: MicroResult,
}

/// One request of a workload; `after` chains a conversation's turns.
#[derive(Clone)]
struct Req {
    arrival: f64,
    prompt: Vec<u32>,
    max_tokens: usize,
    session: Option<String>,
    /// Conversation turns: (think time, user tokens, reply tokens) still to come.
    next_turns: Vec<(f64, Vec<u32>, usize)>,
}

fn tokens(rng: &mut Rng, n: usize) -> Vec<u32> {
    (0..n).map(|_| 17 + (rng.next_u64() % 40_000) as u32).collect()
}

fn exp(rng: &mut Rng, mean: f64) -> f64 {
    -mean * (1.0 - rng.next_f64()).ln()
}

fn long_prefix(rng: &mut Rng, n: usize) -> Vec<Req> {
    let groups: Vec<Vec<u32>> = (0..14).map(|_| tokens(rng, 8000)).collect();
    let mut t = 0.0;
    (0..n)
        .map(|_| {
            t += exp(rng, 1.0 / 6.0);
            let g = (rng.next_u64() % groups.len() as u64) as usize;
            let mut prompt = groups[g].clone();
            prompt.extend(tokens(rng, 64));
            Req {
                arrival: t,
                prompt,
                max_tokens: 64,
                session: None,
                next_turns: Vec::new(),
            }
        })
        .collect()
}

fn conversations(rng: &mut Rng, n: usize) -> Vec<Req> {
    let mut t = 0.0;
    (0..n)
        .map(|_| {
            t += exp(rng, 0.6);
            let turns = 2 + (rng.next_u64() % 7) as usize;
            let first_len = 100 + (rng.next_u64() % 900) as usize;
            let mut next_turns = Vec::new();
            for _ in 1..turns {
                let user = 20 + (rng.next_u64() % 300) as usize;
                next_turns.push((exp(rng, 8.0), tokens(rng, user), 50 + (rng.next_u64() % 300) as usize));
            }
            next_turns.reverse();
            Req {
                arrival: t,
                prompt: tokens(rng, first_len),
                max_tokens: 50 + (rng.next_u64() % 300) as usize,
                // No session header: SageMaker's comparison routes on content alone.
                session: None,
                next_turns,
            }
        })
        .collect()
}

/// The `p` quantile (nearest rank) of `v`, sorting it; 0 when empty.
pub(crate) fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// Virtual time in nanoseconds (a totally ordered heap key).
fn ns(t: f64) -> u64 {
    (t * 1e9) as u64
}

enum Ev {
    Arrive(Req),
    StepDone(usize),
}

struct Flight {
    arrival: f64,
    prompt_tokens: usize,
    uncached_guess: usize,
    max_tokens: usize,
    session: Option<String>,
    prompt: Vec<u32>,
    next_turns: Vec<(f64, Vec<u32>, usize)>,
}

fn simulate(policy: Policy, workload: &str, reqs: &[Req], workers: usize, cost: CostModel) -> PolicyResult {
    let mut router = Router::new(RouterConfig {
        policy,
        ..Default::default()
    });
    for i in 0..workers {
        router.add_worker(&format!("sim-{i}"), "local", true);
    }
    let root = namespace_root(MODEL, "tenant");
    let mut sims: Vec<SimWorker> = (0..workers).map(|_| SimWorker::new(cost)).collect();
    let mut pending: Vec<Option<SimStep>> = (0..workers).map(|_| None).collect();
    let mut heap: BinaryHeap<Reverse<(u64, u64)>> = BinaryHeap::new();
    let mut events: HashMap<u64, Ev> = HashMap::new();
    let mut seq = 0u64;
    let mut push = |heap: &mut BinaryHeap<Reverse<(u64, u64)>>, events: &mut HashMap<u64, Ev>, t: f64, ev: Ev| {
        seq += 1;
        events.insert(seq, ev);
        heap.push(Reverse((ns(t), seq)));
    };
    for r in reqs {
        push(&mut heap, &mut events, r.arrival, Ev::Arrive(r.clone()));
    }
    let mut flights: HashMap<u64, Flight> = HashMap::new();
    let mut next_id = 0u64;
    let (mut ttfts, mut route_us) = (Vec::new(), Vec::new());
    let (mut prompt_total, mut cached_total, mut out_tokens, mut done) = (0usize, 0usize, 0usize, 0usize);
    let mut share = vec![0usize; workers];
    let (mut first_arrival, mut last_done) = (f64::MAX, 0f64);
    while let Some(Reverse((t_ns, id))) = heap.pop() {
        let now = t_ns as f64 / 1e9;
        let Some(ev) = events.remove(&id) else { continue };
        let start_worker = match ev {
            Ev::Arrive(r) => {
                first_arrival = first_arrival.min(r.arrival);
                let hashes: Vec<BlockHash> = block_hashes(root, &r.prompt[..r.prompt.len() - 1], 16);
                // prefix_aware's key: the leading 2048 characters ≈ 512 tokens.
                let lead = &r.prompt[..r.prompt.len().min(512)];
                let key = xxhash_rust::xxh3::xxh3_64(&lead.iter().flat_map(|t| t.to_le_bytes()).collect::<Vec<u8>>());
                let input = RouteInput {
                    hashes: &hashes,
                    prompt_tokens: r.prompt.len(),
                    prefix_key: key,
                    session: r.session.as_deref(),
                    region: None,
                    exclude: 0,
                    fetch: true,
                    adapter: None,
                };
                let t0 = Instant::now();
                let d = router.route(&input, (now * 1000.0) as u64).expect("a worker");
                route_us.push(t0.elapsed().as_secs_f64() * 1e6);
                let uncached = r.prompt.len() - d.expected_cached_tokens;
                router.on_dispatch(d.worker, uncached);
                share[d.worker] += 1;
                let rid = next_id;
                next_id += 1;
                sims[d.worker].submit(rid, r.prompt.clone(), root, r.max_tokens);
                flights.insert(
                    rid,
                    Flight {
                        arrival: now,
                        prompt_tokens: r.prompt.len(),
                        uncached_guess: uncached,
                        max_tokens: r.max_tokens,
                        session: r.session,
                        prompt: r.prompt,
                        next_turns: r.next_turns,
                    },
                );
                (pending[d.worker].is_none()).then_some(d.worker)
            }
            Ev::StepDone(w) => {
                if let Some(step) = pending[w].take() {
                    for (rid, cached) in step.first_tokens {
                        if let Some(f) = flights.get(&rid) {
                            ttfts.push((now - f.arrival) * 1000.0);
                            prompt_total += f.prompt_tokens;
                            cached_total += cached;
                            router.on_first_token(w, f.uncached_guess);
                        }
                    }
                    for rid in step.finished {
                        let Some(mut f) = flights.remove(&rid) else { continue };
                        router.on_finish(w, f.uncached_guess, true);
                        out_tokens += f.max_tokens;
                        done += 1;
                        last_done = last_done.max(now);
                        if let Some((think, user, reply)) = f.next_turns.pop() {
                            // The next turn resends the history: prompt, the answer, the new message.
                            let mut prompt = std::mem::take(&mut f.prompt);
                            prompt.extend((1..=f.max_tokens).map(|g| generated_token(rid, g)));
                            prompt.extend(user);
                            let next = Req {
                                arrival: now + think,
                                prompt,
                                max_tokens: reply,
                                session: f.session,
                                next_turns: f.next_turns,
                            };
                            push(&mut heap, &mut events, now + think, Ev::Arrive(next));
                        }
                    }
                }
                let ev = sims[w].take_events();
                router.index.stored(w, &ev.stored);
                router.index.removed(w, &ev.removed);
                Some(w)
            }
        };
        if let Some(w) = start_worker {
            if let Some(step) = sims[w].step() {
                let ev = sims[w].take_events();
                router.index.removed(w, &ev.removed);
                router.index.stored(w, &ev.stored);
                push(&mut heap, &mut events, now + step.seconds, Ev::StepDone(w));
                pending[w] = Some(step);
            }
        }
    }
    let total: usize = share.iter().sum();
    let shares: Vec<f64> = share.iter().map(|&s| s as f64 / total.max(1) as f64).collect();
    let span = (last_done - first_arrival).max(1e-9);
    PolicyResult {
        workload: workload.into(),
        policy: policy.name().into(),
        requests: done,
        kv_hit_rate: cached_total as f64 / prompt_total.max(1) as f64,
        ttft_p50_ms: percentile(&mut ttfts.clone(), 0.5),
        ttft_p90_ms: percentile(&mut ttfts, 0.9),
        throughput_req_s: done as f64 / span,
        output_tok_s: out_tokens as f64 / span,
        share_min: shares.iter().cloned().fold(1.0, f64::min),
        share_max: shares.iter().cloned().fold(0.0, f64::max),
        share: shares,
        route_p50_us: percentile(&mut route_us.clone(), 0.5),
        route_p99_us: percentile(&mut route_us, 0.99),
    }
}

/// Decision time with 64 workers and 1M indexed blocks; event ingestion rate.
fn micro(quick: bool) -> MicroResult {
    let workers = 64;
    let blocks = if quick { 250_000 } else { 1_000_000 };
    let mut router = Router::new(RouterConfig::default());
    for i in 0..workers {
        router.add_worker(&format!("w{i}"), "local", true);
    }
    let mut rng = Rng::new(7);
    // Prefix chains of 500 blocks (an 8,000-token prompt), each cached on 1-3 workers.
    let chains = blocks / 500;
    let roots: Vec<BlockHash> = (0..chains).map(|c| namespace_root(MODEL, &format!("t{c}"))).collect();
    let prompt: Vec<u32> = tokens(&mut rng, 8000);
    let t0 = Instant::now();
    let mut ingested = 0usize;
    let mut all_chains = Vec::with_capacity(chains);
    for root in &roots {
        let hashes = block_hashes(*root, &prompt, 16);
        for k in 0..1 + (rng.next_u64() % 3) as usize {
            let w = (rng.next_u64() % workers as u64) as usize;
            for batch in hashes.chunks(16) {
                router.index.stored(w, batch);
                ingested += batch.len();
            }
            let _ = k;
        }
        all_chains.push(hashes);
    }
    let ingest = ingested as f64 / t0.elapsed().as_secs_f64();
    let times = decisions(&mut router, &all_chains, quick);
    // Tiers: each chain also on 1-3 workers' disks.
    let mut disk_blocks = 0;
    for hashes in &all_chains {
        for _ in 0..1 + (rng.next_u64() % 3) as usize {
            let w = (rng.next_u64() % workers as u64) as usize;
            for batch in hashes.chunks(16) {
                router.index.stored_in(w, batch, Tier::Disk);
                disk_blocks += batch.len();
            }
        }
    }
    let mut tiered = decisions(&mut router, &all_chains, quick);
    MicroResult {
        workers,
        indexed_blocks: router.index.len(),
        request_blocks: 500,
        decision_p50_us: percentile(&mut times.clone(), 0.5),
        decision_p99_us: percentile(&mut times.clone(), 0.99),
        ingest_blocks_per_s: ingest,
        tiers_disk_blocks: disk_blocks,
        tiers_decision_p50_us: percentile(&mut tiered.clone(), 0.5),
        tiers_decision_p99_us: percentile(&mut tiered, 0.99),
    }
}

/// Routing decision times (µs) for requests over `chains`.
fn decisions(router: &mut Router, all_chains: &[Vec<BlockHash>], quick: bool) -> Vec<f64> {
    let mut times = Vec::new();
    for i in 0..if quick { 2_000 } else { 20_000 } {
        let hashes = &all_chains[i % all_chains.len()];
        let input = RouteInput {
            hashes,
            prompt_tokens: 8064,
            prefix_key: i as u64,
            session: None,
            region: None,
            exclude: 0,
            fetch: true,
            adapter: None,
        };
        let t = Instant::now();
        let d = router.route(&input, 0);
        times.push(t.elapsed().as_secs_f64() * 1e6);
        std::hint::black_box(d);
    }
    times
}

pub fn run(cfg: RoutingBenchConfig) -> RoutingReport {
    let cost = CostModel {
        kv_tokens: 40_000,
        ..CostModel::default()
    };
    let policies = ["random", "least_outstanding", "prefix_aware", "kv_aware"];
    let (n_long, n_conv) = if cfg.quick { (600, 150) } else { (3000, 600) };
    let mut results = Vec::new();
    for (name, reqs) in [
        ("long_prefix", long_prefix(&mut Rng::new(cfg.seed), n_long)),
        ("conversations", conversations(&mut Rng::new(cfg.seed + 1), n_conv)),
    ] {
        for p in policies {
            let policy = Policy::parse(p).unwrap_or(Policy::Random);
            results.push(simulate(policy, name, &reqs, cfg.workers, cost));
        }
    }
    RoutingReport {
        workers: cfg.workers,
        cost_model: format!(
            "prefill {} tok/s, decode step {} ms + {} ms/seq, KV {} tokens per worker",
            cost.prefill_tok_s,
            cost.decode_step_s * 1e3,
            cost.decode_per_seq_s * 1e3,
            cost.kv_tokens
        ),
        results,
        micro: micro(cfg.quick),
    }
}

impl RoutingReport {
    pub fn table(&self) -> String {
        let mut out = format!(
            "hearth bench routing — {} sim workers ({})\n",
            self.workers, self.cost_model
        );
        out.push_str(&format!(
            "  {:<14} {:<18} {:>6} {:>8} {:>10} {:>10} {:>9} {:>13} {:>9} {:>9}\n",
            "workload",
            "policy",
            "reqs",
            "KV hit",
            "TTFT p50",
            "TTFT p90",
            "req/s",
            "share min-max",
            "route p50",
            "route p99"
        ));
        for r in &self.results {
            out.push_str(&format!(
                "  {:<14} {:<18} {:>6} {:>7.1}% {:>8.0}ms {:>8.0}ms {:>9.2} {:>6.1}-{:<5.1}% {:>7.1}µs {:>7.1}µs\n",
                r.workload,
                r.policy,
                r.requests,
                r.kv_hit_rate * 100.0,
                r.ttft_p50_ms,
                r.ttft_p90_ms,
                r.throughput_req_s,
                r.share_min * 100.0,
                r.share_max * 100.0,
                r.route_p50_us,
                r.route_p99_us
            ));
        }
        for w in ["long_prefix", "conversations"] {
            let get = |p: &str| self.results.iter().find(|r| r.workload == w && r.policy == p);
            if let (Some(rand), Some(kv), Some(pa)) = (get("random"), get("kv_aware"), get("prefix_aware")) {
                out.push_str(&format!(
                    "  {w}: vs random — kv_aware TTFT p50 {:+.0}%, p90 {:+.0}%, throughput {:+.0}%; prefix_aware TTFT p50 {:+.0}%, p90 {:+.0}%\n",
                    (kv.ttft_p50_ms / rand.ttft_p50_ms - 1.0) * 100.0,
                    (kv.ttft_p90_ms / rand.ttft_p90_ms - 1.0) * 100.0,
                    (kv.throughput_req_s / rand.throughput_req_s - 1.0) * 100.0,
                    (pa.ttft_p50_ms / rand.ttft_p50_ms - 1.0) * 100.0,
                    (pa.ttft_p90_ms / rand.ttft_p90_ms - 1.0) * 100.0,
                ));
            }
        }
        let m = &self.micro;
        out.push_str(&format!(
            "  router micro-benchmark: {} workers, {} indexed blocks, {}-block requests: decision p50 {:.1} µs, p99 {:.1} µs; ingestion {:.1} M blocks/s\n",
            m.workers,
            m.indexed_blocks,
            m.request_blocks,
            m.decision_p50_us,
            m.decision_p99_us,
            m.ingest_blocks_per_s / 1e6
        ));
        out.push_str(&format!(
            "  with tiers ({} disk-tier entries added): decision p50 {:.1} µs, p99 {:.1} µs (target ≤ 10 µs: {})\n",
            m.tiers_disk_blocks,
            m.tiers_decision_p50_us,
            m.tiers_decision_p99_us,
            if m.tiers_decision_p99_us <= 10.0 {
                "met"
            } else {
                "MISSED"
            }
        ));
        out
    }
}

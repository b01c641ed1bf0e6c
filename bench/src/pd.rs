//! `hearth bench pd`: prefill/decode disaggregation against colocated serving, at equal
//! worker count, under one mixed workload — steady short-prompt streams, plus bursts of
//! long prompts that, colocated, stall every running stream's next token.
//!
//! * **engine**: real processes — for each mode a `hearth gateway` and two `hearth worker`s
//!   (`both` + `both`, or `prefill` + `decode`), each worker with an equal share of the
//!   CPU threads; the load comes through the gateway's OpenAI API, streamed, and every
//!   token's arrival time is recorded at the client.
//! * **sim**: the same workload shape at larger scale on `sim` workers (the real scheduler
//!   and prefix cache, a cost model, virtual time), with the KV transfer costed at a given
//!   rate (by default 0.5 GB/s, the loopback rate `hearth bench kv-transfer` measured before
//!   the one-copy path).
//!
//! Reported per mode: TTFT and inter-token latency P50/P90/P99, output tokens/s, KV bytes
//! moved and the transfer rate; for each engine worker, where its engine thread spent the
//! run ([`WorkerProfile`]); then the ratios the targets name.

use std::collections::{BinaryHeap, HashMap};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use hearth_engine::worker::metrics::series_sum as series;
use hearth_engine::worker::sim::{CostModel, SimWorker};
use hearth_protocol::namespace_root;
use serde::Serialize;

use crate::procs::{self, Proc};
use crate::routing::percentile;
use serde_json::json;

const TOKEN: &str = "hearth-bench-pd-token";

#[derive(Debug, Clone)]
pub struct PdBenchConfig {
    /// The `hearth` executable (workers and gateways are started from it).
    pub exe: PathBuf,
    /// `--model` for the workers (a known model or a path) and the id it is served as.
    pub model: String,
    pub model_id: String,
    /// CPU threads shared out between the two workers.
    pub threads: usize,
    /// The workers' `--max-batch-tokens` (decodes and prefill chunks per step).
    pub step_tokens: usize,
    /// Seconds of load per mode.
    pub seconds: f64,
    /// Steady short-prompt streams.
    pub streams: usize,
    /// Tokens each short request generates.
    pub short_tokens: u32,
    /// A long prompt's length in words (about as many tokens).
    pub long_words: usize,
    /// Seconds between bursts of long prompts, and prompts per burst.
    pub burst_every: f64,
    pub burst: usize,
    /// The gateway's `--pd-threshold`.
    pub threshold: usize,
    /// The sim's KV transfer rate, GB/s.
    pub sim_transfer_gbs: f64,
    pub quick: bool,
    /// Disaggregated mode's threads for the prefill and the decode worker (default: half
    /// of `threads` each, as each colocated worker has).
    pub pd_threads: Option<(usize, usize)>,
    /// Disaggregated mode's decode worker: `--max-running` (a batch cap; default: the
    /// worker's own).
    pub decode_max_running: Option<usize>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ModeResult {
    /// `engine` or `sim`.
    pub backend: String,
    /// `colocated` or `disaggregated`.
    pub mode: String,
    pub workers: String,
    pub requests: usize,
    pub errors: usize,
    pub ttft_p50_ms: f64,
    pub ttft_p90_ms: f64,
    pub ttft_p99_ms: f64,
    /// The long prompts' own TTFT.
    pub long_ttft_p50_ms: f64,
    pub itl_p50_ms: f64,
    pub itl_p90_ms: f64,
    pub itl_p99_ms: f64,
    pub output_tok_s: f64,
    /// Requests the gateway disaggregated.
    pub disaggregated: u64,
    pub kv_bytes: u64,
    pub transfer_gbs: f64,
    /// Each worker's engine thread over the measured run (engine mode only).
    pub profile: Vec<WorkerProfile>,
}

/// Where one worker's engine thread spent the measured run, read from its
/// `hearth_engine_step_*` and `hearth_engine_thread_seconds_total` metrics (the difference
/// between a scrape before the load and one after).
#[derive(Debug, Clone, Default, Serialize)]
pub struct WorkerProfile {
    pub role: String,
    pub threads: usize,
    /// Busy time ÷ the run's time, and its parts, in ms per second of run.
    pub busy: f64,
    pub plan_ms_s: f64,
    pub forward_ms_s: f64,
    pub sample_ms_s: f64,
    pub commands_ms_s: f64,
    pub publish_ms_s: f64,
    /// Steps of decodes only: how many, their mean time, their mean rows.
    pub decode_steps: u64,
    pub decode_step_ms: f64,
    pub decode_rows: f64,
    /// Steps with prompt tokens.
    pub prompt_steps: u64,
    pub prompt_step_ms: f64,
    pub prompt_rows: f64,
    /// KV pulls this worker made (disaggregated decode): how many and their mean time.
    pub pulls: u64,
    pub pull_ms: f64,
}

impl WorkerProfile {
    fn between(role: &str, threads: usize, before: &str, after: &str, seconds: f64) -> Self {
        let d = |name: &str, label: &str| series(after, name, label) - series(before, name, label);
        let phase = |p: &str| d("hearth_engine_thread_seconds_total", &format!("phase=\"{p}\"")) * 1000.0 / seconds;
        let kind = |k: &str| {
            let label = format!("kind=\"{k}\"");
            let n = d("hearth_engine_step_seconds_count", &label);
            let ms = d("hearth_engine_step_seconds_sum", &label) * 1000.0 / n.max(1.0);
            let rows = d("hearth_engine_step_rows_total", &label) / n.max(1.0);
            (n as u64, ms, rows)
        };
        let (decode_steps, decode_step_ms, decode_rows) = kind("decode");
        let (prompt_steps, prompt_step_ms, prompt_rows) = kind("prompt");
        let pulls = d("hearth_kv_transfer_seconds_count", "");
        let (plan, forward, sample, commands, publish) = (
            phase("plan"),
            phase("forward"),
            phase("sample"),
            phase("commands"),
            phase("publish"),
        );
        WorkerProfile {
            role: role.to_string(),
            threads,
            busy: (plan + forward + sample + commands + publish) / 1000.0,
            plan_ms_s: plan,
            forward_ms_s: forward,
            sample_ms_s: sample,
            commands_ms_s: commands,
            publish_ms_s: publish,
            decode_steps,
            decode_step_ms,
            decode_rows,
            prompt_steps,
            prompt_step_ms,
            prompt_rows,
            pulls: pulls as u64,
            pull_ms: d("hearth_kv_transfer_seconds_sum", "") * 1000.0 / pulls.max(1.0),
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct PdReport {
    pub isa: String,
    pub cpu: String,
    pub workload: String,
    pub results: Vec<ModeResult>,
    /// Disaggregated ÷ colocated, engine then sim: P90 ITL (target ≤ 0.5) and output
    /// tokens/s (target ≥ 0.9).
    pub engine_itl_p90_ratio: f64,
    pub engine_throughput_ratio: f64,
    pub sim_itl_p90_ratio: f64,
    pub sim_throughput_ratio: f64,
    /// The same with an RDMA-class link ([`RDMA_GBS`]).
    pub sim_rdma_itl_p90_ratio: f64,
    pub sim_rdma_throughput_ratio: f64,
}

/// An RDMA-class KV link for the sim's second disaggregated run, GB/s (one 200 Gb/s NIC).
pub const RDMA_GBS: f64 = 25.0;

impl PdReport {
    pub fn table(&self) -> String {
        let mut out = format!(
            "Prefill/decode disaggregation vs colocated (ISA {}; {})\n{}\n\n",
            self.isa, self.cpu, self.workload
        );
        out += &format!("{SIM_WORKLOAD}\n\n");
        out += "| backend | mode | workers | requests | errors | TTFT P50/P90/P99 ms | long-prompt TTFT P50 ms | ITL P50/P90/P99 ms | output tok/s | disaggregated | KV moved MB | transfer GB/s |\n";
        out += "|---|---|---|---:|---:|---|---:|---|---:|---:|---:|---:|\n";
        for r in &self.results {
            out += &format!(
                "| {} | {} | {} | {} | {} | {:.0} / {:.0} / {:.0} | {:.0} | {:.1} / {:.1} / {:.1} | {:.1} | {} | {:.1} | {:.2} |\n",
                r.backend,
                r.mode,
                r.workers,
                r.requests,
                r.errors,
                r.ttft_p50_ms,
                r.ttft_p90_ms,
                r.ttft_p99_ms,
                r.long_ttft_p50_ms,
                r.itl_p50_ms,
                r.itl_p90_ms,
                r.itl_p99_ms,
                r.output_tok_s,
                r.disaggregated,
                r.kv_bytes as f64 / 1e6,
                r.transfer_gbs
            );
        }
        out += "\nWhere each engine worker's engine thread spent the run (busy share; ms per second of run by phase; steps of decodes only and steps with prompt tokens: count, mean ms, mean rows; KV pulls):\n\n";
        out += "| mode | worker | threads | busy | plan / forward / sample / commands / publish ms/s | decode steps | decode step ms | decode rows | prompt steps | prompt step ms | prompt rows | KV pulls | pull ms |\n";
        out += "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|\n";
        for r in &self.results {
            for p in &r.profile {
                out += &format!(
                    "| {} | {} | {} | {:.0} % | {:.0} / {:.0} / {:.0} / {:.0} / {:.0} | {} | {:.2} | {:.2} | {} | {:.2} | {:.1} | {} | {:.1} |\n",
                    r.mode,
                    p.role,
                    p.threads,
                    p.busy * 100.0,
                    p.plan_ms_s,
                    p.forward_ms_s,
                    p.sample_ms_s,
                    p.commands_ms_s,
                    p.publish_ms_s,
                    p.decode_steps,
                    p.decode_step_ms,
                    p.decode_rows,
                    p.prompt_steps,
                    p.prompt_step_ms,
                    p.prompt_rows,
                    p.pulls,
                    p.pull_ms
                );
            }
        }
        out += &format!(
            "\nP90 ITL, disaggregated ÷ colocated: engine {:.2}×, sim {:.2}× (RDMA-class link {:.2}×) (target ≤ 0.5×)\n\
             Output tokens/s, disaggregated ÷ colocated: engine {:.2}×, sim {:.2}× (RDMA-class link {:.2}×) (target ≥ 0.9×)\n",
            self.engine_itl_p90_ratio,
            self.sim_itl_p90_ratio,
            self.sim_rdma_itl_p90_ratio,
            self.engine_throughput_ratio,
            self.sim_throughput_ratio,
            self.sim_rdma_throughput_ratio
        );
        out
    }
}

pub async fn run(cfg: PdBenchConfig) -> anyhow::Result<PdReport> {
    let mut results = Vec::new();
    for pd in [false, true] {
        results.push(engine_mode(&cfg, pd).await?);
    }
    let sim_cfg = cfg.clone();
    let sim = tokio::task::spawn_blocking(move || {
        [None, Some(sim_cfg.sim_transfer_gbs), Some(RDMA_GBS)].map(|g| sim_mode(&sim_cfg, g))
    })
    .await?;
    results.extend(sim);
    let ratio = |i: usize, j: usize, f: fn(&ModeResult) -> f64| f(&results[j]) / f(&results[i]).max(1e-9);
    Ok(PdReport {
        isa: hearth_engine::kernels::isa().name().to_string(),
        cpu: hearth_engine::kernels::cpu_features(),
        workload: format!(
            "engine: {} steady streams (short prompts, {} tokens each) + every {:.1} s a burst of {} prompts of ~{} words (16 out); {:.0} s per mode; {}-token steps; --pd-threshold {}",
            cfg.streams, cfg.short_tokens, cfg.burst_every, cfg.burst, cfg.long_words, cfg.seconds, cfg.step_tokens, cfg.threshold
        ),
        engine_itl_p90_ratio: ratio(0, 1, |r| r.itl_p90_ms),
        engine_throughput_ratio: ratio(0, 1, |r| r.output_tok_s),
        sim_itl_p90_ratio: ratio(2, 3, |r| r.itl_p90_ms),
        sim_throughput_ratio: ratio(2, 3, |r| r.output_tok_s),
        sim_rdma_itl_p90_ratio: ratio(2, 4, |r| r.itl_p90_ms),
        sim_rdma_throughput_ratio: ratio(2, 4, |r| r.output_tok_s),
        results,
    })
}

fn spawn(exe: &std::path::Path, args: &[&str]) -> anyhow::Result<(Proc, String)> {
    procs::spawn(
        exe,
        args,
        &[("HEARTH_WORKER_TOKEN", TOKEN), ("HEARTH_ADMIN_TOKEN", TOKEN)],
    )
}

fn admin(exe: &std::path::Path, data: &str, args: &[&str]) -> anyhow::Result<String> {
    procs::cli(exe, "admin", data, args)
}

/// One streamed request's timings at the client.
struct Timed {
    /// A long prompt (the bursts).
    long: bool,
    ttft: f64,
    /// Gaps between consecutive tokens.
    itl: Vec<f64>,
    tokens: usize,
}

async fn stream(client: &reqwest::Client, url: &str, key: &str, body: serde_json::Value, long: bool) -> Option<Timed> {
    let start = Instant::now();
    let resp = client.post(url).bearer_auth(key).json(&body).send().await.ok()?;
    if !resp.status().is_success() {
        return None;
    }
    let mut bytes = resp.bytes_stream();
    let (mut buf, mut times) = (Vec::<u8>::new(), Vec::new());
    let mut ok = false;
    while let Some(chunk) = bytes.next().await {
        buf.extend_from_slice(&chunk.ok()?);
        while let Some(end) = buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buf.drain(..end + 2).collect();
            let text = String::from_utf8_lossy(&event);
            let Some(data) = text.trim().strip_prefix("data: ") else {
                continue;
            };
            if data == "[DONE]" {
                ok = true;
                continue;
            }
            let v: serde_json::Value = serde_json::from_str(data).ok()?;
            if v.get("error").is_some() {
                return None;
            }
            if v["choices"][0]["delta"]["content"]
                .as_str()
                .is_some_and(|c| !c.is_empty())
            {
                times.push(start.elapsed().as_secs_f64());
            }
        }
    }
    if !ok || times.is_empty() {
        return None;
    }
    Some(Timed {
        long,
        ttft: times[0],
        itl: times.windows(2).map(|w| w[1] - w[0]).collect(),
        tokens: times.len(),
    })
}

fn long_prompt(words: usize, n: usize) -> String {
    let mut s = format!("Document {n}. ");
    for i in 0..words {
        s.push_str(["alpha ", "beta ", "gamma ", "delta ", "omega ", "sigma "][(i * 7 + n) % 6]);
        if i % 13 == 12 {
            s.push_str(&format!("{} ", i + n));
        }
    }
    s + "\nSummarise the document in one line."
}

async fn engine_mode(cfg: &PdBenchConfig, pd: bool) -> anyhow::Result<ModeResult> {
    let data = std::env::temp_dir().join(format!("hearth-bench-pd-{}-{pd}", std::process::id()));
    std::fs::create_dir_all(&data)?;
    let data_s = data.to_string_lossy().to_string();
    admin(&cfg.exe, &data_s, &["tenant", "create", "bench"])?;
    let key = crate::procs::new_key(&cfg.exe, &data_s, "bench")?;
    let half = (cfg.threads / 2).max(1);
    let threads = match (pd, cfg.pd_threads) {
        (true, Some((p, d))) => [p, d],
        _ => [half, half],
    };
    let step_tokens = cfg.step_tokens.to_string();
    let roles = if pd { ["prefill", "decode"] } else { ["both", "both"] };
    let cap = cfg.decode_max_running.map(|c| c.to_string());
    let mut procs = Vec::new();
    let mut urls = Vec::new();
    for (role, n) in roles.into_iter().zip(threads) {
        let n = n.to_string();
        let mut args = vec![
            "worker",
            "--listen",
            "127.0.0.1:0",
            "--model",
            &cfg.model,
            "--model-id",
            &cfg.model_id,
            "--threads",
            &n,
            "--max-batch-tokens",
            &step_tokens,
            "--role",
            role,
        ];
        if let (true, Some(cap)) = (role == "decode", &cap) {
            args.extend(["--max-running", cap]);
        }
        let (p, url) = spawn(&cfg.exe, &args)?;
        procs.push(p);
        urls.push(url);
    }
    let threshold = cfg.threshold.to_string();
    let (gw, gw_url) = spawn(
        &cfg.exe,
        &[
            "gateway",
            "--listen",
            "127.0.0.1:0",
            "--data-dir",
            &data_s,
            "--worker",
            &urls[0],
            "--worker",
            &urls[1],
            "--pd-threshold",
            &threshold,
        ],
    )?;
    let client = reqwest::Client::builder().timeout(Duration::from_secs(600)).build()?;
    let url = format!("{gw_url}/v1/chat/completions");
    let model = cfg.model_id.clone();
    // Warm up both workers' code paths.
    for i in 0..2 {
        let body = json!({"model": model, "stream": true, "max_tokens": 4,
            "messages": [{"role": "user", "content": long_prompt(cfg.long_words, 900 + i)}]});
        stream(&client, &url, &key, body, true).await;
    }
    let gateway_metrics = || async {
        client
            .get(format!("{gw_url}/metrics"))
            .bearer_auth(TOKEN)
            .send()
            .await?
            .text()
            .await
    };
    let mut before = Vec::new();
    for u in &urls {
        before.push(client.get(format!("{u}/metrics")).send().await?.text().await?);
    }
    let gateway_before = gateway_metrics().await?;
    let started = Instant::now();
    let deadline = started + Duration::from_secs_f64(cfg.seconds);
    let mut tasks = Vec::new();
    for s in 0..cfg.streams {
        let (client, url, key, model) = (client.clone(), url.clone(), key.clone(), model.clone());
        let short = cfg.short_tokens;
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::new();
            let mut n = 0;
            while Instant::now() < deadline {
                n += 1;
                let body = json!({"model": model, "stream": true, "max_tokens": short, "ignore_eos": true,
                    "messages": [{"role": "user", "content": format!("Stream {s}, request {n}: name a colour.")}]});
                out.push(stream(&client, &url, &key, body, false).await);
            }
            out
        }));
    }
    {
        let (client, url, key, model) = (client.clone(), url.clone(), key.clone(), model.clone());
        let (every, burst, words) = (cfg.burst_every, cfg.burst, cfg.long_words);
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::new();
            let mut k = 0;
            tokio::time::sleep(Duration::from_secs_f64(every / 2.0)).await;
            while Instant::now() + Duration::from_secs_f64(every / 2.0) < deadline {
                let mut burst_reqs = Vec::new();
                for _ in 0..burst {
                    k += 1;
                    let body = json!({"model": model, "stream": true, "max_tokens": 16, "ignore_eos": true,
                        "messages": [{"role": "user", "content": long_prompt(words, k)}]});
                    let (client, url, key) = (client.clone(), url.clone(), key.clone());
                    burst_reqs.push(tokio::spawn(
                        async move { stream(&client, &url, &key, body, true).await },
                    ));
                }
                tokio::time::sleep(Duration::from_secs_f64(every)).await;
                for r in burst_reqs {
                    out.push(r.await.ok().flatten());
                }
            }
            out
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await?);
    }
    let elapsed = started.elapsed().as_secs_f64();
    let mut kv_bytes = 0.0;
    let mut kv_seconds = 0.0;
    let mut profile = Vec::new();
    for (i, u) in urls.iter().enumerate() {
        let m = client.get(format!("{u}/metrics")).send().await?.text().await?;
        kv_bytes +=
            series(&m, "hearth_kv_transfer_bytes_total", "") - series(&before[i], "hearth_kv_transfer_bytes_total", "");
        kv_seconds +=
            series(&m, "hearth_kv_transfer_seconds_sum", "") - series(&before[i], "hearth_kv_transfer_seconds_sum", "");
        profile.push(WorkerProfile::between(roles[i], threads[i], &before[i], &m, elapsed));
    }
    let gateway_after = gateway_metrics().await?;
    let label = format!("model=\"{model}\",outcome=\"disaggregated\"");
    let disaggregated = (series(&gateway_after, "hearth_pd_requests_total", &label)
        - series(&gateway_before, "hearth_pd_requests_total", &label)) as u64;
    drop(gw);
    drop(procs);
    let _ = std::fs::remove_dir_all(&data);
    let errors = all.iter().filter(|r| r.is_none()).count();
    let ok: Vec<Timed> = all.into_iter().flatten().collect();
    let mut result = summarise(
        "engine",
        pd,
        if pd {
            format!("1 prefill ({} threads) + 1 decode ({} threads)", threads[0], threads[1])
        } else {
            format!("2 both ({half} threads each)")
        },
        &ok,
        errors,
        elapsed,
        disaggregated,
        kv_bytes as u64,
        kv_seconds,
    );
    result.profile = profile;
    Ok(result)
}

#[allow(clippy::too_many_arguments)]
fn summarise(
    backend: &str,
    pd: bool,
    workers: String,
    ok: &[Timed],
    errors: usize,
    elapsed: f64,
    disaggregated: u64,
    kv_bytes: u64,
    kv_seconds: f64,
) -> ModeResult {
    let mut ttft: Vec<f64> = ok.iter().map(|t| t.ttft * 1000.0).collect();
    let mut long_ttft: Vec<f64> = ok.iter().filter(|t| t.long).map(|t| t.ttft * 1000.0).collect();
    let mut itl: Vec<f64> = ok.iter().flat_map(|t| t.itl.iter().map(|x| x * 1000.0)).collect();
    let tokens: usize = ok.iter().map(|t| t.tokens).sum();
    ModeResult {
        backend: backend.into(),
        mode: if pd { "disaggregated" } else { "colocated" }.into(),
        workers,
        requests: ok.len(),
        errors,
        ttft_p50_ms: percentile(&mut ttft, 0.5),
        ttft_p90_ms: percentile(&mut ttft, 0.9),
        ttft_p99_ms: percentile(&mut ttft, 0.99),
        long_ttft_p50_ms: percentile(&mut long_ttft, 0.5),
        itl_p50_ms: percentile(&mut itl, 0.5),
        itl_p90_ms: percentile(&mut itl, 0.9),
        itl_p99_ms: percentile(&mut itl, 0.99),
        output_tok_s: tokens as f64 / elapsed.max(1e-9),
        disaggregated,
        kv_bytes,
        transfer_gbs: if kv_seconds > 0.0 {
            kv_bytes as f64 / kv_seconds / 1e9
        } else {
            0.0
        },
        profile: Vec::new(),
    }
}

// ---- sim ----

/// KV bytes per token of the sim's model (a 70B-class Llama: 80 layers, 8 KV heads of 128,
/// fp16 keys and values).
const SIM_KV_BYTES_PER_TOKEN: f64 = 80.0 * 8.0 * 128.0 * 2.0 * 2.0;

/// One simulated request.
struct SimFlight {
    arrival: f64,
    prompt: Vec<u32>,
    max_tokens: usize,
    /// A steady stream's request (the stream sends its next one when it ends).
    stream: Option<usize>,
    first: Option<f64>,
    last: Option<f64>,
    itl: Vec<f64>,
    tokens: usize,
}

/// An event time, earliest first in a max-heap.
struct At(f64);
impl PartialEq for At {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o).is_eq()
    }
}
impl Eq for At {}
impl PartialOrd for At {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for At {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        o.0.total_cmp(&self.0)
    }
}

enum SimEv {
    Arrive(u64),
    /// A worker's step ended.
    Step(usize),
    /// A disaggregated request's blocks reached its decode worker.
    Transferred(u64),
}

/// The simulation's state: workers, the event queue, requests by id.
struct Sim {
    sims: Vec<SimWorker>,
    pending: Vec<Option<hearth_engine::worker::sim::SimStep>>,
    heap: BinaryHeap<(At, u64)>,
    evs: HashMap<u64, SimEv>,
    seq: u64,
    flights: HashMap<u64, SimFlight>,
    next_flight: u64,
    /// Sim request id → (flight, the worker if it is a prefill-only half).
    on_worker: HashMap<u64, (u64, Option<usize>)>,
    /// When each prefill worker's link is free again (its transfers queue on it).
    link_free: Vec<f64>,
    next_rid: u64,
    rng: hearth_engine::step::sampling::Rng,
    root: hearth_protocol::BlockHash,
}

impl Sim {
    fn push(&mut self, t: f64, e: SimEv) {
        self.seq += 1;
        self.evs.insert(self.seq, e);
        self.heap.push((At(t), self.seq));
    }

    fn flight(&mut self, at: f64, len: usize, out: usize, stream: Option<usize>) {
        let prompt: Vec<u32> = (0..len).map(|_| (self.rng.next_u64() % 40_000) as u32 + 17).collect();
        let id = self.next_flight;
        self.next_flight += 1;
        self.flights.insert(
            id,
            SimFlight {
                arrival: at,
                prompt,
                max_tokens: out,
                stream,
                first: None,
                last: None,
                itl: Vec::new(),
                tokens: 0,
            },
        );
        self.push(at, SimEv::Arrive(id));
    }

    /// The least loaded of `ws` (prefill tokens in flight, then sequences).
    fn least(&self, ws: &[usize]) -> usize {
        *ws.iter()
            .min_by_key(|&&w| {
                let l = self.sims[w].load();
                (l.inflight_prefill_tokens, l.running + l.waiting)
            })
            .unwrap_or(&0)
    }

    fn submit(&mut self, w: usize, fid: u64, prompt: Vec<u32>, max_tokens: usize, prefill: bool, now: f64) {
        let rid = self.next_rid;
        self.next_rid += 1;
        self.sims[w].submit(rid, prompt, self.root, max_tokens);
        self.on_worker.insert(rid, (fid, prefill.then_some(w)));
        self.start(w, now);
    }

    /// Starts worker `w`'s next step unless one is running.
    fn start(&mut self, w: usize, now: f64) {
        if self.pending[w].is_some() {
            return;
        }
        if let Some(step) = self.sims[w].step() {
            self.sims[w].take_events();
            self.push(now + step.seconds, SimEv::Step(w));
            self.pending[w] = Some(step);
        }
    }
}

/// The sim's workload: 64 steady streams (200-token prompts, 128 tokens out) and every 2 s
/// a burst of 5 prompts of 8,000 tokens (16 out), on 4 workers (2 + 2 disaggregated) with
/// 2,048-token steps (chunked prefill); a KV transfer takes its bytes ÷ `gbs`, one at a
/// time per prefill worker.
pub const SIM_WORKLOAD: &str = "sim: 64 streams (200-token prompts, 128 out) + every 2 s 5 prompts of 8,000 tokens (16 out); 4 workers, 2,048-token steps; 70B-class cost model";

/// `gbs`: None for colocated serving, else the transfer rate of a disaggregated run.
fn sim_mode(cfg: &PdBenchConfig, gbs: Option<f64>) -> ModeResult {
    let pd = gbs.is_some();
    let workers = 4usize;
    let (streams, short_prompt, short_out, long_prompt) = (64usize, 200usize, 128usize, 8000usize);
    let (every, burst) = (2.0, 5usize);
    let horizon = if cfg.quick { 60.0 } else { 300.0 };
    let mut sim = Sim {
        sims: (0..workers)
            .map(|_| SimWorker::with_batch_tokens(CostModel::default(), 2048))
            .collect(),
        link_free: vec![0.0; workers],
        pending: (0..workers).map(|_| None).collect(),
        heap: BinaryHeap::new(),
        evs: HashMap::new(),
        seq: 0,
        flights: HashMap::new(),
        next_flight: 0,
        on_worker: HashMap::new(),
        next_rid: 0,
        rng: hearth_engine::step::sampling::Rng::new(11),
        root: namespace_root("sim-70b", "bench"),
    };
    for s in 0..streams {
        sim.flight(s as f64 * 0.05, short_prompt, short_out, Some(s));
    }
    let mut t = every / 2.0;
    while t < horizon {
        for _ in 0..burst {
            sim.flight(t, long_prompt, 16, None);
        }
        t += every;
    }
    let (prefill_ws, decode_ws): (Vec<usize>, Vec<usize>) = if pd {
        ((0..workers / 2).collect(), (workers / 2..workers).collect())
    } else {
        ((0..workers).collect(), (0..workers).collect())
    };
    let (mut kv_bytes, mut kv_seconds, mut disaggregated) = (0u64, 0f64, 0u64);
    let mut done: Vec<SimFlight> = Vec::new();
    let mut end = 0f64;
    while let Some((At(now), id)) = sim.heap.pop() {
        if now > horizon * 2.0 {
            break;
        }
        let Some(ev) = sim.evs.remove(&id) else { continue };
        match ev {
            SimEv::Arrive(fid) => {
                let (prompt, max_tokens) = {
                    let f = &sim.flights[&fid];
                    (f.prompt.clone(), f.max_tokens)
                };
                if pd && prompt.len() >= long_prompt {
                    let w = sim.least(&prefill_ws);
                    sim.submit(w, fid, prompt, 1, true, now);
                } else {
                    let w = sim.least(&decode_ws);
                    sim.submit(w, fid, prompt, max_tokens, false, now);
                }
            }
            SimEv::Transferred(fid) => {
                // The decode worker holds the prompt's blocks now: it computes the prompt's
                // last block and the first token, then decodes.
                let (mut prompt, max_tokens) = {
                    let f = &sim.flights[&fid];
                    (f.prompt.clone(), f.max_tokens)
                };
                let w = sim.least(&decode_ws);
                let root = sim.root;
                sim.sims[w].import_prefix(&prompt, root);
                prompt.push(17);
                sim.submit(w, fid, prompt, max_tokens - 1, false, now);
            }
            SimEv::Step(w) => {
                let step = sim.pending[w].take().unwrap_or_default();
                for rid in &step.sampled {
                    let Some(&(fid, _)) = sim.on_worker.get(rid) else {
                        continue;
                    };
                    let Some(f) = sim.flights.get_mut(&fid) else { continue };
                    f.first.get_or_insert(now);
                    if let Some(l) = f.last {
                        f.itl.push(now - l);
                    }
                    f.last = Some(now);
                    f.tokens += 1;
                }
                for rid in &step.finished {
                    let Some((fid, prefill)) = sim.on_worker.remove(rid) else {
                        continue;
                    };
                    if let Some(pw) = prefill {
                        disaggregated += 1;
                        let bytes = sim.flights[&fid].prompt.len() as f64 * SIM_KV_BYTES_PER_TOKEN;
                        let secs = bytes / (gbs.unwrap_or(1.0).max(1e-3) * 1e9);
                        kv_bytes += bytes as u64;
                        kv_seconds += secs;
                        let arrives = sim.link_free[pw].max(now) + secs;
                        sim.link_free[pw] = arrives;
                        sim.push(arrives, SimEv::Transferred(fid));
                        continue;
                    }
                    let Some(f) = sim.flights.remove(&fid) else { continue };
                    end = end.max(now);
                    if let Some(s) = f.stream.filter(|_| now < horizon) {
                        sim.flight(now, short_prompt, short_out, Some(s));
                    }
                    done.push(f);
                }
                sim.start(w, now);
            }
        }
    }
    let timed: Vec<Timed> = done
        .iter()
        .filter_map(|f| {
            Some(Timed {
                long: f.stream.is_none(),
                ttft: f.first? - f.arrival,
                itl: f.itl.clone(),
                tokens: f.tokens,
            })
        })
        .collect();
    summarise(
        "sim",
        pd,
        match gbs {
            Some(g) => format!("{} prefill + {} decode, KV link {g} GB/s", workers / 2, workers / 2),
            None => format!("{workers} both"),
        },
        &timed,
        0,
        end.max(1e-9),
        disaggregated,
        kv_bytes,
        kv_seconds,
    )
}

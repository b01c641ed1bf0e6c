//! `hearth bench engine`: the engine's hot paths measured in-process, printed as a table and
//! returned as JSON. Each measurement uses its own cache namespace so that only the TTFT
//! comparison sees prefix-cache hits.
//!
//! The engine's other benchmarks are its submodules: [`attention`] (the attention kernels),
//! [`coldstart`] (load to first token), [`kvtiers`] (the KV tiers), [`kvtransfer`] (KV
//! blocks between workers) and [`lora`] (adapters beside the base model).

pub mod attention;
pub mod coldstart;
pub mod kld;
pub mod kvtiers;
pub mod kvtransfer;
pub mod load;
pub mod lora;
pub mod pipeline;

/// The middle value of `v` (the upper one of an even count; 0 when empty).
pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// A directory a benchmark made, removed however the run ends.
pub(crate) struct RemovedDir(pub std::path::PathBuf);

impl Drop for RemovedDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

use std::path::Path;
use std::time::Instant;

use hearth_protocol::{GenerateEvent, GenerateRequest, SamplingParams};
use serde::Serialize;

use hearth_engine::step::sampling::Rng;
use hearth_engine::{EngineConfig, EngineError, EngineHandle};

#[derive(Debug, Clone)]
pub struct BenchConfig {
    pub threads: usize,
    pub kv_cache_mib: Option<usize>,
    pub kv_dtype: hearth_engine::kv::pool::KvDtype,
    /// The kernels' instruction set (None: the best this CPU runs).
    pub isa: Option<hearth_engine::kernels::Isa>,
    /// Fewer tokens per measurement (for smoke runs).
    pub quick: bool,
    /// Decoding speculates (prompt-lookup drafts); off: one token per forward pass.
    pub speculative: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    pub model: String,
    pub threads: usize,
    pub isa: String,
    /// The CPU features the kernels could use.
    pub cpu: String,
    pub kv_dtype: String,
    /// Whether decoding speculated.
    pub speculative: bool,
    pub model_file_mib: f64,
    /// Repacked weights held in memory (0 on the scalar path).
    pub packed_weights_mib: f64,
    pub kv_cache_mib: f64,
    pub load_s: f64,
    /// Of which repacking weights for the SIMD kernels.
    pub repack_s: f64,
    pub prefill_512_tok_s: f64,
    pub decode_1_tok_s: f64,
    pub decode_8_tok_s: f64,
    pub decode_32_tok_s: f64,
    pub ttft_1000_cold_ms: f64,
    pub ttft_1000_cached_900_ms: f64,
    pub ttft_cached_over_cold: f64,
    pub cached_tokens_reported: u32,
    pub rss_after_load_mib: f64,
    pub peak_rss_mib: f64,
    /// DRAM read bandwidth measured here with the engine's thread count (GB/s).
    pub dram_read_gb_s: f64,
    /// Weight bytes one decode step reads (every matrix once; MB).
    pub weight_mb_per_token: f64,
    /// The decode rate that bandwidth allows: bandwidth ÷ weight bytes per token.
    pub decode_limit_tok_s: f64,
    /// `decode_1_tok_s` as a fraction of that limit.
    pub decode_1_of_limit: f64,
}

/// DRAM read bandwidth with `threads` threads: the best of several passes summing a buffer
/// of 1 GiB (larger than any L3; at most a quarter of the memory available, at least
/// 256 MiB), in GB/s.
pub fn dram_read_bandwidth(threads: usize) -> f64 {
    use rayon::prelude::*;
    let available = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            let l = s.lines().find(|l| l.starts_with("MemAvailable:"))?;
            l.split_whitespace().nth(1)?.parse::<usize>().ok()
        })
        .map_or(1usize << 30, |kib| kib << 10);
    let words = (available / 4).clamp(256 << 20, 1 << 30) / 8;
    let Ok(pool) = rayon::ThreadPoolBuilder::new().num_threads(threads.max(1)).build() else {
        return 0.0;
    };
    pool.install(|| {
        let buf: Vec<u64> = (0..words as u64)
            .into_par_iter()
            .map(|i| i.wrapping_mul(0x9E37_79B9))
            .collect();
        let mut best = 0f64;
        for _ in 0..4 {
            let t = Instant::now();
            let sum = buf
                .par_chunks(1 << 16)
                .map(|c| c.iter().fold(0u64, |a, &v| a.wrapping_add(v)))
                .reduce(|| 0, u64::wrapping_add);
            std::hint::black_box(sum);
            best = best.max((words * 8) as f64 / t.elapsed().as_secs_f64() / 1e9);
        }
        best
    })
}

/// A memory figure of this process from `/proc/self/status` (`VmRSS:`, `VmHWM:`), in MiB.
pub fn rss_mib(field: &str) -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .map_or(0.0, |kib| kib / 1024.0)
}

/// Random ordinary tokens (ids above the special tokens).
fn prompt(rng: &mut Rng, n: usize, vocab: u32) -> Vec<u32> {
    (0..n)
        .map(|_| 17 + (rng.next_u64() % (vocab as u64 - 17)) as u32)
        .collect()
}

/// When each token of a request arrived, and its usage.
struct Trace {
    start: Instant,
    tokens: Vec<Instant>,
    cached: u32,
}

async fn run_one(
    engine: &EngineHandle,
    prompt: Vec<u32>,
    max_tokens: u32,
    namespace: String,
    speculative: bool,
) -> Trace {
    let req = GenerateRequest {
        request_id: format!("bench-{namespace}"),
        model: engine.info().model.clone(),
        prompt,
        sampling: SamplingParams {
            temperature: 0.0,
            max_tokens,
            ignore_eos: true,
            // Off by default: one token per forward pass, as llama.cpp decodes — the engine's
            // own speed (a random model's greedy output loops, and prompt-lookup drafts
            // would be accepted by the dozen). `hearth bench agent` measures speculation.
            speculative,
            ..Default::default()
        },
        cache_namespace: namespace,
        n: 1,
        prefill_only: false,
        resume: Vec::new(),
        kv_source: None,
        qos: Default::default(),
        constraint: None,
        adapter: None,
    };
    let start = Instant::now();
    let mut rx = engine.generate(req);
    let mut trace = Trace {
        start,
        tokens: Vec::new(),
        cached: 0,
    };
    while let Some(ev) = rx.recv().await {
        match ev {
            GenerateEvent::Token { .. } => trace.tokens.push(Instant::now()),
            GenerateEvent::Done { usage, .. } => {
                trace.cached = usage.cached_tokens;
                break;
            }
            GenerateEvent::Error { message, .. } => panic!("bench request failed: {message}"),
            GenerateEvent::Finish { .. } => {}
        }
    }
    trace
}

/// Aggregate decode tokens/s with `n` concurrent streams: tokens produced while all `n`
/// were decoding, over that window.
async fn decode_streams(engine: &EngineHandle, rng: &mut Rng, n: usize, max_tokens: u32, tag: &str, spec: bool) -> f64 {
    let vocab = engine.info().tokenizer.tokens.len() as u32;
    let handles: Vec<_> = (0..n)
        .map(|i| {
            let e = engine.clone();
            let p = prompt(rng, 16, vocab);
            let ns = format!("{tag}-{i}");
            tokio::spawn(async move { run_one(&e, p, max_tokens, ns, spec).await })
        })
        .collect();
    let mut traces = Vec::new();
    for h in handles {
        traces.push(h.await.expect("bench task"));
    }
    let all_started = traces
        .iter()
        .filter_map(|t| t.tokens.first())
        .max()
        .copied()
        .unwrap_or_else(Instant::now);
    let end = traces
        .iter()
        .filter_map(|t| t.tokens.last())
        .max()
        .copied()
        .unwrap_or_else(Instant::now);
    let window = (end - all_started).as_secs_f64();
    let tokens: usize = traces
        .iter()
        .map(|t| t.tokens.iter().filter(|&&x| x > all_started).count())
        .sum();
    tokens as f64 / window.max(1e-9)
}

pub async fn run(model_path: &Path, model_id: &str, cfg: &BenchConfig) -> Result<BenchReport, EngineError> {
    let ecfg = EngineConfig {
        threads: cfg.threads,
        kv_cache_mib: cfg.kv_cache_mib,
        kv_dtype: cfg.kv_dtype,
        isa: cfg.isa,
        ..Default::default()
    };
    let t0 = Instant::now();
    let engine = EngineHandle::load(model_path, model_id, &ecfg)?;
    let load_s = t0.elapsed().as_secs_f64();
    let rss_after_load = rss_mib("VmRSS:");
    let vocab = engine.info().tokenizer.tokens.len() as u32;
    let mut rng = Rng::new(20261129);
    let (decode_tokens, stream_tokens) = if cfg.quick { (32, 16) } else { (128, 64) };

    // Warm up (page in the weights).
    run_one(
        &engine,
        prompt(&mut rng, 32, vocab),
        4,
        "warmup".into(),
        cfg.speculative,
    )
    .await;

    let mut prefill = 0f64;
    for i in 0..if cfg.quick { 1 } else { 3 } {
        let t = run_one(
            &engine,
            prompt(&mut rng, 512, vocab),
            1,
            format!("prefill-{i}"),
            cfg.speculative,
        )
        .await;
        let ttft = (t.tokens[0] - t.start).as_secs_f64();
        prefill = prefill.max(512.0 / ttft);
    }

    let t = run_one(
        &engine,
        prompt(&mut rng, 16, vocab),
        decode_tokens,
        "decode-1".into(),
        cfg.speculative,
    )
    .await;
    let decode_1 = (t.tokens.len() - 1) as f64
        / (*t.tokens.last().unwrap_or(&t.start) - t.tokens[0])
            .as_secs_f64()
            .max(1e-9);
    let decode_8 = decode_streams(&engine, &mut rng, 8, stream_tokens, "decode-8", cfg.speculative).await;
    let decode_32 = decode_streams(&engine, &mut rng, 32, stream_tokens, "decode-32", cfg.speculative).await;

    let prefix = prompt(&mut rng, 900, vocab);
    let with = |suffix: Vec<u32>| prefix.iter().copied().chain(suffix).collect::<Vec<u32>>();
    let cold = run_one(
        &engine,
        with(prompt(&mut rng, 100, vocab)),
        1,
        "ttft".into(),
        cfg.speculative,
    )
    .await;
    let warm = run_one(
        &engine,
        with(prompt(&mut rng, 100, vocab)),
        1,
        "ttft".into(),
        cfg.speculative,
    )
    .await;
    let ms = |t: &Trace| (t.tokens[0] - t.start).as_secs_f64() * 1000.0;

    let c = engine.info();
    // After the memory figures: the bandwidth probe's buffer is not the engine's.
    let peak_rss = rss_mib("VmHWM:");
    let bandwidth = dram_read_bandwidth(cfg.threads);
    let weight_bytes = engine.decode_weight_bytes() as f64;
    let limit = bandwidth * 1e9 / weight_bytes.max(1.0);
    let file_mib = std::fs::metadata(model_path).map_or(0.0, |m| m.len() as f64 / (1 << 20) as f64);
    Ok(BenchReport {
        model: c.model.clone(),
        threads: cfg.threads,
        isa: hearth_engine::kernels::isa().to_string(),
        cpu: hearth_engine::kernels::cpu_features(),
        kv_dtype: cfg.kv_dtype.name().to_string(),
        speculative: cfg.speculative,
        model_file_mib: file_mib,
        packed_weights_mib: engine.packed_bytes() as f64 / (1 << 20) as f64,
        kv_cache_mib: engine.kv_cache_bytes() as f64 / (1 << 20) as f64,
        load_s,
        repack_s: engine.repack_seconds(),
        prefill_512_tok_s: prefill,
        decode_1_tok_s: decode_1,
        decode_8_tok_s: decode_8,
        decode_32_tok_s: decode_32,
        ttft_1000_cold_ms: ms(&cold),
        ttft_1000_cached_900_ms: ms(&warm),
        ttft_cached_over_cold: ms(&warm) / ms(&cold),
        cached_tokens_reported: warm.cached,
        rss_after_load_mib: rss_after_load,
        peak_rss_mib: peak_rss,
        dram_read_gb_s: bandwidth,
        weight_mb_per_token: weight_bytes / 1e6,
        decode_limit_tok_s: limit,
        decode_1_of_limit: decode_1 / limit.max(1e-9),
    })
}

impl BenchReport {
    /// A plain-text table.
    pub fn table(&self) -> String {
        let rows = [
            (
                "model load",
                format!("{:.3} s (repacking {:.3} s)", self.load_s, self.repack_s),
            ),
            (
                "prefill, 512-token prompt",
                format!("{:.0} tok/s", self.prefill_512_tok_s),
            ),
            ("decode, 1 stream", format!("{:.1} tok/s", self.decode_1_tok_s)),
            (
                "decode, 8 streams (aggregate)",
                format!("{:.1} tok/s", self.decode_8_tok_s),
            ),
            (
                "decode, 32 streams (aggregate)",
                format!("{:.1} tok/s", self.decode_32_tok_s),
            ),
            (
                "TTFT, 1000-token prompt, cold",
                format!("{:.1} ms", self.ttft_1000_cold_ms),
            ),
            (
                "TTFT, 1000 tokens, 900 cached",
                format!(
                    "{:.1} ms ({:.2}x cold; {} cached)",
                    self.ttft_1000_cached_900_ms, self.ttft_cached_over_cold, self.cached_tokens_reported
                ),
            ),
            (
                "decode limit from DRAM bandwidth",
                format!(
                    "{:.1} tok/s ({:.1} GB/s read ÷ {:.0} MB of weights a token; decode 1 at {:.0} %)",
                    self.decode_limit_tok_s,
                    self.dram_read_gb_s,
                    self.weight_mb_per_token,
                    100.0 * self.decode_1_of_limit
                ),
            ),
            ("RSS after load", format!("{:.0} MiB", self.rss_after_load_mib)),
            (
                "peak RSS",
                format!(
                    "{:.0} MiB (file {:.0} MiB + KV pool {:.0} MiB)",
                    self.peak_rss_mib, self.model_file_mib, self.kv_cache_mib
                ),
            ),
        ];
        let mut out = format!(
            "hearth bench engine — {} — {} threads, isa {} (cpu: {}), KV {}, speculation {}\n",
            self.model,
            self.threads,
            self.isa,
            self.cpu,
            self.kv_dtype,
            if self.speculative { "on" } else { "off" }
        );
        for (k, v) in rows {
            out.push_str(&format!("  {k:<34} {v}\n"));
        }
        out
    }
}

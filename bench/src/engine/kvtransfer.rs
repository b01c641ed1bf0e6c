//! `hearth bench kv-transfer`: how fast a prompt's KV blocks move from one engine to another
//! — in process (export + import, the floor) and worker to worker over loopback HTTP (the
//! transport prefill/decode disaggregation uses) — and that the receiving engine then
//! reuses them.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use hearth_protocol::{GenerateEvent, GenerateRequest, SamplingParams};
use serde::Serialize;

use hearth_engine::kv::transfer::{pull, HttpKvTransport};
use hearth_engine::{EngineConfig, EngineError, EngineHandle};

#[derive(Debug, Clone, Serialize)]
pub struct KvTransferReport {
    pub model: String,
    pub prompt_tokens: usize,
    pub blocks: usize,
    pub block_bytes: usize,
    pub kv_dtype: String,
    /// The kernels' instruction set and the CPU (the copies and checksums run there).
    pub isa: String,
    pub cpu: String,
    /// Export from one engine and import into another, in process, into a fresh engine
    /// (its pool untouched), median of the runs.
    pub in_process_ms: f64,
    pub in_process_gb_s: f64,
    /// The same into an engine whose pool has held blocks before (a worker that has been
    /// serving): the pages are already there.
    pub in_process_warm_ms: f64,
    pub in_process_warm_gb_s: f64,
    /// Of the warm transfer, the blocks copied out of the source pool and checksummed.
    pub in_process_export_ms: f64,
    /// Each run: [fresh, warm] ms.
    pub in_process_runs_ms: Vec<[f64; 2]>,
    /// `pull` on a receiving engine: hashes, missing, framed stream over loopback HTTP,
    /// checksums, import — into a fresh engine, and into one whose pool is reused.
    pub loopback_ms: f64,
    pub loopback_gb_s: f64,
    pub loopback_warm_ms: f64,
    pub loopback_warm_gb_s: f64,
    pub loopback_runs_ms: Vec<[f64; 2]>,
    /// The receiving engine's next request reused the whole transferred prefix.
    pub reused_tokens: u32,
    /// Time to first token on the receiving engine after the transfer, and on an engine
    /// that must prefill the prompt itself.
    pub ttft_after_transfer_ms: f64,
    pub ttft_prefill_ms: f64,
}

async fn first_token(e: &EngineHandle, prompt: &[u32]) -> (f64, u32) {
    let t = Instant::now();
    let mut rx = e.generate(GenerateRequest {
        request_id: "kv-bench".into(),
        model: e.info().model.clone(),
        prompt: prompt.to_vec(),
        sampling: SamplingParams {
            temperature: 0.0,
            max_tokens: 1,
            ..Default::default()
        },
        cache_namespace: String::new(),
        n: 1,
        prefill_only: false,
        resume: Vec::new(),
        kv_source: None,
        qos: Default::default(),
        constraint: None,
        adapter: None,
    });
    let mut ms = 0.0;
    while let Some(ev) = rx.recv().await {
        match ev {
            GenerateEvent::Token { .. } if ms == 0.0 => ms = t.elapsed().as_secs_f64() * 1000.0,
            GenerateEvent::Done { usage, .. } => return (ms, usage.cached_tokens),
            GenerateEvent::Error { .. } => break,
            _ => {}
        }
    }
    (ms, 0)
}

/// Transfers timed per path, each into a fresh engine; the median is reported.
const RUNS: usize = 5;

/// The workers' shared token in this benchmark.
const TOKEN: &str = "kv-bench";

/// Serves `engine` as a worker with the shared `token` on a loopback port; its base URL.
pub(crate) async fn serve(engine: EngineHandle, token: &str) -> std::io::Result<String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let engines: Vec<(String, Arc<dyn hearth_engine::Backend>)> = vec![(engine.info().model.clone(), Arc::new(engine))];
    let app = hearth_engine::worker::server::router_many(
        engines,
        "bench",
        hearth_engine::worker::server::WorkerOptions {
            token: Some(token.into()),
            ..Default::default()
        },
    );
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(format!("http://{addr}"))
}

pub async fn run(
    model_path: &Path,
    model_id: &str,
    cfg: &EngineConfig,
    prompt_tokens: usize,
) -> Result<KvTransferReport, EngineError> {
    let load = || EngineHandle::load(model_path, model_id, cfg);
    let vocab = hearth_engine::engine::config::file_info(model_path, model_id, "local")?
        .tokenizer
        .tokens
        .len() as u32;
    let span = vocab.saturating_sub(17).clamp(1, 40_000);
    let prompt: Vec<u32> = (0..prompt_tokens as u32).map(|i| 17 + (i * 7919) % span).collect();
    // Two prompts with no block in common: a receiving pool sized to one prompt's blocks
    // takes the second by evicting the first, i.e. into pages it has written before.
    let prompt_b: Vec<u32> = (0..prompt_tokens as u32).map(|i| 17 + (i * 7919 + 3) % span).collect();
    let source = load()?;
    let (ttft_prefill_ms, _) = first_token(&source, &prompt).await;
    first_token(&source, &prompt_b).await;
    let hashes = source.prompt_block_hashes(&prompt, "");
    let hashes_b = source.prompt_block_hashes(&prompt_b, "");
    let layout = source.kv_layout();
    let block_bytes = layout.block_bytes();
    let mut small = cfg.clone();
    small.kv_cache_mib = Some(((hashes.len() + 4) * block_bytes).div_ceil(1 << 20));
    let load_receiver = || EngineHandle::load(model_path, model_id, &small);
    let start = |e: String| EngineError::Start(e);

    // In process: export, import — into a fresh engine (an untouched pool, as a worker that
    // just started has), then the second prompt into the same engine (its pool reused, as
    // a worker that has been serving has), RUNS times: medians are reported.
    let mut in_process = Vec::new();
    let mut bytes = 0u64;
    for _ in 0..RUNS {
        let sink = load_receiver()?;
        let mut run = [(0.0, 0.0); 2];
        for (i, h) in [&hashes, &hashes_b].into_iter().enumerate() {
            let t = Instant::now();
            let blocks: Vec<_> = source
                .export_blocks(h.clone())
                .await
                .map_err(|e| start(e.to_string()))?
                .into_iter()
                .flatten()
                .collect();
            let exported = t.elapsed().as_secs_f64() * 1000.0;
            let report = sink
                .import_blocks(layout, blocks)
                .await
                .map_err(|e| start(e.to_string()))?;
            if report.imported != h.len() {
                return Err(start(format!(
                    "in-process import took {} of {} blocks",
                    report.imported,
                    h.len()
                )));
            }
            bytes = report.bytes;
            run[i] = (t.elapsed().as_secs_f64() * 1000.0, exported);
        }
        in_process.push(run);
    }

    // Worker to worker over loopback HTTP, the same two ways.
    let url = serve(source.clone(), TOKEN).await.map_err(|e| start(e.to_string()))?;
    let transport = HttpKvTransport::new(Some(TOKEN.into()));
    let mut loopback = Vec::new();
    let mut last = None;
    for _ in 0..RUNS {
        let receiver = load_receiver()?;
        let mut run = [0.0; 2];
        for (i, (p, h)) in [(&prompt, &hashes), (&prompt_b, &hashes_b)].into_iter().enumerate() {
            let pulled = pull(&receiver, &transport, &url, p, "", None).await;
            if let Some(e) = &pulled.error {
                return Err(start(format!("loopback transfer failed: {e}")));
            }
            if pulled.import.imported != h.len() {
                return Err(start(format!(
                    "loopback pull took {} of {} blocks",
                    pulled.import.imported,
                    h.len()
                )));
            }
            run[i] = pulled.seconds * 1000.0;
        }
        loopback.push(run);
        last = Some(receiver);
    }
    let receiver = last.ok_or_else(|| start("no run".into()))?;
    let (ttft_after_transfer_ms, reused_tokens) = first_token(&receiver, &prompt_b).await;
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let gb_s = |ms: f64| bytes as f64 / (ms / 1000.0).max(1e-9) / 1e9;
    let in_process_ms = median(in_process.iter().map(|r| r[0].0).collect());
    let in_process_warm_ms = median(in_process.iter().map(|r| r[1].0).collect());
    let loopback_ms = median(loopback.iter().map(|r| r[0]).collect());
    let loopback_warm_ms = median(loopback.iter().map(|r| r[1]).collect());
    Ok(KvTransferReport {
        model: model_id.to_string(),
        prompt_tokens,
        blocks: hashes.len(),
        block_bytes,
        kv_dtype: cfg.kv_dtype.name().to_string(),
        isa: hearth_engine::kernels::isa().to_string(),
        cpu: hearth_engine::kernels::cpu_features(),
        in_process_ms,
        in_process_gb_s: gb_s(in_process_ms),
        in_process_warm_ms,
        in_process_warm_gb_s: gb_s(in_process_warm_ms),
        in_process_export_ms: median(in_process.iter().map(|r| r[1].1).collect()),
        in_process_runs_ms: in_process.iter().map(|r| [r[0].0, r[1].0]).collect(),
        loopback_ms,
        loopback_gb_s: gb_s(loopback_ms),
        loopback_warm_ms,
        loopback_warm_gb_s: gb_s(loopback_warm_ms),
        loopback_runs_ms: loopback.clone(),
        reused_tokens,
        ttft_after_transfer_ms,
        ttft_prefill_ms,
    })
}

impl KvTransferReport {
    pub fn table(&self) -> String {
        let mb = (self.blocks * self.block_bytes) as f64 / 1e6;
        let fresh = |runs: &[[f64; 2]]| runs.iter().map(|r| r[0]).collect::<Vec<_>>();
        let warm = |runs: &[[f64; 2]]| runs.iter().map(|r| r[1]).collect::<Vec<_>>();
        format!(
            "hearth bench kv-transfer — {} — isa {} ({}) — {}-token prompt: {} blocks of {} KiB ({:.1} MB, KV {}); medians of {} runs\n\
             \x20 in process (export + import), fresh engine          {:>7.1} ms  {:>5.2} GB/s  (runs {})\n\
             \x20 in process (export + import), pool reused           {:>7.1} ms  {:>5.2} GB/s  (export {:.1} ms; runs {})\n\
             \x20 worker to worker, loopback HTTP, fresh worker       {:>7.1} ms  {:>5.2} GB/s  (runs {})\n\
             \x20 worker to worker, loopback HTTP, pool reused        {:>7.1} ms  {:>5.2} GB/s  (target ≥ 1 GB/s: {}; runs {})\n\
             \x20 first token after the transfer                      {:>7.1} ms  ({} prompt tokens reused)\n\
             \x20 first token, prefilling the prompt                  {:>7.1} ms\n",
            self.model,
            self.isa,
            self.cpu,
            self.prompt_tokens,
            self.blocks,
            self.block_bytes / 1024,
            mb,
            self.kv_dtype,
            self.loopback_runs_ms.len(),
            self.in_process_ms,
            self.in_process_gb_s,
            runs(&fresh(&self.in_process_runs_ms)),
            self.in_process_warm_ms,
            self.in_process_warm_gb_s,
            self.in_process_export_ms,
            runs(&warm(&self.in_process_runs_ms)),
            self.loopback_ms,
            self.loopback_gb_s,
            runs(&fresh(&self.loopback_runs_ms)),
            self.loopback_warm_ms,
            self.loopback_warm_gb_s,
            if self.loopback_warm_gb_s >= 1.0 { "met" } else { "MISSED" },
            runs(&warm(&self.loopback_runs_ms)),
            self.ttft_after_transfer_ms,
            self.reused_tokens,
            self.ttft_prefill_ms,
        )
    }
}

/// Each run's time, in ms, as `a / b / c`.
fn runs(ms: &[f64]) -> String {
    ms.iter().map(|m| format!("{m:.0}")).collect::<Vec<_>>().join(" / ")
}

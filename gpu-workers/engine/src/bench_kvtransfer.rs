//! `hearth bench kv-transfer`: how fast a prompt's KV blocks move from one engine to another
//! — in process (export + import, the floor) and worker to worker over loopback HTTP (the
//! transport prefill/decode disaggregation uses) — and that the receiving engine then
//! reuses them.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use hearth_protocol::{GenerateEvent, GenerateRequest, SamplingParams};
use serde::Serialize;

use crate::kv_transfer::{pull, HttpKvTransport};
use crate::{EngineConfig, EngineError, EngineHandle};

#[derive(Debug, Clone, Serialize)]
pub struct KvTransferReport {
    pub model: String,
    pub prompt_tokens: usize,
    pub blocks: usize,
    pub block_bytes: usize,
    pub kv_dtype: String,
    /// Export from one engine and import into another, in process.
    pub in_process_ms: f64,
    pub in_process_gb_s: f64,
    /// `POST /v1/worker/kv/pull` on the receiving worker: hashes, missing, framed stream
    /// over loopback HTTP, checksums, import.
    pub loopback_ms: f64,
    pub loopback_gb_s: f64,
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

/// The workers' shared token in this benchmark.
const TOKEN: &str = "kv-bench";

/// Serves `engine` as a worker with the shared `token` on a loopback port; its base URL.
pub(crate) async fn serve(engine: EngineHandle, token: &str) -> std::io::Result<String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let engines: Vec<(String, Arc<dyn crate::Backend>)> = vec![(engine.info().model.clone(), Arc::new(engine))];
    let app = crate::server::router_many(
        engines,
        "bench",
        crate::server::WorkerOptions {
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
    let vocab = crate::engine::file_info(model_path, model_id, "local")?
        .tokenizer
        .tokens
        .len() as u32;
    let span = vocab.saturating_sub(17).clamp(1, 40_000);
    let prompt: Vec<u32> = (0..prompt_tokens as u32).map(|i| 17 + (i * 7919) % span).collect();
    let source = load()?;
    let (ttft_prefill_ms, _) = first_token(&source, &prompt).await;
    let hashes = source.prompt_block_hashes(&prompt, "");

    // In process: export, import.
    let sink = load()?;
    let t = Instant::now();
    let blocks: Vec<_> = source
        .export_blocks(hashes.clone())
        .await
        .map_err(|e| EngineError::Start(e.to_string()))?
        .into_iter()
        .flatten()
        .collect();
    let block_bytes = blocks.first().map_or(0, |b| b.data.len());
    let report = sink
        .import_blocks(source.kv_layout(), blocks)
        .await
        .map_err(|e| EngineError::Start(e.to_string()))?;
    let in_process_ms = t.elapsed().as_secs_f64() * 1000.0;
    let bytes = report.bytes as f64;
    drop(sink);

    // Worker to worker over loopback HTTP.
    let url = serve(source.clone(), TOKEN)
        .await
        .map_err(|e| EngineError::Start(e.to_string()))?;
    let receiver = load()?;
    let pulled = pull(
        &receiver,
        &HttpKvTransport::new(Some(TOKEN.into())),
        &url,
        &prompt,
        "",
        None,
    )
    .await;
    if let Some(e) = &pulled.error {
        return Err(EngineError::Start(format!("loopback transfer failed: {e}")));
    }
    let loopback_ms = pulled.seconds * 1000.0;
    let (ttft_after_transfer_ms, reused_tokens) = first_token(&receiver, &prompt).await;
    Ok(KvTransferReport {
        model: model_id.to_string(),
        prompt_tokens,
        blocks: hashes.len(),
        block_bytes,
        kv_dtype: cfg.kv_dtype.name().to_string(),
        in_process_ms,
        in_process_gb_s: bytes / (in_process_ms / 1000.0) / 1e9,
        loopback_ms,
        loopback_gb_s: pulled.import.bytes as f64 / pulled.seconds.max(1e-9) / 1e9,
        reused_tokens,
        ttft_after_transfer_ms,
        ttft_prefill_ms,
    })
}

impl KvTransferReport {
    pub fn table(&self) -> String {
        let mb = (self.blocks * self.block_bytes) as f64 / 1e6;
        format!(
            "hearth bench kv-transfer — {} — {}-token prompt: {} blocks of {} KiB ({:.1} MB, KV {})\n\
             \x20 in process (export + import)        {:>8.1} ms  {:>6.2} GB/s\n\
             \x20 worker to worker, loopback HTTP     {:>8.1} ms  {:>6.2} GB/s  (target ≥ 1 GB/s: {})\n\
             \x20 first token after the transfer      {:>8.1} ms  ({} prompt tokens reused)\n\
             \x20 first token, prefilling the prompt  {:>8.1} ms\n",
            self.model,
            self.prompt_tokens,
            self.blocks,
            self.block_bytes / 1024,
            mb,
            self.kv_dtype,
            self.in_process_ms,
            self.in_process_gb_s,
            self.loopback_ms,
            self.loopback_gb_s,
            if self.loopback_gb_s >= 1.0 { "met" } else { "MISSED" },
            self.ttft_after_transfer_ms,
            self.reused_tokens,
            self.ttft_prefill_ms,
        )
    }
}

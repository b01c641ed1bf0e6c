//! `hearth bench coldstart`: how long a request for a model that is not loaded waits for
//! its first token, against the floor — reading the file plus one prefill of the prompt —
//! with and without the on-disk pack cache, with the page cache warm and (where the OS lets
//! this process drop a file's pages) cold.

use std::path::Path;
use std::time::{Duration, Instant};

use hearth_protocol::{GenerateEvent, GenerateRequest, SamplingParams};
use serde::Serialize;

use crate::host::{HostConfig, ModelEntry, ModelHost};
use crate::{Backend, EngineConfig, EngineError, EngineHandle};

#[derive(Debug, Clone, Serialize)]
pub struct ColdstartReport {
    pub model: String,
    pub isa: String,
    pub file_mib: f64,
    pub prompt_tokens: usize,
    /// Whether dropping the file's pages from the page cache worked (cold-disk rows).
    pub cold_disk_measured: bool,
    pub file_read_warm_ms: f64,
    pub file_read_cold_ms: Option<f64>,
    /// One prefill of the prompt on a loaded engine.
    pub prefill_ms: f64,
    /// Request for an unloaded model → first token.
    pub first_token_warm_cache_ms: f64,
    pub first_token_no_pack_cache_ms: f64,
    pub first_token_cold_disk_ms: Option<f64>,
    /// first_token_warm_cache / (file_read_warm + prefill): the target is ≤ 1.2.
    pub ratio_to_floor: f64,
}

/// Drops a file's pages from the page cache (only clean pages no one maps); false if the OS
/// refused.
fn drop_page_cache(path: &Path) -> bool {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        let Ok(f) = std::fs::File::open(path) else { return false };
        // SAFETY: posix_fadvise only advises the kernel about this open file's pages.
        unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) == 0 }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = path;
        false
    }
}

fn read_ms(path: &Path) -> f64 {
    let t = Instant::now();
    let n = std::fs::read(path).map_or(0, |b| b.len());
    std::hint::black_box(n);
    t.elapsed().as_secs_f64() * 1000.0
}

fn request(model: &str, prompt: &[u32], tag: &str) -> GenerateRequest {
    GenerateRequest {
        request_id: format!("coldstart-{tag}"),
        model: model.into(),
        prompt: prompt.to_vec(),
        sampling: SamplingParams {
            temperature: 0.0,
            max_tokens: 1,
            ..Default::default()
        },
        cache_namespace: tag.into(),
        n: 1,
    }
}

async fn first_token_ms(b: &dyn Backend, req: GenerateRequest) -> f64 {
    let t = Instant::now();
    let mut rx = b.generate(req);
    while let Some(ev) = rx.recv().await {
        match ev {
            GenerateEvent::Token { .. } => return t.elapsed().as_secs_f64() * 1000.0,
            GenerateEvent::Error { message, .. } => panic!("coldstart request failed: {message}"),
            GenerateEvent::Done { .. } => break,
            GenerateEvent::Finish { .. } => {}
        }
    }
    t.elapsed().as_secs_f64() * 1000.0
}

/// A request to a cold model of a fresh host, timed to its first token.
async fn cold_request(path: &Path, id: &str, cfg: &EngineConfig, prompt: &[u32], tag: &str) -> f64 {
    let (host, failed) = ModelHost::new(
        vec![ModelEntry {
            id: id.into(),
            path: path.to_path_buf(),
            idle_ttl: None,
            pinned: false,
            context_length: None,
            memory_bytes: None,
        }],
        HostConfig {
            engine: cfg.clone(),
            load_timeout: Duration::from_secs(300),
            ..Default::default()
        },
    );
    assert!(failed.is_empty(), "{failed:?}");
    let m = host.model(id).expect("catalogued");
    first_token_ms(&m, request(id, prompt, tag)).await
}

pub async fn run(
    model_path: &Path,
    model_id: &str,
    cfg: &EngineConfig,
    prompt_tokens: usize,
) -> Result<ColdstartReport, EngineError> {
    let file_mib = std::fs::metadata(model_path).map_or(0.0, |m| m.len() as f64 / (1 << 20) as f64);
    // Ordinary token ids (above the special tokens), deterministic, inside the vocabulary.
    let vocab = crate::engine::file_info(model_path, model_id, "local")?
        .tokenizer
        .tokens
        .len() as u32;
    let span = vocab.saturating_sub(17).clamp(1, 40_000);
    let prompt: Vec<u32> = (0..prompt_tokens as u32).map(|i| 17 + (i * 7919) % span).collect();
    let pack = crate::pack_cache::path_for(model_path);

    // The floor: reading the file, and one prefill on a loaded engine.
    read_ms(model_path);
    let file_read_warm_ms = read_ms(model_path);
    let engine = EngineHandle::load(model_path, model_id, cfg)?;
    first_token_ms(&engine, request(model_id, &prompt[..16.min(prompt.len())], "warmup")).await;
    let prefill_ms = first_token_ms(&engine, request(model_id, &prompt, "prefill")).await;
    drop(engine); // this load also wrote the pack cache if it was missing

    // Warm page cache, pack cache present.
    let first_token_warm_cache_ms = cold_request(model_path, model_id, cfg, &prompt, "cached").await;
    // No pack cache: repack at load.
    let no_cache = EngineConfig {
        pack_cache: false,
        ..cfg.clone()
    };
    let first_token_no_pack_cache_ms = cold_request(model_path, model_id, &no_cache, &prompt, "nocache").await;
    // Cold disk: the model's and the pack cache's pages dropped first.
    let cold_disk_measured = drop_page_cache(model_path) && (!pack.exists() || drop_page_cache(&pack));
    let (file_read_cold_ms, first_token_cold_disk_ms) = if cold_disk_measured {
        let t = cold_request(model_path, model_id, cfg, &prompt, "colddisk").await;
        drop_page_cache(model_path);
        (Some(read_ms(model_path)), Some(t))
    } else {
        (None, None)
    };
    Ok(ColdstartReport {
        model: model_id.to_string(),
        isa: crate::kernels::isa().to_string(),
        file_mib,
        prompt_tokens,
        cold_disk_measured,
        file_read_warm_ms,
        file_read_cold_ms,
        prefill_ms,
        first_token_warm_cache_ms,
        first_token_no_pack_cache_ms,
        first_token_cold_disk_ms,
        ratio_to_floor: first_token_warm_cache_ms / (file_read_warm_ms + prefill_ms),
    })
}

impl ColdstartReport {
    pub fn table(&self) -> String {
        let opt = |v: Option<f64>| {
            v.map_or("not measured (page cache could not be dropped)".into(), |v| {
                format!("{v:.1} ms")
            })
        };
        let rows = [
            (
                "read the file, page cache warm",
                format!("{:.1} ms ({:.0} MiB)", self.file_read_warm_ms, self.file_mib),
            ),
            ("read the file, page cache dropped", opt(self.file_read_cold_ms)),
            (
                "one prefill of the prompt (loaded)",
                format!("{:.1} ms ({} tokens)", self.prefill_ms, self.prompt_tokens),
            ),
            (
                "cold model → first token, pack cache",
                format!(
                    "{:.1} ms ({:.2}x read + prefill; target ≤ 1.2x)",
                    self.first_token_warm_cache_ms, self.ratio_to_floor
                ),
            ),
            (
                "cold model → first token, no pack cache",
                format!("{:.1} ms", self.first_token_no_pack_cache_ms),
            ),
            (
                "cold model → first token, cold disk",
                opt(self.first_token_cold_disk_ms),
            ),
        ];
        let mut out = format!("hearth bench coldstart — {} — isa {}\n", self.model, self.isa);
        for (k, v) in rows {
            out.push_str(&format!("  {k:<40} {v}\n"));
        }
        out
    }
}

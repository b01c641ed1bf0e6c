//! `hearth bench coldstart`: how long a request for a model that is not loaded waits for
//! its first token, against the floor — reading the file plus one prefill of the prompt —
//! with and without the on-disk pack cache, with the page cache warm and (where the OS lets
//! this process drop a file's pages) cold; and how long a worker process takes from start to
//! ready. For the GGUF and for the same model as a Hugging Face directory (F16 safetensors,
//! exported for the run).

use std::path::Path;
use std::time::{Duration, Instant};

use hearth_protocol::{GenerateEvent, GenerateRequest, SamplingParams};
use serde::Serialize;

use hearth_engine::kernels::pack_cache::{PackCache, PackMode};
use hearth_engine::worker::host::{HostConfig, ModelEntry, ModelHost};
use hearth_engine::{Backend, EngineConfig, EngineError, EngineHandle};

#[derive(Debug, Clone, Serialize)]
pub struct ColdstartReport {
    pub model: String,
    pub isa: String,
    pub prompt_tokens: usize,
    /// Whether dropping the files' pages from the page cache worked (cold-disk rows).
    pub cold_disk_measured: bool,
    /// The GGUF, then the same model as a Hugging Face directory (F16 safetensors).
    pub formats: Vec<FormatColdstart>,
    /// Three models, room for two, requests alternating between them.
    pub alternating: Alternating,
}

/// A worker with three models (the GGUF under three ids) and a memory budget for two,
/// serving three clients whose requests rotate over the models.
#[derive(Debug, Clone, Serialize)]
pub struct Alternating {
    pub models: usize,
    pub room_for: usize,
    pub requests: usize,
    pub answered: usize,
    /// Requests that got an error (by code) or no answer: the target is none.
    pub failed: Vec<String>,
    pub loads: u64,
    pub p50_ms: f64,
    pub max_ms: f64,
}

/// One format's cold start.
#[derive(Debug, Clone, Serialize)]
pub struct FormatColdstart {
    pub format: String,
    pub weights_mib: f64,
    pub file_read_warm_ms: f64,
    pub file_read_cold_ms: Option<f64>,
    /// One prefill of the prompt on a loaded engine.
    pub prefill_ms: f64,
    /// `hearth worker --model …` started → listening (model loaded), when measured.
    pub process_ready_ms: Option<f64>,
    /// Request for an unloaded model → first token.
    pub first_token_warm_cache_ms: f64,
    /// The same without the on-disk load cache (repacking, or for float safetensors
    /// quantizing to Q8_0, at load).
    pub first_token_no_pack_cache_ms: Option<f64>,
    pub first_token_cold_disk_ms: Option<f64>,
    /// first_token_warm_cache / (file_read_warm + prefill): the target is ≤ 1.2.
    pub ratio_to_floor: f64,
    /// first_token_cold_disk / (file_read_cold + prefill).
    pub ratio_to_floor_cold: Option<f64>,
}

/// The files a model is read from: the GGUF, or a directory's safetensors.
fn weight_files(path: &Path) -> Vec<std::path::PathBuf> {
    if !path.is_dir() {
        return vec![path.to_path_buf()];
    }
    let mut v: Vec<_> = std::fs::read_dir(path)
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    v.sort();
    v
}

/// Drops a file's pages from the page cache (only clean pages no one maps); false if the OS
/// refused.
pub(super) fn drop_page_cache(path: &Path) -> bool {
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
    for f in weight_files(path) {
        let n = std::fs::read(f).map_or(0, |b| b.len());
        std::hint::black_box(n);
    }
    t.elapsed().as_secs_f64() * 1000.0
}

fn drop_all(path: &Path) -> bool {
    weight_files(path).iter().all(|f| drop_page_cache(f))
}

/// `exe worker --model PATH --listen 127.0.0.1:0` started → "listening" printed (the model
/// loaded), in ms; the process is killed after.
fn process_ready_ms(exe: &Path, path: &Path, cfg: &EngineConfig) -> Option<f64> {
    use std::io::BufRead;
    let t = Instant::now();
    let mut child = std::process::Command::new(exe)
        .args(["worker", "--listen", "127.0.0.1:0", "--model"])
        .arg(path)
        .args(["--threads", &cfg.threads.to_string()])
        .args(["--kv-cache-mib", &cfg.kv_cache_mib.unwrap_or(64).to_string()])
        .env("HEARTH_LOG", "warn")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .ok()?;
    let stdout = child.stdout.take()?;
    // Read on a thread, waited for at most 2 minutes: a worker that never gets ready is
    // killed, not waited for forever.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let ready = std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .any(|l| l.contains("listening on"));
        let _ = tx.send(ready);
    });
    let ready = rx.recv_timeout(Duration::from_secs(120)).unwrap_or(false);
    let ms = t.elapsed().as_secs_f64() * 1000.0;
    let _ = child.kill();
    let _ = child.wait();
    ready.then_some(ms)
}

pub(super) fn request(model: &str, prompt: &[u32], tag: &str) -> GenerateRequest {
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
        prefill_only: false,
        resume: Vec::new(),
        kv_source: None,
        qos: Default::default(),
        constraint: None,
        adapter: None,
    }
}

pub(super) async fn first_token_ms(b: &dyn Backend, req: GenerateRequest) -> f64 {
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
            rope_scaling: None,
            memory_bytes: None,
            tenants: Vec::new(),
            chat_template: None,
            kv_disk_dir: None,
            kv_disk_gib: None,
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

/// Measures the GGUF at `model_path` and the same model exported as a Hugging Face
/// directory (F16 safetensors, written to a temporary directory and removed after).
/// `exe`: the `hearth` binary, for the process start → ready rows.
pub async fn run(
    model_path: &Path,
    model_id: &str,
    cfg: &EngineConfig,
    prompt_tokens: usize,
    exe: Option<&Path>,
) -> Result<ColdstartReport, EngineError> {
    // Ordinary token ids (above the special tokens), deterministic, inside the vocabulary.
    let vocab = hearth_engine::engine::config::file_info(model_path, model_id, "local")?
        .tokenizer
        .tokens
        .len() as u32;
    let span = vocab.saturating_sub(17).clamp(1, 40_000);
    let prompt: Vec<u32> = (0..prompt_tokens as u32).map(|i| 17 + (i * 7919) % span).collect();
    let hf_dir = super::RemovedDir(std::env::temp_dir().join(format!("hearth-coldstart-hf-{}", std::process::id())));
    let gguf = hearth_engine::formats::gguf::GgufFile::open(model_path)?;
    hearth_engine::formats::hf::export::export(
        &gguf,
        &hf_dir.0,
        hearth_engine::formats::hf::export::ExportDtype::F16,
        1,
    )?;
    drop(gguf);
    let mut formats = Vec::new();
    let mut cold_disk_measured = true;
    for (format, path) in [("gguf", model_path), ("safetensors (f16)", hf_dir.0.as_path())] {
        let (f, cold) = measure(format, path, model_id, cfg, &prompt, exe).await;
        cold_disk_measured &= cold;
        formats.push(f?);
    }
    drop(hf_dir);
    let alternating = alternating(model_path, cfg, &prompt[..32.min(prompt.len())]).await;
    Ok(ColdstartReport {
        model: model_id.to_string(),
        isa: hearth_engine::kernels::isa().to_string(),
        prompt_tokens,
        cold_disk_measured,
        formats,
        alternating,
    })
}

/// Three clients, each sending 10 requests (8 tokens) in turn to models a, b, c (offset by
/// client), to a host with room for two of the three.
async fn alternating(path: &Path, cfg: &EngineConfig, prompt: &[u32]) -> Alternating {
    const MODELS: [&str; 3] = ["a", "b", "c"];
    const PER_CLIENT: usize = 10;
    let kv_mib = 16;
    let engine = EngineConfig {
        kv_cache_mib: Some(kv_mib),
        ..cfg.clone()
    };
    let per_model = hearth_engine::formats::hf::weights_bytes(path) + ((kv_mib as u64) << 20);
    let entries = MODELS
        .iter()
        .map(|id| ModelEntry {
            id: id.to_string(),
            path: path.to_path_buf(),
            idle_ttl: None,
            pinned: false,
            context_length: None,
            rope_scaling: None,
            memory_bytes: None,
            tenants: Vec::new(),
            chat_template: None,
            kv_disk_dir: None,
            kv_disk_gib: None,
        })
        .collect();
    let (host, failed) = ModelHost::new(
        entries,
        HostConfig {
            memory_budget: Some(2 * per_model + (per_model / 2)),
            load_timeout: Duration::from_secs(300),
            engine,
            ..Default::default()
        },
    );
    let clients = (0..MODELS.len()).map(|c| {
        let host = host.clone();
        let prompt = prompt.to_vec();
        tokio::spawn(async move {
            let mut out = Vec::new();
            for j in 0..PER_CLIENT {
                let id = MODELS[(c + j) % MODELS.len()];
                let Some(m) = host.model(id) else {
                    out.push((Err("not catalogued".to_string()), 0.0));
                    continue;
                };
                let mut req = request(id, &prompt, &format!("alt-{c}-{j}"));
                req.sampling.max_tokens = 8;
                req.sampling.ignore_eos = true;
                let t = Instant::now();
                let mut rx = m.generate(req);
                let mut outcome = Err("no answer".to_string());
                while let Some(ev) = rx.recv().await {
                    match ev {
                        GenerateEvent::Done { .. } => {
                            outcome = Ok(());
                            break;
                        }
                        GenerateEvent::Error { code, .. } => {
                            outcome = Err(code);
                            break;
                        }
                        _ => {}
                    }
                }
                out.push((outcome, t.elapsed().as_secs_f64() * 1000.0));
            }
            out
        })
    });
    let mut results: Vec<(Result<(), String>, f64)> = failed
        .into_iter()
        .map(|(id, e)| (Err(format!("{id}: {e}")), 0.0))
        .collect();
    for c in clients.collect::<Vec<_>>() {
        results.extend(c.await.unwrap_or_default());
    }
    let mut times: Vec<f64> = results.iter().map(|r| r.1).collect();
    times.sort_by(f64::total_cmp);
    Alternating {
        models: MODELS.len(),
        room_for: 2,
        requests: MODELS.len() * PER_CLIENT,
        answered: results.iter().filter(|r| r.0.is_ok()).count(),
        failed: results.iter().filter_map(|r| r.0.clone().err()).collect(),
        loads: host.loads(),
        p50_ms: times.get(times.len() / 2).copied().unwrap_or(0.0),
        max_ms: times.last().copied().unwrap_or(0.0),
    }
}

async fn measure(
    format: &str,
    path: &Path,
    model_id: &str,
    cfg: &EngineConfig,
    prompt: &[u32],
    exe: Option<&Path>,
) -> (Result<FormatColdstart, EngineError>, bool) {
    let weights_mib = hearth_engine::formats::hf::weights_bytes(path) as f64 / (1 << 20) as f64;
    let pack = hearth_engine::kernels::pack_cache::path_for(path);

    // The floor: reading the file(s), and one prefill on a loaded engine.
    read_ms(path);
    let file_read_warm_ms = read_ms(path);
    // This first load repacks and writes the pack (beside the model) for the runs that
    // map it.
    let writing = EngineConfig {
        pack_cache: PackCache {
            mode: PackMode::Write,
            dir: None,
        },
        ..cfg.clone()
    };
    let engine = match EngineHandle::load(path, model_id, &writing) {
        Ok(e) => e,
        Err(e) => return (Err(e), false),
    };
    first_token_ms(&engine, request(model_id, &prompt[..16.min(prompt.len())], "warmup")).await;
    let prefill_ms = first_token_ms(&engine, request(model_id, prompt, "prefill")).await;
    drop(engine); // this load also wrote the pack cache if it was missing
    let process_ready_ms = exe.and_then(|exe| process_ready_ms(exe, path, cfg));

    // Warm page cache, load cache present.
    let first_token_warm_cache_ms = cold_request(path, model_id, cfg, prompt, "cached").await;
    // No load cache: repack at load (a GGUF's quantized matrices; a safetensors
    // directory's float weights quantized to Q8_0).
    let first_token_no_pack_cache_ms = {
        let no_cache = EngineConfig {
            pack_cache: PackCache::OFF,
            ..cfg.clone()
        };
        Some(cold_request(path, model_id, &no_cache, prompt, "nocache").await)
    };
    // Cold disk: the model's (and the pack cache's) pages dropped first. (The cold read
    // first: the engine's read-ahead may still be filling the page cache after its first
    // token.)
    let drop_files = || drop_all(path) && (!pack.exists() || drop_page_cache(&pack));
    let (file_read_cold_ms, first_token_cold_disk_ms) = if drop_files() {
        let read = read_ms(path);
        drop_files();
        let t = cold_request(path, model_id, cfg, prompt, "colddisk").await;
        (Some(read), Some(t))
    } else {
        (None, None)
    };
    let report = FormatColdstart {
        format: format.to_string(),
        weights_mib,
        file_read_warm_ms,
        file_read_cold_ms,
        prefill_ms,
        process_ready_ms,
        first_token_warm_cache_ms,
        first_token_no_pack_cache_ms,
        first_token_cold_disk_ms,
        ratio_to_floor: first_token_warm_cache_ms / (file_read_warm_ms + prefill_ms),
        ratio_to_floor_cold: first_token_cold_disk_ms
            .zip(file_read_cold_ms)
            .map(|(t, r)| t / (r + prefill_ms)),
    };
    let cold = report.file_read_cold_ms.is_some();
    (Ok(report), cold)
}

impl ColdstartReport {
    pub fn table(&self) -> String {
        let ms = |v: Option<f64>| v.map_or("—".to_string(), |v| format!("{v:.1} ms"));
        let mut out = format!(
            "hearth bench coldstart — {} — isa {} — {}-token prompt — cold disk: {}\n",
            self.model,
            self.isa,
            self.prompt_tokens,
            if self.cold_disk_measured {
                "page cache dropped with posix_fadvise(DONTNEED)"
            } else {
                "not measured (the page cache could not be dropped)"
            }
        );
        out.push_str(&format!("  {:<44}", "measure"));
        for f in &self.formats {
            out.push_str(&format!(" {:>26}", f.format));
        }
        out.push('\n');
        type Cell<'a> = Box<dyn Fn(&FormatColdstart) -> String + 'a>;
        let rows: [(&str, Cell); 9] = [
            ("weights on disk", Box::new(|f| format!("{:.0} MiB", f.weights_mib))),
            (
                "read the files, page cache warm",
                Box::new(|f| ms(Some(f.file_read_warm_ms))),
            ),
            (
                "read the files, page cache dropped",
                Box::new(|f| ms(f.file_read_cold_ms)),
            ),
            (
                "one prefill of the prompt (loaded)",
                Box::new(|f| ms(Some(f.prefill_ms))),
            ),
            (
                "process start → ready (worker, model loaded)",
                Box::new(|f| ms(f.process_ready_ms)),
            ),
            (
                "cold model → first token (load cache)",
                Box::new(|f| format!("{:.1} ms = {:.2}x", f.first_token_warm_cache_ms, f.ratio_to_floor)),
            ),
            (
                "cold model → first token, no load cache",
                Box::new(|f| ms(f.first_token_no_pack_cache_ms)),
            ),
            (
                "cold model → first token, cold disk",
                Box::new(|f| match (f.first_token_cold_disk_ms, f.ratio_to_floor_cold) {
                    (Some(t), Some(r)) => format!("{t:.1} ms = {r:.2}x"),
                    _ => "—".into(),
                }),
            ),
            (
                "target: first token ≤ 1.2x (read + prefill)",
                Box::new(|f| {
                    if f.ratio_to_floor <= 1.2 {
                        "met".into()
                    } else {
                        "MISSED".into()
                    }
                }),
            ),
        ];
        for (name, cell) in rows {
            out.push_str(&format!("  {name:<44}"));
            for f in &self.formats {
                out.push_str(&format!(" {:>26}", cell(f)));
            }
            out.push('\n');
        }
        out.push_str("  (x: against the same format's file read + prefill; safetensors: float weights quantized to Q8_0 at load, then cached like a GGUF's repacking)\n");
        let a = &self.alternating;
        out.push_str(&format!(
            "alternating workload: {} models, room for {}, {} requests from 3 clients: {} answered, {} failed {:?}, {} loads, p50 {:.0} ms, max {:.0} ms ({})\n",
            a.models,
            a.room_for,
            a.requests,
            a.answered,
            a.failed.len(),
            a.failed,
            a.loads,
            a.p50_ms,
            a.max_ms,
            if a.answered == a.requests { "target met: none lost" } else { "target MISSED" }
        ));
        out
    }
}

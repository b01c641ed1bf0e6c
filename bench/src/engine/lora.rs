//! `hearth bench lora`: serving many LoRA adapters beside the base model on one engine.
//!
//! Rank-`r` PEFT adapters on every q/k/v/o/gate/up/down projection, seeded random weights
//! written here for the model's shapes. Three ways to serve the same `streams` requests
//! (distinct prompts, greedy, a fixed number of tokens each):
//! * **base**: every stream on the base model, all at once (the ceiling);
//! * **mixed**: the streams spread over `adapters` adapters, all at once, so that each step
//!   mixes them (the base GEMMs once for all rows, plus each row's low-rank terms);
//! * **one adapter at a time**: the same requests served adapter by adapter, each
//!   adapter's streams together (what a server that batches only one adapter does).
//!
//! Throughput is aggregate decode tokens per second: generated tokens after each stream's
//! first, over the time from the last stream's first token to the last token (so prefill
//! is left out); for one adapter at a time, summed over the rounds.
//!
//! Then a cold adapter's first token (read from disk, checked, loaded, then the prompt's
//! prefill) against a warm one's (the prefill only), on fresh prompts.

use std::path::Path;
use std::time::{Duration, Instant};

use hearth_protocol::{AdapterRef, GenerateEvent, GenerateRequest, SamplingParams};
use serde::Serialize;

use hearth_engine::models::{lora, ModelConfig};
use hearth_engine::{EngineConfig, EngineError, EngineHandle};

#[derive(Debug, Clone, Serialize)]
pub struct LoraReport {
    pub model: String,
    pub isa: String,
    pub cpu: String,
    pub threads: usize,
    pub streams: usize,
    pub adapters: usize,
    pub rank: usize,
    pub tokens_per_stream: usize,
    /// One adapter's bytes in memory.
    pub adapter_bytes: usize,
    pub modes: Vec<ModeRow>,
    /// Mixed ÷ base (target ≥ 0.8).
    pub mixed_vs_base: f64,
    /// Mixed ÷ one adapter at a time (target ≥ 4).
    pub mixed_vs_one_at_a_time: f64,
    /// Every stream's tokens the same in the mixed and one-at-a-time modes.
    pub identical: bool,
    pub cold: ColdStart,
}

#[derive(Debug, Clone, Serialize)]
pub struct ModeRow {
    pub mode: String,
    pub decode_tokens: usize,
    pub seconds: f64,
    pub tokens_per_s: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct ColdStart {
    pub prompt_tokens: usize,
    pub samples: usize,
    /// Medians: first token with the adapter loaded on demand, and already loaded.
    pub cold_ms: f64,
    pub warm_ms: f64,
    /// Cold ÷ warm (target ≤ 1.2).
    pub ratio: f64,
    /// Reading, checking and loading the adapter alone (the engine's own count).
    pub load_ms: f64,
}

impl LoraReport {
    pub fn table(&self) -> String {
        let mut s = format!(
            "hearth bench lora — {} — isa {} ({}) — {} threads; {} streams × {} tokens over {} rank-{} adapters ({:.1} MiB each, q/k/v/o/gate/up/down)\n",
            self.model,
            self.isa,
            self.cpu,
            self.threads,
            self.streams,
            self.tokens_per_stream,
            self.adapters,
            self.rank,
            self.adapter_bytes as f64 / (1 << 20) as f64
        );
        s += "  mode                          decode tokens   seconds   tokens/s\n";
        for m in &self.modes {
            s += &format!(
                "  {:<30}{:>13}{:>10.2}{:>11.1}\n",
                m.mode, m.decode_tokens, m.seconds, m.tokens_per_s
            );
        }
        s += &format!(
            "  mixed ÷ base {:.2}× (target ≥ 0.8×); mixed ÷ one adapter at a time {:.2}× (target ≥ 4×); outputs identical across modes: {}\n",
            self.mixed_vs_base, self.mixed_vs_one_at_a_time, self.identical
        );
        s += &format!(
            "  first token, {}-token prompt, medians of {}: adapter cold {:.1} ms, warm {:.1} ms → {:.2}× (target ≤ 1.2×); loading alone {:.1} ms\n",
            self.cold.prompt_tokens,
            self.cold.samples,
            self.cold.cold_ms,
            self.cold.warm_ms,
            self.cold.ratio,
            self.cold.load_ms
        );
        s
    }
}

/// Writes a PEFT adapter of rank `rank` for a dense model's shapes (seeded random weights,
/// F32), as `bench/synth_lora.py` does for the tests.
pub fn write_synthetic_adapter(c: &ModelConfig, rank: usize, seed: u64, dir: &Path) -> std::io::Result<()> {
    let (d, q, kv, ff) = (c.d_model, c.q_dim(), c.kv_dim(), c.n_ff);
    let mut rng = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut normal = |std: f32| {
        // Sum of uniforms (Irwin–Hall, 4 terms), scaled to the standard deviation.
        let mut u = 0f32;
        for _ in 0..4 {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            u += (rng >> 40) as f32 / (1u64 << 24) as f32;
        }
        (u - 2.0) * std * 3f32.sqrt()
    };
    let modules = [
        ("self_attn.q_proj", q, d),
        ("self_attn.k_proj", kv, d),
        ("self_attn.v_proj", kv, d),
        ("self_attn.o_proj", d, q),
        ("mlp.gate_proj", ff, d),
        ("mlp.up_proj", ff, d),
        ("mlp.down_proj", d, ff),
    ];
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for l in 0..c.n_layers {
        for (m, out, inp) in modules {
            let name = format!("base_model.model.model.layers.{l}.{m}");
            let a: Vec<f32> = (0..rank * inp).map(|_| normal(1.0 / (inp as f32).sqrt())).collect();
            let b: Vec<f32> = (0..out * rank).map(|_| normal(0.02)).collect();
            let bytes = |v: Vec<f32>| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
            tensors.push((format!("{name}.lora_A.weight"), vec![rank, inp], bytes(a)));
            tensors.push((format!("{name}.lora_B.weight"), vec![out, rank], bytes(b)));
        }
    }
    std::fs::create_dir_all(dir)?;
    let views = tensors.iter().map(|(n, shape, data)| {
        let v = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), data)
            .expect("a tensor's shape matches its bytes");
        (n.clone(), v)
    });
    safetensors::serialize_to_file(views, None, &dir.join("adapter_model.safetensors"))
        .map_err(|e| std::io::Error::other(e.to_string()))?;
    let config = serde_json::json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        "bias": "none",
        "use_rslora": false,
    });
    std::fs::write(dir.join("adapter_config.json"), serde_json::to_vec_pretty(&config)?)
}

/// One stream's result: its tokens, and when each came.
struct Stream {
    tokens: Vec<u32>,
    times: Vec<Instant>,
}

async fn stream(
    e: &EngineHandle,
    prompt: Vec<u32>,
    adapter: Option<AdapterRef>,
    tokens: usize,
) -> Result<Stream, EngineError> {
    let mut rx = e.generate(GenerateRequest {
        request_id: "bench-lora".into(),
        model: e.info().model.clone(),
        prompt,
        sampling: SamplingParams {
            temperature: 0.0,
            max_tokens: tokens as u32,
            ignore_eos: true,
            speculative: false,
            ..Default::default()
        },
        cache_namespace: "bench".into(),
        n: 1,
        prefill_only: false,
        resume: Vec::new(),
        kv_source: None,
        qos: Default::default(),
        constraint: None,
        adapter,
    });
    let (mut out, mut times) = (Vec::new(), Vec::new());
    while let Some(ev) = rx.recv().await {
        match ev {
            GenerateEvent::Token { id, .. } => {
                times.push(Instant::now());
                out.push(id);
            }
            GenerateEvent::Done { .. } => break,
            GenerateEvent::Error { code, message } => return Err(EngineError::Start(format!("{code}: {message}"))),
            GenerateEvent::Finish { .. } => {}
        }
    }
    if out.is_empty() {
        return Err(EngineError::Start("a stream ended without a token".into()));
    }
    Ok(Stream { tokens: out, times })
}

/// Runs these streams at once: their tokens, and (decode tokens, seconds).
async fn together(
    e: &EngineHandle,
    jobs: Vec<(Vec<u32>, Option<AdapterRef>)>,
    tokens: usize,
) -> Result<(Vec<Vec<u32>>, usize, f64), EngineError> {
    let runs = futures_util::future::join_all(jobs.into_iter().map(|(p, a)| stream(e, p, a, tokens))).await;
    let runs: Vec<Stream> = runs.into_iter().collect::<Result<_, _>>()?;
    // From the last stream's first token: every prompt is in, only decoding remains.
    let start = runs.iter().map(|s| s.times[0]).max().expect("streams");
    let end = *runs.iter().filter_map(|s| s.times.last()).max().expect("streams");
    let decoded: usize = runs
        .iter()
        .map(|s| s.times.iter().filter(|&&t| t > start).count())
        .sum();
    let seconds = (end - start).as_secs_f64().max(1e-9);
    Ok((runs.into_iter().map(|s| s.tokens).collect(), decoded, seconds))
}

#[allow(clippy::too_many_arguments)]
pub async fn run(
    model_path: &Path,
    model_id: &str,
    cfg: &EngineConfig,
    streams: usize,
    adapters: usize,
    rank: usize,
    tokens: usize,
    quick: bool,
) -> Result<LoraReport, EngineError> {
    let file = hearth_engine::formats::hf::open_model(model_path)?;
    let c = ModelConfig::from_gguf(&file)?;
    drop(file);
    let vocab = c.vocab_size as u32;
    let dir = std::env::temp_dir().join(format!("hearth-bench-lora-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut refs = Vec::new();
    // The adapters served, and one more per cold-start sample.
    let samples = if quick { 3 } else { 5 };
    for i in 0..adapters + samples {
        let p = dir.join(format!("adapter-{i}"));
        write_synthetic_adapter(&c, rank, i as u64 + 1, &p).map_err(|e| EngineError::Start(e.to_string()))?;
        refs.push(AdapterRef {
            name: format!("{model_id}:adapter-{i}"),
            digest: lora::digest(&p).map_err(|e| EngineError::Start(e.to_string()))?,
            path: p.display().to_string(),
        });
    }
    let mut cfg = cfg.clone();
    cfg.adapters.max_loaded = cfg.adapters.max_loaded.max(adapters + samples + 1);
    cfg.adapters.store = Some(dir.clone());
    cfg.max_running = cfg.max_running.max(streams);
    let e = EngineHandle::load(model_path, model_id, &cfg)?;
    // Distinct prompts (no prefix is shared between streams or modes).
    let mut salt = 0u32;
    let mut prompt = |len: usize| -> Vec<u32> {
        salt += 1;
        (0..len as u32)
            .map(|i| (salt * 7919 + i * 104_729) % (vocab - 1) + 1)
            .collect()
    };
    let warm: Vec<(Vec<u32>, Option<AdapterRef>)> = (0..adapters).map(|a| (prompt(8), Some(refs[a].clone()))).collect();
    together(&e, warm, 2).await?; // loads every adapter; warms the kernels
    let prompt_len = 32;
    let assign: Vec<Option<usize>> = (0..streams).map(|s| Some(s % adapters.max(1))).collect();
    let base_jobs = (0..streams).map(|_| (prompt(prompt_len), None)).collect();
    let (_, base_tokens, base_s) = together(&e, base_jobs, tokens).await?;
    let prompts: Vec<Vec<u32>> = (0..streams).map(|_| prompt(prompt_len)).collect();
    let mixed_jobs = prompts
        .iter()
        .zip(&assign)
        .map(|(p, a)| (p.clone(), a.map(|a| refs[a].clone())))
        .collect();
    let (mixed_out, mixed_tokens, mixed_s) = together(&e, mixed_jobs, tokens).await?;
    // The same requests adapter by adapter (their prompts now cached: only decoding is
    // measured, and the outputs must not change).
    let mut one_out = vec![Vec::new(); streams];
    let (mut one_tokens, mut one_s) = (0, 0.0);
    for (a, r) in refs.iter().enumerate().take(adapters) {
        let idx: Vec<usize> = (0..streams).filter(|&s| assign[s] == Some(a)).collect();
        let jobs = idx.iter().map(|&s| (prompts[s].clone(), Some(r.clone()))).collect();
        let (out, n, s) = together(&e, jobs, tokens).await?;
        one_tokens += n;
        one_s += s;
        for (i, o) in idx.into_iter().zip(out) {
            one_out[i] = o;
        }
    }
    let rate = |n: usize, s: f64| n as f64 / s;
    let modes = vec![
        ModeRow {
            mode: "base model".into(),
            decode_tokens: base_tokens,
            seconds: base_s,
            tokens_per_s: rate(base_tokens, base_s),
        },
        ModeRow {
            mode: format!("{adapters} adapters mixed"),
            decode_tokens: mixed_tokens,
            seconds: mixed_s,
            tokens_per_s: rate(mixed_tokens, mixed_s),
        },
        ModeRow {
            mode: "one adapter at a time".into(),
            decode_tokens: one_tokens,
            seconds: one_s,
            tokens_per_s: rate(one_tokens, one_s),
        },
    ];
    let identical = mixed_out == one_out;
    // Cold against warm first token, fresh prompts each time.
    let cold_len = if quick { 128 } else { 256 };
    let (mut cold, mut warm) = (Vec::new(), Vec::new());
    let loads_before = e.stats();
    for i in 0..samples {
        let r = refs[adapters + i].clone();
        let t = Instant::now();
        stream(&e, prompt(cold_len), Some(r.clone()), 1).await?;
        cold.push(t.elapsed().as_secs_f64() * 1e3);
        let t = Instant::now();
        stream(&e, prompt(cold_len), Some(r), 1).await?;
        warm.push(t.elapsed().as_secs_f64() * 1e3);
    }
    tokio::time::sleep(Duration::from_millis(60)).await; // the stats after the last step
    let after = e.stats();
    let load_ms = {
        let loads = after.adapter_loads.saturating_sub(loads_before.adapter_loads).max(1);
        (after.adapter_load_seconds - loads_before.adapter_load_seconds) * 1e3 / loads as f64
    };
    let adapter_bytes = after.adapter_bytes / after.adapters_loaded.max(1);
    let _ = std::fs::remove_dir_all(&dir);
    let (cold_ms, warm_ms) = (super::median(cold), super::median(warm));
    Ok(LoraReport {
        model: model_id.to_string(),
        isa: hearth_engine::kernels::isa().to_string(),
        cpu: hearth_engine::kernels::cpu_features(),
        threads: cfg.threads,
        streams,
        adapters,
        rank,
        tokens_per_stream: tokens,
        adapter_bytes,
        mixed_vs_base: rate(mixed_tokens, mixed_s) / rate(base_tokens, base_s),
        mixed_vs_one_at_a_time: rate(mixed_tokens, mixed_s) / rate(one_tokens, one_s),
        modes,
        identical,
        cold: ColdStart {
            prompt_tokens: cold_len,
            samples,
            cold_ms,
            warm_ms,
            ratio: cold_ms / warm_ms,
            load_ms,
        },
    })
}

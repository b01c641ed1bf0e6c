//! `hearth bench pipeline`: a model served by 2 pipeline stages (the leader in this process,
//! stage 2 a `hearth worker --stage 2/2` process, each with `threads / 2` threads) against
//! one process with all the threads, in one run: prefill of 512 tokens, decode of one
//! stream, aggregate decode at 32 streams; the activation channel's hop on loopback (one
//! frame of 32 rows at the model's width, and one token's round: a row out, its logits
//! back); and each stage's share of the weights.

use std::io::{BufRead, BufReader};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde::Serialize;

use hearth_engine::models::stage::{resident_bytes, StageSpan};
use hearth_engine::models::{ModelConfig, StagePlan};
use hearth_engine::pipeline::wire::{self, Kind};
use hearth_engine::pipeline::PipelineConfig;
use hearth_engine::step::sampling::Rng;
use hearth_engine::{EngineConfig, EngineHandle};

use super::{decode_streams, prompt, run_one};

#[derive(Debug, Serialize)]
pub struct Row {
    pub metric: String,
    pub one_process: f64,
    pub two_stages: f64,
    pub ratio: f64,
    pub target: f64,
}

#[derive(Debug, Serialize)]
pub struct PipelineReport {
    pub model: String,
    pub isa: String,
    pub threads: usize,
    pub rows: Vec<Row>,
    /// One frame of 32 rows at d_model, loopback, one way (µs).
    pub hop_32_rows_us: f64,
    /// One decode token's channel round: a row's hidden state out, its logits back (µs).
    pub hop_token_us: f64,
    /// Each stage's layers and its share of the weights it maps.
    pub stages: Vec<(String, f64)>,
    /// Stage 2's resident memory (MiB) and the model file's size.
    pub stage2_rss_mib: f64,
    pub file_mib: f64,
}

struct Killed(Child);
impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts stage 2 of 2 as a process of `exe`; its address.
fn stage_two(exe: &Path, path: &Path, threads: usize, kv_mib: usize, token: &str) -> anyhow::Result<(Killed, String)> {
    let mut child = Command::new(exe)
        .args(["worker", "--model"])
        .arg(path)
        .args(["--stage", "2/2", "--stage-listen", "127.0.0.1:0", "--threads"])
        .arg(threads.to_string())
        .args(["--kv-cache-mib", &kv_mib.to_string()])
        .env("HEARTH_WORKER_TOKEN", token)
        .env("HEARTH_LOG", "warn")
        .stdout(Stdio::piped())
        .spawn()?;
    let out = child.stdout.take().expect("piped");
    let child = Killed(child);
    for line in BufReader::new(out).lines() {
        let line = line?;
        if let Some(addr) = line.split("listening on ").nth(1) {
            return Ok((child, addr.trim().to_string()));
        }
    }
    anyhow::bail!("stage 2 exited before listening")
}

/// Prefill tokens/s (512), one stream's decode tokens/s, 32 streams' aggregate tokens/s.
async fn measure(e: &EngineHandle, rng: &mut Rng, tag: &str) -> [f64; 3] {
    let vocab = e.info().tokenizer.tokens.len() as u32;
    // Warm-up.
    run_one(e, prompt(rng, 64, vocab), 4, format!("{tag}-warm"), false).await;
    let t = run_one(e, prompt(rng, 512, vocab), 1, format!("{tag}-prefill"), false).await;
    let prefill = 512.0 / (t.tokens[0] - t.start).as_secs_f64();
    let t = run_one(e, prompt(rng, 16, vocab), 65, format!("{tag}-one"), false).await;
    let one = 64.0 / (t.tokens[64] - t.tokens[0]).as_secs_f64();
    let many = decode_streams(e, rng, 32, 33, &format!("{tag}-32"), false).await;
    [prefill, one, many]
}

/// A frame's one-way time on loopback: `out` floats there, `back` floats back, halved
/// when both are equal (a ping-pong), else the round (µs, median of 200).
fn hop_us(out: usize, back: usize) -> anyhow::Result<f64> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    let addr = l.local_addr()?;
    let echo = std::thread::spawn(move || -> anyhow::Result<()> {
        let (mut s, _) = l.accept()?;
        s.set_nodelay(true)?;
        let reply = vec![0.5f32; back];
        while let Ok(f) = wire::read_frame(&mut s) {
            wire::write_frame(&mut s, Kind::Result, f.seq, &[wire::float_bytes(&reply)])?;
        }
        Ok(())
    });
    let mut s = TcpStream::connect(addr)?;
    s.set_nodelay(true)?;
    let payload = vec![0.25f32; out];
    let mut times = Vec::new();
    for i in 0..220 {
        let t = Instant::now();
        wire::write_frame(&mut s, Kind::Step, i, &[wire::float_bytes(&payload)])?;
        wire::read_frame(&mut s)?;
        if i >= 20 {
            times.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    drop(s);
    let _ = echo.join();
    let round = super::median(times);
    Ok(if out == back { round / 2.0 } else { round })
}

pub async fn run(exe: &Path, path: &Path, model_id: &str, cfg: &EngineConfig) -> anyhow::Result<PipelineReport> {
    let threads = cfg.threads.max(2);
    let file = hearth_engine::formats::hf::open_model(path)?;
    let c = ModelConfig::from_gguf(&file)?;
    let whole = resident_bytes(&file, StageSpan::whole(c.n_layers)) as f64;
    let spans: Vec<StageSpan> = (0..2)
        .map(|i| StagePlan::Balanced { index: i, count: 2 }.resolve(&file, &c))
        .collect::<Result<_, _>>()?;
    let stages = spans
        .iter()
        .map(|s| (s.to_string(), resident_bytes(&file, *s) as f64 / whole))
        .collect();
    let (d, vocab) = (c.d_model, c.vocab_size);
    drop(file);
    let kv_mib = cfg.kv_cache_mib.unwrap_or(512);
    let mut rng = Rng::new(7);
    let single = EngineHandle::load(
        path,
        model_id,
        &EngineConfig {
            threads,
            kv_cache_mib: Some(kv_mib),
            ..cfg.clone()
        },
    )?;
    let one = measure(&single, &mut rng, "one").await;
    drop(single);
    let token = wire::nonce();
    let (stage2, addr) = stage_two(exe, path, threads / 2, kv_mib, &token)?;
    let mut p = PipelineConfig::new(vec![addr], Some(token));
    p.connect_timeout = Duration::from_secs(600);
    let group = EngineHandle::load(
        path,
        model_id,
        &EngineConfig {
            threads: threads / 2,
            kv_cache_mib: Some(kv_mib),
            stage: Some(StagePlan::Balanced { index: 0, count: 2 }),
            pipeline: Some(p),
            ..cfg.clone()
        },
    )?;
    let mut rng = Rng::new(7);
    let two = measure(&group, &mut rng, "two").await;
    let stage2_rss_mib = std::fs::read_to_string(format!("/proc/{}/status", stage2.0.id()))
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        .map_or(0.0, |kib| kib / 1024.0);
    drop(group);
    drop(stage2);
    let names = [
        "prefill 512 (tok/s)",
        "decode, 1 stream (tok/s)",
        "decode, 32 streams (tok/s)",
    ];
    let targets = [0.85, 0.8, 0.85];
    let rows = (0..3)
        .map(|i| Row {
            metric: names[i].into(),
            one_process: one[i],
            two_stages: two[i],
            ratio: two[i] / one[i],
            target: targets[i],
        })
        .collect();
    Ok(PipelineReport {
        model: model_id.into(),
        isa: hearth_engine::kernels::isa().to_string(),
        threads,
        rows,
        hop_32_rows_us: hop_us(32 * d, 32 * d)?,
        hop_token_us: hop_us(d, vocab)?,
        stages,
        stage2_rss_mib,
        file_mib: std::fs::metadata(path)?.len() as f64 / (1 << 20) as f64,
    })
}

impl PipelineReport {
    pub fn table(&self) -> String {
        let mut s = format!(
            "pipeline: {} ({}), one process × {} threads against 2 stages × {} (stage 2 its own process, loopback TCP)\n",
            self.model,
            self.isa,
            self.threads,
            self.threads / 2
        );
        s += &format!(
            "{:<28} {:>12} {:>12} {:>7} {:>7}\n",
            "", "one process", "2 stages", "ratio", "target"
        );
        for r in &self.rows {
            s += &format!(
                "{:<28} {:>12.1} {:>12.1} {:>6.2}× {:>6.2}×\n",
                r.metric, r.one_process, r.two_stages, r.ratio, r.target
            );
        }
        s += &format!(
            "hop, 32 rows × d on loopback: {:.0} µs one way (target ≤ 100); one token's round (a row out, its logits back): {:.0} µs\n",
            self.hop_32_rows_us, self.hop_token_us
        );
        for (span, share) in &self.stages {
            s += &format!("stage {span}: {:.2}× the model's weights (target ≤ 0.55)\n", share);
        }
        s += &format!(
            "stage 2 resident: {:.0} MiB (file {:.0} MiB)\n",
            self.stage2_rss_mib, self.file_mib
        );
        s
    }
}

//! `hearth bench kld`: what the default load-time quantization of float weights costs in
//! accuracy. For each model given as a float (F16/BF16/F32) GGUF, the token distributions
//! along fixed texts (teacher-forced, every position) are computed by Hearth's engine
//! with the float path (`--float-weights float`: the reference), with load-time
//! quantization (`--float-weights q8_0`: float matrices quantized to Q8_0 at load, as
//! llama.cpp's quantizer chooses them; what the default, `auto`, does for a dense model —
//! a mixture of experts stays float by default) and, beside it, with llama.cpp's own Q8_0
//! file of the same model; each against the reference: mean and largest KL divergence,
//! and how often the top token agrees.

use std::path::{Path, PathBuf};

use hearth_engine::formats::gguf::GgufFile;
use hearth_engine::kv::pool::KvDtype;
use hearth_engine::models::{FloatWeights, ForwardScratch, LoadOptions, Model, Session};
use hearth_engine::step::sampling::argmax;
use hearth_protocol::Tokenizer;
use serde::Serialize;

/// The texts the distributions are taken along (teacher-forced).
const TEXTS: [&str; 4] = [
    "The capital of France is Paris, and the capital of Italy is Rome. Both cities are known for",
    "fn main() { let xs = vec![1, 2, 3]; for x in xs.iter() { println!(\"{}\", x * 2); } }",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Berlin\", \"unit\": \"celsius\"}}",
];

/// The target the issue sets for the default's mean KL divergence.
pub const MEAN_TARGET: f64 = 0.005;

/// One model's row.
#[derive(Debug, Serialize)]
pub struct KldRow {
    pub label: String,
    pub file: String,
    /// Positions compared.
    pub positions: usize,
    /// What the default (`auto`) does for this model: `q8_0` or `float`.
    pub default_is: String,
    /// Float quantized to Q8_0 at load against the float path.
    pub default_mean: f64,
    pub default_max: f64,
    pub default_top1: f64,
    /// llama.cpp's Q8_0 file against the same reference, where one was given.
    pub llamacpp_q8_0_mean: Option<f64>,
    pub llamacpp_q8_0_max: Option<f64>,
    pub llamacpp_q8_0_top1: Option<f64>,
}

#[derive(Debug, Serialize)]
pub struct KldReport {
    pub isa: String,
    pub rows: Vec<KldRow>,
    pub mean_target: f64,
}

/// A model to measure: its float file and, optionally, llama.cpp's Q8_0 file of it.
#[derive(Debug, Clone)]
pub struct KldModel {
    pub label: String,
    pub float: PathBuf,
    pub q8_0: Option<PathBuf>,
}

impl KldModel {
    /// `LABEL=FLOAT.gguf[,Q8_0.gguf]`.
    pub fn parse(s: &str) -> Result<Self, String> {
        let (label, files) = s.split_once('=').ok_or("expected LABEL=FLOAT.gguf[,Q8_0.gguf]")?;
        let mut parts = files.split(',');
        let float = PathBuf::from(parts.next().unwrap_or_default());
        Ok(KldModel {
            label: label.to_string(),
            float,
            q8_0: parts.next().map(PathBuf::from),
        })
    }
}

/// Log-softmax of `logits` (f64).
fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
    let sum: f64 = logits.iter().map(|&v| (v as f64 - max).exp()).sum();
    let log_z = max + sum.ln();
    logits.iter().map(|&v| v as f64 - log_z).collect()
}

/// KL(p ‖ q) from log-probabilities.
fn kl(p: &[f64], q: &[f64]) -> f64 {
    p.iter().zip(q).map(|(&a, &b)| a.exp() * (a - b)).sum::<f64>().max(0.0)
}

/// The logits at every position of every text (each text's tokens fed one at a time).
fn distributions(model: &Model, texts: &[Vec<u32>]) -> Vec<Vec<f32>> {
    let mut out = Vec::new();
    for ids in texts {
        let mut session = Session::with_kv(model, ids.len() + 8, ForwardScratch::default(), KvDtype::F32);
        for &t in ids {
            out.push(session.feed(&[t]));
        }
    }
    out
}

fn load(path: &Path, float_weights: FloatWeights) -> anyhow::Result<Model> {
    let opts = LoadOptions {
        pack_cache: hearth_engine::kernels::pack_cache::PackCache::OFF,
        float_weights,
        ..Default::default()
    };
    Ok(Model::load_options(GgufFile::open(path)?, opts)?)
}

/// (mean, max, top-1 agreement) of `got` against `reference`.
fn compare(reference: &[Vec<f32>], got: &[Vec<f32>]) -> (f64, f64, f64) {
    let (mut sum, mut max, mut same) = (0f64, 0f64, 0usize);
    for (r, g) in reference.iter().zip(got) {
        let d = kl(&log_softmax(r), &log_softmax(g));
        sum += d;
        max = max.max(d);
        same += usize::from(argmax(r) == argmax(g));
    }
    let n = reference.len().max(1) as f64;
    (sum / n, max, same as f64 / n)
}

pub fn run(models: &[KldModel]) -> anyhow::Result<KldReport> {
    let mut rows = Vec::new();
    for m in models {
        let file = GgufFile::open(&m.float)?;
        if file.tensors.iter().all(|t| t.ty.is_quantized()) {
            anyhow::bail!("{}: no float tensors (give the F16/BF16/F32 file)", m.float.display());
        }
        let spec = hearth_engine::tokenizer_spec(&file)?;
        let default_is = FloatWeights::Auto.resolve(file.has_routed_experts()).name().to_string();
        drop(file);
        let tok = Tokenizer::from_spec(&spec)?;
        let texts: Vec<Vec<u32>> = TEXTS.iter().map(|t| tok.encode(t)).collect();
        let reference = distributions(&load(&m.float, FloatWeights::Float)?, &texts);
        let default = distributions(&load(&m.float, FloatWeights::Q8_0)?, &texts);
        let (default_mean, default_max, default_top1) = compare(&reference, &default);
        let theirs = match &m.q8_0 {
            Some(q) => Some(compare(
                &reference,
                &distributions(&load(q, FloatWeights::Q8_0)?, &texts),
            )),
            None => None,
        };
        rows.push(KldRow {
            label: m.label.clone(),
            file: m.float.display().to_string(),
            positions: reference.len(),
            default_is,
            default_mean,
            default_max,
            default_top1,
            llamacpp_q8_0_mean: theirs.map(|t| t.0),
            llamacpp_q8_0_max: theirs.map(|t| t.1),
            llamacpp_q8_0_top1: theirs.map(|t| t.2),
        });
    }
    Ok(KldReport {
        isa: hearth_engine::kernels::isa().to_string(),
        rows,
        mean_target: MEAN_TARGET,
    })
}

impl KldReport {
    pub fn table(&self) -> String {
        let mut s = format!(
            "KL divergence against the float path (Hearth, {} kernels), teacher-forced along {} texts\n",
            self.isa,
            TEXTS.len()
        );
        s.push_str(&format!(
            "{:<18} {:>9} {:>8} | {:>12} {:>10} {:>7} | {:>12} {:>10} {:>7} | {}\n",
            "model", "positions", "default", "q8_0 mean", "max", "top-1", "llama Q8_0", "max", "top-1", "target"
        ));
        for r in &self.rows {
            let opt = |v: Option<f64>, pct: bool| match (v, pct) {
                (Some(v), true) => format!("{:.1} %", v * 100.0),
                (Some(v), false) => format!("{v:.5}"),
                (None, _) => "—".into(),
            };
            // The default's divergence: the q8_0 row's, or none where it computes floats.
            let q8_met = r.default_mean <= self.mean_target && r.llamacpp_q8_0_mean.is_none_or(|q| r.default_mean <= q);
            let verdict = match (r.default_is.as_str(), q8_met) {
                (_, true) => "met",
                ("float", false) => "met (float; q8_0: missed)",
                _ => "MISSED",
            };
            s.push_str(&format!(
                "{:<18} {:>9} {:>8} | {:>12.5} {:>10.5} {:>6.1} % | {:>12} {:>10} {:>7} | {}\n",
                r.label,
                r.positions,
                r.default_is,
                r.default_mean,
                r.default_max,
                r.default_top1 * 100.0,
                opt(r.llamacpp_q8_0_mean, false),
                opt(r.llamacpp_q8_0_max, false),
                opt(r.llamacpp_q8_0_top1, true),
                verdict
            ));
        }
        s.push_str(&format!(
            "(q8_0: float matrices quantized at load, what the default (`auto`) does for a dense model; a mixture stays float by default: KL 0. Target: the default's mean ≤ {} and no worse than llama.cpp's Q8_0 file)\n",
            self.mean_target
        ));
        s
    }
}

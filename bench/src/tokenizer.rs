//! `hearth bench tokenizer`: Hearth's tokenizer against Hugging Face's `tokenizers` crate on
//! the same vocabulary, one thread, side by side: encode and decode throughput on a fixed
//! mixed corpus (prose, code, JSON tool schemas, numbers, several scripts and emoji), cut
//! into request-sized chunks, and whether the two produce identical ids.

use std::time::Instant;

use hearth_protocol::{Tokenizer, TokenizerSpec};
use serde::Serialize;

/// Bytes per encode call (about one agent-sized message).
const CHUNK_BYTES: usize = 4096;

#[derive(Debug, Clone, Serialize)]
pub struct EngineResult {
    pub tokenizer: String,
    pub encode_mb_s: f64,
    pub encode_mtok_s: f64,
    pub decode_mb_s: f64,
    pub tokens: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct TokenizerReport {
    pub model: String,
    pub cpu: String,
    pub corpus_bytes: usize,
    pub chunk_bytes: usize,
    pub hearth: EngineResult,
    pub reference: EngineResult,
    /// Chunks whose ids differ between the two (0 expected).
    pub mismatched_chunks: usize,
    pub chunks: usize,
    /// Hearth's encode throughput over the reference's.
    pub encode_ratio: f64,
    pub decode_ratio: f64,
}

impl TokenizerReport {
    pub fn table(&self) -> String {
        let mut s = format!(
            "tokenizer: {} on {} ({} KiB corpus in {}-byte chunks, one thread)\n",
            self.model,
            self.cpu,
            self.corpus_bytes / 1024,
            self.chunk_bytes
        );
        s.push_str(&format!(
            "{:<26} {:>12} {:>12} {:>12} {:>10}\n",
            "", "encode MB/s", "encode Mtok/s", "decode MB/s", "tokens"
        ));
        for r in [&self.hearth, &self.reference] {
            s.push_str(&format!(
                "{:<26} {:>12.1} {:>12.2} {:>12.1} {:>10}\n",
                r.tokenizer, r.encode_mb_s, r.encode_mtok_s, r.decode_mb_s, r.tokens
            ));
        }
        s.push_str(&format!(
            "Hearth ÷ tokenizers: encode {:.2}×, decode {:.2}×; identical ids in {}/{} chunks\n",
            self.encode_ratio,
            self.decode_ratio,
            self.chunks - self.mismatched_chunks,
            self.chunks
        ));
        s
    }
}

/// The fixed corpus: deterministic, about `bytes` long.
pub fn corpus(bytes: usize) -> String {
    const PROSE: &str =
        "The committee met on Tuesday to review the quarterly figures. Revenue rose 4.7% to $12,345,678, \
        while costs fell; nobody expected that. \"It's the best quarter we've had,\" she said, and they'll publish the \
        report on 2026-12-01 at 09:30 UTC. Don't forget: the meeting's minutes aren't final until they're signed.\n\n";
    const CODE: &str = "fn main() {\n    let xs: Vec<u64> = (0..100).map(|i| i * i).collect();\n    for (i, x) in xs.iter().enumerate() {\n        if x % 7 == 0 { println!(\"{i}: {x:>8}\"); }\n    }\n}\n\ndef parse(line: str) -> dict[str, int]:\n    key, _, value = line.partition('=')\n    return {key.strip(): int(value or 0)}\n\n";
    const JSON: &str = "{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \"Current weather for a city\", \"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}, \"days\": {\"type\": \"integer\", \"minimum\": 1}}, \"required\": [\"city\"]}}}\n";
    const WORLD: &str = "日本語のテキストと中文文本混在。Привет, как дела? مرحبا بالعالم. Ünïcödé naïve café. 🚀🤖👩‍💻 ✅\n\t\t  indented\r\n";
    let parts = [PROSE, CODE, JSON, WORLD];
    let mut s = String::with_capacity(bytes + 1024);
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    while s.len() < bytes {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        s.push_str(parts[(seed % parts.len() as u64) as usize]);
        // Vary the numbers so that the corpus is not one repeated block.
        s.push_str(&format!("{} ", seed % 100_000));
    }
    s
}

/// Chunks of about `CHUNK_BYTES`, cut at character boundaries.
fn chunks(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut start = 0;
    while start < text.len() {
        let mut end = (start + CHUNK_BYTES).min(text.len());
        while !text.is_char_boundary(end) {
            end += 1;
        }
        out.push(&text[start..end]);
        start = end;
    }
    out
}

/// Seconds for one call of `f`, the best of enough repeats to fill ~`budget_s`.
fn best_of(budget_s: f64, mut f: impl FnMut()) -> f64 {
    let started = Instant::now();
    let mut best = f64::INFINITY;
    let mut runs = 0;
    while runs < 3 || (started.elapsed().as_secs_f64() < budget_s && runs < 50) {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed().as_secs_f64());
        runs += 1;
    }
    best
}

/// Runs the benchmark on `spec`'s vocabulary; `reference_json` is the same tokenizer as a
/// Hugging Face `tokenizer.json`.
pub fn run(model: &str, spec: &TokenizerSpec, reference_json: &str, quick: bool) -> anyhow::Result<TokenizerReport> {
    let hearth = Tokenizer::from_spec(spec)?;
    let reference = tokenizers::Tokenizer::from_bytes(reference_json.as_bytes())
        .map_err(|e| anyhow::anyhow!("the reference tokenizer: {e}"))?;
    let text = corpus(if quick { 256 << 10 } else { 1 << 20 });
    let pieces = chunks(&text);
    let budget = if quick { 1.0 } else { 3.0 };

    let mut ours: Vec<Vec<u32>> = Vec::new();
    let enc_h = best_of(budget, || ours = pieces.iter().map(|p| hearth.encode(p)).collect());
    let mut theirs: Vec<Vec<u32>> = Vec::new();
    let enc_r = best_of(budget, || {
        theirs = pieces
            .iter()
            .map(|p| {
                reference
                    .encode(*p, false)
                    .map(|e| e.get_ids().to_vec())
                    .unwrap_or_default()
            })
            .collect()
    });
    let mismatched = ours.iter().zip(&theirs).filter(|(a, b)| a != b).count();
    let dec_h = best_of(budget, || {
        for ids in &ours {
            std::hint::black_box(hearth.decode(ids, false).ok());
        }
    });
    let dec_r = best_of(budget, || {
        for ids in &theirs {
            std::hint::black_box(reference.decode(ids, false).ok());
        }
    });
    let mb = text.len() as f64 / 1e6;
    let result = |name: &str, enc: f64, dec: f64, ids: &[Vec<u32>]| {
        let tokens: usize = ids.iter().map(Vec::len).sum();
        EngineResult {
            tokenizer: name.to_string(),
            encode_mb_s: mb / enc,
            encode_mtok_s: tokens as f64 / 1e6 / enc,
            decode_mb_s: mb / dec,
            tokens,
        }
    };
    Ok(TokenizerReport {
        model: model.to_string(),
        cpu: hearth_engine::kernels::cpu_features(),
        corpus_bytes: text.len(),
        chunk_bytes: CHUNK_BYTES,
        hearth: result("hearth", enc_h, dec_h, &ours),
        reference: result("tokenizers (Hugging Face)", enc_r, dec_r, &theirs),
        mismatched_chunks: mismatched,
        chunks: pieces.len(),
        encode_ratio: enc_r / enc_h,
        decode_ratio: dec_r / dec_h,
    })
}

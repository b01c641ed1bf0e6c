//! `hearth bench load`: a model's first-ever load (no pack anywhere: parsed and repacked in
//! memory, page cache warm), several rounds, with the repacking rate; and a prepared pack's
//! cold start (`hearth model pack`, then the model's and the pack's pages dropped from the
//! page cache): load → first token against the time to read the bytes the load maps at the
//! drive's sequential rate, measured in the same run. `bench/load-compare` runs it beside
//! llama.cpp's load of the same file.

use std::path::Path;
use std::time::Instant;

use serde::Serialize;

use hearth_engine::formats::gguf::GgufFile;
use hearth_engine::kernels::pack_cache::{PackCache, PackMode};
use hearth_engine::models::{LoadOptions, Model};
use hearth_engine::{EngineConfig, EngineHandle};

use super::coldstart::{drop_page_cache, first_token_ms, request};

#[derive(Debug, Serialize)]
pub struct LoadReport {
    pub model: String,
    pub isa: String,
    pub threads: usize,
    pub file_mib: f64,
    /// Each round's whole load (open, parse, repack), seconds.
    pub load_s: Vec<f64>,
    /// Of which repacking.
    pub repack_s: Vec<f64>,
    pub packed_mib: f64,
    pub load_median_s: f64,
    /// Packed bytes per second of repacking (median round), GB/s.
    pub repack_gbs: f64,
    /// The prepared pack's cold start, where the page cache could be dropped.
    pub cold: Option<ColdPack>,
}

#[derive(Debug, Serialize)]
pub struct ColdPack {
    pub pack_mib: f64,
    /// Bytes the load reads: the pack, and the model file's header, vectors and embedding.
    pub read_mib: f64,
    /// The drive's sequential read rate, measured on the pack with its pages dropped.
    pub drive_mbs: f64,
    /// Cold model (pages dropped) → first token of a 16-token prompt.
    pub first_token_ms: f64,
    /// `read_mib` at `drive_mbs`.
    pub floor_ms: f64,
    /// first_token / floor: the target is ≤ 1.2.
    pub ratio: f64,
}

pub async fn run(path: &Path, model_id: &str, cfg: &EngineConfig, rounds: usize) -> anyhow::Result<LoadReport> {
    let file_mib = std::fs::metadata(path)?.len() as f64 / (1 << 20) as f64;
    // Warm the page cache: the first-ever load is measured on a cached file, as llama.cpp's.
    std::hint::black_box(std::fs::read(path)?.len());
    let (mut load_s, mut repack_s, mut packed) = (Vec::new(), Vec::new(), 0);
    for _ in 0..rounds.max(1) {
        let t = Instant::now();
        let opts = LoadOptions {
            pack_cache: PackCache::OFF,
            float_weights: cfg.float_weights,
            ..Default::default()
        };
        let model = Model::load_options(GgufFile::open(path)?, opts)?;
        load_s.push(t.elapsed().as_secs_f64());
        repack_s.push(model.repack_seconds());
        packed = model.packed_bytes();
    }
    let repack_median = super::median(repack_s.clone());
    let cold = cold_pack(path, model_id, cfg).await?;
    Ok(LoadReport {
        model: path.display().to_string(),
        isa: hearth_engine::kernels::isa().to_string(),
        threads: rayon::current_num_threads(),
        file_mib,
        load_median_s: super::median(load_s.clone()),
        load_s,
        repack_s,
        packed_mib: packed as f64 / (1 << 20) as f64,
        repack_gbs: packed as f64 / repack_median.max(1e-9) / 1e9,
        cold,
    })
}

/// The prepared pack's cold start (None where the page cache cannot be dropped).
async fn cold_pack(path: &Path, model_id: &str, cfg: &EngineConfig) -> anyhow::Result<Option<ColdPack>> {
    let dir = std::env::temp_dir().join(format!("hearth-bench-load-{}", std::process::id()));
    let _removed = super::RemovedDir(dir.clone());
    let cache = PackCache {
        mode: PackMode::Read,
        dir: Some(dir),
    };
    let prepared = Model::prepare_pack(
        GgufFile::open(path)?,
        LoadOptions {
            pack_cache: cache.clone(),
            float_weights: cfg.float_weights,
            ..Default::default()
        },
    )?;
    let pack = prepared.path;
    let pack_bytes = std::fs::metadata(&pack)?.len();
    // The drive's sequential rate: the pack read whole, its pages dropped first.
    if !drop_page_cache(&pack) {
        return Ok(None);
    }
    let t = Instant::now();
    let n = std::fs::read(&pack)?.len();
    let drive_mbs = n as f64 / t.elapsed().as_secs_f64() / 1e6;
    // What the load reads of the model file besides the pack: every tensor the pack does
    // not hold (vectors, the embedding) and the header before the first tensor.
    let file = GgufFile::open(path)?;
    let held = hearth_engine::kernels::pack_cache::cached_tensors(path, &cache).unwrap_or_default();
    let first = file.tensors.iter().map(|t| t.offset).min().unwrap_or(0) as u64;
    let model_read: u64 = first
        + file
            .tensors
            .iter()
            .filter(|t| !held.contains(&(t.offset as u64)) || t.name == "token_embd.weight")
            .map(|t| t.len as u64)
            .sum::<u64>();
    drop(file);
    let read_bytes = pack_bytes + model_read;
    if !(drop_page_cache(&pack) && drop_page_cache(path)) {
        return Ok(None);
    }
    let cold_cfg = EngineConfig {
        pack_cache: cache,
        kv_cache_mib: Some(64),
        ..cfg.clone()
    };
    let prompt: Vec<u32> = (0..16u32).map(|i| 100 + i * 7).collect();
    let t = Instant::now();
    let engine = {
        let (p, id, c) = (path.to_path_buf(), model_id.to_string(), cold_cfg.clone());
        tokio::task::spawn_blocking(move || EngineHandle::load(&p, &id, &c)).await??
    };
    let _ = first_token_ms(&engine, request(model_id, &prompt, "load-cold")).await;
    let first_token_ms = t.elapsed().as_secs_f64() * 1000.0;
    drop(engine);
    let floor_ms = read_bytes as f64 / (drive_mbs * 1e6) * 1000.0;
    Ok(Some(ColdPack {
        pack_mib: pack_bytes as f64 / (1 << 20) as f64,
        read_mib: read_bytes as f64 / (1 << 20) as f64,
        drive_mbs,
        first_token_ms,
        floor_ms,
        ratio: first_token_ms / floor_ms.max(1e-9),
    }))
}

impl LoadReport {
    pub fn table(&self) -> String {
        let mut s = format!(
            "model load, {} ({:.0} MiB), {} kernels, {} threads\n",
            self.model, self.file_mib, self.isa, self.threads
        );
        let list = |v: &[f64]| v.iter().map(|x| format!("{x:.3}")).collect::<Vec<_>>().join(" ");
        s.push_str(&format!(
            "  first-ever load (no pack, page cache warm)  median {:.3} s   rounds: {} s\n",
            self.load_median_s,
            list(&self.load_s)
        ));
        s.push_str(&format!(
            "  of which repacking                          {:.0} MiB at {:.2} GB/s (target ≥ 1.5)   rounds: {} s\n",
            self.packed_mib,
            self.repack_gbs,
            list(&self.repack_s)
        ));
        match &self.cold {
            Some(c) => s.push_str(&format!(
                "  prepared pack, page cache dropped: load → first token {:.0} ms; reads {:.0} MiB (pack {:.0}) at the drive's {:.0} MB/s = {:.0} ms: {:.2}x (target ≤ 1.2)\n",
                c.first_token_ms, c.read_mib, c.pack_mib, c.drive_mbs, c.floor_ms, c.ratio
            )),
            None => s.push_str("  prepared pack, cold: not measured (the page cache could not be dropped)\n"),
        }
        s
    }
}

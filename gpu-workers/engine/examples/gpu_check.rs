//! `hearth-gpu-check`: the CUDA backend checked against the CPU engine on one GPU, then
//! measured. Run by `bench/gpu-check` on a GPU machine (it is the engine alone, so it is
//! small enough to send there); prints a table and writes JSON. An example rather than a
//! binary, so that `cargo run` still finds the one binary, `hearth`.
//!
//! 1. Golden prompt (see `shared/reference/smollm2/GOLDEN.md`): the first position's logits
//!    on the GPU against the CPU engine's (top-5 set, top-1), then the greedy continuation
//!    on the GPU, each decode step's logits against the CPU's (decode steps replay CUDA
//!    graphs); every difference within 2% of the logits' scale. The model is loaded on the
//!    main thread and computed on another, as the engine does. Then KV blocks (one read
//!    back, written to a free block, copied on the device to a third: byte-identical) and
//!    graph replays of 3 and 8 rows (padded to buckets 4 and 8) against the same steps run
//!    eagerly.
//! 2. Prefill: one `--prefill-tokens` prompt in one step, the median of 5.
//! 3. Decode at each of `--streams`: that many sequences with `--prompt-tokens` cached,
//!    then `--decode-tokens` batched greedy steps (logits to the host, argmax there, as the
//!    engine samples), with CUDA graphs and without.
//!
//! Usage: `hearth-gpu-check --model MODEL.gguf [--json OUT] [--device N] [--streams 1,8,32]`

use std::time::Instant;

use hearth_engine::cuda::{plan, CudaCompute, CudaOptions};
use hearth_engine::formats::gguf::GgufFile;
use hearth_engine::models::{Batch, ForwardScratch, Model, Session};
use hearth_engine::step::sampling::argmax;
use serde_json::json;

const GOLDEN_PROMPT: [u32; 42] = [
    1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712, 8182, 2, 198,
    1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 19842, 281, 582, 6330, 30, 2, 198, 1, 520, 9531, 198,
];
const GOLDEN_ANSWER: [u32; 8] = [504, 3575, 282, 4649, 314, 7042, 30, 2];
const BLOCK_TOKENS: usize = hearth_protocol::DEFAULT_BLOCK_TOKENS;

struct Args {
    model: String,
    json: Option<String>,
    device: usize,
    streams: Vec<usize>,
    prompt_tokens: usize,
    decode_tokens: usize,
    prefill_tokens: usize,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        model: String::new(),
        json: None,
        device: 0,
        streams: vec![1, 8, 32],
        prompt_tokens: 128,
        decode_tokens: 64,
        prefill_tokens: 512,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = || it.next().ok_or(format!("{flag} needs a value"));
        let num = |v: String| v.parse::<usize>().map_err(|e| format!("{v}: {e}"));
        match flag.as_str() {
            "--model" => a.model = val()?,
            "--json" => a.json = Some(val()?),
            "--device" => a.device = num(val()?)?,
            "--streams" => {
                a.streams = val()?
                    .split(',')
                    .map(|s| s.trim().parse().map_err(|e| format!("{s}: {e}")))
                    .collect::<Result<_, _>>()?
            }
            "--prompt-tokens" => a.prompt_tokens = num(val()?)?,
            "--decode-tokens" => a.decode_tokens = num(val()?)?,
            "--prefill-tokens" => a.prefill_tokens = num(val()?)?,
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if a.model.is_empty() {
        return Err("--model MODEL.gguf is required".into());
    }
    if a.prompt_tokens == 0 || a.prefill_tokens == 0 || a.decode_tokens < 2 || a.streams.contains(&0) {
        return Err(
            "--prompt-tokens, --prefill-tokens and --streams must be at least 1, --decode-tokens at least 2".into(),
        );
    }
    Ok(a)
}

/// Sequences over disjoint block ranges of the device pool.
struct Seqs {
    tables: Vec<Vec<u32>>,
    next_block: u32,
}

impl Seqs {
    fn new() -> Self {
        Self {
            tables: Vec::new(),
            next_block: 0,
        }
    }
    fn add(&mut self, capacity: usize, pool: usize) -> Result<usize, String> {
        let n = capacity.div_ceil(BLOCK_TOKENS) as u32;
        if (self.next_block + n) as usize > pool {
            return Err(format!("the check needs more than the pool's {pool} KV blocks"));
        }
        self.tables.push((self.next_block..self.next_block + n).collect());
        self.next_block += n;
        Ok(self.tables.len() - 1)
    }
}

/// Feeds `tokens` at positions `start..` of sequence `seq` in one step; the last row's
/// logits.
fn prefill(gpu: &mut CudaCompute, seqs: &Seqs, seq: usize, start: usize, tokens: &[u32]) -> Result<Vec<f32>, String> {
    let positions: Vec<usize> = (start..start + tokens.len()).collect();
    let tables: Vec<&[u32]> = vec![&seqs.tables[seq]; tokens.len()];
    let batch = Batch {
        tokens,
        positions: &positions,
        tables: &tables,
        logit_rows: &[tokens.len() - 1],
        adapters: &[],
    };
    gpu.forward(&batch).map_err(|e| e.to_string())
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

fn top5(l: &[f32]) -> Vec<u32> {
    let mut idx: Vec<u32> = (0..l.len() as u32).collect();
    idx.sort_by(|a, b| l[*b as usize].total_cmp(&l[*a as usize]));
    idx.truncate(5);
    idx
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn run(a: &Args) -> Result<serde_json::Value, String> {
    let path = std::path::Path::new(&a.model);
    let open = || GgufFile::open(path).map_err(|e| e.to_string());
    let cpu_model = Model::load(open()?).map_err(|e| e.to_string())?;
    let gpu_model = Model::load_unpacked(open()?, Default::default()).map_err(|e| e.to_string())?;
    let context = gpu_model.config.context_length;
    let max_rows = a
        .prefill_tokens
        .max(a.streams.iter().copied().max().unwrap_or(1))
        .max(64);
    let t0 = Instant::now();
    let options = CudaOptions {
        ordinal: a.device,
        kv_cache_mib: Some(2048),
        max_rows,
        context,
        block_tokens: BLOCK_TOKENS,
        graphs: true,
    };
    let gpu = CudaCompute::new(&gpu_model, &options).map_err(|e| e.to_string())?;
    let load_s = t0.elapsed().as_secs_f64();
    let r = gpu.report().clone();
    println!(
        "device: {} (sm {}.{}, driver CUDA {}, NVRTC {:?}, kernels {}), weights {} MiB, KV {} MiB, loaded in {load_s:.2} s",
        r.name, r.compute_capability.0, r.compute_capability.1, r.driver_cuda, r.nvrtc, r.kernels, r.weights_mib, r.kv_cache_mib
    );
    // The engine computes on its own thread, not the one that loaded the model.
    std::thread::scope(|scope| {
        scope
            .spawn(|| measure(a, &cpu_model, gpu, load_s))
            .join()
            .map_err(|_| "the check panicked".to_string())?
    })
}

fn measure(a: &Args, cpu_model: &Model, mut gpu: CudaCompute, load_s: f64) -> Result<serde_json::Value, String> {
    let report = gpu.report().clone();
    let pool = report.kv_blocks;
    let vocab = cpu_model.config.vocab_size;
    let err = |e: hearth_engine::cuda::CudaError| e.to_string();

    // 1. Golden prompt against the CPU engine (float activations, f32 KV: the reference).
    let mut cpu = Session::new(cpu_model, 128, ForwardScratch::precise());
    let mut seqs = Seqs::new();
    let s0 = seqs.add(128, pool)?;
    let cpu_first = cpu.feed(&GOLDEN_PROMPT);
    let gpu_first = prefill(&mut gpu, &seqs, s0, 0, &GOLDEN_PROMPT)?;
    let scale = cpu_first.iter().fold(0f32, |m, v| m.max(v.abs()));
    let first_diff = max_abs_diff(&cpu_first, &gpu_first);
    let (cpu_top, gpu_top) = (top5(&cpu_first), top5(&gpu_first));
    let mut answer = vec![argmax(&gpu_first)];
    let mut step_diffs = Vec::new();
    while answer.len() < GOLDEN_ANSWER.len() {
        let tok = *answer.last().unwrap();
        let pos = GOLDEN_PROMPT.len() + answer.len() - 1;
        let cpu_l = cpu.feed(&[tok]);
        let tables: Vec<&[u32]> = vec![&seqs.tables[s0]];
        let batch = Batch {
            tokens: &[tok],
            positions: &[pos],
            tables: &tables,
            logit_rows: &[0],
            adapters: &[],
        };
        let gpu_l = gpu.forward(&batch).map_err(err)?;
        step_diffs.push(max_abs_diff(&cpu_l, &gpu_l));
        answer.push(argmax(&gpu_l));
    }
    let sorted = |v: &[u32]| {
        let mut v = v.to_vec();
        v.sort();
        v
    };
    let worst_decode = step_diffs.iter().copied().fold(0.0, f32::max);
    let golden_ok = answer == GOLDEN_ANSWER
        && gpu_top[0] == cpu_top[0]
        && sorted(&gpu_top) == sorted(&cpu_top)
        && first_diff.max(worst_decode) <= 0.02 * scale;
    println!(
        "golden: answer {answer:?} ({}), first-position top-5 GPU {gpu_top:?} CPU {cpu_top:?}, max |Δlogit| first {first_diff:.4}, decode steps {worst_decode:.4} (scale {scale:.2})",
        if answer == GOLDEN_ANSWER { "identical" } else { "DIFFERENT" },
    );

    // KV blocks: read, written elsewhere, copied on the device; byte-identical throughout.
    let t = seqs.add(2 * BLOCK_TOKENS, pool)?;
    let (src, dst, copy) = (seqs.tables[s0][0], seqs.tables[t][0], seqs.tables[t][1]);
    let bytes = gpu.read_block(src).map_err(err)?;
    let written = gpu.write_block(dst, &bytes).map_err(err)?;
    gpu.copy_block(dst, copy).map_err(err)?;
    let kv_ok = written
        && bytes.iter().any(|b| *b != 0)
        && gpu.read_block(dst).map_err(err)? == bytes
        && gpu.read_block(copy).map_err(err)? == bytes;
    println!(
        "KV blocks read/write/copy on the device: {}",
        if kv_ok { "identical" } else { "DIFFERENT" }
    );

    // Graph replays against eager runs of the same steps (the same positions rewritten).
    let (mut graph_diff, mut captured) = (0f32, true);
    for b in [3usize, 8] {
        let ids = (0..b).map(|_| seqs.add(64, pool)).collect::<Result<Vec<_>, _>>()?;
        for (i, &s) in ids.iter().enumerate() {
            let p: Vec<u32> = (0..32).map(|j| 200 + ((i * 17 + j) as u32 * 31) % 30000).collect();
            prefill(&mut gpu, &seqs, s, 0, &p)?;
        }
        let tables: Vec<&[u32]> = ids.iter().map(|&s| &seqs.tables[s][..]).collect();
        let tokens: Vec<u32> = (0..b as u32).map(|i| 300 + i).collect();
        let positions = vec![32usize; b];
        let rows: Vec<usize> = (0..b).collect();
        let batch = Batch {
            tokens: &tokens,
            positions: &positions,
            tables: &tables,
            logit_rows: &rows,
            adapters: &[],
        };
        gpu.set_graphs(false);
        let eager = gpu.forward(&batch).map_err(err)?;
        gpu.set_graphs(true);
        gpu.forward(&batch).map_err(err)?; // captures
        captured &= gpu.report().graphs; // a failed capture turns graphs off
        let replayed = gpu.forward(&batch).map_err(err)?;
        graph_diff = graph_diff.max(max_abs_diff(&eager, &replayed));
    }
    let graphs_ok = captured && graph_diff <= 1e-3 * scale;
    if !captured {
        println!("CUDA graph capture FAILED: graphs are off (see the log)");
    }
    println!("graph replay vs eager (3 and 8 rows): max |Δlogit| {graph_diff:.5}");

    // 2. Prefill.
    let prompt: Vec<u32> = (0..a.prefill_tokens).map(|i| 100 + (i as u32 * 7919) % 40000).collect();
    let sp = seqs.add(a.prefill_tokens, pool)?;
    prefill(&mut gpu, &seqs, sp, 0, &prompt)?; // warm-up: cuBLAS plans for these shapes
    let mut times = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        prefill(&mut gpu, &seqs, sp, 0, &prompt)?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let prefill_ms = median(times);
    println!(
        "prefill {} tokens: {prefill_ms:.2} ms ({:.0} tokens/s)",
        a.prefill_tokens,
        a.prefill_tokens as f64 / prefill_ms * 1e3
    );

    // 3. Decode.
    let mut decode = Vec::new();
    for &b in &a.streams {
        for graphs in [true, false] {
            gpu.set_graphs(graphs);
            let mut seqs = Seqs {
                tables: Vec::new(),
                next_block: seqs.next_block,
            };
            let ids = (0..b)
                .map(|_| seqs.add(a.prompt_tokens + a.decode_tokens + 1, pool))
                .collect::<Result<Vec<_>, _>>()?;
            let mut last = Vec::with_capacity(b);
            for (i, &s) in ids.iter().enumerate() {
                let p: Vec<u32> = (0..a.prompt_tokens)
                    .map(|j| 100 + ((i * 131 + j) as u32 * 7919) % 40000)
                    .collect();
                last.push(argmax(&prefill(&mut gpu, &seqs, s, 0, &p)?));
            }
            let rows: Vec<usize> = (0..b).collect();
            let tables: Vec<&[u32]> = ids.iter().map(|&s| &seqs.tables[s][..]).collect();
            let mut step = |pos: usize, last: &mut Vec<u32>| -> Result<(), String> {
                let positions = vec![pos; b];
                let batch = Batch {
                    tokens: last,
                    positions: &positions,
                    tables: &tables,
                    logit_rows: &rows,
                    adapters: &[],
                };
                let logits = gpu.forward(&batch).map_err(err)?;
                for (t, l) in last.iter_mut().zip(logits.chunks_exact(vocab)) {
                    *t = argmax(l);
                }
                Ok(())
            };
            step(a.prompt_tokens, &mut last)?; // warm-up (captures the graph)
            let t = Instant::now();
            for k in 1..a.decode_tokens {
                step(a.prompt_tokens + k, &mut last)?;
            }
            let secs = t.elapsed().as_secs_f64();
            let steps = a.decode_tokens - 1;
            let tps = (b * steps) as f64 / secs;
            // Graphs ran only if they stayed on and the batch fits a bucket (the buffers
            // hold every bucket: `run` sizes them for 64 rows or more).
            let replayed = gpu.report().graphs && plan::graph_bucket(b, &rows, usize::MAX).is_some();
            println!(
                "decode {b:>2} streams, graphs {:<3}: {:.3} ms/step, {tps:.0} tokens/s",
                if replayed { "on" } else { "off" },
                secs * 1e3 / steps as f64
            );
            decode.push(json!({
                "streams": b, "graphs": replayed, "ms_per_step": secs * 1e3 / steps as f64, "tokens_per_s": tps,
            }));
        }
    }
    Ok(json!({
        "device": report,
        "load_seconds": load_s,
        "ok": golden_ok && kv_ok && graphs_ok,
        "golden": {
            "ok": golden_ok,
            "answer": answer,
            "expected": GOLDEN_ANSWER,
            "top5_gpu": gpu_top,
            "top5_cpu": cpu_top,
            "max_abs_logit_diff_first": first_diff,
            "max_abs_logit_diff_decode": worst_decode,
            "logit_scale": scale,
        },
        "kv_blocks_identical": kv_ok,
        "graphs_captured": captured,
        "graph_vs_eager_max_abs_diff": graph_diff,
        "prefill": {"tokens": a.prefill_tokens, "ms": prefill_ms, "tokens_per_s": a.prefill_tokens as f64 / prefill_ms * 1e3},
        "decode": decode,
        "prompt_tokens": a.prompt_tokens,
        "decode_tokens": a.decode_tokens,
        "cpu_isa": hearth_engine::kernels::isa().to_string(),
    }))
}

fn main() {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("hearth-gpu-check: {e}");
            std::process::exit(2);
        }
    };
    match run(&args) {
        Ok(out) => {
            let text = serde_json::to_string_pretty(&out).unwrap_or_default();
            if let Some(p) = &args.json {
                if let Err(e) = std::fs::write(p, &text) {
                    eprintln!("hearth-gpu-check: writing {p}: {e}");
                }
            }
            let ok = out["ok"].as_bool() == Some(true);
            println!(
                "{}",
                if ok {
                    "GPU CHECK PASSED"
                } else {
                    "GPU CHECK FAILED: golden mismatch"
                }
            );
            std::process::exit(if ok { 0 } else { 1 });
        }
        Err(e) => {
            eprintln!("hearth-gpu-check: {e}");
            std::process::exit(1);
        }
    }
}

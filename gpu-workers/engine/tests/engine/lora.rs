//! LoRA adapters, differentially: seeded random PEFT adapters (`bench/synth_lora.py`, NumPy
//! and safetensors) applied by Hearth at run time give the tokens and logits of the base
//! model with the adapter merged into its weights by NumPy (exported as a Hugging Face
//! directory and loaded as a plain model); the GGUF LoRA form of the same weights gives the
//! same; a step mixing four adapters and the base model gives every sequence its tokens
//! alone, in the forward pass and through the engine (whose prefix cache keeps adapters
//! apart); and broken or mismatched adapters are refused with a message naming the problem.

use crate::harness::TempDir;
use std::path::Path;
use std::process::Command;
use std::sync::OnceLock;

use hearth_engine::engine::adapters::AdapterCacheConfig;
use hearth_engine::formats::gguf::GgufFile;
use hearth_engine::formats::hf::{self, export::ExportDtype};
use hearth_engine::kv::pool::{KvDtype, KvPool};
use hearth_engine::models::{lora, Batch, ForwardScratch, LoraAdapter, LoraError, LoraLimits, Model, Session};
use hearth_engine::{EngineConfig, EngineHandle};
use hearth_protocol::{AdapterRef, GenerateEvent, GenerateRequest, SamplingParams};

/// The default model exported as an F32 Hugging Face directory (once per test binary).
fn base_dir() -> &'static Path {
    static DIR: OnceLock<TempDir> = OnceLock::new();
    &DIR.get_or_init(|| {
        let dir = TempDir::new("base");
        let g = GgufFile::open(&crate::harness::default_model()).unwrap();
        hf::export::export(&g, &dir.0, ExportDtype::F32, 1).unwrap();
        dir
    })
    .0
}

/// `bench/synth_lora.py` under the reference venv.
fn synth_lora(args: &[&str]) {
    let python = crate::harness::reference().join("venv/bin/python");
    crate::harness::run(
        Command::new(python)
            .arg(crate::harness::repo().join("bench/synth_lora.py"))
            .args(args),
    );
}

fn adapter(out: &Path, rank: usize, seed: u64, extra: &[&str]) {
    let (rank, alpha, seed) = (rank.to_string(), (2 * rank).to_string(), seed.to_string());
    let mut args = vec![
        "adapter",
        base_dir().to_str().unwrap(),
        out.to_str().unwrap(),
        "--rank",
        &rank,
        "--alpha",
        &alpha,
        "--seed",
        &seed,
    ];
    args.extend(extra);
    synth_lora(&args);
}

const PROMPT: [u32; 12] = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3050, 30];

/// Greedy decoding: each step's logits and the tokens chosen.
fn greedy(mut s: Session<'_>, steps: usize) -> (Vec<Vec<f32>>, Vec<u32>) {
    let mut logits = s.feed(&PROMPT);
    let (mut all, mut tokens) = (Vec::new(), Vec::new());
    for _ in 0..steps {
        let t = argmax(&logits);
        all.push(logits);
        tokens.push(t);
        logits = s.feed(&[t]);
    }
    (all, tokens)
}

fn argmax(v: &[f32]) -> u32 {
    (0..v.len()).max_by(|&a, &b| v[a].total_cmp(&v[b])).unwrap() as u32
}

fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn session(m: &Model) -> Session<'_> {
    Session::new(m, 64, ForwardScratch::precise())
}

#[test]
fn peft_adapters_give_the_merged_models_tokens_and_logits() {
    let gguf = Model::load(GgufFile::open(&crate::harness::default_model()).unwrap()).unwrap();
    let hf_base = Model::load(hf::open(base_dir()).unwrap()).unwrap();
    let (base_logits, base_tokens) = greedy(session(&gguf), 12);
    for rank in [8, 16] {
        let dir = TempDir::new(&format!("peft-{rank}"));
        let (a, merged) = (dir.0.join("adapter"), dir.0.join("merged"));
        adapter(&a, rank, rank as u64, &[]);
        synth_lora(&[
            "merge",
            base_dir().to_str().unwrap(),
            a.to_str().unwrap(),
            merged.to_str().unwrap(),
        ]);
        let merged = Model::load(hf::open(&merged).unwrap()).unwrap();
        let (want_logits, want_tokens) = greedy(session(&merged), 12);
        // The adapter changes the model: a test that passed with it ignored would be void.
        let change = max_diff(&want_logits[..1], &base_logits[..1]);
        assert!(
            change > 0.5,
            "rank {rank}: the merged model's logits moved by only {change}"
        );
        // Applied at run time to the GGUF (Q/K rows permuted) and to the Hugging Face
        // directory (rows as trained).
        for (what, base) in [("GGUF", &gguf), ("Hugging Face", &hf_base)] {
            let lora = LoraAdapter::open(&a, base, LoraLimits::default()).unwrap();
            assert_eq!((lora.rank, lora.modules), (rank, 30 * 7));
            let (logits, tokens) = greedy(session(base).with_adapter(&lora), 12);
            let diff = max_diff(&logits, &want_logits);
            eprintln!(
                "rank {rank}, {what} base: max |Δlogit| vs merged {diff:.2e} (the adapter moves them by {change:.2}); tokens {tokens:?} (base {base_tokens:?})"
            );
            assert_eq!(tokens, want_tokens, "rank {rank} on the {what} base");
            // Adapters are kept in f16 (as servers compute them in the model's f16/bf16):
            // 1–3e-3 measured, where the adapter moves the logits by 3.5–4.
            assert!(diff < 1e-2, "rank {rank} on the {what} base: logits differ by {diff}");
        }
    }
}

#[test]
fn a_gguf_lora_gives_the_same_model_as_its_peft_form() {
    let gguf = Model::load(GgufFile::open(&crate::harness::default_model()).unwrap()).unwrap();
    let hf_base = Model::load(hf::open(base_dir()).unwrap()).unwrap();
    let dir = TempDir::new("gguf");
    let (a, file) = (dir.0.join("adapter"), dir.0.join("adapter.gguf"));
    adapter(&a, 8, 7, &["--gguf", file.to_str().unwrap(), "--gguf-arch", "llama"]);
    for base in [&gguf, &hf_base] {
        let peft = LoraAdapter::open(&a, base, LoraLimits::default()).unwrap();
        let ggml = LoraAdapter::open(&file, base, LoraLimits::default()).unwrap();
        assert_ne!(peft.digest, ggml.digest);
        let (want, want_tokens) = greedy(session(base).with_adapter(&peft), 6);
        let (got, tokens) = greedy(session(base).with_adapter(&ggml), 6);
        assert_eq!(tokens, want_tokens);
        let diff = max_diff(&got, &want);
        assert!(diff < 1e-4, "the GGUF form's logits differ by {diff}");
    }
}

#[test]
fn a_step_mixing_four_adapters_and_the_base_gives_each_sequence_its_solo_tokens() {
    let model = Model::load(GgufFile::open(&crate::harness::default_model()).unwrap()).unwrap();
    let dir = TempDir::new("mixed");
    let adapters: Vec<LoraAdapter> = [(8, 11), (16, 12), (8, 13), (16, 14)]
        .iter()
        .map(|&(rank, seed)| {
            let p = dir.0.join(format!("a{seed}"));
            adapter(&p, rank, seed, &[]);
            LoraAdapter::open(&p, &model, LoraLimits::default()).unwrap()
        })
        .collect();
    // Sequence i runs under adapter i; the fifth under the base model. Prompts differ in
    // length so that prefill rows of different sequences interleave unevenly.
    let which: Vec<Option<&LoraAdapter>> = adapters.iter().map(Some).chain([None]).collect();
    let prompts: Vec<Vec<u32>> = (0..which.len()).map(|i| PROMPT[..6 + i].to_vec()).collect();
    let steps = 8;
    let solo: Vec<Vec<u32>> = which
        .iter()
        .zip(&prompts)
        .map(|(a, p)| {
            let mut s = Session::with_kv(&model, 64, ForwardScratch::default(), KvDtype::F32);
            if let Some(a) = a {
                s = s.with_adapter(a);
            }
            let mut logits = s.feed(p);
            let mut out = Vec::new();
            for _ in 0..steps {
                let t = argmax(&logits);
                out.push(t);
                logits = s.feed(&[t]);
            }
            out
        })
        .collect();
    let distinct: std::collections::HashSet<&Vec<u32>> = solo.iter().collect();
    assert!(distinct.len() >= 4, "the adapters barely change the tokens: {solo:?}");
    // All five in one batch: prefill together, then decode together.
    let bt = hearth_protocol::DEFAULT_BLOCK_TOKENS;
    let per_seq = 64usize.div_ceil(bt);
    let mut pool = KvPool::new(model.kv_shape(bt), KvDtype::F32, per_seq * which.len());
    let tables: Vec<Vec<u32>> = (0..which.len())
        .map(|i| ((i * per_seq) as u32..((i + 1) * per_seq) as u32).collect())
        .collect();
    let mut scratch = ForwardScratch::default();
    let mut lens = vec![0usize; which.len()];
    let mut mixed: Vec<Vec<u32>> = vec![Vec::new(); which.len()];
    let mut next: Vec<Vec<u32>> = prompts.clone();
    for _ in 0..=steps {
        let (mut tokens, mut positions, mut row_tables, mut row_adapters, mut logit_rows) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (i, feed) in next.iter().enumerate() {
            for &t in feed {
                tokens.push(t);
                positions.push(lens[i]);
                row_tables.push(&tables[i][..]);
                row_adapters.push(which[i]);
                lens[i] += 1;
            }
            logit_rows.push(tokens.len() - 1);
        }
        let batch = Batch {
            tokens: &tokens,
            positions: &positions,
            tables: &row_tables,
            logit_rows: &logit_rows,
            adapters: &row_adapters,
        };
        let logits = model.forward_batch(&batch, &mut pool, &mut scratch);
        for (i, l) in logits.chunks_exact(model.config.vocab_size).enumerate() {
            let t = argmax(l);
            mixed[i].push(t);
            next[i] = vec![t];
        }
    }
    for m in &mut mixed {
        m.truncate(steps);
    }
    assert_eq!(mixed, solo);
}

fn refused(path: &Path, model: &Model, limits: LoraLimits) -> LoraError {
    match LoraAdapter::open(path, model, limits) {
        Ok(_) => panic!("{} was accepted", path.display()),
        Err(e) => e,
    }
}

#[test]
fn broken_and_mismatched_adapters_are_refused_by_name() {
    let model = Model::load(GgufFile::open(&crate::harness::default_model()).unwrap()).unwrap();
    let dir = TempDir::new("refused");
    let good = dir.0.join("good");
    adapter(&good, 8, 3, &["--layers", "0,1"]);
    let ok = LoraAdapter::open(&good, &model, LoraLimits::default()).unwrap();
    assert_eq!(ok.modules, 14);
    // Over the rank limit.
    let e = refused(
        &good,
        &model,
        LoraLimits {
            max_rank: 4,
            ..Default::default()
        },
    );
    assert!(
        matches!(e, LoraError::Limit(_)) && e.to_string().contains("rank 8"),
        "{e}"
    );
    // Over the size limit.
    let e = refused(
        &good,
        &model,
        LoraLimits {
            max_bytes: 1000,
            ..Default::default()
        },
    );
    assert!(
        matches!(e, LoraError::Limit(_)) && e.to_string().contains("limit"),
        "{e}"
    );
    // Truncated weights.
    let cut = dir.0.join("cut");
    std::fs::create_dir_all(&cut).unwrap();
    std::fs::copy(good.join("adapter_config.json"), cut.join("adapter_config.json")).unwrap();
    let bytes = std::fs::read(good.join("adapter_model.safetensors")).unwrap();
    std::fs::write(cut.join("adapter_model.safetensors"), &bytes[..bytes.len() / 2]).unwrap();
    let e = refused(&cut, &model, LoraLimits::default());
    assert!(
        matches!(e, LoraError::Invalid(_)) && e.to_string().contains("adapter_model.safetensors"),
        "{e}"
    );
    // Made for another model's shapes (a hidden size of 64).
    let other = dir.0.join("other-base");
    std::fs::create_dir_all(&other).unwrap();
    std::fs::write(
        other.join("config.json"),
        r#"{"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "num_hidden_layers": 2}"#,
    )
    .unwrap();
    let small = dir.0.join("small");
    synth_lora(&[
        "adapter",
        other.to_str().unwrap(),
        small.to_str().unwrap(),
        "--rank",
        "4",
    ]);
    let e = refused(&small, &model, LoraLimits::default());
    assert!(
        matches!(e, LoraError::Mismatch(_)) && e.to_string().contains("blk.0."),
        "{e}"
    );
    // Not a LoRA, or a variant Hearth does not compute.
    let config = std::fs::read_to_string(good.join("adapter_config.json")).unwrap();
    for (edit, want) in [
        (config.replace("\"LORA\"", "\"IA3\""), "peft_type"),
        (config.replace("\"use_dora\": false", "\"use_dora\": true"), "use_dora"),
        (config.replace("\"bias\": \"none\"", "\"bias\": \"all\""), "bias"),
        (
            config.replace("\"modules_to_save\": null", "\"modules_to_save\": [\"lm_head\"]"),
            "modules_to_save",
        ),
    ] {
        assert_ne!(edit, config, "{want}: the edit did not apply");
        let d = dir.0.join(want);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::copy(
            good.join("adapter_model.safetensors"),
            d.join("adapter_model.safetensors"),
        )
        .unwrap();
        std::fs::write(d.join("adapter_config.json"), edit).unwrap();
        let e = refused(&d, &model, LoraLimits::default());
        assert!(
            matches!(e, LoraError::Unsupported(_)) && e.to_string().contains(want),
            "{want}: {e}"
        );
    }
    // No adapter at all, and a GGUF that is a model rather than an adapter.
    let e = refused(&dir.0, &model, LoraLimits::default());
    assert!(e.to_string().contains("adapter_config.json"), "{e}");
    let e = refused(
        &crate::harness::default_model(),
        &model,
        LoraLimits {
            max_bytes: u64::MAX,
            ..Default::default()
        },
    );
    assert!(
        matches!(e, LoraError::Invalid(_)) && e.to_string().contains("not a GGUF LoRA"),
        "{e}"
    );
}

/// A greedy request under the tenant's namespace.
fn request(e: &EngineHandle, prompt: &[u32], adapter: Option<AdapterRef>, max_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        request_id: "lora".into(),
        model: e.info().model.clone(),
        prompt: prompt.to_vec(),
        sampling: SamplingParams {
            temperature: 0.0,
            max_tokens,
            ..Default::default()
        },
        cache_namespace: "tenant".into(),
        n: 1,
        prefill_only: false,
        resume: Vec::new(),
        kv_source: None,
        qos: Default::default(),
        constraint: None,
        adapter,
    }
}

/// One request on an engine: its tokens and cached prompt tokens, or the error code.
async fn generate(
    e: &EngineHandle,
    prompt: &[u32],
    adapter: Option<AdapterRef>,
    max_tokens: u32,
) -> Result<(Vec<u32>, u32), String> {
    let mut rx = e.generate(request(e, prompt, adapter, max_tokens));
    let mut tokens = Vec::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            GenerateEvent::Token { id, .. } => tokens.push(id),
            GenerateEvent::Done { usage, .. } => return Ok((tokens, usage.cached_tokens)),
            GenerateEvent::Error { code, .. } => return Err(code),
            GenerateEvent::Finish { .. } => {}
        }
    }
    Err("the stream ended without Done".into())
}

fn adapter_ref(name: &str, path: &Path) -> AdapterRef {
    AdapterRef {
        name: name.into(),
        digest: lora::digest(path).unwrap(),
        path: path.display().to_string(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engine_batches_adapters_and_keeps_their_prefix_caches_apart() {
    let dir = TempDir::new("engine");
    let refs: Vec<AdapterRef> = [(8, 21), (16, 22), (8, 23), (16, 24)]
        .iter()
        .map(|&(rank, seed)| {
            let p = dir.0.join(format!("a{seed}"));
            adapter(&p, rank, seed, &["--b-std", "0.05"]);
            adapter_ref(&format!("smollm2:a{seed}"), &p)
        })
        .collect();
    let cfg = EngineConfig {
        adapters: AdapterCacheConfig {
            store: Some(dir.0.clone()),
            max_loaded: 3,
            ..Default::default()
        },
        ..Default::default()
    };
    let e = EngineHandle::load(&crate::harness::default_model(), "smollm2", &cfg).unwrap();
    // Two blocks of prompt, the same for every adapter: a cache shared between adapters
    // would hand one adapter's KV to the next.
    let prompt: Vec<u32> = PROMPT
        .iter()
        .copied()
        .chain((0..28u32).map(|i| (i * 7919 + 13) % 40_000 + 100))
        .collect();
    let which: Vec<Option<AdapterRef>> = refs.iter().cloned().map(Some).chain([None]).collect();
    let mut solo = Vec::new();
    for a in &which {
        let (tokens, cached) = generate(&e, &prompt, a.clone(), 8).await.unwrap();
        assert_eq!(
            cached,
            0,
            "{:?} found another adapter's KV",
            a.as_ref().map(|a| &a.name)
        );
        solo.push(tokens);
    }
    let distinct: std::collections::HashSet<&Vec<u32>> = solo.iter().collect();
    assert!(distinct.len() >= 4, "the adapters barely change the tokens: {solo:?}");
    // Its own KV is reused: the second run of an adapter finds its prompt cached.
    let (again, cached) = generate(&e, &prompt, which[0].clone(), 8).await.unwrap();
    assert_eq!(again, solo[0]);
    assert!(cached >= 32, "adapter 0's own prefix was not reused ({cached} cached)");
    // All five at once, in shared steps; at most three adapters stay loaded (one was
    // unloaded and is loaded again).
    let together = futures_util::future::join_all(which.iter().map(|a| generate(&e, &prompt, a.clone(), 8))).await;
    let together: Vec<Vec<u32>> = together.into_iter().map(|r| r.unwrap().0).collect();
    assert_eq!(together, solo);
    // Five loads before (four adapters into three slots, then adapter 0 again); the fourth
    // concurrent adapter waited for a slot and was loaded again.
    let mut stats = e.stats();
    for _ in 0..100 {
        if stats.adapter_loads >= 6 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        stats = e.stats();
    }
    assert!(stats.adapters_loaded <= 3 && stats.adapter_loads >= 6, "{stats:?}");
    // Files that changed since the digest was taken, or are gone, are refused.
    let mut changed = refs[1].clone();
    changed.digest = "e".repeat(64);
    assert_eq!(
        generate(&e, &prompt, Some(changed), 2).await.unwrap_err(),
        "adapter_not_found"
    );
    let mut gone = refs[1].clone();
    gone.path = dir.0.join("missing").display().to_string();
    gone.digest = "0".repeat(64);
    assert_eq!(
        generate(&e, &prompt, Some(gone), 2).await.unwrap_err(),
        "adapter_not_found"
    );
    // Nothing outside the adapter store is read, whatever the request names (a loaded
    // adapter is found by its digest alone, so this one names a digest not loaded).
    let outside_dir = dir.0.join(format!("../hearth-lora-outside-{}", std::process::id()));
    adapter(&outside_dir, 8, 26, &[]);
    let mut outside = adapter_ref("smollm2:outside", &outside_dir);
    outside.path = outside_dir.canonicalize().unwrap().display().to_string();
    let refused = generate(&e, &prompt, Some(outside), 2).await.unwrap_err();
    assert_eq!(refused, "adapter_not_found");
    // A path relative to the store (an adapter not loaded yet, so the path is what finds it).
    let fresh = dir.0.join("fresh");
    adapter(&fresh, 8, 27, &[]);
    let mut relative = adapter_ref("smollm2:fresh", &fresh);
    relative.path = "fresh".into();
    let (tokens, _) = generate(&e, &prompt, Some(relative), 8).await.unwrap();
    assert_eq!(tokens.len(), 8);
    // An adapter removed from the store while its request runs: the request finishes; a new
    // request for it is refused, though it is still loaded.
    let doomed = dir.0.join("doomed");
    adapter(&doomed, 8, 25, &[]);
    let doomed_ref = adapter_ref("smollm2:doomed", &doomed);
    let mut rx = e.generate(request(&e, &prompt, Some(doomed_ref.clone()), 24));
    let (mut before, mut after, mut done) = (0, 0, false);
    while let Some(ev) = rx.recv().await {
        match ev {
            GenerateEvent::Token { .. } if before == 0 => {
                before = 1;
                std::fs::remove_dir_all(&doomed).unwrap();
            }
            GenerateEvent::Token { .. } => after += 1,
            GenerateEvent::Done { .. } => done = true,
            GenerateEvent::Error { code, message } => panic!("{code}: {message}"),
            GenerateEvent::Finish { .. } => {}
        }
    }
    assert!(done && after == 23, "{after} tokens after the removal");
    let refused = generate(&e, &prompt, Some(doomed_ref), 2).await.unwrap_err();
    assert_eq!(refused, "adapter_not_found");
}

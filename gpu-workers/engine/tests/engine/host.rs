//! The multi-model host with the real default model: one load for concurrent first
//! requests, no eviction of a busy model, scale to zero after the idle TTL, and a model
//! whose file went bad failing alone.

use std::path::PathBuf;
use std::time::Duration;

use hearth_engine::worker::host::{HostConfig, ModelEntry, ModelHost, ModelState};
use hearth_engine::{Backend, EngineConfig};
use hearth_protocol::{GenerateEvent, GenerateRequest, SamplingParams};

fn entry(id: &str, path: PathBuf, ttl: Option<Duration>) -> ModelEntry {
    ModelEntry {
        id: id.into(),
        path,
        idle_ttl: ttl,
        pinned: false,
        context_length: None,
        rope_scaling: None,
        memory_bytes: None,
        tenants: Vec::new(),
        chat_template: None,
        kv_disk_dir: None,
        kv_disk_gib: None,
    }
}

fn config(budget_models: Option<u64>) -> HostConfig {
    let file = std::fs::metadata(crate::harness::default_model()).unwrap().len();
    HostConfig {
        // Room for this many models of the default size (file + 16 MiB of KV) and a bit.
        memory_budget: budget_models.map(|n| n * (file + (16 << 20)) + (8 << 20)),
        load_timeout: Duration::from_secs(30),
        max_waiting: 64,
        engine: EngineConfig {
            threads: 2,
            kv_cache_mib: Some(16),
            ..Default::default()
        },
    }
}

/// Runs one request to its end: (tokens, error code).
async fn run(b: &dyn Backend, model: &str, max_tokens: u32) -> (usize, Option<String>) {
    let req = GenerateRequest {
        request_id: "t".into(),
        model: model.into(),
        prompt: vec![1, 9690, 198, 2683, 359, 253],
        sampling: SamplingParams {
            temperature: 0.0,
            max_tokens,
            ignore_eos: true,
            ..Default::default()
        },
        cache_namespace: String::new(),
        n: 1,
        prefill_only: false,
        resume: Vec::new(),
        kv_source: None,
        qos: Default::default(),
        constraint: None,
        adapter: None,
    };
    let mut rx = b.generate(req);
    let mut tokens = 0;
    while let Some(ev) = rx.recv().await {
        match ev {
            GenerateEvent::Token { .. } => tokens += 1,
            GenerateEvent::Done { .. } => return (tokens, None),
            GenerateEvent::Error { code, message } => {
                eprintln!("{code}: {message}");
                return (tokens, Some(code));
            }
            GenerateEvent::Finish { .. } => {}
        }
    }
    (tokens, Some("closed".into()))
}

/// Resident memory of this process (nextest runs each test in its own process).
fn rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kib = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:")?.split_whitespace().next()?.parse::<f64>().ok());
    kib.map_or(0.0, |kib| kib / 1024.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_first_requests_share_one_load() {
    let (host, failed) = ModelHost::new(vec![entry("a", crate::harness::default_model(), None)], config(None));
    assert!(failed.is_empty());
    let a = host.model("a").unwrap();
    assert_eq!(a.state(), ModelState::Cold);
    assert_eq!(a.info().model, "a");
    let runs: Vec<_> = (0..4)
        .map(|_| {
            let a = a.clone();
            tokio::spawn(async move { run(&a, "a", 4).await })
        })
        .collect();
    for r in runs {
        assert_eq!(r.await.unwrap(), (4, None));
    }
    assert_eq!(host.loads(), 1, "four concurrent first requests, one load");
    assert_eq!(a.state(), ModelState::Warm);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_model_is_never_evicted() {
    // Room for one model: B's request must wait for A's to finish, then evict A.
    let (host, _) = ModelHost::new(
        vec![
            entry("a", crate::harness::default_model(), None),
            entry("b", crate::harness::default_model(), None),
        ],
        config(Some(1)),
    );
    let (a, b) = (host.model("a").unwrap(), host.model("b").unwrap());
    let long = {
        let a = a.clone();
        tokio::spawn(async move { run(&a, "a", 96).await })
    };
    while a.state() != ModelState::Warm {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let other = run(&b, "b", 4).await;
    assert_eq!(long.await.unwrap(), (96, None), "A's request ran to its end");
    assert_eq!(other, (4, None), "B was served once A was free");
    assert_eq!(a.state(), ModelState::Cold, "A was evicted for B, after its request");
    assert_eq!(b.state(), ModelState::Warm);
    // Alternating: every request answered, each after a load.
    for i in 0..4 {
        let (m, id) = if i % 2 == 0 { (&a, "a") } else { (&b, "b") };
        assert_eq!(run(m, id, 2).await, (2, None));
    }
    assert_eq!(host.loads(), 6);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_models_scale_to_zero_and_reload() {
    let ttl = Duration::from_millis(300);
    let (host, _) = ModelHost::new(
        vec![entry("a", crate::harness::default_model(), Some(ttl))],
        config(None),
    );
    let a = host.model("a").unwrap();
    assert_eq!(run(&a, "a", 2).await, (2, None));
    assert_eq!(a.state(), ModelState::Warm);
    let warm_rss = rss_mib();
    let t = std::time::Instant::now();
    while a.state() != ModelState::Cold {
        assert!(t.elapsed() < Duration::from_secs(10), "not unloaded after its TTL");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The engine thread ends with its last handle; give it a moment to free the weights.
    let t = std::time::Instant::now();
    while warm_rss - rss_mib() < 60.0 {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "RSS {warm_rss:.0} MiB warm, {:.0} MiB cold: the weights were not released",
            rss_mib()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(run(&a, "a", 2).await, (2, None), "the next request loads it again");
    assert_eq!(host.loads(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_whose_file_went_bad_fails_alone() {
    let dir = std::env::temp_dir().join(format!("hearth-host-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let copy = dir.join("copy.gguf");
    std::fs::copy(crate::harness::default_model(), &copy).unwrap();
    let missing = dir.join("missing.gguf");
    let (host, failed) = ModelHost::new(
        vec![
            entry("good", crate::harness::default_model(), None),
            entry("bad", copy.clone(), None),
            entry("gone", missing, None),
        ],
        config(None),
    );
    assert_eq!(failed.len(), 1, "an unreadable file is left out of the catalogue");
    assert!(failed[0].1.to_string().contains("missing.gguf"), "{}", failed[0].1);
    // Truncated after the catalogue read it: its load fails with a clear error.
    let f = std::fs::OpenOptions::new().write(true).open(&copy).unwrap();
    f.set_len(4 << 20).unwrap();
    let (bad, good) = (host.model("bad").unwrap(), host.model("good").unwrap());
    assert_eq!(run(&bad, "bad", 2).await, (0, Some("model_load_failed".into())));
    assert_eq!(bad.state(), ModelState::Cold);
    assert_eq!(
        run(&good, "good", 2).await,
        (2, None),
        "the other model is still served"
    );
    assert!(host.model("nope").is_none());
    std::fs::remove_dir_all(&dir).ok();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_larger_than_the_budget_fails_at_once() {
    let mut cfg = config(Some(1));
    cfg.memory_budget = Some(32 << 20);
    let (host, _) = ModelHost::new(vec![entry("big", crate::harness::default_model(), None)], cfg);
    let big = host.model("big").unwrap();
    let t = std::time::Instant::now();
    assert_eq!(run(&big, "big", 2).await, (0, Some("model_load_failed".into())));
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "refused at once, not after the load timeout"
    );
    assert_eq!(host.loads(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_safetensors_model_fails_alone() {
    let dir = std::env::temp_dir().join(format!("hearth-host-hf-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (late, early) = (dir.join("late"), dir.join("early"));
    let gguf = hearth_engine::formats::gguf::GgufFile::open(&crate::harness::default_model()).unwrap();
    for d in [&late, &early] {
        hearth_engine::formats::hf::export::export(&gguf, d, hearth_engine::formats::hf::export::ExportDtype::BF16, 2)
            .unwrap();
    }
    // Truncated before the catalogue is read: left out, with the file named.
    let shard = |d: &std::path::Path| d.join("model-00002-of-00002.safetensors");
    let f = std::fs::OpenOptions::new().write(true).open(shard(&early)).unwrap();
    f.set_len(1 << 20).unwrap();
    let (host, failed) = ModelHost::new(
        vec![
            entry("good", crate::harness::default_model(), None),
            entry("late", late.clone(), None),
            entry("early", early.clone(), None),
        ],
        config(None),
    );
    assert_eq!(failed.len(), 1);
    let why = failed[0].1.to_string();
    assert!(
        why.contains("model-00002-of-00002.safetensors") && why.contains("truncated or corrupt"),
        "{why}"
    );
    // Truncated after: its load fails with the kind; the others are served.
    let f = std::fs::OpenOptions::new().write(true).open(shard(&late)).unwrap();
    f.set_len(1 << 20).unwrap();
    let (bad, good) = (host.model("late").unwrap(), host.model("good").unwrap());
    assert_eq!(run(&bad, "late", 2).await, (0, Some("model_load_failed".into())));
    assert_eq!(
        run(&good, "good", 2).await,
        (2, None),
        "the other model is still served"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// A model removed while it loads and added again under the same id: the old load's engine
/// is discarded, not installed as the new entry (the new one loads for itself).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_removed_while_loading_and_added_again_loads_anew() {
    let (host, _) = ModelHost::new(vec![entry("a", crate::harness::default_model(), None)], config(None));
    let first = host.model("a").unwrap();
    let pending = tokio::spawn(async move { run(&first, "a", 2).await });
    while host.state("a") != Some(ModelState::Loading) {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert!(host.remove("a"));
    assert!(!host.remove("a"), "removed once");
    let mut again = entry("a", crate::harness::default_model(), None);
    again.context_length = Some(128);
    let b = host.add(again).unwrap();
    assert_eq!(b.info().context_length, 128);
    // The waiting request either saw its model removed, or was served by the new entry
    // (which then loaded for itself) — never by the old load's engine.
    let got = pending.await.unwrap();
    match got {
        (0, Some(code)) if code == "model_not_found" => {
            assert_eq!(
                host.state("a"),
                Some(ModelState::Cold),
                "the old engine was not installed"
            );
            assert_eq!(run(&b, "a", 2).await, (2, None));
        }
        other => assert_eq!(other, (2, None)),
    }
    assert_eq!(host.loads(), 2, "the new entry loaded for itself");
    assert_eq!(host.state("a"), Some(ModelState::Warm));
}

/// A removed model's requests in flight finish, and its memory counts against the budget
/// until they do: another model waits for the room rather than overcommitting it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_model_holds_its_memory_until_its_requests_end() {
    let (host, _) = ModelHost::new(vec![entry("a", crate::harness::default_model(), None)], config(Some(1)));
    let a = host.model("a").unwrap();
    let (order_tx, mut order) = tokio::sync::mpsc::unbounded_channel::<&'static str>();
    let req = |model: &str, max_tokens: u32| GenerateRequest {
        request_id: format!("{model}-{max_tokens}"),
        model: model.into(),
        prompt: vec![1, 9690, 198, 2683, 359, 253],
        sampling: SamplingParams {
            temperature: 0.0,
            max_tokens,
            ignore_eos: true,
            ..Default::default()
        },
        cache_namespace: String::new(),
        n: 1,
        prefill_only: false,
        resume: Vec::new(),
        kv_source: None,
        qos: Default::default(),
        constraint: None,
        adapter: None,
    };
    let mut rx_a = a.generate(req("a", 48));
    assert!(
        matches!(rx_a.recv().await, Some(GenerateEvent::Token { .. })),
        "a is running"
    );
    assert!(host.remove("a"));
    let b = host.add(entry("b", crate::harness::default_model(), None)).unwrap();
    let tx = order_tx.clone();
    let a_done = tokio::spawn(async move {
        let mut tokens = 1;
        while let Some(ev) = rx_a.recv().await {
            match ev {
                GenerateEvent::Token { .. } => tokens += 1,
                GenerateEvent::Finish { .. } => {}
                GenerateEvent::Done { .. } => break,
                other => panic!("a: {other:?}"),
            }
        }
        let _ = tx.send("a done");
        tokens
    });
    let mut rx_b = b.generate(req("b", 2));
    let tx = order_tx;
    let b_first = tokio::spawn(async move {
        while let Some(ev) = rx_b.recv().await {
            if let GenerateEvent::Token { .. } = ev {
                let _ = tx.send("b token");
                return true;
            }
        }
        false
    });
    assert_eq!(a_done.await.unwrap(), 48, "the removed model's request finished");
    assert!(b_first.await.unwrap());
    assert_eq!(order.recv().await, Some("a done"));
    assert_eq!(
        order.recv().await,
        Some("b token"),
        "b loaded only once a's memory was free"
    );
}

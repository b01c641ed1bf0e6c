//! The KV tier below the pool: blocks the pool evicts are written to local disk and read
//! back when a later request's prompt continues past what the pool still holds. On the
//! default model with a pool of a few dozen blocks, so that a second prompt evicts the
//! first: the read-back continues exactly as recomputing does, damaged records are
//! recomputed, the tier survives a restart, namespaces never share, quotas hold.

use std::path::{Path, PathBuf};

use hearth_engine::formats::fetch::DEFAULT_MODEL_ID;
use hearth_engine::kv::tier::DiskTierConfig;
use hearth_engine::{EngineConfig, EngineHandle};
use hearth_protocol::{GenerateEvent, GenerateRequest, Qos, SamplingParams};

fn tempdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("hearth-kv-tiers-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// An engine with an 8 MiB pool (22 blocks of the default model) and, with `dir`, a disk
/// tier of 64 MiB there (`tenant_mib` each, 0: no quota).
fn engine(m: &Path, dir: Option<&Path>, tenant_mib: u64) -> EngineHandle {
    let cfg = EngineConfig {
        threads: 2,
        kv_cache_mib: Some(8),
        kv_disk: dir.map(|d| DiskTierConfig {
            dir: d.to_path_buf(),
            capacity_bytes: 64 << 20,
            tenant_bytes: tenant_mib << 20,
        }),
        ..Default::default()
    };
    EngineHandle::load(m, DEFAULT_MODEL_ID, &cfg).unwrap()
}

/// A prompt of `n` tokens: one block every prompt shares (a system prompt's, reused by
/// every request, so never evicted), then tokens different for each `seed`.
fn prompt(seed: u32, n: u32) -> Vec<u32> {
    let mut p = vec![1, 9690, 198];
    p.extend((0..13).map(|i| 300 + i * 11));
    p.extend((0..n - 16).map(|i| 200 + (i * 37 + seed * 1009) % 5000));
    p
}

/// Waits until no engine holds the tier directory (a dropped engine's thread ends
/// asynchronously).
fn wait_unlocked(dir: &Path) {
    for _ in 0..500 {
        let f = std::fs::File::open(dir.join("LOCK")).unwrap();
        if f.try_lock().is_ok() {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    panic!("{} stayed locked", dir.display());
}

/// Greedy tokens and the prompt tokens the engine reused from its cache.
async fn greedy(e: &EngineHandle, prompt: &[u32], namespace: &str, tenant: &str) -> (Vec<u32>, u32) {
    let req = GenerateRequest {
        request_id: "t".into(),
        model: DEFAULT_MODEL_ID.into(),
        prompt: prompt.to_vec(),
        sampling: SamplingParams {
            temperature: 0.0,
            max_tokens: 8,
            ignore_eos: true,
            ..Default::default()
        },
        cache_namespace: namespace.into(),
        n: 1,
        prefill_only: false,
        resume: Vec::new(),
        kv_source: None,
        qos: Qos {
            tenant: tenant.into(),
            ..Default::default()
        },
        constraint: None,
        adapter: None,
    };
    let mut rx = e.generate(req);
    let mut tokens = Vec::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            GenerateEvent::Token { id, .. } => tokens.push(id),
            GenerateEvent::Done { usage, .. } => return (tokens, usage.cached_tokens),
            GenerateEvent::Error { message, .. } => panic!("{message}"),
            GenerateEvent::Finish { .. } => {}
        }
    }
    panic!("no Done")
}

/// Runs `a`, then two other prompts that evict it from the pool, and waits for the writes.
async fn spill(e: &EngineHandle, a: &[u32], ns: &str, tenant: &str) -> Vec<u32> {
    let (tokens, cached) = greedy(e, a, ns, tenant).await;
    assert_eq!(cached, 0);
    greedy(e, &prompt(7, 300), ns, tenant).await;
    greedy(e, &prompt(8, 300), ns, tenant).await;
    e.kv_disk().unwrap().flush();
    tokens
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evicted_blocks_come_back_from_disk_and_continue_exactly() {
    let m = crate::harness::default_model();
    let a = prompt(1, 200);
    let want = greedy(&engine(&m, None, 0), &a, "", "").await.0;

    let dir = tempdir("readback");
    let e = engine(&m, Some(&dir), 0);
    assert_eq!(spill(&e, &a, "", "").await, want);
    let before = e.kv_disk_usage().unwrap();
    assert!(before.blocks >= 12, "A's blocks and more were spilled: {before:?}");
    let hits = e.kv_disk().unwrap().metrics().hits.get();

    let (got, cached) = greedy(&e, &a, "", "").await;
    assert_eq!(
        got, want,
        "read back from disk, decoding continues exactly as recomputed"
    );
    assert_eq!(cached, 12 * 16, "every full block of the prompt was reused");
    assert!(e.kv_disk().unwrap().metrics().hits.get() > hits, "some came from disk");

    // Another namespace (another tenant's cache) never sees these blocks.
    let (got, cached) = greedy(&e, &a, "tenant-b", "b").await;
    assert_eq!(cached, 0, "namespaces never share blocks, on disk or in the pool");
    assert_eq!(got, want);

    // A restart keeps the tier: a new engine on the same directory reads A from disk —
    // the shared first block too, which the pool never evicted (written when first reused).
    let tier_dir = e.kv_disk().unwrap().dir().to_path_buf();
    drop(e);
    wait_unlocked(&tier_dir);
    let e = engine(&m, Some(&dir), 0);
    assert_eq!(e.kv_disk().unwrap().dir(), tier_dir);
    assert!(e.kv_disk_usage().unwrap().blocks >= 12);
    let (got, cached) = greedy(&e, &a, "", "").await;
    assert_eq!(got, want, "after a restart");
    assert_eq!(cached, 12 * 16, "the whole prefix came from disk after a restart");
    // Two engines of one model on one directory each get their own (`--workers 2`).
    let second = engine(&m, Some(&dir), 0);
    assert_ne!(second.kv_disk().unwrap().dir(), e.kv_disk().unwrap().dir());
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn damaged_records_are_recomputed() {
    let m = crate::harness::default_model();
    let a = prompt(2, 200);
    let dir = tempdir("damage");
    let e = engine(&m, Some(&dir), 0);
    let want = spill(&e, &a, "", "").await;
    // Flip a byte every 64 KiB of every segment: every block's data (~360 KiB) is hit.
    let tier = e.kv_disk().unwrap();
    for f in std::fs::read_dir(tier.dir()).unwrap() {
        let p = f.unwrap().path();
        if p.extension().is_some_and(|x| x == "hkv") {
            let mut bytes = std::fs::read(&p).unwrap();
            for i in (4096..bytes.len()).step_by(64 << 10) {
                bytes[i] ^= 0x5a;
            }
            std::fs::write(&p, bytes).unwrap();
        }
    }
    tier.drop_page_cache();
    let (got, _) = greedy(&e, &a, "", "").await;
    assert_eq!(got, want, "damaged blocks are refused and recomputed");
    assert!(tier.metrics().corrupt.get() > 0, "the damage was seen");
    assert_eq!(tier.metrics().hits.get(), 0, "nothing damaged was used");
    drop(e);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_quota_holds_on_disk() {
    let m = crate::harness::default_model();
    let dir = tempdir("quota");
    // 4 MiB each: about 11 blocks of the default model.
    let e = engine(&m, Some(&dir), 4);
    spill(&e, &prompt(3, 200), "a", "a").await;
    spill(&e, &prompt(4, 200), "b", "b").await;
    let u = e.kv_disk_usage().unwrap();
    assert_eq!(u.tenants.len(), 2, "{u:?}");
    for (tenant, bytes) in &u.tenants {
        assert!(*bytes <= 4 << 20, "{tenant} holds {bytes} bytes, over its quota");
        assert!(*bytes > 0);
    }
    assert!(e.kv_disk().unwrap().metrics().quota_evicted.get() > 0);
    drop(e);
    let _ = std::fs::remove_dir_all(&dir);
}

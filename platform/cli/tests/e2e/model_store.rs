//! A model store shared by a fleet: `hearth model pack --out DIR` prepares the packed
//! weights once; a worker started with `--pack-dir DIR` maps them, and a worker whose store
//! has no pack repacks in memory. Neither writes anything into the store (made immutable
//! here, `chattr +i`, where the filesystem allows: then any write fails, even root's),
//! and both serve the golden answer.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::harness::*;
use serde_json::json;

/// Every file under `dir`: path, length and modification time.
fn snapshot(dir: &Path) -> Vec<(PathBuf, u64, std::time::SystemTime)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().map(Result::unwrap) {
            let meta = e.metadata().unwrap();
            if meta.is_dir() {
                stack.push(e.path());
            }
            out.push((e.path(), meta.len(), meta.modified().unwrap()));
        }
    }
    out.sort();
    out
}

/// `chattr ±i` on every path under and including `dir`; false where the filesystem or the
/// user cannot (the snapshot comparison still checks nothing was written).
fn immutable(dir: &Path, on: bool) -> bool {
    let mut paths: Vec<PathBuf> = snapshot(dir).into_iter().map(|s| s.0).collect();
    paths.push(dir.to_path_buf());
    let flag = if on { "+i" } else { "-i" };
    Command::new("chattr")
        .arg(flag)
        .args(&paths)
        .status()
        .is_ok_and(|s| s.success())
}

/// Undoes [`immutable`] however the test ends, so that the directory can be removed.
struct Mutable(PathBuf);
impl Drop for Mutable {
    fn drop(&mut self) {
        immutable(&self.0, false);
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

async fn golden(worker: &Proc, data: &Path) -> String {
    let gateway = gateway_with(data, &worker.url, &[], &[]);
    let key = new_key(data, "store");
    let (status, _, body) = post(
        &format!("{}/v1/chat/completions", gateway.url),
        Some(&key),
        &chat_body(json!({"max_tokens": 16})),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    body["choices"][0]["message"]["content"].as_str().unwrap().to_string()
}

/// The worker's `hearth_model_weights_source` lines (`source` label: pack, repacked or
/// unpacked; value 1 for the one in use).
async fn weights_source(worker: &Proc) -> Vec<String> {
    metrics(&worker.url)
        .await
        .lines()
        .filter(|l| l.starts_with("hearth_model_weights_source{"))
        .map(str::to_string)
        .collect()
}

fn uses(lines: &[String], source: &str) -> bool {
    lines
        .iter()
        .any(|l| l.contains(&format!("source=\"{source}\"")) && l.ends_with(" 1"))
}

#[tokio::test]
async fn a_read_only_store_is_served_from_a_prepared_pack_or_repacked_in_memory() {
    let fetched = Command::new(bin()).args(["model", "fetch"]).output().unwrap();
    assert!(fetched.status.success());
    let source = PathBuf::from(String::from_utf8(fetched.stdout).unwrap().trim());
    let root = temp_dir("store");
    let store = root.join("store");
    let packs = store.join("packs");
    std::fs::create_dir_all(&store).unwrap();
    let model = store.join("model.gguf");
    std::fs::copy(&source, &model).unwrap();

    // Prepared once, for the fleet.
    let out = Command::new(bin())
        .args([
            "model",
            "pack",
            model.to_str().unwrap(),
            "--out",
            packs.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let pack = PathBuf::from(String::from_utf8(out.stdout).unwrap().trim());
    assert_eq!(pack.parent(), Some(packs.as_path()), "{}", pack.display());
    assert!(pack.exists());

    let _cleanup = Mutable(root.clone());
    let locked = immutable(&store, true);
    eprintln!("store immutable: {locked}");
    let before = snapshot(&store);
    let model_arg = model.to_str().unwrap();
    let listen = [
        "worker",
        "--listen",
        "127.0.0.1:0",
        "--model",
        model_arg,
        "--model-id",
        MODEL,
    ];

    // With the pack directory: the pack is mapped.
    let mut args = listen.to_vec();
    args.extend(["--pack-dir", packs.to_str().unwrap()]);
    let worker = spawn(&args);
    let lines = weights_source(&worker).await;
    assert!(uses(&lines, "pack"), "{lines:?}");
    let answer = golden(&worker, &root.join("data-pack")).await;
    assert_eq!(answer, "The capital of France is Paris.");
    drop(worker);

    // Without it (none beside the model either): repacked in memory, nothing written.
    let worker = spawn(&listen);
    let lines = weights_source(&worker).await;
    assert!(uses(&lines, "repacked"), "{lines:?}");
    let answer = golden(&worker, &root.join("data-repack")).await;
    assert_eq!(answer, "The capital of France is Paris.");
    drop(worker);

    let after = snapshot(&store);
    let changed: Vec<_> = after.iter().filter(|a| !before.contains(a)).collect();
    assert!(
        changed.is_empty() && after.len() == before.len(),
        "the store changed: {changed:?} (before: {before:?})"
    );
}

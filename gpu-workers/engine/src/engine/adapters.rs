//! The engine's LoRA adapter cache: adapters are read on demand from the shared adapter
//! store (the path a request's [`AdapterRef`] names), checked against the digest the gateway
//! resolved, kept while requests use them, and unloaded least recently used first when a
//! new one needs room (by count and by bytes) or after sitting idle.
//!
//! An adapter in use by a running request is never unloaded: its requests hold an `Arc`. A
//! request whose adapter finds no room (every loaded adapter in use) waits in the engine
//! until a request holding an adapter ends. Removing an adapter from the store never
//! disturbs requests already running; new requests for it are refused (the store is
//! checked on every request, loaded or not).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hearth_protocol::AdapterRef;

use crate::models::{LoraAdapter, LoraLimits, Model};

/// How many adapters, and how many bytes of them, a worker keeps loaded.
#[derive(Debug, Clone)]
pub struct AdapterCacheConfig {
    /// The adapter store: adapters are read from under it (a request's path is relative to
    /// it, or inside it); None: this engine serves no adapters.
    pub store: Option<PathBuf>,
    /// Adapters loaded at once (0: adapters are refused).
    pub max_loaded: usize,
    /// Their memory in MiB.
    pub memory_mib: usize,
    /// Unloaded after this long unused.
    pub idle_unload: Duration,
    /// What one adapter may be.
    pub limits: LoraLimits,
}

impl Default for AdapterCacheConfig {
    fn default() -> Self {
        Self {
            store: None,
            max_loaded: 16,
            memory_mib: 1024,
            idle_unload: Duration::from_secs(600),
            limits: LoraLimits::default(),
        }
    }
}

/// Why a request's adapter could not be used now: an error code and message for the
/// request, or `Busy` when every loaded adapter is in use (the request waits for one).
#[derive(Debug)]
pub enum AdapterRefused {
    Failed { code: &'static str, message: String },
    Busy,
}

struct Entry {
    adapter: Arc<LoraAdapter>,
    last_used: Instant,
}

/// The loaded adapters, by digest.
pub struct AdapterCache {
    config: AdapterCacheConfig,
    loaded: HashMap<String, Entry>,
    /// Loads from the store, and the seconds they took.
    loads: u64,
    load_seconds: f64,
}

impl AdapterCache {
    pub fn new(config: AdapterCacheConfig) -> Self {
        Self {
            config,
            loaded: HashMap::new(),
            loads: 0,
            load_seconds: 0.0,
        }
    }

    /// The adapter a request names, loaded now if it is not already.
    pub fn get(&mut self, r: &AdapterRef, model: &Model) -> Result<Arc<LoraAdapter>, AdapterRefused> {
        let now = Instant::now();
        self.unload_idle(now);
        let path = match (&self.config.store, self.config.max_loaded) {
            (Some(store), 1..) => within_store(store, &r.path),
            _ => {
                return Err(AdapterRefused::Failed {
                    code: "adapter_unavailable",
                    message: "this worker serves no adapters (it has no adapter store: --adapter-dir)".into(),
                })
            }
        };
        // Checked on every request, loaded or not: an adapter removed from the store serves
        // no new request (those running keep theirs).
        let Some(path) = path else {
            if self
                .loaded
                .get(&r.digest)
                .is_some_and(|e| Arc::strong_count(&e.adapter) == 1)
            {
                self.loaded.remove(&r.digest);
            }
            return Err(AdapterRefused::Failed {
                code: "adapter_not_found",
                message: format!("adapter {}: not found in this worker's adapter store", r.name),
            });
        };
        if let Some(e) = self.loaded.get_mut(&r.digest) {
            e.last_used = now;
            return Ok(e.adapter.clone());
        }
        if self.loaded.len() >= self.config.max_loaded
            && !self.loaded.values().any(|e| Arc::strong_count(&e.adapter) == 1)
        {
            return Err(AdapterRefused::Busy);
        }
        let adapter = LoraAdapter::open(&path, model, self.config.limits).map_err(|e| AdapterRefused::Failed {
            code: match e {
                crate::models::LoraError::Io { .. } => "adapter_not_found",
                _ => "invalid_adapter",
            },
            message: format!("adapter {}: {e}", r.name),
        })?;
        self.loads += 1;
        self.load_seconds += now.elapsed().as_secs_f64();
        if adapter.digest != r.digest {
            return Err(AdapterRefused::Failed {
                code: "adapter_not_found",
                message: format!(
                    "adapter {}: the stored files have changed (digest {} rather than {})",
                    r.name, adapter.digest, r.digest
                ),
            });
        }
        let bytes = adapter.bytes();
        let budget = self.config.memory_mib << 20;
        if bytes > budget {
            return Err(AdapterRefused::Failed {
                code: "invalid_adapter",
                message: format!(
                    "adapter {} takes {} MiB loaded; this worker keeps at most {} MiB of adapters",
                    r.name,
                    bytes >> 20,
                    self.config.memory_mib
                ),
            });
        }
        // Room: unload the least recently used adapters no request holds.
        while self.loaded.len() >= self.config.max_loaded || self.bytes() + bytes > budget {
            let victim = self
                .loaded
                .iter()
                .filter(|(_, e)| Arc::strong_count(&e.adapter) == 1)
                .min_by_key(|(_, e)| e.last_used)
                .map(|(d, _)| d.clone());
            let Some(victim) = victim else {
                return Err(AdapterRefused::Busy);
            };
            self.loaded.remove(&victim);
        }
        let adapter = Arc::new(adapter);
        self.loaded.insert(
            r.digest.clone(),
            Entry {
                adapter: adapter.clone(),
                last_used: now,
            },
        );
        Ok(adapter)
    }

    fn unload_idle(&mut self, now: Instant) {
        let idle = self.config.idle_unload;
        self.loaded
            .retain(|_, e| Arc::strong_count(&e.adapter) > 1 || now.duration_since(e.last_used) < idle);
    }

    /// Bytes of the loaded adapters.
    pub fn bytes(&self) -> usize {
        self.loaded.values().map(|e| e.adapter.bytes()).sum()
    }

    /// How many adapters are loaded.
    pub fn loaded(&self) -> usize {
        self.loaded.len()
    }

    /// The loaded adapters' digests, sorted.
    pub fn digests(&self) -> Vec<String> {
        let mut d: Vec<String> = self.loaded.keys().cloned().collect();
        d.sort();
        d
    }

    /// Loads from the store so far, and the seconds they took.
    pub fn loads(&self) -> (u64, f64) {
        (self.loads, self.load_seconds)
    }
}

/// `path` (relative to the store, or absolute) if it exists and lies inside the store, as
/// do the files of a PEFT directory there (a link out of the store is refused).
fn within_store(store: &Path, path: &str) -> Option<PathBuf> {
    let store = store.canonicalize().ok()?;
    let inside = |p: &Path| p.canonicalize().ok().filter(|p| p.starts_with(&store));
    let full = inside(&store.join(path))?;
    if full.is_dir() {
        for f in ["adapter_config.json", "adapter_model.safetensors"] {
            inside(&full.join(f))?;
        }
    }
    Some(full)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adapters_are_read_from_inside_the_store_only() {
        let root = std::env::temp_dir().join(format!("hearth-adapter-store-{}", std::process::id()));
        let store = root.join("store");
        std::fs::create_dir_all(store.join("a")).unwrap();
        std::fs::write(root.join("secret"), b"x").unwrap();
        for f in ["adapter_config.json", "adapter_model.safetensors"] {
            std::fs::write(store.join("a").join(f), b"{}").unwrap();
        }
        assert_eq!(within_store(&store, "a"), Some(store.join("a").canonicalize().unwrap()));
        let inside = store.join("a").display().to_string();
        assert!(within_store(&store, &inside).is_some());
        assert_eq!(within_store(&store, "../secret"), None);
        assert_eq!(within_store(&store, &root.join("secret").display().to_string()), None);
        assert_eq!(within_store(&store, "missing"), None);
        // A PEFT directory whose weights link out of the store.
        std::fs::remove_file(store.join("a/adapter_model.safetensors")).unwrap();
        std::os::unix::fs::symlink(root.join("secret"), store.join("a/adapter_model.safetensors")).unwrap();
        assert_eq!(within_store(&store, "a"), None);
        std::fs::remove_dir_all(&root).unwrap();
    }
}

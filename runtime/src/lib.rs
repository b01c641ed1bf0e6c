//! The sandbox for tenant processors: WebAssembly components of the `hearth:processor`
//! world (`wit/processor.wit`), run by wasmtime.
//!
//! * **Upload**: [`Runtime::compile`] validates the component (it must be a component of
//!   this world, importing nothing but the world's `host` interface and a restricted WASI)
//!   and precompiles it; compiled code is cached by the SHA-256 of the upload, in memory
//!   and, with a cache directory, on disk.
//! * **Per request**: [`Runtime::instantiate`] hands out a fresh instance, never used
//!   before, so requests share nothing. Instances come from the pooling allocator
//!   (`InstancePre`, copy-on-write memory images) and are made *ahead* of their requests: a
//!   small shelf of ready instances per processor version, configuration and limits
//!   ([`Runtime::with_warm`]). A request finds its instance made, so instantiating a large
//!   guest (a Python runtime: ~600 µs) is off its path. A used instance is never put back:
//!   releasing it (dropping it) hands its store to a background thread, the *maker*, which
//!   drops it (the pool slot's reset) and then tops up the shelf, between requests rather
//!   than beside a guest's calls. While requests keep coming the maker looks at its queue
//!   every millisecond instead of sleeping until woken, so a release is a queue push, not a
//!   cross-core wake-up.
//! * **Limits per call**: CPU through epoch interruption (a 1 ms tick; the guest also
//!   yields to the async executor at every tick, so a busy guest cannot hold a gateway
//!   thread), memory (growing past the limit traps), input and output bytes, captured log
//!   bytes. Any failure is a [`ProcessorError`] for this request only.
//! * **WASI**: only what language runtimes need to start: no preopened directories, no
//!   environment, no sockets, empty stdin, stdout/stderr captured, clocks rounded to 1 s,
//!   random numbers.

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use tokio::sync::mpsc::error::TryRecvError;
use wasmtime::component::{Component, HasSelf, Linker, ResourceTable};
use wasmtime::{Config, Engine, PoolingAllocationConfig, Store, StoreLimits, StoreLimitsBuilder, UpdateDeadline};
use wasmtime_wasi::p2::pipe::MemoryOutputPipe;
use wasmtime_wasi::{HostMonotonicClock, HostWallClock, WasiCtx, WasiCtxView, WasiView};

pub mod wat_guest;

mod bindings {
    wasmtime::component::bindgen!({
        path: "wit",
        world: "processor",
        exports: { default: async },
        additional_derives: [PartialEq, Eq],
    });
}

pub use bindings::hearth::processor::host::Level;
pub use bindings::hearth::processor::types::{Action, Header, Rejection, Request, Response};
use bindings::{Processor, ProcessorPre};

/// The WIT of the world, for guest toolchains (`hearth processor wit`).
pub const WIT: &str = include_str!("../wit/processor.wit");

/// Hard ceilings; a processor's own limits are clamped to these.
pub const MAX_CPU_MS: u32 = 1_000;
pub const MAX_MEMORY_MIB: u32 = 256;

/// Limits of one processor's calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Limits {
    /// CPU time per call (ms, in 1 ms epochs).
    pub cpu_ms: u32,
    /// Linear memory of the instance (MiB).
    pub memory_mib: u32,
    /// Bytes passed into one call.
    pub max_input_bytes: usize,
    /// Bytes a call may return.
    pub max_output_bytes: usize,
    /// Log bytes kept per request (the rest is dropped, with a marker).
    pub max_log_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            cpu_ms: 50,
            memory_mib: 128,
            max_input_bytes: 1 << 20,
            max_output_bytes: 1 << 20,
            max_log_bytes: 4096,
        }
    }
}

impl Limits {
    pub fn clamped(mut self) -> Self {
        self.cpu_ms = self.cpu_ms.clamp(1, MAX_CPU_MS);
        self.memory_mib = self.memory_mib.clamp(1, MAX_MEMORY_MIB);
        self.max_input_bytes = self.max_input_bytes.clamp(1, 16 << 20);
        self.max_output_bytes = self.max_output_bytes.clamp(1, 16 << 20);
        self.max_log_bytes = self.max_log_bytes.min(1 << 20);
        self
    }
}

/// Why a processor failed (its request fails; nothing else does).
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum ProcessorError {
    #[error("not a valid hearth:processor component: {0}")]
    Invalid(String),
    #[error("exceeded its CPU limit of {0} ms")]
    Cpu(u32),
    #[error("exceeded its memory limit of {0} MiB")]
    Memory(u32),
    #[error("input of {size} bytes exceeds its limit of {limit} bytes")]
    InputTooLarge { size: usize, limit: usize },
    #[error("returned {size} bytes, over its limit of {limit} bytes")]
    OutputTooLarge { size: usize, limit: usize },
    #[error("trapped: {0}")]
    Trap(String),
    #[error("could not be started: {0}")]
    Instantiate(String),
}

impl ProcessorError {
    /// A stable code for clients and metrics.
    pub fn code(&self) -> &'static str {
        match self {
            Self::Invalid(_) => "processor_invalid",
            Self::Cpu(_) => "processor_cpu_limit",
            Self::Memory(_) => "processor_memory_limit",
            Self::InputTooLarge { .. } => "processor_input_too_large",
            Self::OutputTooLarge { .. } => "processor_output_too_large",
            Self::Trap(_) => "processor_trap",
            Self::Instantiate(_) => "processor_unavailable",
        }
    }
}

/// Clocks with a 1 s resolution: enough for a guest's runtime, useless for timing attacks.
struct CoarseWall;
impl HostWallClock for CoarseWall {
    fn resolution(&self) -> Duration {
        Duration::from_secs(1)
    }
    fn now(&self) -> Duration {
        let d = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        Duration::from_secs(d.as_secs())
    }
}

/// A monotonic clock in whole seconds from the moment its instance was handed to a
/// request, not made (the wall clock, also in whole seconds, still moves while an instance
/// waits on its shelf).
struct CoarseMonotonic(Arc<Mutex<Instant>>);
impl HostMonotonicClock for CoarseMonotonic {
    fn resolution(&self) -> u64 {
        1_000_000_000
    }
    fn now(&self) -> u64 {
        let start = *self.0.lock().unwrap_or_else(|e| e.into_inner());
        start.elapsed().as_secs() * 1_000_000_000
    }
}

/// Captured log lines, truncated at a byte limit.
#[derive(Default)]
struct LogBuf {
    text: String,
    limit: usize,
    truncated: bool,
}

impl LogBuf {
    fn push(&mut self, line: &str) {
        if self.truncated {
            return;
        }
        if self.text.len() + line.len() + 1 > self.limit {
            let room = self.limit.saturating_sub(self.text.len());
            let mut cut = room.min(line.len());
            while !line.is_char_boundary(cut) {
                cut -= 1;
            }
            self.text.push_str(&line[..cut]);
            self.text.push_str("…[truncated]");
            self.truncated = true;
            return;
        }
        self.text.push_str(line);
        self.text.push('\n');
    }
}

pub struct State {
    wasi: WasiCtx,
    table: ResourceTable,
    limits: StoreLimits,
    config: String,
    logs: LogBuf,
    stdout: MemoryOutputPipe,
    ticks: u32,
    max_ticks: u32,
    /// The start of the guest's monotonic clock.
    clock_start: Arc<Mutex<Instant>>,
}

impl WasiView for State {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

impl bindings::hearth::processor::host::Host for State {
    fn log(&mut self, level: Level, message: String) {
        let l = match level {
            Level::Debug => "debug",
            Level::Info => "info",
            Level::Warn => "warn",
            Level::Error => "error",
        };
        self.logs.push(&format!("[{l}] {message}"));
    }

    fn config(&mut self) -> String {
        self.config.clone()
    }
}

impl bindings::hearth::processor::types::Host for State {}

/// A validated, precompiled processor.
pub struct Compiled {
    pub sha256: String,
    pre: ProcessorPre<State>,
}

impl std::fmt::Debug for Compiled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Compiled").field("sha256", &self.sha256).finish()
    }
}

/// The engine, linker, compiled-code cache and ready instances of one process.
pub struct Runtime {
    engine: Engine,
    linker: Linker<State>,
    cache: Mutex<HashMap<String, Arc<Compiled>>>,
    cache_dir: Option<PathBuf>,
    warm: Arc<Warm>,
    maker: tokio::sync::mpsc::Sender<Job>,
}

/// Ready instances kept per processor version, configuration and limits by default.
pub const DEFAULT_WARM_INSTANCES: usize = 2;
/// Ready instances kept in all (each holds a pool slot and its resident pages); the least
/// recently used shelf goes first.
const MAX_WARM_TOTAL: usize = 64;
/// A shelf not taken from for this long is emptied.
const WARM_IDLE: Duration = Duration::from_secs(120);

/// Counts of how requests got their instances.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WarmStats {
    /// Instances taken ready from a shelf.
    pub warm: u64,
    /// Instances made on the request's path (an empty shelf: the first request of a
    /// processor, requests faster than the refill, or shelves turned off).
    pub made: u64,
}

/// Instances made ahead of their requests. Each is used by one request and dropped: a
/// shelf only ever holds instances no request has touched, so isolation is that of a fresh
/// instance.
struct Warm {
    /// Ready instances per shelf (0: shelves off).
    per_key: std::sync::atomic::AtomicUsize,
    shelves: Mutex<HashMap<WarmKey, Shelf>>,
    hits: AtomicU64,
    misses: AtomicU64,
    /// The next shelf's id.
    next_shelf: AtomicU64,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct WarmKey {
    sha256: String,
    config: String,
    limits: Limits,
}

impl WarmKey {
    /// The shelf of `compiled` under `config` and `limits` (already clamped).
    fn new(compiled: &Compiled, config: &str, limits: Limits) -> Self {
        Self {
            sha256: compiled.sha256.clone(),
            config: config.to_string(),
            limits,
        }
    }
}

struct Shelf {
    /// Tells this shelf from one made again under its key after it was evicted or swept:
    /// a top-up fills only the shelf it was claimed for.
    id: u64,
    ready: Vec<Instance>,
    used: Instant,
    /// A top-up for this shelf is queued or running: at most one at a time.
    topping: bool,
}

impl Warm {
    fn per_key(&self) -> usize {
        self.per_key.load(Ordering::Relaxed)
    }

    fn new(per_key: usize) -> Arc<Self> {
        Arc::new(Self {
            per_key: per_key.into(),
            shelves: Mutex::new(HashMap::new()),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            next_shelf: AtomicU64::new(0),
        })
    }

    /// Empties the shelves not taken from for [`WARM_IDLE`]; returns their instances, to
    /// drop unlocked.
    fn sweep(&self) -> Vec<Instance> {
        let mut shelves = self.shelves.lock().unwrap_or_else(|e| e.into_inner());
        let mut dropped = Vec::new();
        shelves.retain(|_, s| {
            let keep = s.topping || s.used.elapsed() < WARM_IDLE;
            if !keep {
                dropped.append(&mut s.ready);
            }
            keep
        });
        dropped
    }

    /// Takes a ready instance if there is one, and returns the instances of shelves it
    /// evicted to make room for a new one, to drop off the request's path.
    fn take(&self, key: &WarmKey) -> (Option<Instance>, Vec<Instance>) {
        let mut shelves = self.shelves.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        let mut dropped = Vec::new();
        if !shelves.contains_key(key) {
            while (shelves.len() + 1) * self.per_key() > MAX_WARM_TOTAL {
                // A top-up of the evicted shelf stops at its next turn (the ids differ).
                let Some(lru) = shelves.iter().min_by_key(|(_, s)| s.used).map(|(k, _)| k.clone()) else {
                    break;
                };
                if let Some(mut s) = shelves.remove(&lru) {
                    dropped.append(&mut s.ready);
                }
            }
        }
        let shelf = shelves.entry(key.clone()).or_insert_with(|| Shelf {
            ready: Vec::new(),
            used: now,
            id: self.next_shelf.fetch_add(1, Ordering::Relaxed),
            topping: false,
        });
        shelf.used = now;
        (shelf.ready.pop(), dropped)
    }

    /// Claims the shelf's top-up, returning the shelf's id; None when one is already
    /// queued or running, or the shelf is gone or full.
    fn claim(&self, key: &WarmKey) -> Option<u64> {
        let mut shelves = self.shelves.lock().unwrap_or_else(|e| e.into_inner());
        match shelves.get_mut(key) {
            Some(s) if !s.topping && s.ready.len() < self.per_key() => {
                s.topping = true;
                Some(s.id)
            }
            _ => None,
        }
    }

    /// How many instances shelf `id` lacks (0 when it is gone, or another shelf now holds
    /// its key); at 0 its top-up ends, under the same lock, so that a release between the
    /// two cannot find it still running.
    fn lacking_or_done(&self, key: &WarmKey, id: u64) -> usize {
        let mut shelves = self.shelves.lock().unwrap_or_else(|e| e.into_inner());
        let Some(s) = shelves.get_mut(key).filter(|s| s.id == id) else {
            return 0;
        };
        let lacking = self.per_key().saturating_sub(s.ready.len());
        if lacking == 0 {
            s.topping = false;
        }
        lacking
    }

    /// Ends shelf `id`'s top-up.
    fn done(&self, key: &WarmKey, id: u64) {
        let mut shelves = self.shelves.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(s) = shelves.get_mut(key).filter(|s| s.id == id) {
            s.topping = false;
        }
    }

    /// Shelves an instance on shelf `id`; returns it when that shelf is gone or full, to
    /// drop unlocked.
    fn put(&self, key: &WarmKey, id: u64, made: Instance) -> Option<Instance> {
        let mut shelves = self.shelves.lock().unwrap_or_else(|e| e.into_inner());
        match shelves.get_mut(key) {
            Some(shelf) if shelf.id == id && shelf.ready.len() < self.per_key() => {
                shelf.ready.push(made);
                None
            }
            _ => Some(made),
        }
    }
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime").finish_non_exhaustive()
    }
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

fn classify(e: wasmtime::Error, limits: &Limits) -> ProcessorError {
    let text = format!("{e:#}");
    if text.contains("growing memory") || text.contains("memory limit") || text.contains("out of memory") {
        return ProcessorError::Memory(limits.memory_mib);
    }
    if let Some(t) = e.downcast_ref::<wasmtime::Trap>() {
        if *t == wasmtime::Trap::Interrupt {
            return ProcessorError::Cpu(limits.cpu_ms);
        }
        return ProcessorError::Trap(t.to_string());
    }
    let root = e.root_cause().to_string();
    ProcessorError::Trap(root.lines().next().unwrap_or("").chars().take(300).collect())
}

impl Runtime {
    /// A runtime; compiled code is also kept in `cache_dir` when given.
    pub fn new(cache_dir: Option<PathBuf>) -> anyhow::Result<Self> {
        let mut cfg = Config::new();
        cfg.wasm_component_model(true)
            .epoch_interruption(true)
            .max_wasm_stack(512 << 10)
            .async_stack_size(2 << 20)
            .memory_init_cow(true)
            .cranelift_opt_level(wasmtime::OptLevel::Speed);
        let mut pool = PoolingAllocationConfig::default();
        let scan = PoolingAllocationConfig::is_pagemap_scan_available();
        pool.total_component_instances(512)
            .total_core_instances(4096)
            .total_memories(1024)
            .total_tables(2048)
            .total_stacks(512)
            .max_core_instances_per_component(64)
            .max_memories_per_component(8)
            .max_tables_per_component(32)
            .max_component_instance_size(4 << 20)
            .max_core_instance_size(4 << 20)
            .table_elements(100_000)
            .max_memory_size((MAX_MEMORY_MIB as usize) << 20)
            // Reset small memories, tables and stacks with memset instead of madvise: the
            // kernel's mm lock would otherwise serialize instantiations across threads.
            // With PAGEMAP_SCAN (Linux 6.7+) wasmtime finds the pages the last instance
            // dirtied and copies back only those, so most of a JS guest's heap stays
            // resident instead of being refaulted from the image on every request (`hearth
            // bench processors`, 2-core Xeon: JS p50 648 → 237–250 µs, Python 1,069 → 740).
            // The contents are the image's, as before. (A larger keep-resident size, 16, 32
            // or 64 MiB in separate runs, measured no better, and every warm slot would keep
            // that much.) Still, a fresh JS or Python instance's calls take 37 / 60 page
            // faults (the bench's faults column): wasmtime's scan reports at most 32 dirty
            // regions and decommits everything past the last one, and these guests dirty
            // more (the scan also stops at the keep-resident size, but the larger sizes
            // left the faults as they were, so the regions are the limit).
            // Without the scan and with all of memory kept resident they take none (calls:
            // JS ~290 → ~220 µs, Python ~195 → ~85 µs), but every release then copies the
            // whole image back (12 MiB), which the maker cannot keep up with.
            .linear_memory_keep_resident(1 << 20)
            .pagemap_scan(if scan {
                wasmtime::Enabled::Yes
            } else {
                wasmtime::Enabled::No
            })
            .table_keep_resident(64 << 10)
            .async_stack_keep_resident(128 << 10)
            .decommit_batch_size(64);
        cfg.allocation_strategy(wasmtime::InstanceAllocationStrategy::Pooling(pool));
        let engine = Engine::new(&cfg).map_err(|e| anyhow::anyhow!("{e:#}"))?;
        // The CPU clock of every guest: one epoch per millisecond.
        let ticker = engine.weak();
        std::thread::Builder::new()
            .name("hearth-wasm-epoch".into())
            .spawn(move || loop {
                std::thread::sleep(Duration::from_millis(1));
                match ticker.upgrade() {
                    Some(e) => e.increment_epoch(),
                    None => break,
                }
            })?;
        let mut linker: Linker<State> = Linker::new(&engine);
        wasmtime_wasi::p2::add_to_linker_async(&mut linker).map_err(|e| anyhow::anyhow!("{e:#}"))?;
        Processor::add_to_linker::<State, HasSelf<State>>(&mut linker, |s| s).map_err(|e| anyhow::anyhow!("{e:#}"))?;
        if let Some(d) = &cache_dir {
            std::fs::create_dir_all(d)?;
        }
        let warm = Warm::new(DEFAULT_WARM_INSTANCES);
        let maker = spawn_maker(engine.clone(), Arc::downgrade(&warm))?;
        Ok(Self {
            engine,
            maker,
            linker,
            cache: Mutex::new(HashMap::new()),
            cache_dir,
            warm,
        })
    }

    /// Keeps `per_processor` ready instances for each processor version, configuration and
    /// limits in use (0: every request makes its own, on its path). Shelves are topped up by
    /// the maker thread when an instance is released; emptied after two idle minutes; at
    /// most 64 instances are kept in all.
    pub fn with_warm(self, per_processor: usize) -> Self {
        self.warm
            .per_key
            .store(per_processor.min(MAX_WARM_TOTAL), Ordering::Relaxed);
        self
    }

    /// How requests got their instances so far.
    pub fn warm_stats(&self) -> WarmStats {
        WarmStats {
            warm: self.warm.hits.load(Ordering::Relaxed),
            made: self.warm.misses.load(Ordering::Relaxed),
        }
    }

    fn cached(&self, sha: &str) -> Option<Arc<Compiled>> {
        self.cache.lock().unwrap_or_else(|e| e.into_inner()).get(sha).cloned()
    }

    fn cache_path(&self, sha: &str) -> Option<PathBuf> {
        self.cache_dir.as_ref().map(|d| d.join(format!("{sha}.cwasm")))
    }

    /// Validates and precompiles `wasm` (CPU-heavy: call from a blocking thread). Compiled
    /// code is cached by content hash.
    pub fn compile(&self, wasm: &[u8]) -> Result<Arc<Compiled>, ProcessorError> {
        let sha = sha256_hex(wasm);
        if let Some(c) = self.cached(&sha) {
            return Ok(c);
        }
        let from_disk = self.cache_path(&sha).filter(|p| p.exists()).and_then(|p| {
            // SAFETY: the file was written by `Component::serialize` of this same engine
            // configuration in this cache directory (owned by Hearth); wasmtime checks the
            // engine/version header and refuses a mismatch.
            unsafe { Component::deserialize_file(&self.engine, &p) }.ok()
        });
        let component = match from_disk {
            Some(c) => c,
            None => {
                let c = Component::new(&self.engine, wasm).map_err(|e| ProcessorError::Invalid(format!("{e:#}")))?;
                if let (Some(p), Ok(bytes)) = (self.cache_path(&sha), c.serialize()) {
                    let tmp = p.with_extension("tmp");
                    if std::fs::write(&tmp, bytes).is_ok() {
                        let _ = std::fs::rename(&tmp, &p);
                    }
                }
                c
            }
        };
        let pre = self
            .linker
            .instantiate_pre(&component)
            .map_err(|e| ProcessorError::Invalid(format!("{e:#}")))?;
        let pre = ProcessorPre::new(pre).map_err(|e| ProcessorError::Invalid(format!("{e:#}")))?;
        let c = Arc::new(Compiled {
            sha256: sha.clone(),
            pre,
        });
        self.cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(sha, c.clone());
        Ok(c)
    }

    /// Compiled code by hash, from memory or the disk cache (None: compile it again).
    pub fn lookup(&self, sha: &str, wasm: impl FnOnce() -> Option<Vec<u8>>) -> Option<Arc<Compiled>> {
        if let Some(c) = self.cached(sha) {
            return Some(c);
        }
        let bytes = wasm()?;
        self.compile(&bytes).ok()
    }

    /// A fresh instance for one request: never used before, taken ready from its shelf
    /// when there is one (made on this path otherwise). Dropping it releases it.
    pub async fn instantiate(
        &self,
        compiled: &Arc<Compiled>,
        config: &str,
        limits: Limits,
    ) -> Result<Instance, ProcessorError> {
        let limits = limits.clamped();
        // With shelves on, the shelf is topped up when this instance is released, not now:
        // making an instance beside a guest's first calls slows them by about half the
        // making (measured: a Python guest's first calls 190 → 470-590 µs), since both work
        // the same address space.
        let (taken, top_up) = if self.warm.per_key() == 0 {
            (None, None)
        } else {
            let key = WarmKey::new(compiled, config, limits);
            let (taken, evicted) = self.warm.take(&key);
            for i in evicted {
                retire(&self.maker, i);
            }
            let top_up = TopUp {
                pre: compiled.pre.clone(),
                key,
                shelf: 0,
                warm: self.warm.clone(),
            };
            (taken, Some(top_up))
        };
        let release = Release {
            maker: self.maker.clone(),
            top_up,
        };
        let mut i = match taken {
            Some(mut i) => {
                self.warm.hits.fetch_add(1, Ordering::Relaxed);
                i.warm = true;
                i
            }
            None => {
                self.warm.misses.fetch_add(1, Ordering::Relaxed);
                // A guest that cannot start fails here; its shelf is not topped up.
                make(&self.engine, &compiled.pre, config, limits).await?
            }
        };
        i.release = Some(release);
        if let Some(store) = &i.store {
            *store.data().clock_start.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
        }
        Ok(i)
    }
}

/// What releasing a handed-out instance does, on the maker thread: drop its store (the
/// pool slot's reset, 50-100 µs for a language runtime's memory), then top up its shelf.
struct Release {
    maker: tokio::sync::mpsc::Sender<Job>,
    /// None with shelves off.
    top_up: Option<TopUp>,
}

impl Release {
    /// When the maker thread is behind (its queue full) the store is dropped here, and the
    /// shelf waits for a later release: released stores never pile up holding pool slots.
    fn send(self, store: Option<Store<State>>) {
        if let Some(store) = store {
            drop(self.maker.try_send(Job::Retire(store)));
        }
        if let Some(mut t) = self.top_up {
            if let Some(id) = t.warm.claim(&t.key) {
                t.shelf = id;
                if let Err(e) = self.maker.try_send(Job::TopUp(t)) {
                    if let Job::TopUp(t) = e.into_inner() {
                        t.warm.done(&t.key, t.shelf);
                    }
                }
            }
        }
    }
}

/// Drops an instance that never served a request (a shelf's) on the maker thread, or here
/// when it is behind.
fn retire(maker: &tokio::sync::mpsc::Sender<Job>, mut i: Instance) {
    if let Some(store) = i.store.take() {
        drop(maker.try_send(Job::Retire(store)));
    }
}

/// Fill a shelf, on the maker thread.
struct TopUp {
    pre: ProcessorPre<State>,
    key: WarmKey,
    /// The id of the shelf it fills, set when the release claims it.
    shelf: u64,
    warm: Arc<Warm>,
}

/// Jobs the maker thread may have queued (a store to drop per release, at most one
/// top-up per shelf); past this a releasing request drops its own instance.
const MAKER_QUEUE: usize = 64;
/// The maker thread's nice value.
#[cfg(target_os = "linux")]
const MAKER_NICE: libc::c_int = 10;

/// After its last job the maker thread keeps looking at its queue, once per tick, this long
/// before it sleeps until woken: a release in that time is queued without waking a thread.
/// Waking one on another core costs the releasing request 18-37 µs on a 2-core virtual
/// machine (`hearth bench processors`, the drop column), for every guest.
const MAKER_LINGER: Duration = Duration::from_millis(50);
/// How often the lingering maker looks (tokio's timer ticks in milliseconds).
const MAKER_TICK: Duration = Duration::from_millis(1);

/// Work for the maker thread.
enum Job {
    /// Drop a released instance's store.
    Retire(Store<State>),
    /// Make the instances the shelf lacks, one per turn, until it lacks none (stopping at
    /// a failure: the next release tries again).
    TopUp(TopUp),
}

/// The thread that drops released instances and makes shelved ones (queued jobs first, then
/// one instance for each running top-up in turn; a slot freed first is reused warm), and
/// empties idle shelves, on its own single-threaded executor: it
/// never takes a request-serving thread, and ends with its runtime. It is one thread, so
/// making ahead keeps up with about one instance per making time (a Python guest: ~1,700
/// a second); past that, requests make their own. For [`MAKER_LINGER`] after its last job it
/// polls its queue every [`MAKER_TICK`] rather than waiting on it, so that releases do not
/// wake it: a top-up then starts up to a tick after its release, and back-to-back requests
/// of a fast guest mostly make their own instances (a WebAssembly text or JavaScript one:
/// 20-40 µs), still faster than with a wake-up per release.
fn spawn_maker(engine: Engine, warm: std::sync::Weak<Warm>) -> anyhow::Result<tokio::sync::mpsc::Sender<Job>> {
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Job>(MAKER_QUEUE);
    let rt = tokio::runtime::Builder::new_current_thread().enable_time().build()?;
    std::thread::Builder::new()
        .name("hearth-wasm-maker".into())
        .spawn(move || {
            // Background work: at a lower priority than the threads serving requests, so
            // that waking it does not preempt the request that released an instance.
            #[cfg(target_os = "linux")]
            // SAFETY: setpriority on this thread's own id; a failure leaves it at the default.
            unsafe {
                libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, MAKER_NICE);
            }
            rt.block_on(async move {
                let sweep_every = WARM_IDLE / 4;
                let mut next_sweep = Instant::now() + sweep_every;
                // Top-ups in progress, one instance made per turn, so that released stores
                // (which hold pool slots) and other shelves are served in between.
                let mut topping: VecDeque<TopUp> = VecDeque::new();
                let mut last_job = Instant::now();
                loop {
                    // Idle shelves are emptied on time even while top-ups keep it busy.
                    if Instant::now() >= next_sweep {
                        if let Some(w) = warm.upgrade() {
                            drop(w.sweep());
                        }
                        next_sweep = Instant::now() + sweep_every;
                    }
                    let job = match rx.try_recv() {
                        Ok(job) => Some(job),
                        Err(TryRecvError::Disconnected) => None,
                        Err(TryRecvError::Empty) => match topping.pop_front() {
                            Some(t) => Some(Job::TopUp(t)),
                            // Not waiting on the queue: a send finds no waker to wake.
                            None if last_job.elapsed() < MAKER_LINGER => {
                                tokio::time::sleep(MAKER_TICK).await;
                                continue;
                            }
                            None => tokio::select! {
                                job = rx.recv() => job,
                                _ = tokio::time::sleep_until(next_sweep.into()) => continue,
                            },
                        },
                    };
                    if job.is_some() {
                        last_job = Instant::now();
                    }
                    match job {
                        // Every sender is gone (the runtime and all its instances): no one is
                        // left to take from the shelves that queued top-ups would fill.
                        None => break,
                        Some(Job::Retire(store)) => drop(store),
                        Some(Job::TopUp(t)) => {
                            // The shelf's need is read again each turn: instances taken
                            // while it is topped up are made too.
                            if t.warm.lacking_or_done(&t.key, t.shelf) == 0 {
                                continue;
                            }
                            match make(&engine, &t.pre, &t.key.config, t.key.limits).await {
                                Ok(i) => {
                                    drop(t.warm.put(&t.key, t.shelf, i));
                                    topping.push_back(t);
                                }
                                Err(e) => {
                                    tracing::debug!(error = %e, "a processor instance could not be made ahead");
                                    t.warm.done(&t.key, t.shelf);
                                }
                            }
                        }
                    }
                }
            })
        })?;
    Ok(tx)
}

/// A fresh instance of a processor (its initializers bounded by its CPU limit).
async fn make(
    engine: &Engine,
    pre: &ProcessorPre<State>,
    config: &str,
    limits: Limits,
) -> Result<Instance, ProcessorError> {
    let stdout = MemoryOutputPipe::new(limits.max_log_bytes.max(1024));
    let clock_start = Arc::new(Mutex::new(Instant::now()));
    let wasi = wasmtime_wasi::WasiCtxBuilder::new()
        .stdout(stdout.clone())
        .stderr(stdout.clone())
        .wall_clock(CoarseWall)
        .monotonic_clock(CoarseMonotonic(clock_start.clone()))
        .allow_tcp(false)
        .allow_udp(false)
        .allow_ip_name_lookup(false)
        .build();
    let state = State {
        wasi,
        table: ResourceTable::new(),
        limits: StoreLimitsBuilder::new()
            .memory_size((limits.memory_mib as usize) << 20)
            .instances(64)
            .tables(64)
            .memories(16)
            .trap_on_grow_failure(true)
            .build(),
        config: config.to_string(),
        logs: LogBuf {
            limit: limits.max_log_bytes,
            ..Default::default()
        },
        stdout,
        ticks: 0,
        max_ticks: limits.cpu_ms,
        clock_start,
    };
    let mut store = Store::new(engine, state);
    store.limiter(|s| &mut s.limits);
    store.epoch_deadline_callback(|mut ctx| {
        let s = ctx.data_mut();
        s.ticks += 1;
        if s.ticks > s.max_ticks {
            Ok(UpdateDeadline::Interrupt)
        } else {
            Ok(UpdateDeadline::Yield(1))
        }
    });
    store.set_epoch_deadline(1);
    let bindings = pre
        .instantiate_async(&mut store)
        .await
        .map_err(|e| match classify(e, &limits) {
            ProcessorError::Trap(m) => ProcessorError::Instantiate(m),
            other => other,
        })?;
    Ok(Instance {
        store: Some(store),
        bindings,
        limits,
        warm: false,
        release: None,
    })
}

/// One request's instance of a processor. Dropping it releases it: its store is dropped
/// on the maker thread, which then refills its shelf.
pub struct Instance {
    /// None only once released.
    store: Option<Store<State>>,
    bindings: Processor,
    limits: Limits,
    warm: bool,
    /// Set when handed to a request (a shelved instance has none).
    release: Option<Release>,
}

impl Drop for Instance {
    fn drop(&mut self) {
        if let Some(r) = self.release.take() {
            r.send(self.store.take());
        }
    }
}

impl Instance {
    /// The bindings and the store, for a call (the store is only gone once released).
    fn live(&mut self) -> Result<(&Processor, &mut Store<State>), ProcessorError> {
        match self.store.as_mut() {
            Some(store) => Ok((&self.bindings, store)),
            None => Err(ProcessorError::Instantiate("the instance was released".into())),
        }
    }

    /// Whether it was made ahead of its request (taken from a shelf).
    pub fn was_warm(&self) -> bool {
        self.warm
    }

    fn begin(&mut self, input: usize) -> Result<(), ProcessorError> {
        if input > self.limits.max_input_bytes {
            return Err(ProcessorError::InputTooLarge {
                size: input,
                limit: self.limits.max_input_bytes,
            });
        }
        let (_, store) = self.live()?;
        store.data_mut().ticks = 0;
        store.set_epoch_deadline(1);
        Ok(())
    }

    fn finish(&self, r: wasmtime::Result<Action>) -> Result<Action, ProcessorError> {
        let a = r.map_err(|e| classify(e, &self.limits))?;
        let size = match &a {
            Action::Continue => 0,
            Action::Replace(s) => s.len(),
            Action::Reject(r) => r.message.len(),
        };
        if size > self.limits.max_output_bytes {
            return Err(ProcessorError::OutputTooLarge {
                size,
                limit: self.limits.max_output_bytes,
            });
        }
        Ok(a)
    }

    pub async fn on_request(&mut self, req: &Request) -> Result<Action, ProcessorError> {
        let size = req.body.len() + req.headers.iter().map(|h| h.name.len() + h.value.len()).sum::<usize>();
        self.begin(size)?;
        let (bindings, store) = self.live()?;
        let r = bindings.call_on_request(store, req).await;
        self.finish(r)
    }

    pub async fn on_response(&mut self, resp: &Response) -> Result<Action, ProcessorError> {
        self.begin(resp.body.len())?;
        let (bindings, store) = self.live()?;
        let r = bindings.call_on_response(store, resp).await;
        self.finish(r)
    }

    pub async fn on_chunk(&mut self, index: u32, text: &str) -> Result<Action, ProcessorError> {
        self.begin(text.len())?;
        let (bindings, store) = self.live()?;
        let r = bindings.call_on_chunk(store, index, text).await;
        self.finish(r)
    }

    pub async fn on_stream_end(&mut self) -> Result<Action, ProcessorError> {
        self.begin(0)?;
        let (bindings, store) = self.live()?;
        let r = bindings.call_on_stream_end(store).await;
        self.finish(r)
    }

    /// What the guest logged (host `log`, stdout and stderr), truncated.
    pub fn logs(&self) -> String {
        let Some(store) = &self.store else {
            return String::new();
        };
        let s = store.data();
        let mut out = s.logs.text.clone();
        let raw = s.stdout.contents();
        if !raw.is_empty() {
            let room = s.logs.limit.saturating_sub(out.len());
            let text = String::from_utf8_lossy(&raw[..raw.len().min(room)]);
            out.push_str(&text);
        }
        out
    }
}

/// Reads a component file (for tools and tests).
pub fn read_component(path: &Path) -> std::io::Result<Vec<u8>> {
    std::fs::read(path)
}

#[cfg(test)]
mod tests;

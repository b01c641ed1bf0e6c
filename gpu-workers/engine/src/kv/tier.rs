//! The KV tier below the engine's pool: full blocks the pool evicts are kept on local disk
//! and read back when a later prompt misses them in the pool, instead of being recomputed.
//!
//! * **Identity.** The pool names blocks by the 64-bit XXH3 chain ([`BlockHash`]), which is
//!   fine for one process's cache and for the router's advisory index. A store that outlives
//!   requests and that every tenant feeds needs more: it is keyed by a second chain,
//!   [`BlockKey`], SHA-256 over (parent key, the block's tokens) truncated to 128 bits, rooted
//!   at (model, cache namespace). A tenant's block can only be found under its own namespace's
//!   chain: a read under another namespace computes other keys. The cost is one SHA-256 of
//!   ~100 bytes per block on the engine thread; the router keeps its 64-bit index, so its
//!   decision time does not change.
//! * **Layout on disk.** One directory per model and KV layout, holding append-only segment
//!   files (`seg-<n>.hkv`, [`SEGMENT_BYTES`] each at most): large sequential writes, never a
//!   file per block. Each record is a header (magic, key, pool hash, tenant, length, the
//!   data's XXH3-64 checksum, the header's own checksum) then the block's bytes.
//! * **Eviction: FIFO of segments with reinsertion** (a log-structured cache, as flash caches
//!   such as CacheLib's and Kangaroo's logs are). When the tier is full the oldest segment is
//!   deleted whole: no fragmentation, no per-block free lists, one `unlink`. A block read
//!   back and evicted again from the pool is rewritten to the head segment if its copy lies in
//!   the older half of the log, so blocks in use survive as in an LRU; cold ones age out.
//! * **Quotas.** Each tenant's live bytes are bounded ([`DiskTierConfig::tenant_bytes`]); a
//!   write over the quota drops that tenant's own oldest records first, never another's.
//! * **Writes** are asynchronous: the engine copies an evicted block's bytes and hands them to
//!   the writer thread through a bounded queue; when the queue is full the block is dropped
//!   (counted), the engine never waits. **Reads** run on the reader thread too: a request
//!   whose prompt continues on disk waits there, then its blocks are imported into the pool
//!   as PD transfers are, and the scheduler finds them as cached prefix.
//! * **Integrity.** Every read checks the header and the data's checksum; a bad record is
//!   dropped from the index and its block recomputed, never used.
//! * **Restart.** Opening the directory scans the segments' headers (not their data) and
//!   rebuilds the index; a torn tail (a crash mid-write) is cut off. One engine owns a
//!   directory at a time (an exclusive lock).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex, MutexGuard};
use std::time::Instant;

use hearth_protocol::{BlockHash, KvEvent, Tier};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use tokio::sync::broadcast;

use crate::kv::block::{BlockKey, KvBlock, KvLayout, Spill};

/// `--kv-disk-dir`, `--kv-disk-gib`, `--kv-disk-tenant-gib`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskTierConfig {
    pub dir: PathBuf,
    /// Bytes of segment files at most.
    pub capacity_bytes: u64,
    /// Live bytes per tenant at most (0: only the capacity bounds a tenant).
    pub tenant_bytes: u64,
}

/// The tier's size when none is given (16 GiB).
pub const DEFAULT_CAPACITY: u64 = 16 << 30;

/// Largest segment file.
pub const SEGMENT_BYTES: u64 = 256 << 20;
/// Blocks waiting to be written at most (beyond them evicted blocks are dropped).
const WRITE_QUEUE_BYTES: usize = 256 << 20;

const FILE_MAGIC: &[u8; 8] = b"HKVSEG01";
const RECORD_MAGIC: &[u8; 4] = b"HKVR";
/// magic, key, hash, checksum, data length, tenant length, header checksum.
const HEADER_BYTES: usize = 4 + 16 + 8 + 8 + 4 + 2 + 8;
const MAX_TENANT: usize = 1024;

/// The tier's counters (also exported as Prometheus metrics by the worker).
#[derive(Debug)]
pub struct TierMetrics {
    /// Blocks read back into the pool, and their bytes.
    pub hits: Counter,
    pub read_bytes: Counter,
    /// Blocks written, and their bytes.
    pub writes: Counter,
    pub written_bytes: Counter,
    /// Blocks dropped: by segment eviction, by a tenant's quota, or because the write queue
    /// was full.
    pub evicted: Counter,
    pub quota_evicted: Counter,
    pub dropped_writes: Counter,
    /// Records whose checksum failed on read (recomputed instead).
    pub corrupt: Counter,
    /// One read-back of a prompt's run of blocks.
    pub read_seconds: Histogram,
    /// What the tier holds now: blocks, and the bytes of its segment files.
    pub blocks: Gauge,
    pub bytes: Gauge,
    /// Set when a tier opens (engines without one export none of these).
    enabled: std::sync::atomic::AtomicBool,
}

impl TierMetrics {
    pub fn enabled(&self) -> bool {
        self.enabled.load(Ordering::Relaxed)
    }
}

impl Default for TierMetrics {
    fn default() -> Self {
        Self {
            hits: Counter::default(),
            read_bytes: Counter::default(),
            writes: Counter::default(),
            written_bytes: Counter::default(),
            evicted: Counter::default(),
            quota_evicted: Counter::default(),
            dropped_writes: Counter::default(),
            corrupt: Counter::default(),
            read_seconds: Histogram::new([0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0]),
            blocks: Gauge::default(),
            bytes: Gauge::default(),
            enabled: Default::default(),
        }
    }
}

/// Where one record lies.
#[derive(Debug, Clone, Copy)]
struct Loc {
    segment: u64,
    offset: u64,
    /// Header + tenant + data.
    len: u32,
    hash: BlockHash,
    tenant: u32,
}

struct Segment {
    path: PathBuf,
    file: Arc<File>,
    bytes: u64,
    /// Records written here (some may have moved or been dropped since).
    keys: Vec<BlockKey>,
}

#[derive(Default)]
struct TenantUse {
    name: Arc<str>,
    live: u64,
    /// Its records, oldest first (stale entries are skipped when popped).
    order: VecDeque<(BlockKey, u64, u64)>,
}

#[derive(Default)]
struct Index {
    records: HashMap<BlockKey, Loc>,
    segments: BTreeMap<u64, Segment>,
    /// Bytes of every segment file.
    bytes: u64,
    tenants: Vec<TenantUse>,
    tenant_ids: HashMap<Arc<str>, u32>,
}

impl Index {
    fn tenant(&mut self, name: &Arc<str>) -> u32 {
        if let Some(&t) = self.tenant_ids.get(name) {
            return t;
        }
        self.tenants.push(TenantUse {
            name: name.clone(),
            ..Default::default()
        });
        let t = self.tenants.len() as u32 - 1;
        self.tenant_ids.insert(name.clone(), t);
        t
    }

    /// Whether segment `id` is in the older half of the live segments (by id: by age).
    fn in_older_half(&self, id: u64) -> bool {
        let n = self.segments.len();
        n >= 2 && self.segments.keys().nth(n / 2).is_some_and(|&mid| id < mid)
    }

    /// Drops a record from the index (its bytes stay until its segment goes).
    fn forget(&mut self, key: &BlockKey) -> Option<Loc> {
        let loc = self.records.remove(key)?;
        let data = u64::from(loc.len);
        if let Some(t) = self.tenants.get_mut(loc.tenant as usize) {
            t.live = t.live.saturating_sub(data);
        }
        Some(loc)
    }

    fn insert(&mut self, key: BlockKey, loc: Loc) -> Option<Loc> {
        let old = self.forget(&key);
        let t = &mut self.tenants[loc.tenant as usize];
        t.live += u64::from(loc.len);
        t.order.push_back((key, loc.segment, loc.offset));
        self.records.insert(key, loc);
        old
    }

    /// Drops the oldest segment from the index: the hashes of the records that went with
    /// it, and its file to delete.
    fn drop_oldest(&mut self) -> (Vec<BlockHash>, Option<PathBuf>) {
        let Some((id, seg)) = self.segments.pop_first() else {
            return (Vec::new(), None);
        };
        self.bytes -= seg.bytes;
        let mut gone = Vec::new();
        for key in seg.keys {
            if self.records.get(&key).is_some_and(|l| l.segment == id) {
                if let Some(l) = self.forget(&key) {
                    gone.push(l.hash);
                }
            }
        }
        // Each tenant's order is by segment: its entries for this one are at the front.
        for t in &mut self.tenants {
            while t.order.front().is_some_and(|e| e.1 <= id) {
                t.order.pop_front();
            }
        }
        // (The caller deletes the file once the index is unlocked.)
        (gone, Some(seg.path))
    }

    /// Drops a tenant's oldest live records until `more` bytes fit its quota.
    fn make_quota_room(&mut self, tenant: u32, more: u64, quota: u64) -> Vec<BlockHash> {
        let mut gone = Vec::new();
        while self.tenants[tenant as usize].live + more > quota {
            let Some((key, seg, off)) = self.tenants[tenant as usize].order.pop_front() else {
                break;
            };
            if self
                .records
                .get(&key)
                .is_some_and(|l| l.segment == seg && l.offset == off)
            {
                if let Some(l) = self.forget(&key) {
                    gone.push(l.hash);
                }
            }
        }
        gone
    }
}

struct Shared {
    index: Mutex<Index>,
    dir: PathBuf,
    capacity: u64,
    tenant_bytes: u64,
    segment_bytes: u64,
    block_bytes: usize,
    metrics: Arc<TierMetrics>,
    events: broadcast::Sender<KvEvent>,
    queued_bytes: AtomicU64,
    /// Held for the life of the tier: one engine per directory.
    _lock: File,
}

impl Shared {
    fn index(&self) -> MutexGuard<'_, Index> {
        // A panic elsewhere never leaves the index half-updated in a way reads could misuse:
        // every record is checked on read.
        self.index.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sets the occupancy gauges from the index.
    fn gauge(&self, ix: &Index) {
        self.metrics.blocks.set(ix.records.len() as i64);
        self.metrics.bytes.set(ix.bytes as i64);
    }

    fn announce(&self, ev: KvEvent) {
        let _ = self.events.send(ev);
    }
}

/// A block read back: the block (checksum verified or not: see `why`), why it was refused,
/// and its spill identity for when the pool evicts it again.
pub type ReadBlock = (KvBlock, Option<String>, Option<Spill>);

/// Runs when a read finishes (on the reader thread).
pub type ReadDone = Box<dyn FnOnce(Vec<ReadBlock>) + Send>;

struct WriteJob {
    key: BlockKey,
    hash: BlockHash,
    tenant: Arc<str>,
    data: Vec<u8>,
}

struct ReadJob {
    run: Vec<(BlockKey, BlockHash)>,
    done: ReadDone,
}

/// The disk tier of one engine.
pub struct DiskTier {
    shared: Arc<Shared>,
    /// (Options only so that dropping the tier can close them first.)
    writes: Option<mpsc::Sender<WriteJob>>,
    reads: Option<mpsc::Sender<ReadJob>>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Drop for DiskTier {
    /// Writes what is queued, then stops the threads, so the directory's lock is free when
    /// this returns (a restarted engine opens it at once).
    fn drop(&mut self) {
        self.writes = None;
        self.reads = None;
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl std::fmt::Debug for DiskTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiskTier").field("dir", &self.shared.dir).finish()
    }
}

/// What the tier holds, for the dashboard and tests.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct TierUsage {
    pub blocks: usize,
    pub live_bytes: u64,
    pub file_bytes: u64,
    pub capacity_bytes: u64,
    pub segments: usize,
    /// Live bytes per tenant.
    pub tenants: Vec<(String, u64)>,
}

impl DiskTier {
    /// Opens (or creates) the tier for one model and layout under `cfg.dir`, rebuilding the
    /// index from what a previous run wrote.
    pub fn open(
        cfg: &DiskTierConfig,
        model_id: &str,
        weights_id: u64,
        layout: &KvLayout,
        events: broadcast::Sender<KvEvent>,
        metrics: Arc<TierMetrics>,
    ) -> std::io::Result<Self> {
        let block_bytes = layout.block_bytes();
        // The weights are part of the identity: the same id and layout with another file
        // (re-fetched, re-quantized, replaced) never reads this one's blocks.
        let layout_id = xxhash_rust::xxh3::xxh3_64(
            format!(
                "{model_id}\0{}\0{weights_id:016x}",
                serde_json::to_string(layout).unwrap_or_default()
            )
            .as_bytes(),
        );
        let safe: String = model_id
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || "-_.".contains(c) {
                    c
                } else {
                    '_'
                }
            })
            .take(64)
            .collect();
        // One engine per directory: a second engine of the same model (`--workers N`) takes
        // the next free suffix, so each keeps its own blocks across restarts.
        let base = format!("{safe}-{layout_id:016x}");
        let mut taken = None;
        for i in 0..64 {
            let dir = if i == 0 {
                cfg.dir.join(&base)
            } else {
                cfg.dir.join(format!("{base}-{i}"))
            };
            std::fs::create_dir_all(&dir)?;
            let lock = File::options()
                .create(true)
                .truncate(false)
                .write(true)
                .open(dir.join("LOCK"))?;
            if lock.try_lock().is_ok() {
                taken = Some((dir, lock));
                break;
            }
        }
        let Some((dir, lock)) = taken else {
            return Err(std::io::Error::other(format!(
                "every KV disk directory for {model_id} under {} is in use by another engine",
                cfg.dir.display()
            )));
        };
        let record_bytes = (HEADER_BYTES + MAX_TENANT + block_bytes) as u64;
        if cfg.capacity_bytes < 2 * record_bytes {
            return Err(std::io::Error::other(format!(
                "--kv-disk-gib is smaller than two KV blocks ({record_bytes} bytes each)"
            )));
        }
        // At least eight segments, so that deleting one frees an eighth, not everything.
        let segment_bytes = (cfg.capacity_bytes / 8).clamp(record_bytes, SEGMENT_BYTES.max(record_bytes));
        let shared = Arc::new(Shared {
            index: Mutex::new(Index::default()),
            dir,
            capacity: cfg.capacity_bytes,
            tenant_bytes: if cfg.tenant_bytes == 0 {
                u64::MAX
            } else {
                cfg.tenant_bytes
            },
            segment_bytes,
            block_bytes,
            metrics,
            events,
            queued_bytes: AtomicU64::new(0),
            _lock: lock,
        });
        let next = scan(&shared)?;
        shared.gauge(&shared.index());
        shared.metrics.enabled.store(true, Ordering::Relaxed);
        let (writes, wrx) = mpsc::channel();
        let (reads, rrx) = mpsc::channel::<ReadJob>();
        let w = shared.clone();
        let writer = std::thread::Builder::new()
            .name("hearth-kv-disk-write".into())
            .spawn(move || Writer::new(w, next).run(wrx))?;
        let r = shared.clone();
        let reader = std::thread::Builder::new()
            .name("hearth-kv-disk-read".into())
            .spawn(move || {
                while let Ok(job) = rrx.recv() {
                    let started = Instant::now();
                    let blocks = read_run(&r, &job.run);
                    r.metrics.read_seconds.observe(started.elapsed().as_secs_f64());
                    (job.done)(blocks);
                }
            })?;
        Ok(Self {
            shared,
            writes: Some(writes),
            reads: Some(reads),
            threads: vec![writer, reader],
        })
    }

    /// The bytes of one block's data.
    pub fn block_bytes(&self) -> usize {
        self.shared.block_bytes
    }

    /// The directory this tier writes (one per model and layout).
    pub fn dir(&self) -> &Path {
        &self.shared.dir
    }

    pub fn metrics(&self) -> &TierMetrics {
        &self.shared.metrics
    }

    pub fn contains(&self, key: &BlockKey) -> bool {
        self.shared.index().records.contains_key(key)
    }

    /// Whether a block should be written: the tier lacks it, or its copy lies in the older
    /// half of the segments (rewriting it there keeps a block in use from aging out).
    pub fn wants(&self, key: &BlockKey) -> bool {
        let ix = self.shared.index();
        ix.records.get(key).is_none_or(|l| ix.in_older_half(l.segment))
    }

    /// How many of `keys`, from the first, the tier holds.
    pub fn leading(&self, keys: &[BlockKey]) -> usize {
        let ix = self.shared.index();
        keys.iter().take_while(|k| ix.records.contains_key(k)).count()
    }

    /// The pool hashes of every block held (for a KV-event snapshot).
    pub fn hashes(&self) -> Vec<BlockHash> {
        let mut v: Vec<BlockHash> = self.shared.index().records.values().map(|l| l.hash).collect();
        v.sort();
        v.dedup();
        v
    }

    pub fn usage(&self) -> TierUsage {
        let ix = self.shared.index();
        TierUsage {
            blocks: ix.records.len(),
            live_bytes: ix.tenants.iter().map(|t| t.live).sum(),
            file_bytes: ix.bytes,
            capacity_bytes: self.shared.capacity,
            segments: ix.segments.len(),
            tenants: ix
                .tenants
                .iter()
                .filter(|t| t.live > 0)
                .map(|t| (t.name.to_string(), t.live))
                .collect(),
        }
    }

    /// Queues an evicted block for writing; drops it (counted) when the queue is full.
    pub fn spill(&self, hash: BlockHash, spill: Spill, data: Vec<u8>) {
        let n = data.len() as u64;
        let queued = self.shared.queued_bytes.fetch_add(n, Ordering::Relaxed);
        if queued + n > WRITE_QUEUE_BYTES as u64 {
            self.shared.queued_bytes.fetch_sub(n, Ordering::Relaxed);
            self.shared.metrics.dropped_writes.inc();
            return;
        }
        let job = WriteJob {
            key: spill.key,
            hash,
            tenant: spill.tenant,
            data,
        };
        if self.writes.as_ref().is_none_or(|w| w.send(job).is_err()) {
            self.shared.queued_bytes.fetch_sub(n, Ordering::Relaxed);
            self.shared.metrics.dropped_writes.inc();
        }
    }

    /// Reads a run of blocks on the reader thread, stopping at the first missing or damaged
    /// one (which is returned refused, so the import stops there); `done` gets them.
    pub fn read(&self, run: Vec<(BlockKey, BlockHash)>, done: ReadDone) {
        let job = ReadJob { run, done };
        match &self.reads {
            Some(r) => {
                if let Err(mpsc::SendError(job)) = r.send(job) {
                    (job.done)(Vec::new());
                }
            }
            None => (job.done)(Vec::new()),
        }
    }

    /// Reads a run of blocks on this thread (tests, benchmarks).
    pub fn read_now(&self, run: &[(BlockKey, BlockHash)]) -> Vec<ReadBlock> {
        read_run(&self.shared, run)
    }

    /// Waits until every queued write is on disk (tests, benchmarks, shutdown).
    pub fn flush(&self) {
        while self.shared.queued_bytes.load(Ordering::Acquire) > 0 {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    /// Asks the kernel to drop the segments' pages from its cache (benchmarks: a "cold"
    /// read). Dirty pages are written first.
    pub fn drop_page_cache(&self) {
        let ix = self.shared.index();
        for seg in ix.segments.values() {
            let _ = seg.file.sync_data();
            // SAFETY: a valid descriptor owned by `seg.file`; advice has no memory effects.
            unsafe {
                libc::posix_fadvise(
                    std::os::fd::AsRawFd::as_raw_fd(&*seg.file),
                    0,
                    0,
                    libc::POSIX_FADV_DONTNEED,
                );
            }
        }
    }
}

fn segment_path(dir: &Path, id: u64) -> PathBuf {
    dir.join(format!("seg-{id:010}.hkv"))
}

fn header_checksum(h: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(&h[..HEADER_BYTES - 8])
}

/// A record's header fields.
struct Header {
    key: BlockKey,
    hash: BlockHash,
    checksum: u64,
    data_len: usize,
    tenant_len: usize,
}

fn encode_header(key: &BlockKey, hash: BlockHash, checksum: u64, data_len: usize, tenant: &[u8]) -> Vec<u8> {
    let mut h = Vec::with_capacity(HEADER_BYTES + tenant.len());
    h.extend_from_slice(RECORD_MAGIC);
    h.extend_from_slice(&key.0);
    h.extend_from_slice(&hash.0.to_le_bytes());
    h.extend_from_slice(&checksum.to_le_bytes());
    h.extend_from_slice(&(data_len as u32).to_le_bytes());
    h.extend_from_slice(&(tenant.len() as u16).to_le_bytes());
    let c = xxhash_rust::xxh3::xxh3_64(&h);
    h.extend_from_slice(&c.to_le_bytes());
    h.extend_from_slice(tenant);
    h
}

fn decode_header(h: &[u8], block_bytes: usize) -> Option<Header> {
    if h.len() < HEADER_BYTES || &h[..4] != RECORD_MAGIC {
        return None;
    }
    let stored = u64::from_le_bytes(h[HEADER_BYTES - 8..HEADER_BYTES].try_into().ok()?);
    if header_checksum(h) != stored {
        return None;
    }
    let u64_at = |o: usize| h[o..o + 8].try_into().ok().map(u64::from_le_bytes);
    let data_len = u32::from_le_bytes(h[36..40].try_into().ok()?) as usize;
    let tenant_len = u16::from_le_bytes(h[40..42].try_into().ok()?) as usize;
    if data_len != block_bytes || tenant_len > MAX_TENANT {
        return None;
    }
    Some(Header {
        key: BlockKey(h[4..20].try_into().ok()?),
        hash: BlockHash(u64_at(20)?),
        checksum: u64_at(28)?,
        data_len,
        tenant_len,
    })
}

/// Rebuilds the index from the segment files; the id the next segment takes.
fn scan(shared: &Shared) -> std::io::Result<u64> {
    let mut ids: Vec<u64> = std::fs::read_dir(&shared.dir)?
        .filter_map(|e| {
            let name = e.ok()?.file_name().into_string().ok()?;
            name.strip_prefix("seg-")?.strip_suffix(".hkv")?.parse().ok()
        })
        .collect();
    ids.sort_unstable();
    let mut ix = shared.index();
    for &id in &ids {
        let path = segment_path(&shared.dir, id);
        let file = File::options().read(true).write(true).open(&path)?;
        let len = file.metadata()?.len();
        let mut r = BufReader::with_capacity(1 << 16, &file);
        let mut magic = [0u8; 8];
        if r.read_exact(&mut magic).is_err() || &magic != FILE_MAGIC {
            tracing::warn!(path = %path.display(), "not a KV segment; removed");
            drop(r);
            let _ = std::fs::remove_file(&path);
            continue;
        }
        let mut offset = FILE_MAGIC.len() as u64;
        let mut keys = Vec::new();
        let mut head = vec![0u8; HEADER_BYTES];
        loop {
            if r.read_exact(&mut head).is_err() {
                break;
            }
            let Some(h) = decode_header(&head, shared.block_bytes) else {
                break;
            };
            let mut tenant = vec![0u8; h.tenant_len];
            if r.read_exact(&mut tenant).is_err() {
                break;
            }
            let rec_len = (HEADER_BYTES + h.tenant_len + h.data_len) as u64;
            if offset + rec_len > len {
                break; // the data was cut short
            }
            r.seek(SeekFrom::Current(h.data_len as i64))?;
            let name: Arc<str> = String::from_utf8_lossy(&tenant).into();
            let t = ix.tenant(&name);
            ix.insert(
                h.key,
                Loc {
                    segment: id,
                    offset,
                    len: rec_len as u32,
                    hash: h.hash,
                    tenant: t,
                },
            );
            keys.push(h.key);
            offset += rec_len;
        }
        drop(r);
        if offset < len {
            tracing::warn!(path = %path.display(), kept = offset, length = len, "KV segment had a torn tail; cut");
            file.set_len(offset)?;
        }
        ix.bytes += offset;
        ix.segments.insert(
            id,
            Segment {
                path,
                file: Arc::new(file),
                bytes: offset,
                keys,
            },
        );
    }
    if !ix.records.is_empty() {
        tracing::info!(
            dir = %shared.dir.display(),
            blocks = ix.records.len(),
            segments = ix.segments.len(),
            mib = ix.bytes >> 20,
            "KV disk tier reopened"
        );
    }
    Ok(ids.last().map_or(0, |l| l + 1))
}

fn read_run(shared: &Shared, run: &[(BlockKey, BlockHash)]) -> Vec<ReadBlock> {
    let mut out = Vec::new();
    for &(key, hash) in run {
        let found = {
            let ix = shared.index();
            ix.records.get(&key).and_then(|l| {
                let seg = ix.segments.get(&l.segment)?;
                Some((*l, seg.file.clone(), ix.tenants[l.tenant as usize].name.clone()))
            })
        };
        let Some((loc, file, tenant)) = found else { break };
        let mut buf = vec![0u8; loc.len as usize];
        let checked = file
            .read_exact_at(&mut buf, loc.offset)
            .ok()
            .and_then(|_| decode_header(&buf, shared.block_bytes))
            .filter(|h| h.key == key && h.hash == hash && HEADER_BYTES + h.tenant_len + h.data_len == buf.len());
        let Some(h) = checked else {
            bad(shared, &key, loc);
            out.push((KvBlock::new(hash, Vec::new()), Some("damaged disk record".into()), None));
            break;
        };
        let data = buf.split_off(HEADER_BYTES + h.tenant_len);
        let block = KvBlock {
            hash,
            checksum: h.checksum,
            data: data.into(),
        };
        if !block.intact() {
            bad(shared, &key, loc);
            out.push((block, Some("checksum mismatch on disk".into()), None));
            break;
        }
        shared.metrics.hits.inc();
        shared.metrics.read_bytes.inc_by(block.data.len() as u64);
        out.push((block, None, Some(Spill { key, tenant })));
    }
    out
}

/// A record failed its checks: forget it (the block is recomputed) and say so.
fn bad(shared: &Shared, key: &BlockKey, loc: Loc) {
    shared.metrics.corrupt.inc();
    tracing::warn!(
        segment = loc.segment,
        offset = loc.offset,
        "damaged KV record on disk; recomputing its block"
    );
    let mut ix = shared.index();
    if ix
        .records
        .get(key)
        .is_some_and(|l| l.segment == loc.segment && l.offset == loc.offset)
    {
        ix.forget(key);
        shared.gauge(&ix);
        drop(ix);
        shared.announce(KvEvent::Removed {
            blocks: vec![loc.hash],
            tier: Tier::Disk,
        });
    }
}

/// The writer thread: appends records to the head segment.
struct Writer {
    shared: Arc<Shared>,
    next: u64,
    head: Option<(u64, Arc<File>, u64)>,
}

impl Writer {
    fn new(shared: Arc<Shared>, next: u64) -> Self {
        Self {
            shared,
            next,
            head: None,
        }
    }

    fn run(mut self, rx: mpsc::Receiver<WriteJob>) {
        while let Ok(job) = rx.recv() {
            let n = job.data.len() as u64;
            let mut stored = Vec::new();
            let mut gone = Vec::new();
            let mut unlink = Vec::new();
            self.write(job, &mut stored, &mut gone, &mut unlink);
            // Drain what else is queued before announcing, so events come in batches.
            while let Ok(job) = rx.try_recv() {
                let m = job.data.len() as u64;
                self.write(job, &mut stored, &mut gone, &mut unlink);
                self.shared.queued_bytes.fetch_sub(m, Ordering::AcqRel);
            }
            self.shared.gauge(&self.shared.index());
            for path in unlink {
                let _ = std::fs::remove_file(path);
            }
            self.shared.queued_bytes.fetch_sub(n, Ordering::AcqRel);
            if !gone.is_empty() {
                self.shared.announce(KvEvent::Removed {
                    blocks: gone,
                    tier: Tier::Disk,
                });
            }
            if !stored.is_empty() {
                self.shared.announce(KvEvent::Stored {
                    blocks: stored,
                    tier: Tier::Disk,
                });
            }
        }
    }

    /// Appends one record; the segments it dropped for room go to `unlink` (deleted by the
    /// caller, outside the index lock, so that readers never wait on the filesystem).
    fn write(
        &mut self,
        job: WriteJob,
        stored: &mut Vec<BlockHash>,
        gone: &mut Vec<BlockHash>,
        unlink: &mut Vec<PathBuf>,
    ) {
        let s = self.shared.clone();
        if job.data.len() != s.block_bytes {
            return;
        }
        let mut cut = job.tenant.len().min(MAX_TENANT);
        while !job.tenant.is_char_boundary(cut) {
            cut -= 1;
        }
        let tenant_bytes = &job.tenant.as_bytes()[..cut];
        let len = (HEADER_BYTES + tenant_bytes.len() + job.data.len()) as u64;
        {
            let ix = s.index();
            if let Some(l) = ix.records.get(&job.key) {
                // Already held: rewrite it only if its copy is in the older half of the log
                // (reinsertion keeps blocks in use from aging out).
                if !ix.in_older_half(l.segment) {
                    return;
                }
            }
        }
        // Room: the tenant's quota, then the tier's capacity (whole segments).
        {
            let mut ix = s.index();
            let t = ix.tenant(&job.tenant);
            let dropped = ix.make_quota_room(t, len, s.tenant_bytes);
            s.metrics.quota_evicted.inc_by(dropped.len() as u64);
            gone.extend(dropped);
            let head = self.head.as_ref().map(|h| h.0);
            while ix.bytes + len > s.capacity && ix.segments.keys().next().is_some_and(|&id| Some(id) != head) {
                let (dropped, file) = ix.drop_oldest();
                s.metrics.evicted.inc_by(dropped.len() as u64);
                gone.extend(dropped);
                unlink.extend(file);
            }
        }
        let need_new = match &self.head {
            None => true,
            Some((_, _, at)) => at + len > s.segment_bytes,
        };
        if need_new {
            if let Err(e) = self.rotate() {
                tracing::error!(error = %e, dir = %s.dir.display(), "cannot start a KV segment; block dropped");
                s.metrics.dropped_writes.inc();
                return;
            }
            // A new head may need room that the old head held.
            let mut ix = s.index();
            let head = self.head.as_ref().map(|h| h.0);
            while ix.bytes + len > s.capacity && ix.segments.keys().next().is_some_and(|&id| Some(id) != head) {
                let (dropped, file) = ix.drop_oldest();
                s.metrics.evicted.inc_by(dropped.len() as u64);
                gone.extend(dropped);
                unlink.extend(file);
            }
        }
        let Some((id, file, at)) = self.head.clone() else {
            return;
        };
        let checksum = xxhash_rust::xxh3::xxh3_64(&job.data);
        let mut rec = encode_header(&job.key, job.hash, checksum, job.data.len(), tenant_bytes);
        rec.extend_from_slice(&job.data);
        if let Err(e) = file.write_all_at(&rec, at) {
            tracing::error!(error = %e, "writing a KV record failed; block dropped");
            s.metrics.dropped_writes.inc();
            return;
        }
        self.head = Some((id, file, at + len));
        let mut ix = s.index();
        let t = ix.tenant(&job.tenant);
        ix.insert(
            job.key,
            Loc {
                segment: id,
                offset: at,
                len: len as u32,
                hash: job.hash,
                tenant: t,
            },
        );
        ix.bytes += len;
        if let Some(seg) = ix.segments.get_mut(&id) {
            seg.bytes += len;
            seg.keys.push(job.key);
        }
        s.metrics.writes.inc();
        s.metrics.written_bytes.inc_by(job.data.len() as u64);
        stored.push(job.hash);
    }

    fn rotate(&mut self) -> std::io::Result<()> {
        let id = self.next;
        self.next += 1;
        let path = segment_path(&self.shared.dir, id);
        let file = File::options().create_new(true).read(true).write(true).open(&path)?;
        file.write_all_at(FILE_MAGIC, 0)?;
        let file = Arc::new(file);
        let at = FILE_MAGIC.len() as u64;
        let mut ix = self.shared.index();
        ix.bytes += at;
        ix.segments.insert(
            id,
            Segment {
                path,
                file: file.clone(),
                bytes: at,
                keys: Vec::new(),
            },
        );
        self.head = Some((id, file, at));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::block::KvDtypeName;
    use crate::models::Arch;

    fn layout() -> KvLayout {
        KvLayout {
            arch: Arch::Llama,
            rope: 1,
            n_layers: 1,
            kv_dim: 8,
            head_dim: 8,
            block_tokens: 4,
            dtype: KvDtypeName::F32,
            latent: false,
        }
    }

    fn tier(dir: &Path, capacity: u64, tenant: u64) -> DiskTier {
        let (tx, _) = broadcast::channel(1024);
        let cfg = DiskTierConfig {
            dir: dir.to_path_buf(),
            capacity_bytes: capacity,
            tenant_bytes: tenant,
        };
        DiskTier::open(&cfg, "m", 1, &layout(), tx, Arc::default()).unwrap()
    }

    fn chain(n: usize, ns: &str) -> Vec<(BlockKey, BlockHash, Vec<u8>)> {
        let mut k = BlockKey::root("m", ns);
        (0..n)
            .map(|i| {
                k = k.chain(&[i as u32; 4]);
                let data: Vec<u8> = (0..layout().block_bytes()).map(|j| (i * 7 + j) as u8).collect();
                (k, BlockHash(i as u64 + 1), data)
            })
            .collect()
    }

    #[test]
    fn blocks_survive_a_restart_and_damage_is_refused() {
        let dir = tempdir("restart");
        let blocks = chain(5, "a");
        {
            let t = tier(&dir, 1 << 20, 0);
            for (k, h, d) in &blocks {
                t.spill(
                    *h,
                    Spill {
                        key: *k,
                        tenant: "a".into(),
                    },
                    d.clone(),
                );
            }
            t.flush();
            assert_eq!(t.usage().blocks, 5);
        }
        let t = tier(&dir, 1 << 20, 0);
        let run: Vec<_> = blocks.iter().map(|(k, h, _)| (*k, *h)).collect();
        assert_eq!(t.leading(&run.iter().map(|r| r.0).collect::<Vec<_>>()), 5);
        let got = t.read_now(&run);
        assert_eq!(got.len(), 5);
        for ((b, why, spill), (k, _, d)) in got.iter().zip(&blocks) {
            assert!(why.is_none());
            assert_eq!(&b.data.to_vec(), d);
            assert_eq!(spill.as_ref().unwrap().key, *k);
        }
        // Another namespace's chain finds nothing.
        let other: Vec<BlockKey> = chain(5, "b").iter().map(|c| c.0).collect();
        assert_eq!(t.leading(&other), 0);
        // Damage the third block's data: the run stops there, refused, and it is forgotten.
        let seg = std::fs::read_dir(t.dir())
            .unwrap()
            .filter_map(|e| e.ok())
            .find(|e| e.file_name().to_string_lossy().ends_with(".hkv"))
            .unwrap()
            .path();
        let mut bytes = std::fs::read(&seg).unwrap();
        let rec = HEADER_BYTES + 1 + layout().block_bytes();
        let at = FILE_MAGIC.len() + 2 * rec + HEADER_BYTES + 1 + 10;
        bytes[at] ^= 0xff;
        std::fs::write(&seg, &bytes).unwrap();
        let got = t.read_now(&run);
        assert_eq!(got.len(), 3);
        assert!(got[2].1.is_some());
        assert!(!t.contains(&blocks[2].0));
        drop(t);
        // A torn tail is cut at reopening.
        let len = std::fs::metadata(&seg).unwrap().len();
        File::options()
            .write(true)
            .open(&seg)
            .unwrap()
            .set_len(len - 5)
            .unwrap();
        let t = tier(&dir, 1 << 20, 0);
        // (The damaged record's header is intact: it is indexed again, and refused again on read.)
        assert_eq!(t.usage().blocks, 4);
        assert_eq!(
            std::fs::metadata(&seg).unwrap().len(),
            (FILE_MAGIC.len() + 4 * rec) as u64,
            "the torn record was cut off"
        );
    }

    #[test]
    fn capacity_drops_whole_old_segments_and_quotas_hold_per_tenant() {
        let dir = tempdir("capacity");
        let rec = (HEADER_BYTES + 1 + layout().block_bytes()) as u64;
        // Room for ~16 records in 8 segments of 2.
        let t = tier(&dir, 16 * rec + 64, 4 * rec);
        let a = chain(10, "a");
        for (k, h, d) in &a {
            t.spill(
                *h,
                Spill {
                    key: *k,
                    tenant: "a".into(),
                },
                d.clone(),
            );
        }
        t.flush();
        let u = t.usage();
        assert!(u.tenants.iter().all(|(_, b)| *b <= 4 * rec), "{u:?}");
        // The newest four are the ones kept.
        let keys: Vec<BlockKey> = a.iter().map(|c| c.0).collect();
        assert!(keys[6..].iter().all(|k| t.contains(k)));
        assert!(!t.contains(&keys[0]));
        let b = chain(30, "b");
        for (k, h, d) in &b {
            t.spill(
                *h,
                Spill {
                    key: *k,
                    tenant: "b".into(),
                },
                d.clone(),
            );
        }
        t.flush();
        let u = t.usage();
        assert!(u.file_bytes <= 16 * rec + 64, "{u:?}");
        assert!(u.tenants.iter().all(|(_, b)| *b <= 4 * rec), "{u:?}");
    }

    fn tempdir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("hearth-kv-tier-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }
}

//! Packs: repacked weights in a file, mapped — not read into memory, not copied — by a load
//! instead of repacking. `hearth model pack MODEL [--out DIR]` prepares one once for a fleet
//! (`NAME.hearth-pack-v3` in `DIR`, else beside the model: `MODEL.gguf.hearth-pack-v3`, or
//! `hearth-pack-v3` inside a Hugging Face directory, holding its float matrices quantized to
//! Q8_0). A load looks in its [`PackCache`]'s directory first, then beside the model, and maps
//! from the first current pack the matrices it computes with (a pack may hold more: a worker
//! serving part of a model reads only its part). [`PackMode::Read`], the default, never
//! writes; [`PackMode::Write`] writes the pack after a repack (for CPUs slow to repack).
//!
//! Layout (little-endian), version [`PACK_FORMAT`]:
//!
//! | bytes | content |
//! |---|---|
//! | 0..8 | magic `HRTHPACK` |
//! | 8..12 | layout version ([`PACK_FORMAT`]) |
//! | 12..16 | number of matrices `n` |
//! | 16..24 | the model file's size (a Hugging Face directory: its shards' total) |
//! | 24..36 | the model file's modification time (seconds u64, nanoseconds u32; a directory: its newest shard's) |
//! | 36..40 | a directory's shards: 32 bits of the XXH3 of every shard's name, size and time (a file: 0) |
//! | 40..48 | reserved (0) |
//! | 48.. | `n` entries of 56 bytes: kind (u32: [`PackKind::code`]), reserved u32, rows u64, cols u64, the tensor's offset in the model file u64 (a directory: the shard's index in the top 16 bits), the bytes' offset in this file u64, their length u64, the XXH3-64 of those bytes |
//!
//! Each matrix's bytes start at a multiple of 4096. A pack is mapped only if the version and
//! the model file's size and time match, and it holds every wanted matrix with its shape at
//! its tensor offset; anything else is a miss, and the load repacks in memory (and, writing,
//! rewrites the pack: atomically, a temporary file renamed into place).
//!
//! **Checked before first use, not before the load returns.** Reading the whole file to
//! check it first would put a cold disk's read before the first prefill. Instead a
//! `Verifier` thread hashes the matrices in file order (the order the forward pass uses
//! them: layer by layer, then the output), and each matrix's first use waits for its own
//! check ([`PackedMatrix::checked`]). So the read overlaps the first layers' compute, and
//! every matrix is checked once, before its first use: one whose bytes differ from what was
//! written is repacked from the model file in memory on that use (the same bytes a fresh
//! load makes), and — by a worker that writes packs — the file is deleted so that the next
//! load rewrites it (a reading worker leaves a shared store as it is). (A process that
//! unloads the model or exits before the check reaches a corrupt matrix deletes nothing: the
//! next load finds it again.)

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use xxhash_rust::xxh3::Xxh3;

use crate::kernels::packed::{PackKind, PackedMatrix, PACK_FORMAT};

const MAGIC: &[u8; 8] = b"HRTHPACK";
/// Bytes of the header before the entry table.
const HEADER: usize = 48;
const ENTRY: usize = 56;
const ALIGN: usize = 4096;

/// What a cached matrix must be to stand for one of the model's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Wanted {
    pub kind: PackKind,
    pub rows: usize,
    pub cols: usize,
    /// The tensor's offset in the model file (its identity there; for a directory's
    /// shards, the shard's index in the top 16 bits).
    pub tensor_offset: u64,
}

/// What a load does with packs: map one that is current, and whether it writes one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PackMode {
    /// Neither maps nor writes.
    Off,
    /// Maps a current pack (in the pack directory, else beside the model) and never
    /// writes anything: a model store that is read-only or shared stays as it is, and a
    /// miss repacks in memory.
    #[default]
    Read,
    /// As `Read`, and after a repack writes the pack for the next load (the pack
    /// directory if set, else beside the model) — for CPUs slow enough that reading the
    /// pack beats repacking; it takes as much disk as the model.
    Write,
}

impl PackMode {
    /// `off`, `read` or `write` (`0` and `1`, the variable's earlier values: off and write).
    pub fn parse(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "off" | "0" | "false" => Ok(PackMode::Off),
            "read" => Ok(PackMode::Read),
            "write" | "1" | "true" => Ok(PackMode::Write),
            other => Err(format!("unknown pack-cache mode {other:?} (off, read or write)")),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            PackMode::Off => "off",
            PackMode::Read => "read",
            PackMode::Write => "write",
        }
    }

    /// `HEARTH_PACK_CACHE` (a value [`Self::parse`] refuses counts as the default, with a
    /// warning; the CLI refuses it).
    pub fn from_env() -> Self {
        match std::env::var("HEARTH_PACK_CACHE").ok().map(|v| Self::parse(&v)) {
            Some(Ok(m)) => m,
            Some(Err(e)) => {
                tracing::warn!(error = %e, "HEARTH_PACK_CACHE ignored: packs are read");
                Self::default()
            }
            None => Self::default(),
        }
    }
}

/// Where packs are looked for and written: a directory of prepared packs (a fleet's shared
/// model store, `hearth model pack --out DIR`), and the mode.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PackCache {
    pub mode: PackMode,
    /// Looked in first; where `Write` writes. `None`: beside the model only.
    pub dir: Option<PathBuf>,
}

impl PackCache {
    /// No packs read or written.
    pub const OFF: PackCache = PackCache {
        mode: PackMode::Off,
        dir: None,
    };

    /// The mode from `HEARTH_PACK_CACHE`, packs beside the model.
    pub fn from_env() -> Self {
        PackCache {
            mode: PackMode::from_env(),
            dir: None,
        }
    }

    /// Writes after a repack, beside the model.
    pub fn writing() -> Self {
        PackCache {
            mode: PackMode::Write,
            dir: None,
        }
    }

    /// The packs that could stand for `model`, in the order looked at: the directory's,
    /// then the one beside the model.
    pub fn candidates(&self, model: &Path) -> Vec<PathBuf> {
        if self.mode == PackMode::Off {
            return Vec::new();
        }
        self.dir
            .iter()
            .map(|d| path_in(d, model))
            .chain([path_for(model)])
            .collect()
    }

    /// Where a pack is written: the directory's, else beside the model.
    pub fn target(&self, model: &Path) -> PathBuf {
        match &self.dir {
            Some(d) => path_in(d, model),
            None => path_for(model),
        }
    }
}

/// How far a model's load has come, for `/metrics`: its packed weights' bytes and layers
/// ready to compute with — repacked in memory (complete when the load returns), or mapped
/// from a pack and checked (which goes on in the background after the load returns, so that
/// an operator sees a large model's read advance while it already serves). Not visible
/// while the engine is still being built: `/metrics` shows engines once loaded.
#[derive(Debug, Default)]
pub struct LoadProgress {
    /// [`WeightsSource`] as its code.
    source: AtomicU8,
    total_bytes: std::sync::atomic::AtomicU64,
    ready_bytes: std::sync::atomic::AtomicU64,
    ready_matrices: std::sync::atomic::AtomicUsize,
    /// Matrices counted at each layer's end (and the output's), in load order.
    layer_ends: std::sync::OnceLock<Vec<usize>>,
}

/// Where a model's compute weights come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightsSource {
    /// Straight from the model file (no SIMD path, or every matrix float).
    Unpacked = 0,
    /// Mapped from a prepared pack.
    Pack = 1,
    /// Repacked in memory at load.
    Repacked = 2,
}

impl WeightsSource {
    pub const ALL: [WeightsSource; 3] = [WeightsSource::Unpacked, WeightsSource::Pack, WeightsSource::Repacked];

    pub fn name(self) -> &'static str {
        match self {
            WeightsSource::Unpacked => "unpacked",
            WeightsSource::Pack => "pack",
            WeightsSource::Repacked => "repacked",
        }
    }
}

impl LoadProgress {
    /// Starts counting: `source`, the bytes to make ready, and how many matrices each layer
    /// ends at (cumulative, load order; the last entry: every matrix).
    pub fn start(&self, source: WeightsSource, total_bytes: u64, layer_ends: Vec<usize>) {
        self.source.store(source as u8, Ordering::Relaxed);
        self.total_bytes.store(total_bytes, Ordering::Relaxed);
        let _ = self.layer_ends.set(layer_ends);
    }

    /// Where the weights come from after all (a pack that was not current: repacked).
    pub fn set_source(&self, source: WeightsSource) {
        self.source.store(source as u8, Ordering::Relaxed);
    }

    /// One more matrix of `bytes` ready.
    pub fn ready(&self, bytes: u64) {
        self.ready_bytes.fetch_add(bytes, Ordering::Relaxed);
        self.ready_matrices.fetch_add(1, Ordering::Relaxed);
    }

    pub fn source(&self) -> WeightsSource {
        match self.source.load(Ordering::Relaxed) {
            1 => WeightsSource::Pack,
            2 => WeightsSource::Repacked,
            _ => WeightsSource::Unpacked,
        }
    }

    /// (ready, total) bytes.
    pub fn bytes(&self) -> (u64, u64) {
        (
            self.ready_bytes.load(Ordering::Relaxed),
            self.total_bytes.load(Ordering::Relaxed),
        )
    }

    /// (ready, total) layers (the output counts as one), counting matrices ready in load
    /// order: exact for a mapped pack's check, which goes in that order; a repack, parallel
    /// and unordered, is complete before the load returns.
    pub fn layers(&self) -> (usize, usize) {
        let ends = self.layer_ends.get().map_or(&[][..], Vec::as_slice);
        let n = self.ready_matrices.load(Ordering::Relaxed);
        (ends.iter().filter(|&&e| e <= n).count(), ends.len())
    }
}

/// The pack for a model file (for a Hugging Face directory, a file inside it) beside it.
pub fn path_for(model: &Path) -> PathBuf {
    path_for_version(model, PACK_FORMAT)
}

/// The pack for a model in a directory of packs: the model's file (or directory) name
/// with the pack suffix. Two models of the same file name share that name: the pack is tied
/// to one of them (size and modification time) and refused as stale for the other, which
/// then repacks in memory — name models distinctly in a shared store.
pub fn path_in(dir: &Path, model: &Path) -> PathBuf {
    let mut name = model.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".hearth-pack-v{PACK_FORMAT}"));
    dir.join(name)
}

fn path_for_version(model: &Path, version: u32) -> PathBuf {
    if model.is_dir() {
        return model.join(format!("hearth-pack-v{version}"));
    }
    let mut name = model.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".hearth-pack-v{version}"));
    model.with_file_name(name)
}

/// What ties a cache to its model: the file's size and modification time; for a directory,
/// the total size of its `*.safetensors` shards, the latest of their times, and a hash of
/// every shard's name, size and time (so that a shard replaced by another of the same size
/// but an older time, or two shards swapped, make the cache stale too).
pub(crate) fn source_id(model: &Path) -> Option<(u64, u64, u32, u32)> {
    let stamp = |m: &std::fs::Metadata| -> Option<(u64, std::time::Duration)> {
        Some((m.len(), m.modified().ok()?.duration_since(std::time::UNIX_EPOCH).ok()?))
    };
    if !model.is_dir() {
        let (len, t) = stamp(&std::fs::metadata(model).ok()?)?;
        return Some((len, t.as_secs(), t.subsec_nanos(), 0));
    }
    let mut shards = Vec::new();
    for e in std::fs::read_dir(model).ok()? {
        let p = e.ok()?.path();
        if p.extension().is_some_and(|x| x == "safetensors") {
            let (l, t) = stamp(&std::fs::metadata(&p).ok()?)?;
            shards.push((p.file_name()?.to_string_lossy().into_owned(), l, t));
        }
    }
    shards.sort();
    let mut h = Xxh3::new();
    for (name, l, t) in &shards {
        h.update(name.as_bytes());
        h.update(&[0]);
        h.update(&l.to_le_bytes());
        h.update(&t.as_nanos().to_le_bytes());
    }
    let len = shards.iter().map(|s| s.1).sum();
    let t = shards.iter().map(|s| s.2).max().unwrap_or_default();
    Some((len, t.as_secs(), t.subsec_nanos(), h.digest() as u32))
}

fn u32_at(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes(b[i..i + 4].try_into().unwrap_or_default())
}

fn u64_at(b: &[u8], i: usize) -> u64 {
    u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or_default())
}

/// Starts reading the file at `path` into the page cache in the background, in file order
/// (tensors are laid out layer by layer), 8 MiB at a time, so that a cold disk's reads
/// overlap the load and the first prefill instead of each weight page faulting in when
/// first touched. For loads only, not for reading a model's metadata. Advice only: nothing
/// waits for it, and a failure (or a file already cached) costs nothing.
pub fn read_ahead(path: &Path) {
    read_ahead_parts(vec![(path.to_path_buf(), 0..u64::MAX)]);
}

/// [`read_ahead`] for parts of files, `(file, byte range)` (clamped to the file's length),
/// read in the order given, each in file order.
pub fn read_ahead_parts(parts: Vec<(PathBuf, std::ops::Range<u64>)>) {
    use std::os::fd::AsRawFd;
    let _ = std::thread::Builder::new()
        .name("hearth-readahead".into())
        .spawn(move || {
            const CHUNK: u64 = 8 << 20;
            // The file of the last part (`None`: it could not be opened).
            let mut open: Option<(PathBuf, Option<(std::fs::File, u64)>)> = None;
            for (path, range) in parts {
                if open.as_ref().is_none_or(|(p, _)| *p != path) {
                    let f = std::fs::File::open(&path).ok().map(|f| {
                        let len = f.metadata().map_or(0, |m| m.len());
                        (f, len)
                    });
                    open = Some((path, f));
                }
                let Some((_, Some((f, len)))) = &open else { continue };
                let end = range.end.min(*len);
                let mut off = range.start;
                while off < end {
                    let n = CHUNK.min(end - off);
                    // SAFETY: posix_fadvise only advises the kernel about this open file's pages.
                    unsafe { libc::posix_fadvise(f.as_raw_fd(), off as i64, n as i64, libc::POSIX_FADV_WILLNEED) };
                    off += n;
                }
            }
        });
}

/// Checks a cache's first [`HEADER`] bytes (`head`) against this build's layout and `model` as it
/// is now; `Ok` holds the number of matrices its entry table lists, `Err` says why the cache
/// is not current (not a cache, another layout version, stale).
fn check_header(head: &[u8], model: &Path) -> Result<usize, String> {
    if head.len() < HEADER || &head[0..8] != MAGIC {
        return Err("not a pack cache".into());
    }
    if u32_at(head, 8) != PACK_FORMAT {
        return Err(format!(
            "layout version {} (this build uses {PACK_FORMAT})",
            u32_at(head, 8)
        ));
    }
    let (size, secs, nanos, shards) = source_id(model).ok_or("cannot stat the model file")?;
    if (u64_at(head, 16), u64_at(head, 24), u32_at(head, 32), u32_at(head, 36)) != (size, secs, nanos, shards) {
        return Err("stale: the model file changed".into());
    }
    Ok(u32_at(head, 12) as usize)
}

/// The model-file offsets of the matrices the first current pack for `model` holds (read
/// from its header and entry table; the matrices themselves are neither read nor checked),
/// or `None` when there is none.
pub fn cached_tensors(model: &Path, cache: &PackCache) -> Option<std::collections::HashSet<u64>> {
    use std::io::Read;
    cache.candidates(model).into_iter().find_map(|path| {
        let mut f = std::fs::File::open(path).ok()?;
        let mut head = [0u8; HEADER];
        f.read_exact(&mut head).ok()?;
        let n = check_header(&head, model).ok()?;
        let mut entries = vec![0u8; n.min(1 << 20) * ENTRY];
        f.read_exact(&mut entries).ok()?;
        Some(entries.chunks_exact(ENTRY).map(|e| u64_at(e, 24)).collect())
    })
}

/// The checks of a mapped cache's matrices, made by a background thread in file order and
/// waited for by each matrix's first use.
#[derive(Debug)]
pub(crate) struct Verifier {
    /// Per matrix: [`PENDING`], [`GOOD`] or [`BAD`].
    state: Vec<AtomicU8>,
    /// Told of each matrix checked.
    progress: Option<Arc<LoadProgress>>,
    lock: Mutex<()>,
    done: Condvar,
}

const PENDING: u8 = 0;
const GOOD: u8 = 1;
const BAD: u8 = 2;

impl Verifier {
    fn new(n: usize, progress: Option<Arc<LoadProgress>>) -> Self {
        Self {
            state: (0..n).map(|_| AtomicU8::new(PENDING)).collect(),
            progress,
            lock: Mutex::new(()),
            done: Condvar::new(),
        }
    }

    /// Waits for matrix `i`'s check; true if its bytes are the ones written.
    pub(crate) fn wait(&self, i: usize) -> bool {
        let s = self.state[i].load(Ordering::Acquire);
        if s != PENDING {
            return s == GOOD;
        }
        let mut g = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            match self.state[i].load(Ordering::Acquire) {
                PENDING => g = self.done.wait(g).unwrap_or_else(|e| e.into_inner()),
                s => return s == GOOD,
            }
        }
    }

    fn set(&self, i: usize, good: bool) {
        let _g = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        self.state[i].store(if good { GOOD } else { BAD }, Ordering::Release);
        self.done.notify_all();
    }

    /// Checks every matrix in order: `(offset, length, checksum)` of each in `map`. On the
    /// first mismatch the file at `path` is deleted (if it is still the mapped one, `mapped`:
    /// [`file_id`]), before that matrix is marked, so that whoever sees the mark finds the
    /// file gone. Matrices not checked when this returns (no one left to use them) or
    /// unwinds count as bad (a user repacks them), so nothing waits forever. Whether anyone
    /// is left is looked at between matrices, so after an unload the matrix being hashed is
    /// still read to its end.
    #[cfg(test)]
    fn run(self: &Arc<Self>, map: &memmap2::Mmap, entries: &[(usize, usize, u64)], path: &Path, mapped: FileId) {
        self.run_checks(map, entries, path, Some(mapped));
    }

    /// [`Self::run`]; `mapped: None` never deletes (a pack read, not written, by this
    /// worker: a read-only or shared store is left as it is, and the warning says to
    /// prepare the pack again).
    fn run_checks(
        self: &Arc<Self>,
        map: &memmap2::Mmap,
        entries: &[(usize, usize, u64)],
        path: &Path,
        mapped: Option<FileId>,
    ) {
        struct Unchecked<'a>(&'a Verifier);
        impl Drop for Unchecked<'_> {
            fn drop(&mut self) {
                for i in 0..self.0.state.len() {
                    if self.0.state[i].load(Ordering::Acquire) == PENDING {
                        self.0.set(i, false);
                    }
                }
            }
        }
        let _rest = Unchecked(self);
        let mut deleted = false;
        for (i, &(at, len, sum)) in entries.iter().enumerate() {
            // Every matrix (and so every user) is gone: nothing left to check for.
            if Arc::strong_count(self) == 1 {
                return;
            }
            let good = xxhash_rust::xxh3::xxh3_64(&map[at..at + len]) == sum;
            if !good && !deleted {
                deleted = true;
                match mapped {
                    Some(mapped) => {
                        tracing::warn!(path = %path.display(), matrix = i, "pack corrupt: the matrix is repacked, the pack deleted for the next load to rewrite");
                        if file_id(std::fs::metadata(path)) == mapped {
                            let _ = std::fs::remove_file(path);
                        }
                    }
                    None => tracing::warn!(
                        path = %path.display(),
                        matrix = i,
                        "pack corrupt: the matrix is repacked in memory (the pack is left as it is: prepare it again with `hearth model pack`)"
                    ),
                }
            }
            self.set(i, good);
            if let Some(p) = &self.progress {
                p.ready(len as u64);
            }
        }
    }
}

/// A file's identity (device, inode): tells the mapped cache from one another load renamed
/// into place since. `None` when it cannot be read, which matches no file.
type FileId = Option<(u64, u64)>;

/// The identity in a file's metadata: of an open file (`File::metadata`), or of the file a
/// path names now (`fs::metadata`; the look and a deletion after it are two steps: a fresh
/// cache renamed into place between them is deleted, and costs one rewrite at the next
/// load).
fn file_id(meta: std::io::Result<std::fs::Metadata>) -> FileId {
    use std::os::unix::fs::MetadataExt;
    meta.ok().map(|m| (m.dev(), m.ino()))
}

/// Maps the first current pack for `model` holding every matrix of `want` (a pack may hold
/// more: a worker serving part of a model maps only its part); `Err` says why none (missing,
/// stale, another shape). The mapped matrices' bytes are checked in the background (the
/// module's docs), in `want`'s order: each waits for its check at its first use.
pub fn load(
    model: &Path,
    cache: &PackCache,
    want: &[Wanted],
    progress: &Arc<LoadProgress>,
) -> Result<Vec<PackedMatrix>, String> {
    let mut why = Vec::new();
    for path in cache.candidates(model) {
        match load_from(&path, model, cache.mode, want, progress) {
            Ok(m) => return Ok(m),
            Err(e) => why.push(format!("{}: {e}", path.display())),
        }
    }
    Err(match why.is_empty() {
        true => "turned off".into(),
        false => why.join("; "),
    })
}

fn load_from(
    pack: &Path,
    model: &Path,
    mode: PackMode,
    want: &[Wanted],
    progress: &Arc<LoadProgress>,
) -> Result<Vec<PackedMatrix>, String> {
    let file = std::fs::File::open(pack).map_err(|e| format!("no pack ({e})"))?;
    // SAFETY: read-only map of a file Hearth writes under a unique temporary name and
    // renames into place complete, never modifying it after; a later writer replaces it by
    // rename, leaving this map intact. (A file truncated in place by someone else would
    // fault on access, as any mapped model file would: at the load, in the check thread
    // below, or in the forward pass.)
    let map = Arc::new(unsafe { memmap2::Mmap::map(&file) }.map_err(|e| e.to_string())?);
    let b: &[u8] = &map;
    if b.len() < HEADER {
        return Err("truncated: shorter than a header".into());
    }
    let n = check_header(&b[..HEADER], model)?;
    if b.len() < HEADER + n * ENTRY {
        return Err("truncated: the entry table is cut short".into());
    }
    // The pack's entries by the tensor they stand for.
    let mut entries = std::collections::HashMap::with_capacity(n);
    for i in 0..n {
        let e = HEADER + i * ENTRY;
        let (kind, rows, cols, toff) = (
            u32_at(b, e),
            u64_at(b, e + 8) as usize,
            u64_at(b, e + 16) as usize,
            u64_at(b, e + 24),
        );
        let (at, len, sum) = (
            u64_at(b, e + 32) as usize,
            u64_at(b, e + 40) as usize,
            u64_at(b, e + 48),
        );
        entries.insert(toff, (kind, rows, cols, at, len, sum));
    }
    let mut ranges = Vec::with_capacity(want.len());
    for w in want {
        let Some(&(kind, rows, cols, at, len, sum)) = entries.get(&w.tensor_offset) else {
            return Err(format!(
                "no matrix for the tensor at offset {:#x} (packed with other settings?)",
                w.tensor_offset
            ));
        };
        if (kind, rows, cols) != (w.kind.code() as u32, w.rows, w.cols)
            || len != PackedMatrix::size_for(w.kind, rows, cols)
        {
            return Err(format!(
                "the matrix for the tensor at offset {:#x} does not match the model",
                w.tensor_offset
            ));
        }
        if at.checked_add(len).is_none_or(|end| end > b.len()) {
            return Err(format!(
                "truncated: the matrix for offset {:#x} runs past the file's end",
                w.tensor_offset
            ));
        }
        ranges.push((at, len, sum));
    }
    let verifier = Arc::new(Verifier::new(want.len(), Some(progress.clone())));
    let matrices = want
        .iter()
        .zip(&ranges)
        .enumerate()
        .map(|(i, (w, &(at, _, _)))| {
            PackedMatrix::mapped(w.kind, w.rows, w.cols, map.clone(), at, (verifier.clone(), i))
                .ok_or_else(|| "misaligned entry".to_string())
        })
        .collect::<Result<Vec<_>, _>>()?;
    // Read ahead once the pack is known to be this model's (a stale one is not read), and
    // only the matrices mapped.
    read_ahead_parts(
        ranges
            .iter()
            .map(|&(at, len, _)| (pack.to_path_buf(), at as u64..(at + len) as u64))
            .collect(),
    );
    // Only a pack this worker writes is deleted when found corrupt.
    let mapped = (mode == PackMode::Write).then(|| file_id(file.metadata()));
    let spawned = {
        let (verifier, map, ranges, pack) = (verifier.clone(), map.clone(), ranges.clone(), pack.to_path_buf());
        std::thread::Builder::new()
            .name("hearth-pack-check".into())
            .spawn(move || verifier.run_checks(&map, &ranges, &pack, mapped))
    };
    // Where no thread can be started, the check runs now (the whole read before the load
    // returns), never skipped.
    if spawned.is_err() {
        verifier.run_checks(&map, &ranges, pack, mapped);
    }
    Ok(matrices)
}

/// Writes the pack for `model` at `cache`'s target (atomically: a temporary file renamed
/// into place; the directory is created if missing). Returns its path.
pub fn store(model: &Path, cache: &PackCache, matrices: &[(Wanted, &PackedMatrix)]) -> std::io::Result<PathBuf> {
    let cache = cache.target(model);
    if let Some(dir) = cache.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let (size, secs, nanos, shards) =
        source_id(model).ok_or_else(|| std::io::Error::other("cannot stat the model file"))?;
    let header = (HEADER + matrices.len() * ENTRY).div_ceil(ALIGN) * ALIGN;
    let mut at = header;
    let mut entries = Vec::new();
    for (w, p) in matrices {
        let len = p.bytes().len();
        entries.push((w, at, len, xxhash_rust::xxh3::xxh3_64(p.bytes())));
        at = (at + len).div_ceil(ALIGN) * ALIGN;
    }
    let mut head = Vec::with_capacity(header);
    head.extend_from_slice(MAGIC);
    head.extend_from_slice(&PACK_FORMAT.to_le_bytes());
    head.extend_from_slice(&(matrices.len() as u32).to_le_bytes());
    head.extend_from_slice(&size.to_le_bytes());
    head.extend_from_slice(&secs.to_le_bytes());
    head.extend_from_slice(&nanos.to_le_bytes());
    head.extend_from_slice(&shards.to_le_bytes());
    head.extend_from_slice(&0u64.to_le_bytes());
    for (w, at, len, sum) in &entries {
        head.extend_from_slice(&(w.kind.code() as u32).to_le_bytes());
        head.extend_from_slice(&0u32.to_le_bytes());
        for v in [
            w.rows as u64,
            w.cols as u64,
            w.tensor_offset,
            *at as u64,
            *len as u64,
            *sum,
        ] {
            head.extend_from_slice(&v.to_le_bytes());
        }
    }
    head.resize(header, 0);
    // A name no other writer (thread or process) uses; the rename makes it whole at once.
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = cache.with_extension(format!("tmp{}-{seq}", std::process::id()));
    let result = (|| {
        let file = std::fs::OpenOptions::new().write(true).create_new(true).open(&tmp)?;
        let mut f = std::io::BufWriter::with_capacity(1 << 20, file);
        f.write_all(&head)?;
        let mut pos = header;
        for ((_, p), (_, at, len, _)) in matrices.iter().zip(&entries) {
            f.write_all(&vec![0u8; at - pos])?;
            f.write_all(p.bytes())?;
            pos = at + len;
        }
        f.into_inner().map_err(|e| e.into_error())?.sync_all()?;
        std::fs::rename(&tmp, &cache)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    } else {
        // Caches of earlier layout versions are never read again: their space goes.
        for v in 1..PACK_FORMAT {
            let old = cache
                .to_string_lossy()
                .replace(&format!("hearth-pack-v{PACK_FORMAT}"), &format!("hearth-pack-v{v}"));
            let _ = std::fs::remove_file(old);
        }
    }
    result.map(|()| cache)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file of three 4 KiB "matrices" (bytes 1, 2, 3), mapped, and its path.
    fn three_matrices(name: &str) -> (PathBuf, FileId, memmap2::Mmap, Vec<(usize, usize, u64)>) {
        let path = std::env::temp_dir().join(format!("hearth-verifier-{name}-{}", std::process::id()));
        let bytes: Vec<u8> = (1..=3u8).flat_map(|b| vec![b; ALIGN]).collect();
        std::fs::write(&path, &bytes).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        // SAFETY: a file this test wrote and no one else touches.
        let map = unsafe { memmap2::Mmap::map(&file) }.unwrap();
        let entries = (0..3)
            .map(|i| {
                (
                    i * ALIGN,
                    ALIGN,
                    xxhash_rust::xxh3::xxh3_64(&bytes[i * ALIGN..(i + 1) * ALIGN]),
                )
            })
            .collect();
        (path, file_id(file.metadata()), map, entries)
    }

    #[test]
    fn a_mismatch_marks_its_matrix_bad_and_deletes_the_file_first() {
        let (path, file, map, mut entries) = three_matrices("bad");
        entries[1].2 ^= 1;
        let verifier = Arc::new(Verifier::new(3, None));
        let user = verifier.clone();
        let checker = {
            let path = path.clone();
            std::thread::spawn(move || verifier.run(&map, &entries, &path, file))
        };
        assert!(user.wait(0));
        assert!(!user.wait(1), "the changed matrix fails its check");
        // (Deleting after the mark would still pass here most of the time: the order is
        // the code's, this only catches a deletion that does not happen.)
        assert!(!path.exists(), "the file is gone once the bad mark is seen");
        assert!(user.wait(2), "the matrices after it are still checked");
        checker.join().unwrap();
    }

    #[test]
    fn a_reading_worker_leaves_a_corrupt_pack_in_place() {
        let (path, _, map, mut entries) = three_matrices("read");
        entries[1].2 ^= 1;
        let verifier = Arc::new(Verifier::new(3, None));
        let user = verifier.clone();
        verifier.run_checks(&map, &entries, &path, None);
        assert!(user.wait(0) && !user.wait(1) && user.wait(2));
        assert!(path.exists(), "a pack read, not written, by this worker stays as it is");
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn with_no_one_left_the_check_stops_and_nothing_waits_forever() {
        let (path, file, map, entries) = three_matrices("gone");
        let verifier = Arc::new(Verifier::new(3, None));
        // Only the checker holds the verifier: it returns at once, every matrix marked.
        verifier.run(&map, &entries, &path, file);
        assert!((0..3).all(|i| !verifier.wait(i)));
        assert!(path.exists(), "nothing was found bad: the file stays");
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn a_file_renamed_over_the_mapped_one_is_not_deleted() {
        let (path, file, map, mut entries) = three_matrices("replaced");
        entries[0].2 ^= 1;
        let fresh = path.with_extension("fresh");
        std::fs::write(&fresh, b"a cache another load wrote").unwrap();
        std::fs::rename(&fresh, &path).unwrap();
        let verifier = Arc::new(Verifier::new(3, None));
        let user = verifier.clone();
        verifier.run(&map, &entries, &path, file);
        assert!(!user.wait(0));
        assert!(path.exists(), "the path names another file now: it stays");
        std::fs::remove_file(&path).unwrap();
    }
}

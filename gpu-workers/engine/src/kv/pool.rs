//! The paged KV cache.
//!
//! * [`KvPool`] is the memory: a fixed number of blocks, each holding K and V of
//!   `block_tokens` positions for every layer (or, for latent attention, one latent vector
//!   per position and layer: [`KvShape::latent`]). A sequence's positions live in the blocks of
//!   its block table; nothing is reallocated per token.
//! * [`BlockManager`] decides who owns which block: reference counts, the prefix cache
//!   (full blocks named by their chained [`BlockHash`]), LRU eviction of cached blocks no
//!   sequence uses, and the `stored`/`removed` events the router consumes.
//!
//! Invariant (checked by `check`, property-tested): every block is in exactly one state —
//! free (no hash, unreferenced), cached-idle (hashed, unreferenced, in the LRU), or in use
//! (referenced; hashed or not) — and the hash map and the blocks' hashes agree.

use std::collections::{BTreeMap, HashMap};

use hearth_protocol::BlockHash;

use crate::kv::block::{KvDtypeName, Spill};

/// How K and V are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvDtype {
    /// IEEE half precision: half the memory of f32, converted with F16C when read.
    #[default]
    F16,
    F32,
}

impl KvDtype {
    pub fn bytes(self) -> usize {
        match self {
            KvDtype::F16 => 2,
            KvDtype::F32 => 4,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F16 => "f16",
            KvDtype::F32 => "f32",
        }
    }

    pub fn parse(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "f16" | "fp16" | "half" => Ok(KvDtype::F16),
            "f32" | "fp32" | "float" => Ok(KvDtype::F32),
            other => Err(format!("unknown KV cache type {other:?} (f16 or f32)")),
        }
    }
}

/// How the dtype travels in a [`KvLayout`](crate::kv::block::KvLayout).
impl From<KvDtype> for KvDtypeName {
    fn from(d: KvDtype) -> Self {
        match d {
            KvDtype::F16 => Self::F16,
            KvDtype::F32 => Self::F32,
        }
    }
}

/// The shape of what a pool stores per block and layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvShape {
    pub n_layers: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub block_tokens: usize,
    /// Latent attention's layout ([`crate::models::mla`]): one "key" per position — the
    /// latent vector then the RoPE key — and no values (attention reads each position's
    /// value from its key's latent part).
    pub latent: bool,
}

impl KvShape {
    pub fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Sections per block and layer: K and V, or the latent alone.
    fn sections(&self) -> usize {
        if self.latent {
            1
        } else {
            2
        }
    }

    /// Elements of one block (K and V, or the latent, of every layer).
    fn block_elems(&self) -> usize {
        self.n_layers * self.sections() * self.block_tokens * self.kv_dim()
    }
}

enum Store {
    F16(Vec<u16>),
    F32(Vec<f32>),
}

/// One block-and-layer's keys or values, as stored.
#[derive(Debug, Clone, Copy)]
pub enum KvSlice<'a> {
    F16(&'a [u16]),
    F32(&'a [f32]),
}

impl KvSlice<'_> {
    #[inline]
    pub fn get(&self, i: usize) -> f32 {
        match self {
            KvSlice::F16(s) => half::f16::from_bits(s[i]).to_f32(),
            KvSlice::F32(s) => s[i],
        }
    }

    pub fn len(&self) -> usize {
        match self {
            KvSlice::F16(s) => s.len(),
            KvSlice::F32(s) => s.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// K/V storage for `num_blocks` blocks.
///
/// Per block and layer, keys are stored transposed per head — `[kv_head][head_dim][slot]` —
/// so that attention scores a query against all of a block's positions with contiguous
/// vector loads; values are stored by position — `[slot][kv_dim]` — so that the weighted
/// sum reads whole rows.
pub struct KvPool {
    shape: KvShape,
    num_blocks: usize,
    store: Store,
}

impl std::fmt::Debug for KvPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvPool")
            .field("blocks", &self.num_blocks)
            .field("block_tokens", &self.shape.block_tokens)
            .field("dtype", &self.dtype())
            .finish()
    }
}

impl KvPool {
    /// Bytes one block takes for a model shape.
    pub fn block_bytes(shape: KvShape, dtype: KvDtype) -> usize {
        shape.block_elems() * dtype.bytes()
    }

    /// Pages are touched only when first written, so an unused pool costs address space,
    /// not memory.
    pub fn new(shape: KvShape, dtype: KvDtype, num_blocks: usize) -> Self {
        let n = num_blocks * shape.block_elems();
        let store = match dtype {
            KvDtype::F16 => Store::F16(huge_pages(vec![0u16; n])),
            KvDtype::F32 => Store::F32(huge_pages(vec![0f32; n])),
        };
        Self {
            shape,
            num_blocks,
            store,
        }
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    pub fn block_tokens(&self) -> usize {
        self.shape.block_tokens
    }

    pub fn shape(&self) -> KvShape {
        self.shape
    }

    pub fn dtype(&self) -> KvDtype {
        match self.store {
            Store::F16(_) => KvDtype::F16,
            Store::F32(_) => KvDtype::F32,
        }
    }

    #[inline]
    fn base(&self, block: u32, layer: usize, kind: usize) -> usize {
        let s = &self.shape;
        ((block as usize * s.n_layers + layer) * s.sections() + kind) * s.block_tokens * s.kv_dim()
    }

    /// Writes one position's K and V (`kv_dim` floats each) for one layer (a latent
    /// pool's: the latent as K, and no V).
    pub fn write(&mut self, block: u32, slot: usize, layer: usize, k: &[f32], v: &[f32]) {
        self.write_keys(self.base(block, layer, 0), slot, k);
        if self.shape.latent {
            return;
        }
        let vb = self.base(block, layer, 1);
        let d = self.shape.kv_dim();
        match &mut self.store {
            Store::F16(data) => {
                for (o, x) in data[vb + slot * d..vb + (slot + 1) * d].iter_mut().zip(v) {
                    *o = half::f16::from_f32(*x).to_bits();
                }
            }
            Store::F32(data) => data[vb + slot * d..vb + (slot + 1) * d].copy_from_slice(&v[..d]),
        }
    }

    /// One position's keys, transposed per head: element (head h, dim i) of this slot
    /// lives at `h·hd·bt + i·bt + slot`.
    fn write_keys(&mut self, kb: usize, slot: usize, k: &[f32]) {
        let (d, bt, hd) = (self.shape.kv_dim(), self.shape.block_tokens, self.shape.head_dim);
        let kpos = |j: usize| kb + (j / hd) * hd * bt + (j % hd) * bt + slot;
        match &mut self.store {
            Store::F16(data) => {
                for (j, x) in k.iter().enumerate().take(d) {
                    data[kpos(j)] = half::f16::from_f32(*x).to_bits();
                }
            }
            Store::F32(data) => {
                for (j, x) in k.iter().enumerate().take(d) {
                    data[kpos(j)] = *x;
                }
            }
        }
    }

    fn section(&self, at: usize) -> KvSlice<'_> {
        let n = self.shape.block_tokens * self.shape.kv_dim();
        match &self.store {
            Store::F16(d) => KvSlice::F16(&d[at..at + n]),
            Store::F32(d) => KvSlice::F32(&d[at..at + n]),
        }
    }

    /// Keys of one block and layer: `[kv_head][head_dim][slot]`.
    #[inline]
    pub fn keys(&self, block: u32, layer: usize) -> KvSlice<'_> {
        self.section(self.base(block, layer, 0))
    }

    /// Values of one block and layer: `[slot][kv_dim]`. A latent pool has none (its values
    /// are its keys' leading dims: read [`KvPool::keys`]).
    #[inline]
    pub fn values(&self, block: u32, layer: usize) -> KvSlice<'_> {
        assert!(!self.shape.latent, "a latent pool has no value section");
        self.section(self.base(block, layer, 1))
    }

    /// Key `j` (of `kv_dim`) at `slot`, as f32 (for tests and tools).
    pub fn key(&self, block: u32, layer: usize, slot: usize, j: usize) -> f32 {
        let (bt, hd) = (self.shape.block_tokens, self.shape.head_dim);
        self.keys(block, layer).get((j / hd) * hd * bt + (j % hd) * bt + slot)
    }

    /// A whole block's bytes (every layer's keys and values, little-endian, in the pool's
    /// element type): what moves between workers.
    pub fn read_block(&self, block: u32) -> Vec<u8> {
        let len = self.shape.block_elems();
        let at = self.base(block, 0, 0);
        match &self.store {
            Store::F16(d) => as_bytes(&d[at..at + len]).to_vec(),
            Store::F32(d) => as_bytes(&d[at..at + len]).to_vec(),
        }
    }

    /// Overwrites a whole block with bytes from [`KvPool::read_block`] of a pool of the same
    /// shape and element type, given as consecutive pieces (as they arrived from a peer: each
    /// is copied once, straight into the block); false (nothing written) if the total length
    /// differs.
    pub fn write_block<P: AsRef<[u8]>>(&mut self, block: u32, parts: &[P]) -> bool {
        let len = self.shape.block_elems();
        let at = self.base(block, 0, 0);
        let dst = match &mut self.store {
            Store::F16(d) => as_bytes_mut(&mut d[at..at + len]),
            Store::F32(d) => as_bytes_mut(&mut d[at..at + len]),
        };
        if parts.iter().map(|p| p.as_ref().len()).sum::<usize>() != dst.len() {
            return false;
        }
        let mut rest = dst;
        for p in parts {
            let (head, tail) = rest.split_at_mut(p.as_ref().len());
            head.copy_from_slice(p.as_ref());
            rest = tail;
        }
        true
    }

    /// Copies a whole block (copy-on-write when sequences fork).
    pub fn copy_block(&mut self, from: u32, to: u32) {
        let len = self.shape.block_elems();
        let (f, t) = (self.base(from, 0, 0), self.base(to, 0, 0));
        match &mut self.store {
            Store::F16(d) => d.copy_within(f..f + len, t),
            Store::F32(d) => d.copy_within(f..f + len, t),
        }
    }
}

/// Asks for transparent huge pages on a pool's memory (Linux; where they are off, or on
/// other systems, nothing changes): a page is still touched only when first written, but a
/// first write then faults once per 2 MiB instead of once per 4 KiB. A fresh pool taking a
/// peer's blocks is bound by those faults (measured here: 46.8 MB written into an untouched
/// pool in 23–61 ms with 4 KiB pages, 10–14 ms with huge pages; 5–9 ms once touched), and
/// attention's reads over a large cache miss the TLB less.
fn huge_pages<T: Plain>(v: Vec<T>) -> Vec<T> {
    #[cfg(target_os = "linux")]
    {
        const PAGE: usize = 4096;
        let start = v.as_ptr() as usize;
        let end = start + std::mem::size_of_val(&v[..]);
        let (from, to) = (start.next_multiple_of(PAGE), end & !(PAGE - 1));
        if to > from {
            // SAFETY: the range lies inside `v`'s allocation; MADV_HUGEPAGE changes how the
            // kernel backs it, never its contents.
            let rc = unsafe { libc::madvise(from as *mut libc::c_void, to - from, libc::MADV_HUGEPAGE) };
            if rc != 0 {
                tracing::debug!(error = %std::io::Error::last_os_error(), "no transparent huge pages for the KV pool");
            }
        }
    }
    v
}

/// Element types whose bytes may be viewed directly.
///
/// # Safety
/// Implementors have no padding and every bit pattern is a valid value.
pub(crate) unsafe trait Plain: Copy {}
// SAFETY: u16 and f32 have no padding; every bit pattern is a u16 or an f32 (NaNs included).
unsafe impl Plain for u16 {}
// SAFETY: as above.
unsafe impl Plain for f32 {}

// The transfer format is little-endian; so is every target Hearth builds for.
#[cfg(not(target_endian = "little"))]
compile_error!("the KV transfer format assumes a little-endian target");

pub(crate) fn as_bytes<T: Plain>(v: &[T]) -> &[u8] {
    // SAFETY: `T` is u16 or f32 (no padding, no invalid bit patterns); the view covers
    // exactly the slice's memory and borrows it.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

pub(crate) fn as_bytes_mut<T: Plain>(v: &mut [T]) -> &mut [u8] {
    // SAFETY: as `as_bytes`; any bytes written form valid u16/f32 values.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

/// Events for subscribers, drained by the engine after each step.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct BlockEvents {
    pub stored: Vec<BlockHash>,
    pub removed: Vec<BlockHash>,
}

/// Memory available now (MiB, `/proc/meminfo`'s `MemAvailable`).
pub fn available_memory_mib() -> Option<usize> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024)
}

/// A KV cache's MiB when none is configured: a quarter of available memory, at most 1 GiB.
pub fn default_kv_cache_mib() -> usize {
    available_memory_mib().map_or(512, |m| (m / 4).min(1024))
}

/// Ownership of KV blocks and the prefix cache.
#[derive(Debug)]
pub struct BlockManager {
    refcount: Vec<u32>,
    hash: Vec<Option<BlockHash>>,
    free: Vec<u32>,
    cached: HashMap<BlockHash, u32>,
    /// Cached blocks nobody references, by the time they were released (oldest first).
    lru: BTreeMap<u64, u32>,
    lru_key: Vec<u64>,
    tick: u64,
    events: BlockEvents,
    /// What each cached block needs to go to the tier below when evicted (blocks without
    /// it — imported from a peer, or with no tier — are only dropped).
    spill: Vec<Option<Spill>>,
    /// Evicted blocks still holding their bytes, to copy to the tier below before they are
    /// written (see [`BlockManager::take_evicted`]). Only filled with `spilling` on.
    evicted: Vec<(u32, BlockHash, Spill)>,
    pub spilling: bool,
    /// Prefix-cache lookups and hits, in blocks.
    pub queries: u64,
    pub hits: u64,
}

impl BlockManager {
    pub fn new(num_blocks: usize) -> Self {
        Self {
            refcount: vec![0; num_blocks],
            hash: vec![None; num_blocks],
            free: (0..num_blocks as u32).rev().collect(),
            cached: HashMap::new(),
            lru: BTreeMap::new(),
            lru_key: vec![0; num_blocks],
            tick: 0,
            events: BlockEvents::default(),
            spill: vec![None; num_blocks],
            evicted: Vec::new(),
            spilling: false,
            queries: 0,
            hits: 0,
        }
    }

    pub fn total(&self) -> usize {
        self.refcount.len()
    }

    /// Blocks that `allocate` can hand out (free, or cached and evictable).
    pub fn available(&self) -> usize {
        self.free.len() + self.lru.len()
    }

    /// A block for exclusive use: a free one, else the least recently released cached one
    /// (evicting its hash).
    pub fn allocate(&mut self) -> Option<u32> {
        let b = match self.free.pop() {
            Some(b) => b,
            None => {
                let (&key, &b) = self.lru.iter().next()?;
                self.lru.remove(&key);
                if let Some(h) = self.hash[b as usize].take() {
                    self.cached.remove(&h);
                    self.events.removed.push(h);
                    if let Some(s) = self.spill[b as usize].take() {
                        if self.spilling {
                            self.evicted.push((b, h, s));
                        }
                    }
                }
                b
            }
        };
        self.refcount[b as usize] = 1;
        Some(b)
    }

    /// Takes a reference to the cached block with this hash, if any.
    pub fn lookup(&mut self, h: BlockHash) -> Option<u32> {
        self.queries += 1;
        let b = *self.cached.get(&h)?;
        self.hits += 1;
        // A reused block is offered to the tier below now, not only when evicted: the
        // blocks every request shares (a system prompt's) may never be evicted, and a
        // restarted engine needs them to reach the rest of a chain on disk. (The engine
        // copies it only if the tier lacks it or holds an aging copy.)
        if self.spilling {
            if let Some(s) = &self.spill[b as usize] {
                self.evicted.push((b, h, s.clone()));
            }
        }
        if self.refcount[b as usize] == 0 {
            self.lru.remove(&self.lru_key[b as usize]);
        }
        self.refcount[b as usize] += 1;
        Some(b)
    }

    /// Whether a hash is cached (no reference taken).
    pub fn contains(&self, h: BlockHash) -> bool {
        self.cached.contains_key(&h)
    }

    /// The cached block with this hash, if any (no reference taken).
    pub fn peek(&self, h: BlockHash) -> Option<u32> {
        self.cached.get(&h).copied()
    }

    /// One more reference to a block in use (sequences forking).
    pub fn share(&mut self, b: u32) {
        debug_assert!(self.refcount[b as usize] > 0);
        self.refcount[b as usize] += 1;
    }

    /// Drops a reference. An unreferenced cached block stays reusable until evicted.
    pub fn release(&mut self, b: u32) {
        let rc = &mut self.refcount[b as usize];
        debug_assert!(*rc > 0, "double release of block {b}");
        if *rc == 0 {
            return;
        }
        *rc -= 1;
        if *rc == 0 {
            if self.hash[b as usize].is_some() {
                self.tick += 1;
                self.lru_key[b as usize] = self.tick;
                self.lru.insert(self.tick, b);
            } else {
                self.free.push(b);
            }
        }
    }

    /// Names a full, computed block in use by its hash so later requests can reuse it.
    /// If another block already holds that hash, this one stays private.
    pub fn register(&mut self, b: u32, h: BlockHash) {
        self.register_spillable(b, h, None);
    }

    /// [`BlockManager::register`], with what the block needs to go to the tier below.
    pub fn register_spillable(&mut self, b: u32, h: BlockHash, spill: Option<Spill>) {
        if self.hash[b as usize].is_some() || self.cached.contains_key(&h) {
            return;
        }
        self.hash[b as usize] = Some(h);
        self.spill[b as usize] = spill;
        self.cached.insert(h, b);
        self.events.stored.push(h);
    }

    /// Forgets every unreferenced cached block (its KV is gone: a pipeline stage was
    /// lost), announcing each as removed; the blocks become free.
    pub fn forget_cached(&mut self) {
        for (_, b) in std::mem::take(&mut self.lru) {
            if let Some(h) = self.hash[b as usize].take() {
                self.cached.remove(&h);
                self.events.removed.push(h);
            }
            self.spill[b as usize] = None;
            self.free.push(b);
        }
        self.evicted.clear();
    }

    /// Blocks to copy to the tier below: evicted since the last call (their bytes still
    /// intact: the caller copies them out before anything writes the blocks again — the
    /// next forward step, an import, a fork's copy), and reused for the first time.
    pub fn take_evicted(&mut self) -> Vec<(u32, BlockHash, Spill)> {
        std::mem::take(&mut self.evicted)
    }

    pub fn take_events(&mut self) -> BlockEvents {
        std::mem::take(&mut self.events)
    }

    pub fn cached_hashes(&self) -> Vec<BlockHash> {
        let mut v: Vec<BlockHash> = self.cached.keys().copied().collect();
        v.sort();
        v
    }

    pub fn refcount(&self, b: u32) -> u32 {
        self.refcount[b as usize]
    }

    /// Verifies the ownership invariant; `owned` lists every reference held by sequences.
    pub fn check(&self, owned: &[u32]) -> Result<(), String> {
        let n = self.total();
        let mut refs = vec![0u32; n];
        for &b in owned {
            refs[b as usize] += 1;
        }
        let mut in_free = vec![false; n];
        for &b in &self.free {
            if std::mem::replace(&mut in_free[b as usize], true) {
                return Err(format!("block {b} twice in the free list"));
            }
        }
        let in_lru: std::collections::HashSet<u32> = self.lru.values().copied().collect();
        if in_lru.len() != self.lru.len() {
            return Err("a block is twice in the LRU".into());
        }
        for b in 0..n {
            let rc = self.refcount[b];
            if rc != refs[b] {
                return Err(format!("block {b}: refcount {rc} but {} owners", refs[b]));
            }
            let states = [in_free[b], in_lru.contains(&(b as u32)), rc > 0]
                .iter()
                .filter(|x| **x)
                .count();
            if states != 1 {
                return Err(format!("block {b} is in {states} states (free/lru/used)"));
            }
            if in_free[b] && self.hash[b].is_some() {
                return Err(format!("free block {b} still has a hash"));
            }
            if in_lru.contains(&(b as u32)) && self.hash[b].is_none() {
                return Err(format!("LRU block {b} has no hash"));
            }
            if let Some(h) = self.hash[b] {
                if self.cached.get(&h) != Some(&(b as u32)) {
                    return Err(format!("block {b}'s hash is not mapped to it"));
                }
            }
        }
        if self.cached.values().any(|&b| self.hash[b as usize].is_none()) {
            return Err("the cache maps a hash to an unhashed block".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cached_blocks_are_reused_then_evicted_lru() {
        let mut m = BlockManager::new(3);
        let a = m.allocate().unwrap();
        let b = m.allocate().unwrap();
        m.register(a, BlockHash(1));
        m.register(b, BlockHash(2));
        m.release(a);
        m.release(b);
        assert_eq!(m.available(), 3);
        // A hit takes the block out of the LRU.
        assert_eq!(m.lookup(BlockHash(2)), Some(b));
        let c = m.allocate().unwrap(); // the free one
        assert_ne!(c, a);
        let d = m.allocate().unwrap(); // evicts hash 1 (oldest idle)
        assert_eq!(d, a);
        assert_eq!(
            m.take_events(),
            BlockEvents {
                stored: vec![BlockHash(1), BlockHash(2)],
                removed: vec![BlockHash(1)]
            }
        );
        assert_eq!(m.lookup(BlockHash(1)), None);
        assert!(m.allocate().is_none());
        m.check(&[b, c, d]).unwrap();
    }

    #[test]
    fn pool_reads_what_it_wrote() {
        for dtype in [KvDtype::F16, KvDtype::F32] {
            let shape = KvShape {
                n_layers: 2,
                kv_heads: 2,
                head_dim: 2,
                block_tokens: 2,
                latent: false,
            };
            let mut p = KvPool::new(shape, dtype, 3);
            p.write(1, 1, 1, &[1.0, 2.0, 3.0, 4.0], &[5.0, 6.0, 7.0, 8.5]);
            let keys: Vec<f32> = (0..4).map(|j| p.key(1, 1, 1, j)).collect();
            assert_eq!(keys, [1.0, 2.0, 3.0, 4.0], "{dtype:?}");
            // Transposed per head: [head][dim][slot].
            assert_eq!(p.keys(1, 1).get(2 * 2 + 1), 3.0);
            let vals: Vec<f32> = (4..8).map(|i| p.values(1, 1).get(i)).collect();
            assert_eq!(vals, [5.0, 6.0, 7.0, 8.5]);
            assert!((0..8).all(|i| p.keys(1, 0).get(i) == 0.0));
            p.copy_block(1, 2);
            assert_eq!(p.values(2, 1).get(7), 8.5);
            assert_eq!(p.key(2, 1, 1, 3), 4.0);
            // A block written from pieces (as it arrives from a peer) reads back whole; a
            // wrong total length writes nothing.
            let bytes = p.read_block(1);
            let (a, rest) = bytes.split_at(3);
            let (b, c) = rest.split_at(rest.len() / 2);
            assert!(p.write_block(0, &[a, &[][..], b, c]));
            assert_eq!(p.read_block(0), bytes);
            assert!(!p.write_block(2, &[a, b]));
            assert!(!p.write_block(2, &[&bytes[..], &[0u8][..]]));
            assert_eq!(p.values(2, 1).get(7), 8.5, "untouched by a refused write");
        }
    }
}

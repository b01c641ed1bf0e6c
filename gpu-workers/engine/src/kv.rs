//! The paged KV cache.
//!
//! * [`KvPool`] is the memory: a fixed number of blocks, each holding K and V of
//!   `block_tokens` positions for every layer. A sequence's positions live in the blocks of
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

/// K/V storage for `num_blocks` blocks.
pub struct KvPool {
    n_layers: usize,
    kv_dim: usize,
    block_tokens: usize,
    num_blocks: usize,
    data: Vec<f32>,
}

impl std::fmt::Debug for KvPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvPool")
            .field("blocks", &self.num_blocks)
            .field("block_tokens", &self.block_tokens)
            .finish()
    }
}

impl KvPool {
    /// Bytes one block takes for a model shape.
    pub fn block_bytes(n_layers: usize, kv_dim: usize, block_tokens: usize) -> usize {
        n_layers * 2 * block_tokens * kv_dim * std::mem::size_of::<f32>()
    }

    /// Pages are touched only when first written, so an unused pool costs address space,
    /// not memory.
    pub fn new(n_layers: usize, kv_dim: usize, block_tokens: usize, num_blocks: usize) -> Self {
        let n = num_blocks * n_layers * 2 * block_tokens * kv_dim;
        Self {
            n_layers,
            kv_dim,
            block_tokens,
            num_blocks,
            data: vec![0f32; n],
        }
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    pub fn block_tokens(&self) -> usize {
        self.block_tokens
    }

    #[inline]
    fn base(&self, block: u32, layer: usize, kind: usize) -> usize {
        ((block as usize * self.n_layers + layer) * 2 + kind) * self.block_tokens * self.kv_dim
    }

    /// Writes one position's K and V for one layer.
    pub fn write(&mut self, block: u32, slot: usize, layer: usize, k: &[f32], v: &[f32]) {
        let d = self.kv_dim;
        let kb = self.base(block, layer, 0) + slot * d;
        self.data[kb..kb + d].copy_from_slice(k);
        let vb = self.base(block, layer, 1) + slot * d;
        self.data[vb..vb + d].copy_from_slice(v);
    }

    /// K rows (`block_tokens × kv_dim`) of one block and layer.
    #[inline]
    pub fn keys(&self, block: u32, layer: usize) -> &[f32] {
        let b = self.base(block, layer, 0);
        &self.data[b..b + self.block_tokens * self.kv_dim]
    }

    #[inline]
    pub fn values(&self, block: u32, layer: usize) -> &[f32] {
        let b = self.base(block, layer, 1);
        &self.data[b..b + self.block_tokens * self.kv_dim]
    }

    /// Copies a whole block (copy-on-write when sequences fork).
    pub fn copy_block(&mut self, from: u32, to: u32) {
        let len = self.n_layers * 2 * self.block_tokens * self.kv_dim;
        let (f, t) = (self.base(from, 0, 0), self.base(to, 0, 0));
        self.data.copy_within(f..f + len, t);
    }
}

/// Events for subscribers, drained by the engine after each step.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct BlockEvents {
    pub stored: Vec<BlockHash>,
    pub removed: Vec<BlockHash>,
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
        if self.hash[b as usize].is_some() || self.cached.contains_key(&h) {
            return;
        }
        self.hash[b as usize] = Some(h);
        self.cached.insert(h, b);
        self.events.stored.push(h);
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
        let mut p = KvPool::new(2, 4, 2, 3);
        p.write(1, 1, 1, &[1.0, 2.0, 3.0, 4.0], &[5.0, 6.0, 7.0, 8.0]);
        assert_eq!(&p.keys(1, 1)[4..8], &[1.0, 2.0, 3.0, 4.0]);
        assert_eq!(&p.values(1, 1)[4..8], &[5.0, 6.0, 7.0, 8.0]);
        assert!(p.keys(1, 0).iter().all(|&x| x == 0.0));
        p.copy_block(1, 2);
        assert_eq!(&p.values(2, 1)[4..8], &[5.0, 6.0, 7.0, 8.0]);
    }
}

//! Which worker holds which KV block: the router's view of every engine's prefix cache.
//!
//! Exact when fed by the engines' KV events (`stored` / `removed` / `snapshot`); when a
//! worker publishes no events, the router records its own decisions instead, and those
//! entries expire after a TTL (approximate mode). Workers are slots `0..64` (a bit each).
//!
//! Tiers: a block a worker's pool evicted to its disk tier is still that worker's, at a
//! cost (it is read back before use). The index keeps one bit set for the pool and one for
//! the disk, and [`PrefixIndex::matches_tiers`] counts both.

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};

use hearth_protocol::{BlockHash, Tier};

/// Workers per index (one bit each).
pub const MAX_WORKERS: usize = 64;

/// Block hashes are already uniformly distributed: hash them by identity.
#[derive(Default, Clone, Copy)]
pub struct IdentityHasher(u64);

impl Hasher for IdentityHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

type Fast = BuildHasherDefault<IdentityHasher>;

#[derive(Debug, Clone, Copy, Default)]
struct Entry {
    /// Workers known (from events) to hold the block.
    exact: u64,
    /// Workers the router sent this block to, without confirmation; valid until `expires`.
    approx: u64,
    expires: u64,
    /// Workers whose disk tier holds the block.
    disk: u64,
}

impl Entry {
    fn unused(&self) -> bool {
        self.exact == 0 && self.approx == 0 && self.disk == 0
    }
}

/// The prefix index.
#[derive(Debug, Default)]
pub struct PrefixIndex {
    blocks: HashMap<BlockHash, Entry, Fast>,
    per_worker: Vec<HashSet<BlockHash, Fast>>,
    per_worker_disk: Vec<HashSet<BlockHash, Fast>>,
    /// Entries with a disk bit (when none, matching skips the second pass).
    disk_entries: usize,
}

impl PrefixIndex {
    pub fn new() -> Self {
        Self {
            blocks: HashMap::default(),
            per_worker: (0..MAX_WORKERS).map(|_| HashSet::default()).collect(),
            per_worker_disk: (0..MAX_WORKERS).map(|_| HashSet::default()).collect(),
            disk_entries: 0,
        }
    }

    /// Distinct blocks indexed.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Blocks a worker holds (exactly known).
    pub fn worker_blocks(&self, w: usize) -> usize {
        self.per_worker.get(w).map_or(0, HashSet::len)
    }

    /// Blocks a worker holds in its disk tier.
    pub fn worker_disk_blocks(&self, w: usize) -> usize {
        self.per_worker_disk.get(w).map_or(0, HashSet::len)
    }

    pub fn stored(&mut self, w: usize, hashes: &[BlockHash]) {
        self.stored_in(w, hashes, Tier::Device);
    }

    pub fn removed(&mut self, w: usize, hashes: &[BlockHash]) {
        self.removed_from(w, hashes, Tier::Device);
    }

    /// A worker now holds these blocks in `tier` (host memory counts with the disk: both
    /// are read back into the pool before use).
    pub fn stored_in(&mut self, w: usize, hashes: &[BlockHash], tier: Tier) {
        let bit = 1u64 << w;
        for &h in hashes {
            let e = self.blocks.entry(h).or_default();
            if tier.is_device() {
                e.exact |= bit;
                self.per_worker[w].insert(h);
            } else {
                if e.disk == 0 {
                    self.disk_entries += 1;
                }
                e.disk |= bit;
                self.per_worker_disk[w].insert(h);
            }
        }
    }

    pub fn removed_from(&mut self, w: usize, hashes: &[BlockHash], tier: Tier) {
        let bit = 1u64 << w;
        for h in hashes {
            if let Some(e) = self.blocks.get_mut(h) {
                if tier.is_device() {
                    e.exact &= !bit;
                } else if e.disk & bit != 0 {
                    e.disk &= !bit;
                    if e.disk == 0 {
                        self.disk_entries -= 1;
                    }
                }
                if e.unused() {
                    self.blocks.remove(h);
                }
            }
            if tier.is_device() {
                self.per_worker[w].remove(h);
            } else {
                self.per_worker_disk[w].remove(h);
            }
        }
    }

    /// Replaces everything known about a worker (its snapshot, or its departure with `&[]`).
    pub fn reset_worker(&mut self, w: usize, hashes: &[BlockHash]) {
        self.reset_worker_tiers(w, hashes, &[]);
    }

    /// As [`PrefixIndex::reset_worker`], with what its disk tier holds.
    pub fn reset_worker_tiers(&mut self, w: usize, device: &[BlockHash], disk: &[BlockHash]) {
        let old: Vec<BlockHash> = std::mem::take(&mut self.per_worker[w]).into_iter().collect();
        let old_disk: Vec<BlockHash> = self.per_worker_disk[w].iter().copied().collect();
        self.removed_from(w, &old_disk, Tier::Disk);
        let bit = 1u64 << w;
        for h in &old {
            if let Some(e) = self.blocks.get_mut(h) {
                e.exact &= !bit;
                if e.unused() {
                    self.blocks.remove(h);
                }
            }
        }
        for e in self.blocks.values_mut() {
            e.approx &= !bit;
        }
        self.stored(w, device);
        self.stored_in(w, disk, Tier::Disk);
    }

    /// Approximate mode: the router sent these blocks to `w` at `now` (any monotonic unit);
    /// they count as cached there until `now + ttl`.
    pub fn assume(&mut self, w: usize, hashes: &[BlockHash], now: u64, ttl: u64) {
        let bit = 1u64 << w;
        for &h in hashes {
            let e = self.blocks.entry(h).or_default();
            if e.expires < now {
                e.approx = 0;
            }
            e.approx |= bit;
            e.expires = now + ttl;
        }
    }

    fn holders(&self, h: &BlockHash, now: u64, disk: bool) -> u64 {
        match self.blocks.get(h) {
            Some(e) => e.exact | if e.expires >= now { e.approx } else { 0 } | if disk { e.disk } else { 0 },
            None => 0,
        }
    }

    /// [`PrefixIndex::matches`] in the pool, and in the pool or the disk tier together
    /// (what a worker can serve without recomputing: its pool's prefix, then blocks read
    /// back from disk).
    pub fn matches_tiers(
        &self,
        hashes: &[BlockHash],
        candidates: u64,
        now: u64,
    ) -> ([u32; MAX_WORKERS], [u32; MAX_WORKERS]) {
        let device = self.matches(hashes, candidates, now);
        if self.disk_entries == 0 {
            return (device, device);
        }
        (device, self.matches_with(hashes, candidates, now, true))
    }

    /// For each worker in `candidates`, how many leading blocks of `hashes` it holds.
    ///
    /// Engines evict a prefix's blocks tail first, so what a worker holds of a chain is a
    /// prefix of it; the lengths are then found by bisection in O(distinct lengths × log n)
    /// lookups instead of one lookup per block. (A worker with a gap in a chain would be
    /// credited past the gap: only a slightly worse choice, never a wrong answer — the
    /// engine reports the tokens it really reused.)
    pub fn matches(&self, hashes: &[BlockHash], candidates: u64, now: u64) -> [u32; MAX_WORKERS] {
        self.matches_with(hashes, candidates, now, false)
    }

    fn matches_with(&self, hashes: &[BlockHash], candidates: u64, now: u64, disk: bool) -> [u32; MAX_WORKERS] {
        let mut matched = [0u32; MAX_WORKERS];
        // Workers in `active` hold at least `lo` blocks; find their lengths within [lo, hi].
        let mut stack = vec![(0usize, hashes.len(), candidates)];
        while let Some((lo, hi, active)) = stack.pop() {
            if active == 0 {
                continue;
            }
            if lo == hi {
                let mut bits = active;
                while bits != 0 {
                    matched[bits.trailing_zeros() as usize] = lo as u32;
                    bits &= bits - 1;
                }
                continue;
            }
            let mid = (lo + hi).div_ceil(2);
            let longer = self.holders(&hashes[mid - 1], now, disk) & active;
            stack.push((mid, hi, longer));
            stack.push((lo, mid - 1, active & !longer));
        }
        matched
    }

    /// Drops expired approximate entries (call now and then).
    pub fn sweep(&mut self, now: u64) {
        self.blocks.retain(|_, e| {
            if e.expires < now {
                e.approx = 0;
            }
            !e.unused()
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn h(v: &[u64]) -> Vec<BlockHash> {
        v.iter().map(|&x| BlockHash(x)).collect()
    }

    #[test]
    fn matches_count_leading_blocks_per_worker() {
        let mut ix = PrefixIndex::new();
        ix.stored(0, &h(&[1, 2, 3]));
        ix.stored(1, &h(&[1, 2]));
        ix.stored(2, &h(&[7, 8]));
        let m = ix.matches(&h(&[1, 2, 3, 4]), 0b111, 0);
        assert_eq!(&m[..3], &[3, 2, 0]);
        ix.removed(0, &h(&[3]));
        assert_eq!(ix.matches(&h(&[1, 2, 3]), 0b1, 0)[0], 2);
        ix.reset_worker(1, &[]);
        assert_eq!(ix.matches(&h(&[1, 2]), 0b10, 0)[1], 0);
        // Approximate entries expire.
        ix.assume(5, &h(&[9, 10]), 100, 50);
        assert_eq!(ix.matches(&h(&[9, 10]), 1 << 5, 120)[5], 2);
        assert_eq!(ix.matches(&h(&[9, 10]), 1 << 5, 151)[5], 0);
        ix.sweep(151);
        assert_eq!(ix.worker_blocks(5), 0);
    }

    #[derive(Debug, Clone)]
    enum Ev {
        Store(usize, Vec<u64>),
        Remove(usize, Vec<u64>),
        Reset(usize, Vec<u64>),
    }

    fn ev() -> impl Strategy<Value = Ev> {
        let hashes = proptest::collection::vec(0u64..40, 0..8);
        prop_oneof![
            (0usize..6, hashes.clone()).prop_map(|(w, v)| Ev::Store(w, v)),
            (0usize..6, hashes.clone()).prop_map(|(w, v)| Ev::Remove(w, v)),
            (0usize..6, hashes).prop_map(|(w, v)| Ev::Reset(w, v)),
        ]
    }

    proptest! {
        /// Fed the workers' events, the index agrees exactly with a model of their caches.
        #[test]
        fn events_keep_the_index_exact(events in proptest::collection::vec(ev(), 1..200), query in proptest::collection::vec(0u64..40, 1..10)) {
            let mut ix = PrefixIndex::new();
            let mut model: Vec<std::collections::HashSet<u64>> = vec![Default::default(); 6];
            for e in events {
                match e {
                    Ev::Store(w, v) => { ix.stored(w, &h(&v)); model[w].extend(v); }
                    Ev::Remove(w, v) => { ix.removed(w, &h(&v)); for x in v { model[w].remove(&x); } }
                    Ev::Reset(w, v) => { ix.reset_worker(w, &h(&v)); model[w] = v.into_iter().collect(); }
                }
            }
            let m = ix.matches(&h(&query), 0b111111, 0);
            for w in 0..6 {
                // Never less than the true prefix; exact when the worker holds a prefix of
                // the query (as engines that evict tails first do).
                let want = query.iter().take_while(|q| model[w].contains(q)).count() as u32;
                prop_assert!(m[w] >= want, "worker {}", w);
                let closed = query.iter().skip(want as usize).all(|q| !model[w].contains(q));
                if closed {
                    prop_assert_eq!(m[w], want, "worker {}", w);
                }
                prop_assert_eq!(ix.worker_blocks(w), model[w].len());
            }
            let distinct: std::collections::HashSet<u64> = model.iter().flatten().copied().collect();
            prop_assert_eq!(ix.len(), distinct.len());
        }
    }
}

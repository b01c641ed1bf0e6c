//! The two merge loops: BPE (the lowest-ranked adjacent pair first) and SentencePiece's
//! (the highest-scoring adjacent pair whose concatenation is a token first). Both merge the
//! leftmost pair among equals, as the references do.
//!
//! Short words (nearly all of them) take a plain scan; long ones a heap over a linked list,
//! so that a pathological input (a megabyte without a break) costs O(n log n), not O(n²).

use std::cmp::{Ordering, Reverse};
use std::collections::{BinaryHeap, HashMap};

/// Pairs of token ids → (rank, merged id).
pub type MergeTable = HashMap<(u32, u32), (u32, u32), FastHash>;

/// A multiply-rotate hash (the Fx hash rustc uses) for the tokenizer's tables: their keys
/// come from the model file, not from clients, and SipHash was a third of encode time.
#[derive(Debug, Clone, Copy, Default)]
pub struct FastHash;

impl std::hash::BuildHasher for FastHash {
    type Hasher = FastHasher;
    fn build_hasher(&self) -> FastHasher {
        FastHasher(0)
    }
}

#[derive(Debug, Clone, Copy)]
pub struct FastHasher(u64);

const SEED: u64 = 0x51_7c_c1_b7_27_22_0a_95;

impl FastHasher {
    #[inline]
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(SEED);
    }
}

impl std::hash::Hasher for FastHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            self.add(u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut w = [0u8; 8];
            w[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(w));
        }
    }
    #[inline]
    fn write_u8(&mut self, i: u8) {
        self.add(i as u64);
    }
    #[inline]
    fn write_u32(&mut self, i: u32) {
        self.add(i as u64);
    }
    #[inline]
    fn write_u64(&mut self, i: u64) {
        self.add(i);
    }
    #[inline]
    fn write_usize(&mut self, i: usize) {
        self.add(i as u64);
    }
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
}

/// Words up to this many symbols take the plain scan.
const SCAN_LIMIT: usize = 48;

/// Merges `ids` in place by `merges`' ranks.
pub fn bpe(ids: &mut Vec<u32>, merges: &MergeTable) {
    if ids.len() <= SCAN_LIMIT {
        bpe_scan(ids, merges);
    } else {
        bpe_heap(ids, merges);
    }
}

fn bpe_scan(ids: &mut Vec<u32>, merges: &MergeTable) {
    while ids.len() > 1 {
        let mut best: Option<(u32, usize, u32)> = None;
        for i in 0..ids.len() - 1 {
            if let Some(&(rank, merged)) = merges.get(&(ids[i], ids[i + 1])) {
                if best.is_none_or(|(r, _, _)| rank < r) {
                    best = Some((rank, i, merged));
                }
            }
        }
        let Some((_, i, merged)) = best else { break };
        ids[i] = merged;
        ids.remove(i + 1);
    }
}

const NONE: u32 = u32::MAX;

fn bpe_heap(ids: &mut Vec<u32>, merges: &MergeTable) {
    let n = ids.len();
    let mut next: Vec<u32> = (1..=n as u32).collect();
    next[n - 1] = NONE;
    let mut prev: Vec<u32> = (0..n as u32).map(|i| i.wrapping_sub(1)).collect();
    prev[0] = NONE;
    let mut alive = vec![true; n];
    // (rank, left position): the smallest rank first, then the leftmost.
    let mut heap: BinaryHeap<Reverse<(u32, u32)>> = BinaryHeap::new();
    let push = |heap: &mut BinaryHeap<Reverse<(u32, u32)>>, ids: &[u32], next: &[u32], i: u32| {
        let j = next[i as usize];
        if j != NONE {
            if let Some(&(rank, _)) = merges.get(&(ids[i as usize], ids[j as usize])) {
                heap.push(Reverse((rank, i)));
            }
        }
    };
    for i in 0..n as u32 - 1 {
        push(&mut heap, ids, &next, i);
    }
    while let Some(Reverse((rank, i))) = heap.pop() {
        let iu = i as usize;
        let j = next[iu];
        if !alive[iu] || j == NONE {
            continue;
        }
        // Stale: the pair at i changed since this entry was pushed.
        let Some(&(r, merged)) = merges.get(&(ids[iu], ids[j as usize])) else {
            continue;
        };
        if r != rank {
            continue;
        }
        ids[iu] = merged;
        alive[j as usize] = false;
        let k = next[j as usize];
        next[iu] = k;
        if k != NONE {
            prev[k as usize] = i;
        }
        if prev[iu] != NONE {
            push(&mut heap, ids, &next, prev[iu]);
        }
        push(&mut heap, ids, &next, i);
    }
    let mut out = Vec::with_capacity(n);
    let mut at = 0u32;
    while at != NONE {
        out.push(ids[at as usize]);
        at = next[at as usize];
    }
    *ids = out;
}

/// One candidate merge of SentencePiece's loop.
#[derive(PartialEq)]
struct Bigram {
    score: f32,
    left: u32,
    right: u32,
    /// Byte length of the two symbols when the candidate was made (stale if changed).
    len: u32,
}

impl Eq for Bigram {}

impl Ord for Bigram {
    fn cmp(&self, other: &Self) -> Ordering {
        // A max-heap: the higher score first, then the leftmost.
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}

impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// SentencePiece's merge loop over `text` (already escaped: spaces as `▁`): starting from its
/// characters, repeatedly joins the adjacent pair whose text is the best-scoring token.
/// Returns the final symbols as byte ranges of `text`.
pub fn spm(text: &str, token: &dyn Fn(&[u8]) -> Option<u32>, score: &dyn Fn(u32) -> f32) -> Vec<(u32, u32)> {
    let bytes = text.as_bytes();
    // Symbols: (start, len) with prev/next links.
    let mut start: Vec<u32> = Vec::with_capacity(text.len());
    for (i, _) in text.char_indices() {
        start.push(i as u32);
    }
    let n = start.len();
    if n == 0 {
        return Vec::new();
    }
    let mut len: Vec<u32> = (0..n)
        .map(|i| start.get(i + 1).copied().unwrap_or(bytes.len() as u32) - start[i])
        .collect();
    let mut next: Vec<u32> = (1..=n as u32).collect();
    next[n - 1] = NONE;
    let mut prev: Vec<u32> = (0..n as u32).map(|i| i.wrapping_sub(1)).collect();
    prev[0] = NONE;
    let mut heap = BinaryHeap::new();
    let try_add = |heap: &mut BinaryHeap<Bigram>, len: &[u32], l: u32, r: u32| {
        if l == NONE || r == NONE {
            return;
        }
        let s = start[l as usize] as usize;
        let total = len[l as usize] + len[r as usize];
        if let Some(id) = token(&bytes[s..s + total as usize]) {
            heap.push(Bigram {
                score: score(id),
                left: l,
                right: r,
                len: total,
            });
        }
    };
    for i in 1..n as u32 {
        try_add(&mut heap, &len, i - 1, i);
    }
    while let Some(b) = heap.pop() {
        let (l, r) = (b.left as usize, b.right as usize);
        if len[l] == 0 || len[r] == 0 || len[l] + len[r] != b.len {
            continue;
        }
        len[l] += len[r];
        len[r] = 0;
        next[l] = next[r];
        if next[r] != NONE {
            prev[next[r] as usize] = b.left;
        }
        try_add(&mut heap, &len, prev[l], b.left);
        try_add(&mut heap, &len, b.left, next[l]);
    }
    let mut out = Vec::new();
    let mut at = 0u32;
    while at != NONE {
        out.push((start[at as usize], len[at as usize]));
        at = next[at as usize];
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn table(pairs: &[((u32, u32), u32)]) -> MergeTable {
        pairs
            .iter()
            .enumerate()
            .map(|(rank, &(p, m))| (p, (rank as u32, m)))
            .collect::<HashMap<_, _, FastHash>>()
    }

    proptest! {
        /// The heap gives exactly the plain scan's result, for any word and merge table.
        #[test]
        fn heap_equals_scan(word in proptest::collection::vec(0u32..4, 0..200)) {
            // Symbols 0..4; merges form 4.. from pairs of anything seen so far.
            let merges = table(&[((0, 1), 4), ((1, 1), 5), ((4, 2), 6), ((5, 5), 7), ((3, 0), 8), ((6, 3), 9), ((2, 2), 10), ((8, 4), 11)]);
            let mut a = word.clone();
            bpe_scan(&mut a, &merges);
            let mut b = word.clone();
            if !b.is_empty() {
                bpe_heap(&mut b, &merges);
            }
            prop_assert_eq!(a, b);
        }
    }

    #[test]
    fn spm_joins_the_best_scoring_pair_first() {
        let vocab: HashMap<&[u8], (u32, f32)> = [
            (&b"a"[..], (0, -5.0)),
            (b"b", (1, -5.0)),
            (b"ab", (2, -1.0)),
            (b"ba", (3, -0.5)),
            (b"aba", (4, -2.0)),
        ]
        .into_iter()
        .collect();
        let token = |b: &[u8]| vocab.get(b).map(|v| v.0);
        let score = |id: u32| vocab.values().find(|v| v.0 == id).map_or(0.0, |v| v.1);
        // "aba": "ba" scores best, then "a"+"ba" = "aba".
        assert_eq!(spm("aba", &token, &score), [(0, 3)]);
        assert_eq!(spm("abab", &token, &score), [(0, 3), (3, 1)]);
        assert!(spm("", &token, &score).is_empty());
    }
}

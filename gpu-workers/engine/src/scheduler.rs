//! Continuous batching: which tokens of which sequences run in the next forward step.
//!
//! Each step has a token budget shared by decodes and prefills:
//! 1. every running sequence that is decoding gets its one token (oldest first); if it needs
//!    a new block and none is free, the newest running sequence is preempted (its blocks
//!    freed; it recomputes later, mostly from the prefix cache);
//! 2. sequences part-way through their prompt continue in chunks;
//! 3. waiting sequences are admitted in arrival order while the budget, the running limit
//!    and the free blocks allow: first their longest cached prefix is taken from the prefix
//!    cache, then the rest of the prompt is prefilled in chunks.
//!
//! No sequence starves: admission is FIFO, decodes go first, and preemption always picks
//! the newest, so the oldest sequence always progresses.

use std::collections::{HashMap, VecDeque};

use hearth_protocol::{chain, BlockHash, LoadReport};

use crate::kv::BlockManager;

#[derive(Debug, Clone, Copy)]
pub struct SchedulerConfig {
    pub block_tokens: usize,
    /// Tokens per forward step (decodes + prefill chunks).
    pub max_batch_tokens: usize,
    /// Sequences running at once.
    pub max_running: usize,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            block_tokens: hearth_protocol::DEFAULT_BLOCK_TOKENS,
            max_batch_tokens: 512,
            max_running: 64,
        }
    }
}

#[derive(Debug, Clone)]
pub struct Sequence {
    pub id: u64,
    /// Prompt then generated tokens; the last one may not be computed yet.
    pub tokens: Vec<u32>,
    /// Tokens whose K/V are in the cache.
    pub computed: usize,
    /// Block ids holding positions `[i*B, (i+1)*B)`.
    pub table: Vec<u32>,
    /// Hashes of the full computed blocks (registered in the prefix cache).
    hashes: Vec<BlockHash>,
    root: BlockHash,
    /// Prompt tokens served from the prefix cache at first admission.
    pub cached_tokens: usize,
    admitted: bool,
    pub preemptions: u32,
}

impl Sequence {
    fn remaining(&self) -> usize {
        self.tokens.len() - self.computed
    }
}

/// A slice of one sequence to run in this step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepItem {
    pub seq: u64,
    /// First position (= index into the sequence's tokens).
    pub start: usize,
    pub len: usize,
    /// The step computes the sequence's last token: sample from its logits.
    pub sample: bool,
}

#[derive(Debug)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    pub blocks: BlockManager,
    seqs: HashMap<u64, Sequence>,
    waiting: VecDeque<u64>,
    running: Vec<u64>,
    /// Block copies (from, to) the engine must apply before the next step (forks).
    pub pending_copies: Vec<(u32, u32)>,
    pub preemptions: u64,
}

impl Scheduler {
    pub fn new(cfg: SchedulerConfig, num_blocks: usize) -> Self {
        Self {
            cfg,
            blocks: BlockManager::new(num_blocks),
            seqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            pending_copies: Vec::new(),
            preemptions: 0,
        }
    }

    pub fn config(&self) -> SchedulerConfig {
        self.cfg
    }

    /// Tokens the cache can hold in total.
    pub fn capacity_tokens(&self) -> usize {
        self.blocks.total() * self.cfg.block_tokens
    }

    pub fn add(&mut self, id: u64, tokens: Vec<u32>, root: BlockHash) {
        let seq = Sequence {
            id,
            tokens,
            computed: 0,
            table: Vec::new(),
            hashes: Vec::new(),
            root,
            cached_tokens: 0,
            admitted: false,
            preemptions: 0,
        };
        self.seqs.insert(id, seq);
        self.waiting.push_back(id);
    }

    pub fn get(&self, id: u64) -> Option<&Sequence> {
        self.seqs.get(&id)
    }

    pub fn is_idle(&self) -> bool {
        self.seqs.is_empty()
    }

    /// Ends a sequence (finished or cancelled): its blocks are released at once.
    pub fn remove(&mut self, id: u64) -> Option<Sequence> {
        let seq = self.seqs.remove(&id)?;
        // Tail first: the LRU then evicts a prefix's last blocks before its first ones, so
        // what stays cached is always a usable prefix.
        for &b in seq.table.iter().rev() {
            self.blocks.release(b);
        }
        self.running.retain(|&r| r != id);
        self.waiting.retain(|&w| w != id);
        Some(seq)
    }

    /// The blocks of `id`'s computed full blocks, which are in the prefix cache.
    pub fn cached_blocks(&self, id: u64) -> Vec<u32> {
        self.seqs
            .get(&id)
            .map_or_else(Vec::new, |s| s.table[..s.hashes.len()].to_vec())
    }

    pub fn push_token(&mut self, id: u64, token: u32) {
        if let Some(s) = self.seqs.get_mut(&id) {
            s.tokens.push(token);
        }
    }

    /// Grows `id`'s block table to cover `upto` positions; false if blocks ran out (the
    /// table keeps what it got).
    fn ensure(&mut self, id: u64, upto: usize) -> bool {
        let bt = self.cfg.block_tokens;
        let Some(seq) = self.seqs.get_mut(&id) else {
            return false;
        };
        while seq.table.len() * bt < upto {
            match self.blocks.allocate() {
                Some(b) => seq.table.push(b),
                None => return false,
            }
        }
        true
    }

    fn preempt(&mut self, id: u64) {
        if let Some(seq) = self.seqs.get_mut(&id) {
            for &b in seq.table.iter().rev() {
                self.blocks.release(b);
            }
            seq.table.clear();
            seq.hashes.clear();
            seq.computed = 0;
            seq.preemptions += 1;
        }
        self.preemptions += 1;
        self.running.retain(|&r| r != id);
        self.waiting.push_front(id);
    }

    /// Takes the longest cached prefix (whole blocks, leaving at least one token to compute).
    fn match_prefix(&mut self, id: u64) {
        let bt = self.cfg.block_tokens;
        let Some(seq) = self.seqs.get_mut(&id) else { return };
        if seq.computed > 0 || !seq.table.is_empty() {
            return;
        }
        let full = (seq.tokens.len() - 1) / bt;
        let mut h = seq.root;
        for i in 0..full {
            h = chain(h, &seq.tokens[i * bt..(i + 1) * bt]);
            match self.blocks.lookup(h) {
                Some(b) => {
                    seq.table.push(b);
                    seq.hashes.push(h);
                }
                None => break,
            }
        }
        seq.computed = seq.table.len() * bt;
        if !seq.admitted {
            seq.cached_tokens = seq.computed;
        }
    }

    fn unmatch(&mut self, id: u64) {
        if let Some(seq) = self.seqs.get_mut(&id) {
            for &b in &seq.table {
                self.blocks.release(b);
            }
            seq.table.clear();
            seq.hashes.clear();
            seq.computed = 0;
        }
    }

    /// Plans the next step. If nothing can run (sequences part-way through their prompts
    /// hold the last blocks), the newest running sequence is preempted until something can.
    pub fn schedule(&mut self) -> Vec<StepItem> {
        loop {
            let items = self.plan();
            if !items.is_empty() || self.running.len() <= 1 {
                return items;
            }
            let newest = self.running[self.running.len() - 1];
            self.preempt(newest);
        }
    }

    fn plan(&mut self) -> Vec<StepItem> {
        let bt = self.cfg.block_tokens;
        let mut items = Vec::new();
        let mut budget = self.cfg.max_batch_tokens;

        // 1. Decodes, oldest first; preempt the newest when blocks run out.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            let (computed, remaining) = {
                let s = &self.seqs[&id];
                (s.computed, s.remaining())
            };
            if remaining != 1 {
                i += 1;
                continue;
            }
            let mut preempted_self = false;
            while !self.ensure(id, computed + 1) {
                let victim = *self.running.last().unwrap_or(&id);
                self.preempt(victim);
                if victim == id {
                    preempted_self = true;
                    break;
                }
            }
            if preempted_self {
                break; // everything after it is newer and was preempted first
            }
            items.push(StepItem {
                seq: id,
                start: computed,
                len: 1,
                sample: true,
            });
            budget -= 1;
            i += 1;
        }

        // 2. Running sequences part-way through their prompt.
        let prefilling: Vec<u64> = self
            .running
            .iter()
            .copied()
            .filter(|id| self.seqs[id].remaining() > 1)
            .collect();
        for id in prefilling {
            if budget == 0 {
                break;
            }
            let (computed, remaining, total) = {
                let s = &self.seqs[&id];
                (s.computed, s.remaining(), s.tokens.len())
            };
            let mut len = remaining.min(budget);
            if !self.ensure(id, computed + len) {
                len = self.seqs[&id].table.len() * bt - computed;
                len = len.min(remaining).min(budget);
                if len == 0 {
                    continue;
                }
            }
            items.push(StepItem {
                seq: id,
                start: computed,
                len,
                sample: computed + len == total,
            });
            budget -= len;
        }

        // 3. Admission, in arrival order.
        while budget > 0 && self.running.len() < self.cfg.max_running {
            let Some(&id) = self.waiting.front() else { break };
            self.match_prefix(id);
            let (computed, total, have) = {
                let s = &self.seqs[&id];
                (s.computed, s.tokens.len(), s.table.len())
            };
            // The whole prompt and the first generated token must fit.
            let need = (total + 1).div_ceil(bt).saturating_sub(have);
            if self.blocks.available() < need {
                self.unmatch(id);
                break;
            }
            self.waiting.pop_front();
            self.running.push(id);
            if let Some(s) = self.seqs.get_mut(&id) {
                s.admitted = true;
            }
            let len = (total - computed).min(budget);
            let ok = self.ensure(id, computed + len);
            debug_assert!(ok, "admission checked the free blocks");
            items.push(StepItem {
                seq: id,
                start: computed,
                len,
                sample: computed + len == total,
            });
            budget -= len;
        }
        items
    }

    /// Records that a step ran: advances each sequence and publishes its newly full blocks
    /// to the prefix cache.
    pub fn complete(&mut self, items: &[StepItem]) {
        let bt = self.cfg.block_tokens;
        for it in items {
            let Some(seq) = self.seqs.get_mut(&it.seq) else {
                continue;
            };
            seq.computed = seq.computed.max(it.start + it.len);
            while (seq.hashes.len() + 1) * bt <= seq.computed {
                let i = seq.hashes.len();
                let parent = if i == 0 { seq.root } else { seq.hashes[i - 1] };
                let h = chain(parent, &seq.tokens[i * bt..(i + 1) * bt]);
                seq.hashes.push(h);
                self.blocks.register(seq.table[i], h);
            }
        }
    }

    /// A copy of `parent` as a new sequence `child` sharing its full blocks (the partial
    /// last block is copied). Falls back to queueing the child as a new sequence (it will
    /// reuse the parent's blocks through the prefix cache) if no block is free.
    pub fn fork(&mut self, parent: u64, child: u64) {
        let bt = self.cfg.block_tokens;
        let Some(p) = self.seqs.get(&parent).cloned() else {
            return;
        };
        let full = p.computed / bt;
        let mut table: Vec<u32> = p.table[..full.min(p.table.len())].to_vec();
        let partial = p.computed % bt != 0;
        if partial {
            match self.blocks.allocate() {
                Some(b) => {
                    self.pending_copies.push((p.table[full], b));
                    table.push(b);
                }
                None => {
                    self.add(child, p.tokens.clone(), p.root);
                    return;
                }
            }
        }
        for &b in &table[..full] {
            self.blocks.share(b);
        }
        let seq = Sequence {
            id: child,
            table,
            preemptions: 0,
            ..p
        };
        self.seqs.insert(child, seq);
        self.running.push(child);
    }

    pub fn load(&self) -> LoadReport {
        let inflight: usize = self
            .seqs
            .values()
            .filter(|s| s.remaining() > 1 || !s.admitted)
            .map(Sequence::remaining)
            .sum();
        LoadReport {
            running: self.running.len() as u32,
            waiting: self.waiting.len() as u32,
            inflight_prefill_tokens: inflight as u64,
            free_blocks: self.blocks.available() as u32,
            total_blocks: self.blocks.total() as u32,
        }
    }

    /// Every block reference sequences hold (for the ownership check).
    pub fn owned_blocks(&self) -> Vec<u32> {
        self.seqs.values().flat_map(|s| s.table.iter().copied()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hearth_protocol::namespace_root;
    use proptest::prelude::*;

    fn cfg(budget: usize) -> SchedulerConfig {
        SchedulerConfig {
            block_tokens: 4,
            max_batch_tokens: budget,
            max_running: 8,
        }
    }

    /// Runs a step as the engine would: complete it, then give sampled sequences a token.
    fn run_step(s: &mut Scheduler, items: &[StepItem], tok: u32) {
        s.complete(items);
        for it in items.iter().filter(|i| i.sample) {
            s.push_token(it.seq, tok);
        }
    }

    #[test]
    fn chunked_prefill_then_decode_then_prefix_hit() {
        let root = namespace_root("m", "t");
        let mut s = Scheduler::new(cfg(6), 16);
        s.add(1, (0..10).collect(), root);
        let a = s.schedule();
        assert_eq!(
            a,
            [StepItem {
                seq: 1,
                start: 0,
                len: 6,
                sample: false
            }]
        );
        run_step(&mut s, &a, 99);
        let b = s.schedule();
        assert_eq!(
            b,
            [StepItem {
                seq: 1,
                start: 6,
                len: 4,
                sample: true
            }]
        );
        run_step(&mut s, &b, 99);
        let c = s.schedule();
        assert_eq!(
            c,
            [StepItem {
                seq: 1,
                start: 10,
                len: 1,
                sample: true
            }]
        );
        run_step(&mut s, &c, 98);
        s.remove(1);
        // The same prompt again: its two full blocks (8 tokens) come from the cache.
        s.add(2, (0..10).collect(), root);
        let d = s.schedule();
        assert_eq!(
            d,
            [StepItem {
                seq: 2,
                start: 8,
                len: 2,
                sample: true
            }]
        );
        assert_eq!(s.get(2).unwrap().cached_tokens, 8);
        // Another namespace shares nothing.
        s.add(3, (0..10).collect(), namespace_root("m", "other"));
        let e = s.schedule();
        assert!(
            e.contains(&StepItem {
                seq: 3,
                start: 0,
                len: 4,
                sample: false
            }),
            "{e:?}"
        );
        s.blocks.check(&s.owned_blocks()).unwrap();
    }

    #[test]
    fn preempts_the_newest_when_blocks_run_out() {
        let root = namespace_root("m", "t");
        let mut s = Scheduler::new(cfg(64), 4); // 16 tokens of cache
        s.add(1, vec![1; 5], root);
        s.add(2, vec![2; 5], root);
        let a = s.schedule();
        assert_eq!(a.len(), 2);
        run_step(&mut s, &a, 7);
        // Decode until the cache is full; sequence 2 must be preempted, 1 keeps going.
        for _ in 0..8 {
            let items = s.schedule();
            assert!(
                items.iter().any(|i| i.seq == 1),
                "the oldest always progresses: {items:?}"
            );
            run_step(&mut s, &items, 7);
            s.blocks.check(&s.owned_blocks()).unwrap();
        }
        assert!(s.preemptions > 0);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Arrive(usize),
        Step,
        StepAndFork,
        Cancel(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (1usize..40).prop_map(Op::Arrive),
            Just(Op::Step),
            Just(Op::Step),
            Just(Op::StepAndFork),
            (0usize..64).prop_map(Op::Cancel),
        ]
    }

    struct World {
        s: Scheduler,
        live: Vec<u64>,
        generated: HashMap<u64, usize>,
        next: u64,
    }

    impl World {
        /// One engine step: plan, check, complete, fork sampled sequences (when asked, as
        /// `n` > 1 does after prefill), then give each sampled sequence a token.
        fn step(&mut self, fork: bool) -> Result<(), TestCaseError> {
            let items = self.s.schedule();
            prop_assert!(items.iter().map(|i| i.len).sum::<usize>() <= 16);
            for it in &items {
                let seq = self.s.get(it.seq).unwrap();
                prop_assert!(seq.table.len() * 4 >= it.start + it.len);
            }
            self.s.pending_copies.clear();
            self.s.complete(&items);
            for it in items.iter().filter(|i| i.sample) {
                let mut ids = vec![it.seq];
                if fork && !self.generated.contains_key(&it.seq) {
                    self.s.fork(it.seq, self.next);
                    self.live.push(self.next);
                    ids.push(self.next);
                    self.next += 1;
                }
                for id in ids {
                    if self.s.get(id).is_some_and(|q| q.computed == q.tokens.len()) {
                        // A few repeated token patterns, so prefixes get shared.
                        self.s.push_token(id, (it.start % 3) as u32);
                    }
                    let g = self.generated.entry(id).or_default();
                    *g += 1;
                    if *g >= 6 {
                        self.s.remove(id);
                        self.live.retain(|&x| x != id);
                    }
                }
            }
            self.s.blocks.check(&self.s.owned_blocks()).map_err(TestCaseError::fail)
        }
    }

    proptest! {
        /// Random arrivals, steps, cancellations and forks: blocks are never leaked or
        /// double-owned, every planned step fits its budget and its blocks, and every
        /// sequence finishes.
        #[test]
        fn blocks_are_never_leaked_or_double_owned(ops in proptest::collection::vec(op(), 1..120), blocks in 6usize..40) {
            let root = namespace_root("m", "t");
            let mut w = World { s: Scheduler::new(cfg(16), blocks), live: Vec::new(), generated: HashMap::new(), next: 0 };
            for op in ops {
                match op {
                    Op::Arrive(len) => {
                        // Prompts must fit the cache with their output (as the engine checks).
                        let len = len.min(blocks * 4 - 8).max(1);
                        w.s.add(w.next, (0..len as u32).map(|t| t % 5).collect(), root);
                        w.live.push(w.next);
                        w.next += 1;
                    }
                    Op::Step => w.step(false)?,
                    Op::StepAndFork => w.step(true)?,
                    Op::Cancel(i) if !w.live.is_empty() => {
                        let id = w.live.remove(i % w.live.len());
                        w.s.remove(id);
                    }
                    _ => {}
                }
                w.s.blocks.check(&w.s.owned_blocks()).map_err(TestCaseError::fail)?;
            }
            // Drain: everything finishes (no starvation, no deadlock).
            let mut steps = 0;
            while !w.s.is_idle() {
                w.step(false)?;
                steps += 1;
                prop_assert!(steps < 10_000, "did not drain: {:?}", w.s.load());
            }
            prop_assert_eq!(w.s.blocks.available(), blocks);
        }
    }
}

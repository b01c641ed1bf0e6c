//! The scheduler admitting and preempting: blocks for a sequence's next tokens, its cached
//! prefix matched (and given back), the running order, and the sequences preempted when
//! blocks run out or for a tenant or class that outranks them.

use hearth_protocol::{chain, Priority};

use crate::step::scheduler::{class, Policy, Scheduler, StepItem};

impl Scheduler {
    /// Grows `id`'s block table to cover `upto` positions; false if blocks ran out (the
    /// table keeps what it got).
    pub(super) fn ensure(&mut self, id: u64, upto: usize) -> bool {
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

    pub(super) fn preempt(&mut self, id: u64) {
        if let Some(seq) = self.seqs.get_mut(&id) {
            for &b in seq.table.iter().rev() {
                self.blocks.release(b);
            }
            seq.table.clear();
            seq.hashes.clear();
            seq.draft.clear();
            seq.computed = 0;
            seq.preemptions += 1;
            seq.waiting_since = self.steps;
            // First in its account's queue: it is older than what waits there.
            self.accounts[seq.account].waiting[class(seq.priority)].push_front(id);
        }
        self.preemptions += 1;
        self.running.retain(|&r| r != id);
    }

    /// Where `id` goes in the running order: after every sequence of its class or higher
    /// (FIFO: at the end).
    pub(super) fn insert_running(&mut self, id: u64) {
        let c = self.seqs.get(&id).map_or(0, |s| class(s.priority));
        let at = match self.cfg.policy {
            Policy::Fifo => self.running.len(),
            Policy::Fair => self
                .running
                .iter()
                .position(|r| self.seqs.get(r).is_some_and(|s| class(s.priority) > c))
                .unwrap_or(self.running.len()),
        };
        self.running.insert(at, id);
    }

    /// Takes the longest cached prefix (whole blocks, leaving at least one token to compute).
    pub(super) fn match_prefix(&mut self, id: u64) {
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

    pub(super) fn unmatch(&mut self, id: u64) {
        if let Some(seq) = self.seqs.get_mut(&id) {
            for &b in &seq.table {
                self.blocks.release(b);
            }
            seq.table.clear();
            seq.hashes.clear();
            seq.computed = 0;
        }
    }

    /// Moves `id` from its queue to the running set; the first time, charges its cached
    /// prefix.
    pub(super) fn admit(&mut self, id: u64) {
        let w = self.cfg.weights;
        // (Not `aged`: its prefix taken from the cache, the sequence already holds blocks.)
        let promote = self.cfg.policy == Policy::Fair && self.seqs.get(&id).is_some_and(|s| self.past_bound(s));
        let Some(s) = self.seqs.get_mut(&id) else { return };
        let a = &mut self.accounts[s.account];
        let c = class(s.priority);
        if a.waiting[c].front() == Some(&id) {
            a.waiting[c].pop_front();
        } else {
            a.waiting[c].retain(|&x| x != id);
        }
        if !s.admitted {
            s.admitted = true;
            a.counter += s.cached_tokens as f64 * w.cached / a.share;
            a.served.cached += s.cached_tokens as u64;
        }
        s.charged = s.charged.max(s.computed);
        // Past its wait bound, a batch sequence runs as interactive from now on.
        if promote {
            s.priority = Priority::Interactive;
            s.promoted = true;
            self.promoted += 1;
        }
        self.insert_running(id);
    }

    /// Preempts the last running sequence if it is batch work (dropping what this step
    /// planned for it); false if none is, or if it was admitted in this same plan
    /// (`admitted_now`): it would be admitted again, ahead of an aged sequence behind it in
    /// its queue, and the two would take turns for ever.
    pub(super) fn preempt_batch(
        &mut self,
        admitted_now: &[u64],
        items: &mut Vec<StepItem>,
        budget: &mut usize,
    ) -> bool {
        let Some(&victim) = self.running.iter().rev().find(|id| !self.pinned.contains(id)) else {
            return false;
        };
        if admitted_now.contains(&victim) {
            return false;
        }
        if self.seqs.get(&victim).is_none_or(|s| s.priority != Priority::Batch) {
            return false;
        }
        if let Some(pos) = items.iter().position(|it| it.seq == victim) {
            *budget += items.remove(pos).len;
        }
        self.preempt(victim);
        true
    }

    /// Fairness preemption: when the fair choice `id` does not fit, a running sequence of a
    /// tenant ahead of its own by more than [`Scheduler::preemption_margin`], in the same or
    /// a lower class, makes room — the newest still computing its prompt, else the newest;
    /// never a batch request the starvation bound promoted (it would lose its turn and hold
    /// the next one up). It loses little while the cache keeps
    /// its computed full blocks (prompt and output): admitted again, it recomputes only
    /// its last partial block (on a cache too small to keep them, more). False if there is
    /// none.
    pub(super) fn preempt_for(&mut self, id: u64, items: &mut Vec<StepItem>, budget: &mut usize) -> bool {
        if self.cfg.policy != Policy::Fair {
            return false;
        }
        let Some(w) = self.seqs.get(&id) else { return false };
        let (account, c) = (w.account, if self.aged(id) { 0 } else { class(w.priority) });
        let bar = self.accounts[account].counter + self.preemption_margin();
        let over_served = |r: &u64| {
            let s = &self.seqs[r];
            s.account != account
                && !s.promoted
                && !self.pinned.contains(r)
                && class(s.priority) >= c
                && self.accounts[s.account].counter > bar
        };
        // Cheapest first: a sequence still computing its prompt has produced nothing yet.
        let prefilling = |r: &u64| self.seqs[r].tokens.len() == self.seqs[r].prompt_len;
        let victim = (self.running.iter().rev().copied())
            .find(|r| over_served(r) && prefilling(r))
            .or_else(|| self.running.iter().rev().copied().find(over_served));
        let Some(victim) = victim else { return false };
        if let Some(p) = items.iter().position(|it| it.seq == victim) {
            *budget += items.remove(p).len;
        }
        self.preempt(victim);
        true
    }
}

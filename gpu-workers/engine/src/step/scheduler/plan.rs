//! The scheduler planning a step: decodes, prompt chunks and admissions within the token
//! budget, draft tokens in what is left, batch work deferred for interactive work, and
//! whether an arriving request cuts a step in progress short.

use hearth_protocol::{Priority, Qos};

use crate::step::scheduler::{class, Account, Policy, Scheduler, StepItem, MAX_DEFERRED_STEPS};

impl Scheduler {
    /// Plans the next step. If nothing can run (sequences part-way through their prompts
    /// hold the last blocks), the last running sequence is preempted until something can.
    pub fn schedule(&mut self) -> Vec<StepItem> {
        self.steps += 1;
        loop {
            let items = self.plan();
            if !items.is_empty() || self.running.len() <= 1 {
                return items;
            }
            match self.victim() {
                Some(victim) => self.preempt(victim),
                // Only sequences a step in flight computes hold the blocks (a pipeline's).
                None => return items,
            }
        }
    }

    /// The running sequence to preempt when blocks run out: FIFO, the newest; fair, the
    /// newest of the lowest class's tenant with the highest counter (it has had the most).
    pub(super) fn victim(&self) -> Option<u64> {
        let free = |id: &&u64| !self.pinned.contains(id);
        match self.cfg.policy {
            Policy::Fifo => self.running.iter().rev().find(free).copied(),
            Policy::Fair => self
                .running
                .iter()
                .filter(free)
                .enumerate()
                .max_by(|(i, a), (j, b)| {
                    let (sa, sb) = (&self.seqs[*a], &self.seqs[*b]);
                    class(sa.priority)
                        .cmp(&class(sb.priority))
                        .then(
                            self.accounts[sa.account]
                                .counter
                                .total_cmp(&self.accounts[sb.account].counter),
                        )
                        .then(i.cmp(j))
                })
                .map(|(_, id)| *id),
        }
    }

    pub(super) fn plan(&mut self) -> Vec<StepItem> {
        let bt = self.cfg.block_tokens;
        let mut items = Vec::new();
        let mut budget = self.cfg.max_batch_tokens;

        // 1. Decodes in running order; preempt the victim when blocks run out.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            let (computed, remaining) = {
                let s = &self.seqs[&id];
                (s.computed, s.remaining())
            };
            if remaining != 1 || self.skip.contains(&id) {
                i += 1;
                continue;
            }
            let mut preempted_self = false;
            while !self.ensure(id, computed + 1) {
                let victim = self.victim().unwrap_or(id);
                let at = self.running.iter().position(|&r| r == victim).unwrap_or(usize::MAX);
                if let Some(p) = items.iter().position(|it: &StepItem| it.seq == victim) {
                    budget += items.remove(p).len;
                }
                self.preempt(victim);
                if victim == id {
                    preempted_self = true;
                    break;
                }
                if at < i {
                    i -= 1; // `id` moved one place down
                }
            }
            if preempted_self {
                continue; // the next sequence is at `i` now
            }
            // (Its draft tokens, if any, come last: `attach_drafts`.)
            items.push(StepItem {
                seq: id,
                start: computed,
                len: 1,
                sample: true,
                draft: 0,
            });
            budget -= 1;
            i += 1;
        }

        // 2. Running sequences part-way through their prompt. Fair: the lowest class and
        //    counter first, and those ranked after the next waiting sequence only after
        //    admission (a newly admitted under-served tenant's prompt gets the budget before
        //    an over-served tenant's chunks).
        let mut prefilling: Vec<u64> = self
            .running
            .iter()
            .copied()
            .filter(|id| self.seqs[id].remaining() > 1 && !self.skip.contains(id))
            .collect();
        let mut later = Vec::new();
        if self.cfg.policy == Policy::Fair {
            prefilling.sort_by(|a, b| self.rank(*a).total_cmp(&self.rank(*b)));
            if let Some(bar) = self.next_waiting().map(|w| self.rank(w)) {
                let split = prefilling.partition_point(|id| self.rank(*id) <= bar);
                later = prefilling.split_off(split);
            }
        }
        for id in prefilling {
            self.prefill_chunk(id, &mut items, &mut budget);
        }

        // 3. Admission: the fair (or FIFO) choice; when it does not fit, nothing jumps it,
        //    but interactive work may preempt running batch work to make room.
        let mut admitted_now = Vec::new();
        while budget > 0 {
            let Some(id) = self.next_waiting() else { break };
            let urgent =
                self.cfg.policy == Policy::Fair && (self.seqs[&id].priority == Priority::Interactive || self.aged(id));
            if self.running.len() >= self.cfg.max_running {
                if (urgent && self.preempt_batch(&admitted_now, &mut items, &mut budget))
                    || self.preempt_for(id, &mut items, &mut budget)
                {
                    continue;
                }
                break;
            }
            self.match_prefix(id);
            let (computed, total, have) = {
                let s = &self.seqs[&id];
                (s.computed, s.tokens.len(), s.table.len())
            };
            // The whole prompt and the first generated token must fit.
            let need = (total + 1).div_ceil(bt).saturating_sub(have);
            if self.blocks.available() < need {
                self.unmatch(id);
                if (urgent && self.preempt_batch(&admitted_now, &mut items, &mut budget))
                    || self.preempt_for(id, &mut items, &mut budget)
                {
                    continue;
                }
                break;
            }
            self.admit(id);
            admitted_now.push(id);
            let len = (total - computed).min(budget);
            let ok = self.ensure(id, computed + len);
            debug_assert!(ok, "admission checked the free blocks");
            items.push(StepItem {
                seq: id,
                start: computed,
                len,
                sample: computed + len == total,
                draft: 0,
            });
            budget -= len;
        }
        // (Admission may have preempted some of them, or re-admitted one with a chunk.)
        for id in later {
            if self.running.contains(&id) && !items.iter().any(|it| it.seq == id) {
                self.prefill_chunk(id, &mut items, &mut budget);
            }
        }
        self.attach_drafts(&mut items, &mut budget);
        self.defer_batch_work(&mut items);
        items
    }

    /// Speculative decoding's draft tokens ride along their sequence's decode row with what
    /// the step has left once every decode, prefill chunk and admission has its share — the
    /// budget, and blocks still free — so that a draft never delays, starves or preempts
    /// other work.
    fn attach_drafts(&mut self, items: &mut [StepItem], budget: &mut usize) {
        let bt = self.cfg.block_tokens;
        for it in items.iter_mut() {
            if *budget == 0 {
                break;
            }
            let s = &self.seqs[&it.seq];
            let decode = it.sample && it.len == 1 && it.start + 1 == s.tokens.len();
            let mut k = s.draft.len().min(*budget);
            if !decode || k == 0 {
                continue;
            }
            if !self.ensure(it.seq, it.start + 1 + k) {
                k = (self.seqs[&it.seq].table.len() * bt)
                    .saturating_sub(it.start + 1)
                    .min(k);
            }
            it.len += k;
            it.draft = k;
            *budget -= k;
        }
    }

    /// The next chunk of a running sequence's prompt, as far as the budget and its blocks
    /// allow.
    fn prefill_chunk(&mut self, id: u64, items: &mut Vec<StepItem>, budget: &mut usize) {
        let bt = self.cfg.block_tokens;
        if *budget == 0 {
            return;
        }
        let (computed, remaining, total) = {
            let s = &self.seqs[&id];
            (s.computed, s.remaining(), s.tokens.len())
        };
        let mut len = remaining.min(*budget);
        if !self.ensure(id, computed + len) {
            len = self.seqs[&id].table.len() * bt - computed;
            len = len.min(remaining).min(*budget);
            if len == 0 {
                return;
            }
        }
        items.push(StepItem {
            seq: id,
            start: computed,
            len,
            sample: computed + len == total,
            draft: 0,
        });
        *budget -= len;
    }

    /// Strict order between classes inside a step: a step that prefills interactive work
    /// leaves batch work out (a step's time grows with its tokens, and an interactive first
    /// token should not wait on them) — but never more than [`MAX_DEFERRED_STEPS`] steps in
    /// a row, so running batch work keeps a bounded token rate.
    fn defer_batch_work(&mut self, items: &mut Vec<StepItem>) {
        if self.cfg.policy != Policy::Fair {
            return;
        }
        // (a prompt chunk, class) of each item.
        let kinds: Vec<(bool, Priority)> = items
            .iter()
            .map(|it| {
                let s = &self.seqs[&it.seq];
                (
                    !(it.len - it.draft == 1 && it.sample && it.start >= s.prompt_len),
                    s.priority,
                )
            })
            .collect();
        let interactive_prefill = kinds.contains(&(true, Priority::Interactive));
        let batch = kinds.iter().any(|k| k.1 == Priority::Batch);
        if !interactive_prefill || !batch || self.deferred >= MAX_DEFERRED_STEPS {
            self.deferred = 0;
            return;
        }
        self.deferred += 1;
        let mut k = kinds.into_iter();
        items.retain(|_| k.next().is_none_or(|k| k.1 != Priority::Batch));
    }

    /// Whether a new request of `qos` should cut short the step `items` while it runs
    /// (between layers; the engine then plans again with the request admitted): under
    /// [`Policy::Fair`], an interactive request arriving while the step computes at least a
    /// block's worth of prompt tokens of work it outranks — batch work, or interactive work
    /// of tenants ahead of its own counter (once it arrives) by more than the preemption
    /// margin, which it would preempt — and no prompt tokens of any other work. (A tenant
    /// level with the one whose prompt runs could not be admitted sooner: no cut.)
    pub fn interrupts(&self, qos: &Qos, items: &[StepItem]) -> bool {
        if self.cfg.policy != Policy::Fair || qos.priority != Priority::Interactive {
            return false;
        }
        let bar = self.arrival_counter(qos) + self.preemption_margin();
        let mut outranked = 0;
        for it in items {
            let Some(s) = self.seqs.get(&it.seq) else { continue };
            // (A decode carrying draft tokens is still a decode.)
            let prompt = !(it.len - it.draft == 1 && it.sample && it.start >= s.prompt_len);
            if !prompt {
                continue;
            }
            let a = &self.accounts[s.account];
            if class(s.priority) == 0 && (a.name == qos.tenant || a.counter <= bar) {
                return false;
            }
            outranked += it.len;
        }
        outranked >= self.cfg.block_tokens
    }

    /// The waiting sequence to admit next (not removed from its queue).
    fn next_waiting(&self) -> Option<u64> {
        let front = |a: &Account, c: usize| a.waiting[c].front().map(|id| (self.seqs[id].arrival, *id));
        match self.cfg.policy {
            Policy::Fifo => self
                .accounts
                .iter()
                .flat_map(|a| [front(a, 0), front(a, 1)])
                .flatten()
                .min()
                .map(|(_, id)| id),
            Policy::Fair => {
                // A batch sequence that has waited too long goes first (oldest first).
                let aged = self
                    .accounts
                    .iter()
                    .filter_map(|a| front(a, 1))
                    .filter(|(_, id)| self.aged(*id))
                    .min();
                if let Some((_, id)) = aged {
                    return Some(id);
                }
                // Ties go to the tenant with fewer sequences, then to the oldest.
                (0..2).find_map(|c| {
                    self.accounts
                        .iter()
                        .filter_map(|a| front(a, c).map(|(arrival, id)| (a.counter, a.seqs, arrival, id)))
                        .min_by(|x, y| x.0.total_cmp(&y.0).then(x.1.cmp(&y.1)).then(x.2.cmp(&y.2)))
                        .map(|(_, _, _, id)| id)
                })
            }
        }
    }
}

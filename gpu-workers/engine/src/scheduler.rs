//! Continuous batching: which tokens of which sequences run in the next forward step, and
//! whose sequences are admitted first when they do not all fit.
//!
//! Each step has a token budget shared by decodes and prefills:
//! 1. every running sequence that is decoding gets its one token, in running order; if it
//!    needs a new block and none is free, a running sequence is preempted (its blocks
//!    freed; it recomputes later, mostly from the prefix cache): FIFO the newest, fair the
//!    victim below;
//! 2. sequences part-way through their prompt continue in chunks;
//! 3. waiting sequences are admitted while the budget, the running limit and the free
//!    blocks allow: first their longest cached prefix is taken from the prefix cache, then
//!    the rest of the prompt is prefilled in chunks.
//!
//! ## Fairness ([`Policy::Fair`], the default)
//! Who is admitted next is a virtual token counter per tenant (VTC: Sheng et al., "Fairness
//! in Serving Large Language Models", OSDI '24):
//! - every token a step computes is charged to its tenant's counter, divided by the
//!   tenant's share: prompt tokens at [`FairWeights::prefill`], generated tokens at
//!   [`FairWeights::decode`], prompt tokens served from the prefix cache at
//!   [`FairWeights::cached`] (they cost KV memory, not compute); recomputation after a
//!   preemption is not charged again;
//! - the next sequence admitted is the oldest waiting one of the tenant with the lowest
//!   counter, in the highest priority class with waiting work (strict between classes);
//! - a tenant that becomes active again is lifted to the lowest active counter less a
//!   fixed credit ([`RETURN_CREDIT`] preemption margins), so idle time is not banked beyond
//!   it, and a light tenant's burst of requests — up to about that many steps' prompt
//!   budget — goes ahead of a flooder's;
//! - when that sequence does not fit, the newest running sequences of tenants ahead of its
//!   own by more than the preemption margin (one step's prompt budget, in counter units:
//!   so divided by the share; same or lower class)
//!   are preempted for it — they lose little: their computed full blocks stay in the prefix
//!   cache, so they recompute at most a partial block. The margin is what keeps two tenants
//!   on a full cache from preempting each other in turn as each is charged past the other;
//! - prompt chunks get the step's budget lowest class and counter first;
//! - when blocks run out, the sequence preempted is the newest of the lowest class's
//!   tenant with the highest counter;
//! - admission is head-of-line in that order: a sequence that does not fit waits for room
//!   and is not jumped by smaller ones (so large requests are not starved); meanwhile the
//!   step's budget goes to running work.
//!
//! Classes are strict:
//! - running sequences are kept ordered by class, then admission, and decodes go in that
//!   order; batch work is preempted before interactive work;
//! - an interactive sequence that does not fit (no free blocks, or the running limit)
//!   preempts running batch sequences to make room;
//! - a step that prefills interactive work leaves batch work out (at most
//!   [`MAX_DEFERRED_STEPS`] steps in a row), so an interactive first token does not share
//!   its step with the batch class's tokens;
//! - nor does it wait for a step in progress computing the prompt of work it outranks: an
//!   interactive request arriving while a step computes batch prompt tokens, or prompt
//!   tokens of a tenant it would preempt, cuts that step short between layers
//!   ([`Scheduler::interrupts`]); the engine then plans again with the request admitted.
//!
//! **Starvation bound for the lowest class.** A batch sequence that has waited
//! [`SchedulerConfig::starvation_steps`] steps is admitted ahead of all other waiting work,
//! and from then on runs as interactive (it is not preempted before interactive work, nor
//! for fairness) — one such promoted request at a time, so a batch backlog older than the bound gets a
//! guaranteed share of the worker (one request running) without taking it from
//! interactive work. So the oldest aged batch sequence waits at most that many steps plus
//! the time for the promoted one ahead of it to finish and its blocks to free, which the
//! oldest running sequence's progress guarantees.
//!
//! [`Policy::Fifo`] admits in arrival order and ignores tenants and classes (for
//! comparison in `hearth bench fairness`). Either way no sequence starves: under FIFO the
//! first running sequence always progresses; under fair scheduling a preempted sequence's
//! tenant is not charged while the others are, so it does not stay the victim (the
//! property tests drain random workloads of one and of two tenants).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use hearth_protocol::{chain, BlockHash, LoadReport, Priority, Qos, QueueState};

use crate::kv::BlockManager;
use crate::kv_tier::{BlockKey, Spill};

/// How waiting sequences are admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Policy {
    /// Arrival order, regardless of tenant or class.
    Fifo,
    /// Virtual token counters per tenant within strict priority classes.
    #[default]
    Fair,
}

impl Policy {
    pub fn parse(s: &str) -> Option<Policy> {
        match s {
            "fifo" => Some(Policy::Fifo),
            "fair" => Some(Policy::Fair),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Policy::Fifo => "fifo",
            Policy::Fair => "fair",
        }
    }
}

/// What one token costs a tenant's counter (before dividing by its share).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FairWeights {
    /// A prompt token computed.
    pub prefill: f64,
    /// A generated token (a decode step of one sequence).
    pub decode: f64,
    /// A prompt token served from the prefix cache.
    pub cached: f64,
}

impl Default for FairWeights {
    /// VTC's weights (output tokens twice input tokens); a cached token a tenth of a
    /// computed one.
    fn default() -> Self {
        Self {
            prefill: 1.0,
            decode: 2.0,
            cached: 0.1,
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub struct SchedulerConfig {
    pub block_tokens: usize,
    /// Tokens per forward step (decodes + prefill chunks).
    pub max_batch_tokens: usize,
    /// Sequences running at once.
    pub max_running: usize,
    pub policy: Policy,
    pub weights: FairWeights,
    /// A batch sequence waiting this many steps is admitted ahead of everything else.
    pub starvation_steps: u64,
}

/// Default [`SchedulerConfig::starvation_steps`]: about 30 s at 30 ms a step.
pub const DEFAULT_STARVATION_STEPS: u64 = 1000;

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            block_tokens: hearth_protocol::DEFAULT_BLOCK_TOKENS,
            max_batch_tokens: 512,
            max_running: 64,
            policy: Policy::default(),
            weights: FairWeights::default(),
            starvation_steps: DEFAULT_STARVATION_STEPS,
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
    /// The chain of [`BlockKey`]s over its tokens, from `key_root`, as far as computed (only
    /// with a tier below the pool: see [`Scheduler::set_key_root`]).
    key_root: Option<BlockKey>,
    keys: Vec<BlockKey>,
    /// Prompt tokens served from the prefix cache at first admission.
    pub cached_tokens: usize,
    admitted: bool,
    pub preemptions: u32,
    /// Its tenant's account.
    account: usize,
    /// The class it is scheduled in (a batch sequence that waited too long runs as
    /// interactive).
    pub priority: Priority,
    /// Tokens at arrival (the prompt, with any resumed tokens).
    prompt_len: usize,
    /// Positions already charged to the account (recomputation is free).
    charged: usize,
    /// Arrival order (FIFO, and the oldest-first order inside an account).
    arrival: u64,
    /// The step it last started waiting at: arrival, or its last preemption (for the
    /// starvation bound).
    waiting_since: u64,
    /// A batch sequence promoted to the interactive class by the starvation bound.
    promoted: bool,
    /// Draft tokens to verify after the last token in the next step (speculative
    /// decoding); cleared by every step.
    pub draft: Vec<u32>,
}

impl Sequence {
    /// Tokens at arrival: positions below it are prompt tokens (or resumed ones).
    pub fn prompt_len(&self) -> usize {
        self.prompt_len
    }

    fn remaining(&self) -> usize {
        self.tokens.len() - self.computed
    }

    /// The [`BlockKey`] of full block `i` (None without a key root).
    fn key(&mut self, i: usize, bt: usize) -> Option<BlockKey> {
        let root = self.key_root?;
        while self.keys.len() <= i {
            let j = self.keys.len();
            let parent = self.keys.last().copied().unwrap_or(root);
            self.keys.push(parent.chain(&self.tokens[j * bt..(j + 1) * bt]));
        }
        Some(self.keys[i])
    }
}

/// Tokens served to one tenant, by kind.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Served {
    pub prefill: u64,
    pub decode: u64,
    pub cached: u64,
}

/// One tenant's fairness account.
#[derive(Debug, Clone)]
struct Account {
    name: String,
    /// The name, shared with the blocks it spills.
    tenant: Arc<str>,
    share: f64,
    /// The virtual token counter: weighted tokens served ÷ share (plus lifts).
    counter: f64,
    /// Waiting sequences per class, oldest first.
    waiting: [VecDeque<u64>; 2],
    /// Sequences it has (waiting or running).
    seqs: usize,
    served: Served,
}

/// A tenant's account as tests and benchmarks read it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AccountView {
    pub counter: f64,
    pub share: f64,
    pub served: Served,
    pub seqs: usize,
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
    /// The last `draft` positions are draft tokens (speculative decoding): logits come back
    /// for each of them too, and none counts as computed until it is accepted.
    pub draft: usize,
}

#[derive(Debug)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    pub blocks: BlockManager,
    seqs: HashMap<u64, Sequence>,
    accounts: Vec<Account>,
    account_ids: HashMap<String, usize>,
    /// Ordered by class, then admission (see the module's doc).
    running: Vec<u64>,
    /// Block copies (from, to) the engine must apply before the next step (forks).
    pub pending_copies: Vec<(u32, u32)>,
    pub preemptions: u64,
    arrivals: u64,
    steps: u64,
    /// Consecutive steps that left batch work out.
    deferred: u32,
    /// Sequences the starvation bound has promoted (until they end): while one is, no
    /// other batch sequence ages past the bound.
    promoted: usize,
    /// The highest lowest-active-counter seen at an arrival since the scheduler was last
    /// idle (see [`Scheduler::floor`]).
    floor_seen: Option<f64>,
}

/// A returning tenant starts at most this many preemption margins below the lowest active
/// counter ([`Scheduler::arrival_counter`]). Each request of a light tenant's burst charges
/// it about a margin (a step's prompt budget) while the flooder, sharing the worker, is
/// charged less, and a request may preempt only while its tenant is more than a margin
/// behind: the credit must last the burst, or its later requests wait for a flooder's to
/// finish (the test `a_light_tenants_burst_beside_a_flooder_still_preempts`).
pub const RETURN_CREDIT: f64 = 6.0;

/// At most this many steps in a row leave batch work out for interactive prefills.
pub const MAX_DEFERRED_STEPS: u32 = 4;

/// At most this many steps in a row are cut short for arriving requests
/// ([`Scheduler::interrupts`]); the next one runs whole, so running work always progresses.
pub const MAX_CUTS_IN_A_ROW: u32 = 2;

fn class(p: Priority) -> usize {
    match p {
        Priority::Interactive => 0,
        Priority::Batch => 1,
    }
}

impl Scheduler {
    pub fn new(cfg: SchedulerConfig, num_blocks: usize) -> Self {
        Self {
            cfg,
            blocks: BlockManager::new(num_blocks),
            seqs: HashMap::new(),
            accounts: Vec::new(),
            account_ids: HashMap::new(),
            running: Vec::new(),
            pending_copies: Vec::new(),
            preemptions: 0,
            arrivals: 0,
            steps: 0,
            deferred: 0,
            promoted: 0,
            floor_seen: None,
        }
    }

    pub fn config(&self) -> SchedulerConfig {
        self.cfg
    }

    /// Tokens the cache can hold in total.
    pub fn capacity_tokens(&self) -> usize {
        self.blocks.total() * self.cfg.block_tokens
    }

    /// Queues a sequence for the anonymous tenant, interactive.
    pub fn add(&mut self, id: u64, tokens: Vec<u32>, root: BlockHash) {
        self.add_for(id, tokens, root, &Qos::default());
    }

    fn account_for(&mut self, qos: &Qos) -> usize {
        let share = f64::from(qos.share.max(1));
        if let Some(&a) = self.account_ids.get(&qos.tenant) {
            self.accounts[a].share = share;
            return a;
        }
        if self.accounts.len() >= 100_000 {
            self.forget_idle_accounts();
        }
        self.accounts.push(Account {
            name: qos.tenant.clone(),
            tenant: qos.tenant.as_str().into(),
            share,
            counter: 0.0,
            waiting: Default::default(),
            seqs: 0,
            served: Served::default(),
        });
        let a = self.accounts.len() - 1;
        self.account_ids.insert(qos.tenant.clone(), a);
        a
    }

    /// Drops the accounts of tenants with no sequences (a returning tenant is lifted to the
    /// lowest active counter less the credit anyway, so only its debt beyond that is
    /// forgotten).
    fn forget_idle_accounts(&mut self) {
        let mut remap = vec![usize::MAX; self.accounts.len()];
        let mut kept = Vec::new();
        for (i, a) in std::mem::take(&mut self.accounts).into_iter().enumerate() {
            if a.seqs > 0 {
                remap[i] = kept.len();
                kept.push(a);
            }
        }
        self.accounts = kept;
        self.account_ids = self
            .accounts
            .iter()
            .enumerate()
            .map(|(i, a)| (a.name.clone(), i))
            .collect();
        for s in self.seqs.values_mut() {
            s.account = remap[s.account];
        }
    }

    /// The counter `qos`'s tenant has once a request of it arrives. Idle time is not
    /// credit: a tenant with no sequences starts from the lowest active counter, less
    /// [`RETURN_CREDIT`] margins ([`Scheduler::preemption_margin`]): enough that a light
    /// tenant's burst of requests is admitted ahead of a flooder's and may preempt its
    /// work, and no more. (Idling never lowers a counter: a returning tenant wins back at
    /// most the credit of the service it gave up while idle.)
    fn arrival_counter(&self, qos: &Qos) -> f64 {
        let account = self.account_ids.get(&qos.tenant).map(|&a| &self.accounts[a]);
        let (own, idle) = account.map_or((0.0, true), |a| (a.counter, a.seqs == 0));
        match self.floor() {
            Some(f) if idle => own.max(f - self.return_credit()),
            _ => own,
        }
    }

    /// What returning tenants are lifted to (less the credit): the lowest counter of the
    /// tenants with sequences, or the highest it has been since the scheduler was last idle
    /// ([`Scheduler::floor_seen`]) if that is higher, so that tenants returning one after
    /// another all start from the same place, not each a credit below the last.
    fn floor(&self) -> Option<f64> {
        let f = (self.accounts.iter())
            .filter(|a| a.seqs > 0)
            .map(|a| a.counter)
            .fold(f64::INFINITY, f64::min);
        f.is_finite().then(|| self.floor_seen.map_or(f, |seen| seen.max(f)))
    }

    fn return_credit(&self) -> f64 {
        RETURN_CREDIT * self.preemption_margin()
    }

    /// Queues a sequence for a tenant, in a class.
    pub fn add_for(&mut self, id: u64, tokens: Vec<u32>, root: BlockHash, qos: &Qos) {
        let account = self.account_for(qos);
        self.accounts[account].counter = self.arrival_counter(qos);
        self.floor_seen = self.floor();
        self.arrivals += 1;
        let seq = Sequence {
            id,
            prompt_len: tokens.len(),
            tokens,
            computed: 0,
            table: Vec::new(),
            hashes: Vec::new(),
            root,
            key_root: None,
            keys: Vec::new(),
            cached_tokens: 0,
            admitted: false,
            preemptions: 0,
            account,
            priority: qos.priority,
            charged: 0,
            arrival: self.arrivals,
            waiting_since: self.steps,
            promoted: false,
            draft: Vec::new(),
        };
        self.seqs.insert(id, seq);
        let a = &mut self.accounts[account];
        a.seqs += 1;
        a.waiting[class(qos.priority)].push_back(id);
    }

    pub fn get(&self, id: u64) -> Option<&Sequence> {
        self.seqs.get(&id)
    }

    pub fn is_idle(&self) -> bool {
        self.seqs.is_empty()
    }

    /// A tenant's account (None: it never had a sequence here).
    pub fn account(&self, tenant: &str) -> Option<AccountView> {
        let a = &self.accounts[*self.account_ids.get(tenant)?];
        Some(AccountView {
            counter: a.counter,
            share: a.share,
            served: a.served,
            seqs: a.seqs,
        })
    }

    /// The queue a new request of `tenant` would join, measured as the gateway measures it
    /// (prompt tokens not yet computed), against `limit`.
    pub fn queue_state(&self, tenant: &str, limit: u64) -> QueueState {
        let mine = self.account_ids.get(tenant).copied();
        let mut tenants = vec![false; self.accounts.len()];
        let (mut queued, mut tenant_queued) = (0u64, 0u64);
        for s in self.seqs.values().filter(|s| s.queued()) {
            let t = s.remaining() as u64;
            queued += t;
            tenants[s.account] = true;
            if Some(s.account) == mine {
                tenant_queued += t;
            }
        }
        let others = tenants
            .iter()
            .enumerate()
            .filter(|(i, q)| **q && Some(*i) != mine)
            .count() as u64;
        QueueState {
            limit,
            queued,
            tenant_queued,
            tenants: others + 1,
        }
    }

    /// Names `id`'s blocks for the tier below the pool too: their [`BlockKey`] chain starts
    /// at `root` (its model and cache namespace).
    pub fn set_key_root(&mut self, id: u64, root: BlockKey) {
        if let Some(s) = self.seqs.get_mut(&id) {
            s.key_root = Some(root);
        }
    }

    /// Ends a sequence (finished or cancelled): its blocks are released at once.
    pub fn remove(&mut self, id: u64) -> Option<Sequence> {
        let seq = self.seqs.remove(&id)?;
        self.promoted -= usize::from(seq.promoted);
        // Tail first: the LRU then evicts a prefix's last blocks before its first ones, so
        // what stays cached is always a usable prefix.
        for &b in seq.table.iter().rev() {
            self.blocks.release(b);
        }
        self.running.retain(|&r| r != id);
        let a = &mut self.accounts[seq.account];
        a.seqs -= 1;
        for q in &mut a.waiting {
            q.retain(|&w| w != id);
        }
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

    /// Proposes draft tokens to verify in `id`'s next decode step (speculative decoding).
    pub fn set_draft(&mut self, id: u64, draft: Vec<u32>) {
        if let Some(s) = self.seqs.get_mut(&id) {
            s.draft = draft;
        }
    }

    /// A verified draft token: appended as computed (the step that verified it wrote its
    /// K/V), charged as generated, and its block published once full.
    pub fn accept_draft(&mut self, id: u64, token: u32) {
        let Some(s) = self.seqs.get_mut(&id) else { return };
        debug_assert_eq!(s.computed, s.tokens.len(), "a draft follows a computed token");
        s.tokens.push(token);
        let end = s.tokens.len();
        let item = StepItem {
            seq: id,
            start: end - 1,
            len: 1,
            sample: false,
            draft: 0,
        };
        self.complete(&[item]);
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
    fn insert_running(&mut self, id: u64) {
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
    /// hold the last blocks), the last running sequence is preempted until something can.
    pub fn schedule(&mut self) -> Vec<StepItem> {
        self.steps += 1;
        loop {
            let items = self.plan();
            if !items.is_empty() || self.running.len() <= 1 {
                return items;
            }
            if let Some(victim) = self.victim() {
                self.preempt(victim);
            }
        }
    }

    /// The running sequence to preempt when blocks run out: FIFO, the newest; fair, the
    /// newest of the lowest class's tenant with the highest counter (it has had the most).
    fn victim(&self) -> Option<u64> {
        match self.cfg.policy {
            Policy::Fifo => self.running.last().copied(),
            Policy::Fair => self
                .running
                .iter()
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

    fn plan(&mut self) -> Vec<StepItem> {
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
            if remaining != 1 {
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
            .filter(|id| self.seqs[id].remaining() > 1)
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

    /// Fair order: class first, then the tenant's counter (as one sortable number).
    fn rank(&self, id: u64) -> f64 {
        let s = &self.seqs[&id];
        let c = if self.aged(id) { 0 } else { class(s.priority) };
        // Counters are far below 1e15 (a trillion weighted tokens per unit of share).
        c as f64 * 1e15 + self.accounts[s.account].counter
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

    /// Whether `id` is waiting batch work past its wait bound (a waiting sequence holds no
    /// blocks; a running one always holds some) while no other promoted sequence is alive:
    /// the bound promotes one batch sequence at a time, so the batch class is guaranteed
    /// progress without taking the worker from interactive work.
    fn aged(&self, id: u64) -> bool {
        self.seqs
            .get(&id)
            .is_some_and(|s| s.table.is_empty() && self.past_bound(s))
    }

    /// Whether `s` is batch work that has waited past the bound while no promoted sequence is
    /// alive (waiting or not: see [`Scheduler::aged`]).
    fn past_bound(&self, s: &Sequence) -> bool {
        self.promoted == 0 && s.priority == Priority::Batch && self.steps - s.waiting_since >= self.cfg.starvation_steps
    }

    /// Preempts the last running sequence if it is batch work (dropping what this step
    /// planned for it); false if none is, or if it was admitted in this same plan
    /// (`admitted_now`): it would be admitted again, ahead of an aged sequence behind it in
    /// its queue, and the two would take turns for ever.
    fn preempt_batch(&mut self, admitted_now: &[u64], items: &mut Vec<StepItem>, budget: &mut usize) -> bool {
        let Some(&victim) = self.running.last() else {
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
    fn preempt_for(&mut self, id: u64, items: &mut Vec<StepItem>, budget: &mut usize) -> bool {
        if self.cfg.policy != Policy::Fair {
            return false;
        }
        let Some(w) = self.seqs.get(&id) else { return false };
        let (account, c) = (w.account, if self.aged(id) { 0 } else { class(w.priority) });
        let bar = self.accounts[account].counter + self.preemption_margin();
        let over_served = |r: &u64| {
            let s = &self.seqs[r];
            s.account != account && !s.promoted && class(s.priority) >= c && self.accounts[s.account].counter > bar
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

    /// How far ahead (in counter units) a tenant must be for fairness to preempt its work
    /// (or to have its step cut): one step's budget of prompt tokens. Without it, two
    /// tenants on a full cache take turns preempting each other, each time the one just
    /// admitted is charged past the other, and the work each preemption throws away is
    /// charged to no one.
    fn preemption_margin(&self) -> f64 {
        self.cfg.max_batch_tokens as f64 * self.cfg.weights.prefill
    }

    /// Moves `id` from its queue to the running set; the first time, charges its cached
    /// prefix.
    fn admit(&mut self, id: u64) {
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

    /// Records that a step ran: advances each sequence, charges its tenant for the new
    /// tokens and publishes its newly full blocks to the prefix cache.
    pub fn complete(&mut self, items: &[StepItem]) {
        let bt = self.cfg.block_tokens;
        let w = self.cfg.weights;
        for it in items {
            let Some(seq) = self.seqs.get_mut(&it.seq) else {
                continue;
            };
            // Draft positions are not computed until verified (see `accept_draft`).
            seq.draft.clear();
            let end = it.start + it.len - it.draft;
            if end > seq.charged {
                let from = seq.charged.max(it.start);
                let prompt = seq.prompt_len.clamp(from, end) - from;
                let generated = end - from - prompt;
                let a = &mut self.accounts[seq.account];
                a.counter += (prompt as f64 * w.prefill + generated as f64 * w.decode) / a.share;
                a.served.prefill += prompt as u64;
                a.served.decode += generated as u64;
                seq.charged = end;
            }
            seq.computed = seq.computed.max(end);
            while (seq.hashes.len() + 1) * bt <= seq.computed {
                let i = seq.hashes.len();
                let parent = if i == 0 { seq.root } else { seq.hashes[i - 1] };
                let h = chain(parent, &seq.tokens[i * bt..(i + 1) * bt]);
                seq.hashes.push(h);
                let spill = seq.key(i, bt).map(|key| Spill {
                    key,
                    tenant: self.accounts[seq.account].tenant.clone(),
                });
                self.blocks.register_spillable(seq.table[i], h, spill);
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
                    let qos = Qos {
                        tenant: self.accounts[p.account].name.clone(),
                        priority: p.priority,
                        share: self.accounts[p.account].share as u32,
                    };
                    self.add_for(child, p.tokens.clone(), p.root, &qos);
                    if let Some(c) = self.seqs.get_mut(&child) {
                        c.promoted = p.promoted;
                        self.promoted += usize::from(p.promoted);
                    }
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
            draft: Vec::new(),
            ..p
        };
        self.accounts[seq.account].seqs += 1;
        // (A promoted request's samples are all promoted: the next batch request ages past
        // the bound only when they have all ended.)
        self.promoted += usize::from(seq.promoted);
        self.seqs.insert(child, seq);
        self.insert_running(child);
    }

    pub fn load(&self) -> LoadReport {
        let inflight: usize = self.seqs.values().filter(|s| s.queued()).map(Sequence::remaining).sum();
        LoadReport {
            running: self.running.len() as u32,
            waiting: self
                .accounts
                .iter()
                .map(|a| a.waiting[0].len() + a.waiting[1].len())
                .sum::<usize>() as u32,
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

impl Sequence {
    /// Waiting, or part-way through its prompt: what a queue limit counts.
    fn queued(&self) -> bool {
        self.remaining() > 1 || !self.admitted
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
            ..Default::default()
        }
    }

    /// 16-token steps, 64 blocks, and a starvation bound of `bound` steps.
    fn bounded(bound: u64) -> Scheduler {
        Scheduler::new(
            SchedulerConfig {
                starvation_steps: bound,
                ..cfg(16)
            },
            64,
        )
    }

    /// A tenant's requests in a class, share 1.
    fn qos(tenant: &str, priority: Priority) -> Qos {
        Qos {
            tenant: tenant.into(),
            priority,
            share: 1,
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
    fn drafts_get_only_what_decodes_prefill_and_admission_leave() {
        let root = namespace_root("m", "t");
        let item = |seq, start, len, sample, draft| StepItem {
            seq,
            start,
            len,
            sample,
            draft,
        };
        // Budget: two decoding sequences, one drafting 7 tokens, and a waiting prompt of 4.
        let mut s = Scheduler::new(cfg(8), 16);
        s.add(1, vec![1, 2, 3], root);
        s.add(2, vec![4, 5, 6], root);
        let a = s.schedule();
        run_step(&mut s, &a, 99);
        s.set_draft(1, vec![10, 11, 12, 13, 14, 15, 16]);
        s.add(3, vec![7, 8, 9, 10], root);
        let b = s.schedule();
        assert_eq!(
            b,
            [item(1, 3, 3, true, 2), item(2, 3, 1, true, 0), item(3, 0, 4, true, 0)],
            "the draft gets the 2 tokens left"
        );

        // Blocks (4 tokens each, 4 in all): the other sequence's next block comes first; the
        // draft takes only what is still free, and nothing is preempted.
        let mut s = Scheduler::new(cfg(16), 4);
        s.add(1, vec![1, 2, 3], root);
        s.add(2, vec![4, 5, 6, 7], root);
        let a = s.schedule();
        run_step(&mut s, &a, 99);
        s.set_draft(1, vec![10, 11, 12, 13, 14, 15, 16]);
        let b = s.schedule();
        assert_eq!(b, [item(1, 3, 5, true, 4), item(2, 4, 1, true, 0)]);
        assert_eq!(s.running.len(), 2);
        s.blocks.check(&s.owned_blocks()).unwrap();
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
                sample: false,
                draft: 0
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
                sample: true,
                draft: 0
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
                sample: true,
                draft: 0
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
                sample: true,
                draft: 0
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
                sample: false,
                draft: 0
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

    /// Two tenants kept backlogged (each tops its queue up to `depth[i]` waiting requests
    /// of `prompt` tokens and `out` generated tokens) on one scheduler; returns the largest
    /// counter gap seen after the warm-up, the bound it must stay under, and each tenant's
    /// weighted service.
    struct Backlogged {
        s: Scheduler,
        tenants: [Qos; 2],
        depth: [usize; 2],
        prompt: [usize; 2],
        out: [usize; 2],
        generated: HashMap<u64, (usize, usize)>,
        next: u64,
    }

    impl Backlogged {
        fn new(policy: Policy, shares: [u32; 2], depth: [usize; 2], prompt: [usize; 2], out: [usize; 2]) -> Self {
            let cfg = SchedulerConfig {
                block_tokens: 4,
                max_batch_tokens: 32,
                max_running: 6,
                policy,
                ..Default::default()
            };
            let tenant = |i: usize| Qos {
                tenant: format!("t{i}"),
                priority: Priority::Interactive,
                share: shares[i],
            };
            Self {
                // Room for every running sequence at its longest: no preemption.
                s: Scheduler::new(cfg, 6 * (prompt[0].max(prompt[1]) + out[0].max(out[1]) + 8) / 4),
                tenants: [tenant(0), tenant(1)],
                depth,
                prompt,
                out,
                generated: HashMap::new(),
                next: 0,
            }
        }

        fn top_up(&mut self) {
            let root = namespace_root("m", "t");
            for i in 0..2 {
                let waiting = self
                    .s
                    .account_ids
                    .get(&format!("t{i}"))
                    .map_or(0, |&a| self.s.accounts[a].waiting[0].len());
                for _ in waiting..self.depth[i] {
                    // Distinct tokens: no prefix sharing between requests.
                    let base = (self.next * 1000) as u32;
                    let prompt = (0..self.prompt[i] as u32).map(|t| base + t).collect();
                    self.s.add_for(self.next, prompt, root, &self.tenants[i]);
                    self.generated.insert(self.next, (i, 0));
                    self.next += 1;
                }
            }
        }

        fn step(&mut self) {
            self.top_up();
            let items = self.s.schedule();
            self.s.complete(&items);
            for it in items.iter().filter(|i| i.sample) {
                let Some((t, g)) = self.generated.get_mut(&it.seq) else {
                    continue;
                };
                *g += 1;
                if *g >= self.out[*t] {
                    self.s.remove(it.seq);
                    self.generated.remove(&it.seq);
                } else {
                    self.s.push_token(it.seq, 7);
                }
            }
        }

        fn counters(&self) -> [f64; 2] {
            [0, 1].map(|i| self.s.account(&format!("t{i}")).map_or(0.0, |a| a.counter))
        }

        /// The service-gap bound for two backlogged tenants: a full running set of the
        /// largest requests, plus one step's tokens, at the dearest weight, over the
        /// smaller share.
        fn bound(&self) -> f64 {
            let w = self.s.cfg.weights;
            let cost = (0..2)
                .map(|i| self.prompt[i] as f64 * w.prefill + self.out[i] as f64 * w.decode)
                .fold(0.0, f64::max);
            let min_share = self.tenants.iter().map(|t| t.share).min().unwrap_or(1) as f64;
            (self.s.cfg.max_running as f64 * cost + self.s.cfg.max_batch_tokens as f64 * w.decode) / min_share
        }

        /// Runs `steps` steps; the largest gap after the first `warmup`.
        fn run(&mut self, warmup: usize, steps: usize) -> f64 {
            let mut worst: f64 = 0.0;
            for n in 0..steps {
                self.step();
                if n >= warmup {
                    let [a, b] = self.counters();
                    worst = worst.max((a - b).abs());
                }
            }
            worst
        }
    }

    proptest! {
        /// VTC's guarantee: while two tenants are backlogged on a saturated worker (each
        /// keeps more requests waiting than the worker runs at once, so someone always
        /// waits), the gap between their counters (weighted service ÷ share) stays under a
        /// constant, whatever their shares, request sizes and how much each floods. (On a
        /// worker with room for everyone, each gets what it asks and no bound applies.)
        #[test]
        fn the_service_gap_between_backlogged_tenants_is_bounded(
            shares in (1u32..5, 1u32..5),
            depth in (7usize..16, 7usize..16),
            prompt in (1usize..24, 1usize..24),
            out in (1usize..12, 1usize..12),
        ) {
            let mut b = Backlogged::new(
                Policy::Fair,
                [shares.0, shares.1],
                [depth.0, depth.1],
                [prompt.0, prompt.1],
                [out.0, out.1],
            );
            let gap = b.run(0, 400);
            prop_assert!(gap <= b.bound(), "gap {gap} > bound {}", b.bound());
            b.s.blocks.check(&b.s.owned_blocks()).map_err(TestCaseError::fail)?;
        }
    }

    #[test]
    fn fifo_lets_a_flooder_take_the_worker_and_fair_does_not() {
        // Tenant 0 keeps ten requests waiting, tenant 1 one.
        let run = |policy| {
            let mut b = Backlogged::new(policy, [1, 1], [10, 1], [16, 16], [8, 8]);
            let gap = b.run(0, 2000);
            let served = [0, 1].map(|i| b.s.account(&format!("t{i}")).unwrap().served);
            (gap, b.bound(), served)
        };
        let (fair_gap, bound, fair) = run(Policy::Fair);
        let (fifo_gap, _, fifo) = run(Policy::Fifo);
        assert!(fair_gap <= bound, "fair: {fair_gap} > {bound}");
        assert!(
            fifo_gap > 10.0 * bound,
            "FIFO's gap should grow without bound: {fifo_gap}"
        );
        let split = |s: [Served; 2]| s[0].decode as f64 / (s[0].decode + s[1].decode) as f64;
        assert!((split(fair) - 0.5).abs() < 0.05, "fair split {}", split(fair));
        assert!(split(fifo) > 0.8, "FIFO split {}", split(fifo));
    }

    #[test]
    fn shares_split_a_saturated_worker() {
        let mut b = Backlogged::new(Policy::Fair, [3, 1], [4, 4], [12, 12], [8, 8]);
        b.run(0, 3000);
        let s = [0, 1].map(|i| b.s.account(&format!("t{i}")).unwrap().served);
        let w = |s: Served| s.prefill as f64 + 2.0 * s.decode as f64;
        let share0 = w(s[0]) / (w(s[0]) + w(s[1]));
        assert!(
            (share0 - 0.75).abs() < 0.075,
            "tenant 0 got {share0} of the service, configured 0.75"
        );
    }

    #[test]
    fn a_returning_tenant_does_not_bank_idle_time() {
        let root = namespace_root("m", "t");
        let mut s = Scheduler::new(cfg(64), 256);
        let q = |t: &str| qos(t, Priority::Interactive);
        let steps = |s: &mut Scheduler, n| {
            for _ in 0..n {
                let items = s.schedule();
                run_step(s, &items, 3);
            }
        };
        // a is charged well past the credit (RETURN_CREDIT steps' prompt budget).
        let credit = RETURN_CREDIT * 64.0;
        let prompt = (2.0 * credit) as usize;
        s.add_for(1, vec![1; prompt], root, &q("a"));
        steps(&mut s, prompt.div_ceil(64) + 1);
        let a = s.account("a").unwrap().counter;
        assert!(a >= 2.0 * credit);
        // b arrives while a is active: it starts the credit below a's counter, not at zero.
        s.add_for(2, vec![2; 4], root, &q("b"));
        assert_eq!(s.account("b").unwrap().counter, a - credit);
        // However long it then stays idle, it comes back to the same distance, no further.
        s.remove(2);
        steps(&mut s, 30);
        let a = s.account("a").unwrap().counter;
        s.add_for(3, vec![2; 4], root, &q("b"));
        assert_eq!(s.account("b").unwrap().counter, a - credit);
    }

    #[test]
    fn interactive_goes_first_and_batch_is_preempted_first() {
        let root = namespace_root("m", "t");
        let batch = qos("b", Priority::Batch);
        let inter = qos("i", Priority::Interactive);
        // Room for two 5-token sequences at first (4 blocks of 4 tokens).
        let mut s = Scheduler::new(cfg(64), 4);
        s.add_for(1, vec![1; 5], root, &batch);
        s.add_for(2, vec![2; 5], root, &inter);
        let a = s.schedule();
        // Both fit and are admitted, the interactive one first although it arrived second;
        // its prompt's step leaves the batch prompt out.
        assert_eq!(a.iter().map(|i| i.seq).collect::<Vec<_>>(), [2]);
        assert_eq!(s.load().running, 2);
        run_step(&mut s, &a, 7);
        // Then the batch prompt runs beside the interactive decode.
        let b = s.schedule();
        assert_eq!(b.iter().map(|i| (i.seq, i.len)).collect::<Vec<_>>(), [(2, 1), (1, 5)]);
        run_step(&mut s, &b, 7);
        for _ in 0..6 {
            let items = s.schedule();
            assert!(
                items.iter().any(|i| i.seq == 2),
                "interactive always progresses: {items:?}"
            );
            run_step(&mut s, &items, 7);
        }
        assert!(s.get(1).unwrap().preemptions > 0, "the batch sequence made room");
        assert_eq!(s.get(2).unwrap().preemptions, 0);
    }

    #[test]
    fn a_batch_request_waits_at_most_the_starvation_bound() {
        let root = namespace_root("m", "t");
        let bound = 50;
        let mut s = bounded(bound);
        let inter = qos("i", Priority::Interactive);
        let batch = qos("b", Priority::Batch);
        s.add_for(0, vec![9; 6], root, &batch);
        let mut next = 1;
        let mut generated: HashMap<u64, usize> = HashMap::new();
        let mut admitted_at = None;
        for step in 1..=400u64 {
            // An interactive flood that always keeps eight requests waiting.
            while s.load().waiting < 9 {
                s.add_for(next, vec![next as u32; 6], root, &inter);
                next += 1;
            }
            let items = s.schedule();
            if admitted_at.is_none() && items.iter().any(|i| i.seq == 0) {
                admitted_at = Some(step);
            }
            run_step(&mut s, &items, 1);
            for it in items.iter().filter(|i| i.sample) {
                let g = generated.entry(it.seq).or_default();
                *g += 1;
                if *g >= 4 {
                    s.remove(it.seq);
                }
            }
        }
        let at = admitted_at.expect("the batch request was never admitted");
        assert!(at > 1, "interactive work goes first while it waits");
        // The bound, plus the steps for a running sequence to finish and free room.
        assert!(at <= bound + 1 + 8, "admitted at step {at}, bound {bound}");
    }

    /// `hearth bench fairness`'s engine scenario on the scheduler alone, in virtual time: a
    /// flooder keeps eight 96-token requests in flight on a cache with room for three; a
    /// light tenant's 400 requests arrive Poisson at `rps` a second (16 tokens out each;
    /// the gaps and prompts drawn from `seed`, not zero); a step costs 4 ms, plus 0.3 ms a
    /// prompt token and 1.2 ms a decode (so a request alone takes about 110 ms: 2.5 a second
    /// is 28 % of the engine). Returns the light tenant's P90 wait for its first token (ms)
    /// and the preemptions.
    fn light_tenant_beside_a_flooder(policy: Policy, flood: bool, rps: f64, seed: u64) -> (f64, u64) {
        let cfg = SchedulerConfig {
            block_tokens: 16,
            max_batch_tokens: 128,
            max_running: 8,
            policy,
            ..Default::default()
        };
        let mut s = Scheduler::new(cfg, 22);
        let root = namespace_root("m", "t");
        let rng = std::cell::Cell::new(seed);
        let next = || {
            let mut r = rng.get();
            r ^= r << 13;
            r ^= r >> 7;
            r ^= r << 17;
            rng.set(r);
            r
        };
        // Poisson arrivals at `rps` a second (ms apart).
        let gap = || -(1.0 - (next() >> 11) as f64 / (1u64 << 53) as f64).ln() / (rps / 1000.0);
        // Request id → (light?, arrival ms, tokens generated).
        let mut live: HashMap<u64, (bool, f64, usize)> = HashMap::new();
        let (mut t, mut sent, mut ttft) = (0.0f64, 0, Vec::new());
        let mut arrival = gap();
        let add = |s: &mut Scheduler, live: &mut HashMap<_, _>, light: bool, at: f64| {
            let prompt = (0..96).map(|_| (next() % 40_000) as u32).collect();
            let tenant = if light { "light" } else { "flooder" };
            let id = s.arrivals;
            s.add_for(id, prompt, root, &qos(tenant, Priority::Interactive));
            live.insert(id, (light, at, 0));
        };
        while ttft.len() < 400 {
            while flood && live.values().filter(|l| !l.0).count() < 8 {
                add(&mut s, &mut live, false, t);
            }
            while arrival <= t && sent < 400 {
                add(&mut s, &mut live, true, arrival);
                sent += 1;
                arrival += gap();
            }
            let items = s.schedule();
            if items.is_empty() {
                t = t.max(arrival);
                continue;
            }
            let decodes = items.iter().filter(|i| i.len == 1 && i.start >= 96).count();
            let prompt = items.iter().map(|i| i.len).sum::<usize>() - decodes;
            t += 4.0 + 0.3 * prompt as f64 + 1.2 * decodes as f64;
            s.complete(&items);
            for it in items.iter().filter(|i| i.sample) {
                let l = live.get_mut(&it.seq).unwrap();
                l.2 += 1;
                if l.2 == 1 && l.0 {
                    ttft.push(t - l.1);
                }
                if l.2 == 16 {
                    s.remove(it.seq);
                    live.remove(&it.seq);
                } else {
                    s.push_token(it.seq, 7);
                }
            }
        }
        ttft.sort_by(f64::total_cmp);
        (ttft[ttft.len() * 9 / 10], s.preemptions)
    }

    /// The seeds of [`light_tenant_beside_a_flooder`]'s runs.
    const LIGHT_SEEDS: [u64; 3] = [0x9E37_79B9_7F4A_7C15, 12_345, 987_654_321];

    #[test]
    fn a_light_tenant_beside_a_flooder_on_a_full_cache_waits_little() {
        let seed = LIGHT_SEEDS[0];
        let (solo, _) = light_tenant_beside_a_flooder(Policy::Fair, false, 2.5, seed);
        let (fair, preemptions) = light_tenant_beside_a_flooder(Policy::Fair, true, 2.5, seed);
        let (fifo, _) = light_tenant_beside_a_flooder(Policy::Fifo, true, 2.5, seed);
        // It waits for the step in progress and shares its own with the flooder's decodes
        // (about 2x here); FIFO queues it behind the flooder's five waiting requests.
        assert!(fair <= 3.0 * solo, "fair: P90 {fair:.0} ms against {solo:.0} ms alone");
        assert!(fifo >= 10.0 * solo, "FIFO: P90 {fifo:.0} ms against {solo:.0} ms alone");
        // About one preemption per light request, not tenants taking turns (thousands).
        assert!(preemptions <= 400, "{preemptions} preemptions");
    }

    /// At 44 % of the engine the light tenant's requests overlap, often three or more at
    /// once: the credit must last the burst, or its later requests wait for the flooder's
    /// to finish (with a credit of two margins, 3.6–5.2× here).
    #[test]
    fn a_light_tenants_burst_beside_a_flooder_still_preempts() {
        for seed in LIGHT_SEEDS {
            let (solo, _) = light_tenant_beside_a_flooder(Policy::Fair, false, 4.0, seed);
            let (fair, preemptions) = light_tenant_beside_a_flooder(Policy::Fair, true, 4.0, seed);
            assert!(
                fair <= 2.5 * solo,
                "seed {seed}: P90 {fair:.0} ms against {solo:.0} ms alone"
            );
            assert!(preemptions <= 400, "seed {seed}: {preemptions} preemptions");
        }
    }

    #[test]
    fn the_starvation_bound_promotes_one_batch_request_at_a_time() {
        let root = namespace_root("m", "t");
        let bound = 20;
        let mut s = bounded(bound);
        let inter = qos("i", Priority::Interactive);
        let batch = qos("b", Priority::Batch);
        // A batch backlog, all of it past the bound at once, sharing a system prompt (a
        // prefix from the cache must not keep a request from being promoted).
        for id in 0..12 {
            s.add_for(id, vec![7, 7, 7, 7, id as u32 + 1, id as u32 + 1], root, &batch);
        }
        let mut next = 100;
        let mut generated: HashMap<u64, usize> = HashMap::new();
        let mut batch_done = 0;
        for _ in 0..600u64 {
            // Interactive work always waits.
            while (s.load().waiting as usize) < 12 + 9 - batch_done {
                s.add_for(next, vec![next as u32; 6], root, &inter);
                next += 1;
            }
            let items = s.schedule();
            let batch_running = items.iter().filter(|i| i.seq < 100).count();
            assert!(
                batch_running <= 1,
                "{batch_running} batch requests ran ahead of interactive work: {items:?}"
            );
            run_step(&mut s, &items, 1);
            for it in items.iter().filter(|i| i.sample) {
                let g = generated.entry(it.seq).or_default();
                *g += 1;
                if *g >= 4 {
                    s.remove(it.seq);
                    batch_done += usize::from(it.seq < 100);
                }
            }
        }
        assert_eq!(batch_done, 12, "every batch request ends, one after another");
    }

    #[test]
    fn an_under_served_tenant_preempts_an_over_served_one_when_the_cache_is_full() {
        let root = namespace_root("m", "t");
        let q = |t: &str| qos(t, Priority::Interactive);
        // 6 blocks of 4 tokens: room for two 10-token requests.
        let mut s = Scheduler::new(cfg(16), 6);
        // The flooder's history: well past the preemption margin (16) and the credit a
        // newcomer starts with (96).
        for id in 100..130 {
            s.add_for(id, (0..10).map(|t| t + id as u32 * 10).collect(), root, &q("flood"));
            let a = s.schedule();
            run_step(&mut s, &a, 7);
            s.remove(id);
        }
        s.add_for(1, (0..10).collect(), root, &q("flood"));
        s.add_for(2, (10..20).collect(), root, &q("flood"));
        let a = s.schedule();
        run_step(&mut s, &a, 7);
        assert_eq!(s.load().running, 2);
        // A newcomer: admitted at once, in place of the flooder's newest.
        s.add_for(3, (20..30).collect(), root, &q("steady"));
        let b = s.schedule();
        assert!(b.iter().any(|i| i.seq == 3), "the newcomer runs: {b:?}");
        assert_eq!(s.get(2).unwrap().preemptions, 1, "the flooder's newest made room");
        assert_eq!(s.get(1).unwrap().preemptions, 0);
        s.blocks.check(&s.owned_blocks()).unwrap();
    }

    #[test]
    fn running_batch_work_is_deferred_for_a_bounded_number_of_steps() {
        let root = namespace_root("m", "t");
        let batch = qos("b", Priority::Batch);
        let inter = qos("i", Priority::Interactive);
        let mut s = Scheduler::new(cfg(8), 256);
        s.add_for(0, vec![1; 4], root, &batch);
        let a = s.schedule();
        run_step(&mut s, &a, 7);
        // Interactive prompts arrive every step, so every step prefills interactive work.
        let mut since_batch = 0;
        let mut worst = 0;
        for n in 1..=60u64 {
            s.add_for(n, vec![n as u32 + 2; 6], root, &inter);
            let items = s.schedule();
            if items.iter().any(|i| i.seq == 0) {
                since_batch = 0;
            } else {
                since_batch += 1;
                worst = worst.max(since_batch);
            }
            run_step(&mut s, &items, 7);
            for it in items.iter().filter(|i| i.sample && i.seq != 0) {
                s.remove(it.seq);
            }
        }
        assert!(worst >= 1, "interactive prompts did defer the batch decode");
        assert!(
            worst <= MAX_DEFERRED_STEPS,
            "the batch decode waited {worst} steps in a row"
        );
    }

    #[test]
    fn an_interactive_request_cuts_a_prompt_step_of_work_it_outranks_and_nothing_else() {
        let root = namespace_root("m", "t");
        let inter = |t: &str| qos(t, Priority::Interactive);
        // A batch tenant's long prompts: an interactive arrival cuts the step.
        let mut b = Scheduler::new(cfg(16), 64);
        for id in 1..=3 {
            b.add_for(
                id,
                (0..40).map(|t| t + 100 * id as u32).collect(),
                root,
                &qos("b", Priority::Batch),
            );
        }
        let step = b.schedule();
        assert!(b.interrupts(&inter("i"), &step));
        // Not a batch arrival, and not under FIFO.
        assert!(!b.interrupts(&qos("b2", Priority::Batch), &step));
        let mut fifo = Scheduler::new(
            SchedulerConfig {
                policy: Policy::Fifo,
                ..cfg(16)
            },
            64,
        );
        fifo.add_for(1, (0..40).collect(), root, &qos("b", Priority::Batch));
        let f = fifo.schedule();
        assert!(!fifo.interrupts(&inter("i"), &f));
        // Interactive prompt work of a tenant no further ahead than the margin (16): no cut.
        let mut s = Scheduler::new(cfg(16), 64);
        s.add_for(1, (0..40).collect(), root, &inter("flood"));
        s.add_for(2, (100..140).collect(), root, &inter("steady"));
        for _ in 0..6 {
            let step = s.schedule();
            run_step(&mut s, &step, 7);
        }
        s.add_for(3, (50..90).collect(), root, &inter("flood"));
        let step = s.schedule();
        assert!(step.iter().any(|i| i.seq == 3 && i.len > 1), "{step:?}");
        let [flood, steady] = ["flood", "steady"].map(|t| s.account(t).unwrap().counter);
        assert!((flood - steady).abs() <= 16.0, "{flood} {steady}");
        assert!(!s.interrupts(&inter("steady"), &step), "steady is active and level");
        // A tenant new here (at zero: the credit would lift it no higher) is more than a
        // margin behind the flooder: it cuts.
        assert!(s.interrupts(&inter("light"), &step));
        assert!(!s.interrupts(&inter("flood"), &step), "not the flooder's own requests");
        // A step of decodes alone (even carrying draft tokens) is short: nothing to cut.
        let mut d = Scheduler::new(cfg(32), 64);
        d.add_for(1, (0..4).collect(), root, &qos("b", Priority::Batch));
        let first = d.schedule();
        run_step(&mut d, &first, 7);
        d.set_draft(1, (0..20).collect());
        let decode = d.schedule();
        assert!(decode[0].draft > 0, "{decode:?}");
        assert!(!d.interrupts(&inter("i"), &decode));
    }

    #[test]
    fn the_queue_state_counts_uncomputed_prompt_tokens_per_tenant() {
        let root = namespace_root("m", "t");
        let mut s = Scheduler::new(cfg(4), 64);
        let q = |t: &str| qos(t, Priority::Interactive);
        s.add_for(1, vec![1; 10], root, &q("a"));
        s.add_for(2, vec![2; 6], root, &q("b"));
        let st = s.queue_state("a", 100);
        assert_eq!((st.queued, st.tenant_queued, st.tenants), (16, 10, 2));
        let items = s.schedule(); // 4 of a's tokens
        run_step(&mut s, &items, 3);
        assert_eq!(s.queue_state("a", 100).queued, 12);
        assert_eq!(s.queue_state("c", 100).tenants, 3);
        assert_eq!(s.load().inflight_prefill_tokens, 12);
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
            // Each item is a running sequence's, once.
            let mut seen = std::collections::HashSet::new();
            for it in &items {
                prop_assert!(self.s.running.contains(&it.seq), "{it:?} is not running");
                prop_assert!(seen.insert(it.seq), "{it:?} planned twice");
            }
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
                        // Three tenants, one in five requests batch: fair admission,
                        // preemption and deferral all get exercised.
                        let qos = Qos {
                            tenant: ["", "a", "b"][len % 3].into(),
                            priority: if len % 5 == 0 { Priority::Batch } else { Priority::Interactive },
                            share: 1 + (len % 2) as u32,
                        };
                        let len = len.min(blocks * 4 - 8).max(1);
                        w.s.add_for(w.next, (0..len as u32).map(|t| t % 5).collect(), root, &qos);
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

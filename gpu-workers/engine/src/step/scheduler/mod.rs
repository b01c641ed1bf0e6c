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

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;

use hearth_protocol::{chain, BlockHash, LoadReport, Priority, Qos};

use crate::kv::block::{BlockKey, Spill};
use crate::kv::pool::BlockManager;

mod admit;
mod fair;
mod plan;
#[cfg(test)]
mod tests;

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
    /// Sequences a pipeline lane's plan leaves out, and those it never preempts (see
    /// [`Scheduler::schedule_lane`]); empty otherwise.
    skip: HashSet<u64>,
    pinned: HashSet<u64>,
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
            skip: HashSet::new(),
            pinned: HashSet::new(),
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

    /// Plans a step for one lane of a pipeline's leader ([`Scheduler::schedule`]) with
    /// `skip` left out (not planned: another lane's decodes, sequences in flight) and
    /// `pinned` never preempted (sequences a step in flight computes). `running` keeps its
    /// order. A plan with nothing in it does not count as a step.
    pub fn schedule_lane(&mut self, skip: HashSet<u64>, pinned: HashSet<u64>) -> Vec<StepItem> {
        self.skip = skip;
        self.pinned = pinned;
        let items = self.schedule();
        if items.is_empty() {
            self.steps -= 1;
        }
        self.skip.clear();
        self.pinned.clear();
        items
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

//! The scheduler's fairness accounts (the virtual token counters of the module's doc): a
//! tenant's counter on arrival and return, its rank among the others, the preemption
//! margin, and the starvation bound's aging of batch work.

use hearth_protocol::{Priority, Qos, QueueState};

use crate::step::scheduler::{class, Account, AccountView, Scheduler, Sequence, Served, RETURN_CREDIT};

impl Scheduler {
    pub(super) fn account_for(&mut self, qos: &Qos) -> usize {
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
    pub(super) fn arrival_counter(&self, qos: &Qos) -> f64 {
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
    pub(super) fn floor(&self) -> Option<f64> {
        let f = (self.accounts.iter())
            .filter(|a| a.seqs > 0)
            .map(|a| a.counter)
            .fold(f64::INFINITY, f64::min);
        f.is_finite().then(|| self.floor_seen.map_or(f, |seen| seen.max(f)))
    }

    fn return_credit(&self) -> f64 {
        RETURN_CREDIT * self.preemption_margin()
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

    /// Fair order: class first, then the tenant's counter (as one sortable number).
    pub(super) fn rank(&self, id: u64) -> f64 {
        let s = &self.seqs[&id];
        let c = if self.aged(id) { 0 } else { class(s.priority) };
        // Counters are far below 1e15 (a trillion weighted tokens per unit of share).
        c as f64 * 1e15 + self.accounts[s.account].counter
    }

    /// How far ahead (in counter units) a tenant must be for fairness to preempt its work
    /// (or to have its step cut): one step's budget of prompt tokens. Without it, two
    /// tenants on a full cache take turns preempting each other, each time the one just
    /// admitted is charged past the other, and the work each preemption throws away is
    /// charged to no one.
    pub(super) fn preemption_margin(&self) -> f64 {
        self.cfg.max_batch_tokens as f64 * self.cfg.weights.prefill
    }

    /// Whether `id` is waiting batch work past its wait bound (a waiting sequence holds no
    /// blocks; a running one always holds some) while no other promoted sequence is alive:
    /// the bound promotes one batch sequence at a time, so the batch class is guaranteed
    /// progress without taking the worker from interactive work.
    pub(super) fn aged(&self, id: u64) -> bool {
        self.seqs
            .get(&id)
            .is_some_and(|s| s.table.is_empty() && self.past_bound(s))
    }

    /// Whether `s` is batch work that has waited past the bound while no promoted sequence is
    /// alive (waiting or not: see [`Scheduler::aged`]).
    pub(super) fn past_bound(&self, s: &Sequence) -> bool {
        self.promoted == 0 && s.priority == Priority::Batch && self.steps - s.waiting_since >= self.cfg.starvation_steps
    }
}

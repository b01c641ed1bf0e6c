//! A pipeline leader's steps in flight: its running sequences fall into lanes (as many as
//! the group has stages), and while one lane's step is computed by the stages after the
//! leader, the leader plans and computes the next lane's. A sequence is in at most one step
//! in flight: the scheduler plans each lane without the other lanes' decodes and the
//! sequences in flight, and never preempts the latter ([`Scheduler::schedule_lane`]); a
//! step's tokens are sampled when its logits arrive, oldest first.
//!
//! [`Scheduler::schedule_lane`]: crate::step::scheduler::Scheduler::schedule_lane

use std::collections::HashSet;
use std::panic::AssertUnwindSafe;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::engine::command::Command;
use crate::engine::metrics::Phase;
use crate::engine::runner::step::{tables, StepRows};
use crate::engine::runner::Runner;
use crate::models::Batch;
use crate::pipeline::link::Ticket;
use crate::step::scheduler::StepItem;

/// A step launched and not yet sampled.
pub(in crate::engine) struct InFlight {
    items: Vec<StepItem>,
    drafts: Vec<Vec<u32>>,
    rows: usize,
    /// The leader's own compute for the step (its layers, sending them on).
    launch: Duration,
    ticket: Ticket,
}

impl Runner {
    /// The sequences of the steps in flight.
    pub(super) fn in_flight(&self) -> HashSet<u64> {
        self.lanes.iter().flat_map(|f| f.items.iter().map(|i| i.seq)).collect()
    }

    /// One round of a pipeline's leader: launch a step for each lane that has work, while
    /// fewer than `depth` are in flight; then sample the oldest.
    pub(super) fn pipelined_step(&mut self, rx: &mpsc::Receiver<Command>) {
        let depth = self.compute.depth();
        for _ in 0..depth {
            if self.lanes.len() >= depth {
                break;
            }
            let lane = self.next_lane;
            self.next_lane = (lane + 1) % depth;
            self.launch(lane, depth);
            // Requests that arrived meanwhile join the next lane's plan.
            while let Ok(cmd) = rx.try_recv() {
                self.command(cmd);
            }
        }
        match self.lanes.pop_front() {
            Some(f) => self.land(f),
            // Nothing could run (every waiting request larger than the free cache): never spin.
            None => std::thread::sleep(Duration::from_millis(1)),
        }
    }

    /// Plans and launches `lane`'s step without the decoding sequences of other lanes, the
    /// sequences in flight and those of cancelled requests (reaped once nothing of theirs
    /// is in flight); waiting and prefilling work joins whichever lane is planned.
    fn launch(&mut self, lane: usize, depth: usize) {
        let planned = Instant::now();
        let busy = self.in_flight();
        let skip: HashSet<u64> = self
            .owner
            .iter()
            .filter(|(id, (key, _))| {
                busy.contains(id)
                    || self.requests.get(key).is_none_or(|r| r.tx.is_closed())
                    || (**id % depth as u64 != lane as u64
                        && self.sched.get(**id).is_some_and(|s| s.computed + 1 == s.tokens.len()))
            })
            .map(|(id, _)| *id)
            .collect();
        self.propose_drafts(&skip);
        let items = self.sched.schedule_lane(skip, busy);
        self.spill_evicted();
        for (from, to) in std::mem::take(&mut self.sched.pending_copies) {
            self.compute.copy_block(from, to);
        }
        if items.is_empty() {
            self.metrics.spend(Phase::Plan, planned.elapsed());
            return;
        }
        self.mark_scheduled(&items);
        let StepRows {
            tokens,
            positions,
            row_seq,
            logit_rows,
            drafts,
        } = self.rows(&items);
        let tables = tables(&self.sched, &row_seq);
        let batch = Batch {
            tokens: &tokens,
            positions: &positions,
            tables: &tables,
            logit_rows: &logit_rows,
            adapters: &[],
        };
        let started = Instant::now();
        self.metrics.spend(Phase::Plan, started - planned);
        let (model, compute) = (&self.model, &mut self.compute);
        let launched = std::panic::catch_unwind(AssertUnwindSafe(|| compute.launch(model, &batch)))
            .unwrap_or_else(|_| Err("the leader panicked computing a step".into()));
        let launch = started.elapsed();
        self.metrics.spend(Phase::Forward, launch);
        drop(tables);
        match launched {
            Ok(ticket) => self.lanes.push_back(InFlight {
                items,
                drafts,
                rows: tokens.len(),
                launch,
                ticket,
            }),
            Err(e) => self.fail_pipelined(&items, &e),
        }
    }

    /// A pipelined step failed: part of it may be on its way through the stages, so the
    /// group is given up (set up afresh when it reconnects) and every request fails.
    fn fail_pipelined(&mut self, items: &[StepItem], why: &str) {
        tracing::error!(error = why, "a pipeline step failed; failing that step's requests");
        self.compute.lose(why);
        self.fail_step(items);
        self.upkeep();
    }

    /// Waits for the oldest step's logits and samples them.
    fn land(&mut self, f: InFlight) {
        let waited = Instant::now();
        let vocab = self.model.config.vocab_size;
        let compute = &mut self.compute;
        let logits = std::panic::catch_unwind(AssertUnwindSafe(|| compute.finish(&f.ticket, vocab)))
            .unwrap_or_else(|_| Err("the leader panicked taking a step's logits".into()));
        let wait = waited.elapsed();
        self.metrics.spend(Phase::Forward, wait);
        match logits {
            Ok(logits) => {
                self.steps += 1;
                let kind = self.step_kind(&f.items);
                // The step's time: the leader's part and the wait for the rest (not the
                // time other lanes' steps took in between).
                self.metrics.record_step(kind, f.rows, f.launch + wait);
                self.sample_step(&f.items, &f.drafts, &logits);
            }
            Err(e) => self.fail_pipelined(&f.items, &e),
        }
    }
}

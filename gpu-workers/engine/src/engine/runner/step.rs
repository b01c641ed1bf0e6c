//! The runner's step: drafts proposed for speculative decoding, then one batched forward
//! pass over what the scheduler planned (cut short between layers when an arriving request
//! outranks its prompt work).

use std::collections::HashSet;
use std::panic::AssertUnwindSafe;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::engine::command::Command;
use crate::engine::metrics::{EngineMetrics, Phase, StepKind};
use crate::engine::runner::{error, Runner};
use crate::models::{Batch, LoraAdapter};
use crate::step::scheduler::{Scheduler, StepItem};
use crate::step::speculative::Drafter;

impl Runner {
    /// Proposes draft tokens for every decoding sequence that speculates (prompt lookup
    /// over its own tokens, no longer than what it may still generate), but those in `skip`
    /// (a pipeline's sequences not planned now).
    pub(super) fn propose_drafts(&mut self, skip: &HashSet<u64>) {
        if self.speculative_tokens == 0 {
            return;
        }
        let mut drafts = Vec::new();
        for r in self.requests.values_mut() {
            let room = r.max_tokens.saturating_sub(r.choices[0].generated + 1);
            let ch = &mut r.choices[0];
            let (Some(id), false) = (ch.seq, ch.spec.is_off()) else {
                continue;
            };
            let Some(seq) = self.sched.get(id) else { continue };
            if seq.computed + 1 != seq.tokens.len() || skip.contains(&id) {
                continue; // waiting or prefilling
            }
            let k = ch.spec.draft_len().min(room);
            let draft = match ch.grammar.as_mut() {
                None => self.drafter.draft(&seq.tokens, k),
                Some(g) => {
                    // What the grammar forces is certain (a JSON key, its `": "`); the
                    // context's guess follows, cut where the grammar would refuse it.
                    let started = Instant::now();
                    // (Forced tokens are drafted even while the lookup is paused.)
                    let mut draft = g.forced(self.speculative_tokens.min(room));
                    let more = k.saturating_sub(draft.len());
                    if more > 0 {
                        let mut ctx = seq.tokens.clone();
                        ctx.extend_from_slice(&draft);
                        draft.extend(self.drafter.draft(&ctx, more));
                    }
                    let n = g.valid_prefix(&draft);
                    draft.truncate(n);
                    self.metrics
                        .grammar_mask_seconds
                        .inc_by(started.elapsed().as_secs_f64());
                    draft
                }
            };
            if !draft.is_empty() {
                drafts.push((id, draft));
            }
        }
        for (id, draft) in drafts {
            self.sched.set_draft(id, draft);
        }
    }

    /// Plans and runs one step. Commands that arrive while it runs are taken between layers
    /// and carried out after it; one that brings an interactive request while the step
    /// computes prompt tokens of work it outranks — batch work, or a tenant it would preempt
    /// ([`Scheduler::interrupts`](crate::step::scheduler::Scheduler::interrupts)) — cuts the step short, at most
    /// [`crate::step::scheduler::MAX_CUTS_IN_A_ROW`] steps in a row so that running work always
    /// progresses.
    pub(super) fn step(&mut self, rx: &mpsc::Receiver<Command>) {
        let planned = Instant::now();
        self.propose_drafts(&HashSet::new());
        let items = self.sched.schedule();
        // Evicted blocks go to the tier below before this step (or a fork's copy) overwrites them.
        self.spill_evicted();
        for (from, to) in std::mem::take(&mut self.sched.pending_copies) {
            self.compute.copy_block(from, to);
        }
        if items.is_empty() {
            // Only possible when every waiting request is larger than the free cache while
            // nothing runs; validation prevents it, but never spin.
            self.metrics.spend(Phase::Plan, planned.elapsed());
            std::thread::sleep(Duration::from_millis(1));
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
        // Each row's adapter (none at all when no request of the step has one).
        let adapter_of = |s: &u64| {
            let key = self.owner.get(s)?.0;
            self.requests.get(&key)?.adapter.as_deref()
        };
        let adapters: Vec<Option<&LoraAdapter>> = if row_seq.iter().any(|s| adapter_of(s).is_some()) {
            row_seq.iter().map(adapter_of).collect()
        } else {
            Vec::new()
        };
        let batch = Batch {
            tokens: &tokens,
            positions: &positions,
            tables: &tables,
            logit_rows: &logit_rows,
            adapters: &adapters,
        };
        let (model, compute, sched) = (&self.model, &mut self.compute, &self.sched);
        let may_cut = self.cuts_in_a_row < crate::step::scheduler::MAX_CUTS_IN_A_ROW;
        let mut arrived = Vec::new();
        let mut stop = |_layer: usize| {
            while let Ok(cmd) = rx.try_recv() {
                let cut = may_cut && matches!(&cmd, Command::Generate(job) if sched.interrupts(&job.req.qos, &items));
                arrived.push(cmd);
                if cut {
                    return true;
                }
            }
            false
        };
        let started = Instant::now();
        self.metrics.spend(Phase::Plan, started - planned);
        let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| compute.forward(model, &batch, &mut stop)));
        let took = started.elapsed();
        self.metrics.spend(Phase::Forward, took);
        drop((tables, adapters));
        let logits = match outcome {
            Ok(Ok(Some(l))) => l,
            Ok(Ok(None)) => {
                // Cut short: nothing of it counts; the new request is admitted and the next
                // step planned with it.
                self.cuts_in_a_row += 1;
                self.metrics.steps_cut.inc();
                for cmd in arrived {
                    self.command(cmd);
                }
                return;
            }
            failed => {
                match failed {
                    Ok(Err(e)) => tracing::error!(error = %e, "a forward step failed; failing that step's requests"),
                    _ => tracing::error!("engine panicked in a forward step; failing that step's requests"),
                }
                self.fail_step(&items);
                // A pipeline that lost a stage fails every other request too.
                self.upkeep();
                for cmd in arrived {
                    self.command(cmd);
                }
                return;
            }
        };
        self.steps += 1;
        self.cuts_in_a_row = 0;
        let kind = self.step_kind(&items);
        self.metrics.record_step(kind, tokens.len(), took);
        self.sample_step(&items, &drafts, &logits);
        for cmd in arrived {
            self.command(cmd);
        }
    }
}

/// Each row's block table (empty for a sequence gone meanwhile).
pub(super) fn tables<'s>(sched: &'s Scheduler, row_seq: &[u64]) -> Vec<&'s [u32]> {
    row_seq
        .iter()
        .map(|s| sched.get(*s).map_or(&[][..], |q| &q.table[..]))
        .collect()
}

/// A step's rows, from its items (see [`Runner::rows`]).
pub(super) struct StepRows {
    pub tokens: Vec<u32>,
    pub positions: Vec<usize>,
    /// Each row's sequence.
    pub row_seq: Vec<u64>,
    pub logit_rows: Vec<usize>,
    /// The draft tokens each item verifies (positions past the sequence's tokens).
    pub drafts: Vec<Vec<u32>>,
}

impl Runner {
    /// The rows a step's items compute: each item's positions, then (verifying drafts)
    /// one row per draft token; the rows whose logits are sampled.
    pub(super) fn rows(&self, items: &[StepItem]) -> StepRows {
        let mut r = StepRows {
            tokens: Vec::new(),
            positions: Vec::new(),
            row_seq: Vec::new(),
            logit_rows: Vec::new(),
            drafts: Vec::with_capacity(items.len()),
        };
        for it in items {
            let Some(seq) = self.sched.get(it.seq) else {
                r.drafts.push(Vec::new());
                continue;
            };
            let draft = seq.draft[..it.draft.min(seq.draft.len())].to_vec();
            for p in it.start..it.start + it.len {
                let t = match seq.tokens.get(p) {
                    Some(&t) => t,
                    None => draft.get(p - seq.tokens.len()).copied().unwrap_or(0),
                };
                r.tokens.push(t);
                r.positions.push(p);
                r.row_seq.push(it.seq);
            }
            if it.sample {
                // The last real token's row, then one per draft token.
                r.logit_rows.extend(r.tokens.len() - 1 - it.draft..r.tokens.len());
            }
            r.drafts.push(draft);
        }
        r
    }

    /// The first step that computes any of a request ends its queue time.
    pub(super) fn mark_scheduled(&mut self, items: &[StepItem]) {
        let now = Instant::now();
        for it in items {
            if let Some(r) = self.owner.get(&it.seq).and_then(|o| self.requests.get_mut(&o.0)) {
                if r.scheduled.is_none() {
                    r.scheduled = Some(now);
                    EngineMetrics::observe(&self.metrics.queue, now - r.started);
                }
            }
        }
    }

    /// A step failed: its requests end with an error (`stage_lost` when a pipeline's
    /// group was lost: the gateway fails those over).
    pub(super) fn fail_step(&mut self, items: &[StepItem]) {
        let code = match self.compute.failed() {
            true => "stage_lost",
            false => "engine_error",
        };
        let keys: Vec<u64> = items
            .iter()
            .filter_map(|it| self.owner.get(&it.seq).map(|o| o.0))
            .collect();
        for key in keys {
            if let Some(r) = self.requests.get(&key) {
                let _ = r.tx.send(error(code, "the engine failed on this request".into()));
            }
            self.drop_request(key);
        }
    }

    /// A computed step's logits: the items' sequences advance, and each sampling item's
    /// rows are sampled (its drafts verified).
    pub(super) fn sample_step(&mut self, items: &[StepItem], drafts: &[Vec<u32>], logits: &[f32]) {
        let sampling = Instant::now();
        self.sched.complete(items);
        let vocab = self.model.config.vocab_size;
        let mut rows = logits.chunks_exact(vocab);
        for (it, draft) in items.iter().zip(drafts).filter(|(i, _)| i.sample) {
            let group: Vec<&[f32]> = rows.by_ref().take(1 + it.draft).collect();
            self.on_logits(it, &group, draft);
        }
        self.metrics.spend(Phase::Sample, sampling.elapsed());
    }

    /// Whether a step computes prompt tokens (else it decodes).
    pub(super) fn step_kind(&self, items: &[StepItem]) -> StepKind {
        let computes_prompt =
            |i: &StepItem| i.len > 1 + i.draft || self.sched.get(i.seq).is_some_and(|s| i.start < s.prompt_len());
        match items.iter().any(computes_prompt) {
            true => StepKind::Prompt,
            false => StepKind::Decode,
        }
    }
}

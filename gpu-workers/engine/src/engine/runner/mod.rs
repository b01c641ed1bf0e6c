//! The engine thread ([`Runner`]): it owns the model, the KV cache, the scheduler and
//! every running request, and loops: take commands, plan a step, run it, sample and send
//! tokens, publish what changed. Its jobs are in the files beside this one: [`admit`]
//! (requests in), [`step`] (drafts and the forward step), [`emit`] (tokens out, events
//! and stats), [`blocks`] (KV blocks held, imported, spilled to and read from disk).

mod admit;
mod blocks;
mod emit;
pub(super) mod lanes;
mod step;

use std::collections::{HashMap, VecDeque};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use hearth_protocol::{FinishReason, GenerateEvent, KvEvent, LoadReport, SamplingParams, Tokenizer};
use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::{broadcast, watch};

use crate::engine::adapters::AdapterCache;
use crate::engine::command::{Command, EngineStats, Job};
use crate::engine::compute::Compute;
use crate::engine::metrics::{EngineMetrics, Phase};
use crate::kv::block::ImportReport;
use crate::kv::tier::DiskTier;
use crate::models::{LoraAdapter, Model};
use crate::step::grammar::{Grammar, Grammars};
use crate::step::sampling::Sampler;
use crate::step::scheduler::Scheduler;
use crate::step::speculative::{PromptLookup, Speculation};
use crate::step::text::TextStream;

fn error(code: &str, message: String) -> GenerateEvent {
    GenerateEvent::Error {
        code: code.into(),
        message,
    }
}

struct Choice {
    seq: Option<u64>,
    sampler: Sampler,
    text: TextStream,
    generated: usize,
    finish: Option<FinishReason>,
    /// Constrained decoding: the choice's own grammar state.
    grammar: Option<Grammar>,
    /// Speculative decoding's draft length for this choice (off: 0).
    spec: Speculation,
}

pub(super) struct Request {
    request_id: String,
    tx: UnboundedSender<GenerateEvent>,
    params: SamplingParams,
    max_tokens: usize,
    prompt_len: usize,
    cached_tokens: usize,
    n: u32,
    forked: bool,
    /// Ends after the first token with `Handoff` (disaggregated prefill).
    prefill_only: bool,
    /// The LoRA adapter every token runs under.
    adapter: Option<Arc<LoraAdapter>>,
    choices: Vec<Choice>,
    started: Instant,
    /// The first step that computed any of it (queue time ends here).
    scheduled: Option<Instant>,
    first_token: Option<Instant>,
}

/// The text a generated token adds to the output: none for control tokens, unless the
/// request asks for theirs (`special_text`: tool-call delimiters, reasoning markers).
fn shown_bytes<'t>(tokenizer: &'t Tokenizer, tok: u32, special_text: &[u32]) -> &'t [u8] {
    if tokenizer.is_special(tok) && !special_text.contains(&tok) {
        &[]
    } else {
        tokenizer.token_bytes(tok).unwrap_or(&[])
    }
}

/// What the engine thread owns.
pub(super) struct Runner {
    pub(super) model: Model,
    /// The context served (the model's, or less by configuration).
    pub(super) context: usize,
    pub(super) tokenizer: Arc<Tokenizer>,
    /// Compiles constrained requests' grammars (tables built on first use).
    pub(super) grammars: Grammars,
    /// Proposes speculative decoding's draft tokens.
    pub(super) drafter: PromptLookup,
    /// The most draft tokens per sequence and step (0: no speculation).
    pub(super) speculative_tokens: usize,
    pub(super) model_id: String,
    pub(super) end_of_generation: Vec<u32>,
    pub(super) compute: Compute,
    pub(super) sched: Scheduler,
    /// By request key (the id of its first sequence).
    pub(super) requests: HashMap<u64, Request>,
    /// Sequence → (request key, choice index).
    pub(super) owner: HashMap<u64, (u64, usize)>,
    pub(super) next_id: u64,
    pub(super) kv_tx: broadcast::Sender<KvEvent>,
    pub(super) stats_tx: watch::Sender<EngineStats>,
    pub(super) metrics: Arc<EngineMetrics>,
    pub(super) steps: u64,
    /// Steps cut short in a row (see [`Runner::step`]).
    pub(super) cuts_in_a_row: u32,
    pub(super) last_load: (LoadReport, Instant),
    /// Adapter loads and adapters loaded when [`KvEvent::Adapters`] was last sent.
    pub(super) last_adapters: (u64, usize),
    /// Blocks held for decode workers, by the prefill request's id, until released or
    /// [`HOLD_TTL`](crate::engine::config::HOLD_TTL) passes.
    pub(super) holds: HashMap<String, (Vec<u32>, Instant)>,
    /// The queue limit (0: unbounded), as reported in [`WorkerInfo::queue_tokens`](hearth_protocol::WorkerInfo::queue_tokens).
    pub(super) queue_tokens: u64,
    /// The KV tier below the pool.
    pub(super) tier: Option<Arc<DiskTier>>,
    /// LoRA adapters, loaded on demand.
    pub(super) adapters: AdapterCache,
    /// Requests whose adapter waits for room in the adapter cache, in arrival order.
    pub(super) adapter_waiting: VecDeque<Job>,
    /// A request holding an adapter ended since the waiting requests were last tried.
    pub(super) adapter_released: bool,
    /// The waiting requests are being tried (admission order is theirs, not a newcomer's).
    pub(super) adapter_retrying: bool,
    /// A pipeline leader's steps in flight, oldest first (see [`lanes`]).
    pub(super) lanes: VecDeque<lanes::InFlight>,
    /// The lane a pipeline leader plans next.
    pub(super) next_lane: usize,
}

impl Runner {
    pub(super) fn run(&mut self, rx: mpsc::Receiver<Command>) {
        loop {
            // Idle, unless a released adapter lets waiting requests in.
            if self.sched.is_idle() && !self.adapter_released {
                // Holds expire even while nothing runs.
                let cmd = if self.holds.is_empty() && !self.compute.needs_upkeep() {
                    rx.recv().map_err(|_| mpsc::RecvTimeoutError::Disconnected)
                } else {
                    rx.recv_timeout(Duration::from_secs(1))
                };
                match cmd {
                    Ok(cmd) => self.command(cmd),
                    Err(mpsc::RecvTimeoutError::Timeout) => {}
                    Err(mpsc::RecvTimeoutError::Disconnected) => return, // every handle dropped
                }
            }
            let t = Instant::now();
            self.upkeep();
            self.expire_holds();
            self.admit_adapter_waiting();
            self.metrics.spend(Phase::Commands, t.elapsed());
            while let Ok(cmd) = rx.try_recv() {
                self.command(cmd);
            }
            let t = Instant::now();
            self.reap_cancelled();
            self.metrics.spend(Phase::Commands, t.elapsed());
            if self.sched.is_idle() {
                self.publish();
                continue;
            }
            match self.compute.depth() {
                1 => self.step(&rx),
                _ => self.pipelined_step(&rx),
            }
            self.publish();
        }
    }

    /// A pipeline's group lost: every request ends with `stage_lost` (the gateway fails
    /// it over where it can) and the prefix cache is forgotten, since the other stages'
    /// KV is gone.
    pub(super) fn upkeep(&mut self) {
        if !self.compute.upkeep() {
            return;
        }
        // The steps in flight are lost with the group.
        self.lanes.clear();
        let keys: Vec<u64> = self.requests.keys().copied().collect();
        for key in keys {
            if let Some(r) = self.requests.get(&key) {
                let _ = r.tx.send(error(
                    "stage_lost",
                    "a pipeline stage of this worker was lost; the request cannot continue here".into(),
                ));
            }
            self.drop_request(key);
        }
        self.sched.blocks.forget_cached();
        self.announce();
    }

    /// [`Self::apply`], timed as the commands phase.
    fn command(&mut self, cmd: Command) {
        let t = Instant::now();
        self.apply(cmd);
        self.metrics.spend(Phase::Commands, t.elapsed());
    }

    fn apply(&mut self, cmd: Command) {
        match cmd {
            Command::Generate(job) => self.admit(*job),
            Command::Subscribe(reply) => {
                // Subscribe before the snapshot: the disk tier's threads publish too, and an
                // event in between is then replayed (harmless) rather than lost.
                let events = self.kv_tx.subscribe();
                let snap = KvEvent::Snapshot {
                    block_tokens: self.sched.config().block_tokens as u32,
                    blocks: self.sched.blocks.cached_hashes(),
                    load: self.sched.load(),
                    disk: self.tier.as_ref().map_or_else(Vec::new, |t| t.hashes()),
                    adapters: self.adapters.digests(),
                };
                let _ = reply.send((snap, events));
            }
            Command::ExportBlocks(hashes, reply) => {
                // Copies only: checksums are taken off the engine thread.
                let blocks = hashes
                    .into_iter()
                    .map(|h| self.compute.read_block(self.sched.blocks.peek(h)?))
                    .collect();
                let _ = reply.send(blocks);
            }
            Command::MissingBlocks(hashes, reply) => {
                let missing = hashes.into_iter().filter(|h| !self.sched.blocks.contains(*h)).collect();
                let _ = reply.send(missing);
            }
            Command::ImportBlocks(blocks, after, reply) => {
                let report = match after {
                    Some(h) if !self.sched.blocks.contains(h) => ImportReport {
                        rejected: blocks
                            .into_iter()
                            .map(|(b, ..)| (b.hash, "follows a block that is not held".to_string()))
                            .collect(),
                        ..Default::default()
                    },
                    _ => self.import(blocks),
                };
                let _ = reply.send(report);
                // Announce the new cached blocks now, not at the next step (timed as part
                // of this command).
                self.announce();
            }
            Command::DiskRead(job, blocks) => {
                let report = self.import(blocks);
                if !report.rejected.is_empty() {
                    tracing::debug!(request_id = %job.req.request_id, rejected = ?report.rejected, "disk tier read-back cut short; the rest is recomputed");
                }
                self.admit(*job);
            }
            Command::ReleaseHold(id) => {
                if let Some((blocks, _)) = self.holds.remove(&id) {
                    self.release_blocks(blocks);
                }
            }
        }
    }
}

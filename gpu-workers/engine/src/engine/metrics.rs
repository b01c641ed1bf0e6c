//! What the engine thread records as it runs: per-request timings, KV transfers received,
//! speculative and constrained decoding, step times and where the thread's time goes
//! ([`EngineMetrics`]). The worker's Prometheus collector ([`crate::worker::metrics`]) names
//! and exposes them; nothing here knows Prometheus' text format.

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::histogram::Histogram;

use hearth_protocol::Priority;

const QUEUE_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0,
];

const TRANSFER_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// Per-request timings the engine thread observes, and the KV transfers this engine
/// received (disaggregated decode).
pub struct EngineMetrics {
    pub queue: Histogram,
    pub prefill: Histogram,
    pub decode: Histogram,
    /// Whole pulls (asking what is missing, fetching, importing).
    pub transfer: Histogram,
    pub transfer_bytes: Counter,
    pub transfer_blocks: Counter,
    /// Pulls that failed or were cut (the request computed what did not arrive).
    pub transfer_failures: Counter,
    /// Requests refused because the queue was full, by priority class.
    pub shed: [Counter; 2],
    /// Speculative decoding: draft tokens proposed and verified, and those accepted.
    pub spec_drafted: Counter,
    pub spec_accepted: Counter,
    /// Constrained decoding: token masks computed, and the seconds they took.
    pub grammar_masks: Counter,
    pub grammar_mask_seconds: Counter<f64, std::sync::atomic::AtomicU64>,
    /// Steps cut short between layers for an arriving request (see `Scheduler::interrupts`).
    pub steps_cut: Counter,
    /// Forward steps that ran to the end, by [`StepKind`].
    pub step_seconds: [Histogram; 2],
    /// The rows those steps computed, by [`StepKind`]: tokens, draft tokens included.
    pub step_rows: [Counter; 2],
    /// The engine thread's busy time, by [`Phase`].
    pub thread_seconds: [Counter<f64, std::sync::atomic::AtomicU64>; 5],
    /// Rows routed to each expert of each mixture-of-experts layer.
    pub expert_load: crate::models::moe::ExpertLoad,
    /// The disk tier below the pool (zero without one).
    pub kv_disk: Arc<crate::kv::tier::TierMetrics>,
}

impl Default for EngineMetrics {
    fn default() -> Self {
        let h = || Histogram::new(QUEUE_BUCKETS.iter().copied());
        Self {
            queue: h(),
            prefill: h(),
            decode: h(),
            transfer: Histogram::new(TRANSFER_BUCKETS.iter().copied()),
            transfer_bytes: Counter::default(),
            transfer_blocks: Counter::default(),
            transfer_failures: Counter::default(),
            expert_load: Default::default(),
            shed: Default::default(),
            spec_drafted: Counter::default(),
            spec_accepted: Counter::default(),
            grammar_masks: Counter::default(),
            grammar_mask_seconds: Counter::default(),
            steps_cut: Counter::default(),
            step_seconds: std::array::from_fn(|_| Histogram::new(STEP_BUCKETS.iter().copied())),
            step_rows: Default::default(),
            thread_seconds: Default::default(),
            kv_disk: Arc::default(),
        }
    }
}

const STEP_BUCKETS: &[f64] = &[
    0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.012, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0,
];

/// A forward step's kind: only decode rows (one token per sequence, with its draft tokens),
/// or prompt tokens too (a prefill chunk, a prompt's last token recomputed after a cache hit
/// or a KV import, or a preempted sequence's recomputation; with or without decodes beside
/// it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepKind {
    Decode = 0,
    Prompt = 1,
}

impl StepKind {
    pub const ALL: [StepKind; 2] = [StepKind::Decode, StepKind::Prompt];

    pub fn as_str(self) -> &'static str {
        match self {
            StepKind::Decode => "decode",
            StepKind::Prompt => "prompt",
        }
    }
}

/// Where the engine thread's time goes: planning a step (drafts, the schedule, block copies,
/// the batch), the forward pass (steps cut short included), sampling and sending tokens,
/// commands (admissions, KV imports and exports, expired holds, cancelled requests), and
/// publishing cache events and load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Plan = 0,
    Forward = 1,
    Sample = 2,
    Commands = 3,
    Publish = 4,
}

impl Phase {
    pub const ALL: [Phase; 5] = [
        Phase::Plan,
        Phase::Forward,
        Phase::Sample,
        Phase::Commands,
        Phase::Publish,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Plan => "plan",
            Phase::Forward => "forward",
            Phase::Sample => "sample",
            Phase::Commands => "commands",
            Phase::Publish => "publish",
        }
    }
}

impl EngineMetrics {
    pub fn observe(h: &Histogram, d: Duration) {
        h.observe(d.as_secs_f64());
    }

    pub fn shed(&self, p: Priority) -> &Counter {
        &self.shed[p as usize]
    }

    /// A forward step that ran to the end: `rows` tokens in `d`.
    pub fn record_step(&self, kind: StepKind, rows: usize, d: Duration) {
        self.step_seconds[kind as usize].observe(d.as_secs_f64());
        self.step_rows[kind as usize].inc_by(rows as u64);
    }

    /// Engine-thread time spent in `phase`.
    pub fn spend(&self, phase: Phase, d: Duration) {
        self.thread_seconds[phase as usize].inc_by(d.as_secs_f64());
    }
}

//! Pipeline parallelism: one model split by layers across processes ("stages"), so that a
//! model larger than any one worker is served by a group of them.
//!
//! * The **leader** (stage 1) is an ordinary engine: it embeds, computes its layers and
//!   keeps everything a request needs — the scheduler, the prefix cache, sampling,
//!   grammars, drafts. Its [`link::StageLink`] sends each step's rows and hidden states to
//!   stage 2 and receives the step's logits from the last stage.
//! * A **follower** ([`stage::serve`]) computes its layers over its own KV pool, which
//!   holds the leader's block ids for its layers only, and passes the hidden states on
//!   (or, the last, the logits back, relayed through the stages before it).
//! * The **activation channel** is TCP ([`wire`]): framed, checksummed, the hidden states
//!   exact `f32`. A follower takes frames only from one upstream that proved the workers'
//!   token on a fresh nonce, with a file of the same fingerprint and the layers just before
//!   its own; the follower proves the token back. Backpressure is TCP's: the leader has at
//!   most one step per stage in flight (`engine::runner`'s lanes), each of at most 8
//!   micro-batches.
//!
//! When a follower dies, the leader's step fails with `stage_lost` (a code the gateway
//! fails over on), every request in the engine ends the same way, its prefix cache is
//! dropped (the follower's KV is gone), and `/readyz` answers 503 until the group is whole
//! again: the leader reconnects every second and sets the pool up afresh.

pub mod link;
pub mod stage;
pub mod wire;

use std::time::Duration;

/// A leader's pipeline: the stages after it.
#[derive(Debug, Clone)]
pub struct PipelineConfig {
    /// The stages after the leader, in order (`host:port`).
    pub next: Vec<String>,
    /// The workers' token: proved to every stage, and required of it.
    pub token: Option<String>,
    /// How long the leader waits at start for its stages to be up.
    pub connect_timeout: Duration,
    /// A step is cut into this many micro-batches in flight (at least
    /// [`MIN_MICROBATCH_ROWS`] rows each), so that the stages compute it at once; 0: one
    /// per [`AUTO_MICROBATCH_ROWS`] rows, at most 8 (a long prefill is cut, a decode step
    /// is not: decode steps overlap across lanes instead).
    pub microbatches: usize,
}

/// The fewest rows a micro-batch is cut to.
pub const MIN_MICROBATCH_ROWS: usize = 8;

/// Rows per micro-batch when their number is automatic.
pub const AUTO_MICROBATCH_ROWS: usize = 64;

/// How long a step may wait for its logits before its stage is given up for lost.
pub const STEP_TIMEOUT: Duration = Duration::from_secs(300);

/// How long a handshake's frames may take.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(20);

impl PipelineConfig {
    pub fn new(next: Vec<String>, token: Option<String>) -> Self {
        Self {
            next,
            token,
            connect_timeout: Duration::from_secs(300),
            microbatches: 0,
        }
    }
}

//! What the handle and the engine thread exchange: the commands a handle sends
//! ([`Command`], a request being a [`Job`]) and the counters the thread publishes after
//! every step ([`EngineStats`]).

use std::sync::mpsc;

use hearth_protocol::{BlockHash, GenerateEvent, GenerateRequest, KvEvent, LoadReport};
use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::{broadcast, oneshot};

use crate::kv::block::ImportReport;
use crate::kv::tier::ReadBlock;

/// Counters the engine publishes after every step.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineStats {
    pub load: LoadReport,
    /// Prefix-cache lookups and hits, in blocks.
    pub prefix_queries: u64,
    pub prefix_hits: u64,
    pub preemptions: u64,
    pub steps: u64,
    /// LoRA adapters loaded now.
    pub adapters_loaded: usize,
    /// Their bytes in memory.
    pub adapter_bytes: usize,
    /// Adapters read from the store so far, and the seconds that took.
    pub adapter_loads: u64,
    pub adapter_load_seconds: f64,
    /// The device failed (CUDA): every request fails until the worker restarts, and the
    /// worker answers `/readyz` with 503.
    pub device_failed: bool,
    /// A pipeline's group is incomplete (a stage lost, not yet reconnected): requests fail
    /// and `/readyz` answers 503 until it is whole.
    pub stage_lost: bool,
}

pub(super) struct Job {
    pub(super) req: GenerateRequest,
    pub(super) tx: UnboundedSender<GenerateEvent>,
    /// The engine's own channel, with a disk tier: a request whose prompt continues on disk
    /// comes back through it once the blocks are read.
    pub(super) resend: Option<mpsc::Sender<Command>>,
}

pub(super) enum Command {
    Generate(Box<Job>),
    Subscribe(oneshot::Sender<(KvEvent, broadcast::Receiver<KvEvent>)>),
    /// The bytes of the cached blocks with these hashes (None: not cached here).
    ExportBlocks(Vec<BlockHash>, oneshot::Sender<Vec<Option<Vec<u8>>>>),
    /// Which of these hashes are not cached here.
    MissingBlocks(Vec<BlockHash>, oneshot::Sender<Vec<BlockHash>>),
    /// Blocks in chain order, each with why it was already refused (its checksum), and the
    /// block they must follow (see [`EngineHandle::start_import`](crate::EngineHandle::start_import)).
    ImportBlocks(Vec<ReadBlock>, Option<BlockHash>, oneshot::Sender<ImportReport>),
    /// A request's blocks read back from the disk tier: import them, then admit it.
    DiskRead(Box<Job>, Vec<ReadBlock>),
    /// The decode worker has what a handed-off request held (or gave up on it).
    ReleaseHold(String),
}

//! The engine loop: one thread owns the model, the paged KV cache and the scheduler, and
//! runs continuous batching — every step, all running sequences advance together in one
//! batched forward pass. Requests arrive on a channel; each streams [`GenerateEvent`]s back.
//! A request whose receiver is dropped is cancelled before the next step and its blocks are
//! freed at once.
//!
//! [`EngineHandle`] is the handle (this file); [`config`] the configuration; [`load`] loads a
//! model and starts the thread; [`runner`] is the thread and its jobs; [`command`] what the
//! two exchange; [`compute`] where the forward pass runs; [`metrics`] what the thread
//! records; [`adapters`] its LoRA adapter cache.

pub mod adapters;
pub mod command;
mod compute;
pub mod config;
mod load;
pub mod metrics;
mod runner;

use std::sync::{mpsc, Arc};

use hearth_protocol::{namespace_root, BlockHash, GenerateEvent, GenerateRequest, KvEvent, WorkerInfo};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};
use tokio::sync::{broadcast, oneshot, watch};

use crate::engine::command::{Command, EngineStats, Job};
use crate::engine::metrics::EngineMetrics;
use crate::kv::block::{ImportError, ImportReport, KvBlock, KvLayout};
use crate::kv::tier::DiskTier;

/// A cheap, cloneable handle to a running engine.
#[derive(Clone)]
pub struct EngineHandle {
    info: Arc<WorkerInfo>,
    commands: mpsc::Sender<Command>,
    stats: watch::Receiver<EngineStats>,
    metrics: Arc<EngineMetrics>,
    load_seconds: f64,
    kv_capacity_tokens: usize,
    kv_bytes_per_token: usize,
    packed_bytes: usize,
    decode_weight_bytes: usize,
    repack_seconds: f64,
    kv_layout: KvLayout,
    tier: Option<Arc<DiskTier>>,
    progress: Arc<crate::kernels::pack_cache::LoadProgress>,
}

impl std::fmt::Debug for EngineHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineHandle").field("model", &self.info.model).finish()
    }
}

impl EngineHandle {
    /// What the disk tier holds (None without one).
    pub fn kv_disk_usage(&self) -> Option<crate::kv::tier::TierUsage> {
        self.tier.as_ref().map(|t| t.usage())
    }

    /// The disk tier (tests, benchmarks).
    pub fn kv_disk(&self) -> Option<&DiskTier> {
        self.tier.as_deref()
    }

    /// Seconds of the load spent repacking weights.
    pub fn repack_seconds(&self) -> f64 {
        self.repack_seconds
    }

    /// Bytes of weights repacked for the SIMD kernels.
    pub fn packed_bytes(&self) -> usize {
        self.packed_bytes
    }

    /// Weight bytes one decode step reads (see `Model::decode_weight_bytes`).
    pub fn decode_weight_bytes(&self) -> usize {
        self.decode_weight_bytes
    }

    pub fn info(&self) -> &WorkerInfo {
        &self.info
    }

    /// Seconds from opening the file to ready.
    pub fn load_seconds(&self) -> f64 {
        self.load_seconds
    }

    /// How far the packed weights are ready (a mapped pack's check goes on after the load).
    pub fn load_progress(&self) -> Arc<crate::kernels::pack_cache::LoadProgress> {
        self.progress.clone()
    }

    pub fn kv_capacity_tokens(&self) -> usize {
        self.kv_capacity_tokens
    }

    /// Bytes the KV pool reserves (touched only as it fills).
    pub fn kv_cache_bytes(&self) -> usize {
        self.kv_capacity_tokens * self.kv_bytes_per_token
    }

    pub fn stats(&self) -> EngineStats {
        *self.stats.borrow()
    }

    /// Per-request timing histograms (queue, prefill, decode).
    pub fn metrics(&self) -> Arc<EngineMetrics> {
        self.metrics.clone()
    }

    /// Queues a request; events arrive on the returned channel, ending with `Done` or
    /// `Error`. Dropping the receiver cancels the request.
    pub fn generate(&self, req: GenerateRequest) -> UnboundedReceiver<GenerateEvent> {
        let (tx, rx) = unbounded_channel();
        let resend = self.tier.as_ref().map(|_| self.commands.clone());
        if let Err(mpsc::SendError(Command::Generate(job))) =
            self.commands.send(Command::Generate(Box::new(Job { req, tx, resend })))
        {
            let _ = job.tx.send(GenerateEvent::Error {
                code: "engine_stopped".into(),
                message: "the engine is not running".into(),
            });
        }
        rx
    }

    /// What another engine's KV blocks must match to be imported here.
    pub fn kv_layout(&self) -> KvLayout {
        self.kv_layout
    }

    /// The prefix-cache hashes of a prompt's full blocks (all but its last token), as this
    /// engine and the gateway compute them.
    pub fn prompt_block_hashes(&self, prompt: &[u32], cache_namespace: &str) -> Vec<BlockHash> {
        let root = namespace_root(&self.info.model, cache_namespace);
        hearth_protocol::block_hashes(
            root,
            &prompt[..prompt.len().saturating_sub(1)],
            self.kv_layout.block_tokens as usize,
        )
    }

    /// Copies out the cached blocks with these hashes (None for those not cached), each with
    /// its checksum.
    pub async fn export_blocks(&self, hashes: Vec<BlockHash>) -> Result<Vec<Option<KvBlock>>, ImportError> {
        let (tx, rx) = oneshot::channel();
        self.commands
            .send(Command::ExportBlocks(hashes.clone(), tx))
            .map_err(|_| ImportError::Stopped)?;
        let data = rx.await.map_err(|_| ImportError::Stopped)?;
        Ok(hashes
            .into_iter()
            .zip(data)
            .map(|(h, d)| d.map(|d| KvBlock::new(h, d)))
            .collect())
    }

    /// Which of these hashes this engine does not hold (the blocks worth sending).
    pub async fn missing_blocks(&self, hashes: Vec<BlockHash>) -> Result<Vec<BlockHash>, ImportError> {
        let (tx, rx) = oneshot::channel();
        self.commands
            .send(Command::MissingBlocks(hashes, tx))
            .map_err(|_| ImportError::Stopped)?;
        rx.await.map_err(|_| ImportError::Stopped)
    }

    /// Imports blocks exported by an engine with the same `layout` into the prefix cache
    /// (see [`crate::kv::transfer`]).
    pub async fn import_blocks(&self, layout: KvLayout, blocks: Vec<KvBlock>) -> Result<ImportReport, ImportError> {
        self.start_import(layout, blocks, None)?
            .await
            .map_err(|_| ImportError::Stopped)
    }

    /// Checks the blocks' checksums here (off the engine thread) and queues their import;
    /// the report comes when the engine has written them, so a transfer receives its next
    /// blocks meanwhile. Imports are done in the order they are started. `after`: the
    /// block these continue a chain from — if the engine does not hold it by then (an
    /// earlier import stopped short, or it was evicted), none of these is imported, since
    /// a prefix is reused only up to its first missing block.
    pub fn start_import(
        &self,
        layout: KvLayout,
        blocks: Vec<KvBlock>,
        after: Option<BlockHash>,
    ) -> Result<oneshot::Receiver<ImportReport>, ImportError> {
        if layout != self.kv_layout {
            return Err(ImportError::Layout {
                ours: self.kv_layout,
                theirs: layout,
            });
        }
        let checked = blocks
            .into_iter()
            .map(|b| {
                let why = (!b.intact()).then(|| "checksum mismatch".to_string());
                (b, why, None)
            })
            .collect();
        let (tx, rx) = oneshot::channel();
        self.commands
            .send(Command::ImportBlocks(checked, after, tx))
            .map_err(|_| ImportError::Stopped)?;
        Ok(rx)
    }

    /// Releases the KV blocks a prefill-only request held for its decode worker (see
    /// [`GenerateRequest::prefill_only`]); unknown or expired holds are ignored.
    pub fn release_hold(&self, hold: &str) {
        let _ = self.commands.send(Command::ReleaseHold(hold.to_string()));
    }

    /// The cache's current content (a `Snapshot`) and every change after it, with no gap.
    pub async fn subscribe_kv(&self) -> Option<(KvEvent, broadcast::Receiver<KvEvent>)> {
        let (tx, rx) = oneshot::channel();
        self.commands.send(Command::Subscribe(tx)).ok()?;
        rx.await.ok()
    }
}

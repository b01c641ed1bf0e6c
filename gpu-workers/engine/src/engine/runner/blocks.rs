//! The runner's KV block jobs: blocks held for decode workers and their expiry, blocks
//! imported (from a peer or the disk tier), evicted blocks spilled to the disk tier, and
//! the run of a prompt's blocks the tier can read back.

use std::time::Instant;

use hearth_protocol::{namespace_root, BlockHash, GenerateRequest};

use crate::engine::config::DISK_READ_MAX_BYTES;
use crate::engine::runner::Runner;
use crate::kv::block::BlockKey;
use crate::kv::block::ImportReport;
use crate::kv::tier::{DiskTier, ReadBlock};

impl Runner {
    /// Tail first, as a finished sequence releases its blocks.
    pub(super) fn release_blocks(&mut self, blocks: Vec<u32>) {
        for b in blocks.into_iter().rev() {
            self.sched.blocks.release(b);
        }
    }

    pub(super) fn expire_holds(&mut self) {
        if self.holds.is_empty() {
            return;
        }
        let now = Instant::now();
        let expired: Vec<String> = self
            .holds
            .iter()
            .filter(|(_, (_, until))| *until <= now)
            .map(|(id, _)| id.clone())
            .collect();
        for id in expired {
            tracing::warn!(request_id = %id, "no decode worker fetched the handed-off KV blocks; released");
            if let Some((blocks, _)) = self.holds.remove(&id) {
                self.release_blocks(blocks);
            }
        }
    }

    /// Writes intact blocks not held yet into free (or evicted) blocks and names them in
    /// the prefix cache, unreferenced: reusable by the next request, evictable like any
    /// cached block.
    ///
    /// Blocks are a prompt's chain in order (checksums already verified): the import stops at
    /// the first one it cannot write, since a prefix is reused only up to its first missing
    /// block. The blocks written stay referenced until the end, so that making room for a
    /// later block never evicts an earlier one of the same import; they are then released
    /// last-first, so that the cache evicts a prefix's tail before its head.
    pub(super) fn import(&mut self, blocks: Vec<ReadBlock>) -> ImportReport {
        let mut report = ImportReport::default();
        let mut held = Vec::new();
        let mut gap = false;
        for (block, rejected, spill) in blocks {
            if gap {
                report
                    .rejected
                    .push((block.hash, "follows a block that could not be imported".into()));
                continue;
            }
            if self.sched.blocks.contains(block.hash) {
                report.already_held += 1;
                continue;
            }
            if let Some(why) = rejected {
                report.rejected.push((block.hash, why));
                gap = true;
                continue;
            }
            let Some(b) = self.sched.blocks.allocate() else {
                report.rejected.push((block.hash, "no free KV block".into()));
                gap = true;
                continue;
            };
            // The block may have been evicted for this: save it before it is overwritten.
            self.spill_evicted();
            if self.compute.write_block(b, &block.data) {
                self.sched.blocks.register_spillable(b, block.hash, spill);
                report.imported += 1;
                report.bytes += block.data.len() as u64;
            } else {
                report.rejected.push((block.hash, "wrong block size".into()));
                gap = true;
            }
            held.push(b);
        }
        for b in held.into_iter().rev() {
            self.sched.blocks.release(b);
        }
        report
    }

    /// Copies the blocks the pool just evicted, or reused for the first time, to the disk
    /// tier (the copy is the engine's only cost: the write happens on the tier's thread).
    pub(super) fn spill_evicted(&mut self) {
        let evicted = self.sched.blocks.take_evicted();
        let Some(tier) = &self.tier else { return };
        for (b, h, spill) in evicted {
            // Only what the tier lacks (or holds in its older half, about to age out): no
            // copy for a block whose fresh copy is already on disk.
            if tier.wants(&spill.key) {
                if let Some(data) = self.compute.read_block(b) {
                    tier.spill(h, spill, data);
                }
            }
        }
    }

    /// With a disk tier: the run of the prompt's full blocks that the pool lacks and the
    /// disk holds, from the first block the pool lacks.
    pub(super) fn disk_run(&self, tier: &DiskTier, req: &GenerateRequest) -> Vec<(BlockKey, BlockHash)> {
        let bt = self.sched.config().block_tokens;
        let tokens: Vec<u32> = req.prompt.iter().chain(&req.resume).copied().collect();
        let full = tokens.len().saturating_sub(1) / bt;
        let namespace = req.kv_namespace();
        let mut h = namespace_root(&self.model_id, &namespace);
        let mut key = BlockKey::root(&self.model_id, &namespace);
        let mut run = Vec::new();
        let mut leading = 0;
        // No more than the pool can take without evicting the prompt's own leading blocks
        // (with room for its last, partial block), nor more than 1 GiB in one read.
        let room = self.sched.blocks.available().saturating_sub(2);
        let cap = (DISK_READ_MAX_BYTES / tier.block_bytes().max(1)).max(1);
        for i in 0..full {
            let block = &tokens[i * bt..(i + 1) * bt];
            h = hearth_protocol::chain(h, block);
            key = key.chain(block);
            if run.is_empty() && self.sched.blocks.contains(h) {
                leading += 1;
                continue;
            }
            if run.len() >= cap || run.len() + leading >= room || !tier.contains(&key) {
                break;
            }
            run.push((key, h));
        }
        run
    }
}

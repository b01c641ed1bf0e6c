//! Moving a prompt's KV cache between workers (prefill/decode disaggregation): the blocks a
//! prefill computed are exported by their block hashes, with a checksum each, and imported
//! by another engine of the same model and KV layout into its prefix cache. A request for
//! the same prompt there then reuses them as it would reuse its own cached prefix: only the
//! prompt's last (partial) block and last token are computed again, and decoding continues
//! exactly as on the prefill side.
//!
//! Imported blocks are ordinary cached blocks: unreferenced, evictable (least recently used
//! first), announced in the engine's KV events. A block whose checksum does not match, or
//! that finds no room, is not imported; the request then computes it.

use hearth_protocol::BlockHash;
use serde::{Deserialize, Serialize};

use crate::kv::KvDtype;

/// What two engines must share for a block to move between them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvLayout {
    pub n_layers: u32,
    pub kv_dim: u32,
    pub head_dim: u32,
    pub block_tokens: u32,
    /// `f16` or `f32`.
    pub dtype: KvDtypeName,
}

/// [`KvDtype`] as it travels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvDtypeName {
    F16,
    F32,
}

impl From<KvDtype> for KvDtypeName {
    fn from(d: KvDtype) -> Self {
        match d {
            KvDtype::F16 => Self::F16,
            KvDtype::F32 => Self::F32,
        }
    }
}

/// One block: its hash in the prefix cache, an XXH3-64 of its bytes, and the bytes (every
/// layer's keys and values, see [`crate::kv::KvPool::read_block`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvBlock {
    pub hash: BlockHash,
    pub checksum: u64,
    pub data: Vec<u8>,
}

impl KvBlock {
    pub fn new(hash: BlockHash, data: Vec<u8>) -> Self {
        Self {
            hash,
            checksum: xxhash_rust::xxh3::xxh3_64(&data),
            data,
        }
    }

    /// Whether the bytes are those the checksum was taken of.
    pub fn intact(&self) -> bool {
        xxhash_rust::xxh3::xxh3_64(&self.data) == self.checksum
    }
}

/// What an import did, block by block.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImportReport {
    /// Written into the cache.
    pub imported: usize,
    /// Already cached here (nothing written).
    pub already_held: usize,
    /// Not imported, and why (the request computes them).
    pub rejected: Vec<(BlockHash, String)>,
    pub bytes: u64,
}

/// Why a whole import was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ImportError {
    #[error("KV layout differs: this engine has {ours:?}, the blocks {theirs:?}")]
    Layout { ours: KvLayout, theirs: KvLayout },
    #[error("the engine is not running")]
    Stopped,
}

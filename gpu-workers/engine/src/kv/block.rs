//! What every store of KV blocks shares, and nothing else: a block's bytes and checksum
//! ([`KvBlock`], [`BlockData`]), the layout two stores must agree on to exchange blocks
//! ([`KvLayout`]), a block's durable key and owner ([`BlockKey`], [`Spill`]; see
//! [`crate::kv::tier`]'s doc for why a second chain), and what importing blocks reports
//! ([`ImportReport`], [`ImportError`]; a pull from a peer, [`PullReport`]). The pool, the
//! disk tier and the transfer between workers all build on it; it imports none of them.

use std::sync::Arc;

use bytes::Bytes;
use hearth_protocol::BlockHash;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::models::arch::Arch;

/// A block's identity in stores that outlive a request (see the module's doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockKey(pub [u8; 16]);

impl BlockKey {
    /// The root of a chain: one per model and cache namespace.
    pub fn root(model: &str, namespace: &str) -> Self {
        let mut h = Sha256::new();
        h.update(b"hearth-kv-key-v1\0");
        h.update((model.len() as u64).to_le_bytes());
        h.update(model.as_bytes());
        h.update(namespace.as_bytes());
        Self::from_digest(h)
    }

    /// The key of the block holding `tokens` after the block keyed `self`.
    pub fn chain(&self, tokens: &[u32]) -> Self {
        let mut h = Sha256::new();
        h.update(self.0);
        for t in tokens {
            h.update(t.to_le_bytes());
        }
        Self::from_digest(h)
    }

    fn from_digest(h: Sha256) -> Self {
        let d = h.finalize();
        let mut k = [0u8; 16];
        k.copy_from_slice(&d[..16]);
        Self(k)
    }
}

/// What a pool block needs to go to the tier when evicted: its key and whose it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Spill {
    pub key: BlockKey,
    pub tenant: Arc<str>,
}

/// What two engines must share for a block to move between them: the shape, and what the
/// stored keys mean — the architecture and the rotation (keys are kept after RoPE, so a
/// worker serving the same file with other RoPE scaling cannot use them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvLayout {
    pub arch: Arch,
    /// [`crate::models::Model::rope_fingerprint`].
    pub rope: u64,
    pub n_layers: u32,
    pub kv_dim: u32,
    pub head_dim: u32,
    pub block_tokens: u32,
    /// `f16` or `f32`.
    pub dtype: KvDtypeName,
    /// Latent attention's layout: one latent per position and layer, no values (see
    /// [`crate::kv::pool::KvShape::latent`]). Never mixed with full K/V.
    #[serde(default)]
    pub latent: bool,
}

impl KvLayout {
    /// Bytes of one block in this layout.
    pub fn block_bytes(&self) -> usize {
        let elem = match self.dtype {
            KvDtypeName::F16 => 2,
            KvDtypeName::F32 => 4,
        };
        let sections = if self.latent { 1 } else { 2 };
        self.n_layers as usize * sections * self.block_tokens as usize * self.kv_dim as usize * elem
    }
}

/// [`KvDtype`](crate::kv::pool::KvDtype) as it travels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvDtypeName {
    F16,
    F32,
}

/// A block's bytes: one buffer (read from a pool or a disk record), or the pieces of a
/// network stream the block spans, never joined — writing them into the destination
/// block is the transfer's one copy on the receiving side.
#[derive(Debug, Clone, Default)]
pub struct BlockData(pub(super) Vec<Bytes>);

impl BlockData {
    /// The bytes, in order, as pieces.
    pub fn parts(&self) -> &[Bytes] {
        &self.0
    }

    pub fn len(&self) -> usize {
        self.0.iter().map(Bytes::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// XXH3-64 of the bytes, as one buffer would hash.
    pub fn checksum(&self) -> u64 {
        match &self.0[..] {
            [one] => xxhash_rust::xxh3::xxh3_64(one),
            parts => {
                let mut h = xxhash_rust::xxh3::Xxh3::new();
                for p in parts {
                    h.update(p);
                }
                h.digest()
            }
        }
    }

    /// The bytes as one buffer (a copy; for tools, tests and device uploads).
    pub fn to_vec(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.len());
        for p in &self.0 {
            out.extend_from_slice(p);
        }
        out
    }

    pub(super) fn push(&mut self, part: Bytes) {
        if !part.is_empty() {
            self.0.push(part);
        }
    }
}

impl From<Vec<u8>> for BlockData {
    fn from(v: Vec<u8>) -> Self {
        Self::from(Bytes::from(v))
    }
}

impl From<Bytes> for BlockData {
    fn from(b: Bytes) -> Self {
        let mut d = Self::default();
        d.push(b);
        d
    }
}

/// Equal bytes, however they are split.
impl PartialEq for BlockData {
    fn eq(&self, other: &Self) -> bool {
        if self.len() != other.len() {
            return false;
        }
        let mut a = self.0.iter().flat_map(|p| p.iter());
        let mut b = other.0.iter().flat_map(|p| p.iter());
        loop {
            match (a.next(), b.next()) {
                (None, None) => return true,
                (x, y) if x == y => {}
                _ => return false,
            }
        }
    }
}

impl Eq for BlockData {}

/// One block: its hash in the prefix cache, an XXH3-64 of its bytes, and the bytes (every
/// layer's keys and values, see [`crate::kv::pool::KvPool::read_block`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvBlock {
    pub hash: BlockHash,
    pub checksum: u64,
    pub data: BlockData,
}

impl KvBlock {
    pub fn new(hash: BlockHash, data: impl Into<BlockData>) -> Self {
        let data = data.into();
        Self {
            hash,
            checksum: data.checksum(),
            data,
        }
    }

    /// Whether the bytes are those the checksum was taken of.
    pub fn intact(&self) -> bool {
        self.data.checksum() == self.checksum
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

/// Result of a pull: what was asked, what was missing here, what the import did, and how
/// long the transfer took.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct PullReport {
    pub blocks: usize,
    pub missing: usize,
    pub import: ImportReport,
    /// Blocks the peer did not hold.
    pub not_held: usize,
    pub seconds: f64,
    /// Set when the transfer failed midway (what arrived before is imported).
    pub error: Option<String>,
}

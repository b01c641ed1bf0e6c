//! KV blocks: one hash, everywhere.
//!
//! Token ids are cut into blocks of `B` tokens (default 16). Each full block gets a chained
//! hash `h_i = H(h_{i-1}, block_i)` with `h_{-1} = H(model, cache_namespace)`. The engine's
//! prefix cache, the KV events it publishes and the router's index all use this function,
//! so a hash names the same prefix everywhere. The namespace is the tenant (plus
//! `prompt_cache_key` when given): two tenants never share a cached prefix.
//!
//! `H` is XXH3-64 (stable across platforms and releases), seeded by the parent hash.

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// Tokens per KV block.
pub const DEFAULT_BLOCK_TOKENS: usize = 16;

/// The chained hash of a full block of tokens (and, through the chain, of everything before it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct BlockHash(pub u64);

/// `h_{-1}`: the root of every chain for one model and cache namespace.
pub fn namespace_root(model: &str, namespace: &str) -> BlockHash {
    let mut buf = Vec::with_capacity(model.len() + namespace.len() + 1);
    buf.extend_from_slice(model.as_bytes());
    buf.push(0);
    buf.extend_from_slice(namespace.as_bytes());
    BlockHash(xxh3_64(&buf))
}

/// `h_i = H(h_{i-1}, block_i)`.
pub fn chain(parent: BlockHash, block: &[u32]) -> BlockHash {
    let mut buf = [0u8; 4 * 64];
    let mut bytes = Vec::new();
    let data: &[u8] = if block.len() <= 64 {
        for (i, t) in block.iter().enumerate() {
            buf[4 * i..4 * i + 4].copy_from_slice(&t.to_le_bytes());
        }
        &buf[..4 * block.len()]
    } else {
        bytes.extend(block.iter().flat_map(|t| t.to_le_bytes()));
        &bytes
    };
    BlockHash(xxh3_64_with_seed(data, parent.0))
}

/// Hashes of every full block of `tokens`.
pub fn block_hashes(root: BlockHash, tokens: &[u32], block_tokens: usize) -> Vec<BlockHash> {
    let mut h = root;
    tokens
        .chunks_exact(block_tokens.max(1))
        .map(|b| {
            h = chain(h, b);
            h
        })
        .collect()
}

/// The cache namespace of a request: its tenant, plus the client's `prompt_cache_key`.
pub fn cache_namespace(tenant_id: &str, prompt_cache_key: Option<&str>) -> String {
    match prompt_cache_key {
        Some(k) if !k.is_empty() => format!("{tenant_id}\u{1f}{k}"),
        _ => tenant_id.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn namespaces_separate_equal_prefixes() {
        let toks: Vec<u32> = (0..64).collect();
        let a = block_hashes(namespace_root("m", &cache_namespace("tenant-a", None)), &toks, 16);
        let b = block_hashes(namespace_root("m", &cache_namespace("tenant-b", None)), &toks, 16);
        let a2 = block_hashes(namespace_root("m", &cache_namespace("tenant-a", Some("k"))), &toks, 16);
        let other_model = block_hashes(namespace_root("m2", &cache_namespace("tenant-a", None)), &toks, 16);
        assert_eq!(a.len(), 4);
        for (i, h) in a.iter().enumerate() {
            assert_ne!(*h, b[i]);
            assert_ne!(*h, a2[i]);
            assert_ne!(*h, other_model[i]);
        }
    }

    #[test]
    fn the_hash_is_stable() {
        // Gateways and workers of different builds must agree: pin one value.
        let h = block_hashes(namespace_root("smollm2-135m-instruct", "t"), &[1; 16], 16);
        assert_eq!(h[0], chain(namespace_root("smollm2-135m-instruct", "t"), &[1; 16]));
        assert_eq!(namespace_root("a", "b"), BlockHash(xxh3_64(b"a\0b")));
    }

    proptest! {
        #[test]
        fn a_block_hash_names_its_whole_prefix(
            a in proptest::collection::vec(0u32..50_000, 16..96),
            i in 0usize..96, v in 0u32..50_000,
        ) {
            let root = namespace_root("m", "t");
            let ha = block_hashes(root, &a, 16);
            prop_assert_eq!(ha.len(), a.len() / 16);
            // Changing one token changes the hash of its block and every later block,
            // and none before.
            let i = i % a.len();
            let mut b = a.clone();
            prop_assume!(b[i] != v);
            b[i] = v;
            let hb = block_hashes(root, &b, 16);
            for k in 0..ha.len() {
                if k < i / 16 { prop_assert_eq!(ha[k], hb[k]); } else { prop_assert_ne!(ha[k], hb[k]); }
            }
            // A prefix's hashes are a prefix of the whole's.
            let hp = block_hashes(root, &a[..a.len() / 2], 16);
            prop_assert_eq!(&ha[..hp.len()], &hp[..]);
        }
    }
}

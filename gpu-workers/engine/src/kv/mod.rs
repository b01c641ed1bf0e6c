//! The KV cache, from the bottom: [`block`] is what every store of KV blocks shares (a
//! block's bytes and checksum, its durable key, its layout); [`pool`] is the paged cache in
//! memory and its prefix cache; [`tier`] keeps evicted blocks on local disk; [`transfer`]
//! moves blocks between workers (it stands above the engine, whose handle it drives).

pub mod block;
pub mod pool;
pub mod tier;
pub mod transfer;

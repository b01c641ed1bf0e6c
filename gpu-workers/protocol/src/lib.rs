//! Wire types shared by Hearth's gateway and its workers, plus the tokenizer and chat
//! template both sides must agree on.
//!
//! The gateway tokenizes and applies the chat template itself (so routing sees exactly the
//! token ids the engine will cache), which is why the tokenizer lives here and not in the
//! engine: a gateway never links the engine, it receives a [`TokenizerSpec`] from a worker.

pub mod adapter;
pub mod blocks;
pub mod chat;
pub mod output;
pub mod qos;
pub mod tokenizer;
pub mod trace_context;
mod wire;

pub use blocks::{block_hashes, cache_namespace, chain, namespace_root, BlockHash, DEFAULT_BLOCK_TOKENS};
pub use chat::{ChatInput, ChatMessage, ChatTemplate, FunctionCall, TemplateError, ToolCall};
pub use qos::{Priority, Qos, QueueState, Shed, BATCH_QUEUE_FRACTION, MAX_SHARE};
pub use tokenizer::{TokenizeError, Tokenizer, TokenizerSpec};
pub use trace_context::{TraceParent, TRACEPARENT};
pub use wire::*;

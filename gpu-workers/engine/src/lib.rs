//! Hearth's inference engine.
//!
//! * [`gguf`] reads model files ([`hf`] opens Hugging Face directories as the same view); [`kernels`] holds the CPU maths; [`models`] has one file
//!   per architecture; [`kv`] is the paged KV cache and prefix cache; [`attention`] reads it;
//!   [`scheduler`] plans continuous batching; [`sampling`] and [`text`] turn logits into
//!   tokens and tokens into streamed text; [`grammar`] constrains them (llguidance) and
//!   [`speculative`] drafts several per step.
//! * [`cuda`] runs the same forward pass on an NVIDIA GPU (the `cuda` feature; CUDA is
//!   loaded at run time).
//! * [`EngineHandle`] runs a model on its own thread; [`server`] exposes it over HTTP as a
//!   worker; [`fetch`] acquires the default model. (Its benchmarks are in `hearth-bench`.)
//!
//! The gateway never links these internals: it speaks `hearth-protocol` to a worker.

pub mod adapters;
pub mod attention;
pub mod backend;
pub mod cuda;
pub mod engine;
pub mod fetch;
pub mod gguf;
pub mod grammar;
pub mod hf;
pub mod host;
pub mod inspect;
pub mod kernels;
pub mod kv;
pub mod kv_tier;
pub mod kv_transfer;
#[cfg(test)]
mod layering;
pub mod metrics;
pub mod models;
pub mod pack_cache;
pub mod sampling;
pub mod scheduler;
pub mod server;
pub mod sim;
pub mod speculative;
pub mod telemetry;
pub mod text;

pub use backend::Backend;
pub use engine::{EngineConfig, EngineError, EngineHandle, EngineStats};
pub use gguf::tokenizer_spec;

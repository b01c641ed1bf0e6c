//! Hearth's inference engine.
//!
//! * [`formats`] reads model files ([`formats::gguf`]; [`formats::hf`] opens Hugging Face
//!   directories as the same view) and fetches and inspects them; [`kernels`] holds the CPU
//!   maths; [`models`] has one file per architecture; [`kv`] is the paged KV cache and prefix
//!   cache, its disk tier and its transfer between workers; [`attention`] reads it;
//!   [`step`] holds what a step uses besides the model: the scheduler that plans continuous
//!   batching, sampling and streamed text, grammar constraints (llguidance) and drafting.
//! * [`cuda`] runs the same forward pass on an NVIDIA GPU (the `cuda` feature; CUDA is
//!   loaded at run time).
//! * [`EngineHandle`] ([`engine`]) runs a model on its own thread; [`worker`] exposes it over
//!   HTTP as a worker, with its metrics and traces; [`formats::fetch`] acquires the default
//!   model. (Its benchmarks are in `hearth-bench`.)
//!
//! The gateway never links these internals: it speaks `hearth-protocol` to a worker. Inside
//! the crate, modules name each other by their full paths; the re-exports below are for
//! other crates.

pub mod attention;
pub mod cuda;
pub mod engine;
pub mod formats;
pub mod kernels;
pub mod kv;
#[cfg(test)]
mod layering;
pub mod models;
pub mod pipeline;
pub mod step;
pub mod worker;

pub use engine::command::EngineStats;
pub use engine::config::{EngineConfig, EngineError};
pub use engine::EngineHandle;
pub use formats::gguf::tokenizer_spec;
pub use worker::backend::Backend;

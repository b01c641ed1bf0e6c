//! Hearth's API tier: the OpenAI-compatible gateway ([`gateway`]), the admin API
//! ([`admin`]), the tenant self-service API ([`selfservice`]), the models it serves ([`registry`]) and how it reaches workers
//! ([`workers`]). The `hearth` binary (`main.rs`) wires these together.
//!
//! Invariant: the gateway talks to engines only through `hearth-protocol` and a
//! [`workers::WorkerClient`]; only the embedded launcher (`hearth serve`) links the engine.

pub mod admin;
pub mod db;
pub mod error;
pub mod gateway;
pub mod gateway_bench;
pub mod limits;
pub mod metrics;
pub mod openai;
pub mod processor_bench;
pub mod processors;
pub mod registry;
pub mod routing_bench;
pub mod selfservice;
pub mod workers;

//! Hearth's benchmarks, kept outside the production libraries and run through
//! `hearth bench …`: each prints a table and can write JSON.
//!
//! * [`gateway`] — what authentication, limits, budgets and metering add per request;
//! * [`processors`] — tenant processor overhead per guest language, and core scaling;
//! * [`routing`] — routing policies on simulated workers, and the router micro-benchmark;
//! * [`pd`] — prefill/decode disaggregation vs colocated serving, on real worker processes
//!   and on simulated workers;
//! * [`agent`] — agent workloads (extraction, tool calls, edits, chat) with and without
//!   speculative decoding, the grammar mask's cost and schema validity, on the engine;
//! * [`fairness`] — FIFO vs fair scheduling between tenants and classes on one saturated
//!   worker (sim and engine).
//!
//! (`hearth bench engine` lives with the engine, in `hearth_engine::bench`.) Side-by-side
//! comparisons with other projects are the scripts beside this crate
//! (`llamacpp-compare`, `gateway-compare`), measured in the same run.

pub mod agent;
pub mod fairness;
pub mod gateway;
pub mod pd;
pub mod processors;
pub mod routing;

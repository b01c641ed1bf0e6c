//! Hearth's API tier. A map of the crate:
//!
//! * [`state`] — [`AppState`](state::AppState), what one gateway process shares;
//! * [`app`] — the route table (public API, self-service, operator routes behind one layer);
//! * [`auth`] — the one bearer parser, tenant credentials and scopes, the admin token;
//! * [`pipeline`] — the OpenAI request as named phases over one per-request context;
//! * [`limits`] — rate limits (GCRA, in-process or Redis); [`processors`] — tenant Wasm chains;
//! * [`redis_conn`] — connecting to Redis, and whether it answers (limits, budgets, routing state);
//! * [`registry`] — the models served and their routers; [`workers`] — how workers are reached;
//!   [`queues`] — each model's queued prompt tokens by tenant, and its drain rate;
//! * [`cluster`] — workers registering through Redis, discovery, routing state shared by gateways;
//! * [`management`] — the one implementation of key/processor/usage management, with its
//!   adapters [`admin`] and [`selfservice`] (and the CLI); [`metrics`] — Prometheus;
//! * [`http`] — the HTTP server with its connection, header and body limits (gateway and workers);
//! * [`batches`] — OpenAI's Files and Batch APIs, and the runner that works batches off in
//!   the `batch` class;
//! * [`openai`] — request parsing; [`error`] — every client-visible error; [`db`] — the store;
//! * [`responses`] (OpenAI Responses) and [`anthropic`] (Anthropic Messages) — translations
//!   onto the same pipeline, their answers built as items by [`answer`];
//! * [`telemetry`] — the request's root span (GenAI attributes) and `traceparent` for workers.
//!
//! Invariant: this crate never links the engine. It reaches engines only through
//! `hearth-protocol` and a [`workers::WorkerClient`]; the embedded launcher (`hearth serve`,
//! in `hearth-cli`) supplies an in-process client.

pub mod adapters;
pub mod admin;
pub mod answer;
pub mod anthropic;
pub mod app;
pub mod auth;
pub mod batches;
pub mod cluster;
pub mod dashboard;
pub mod db;
pub mod error;
pub mod http;
#[cfg(test)]
mod layering;
pub mod limits;
pub mod management;
pub mod metrics;
pub mod openai;
pub mod openapi;
pub mod pipeline;
pub mod processors;
pub mod queues;
pub mod redis_conn;
pub mod registry;
pub mod responses;
pub mod selfservice;
pub mod state;
pub mod telemetry;
pub mod tools;
pub mod workers;

/// This request's id, set by the outermost middleware and echoed in `x-request-id`.
#[derive(Debug, Clone)]
pub struct RequestId(pub String);

//! Hearth's API tier, in floors: a module imports only from its own floor or below
//! (`docs/ARCHITECTURE.md`, "Layers"; enforced by the `layering` test). From the bottom:
//!
//! * [`server`] — every client-visible error, the store, the HTTP server and its limits,
//!   Prometheus metrics, the request's span and `traceparent`, Redis;
//! * [`upstream`] — how workers are reached: the models served and their routers, the
//!   worker clients, registration and routing state shared through Redis, tenant queues;
//! * [`policy`] — rate limits (GCRA), spending budgets, tenant Wasm processors, the
//!   bad-credential throttle;
//! * [`state`] — [`AppState`](state::AppState), what one gateway process shares; [`auth`]
//!   — tenant credentials, scopes and the admin token, read off it; [`manage`] — the one
//!   implementation of key/processor/usage/adapter management;
//! * [`api`] — each API's own requests and answers (OpenAI chat and completions, Responses,
//!   Anthropic Messages, tool calls): parsed into the pipeline's terms, rendered from its
//!   events;
//! * [`pipeline`] — a generation request as named phases over one per-request context; it
//!   calls down into [`api`] to parse and to render;
//! * [`routes`] — the other HTTP surfaces: admin and self-service, Files and Batches (with
//!   the runner that works batches off), the OpenAPI documents, health and models;
//! * [`app`] — the route table; [`gate`] — credentials checked before large bodies are
//!   read; [`dashboard`] — the browser console.
//!
//! Invariant: this crate never links the engine. It reaches engines only through
//! `hearth-protocol` and a [`upstream::workers::WorkerClient`]; the embedded launcher
//! (`hearth serve`, in `hearth-cli`) supplies an in-process client.

pub mod api;
pub mod app;
pub mod auth;
pub mod dashboard;
pub mod gate;
#[cfg(test)]
mod layering;
pub mod manage;
pub mod pipeline;
pub mod policy;
pub mod routes;
pub mod server;
pub mod state;
pub mod upstream;

/// This request's id, set by the outermost middleware and echoed in `x-request-id`.
#[derive(Debug, Clone)]
pub struct RequestId(pub String);

//! The worker around an engine: [`backend`] is what a worker serves (a real engine or
//! [`sim`]'s simulated one); [`host`] holds the models a worker serves; [`server`] is its
//! HTTP API; [`metrics`] its Prometheus collector; [`telemetry`] its trace spans.

pub mod backend;
pub mod host;
pub mod metrics;
pub mod server;
pub mod sim;
pub mod telemetry;

//! The floor everything stands on: client-visible errors ([`error`]), the store ([`db`]),
//! the HTTP server with its connection, header and body limits ([`http`], gateway and
//! workers), the request's root span and `traceparent` ([`telemetry`]), and connecting to
//! Redis ([`redis_conn`]). Prometheus ([`metrics`]) lives here too but stands one floor up,
//! beside `upstream`: its gauges read the registry's routers.

pub mod db;
pub mod error;
pub mod http;
pub mod metrics;
pub mod redis_conn;
pub mod telemetry;

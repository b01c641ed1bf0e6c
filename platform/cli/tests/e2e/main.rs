//! The `hearth` binary end to end, one test binary (one link) for every file: each module
//! is one surface (chat, tenants, PD, processors, ...) driven through real processes and
//! real HTTP. `harness` starts the processes and holds the shared helpers; the tier a test
//! belongs to (`quick`, `model`, `reference`) is set in `.config/nextest.toml`.

mod harness;

mod adapters;
mod agent;
mod agent_api;
mod batches;
mod catalogue;
mod chaos;
mod cluster;
mod dashboard;
mod fairness;
mod formats;
mod model_store;
mod pd;
mod pipeline;
mod probe;
mod processors;
mod serve;
mod telemetry;
mod tenants;

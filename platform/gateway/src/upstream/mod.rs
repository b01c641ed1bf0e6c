//! How workers are reached: the models served and their routers ([`registry`]), the clients
//! that speak to workers ([`workers`]), workers registering through Redis with the routing
//! state the gateways share ([`cluster`]), and each model's queued prompt tokens by tenant
//! ([`queues`]).

pub mod cluster;
pub mod queues;
pub mod registry;
pub mod workers;

//! The HTTP surfaces other than generation: the admin API ([`admin`]), the tenant's
//! self-service API ([`selfservice`]), OpenAI's Files and Batch APIs with the runner that
//! works batches off ([`batches`]), the OpenAPI documents ([`openapi`]), and health, models
//! and metrics ([`public`]).

pub mod admin;
pub mod batches;
pub mod openapi;
pub mod public;
pub mod selfservice;

//! The engine's integration tests, one test binary (one link) for every file: each module
//! is one concern (golden values, families against llama.cpp, KV transfer, LoRA, ...).
//! `harness` holds the shared helpers and the reference data's location; the tier a test
//! belongs to (`quick`, `model`, `reference`) is set in `.config/nextest.toml`.

mod harness;

mod agent;
mod cuda_emulated;
mod cuda_kernels;
mod families;
mod fuzz;
mod golden;
mod hf;
mod host;
mod kv_tiers;
mod kv_transfer;
mod llamacpp;
mod long_context;
mod lora;
mod pack_cache;
mod pipeline;
mod quants;
mod step_cuts;
mod tokenizers;

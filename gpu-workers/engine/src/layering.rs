//! The engine's floors, from the bottom: a module imports only from its own floor or below
//! (`docs/ARCHITECTURE.md`, "Layers"; checked by `hearth_testkit::layers`). `DEBT` lists the
//! upward imports the code still has; it only shrinks.

/// From the bottom: leaves (the file format, the KV block pool, text and sampling); the
/// kernels; the models and formats built on them, with the KV tier; what a step uses
/// (adapters, grammar, drafting, the scheduler, CUDA); the engine; what stands beside a
/// running engine (KV transfer, metrics, telemetry, the backend interface); the worker.
const FLOORS: &[&[&str]] = &[
    &["gguf", "kv", "text", "sampling"],
    &["kernels", "pack_cache"],
    &["models", "attention", "hf", "fetch", "kv_tier"],
    &["adapters", "grammar", "speculative", "scheduler", "cuda"],
    &["engine", "inspect"],
    &["kv_transfer", "telemetry", "metrics", "backend"],
    &["server", "host", "sim", "layering"],
];

/// Upward imports not yet removed: `(importer, imported)`.
const DEBT: &[(&str, &str)] = &[
    ("engine", "kv_transfer"),
    ("engine", "metrics"),
    ("kv", "kv_tier"),
    ("kv_tier", "kv_transfer"),
];

/// The largest circle of modules importing each other may not grow (the target is 4). Counted
/// with names the root re-exports resolved to their modules (`crate::EngineHandle` is
/// `engine`).
const MAX_CIRCLE: usize = 13;

#[test]
fn no_module_imports_from_a_floor_above() {
    hearth_testkit::layers::assert_crate_floors(env!("CARGO_MANIFEST_DIR"), FLOORS, DEBT, MAX_CIRCLE);
}

//! The engine's floors, from the bottom: a module imports only from its own floor or below
//! (`docs/ARCHITECTURE.md`, "Layers"; checked by `hearth_testkit::layers`). `DEBT` lists the
//! upward imports the code still has; it only shrinks.

/// From the bottom: leaves (the GGUF format, fetching a model, the architectures' names, the
/// KV block types, sampling, text, grammar, drafting); the kernels and the KV pool and disk
/// tier; attention over the pool; the models with the Hugging Face format they read and
/// write; what the engine uses beside the model (the scheduler, CUDA, adapters, its
/// metrics recorder, inspecting a file, the pipeline's stages and channel); the engine; what stands beside a running engine
/// (KV transfer between workers, trace spans, the backend interface); the worker.
const FLOORS: &[&[&str]] = &[
    &[
        "formats",
        "formats::gguf",
        "formats::fetch",
        "models::arch",
        "kv::block",
        "step",
    ],
    &["kernels", "kv", "kv::pool", "kv::tier"],
    &["attention"],
    &["models", "formats::hf"],
    &[
        "step::scheduler",
        "cuda",
        "engine::adapters",
        "engine::metrics",
        "formats::inspect",
        "pipeline",
    ],
    &["engine"],
    &["kv::transfer", "worker::telemetry", "worker::backend"],
    &["worker", "layering"],
];

/// Upward imports not yet removed: `(importer, imported)`.
const DEBT: &[(&str, &str)] = &[];

/// The largest circle of modules importing each other may not grow. Counted with names the
/// root re-exports resolved to their modules (`crate::EngineHandle` is `engine`).
const MAX_CIRCLE: usize = 4;

#[test]
fn no_module_imports_from_a_floor_above() {
    hearth_testkit::layers::assert_crate_floors(env!("CARGO_MANIFEST_DIR"), FLOORS, DEBT, MAX_CIRCLE);
}

//! The gateway's floors, from the bottom: a module imports only from its own floor or below
//! (`docs/ARCHITECTURE.md`, "Layers"; checked by `hearth_testkit::layers`). `DEBT` lists the
//! upward imports the code still has; it only shrinks.

/// From the bottom. `server`: HTTP, metrics, telemetry, errors, the store; `upstream`: how
/// workers are reached; `policy`: auth, limits, processors; `manage`: the one management
/// service and its channels; `pipeline`: the phases; `api`: each dialect's parse and render;
/// the top: the route table, the state it shares, the dashboard.
const FLOORS: &[&[&str]] = &[
    &["error", "db", "http", "metrics", "telemetry", "redis_conn"],
    &["registry", "workers", "cluster", "queues"],
    &["auth", "limits", "processors"],
    &["management", "adapters", "admin", "selfservice"],
    &["pipeline"],
    &[
        "openai",
        "tools",
        "responses",
        "anthropic",
        "answer",
        "batches",
        "openapi",
    ],
    &["app", "state", "dashboard", "layering"],
];

/// Upward imports not yet removed: `(importer, imported)`.
const DEBT: &[(&str, &str)] = &[
    ("admin", "dashboard"),
    ("admin", "openai"),
    ("admin", "openapi"),
    ("admin", "state"),
    ("auth", "management"),
    ("auth", "state"),
    ("batches", "state"),
    ("cluster", "state"),
    ("metrics", "state"),
    ("openapi", "app"),
    ("pipeline", "anthropic"),
    ("pipeline", "batches"),
    ("pipeline", "openapi"),
    ("pipeline", "state"),
    ("pipeline::admit", "state"),
    ("pipeline::authenticate", "state"),
    ("pipeline::budget", "state"),
    ("pipeline::dispatch", "state"),
    ("pipeline::limit", "state"),
    ("pipeline::meter", "state"),
    ("pipeline::parse", "anthropic"),
    ("pipeline::parse", "openai"),
    ("pipeline::parse", "responses"),
    ("pipeline::postprocess", "anthropic"),
    ("pipeline::postprocess", "responses"),
    ("pipeline::postprocess", "state"),
    ("pipeline::preprocess", "state"),
    ("pipeline::recall", "responses"),
    ("pipeline::recall", "state"),
    ("pipeline::relay", "state"),
    ("pipeline::resolve", "state"),
    ("pipeline::respond", "openai"),
    ("pipeline::tokenize", "openai"),
    ("pipeline::tokenize", "tools"),
    ("responses", "state"),
    ("selfservice", "openapi"),
    ("selfservice", "state"),
];

/// The largest circle of modules importing each other may not grow (the target is 8).
const MAX_CIRCLE: usize = 14;

#[test]
fn no_module_imports_from_a_floor_above() {
    hearth_testkit::layers::assert_crate_floors(env!("CARGO_MANIFEST_DIR"), FLOORS, DEBT, MAX_CIRCLE);
}

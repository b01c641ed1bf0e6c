//! The gateway's floors, from the bottom: a module imports only from its own floor or below
//! (`docs/ARCHITECTURE.md`, "Layers"; checked by `hearth_testkit::layers`). `DEBT` lists the
//! upward imports the code still has; it only shrinks.

/// From the bottom, one floor per folder: `server` (errors, the store, HTTP, telemetry,
/// Redis); `upstream` (the models served and how workers are reached), with
/// `server::metrics`, whose gauges read the registry; `policy` (limits, budgets, processors,
/// the credential throttle); the state the process shares, `auth` read off it, and the
/// `manage` service; `api` (each API's parse and render); the `pipeline`, which calls down
/// into `api`; the other HTTP surfaces (`routes`); the top: the route table and the
/// dashboard.
const FLOORS: &[&[&str]] = &[
    &["server"],
    &["server::metrics", "upstream"],
    &["policy"],
    &["state", "auth", "manage"],
    &["api"],
    &["pipeline"],
    &["routes"],
    &["app", "gate", "dashboard", "layering"],
];

/// Upward imports not yet removed: `(importer, imported)`.
const DEBT: &[(&str, &str)] = &[];

/// The largest circle of modules importing each other may not grow (the target was
/// 8; today `pipeline::dispatch` and `pipeline::disaggregate` call each other).
const MAX_CIRCLE: usize = 2;

#[test]
fn no_module_imports_from_a_floor_above() {
    hearth_testkit::layers::assert_crate_floors(env!("CARGO_MANIFEST_DIR"), FLOORS, DEBT, MAX_CIRCLE);
}

//! What Hearth's test suites share, outside every production crate:
//!
//! * [`layers`] — a crate's modules as floors: reads each source file's `crate::` paths and
//!   fails on an import from a floor above the importer's (the rule `docs/ARCHITECTURE.md`
//!   states), and measures the largest circle of modules importing each other;
//! * [`tier`] — the test tiers (`quick`, `model`, `reference`) kept honest: a helper that
//!   fetches a model or reference data fails a test filed in a tier below it.

pub mod layers;
pub mod tier;

//! Rust client for Hearth's APIs. Not built yet: see ../README.md.

//! The WebAssembly sandbox for tenant processors. Not built yet: see README.md.

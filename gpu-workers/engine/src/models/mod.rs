//! Model architectures, one file each: a config read from the model file, the weights, and
//! a `forward`. Kernels live in [`crate::kernels`] and know nothing about models.

pub mod llama;

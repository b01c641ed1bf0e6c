//! Model files: [`gguf`] reads GGUF (and is the view every model is read through); [`hf`]
//! opens Hugging Face directories as that view and exports them; [`fetch`] acquires the
//! default model; [`inspect`] reports what a file holds and what serving it would take.

pub mod fetch;
pub mod gguf;
pub mod hf;
pub mod inspect;

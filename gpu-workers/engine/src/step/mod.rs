//! What an engine step uses besides the model: [`scheduler`] plans which sequences run and
//! with how many tokens; [`sampling`] picks tokens from logits; [`grammar`] constrains them;
//! [`speculative`] drafts several per step; [`text`] turns tokens into streamed text.

pub mod grammar;
pub mod sampling;
pub mod scheduler;
pub mod speculative;
pub mod text;

//! What a request may do, decided before it is run: rate limits ([`limits`]), spending
//! budgets ([`budget`]), tenant Wasm processors ([`processors`]) and the throttle on bad
//! credentials ([`throttle`]).

pub mod budget;
pub mod limits;
pub mod processors;
pub mod throttle;

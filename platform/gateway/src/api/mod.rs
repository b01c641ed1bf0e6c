//! Each public API's own shapes: requests parsed into the pipeline's terms, answers rendered
//! from its events. OpenAI chat and completions ([`openai`], rendered by [`respond`]), tool
//! calls ([`tools`]), OpenAI Responses ([`responses`]) and Anthropic Messages
//! ([`anthropic`]), whose answers are built as items by [`answer`]; [`schema`] names the
//! shapes for the OpenAPI documents. The pipeline calls down into these modules; none of
//! them calls the pipeline.

pub mod answer;
pub mod anthropic;
pub mod openai;
pub mod respond;
pub mod responses;
pub mod schema;
pub mod tools;

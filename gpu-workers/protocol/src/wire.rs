//! Request/response types for the worker API (`/v1/worker/*`).

use serde::{Deserialize, Serialize};

use crate::TokenizerSpec;

/// How a worker samples the next token. Defaults match OpenAI's (temperature 1, top_p 1).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// 0 means greedy (argmax).
    pub temperature: f32,
    /// Nucleus sampling mass in (0, 1].
    pub top_p: f32,
    /// Keep only the k most likely tokens (0 = off).
    pub top_k: u32,
    /// Seed for the sampler; the same seed and request give the same output.
    pub seed: Option<u64>,
    /// Upper bound on generated tokens (the worker also stops at the context length).
    pub max_tokens: u32,
    /// Generation stops before any of these strings; they are not part of the output.
    pub stop: Vec<String>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            seed: None,
            max_tokens: 256,
            stop: Vec::new(),
        }
    }
}

/// `POST /v1/worker/generate`: token ids in, a stream of [`GenerateEvent`]s out
/// (newline-delimited JSON over HTTP, a channel in-process).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GenerateRequest {
    /// The gateway's request id, for logs and correlation.
    pub request_id: String,
    /// The model the gateway resolved; a worker refuses a model it does not serve.
    pub model: String,
    /// Prompt token ids, already templated.
    pub prompt: Vec<u32>,
    #[serde(default)]
    pub sampling: SamplingParams,
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// End-of-sequence token or a stop string.
    Stop,
    /// `max_tokens` or the context length was reached.
    Length,
    /// The consumer went away before the end.
    Cancelled,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
        }
    }
}

/// Token counts, as the engine reports them (it is the source of truth).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// All prompt tokens, cached or not.
    pub prompt_tokens: u32,
    /// The part of `prompt_tokens` served from the prefix cache.
    pub cached_tokens: u32,
    pub completion_tokens: u32,
}

/// One event of a generation stream.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum GenerateEvent {
    /// One generated token and the text it completes (may be empty while a multi-byte
    /// character or a possible stop string is pending).
    Token { id: u32, text: String },
    /// The last event of a successful stream.
    Done {
        finish_reason: FinishReason,
        usage: Usage,
    },
    /// The last event of a failed stream.
    Error { code: String, message: String },
}

/// `GET /v1/worker/info`: what a worker serves.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WorkerInfo {
    /// The model id clients use (`smollm2-135m-instruct`, or the file stem).
    pub model: String,
    /// Architecture from the model file (`llama`).
    pub architecture: String,
    pub context_length: u32,
    pub parameters: u64,
    pub tokenizer: TokenizerSpec,
}

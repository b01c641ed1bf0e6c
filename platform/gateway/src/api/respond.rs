//! The OpenAI response shapes: a whole `chat.completion` / `text_completion` object, or
//! server-sent events (`data: {chunk}` … `data: [DONE]`), built from the worker's events.

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use hearth_protocol::{FinishReason, GenerateEvent, TokenLogprob, Usage};
use serde_json::{json, Value};

use crate::api::openai;
use crate::server::error::ApiError;
use crate::upstream::registry::ServedModel;
use hearth_protocol::output::{Assistant, AssistantStream, Delta, OutputSpec};

/// A worker's error event as the client's error.
pub fn worker_error(code: &str, message: &str) -> ApiError {
    match code {
        "model_not_found" => ApiError::model_not_found(message),
        "invalid_prompt" => ApiError::invalid("prompt", message.to_string()),
        "context_length_exceeded" => ApiError::context_length(message.to_string()),
        "worker_disconnected"
        | "engine_stopped"
        | "worker_unavailable"
        | "grammar_unavailable"
        | "draining"
        | "shutting_down" => ApiError::unavailable(message.to_string()),
        "model_loading" => ApiError::model_loading(message.to_string()),
        "request_timeout" => ApiError::timed_out("request_timeout", message.to_string()),
        "stream_idle_timeout" => ApiError::timed_out("stream_idle_timeout", message.to_string()),
        "overloaded" => ApiError::overloaded(message.to_string(), 1),
        "model_load_failed" => ApiError::unavailable(message.to_string()),
        // A LoRA adapter the worker could not use.
        "adapter_not_found" => ApiError::not_found(message.to_string()).with_param("model"),
        "invalid_adapter" => ApiError::invalid("model", message.to_string()),
        "adapter_unavailable" => ApiError::unavailable(message.to_string()),
        // A schema the engine's grammar compiler refused (the relay names the parameter).
        "unsupported_schema" => ApiError::unsupported("response_format", message.to_string()),
        "invalid_schema" => ApiError::invalid("response_format", message.to_string()),
        c if c.starts_with("processor:") => crate::policy::processors::stream_error(&c["processor:".len()..], message),
        _ => ApiError::internal(format!("generation failed: {message}")),
    }
}

/// The OpenAI endpoint a response is shaped for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Chat,
    Completions,
}

/// What every object and chunk of one response shares.
pub struct Shape {
    pub endpoint: Kind,
    pub id: String,
    pub model: Arc<ServedModel>,
    pub created: i64,
    pub n: usize,
    /// How answers are read: tool calls and reasoning (chat), or plain text.
    pub output: OutputSpec,
    /// The prompt's tokens: a stream that fails reports them in its usage chunk (as its usage
    /// record bills them) once something was generated.
    pub prompt_tokens: u32,
}

impl Shape {
    fn id(&self) -> String {
        match self.endpoint {
            Kind::Chat => format!("chatcmpl-{}", self.id),
            Kind::Completions => format!("cmpl-{}", self.id),
        }
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.endpoint, chunk) {
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Completions, _) => "text_completion",
        }
    }

    fn token_text(&self, id: u32) -> (String, Vec<u8>) {
        let bytes = self
            .model
            .tokenizer
            .token_bytes(id)
            .map(<[u8]>::to_vec)
            .unwrap_or_default();
        (String::from_utf8_lossy(&bytes).into_owned(), bytes)
    }

    /// OpenAI's chat logprob entry for one token.
    fn chat_logprob(&self, id: u32, logprob: f32, top: &[TokenLogprob]) -> Value {
        let (token, bytes) = self.token_text(id);
        let top: Vec<Value> = top
            .iter()
            .map(|t| {
                let (token, bytes) = self.token_text(t.id);
                json!({"token": token, "logprob": t.logprob, "bytes": bytes})
            })
            .collect();
        json!({"token": token, "logprob": logprob, "bytes": bytes, "top_logprobs": top})
    }

    fn chunk(&self, choices: Value, usage: Option<Value>, include_usage: bool) -> Value {
        let mut v = json!({
            "id": self.id(), "object": self.object(true), "created": self.created, "model": self.model.id,
            "system_fingerprint": fingerprint(), "choices": choices,
        });
        if include_usage {
            v["usage"] = usage.unwrap_or(Value::Null);
        }
        v
    }
}

fn fingerprint() -> String {
    format!("hearth-{}", env!("CARGO_PKG_VERSION"))
}

fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

/// The legacy completions `logprobs` object, built up token by token.
#[derive(Default)]
struct LegacyLogprobs {
    tokens: Vec<String>,
    token_logprobs: Vec<f32>,
    top_logprobs: Vec<serde_json::Map<String, Value>>,
    text_offset: Vec<usize>,
}

impl LegacyLogprobs {
    fn push(&mut self, shape: &Shape, id: u32, logprob: f32, top: &[TokenLogprob], offset: usize) {
        self.tokens.push(shape.token_text(id).0);
        self.token_logprobs.push(logprob);
        self.top_logprobs.push(
            top.iter()
                .map(|t| (shape.token_text(t.id).0, json!(t.logprob)))
                .collect(),
        );
        self.text_offset.push(offset);
    }

    fn json(&self) -> Value {
        json!({"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs, "text_offset": self.text_offset})
    }
}

/// Server-sent events exactly as OpenAI clients expect: `data: {chunk}` … `data: [DONE]`.
pub fn sse_response(
    shape: Shape,
    include_usage: bool,
    events: futures_util::stream::BoxStream<'static, GenerateEvent>,
) -> Response {
    let mut started = vec![false; shape.n];
    let mut offsets = vec![0usize; shape.n];
    // (Completions get a plain spec: only chat answers are read.)
    let parse = !shape.output.is_plain();
    let mut readers: Vec<AssistantStream> = (0..shape.n).map(|_| shape.output.stream()).collect();
    let mut generated = 0u32;
    let body = events
        .map(move |ev| {
            let mut out = Vec::new();
            match ev {
                GenerateEvent::Token { index, id, text, logprob, top_logprobs } => {
                    generated += 1;
                    let i = index as usize;
                    let first = !started.get(i).copied().unwrap_or(true);
                    match shape.endpoint {
                        Kind::Chat => {
                            let lp = logprob.map(|lp| json!({"content": [shape.chat_logprob(id, lp, &top_logprobs)]}));
                            let deltas = match readers.get_mut(i) {
                                Some(r) if parse => r.push_token(&text),
                                _ => vec![Delta::Content(text)],
                            };
                            chat_deltas(&shape, &mut out, index, first, deltas, lp, include_usage);
                        }
                        Kind::Completions => {
                            if first || !text.is_empty() || logprob.is_some() {
                                let lp = logprob.map(|lp| {
                                    let mut l = LegacyLogprobs::default();
                                    l.push(&shape, id, lp, &top_logprobs, offsets.get(i).copied().unwrap_or(0));
                                    l.json()
                                });
                                let choice = json!({"index": index, "text": text, "logprobs": lp, "finish_reason": null});
                                out.push(sse(&shape.chunk(json!([choice]), None, include_usage)));
                            }
                            if let Some(o) = offsets.get_mut(i) {
                                *o += text.len();
                            }
                        }
                    }
                    if !out.is_empty() {
                        if let Some(s) = started.get_mut(i) {
                            *s = true;
                        }
                    }
                }
                GenerateEvent::Finish { index, finish_reason } => {
                    let i = index as usize;
                    let mut reason = finish_reason.as_str();
                    if let (true, Some(r)) = (parse, readers.get_mut(i)) {
                        let first = !started.get(i).copied().unwrap_or(true);
                        chat_deltas(&shape, &mut out, index, first, r.finish(), None, include_usage);
                        if r.calls() > 0 && finish_reason == FinishReason::Stop {
                            reason = "tool_calls";
                        }
                    }
                    let choice = match shape.endpoint {
                        Kind::Chat => json!({"index": index, "delta": {}, "logprobs": null, "finish_reason": reason}),
                        Kind::Completions => {
                            json!({"index": index, "text": "", "logprobs": null, "finish_reason": finish_reason.as_str()})
                        }
                    };
                    out.push(sse(&shape.chunk(json!([choice]), None, include_usage)));
                }
                GenerateEvent::Done { usage, .. } => {
                    if include_usage {
                        let reasoning = readers.iter().map(AssistantStream::reasoning_tokens).sum();
                        out.push(sse(&shape.chunk(json!([]), Some(openai::usage_json_with(&usage, reasoning)), true)));
                    }
                    out.push(Bytes::from_static(b"data: [DONE]\n\n"));
                }
                GenerateEvent::Error { code, message } => {
                    out.push(sse(&worker_error(&code, &message).body()));
                    if include_usage {
                        // What the request's usage record bills: nothing if nothing was
                        // generated, else the prompt and the tokens generated.
                        let usage = hearth_protocol::Usage {
                            prompt_tokens: if generated > 0 { shape.prompt_tokens } else { 0 },
                            cached_tokens: 0,
                            completion_tokens: generated,
                        };
                        out.push(sse(&shape.chunk(json!([]), Some(openai::usage_json(&usage)), true)));
                    }
                    out.push(Bytes::from_static(b"data: [DONE]\n\n"));
                }
            }
            futures_util::stream::iter(out.into_iter().map(Ok::<_, Infallible>))
        })
        .flatten();
    event_stream(body)
}

/// A server-sent-events response over `body` (every API's streams: no caching, no proxy
/// buffering).
pub fn event_stream(body: impl futures_util::Stream<Item = Result<Bytes, Infallible>> + Send + 'static) -> Response {
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .header("x-accel-buffering", "no")
        .body(Body::from_stream(body))
        .unwrap_or_else(|_| ApiError::internal("could not build the stream").into_response())
}

/// A streamed chat token's deltas as chunks: content, or tool-call pieces. The first chunk of
/// a choice carries its role; a token that produced nothing yet sends a chunk only when it is
/// the first or has log-probabilities to report.
fn chat_deltas(
    shape: &Shape,
    out: &mut Vec<Bytes>,
    index: u32,
    first: bool,
    deltas: Vec<Delta>,
    mut lp: Option<Value>,
    include_usage: bool,
) {
    let mut pieces: Vec<serde_json::Map<String, Value>> = deltas
        .into_iter()
        .filter(|d| !matches!(d, Delta::Content(t) | Delta::Reasoning(t) if t.is_empty()))
        .map(|d| {
            let v = match d {
                Delta::Content(text) => json!({"content": text}),
                Delta::Reasoning(text) => json!({"reasoning_content": text}),
                Delta::CallStart { index, id, name } => json!({"tool_calls": [
                    {"index": index, "id": id, "type": "function", "function": {"name": name, "arguments": ""}}
                ]}),
                Delta::Arguments { index, text } => {
                    json!({"tool_calls": [{"index": index, "function": {"arguments": text}}]})
                }
            };
            match v {
                Value::Object(m) => m,
                _ => serde_json::Map::new(),
            }
        })
        .collect();
    if pieces.is_empty() && (first || lp.is_some()) {
        pieces.push(serde_json::Map::from_iter([("content".to_string(), json!(""))]));
    }
    for (k, mut delta) in pieces.into_iter().enumerate() {
        if first && k == 0 {
            delta.insert("role".into(), json!("assistant"));
        }
        let choice = json!({"index": index, "delta": delta, "logprobs": lp.take(), "finish_reason": null});
        out.push(sse(&shape.chunk(json!([choice]), None, include_usage)));
    }
}

/// One choice of a non-streamed response, as it accumulates.
struct Collected {
    text: String,
    /// The answer read as it arrives (the stream's reader, so both agree).
    reader: AssistantStream,
    deltas: Vec<Delta>,
    finish: Option<FinishReason>,
    chat_logprobs: Vec<Value>,
    legacy: LegacyLogprobs,
    any_logprobs: bool,
}

pub async fn collect_response(
    shape: &Shape,
    mut events: futures_util::stream::BoxStream<'static, GenerateEvent>,
) -> Result<Value, ApiError> {
    let mut choices: Vec<Collected> = (0..shape.n)
        .map(|_| Collected {
            text: String::new(),
            reader: shape.output.stream(),
            deltas: Vec::new(),
            finish: None,
            chat_logprobs: Vec::new(),
            legacy: LegacyLogprobs::default(),
            any_logprobs: false,
        })
        .collect();
    while let Some(ev) = events.next().await {
        match ev {
            GenerateEvent::Token {
                index,
                id,
                text,
                logprob,
                top_logprobs,
            } => {
                let Some(c) = choices.get_mut(index as usize) else {
                    continue;
                };
                if let Some(lp) = logprob {
                    c.any_logprobs = true;
                    match shape.endpoint {
                        Kind::Chat => c.chat_logprobs.push(shape.chat_logprob(id, lp, &top_logprobs)),
                        Kind::Completions => c.legacy.push(shape, id, lp, &top_logprobs, c.text.len()),
                    }
                }
                if shape.output.is_plain() {
                    c.text.push_str(&text);
                } else {
                    let d = c.reader.push_token(&text);
                    c.deltas.extend(d);
                }
            }
            GenerateEvent::Finish { index, finish_reason } => {
                if let Some(c) = choices.get_mut(index as usize) {
                    c.finish = Some(finish_reason);
                }
            }
            GenerateEvent::Done {
                finish_reason, usage, ..
            } => {
                for c in &mut choices {
                    let d = c.reader.finish();
                    c.deltas.extend(d);
                }
                return Ok(completion_body(shape, &choices, finish_reason, &usage));
            }
            GenerateEvent::Error { code, message } => return Err(worker_error(&code, &message)),
        }
    }
    Err(ApiError::unavailable("the worker ended the stream without finishing"))
}

fn completion_body(shape: &Shape, choices: &[Collected], default_finish: FinishReason, usage: &Usage) -> Value {
    let reasoning_tokens = choices.iter().map(|c| c.reader.reasoning_tokens()).sum();
    let choices: Vec<Value> = choices
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let reason = c.finish.unwrap_or(default_finish);
            let finish = reason.as_str();
            match shape.endpoint {
                Kind::Chat if !shape.output.is_plain() => {
                    let lp = c.any_logprobs.then(|| json!({"content": c.chat_logprobs}));
                    let a = Assistant::collect(c.deltas.iter().cloned());
                    let mut message = json!({"role": "assistant", "content": a.content, "refusal": null});
                    if let Some(r) = a.reasoning {
                        message["reasoning_content"] = json!(r);
                    }
                    let mut finish = finish;
                    if !a.calls.is_empty() {
                        message["tool_calls"] = a
                            .calls
                            .iter()
                            .map(|c| json!({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}))
                            .collect();
                        if reason == FinishReason::Stop {
                            finish = "tool_calls";
                        }
                    }
                    json!({"index": i, "message": message, "logprobs": lp, "finish_reason": finish})
                }
                Kind::Chat => {
                    let lp = c.any_logprobs.then(|| json!({"content": c.chat_logprobs}));
                    json!({
                        "index": i, "message": {"role": "assistant", "content": c.text, "refusal": null},
                        "logprobs": lp, "finish_reason": finish,
                    })
                }
                Kind::Completions => {
                    let lp = c.any_logprobs.then(|| c.legacy.json());
                    json!({"index": i, "text": c.text, "logprobs": lp, "finish_reason": finish})
                }
            }
        })
        .collect();
    json!({
        "id": shape.id(), "object": shape.object(false), "created": shape.created, "model": shape.model.id,
        "system_fingerprint": fingerprint(), "choices": choices,
        "usage": openai::usage_json_with(usage, reasoning_tokens),
    })
}

//! The Anthropic Messages API (`POST /v1/messages`, what Claude Code speaks, and
//! `/v1/messages/count_tokens`) as a translation onto the chat pipeline: the request's
//! system blocks, messages and content blocks become a chat request (validated by the same
//! parser); the worker's events become content blocks through [`Answer`], streamed as
//! Anthropic's event sequence or returned whole; errors take Anthropic's shape.
//!
//! Usage follows Anthropic's accounting: `input_tokens` is the part of the prompt not read
//! from the prefix cache, `cache_read_input_tokens` the part that was, and
//! `cache_creation_input_tokens` is 0 (Hearth caches every prompt's full blocks without a
//! write charge) — the three add up to the prompt. A stream's `message_start` cannot know
//! the cache hit yet: it counts the whole prompt as `input_tokens`, and `message_delta`
//! carries the final figures (cumulative, as the API documents; the SDKs take them).
//!
//! Claude Code's first system block, `x-anthropic-billing-header: …`, changes with every
//! request; it is dropped before tokenizing (unless the gateway is told to keep it), so
//! that a session's turns share their prompt's prefix in the cache.

use axum::body::Bytes;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::StreamExt;
use hearth_protocol::{FinishReason, Usage};
use serde_json::{json, Map, Value};

use crate::api::answer::{Answer, Change, End, Kind, Part};
use crate::api::openai::{self, get, wrong_type, ChatRequest};
use crate::server::error::ApiError;
use crate::upstream::workers::EventStream;

/// The system block Claude Code sends first, different on every request.
pub const BILLING_HEADER: &str = "x-anthropic-billing-header:";

/// What a Messages request carries beyond the chat request it becomes.
#[derive(Debug, Clone)]
pub struct Request {
    pub hex: String,
}

/// Parameter names of the chat request → this API's.
fn rename(e: ApiError) -> ApiError {
    let Some(p) = e.param.clone() else { return e };
    let renamed = if p == "stop" {
        "stop_sequences".to_string()
    } else if p.starts_with("tools") {
        "tools".to_string()
    } else if p.starts_with("messages") {
        "messages".to_string()
    } else {
        p
    };
    e.with_param(renamed)
}

fn blocks<'a>(param: &str, content: &'a Value) -> Result<Vec<&'a Map<String, Value>>, ApiError> {
    match content {
        Value::Array(a) => a
            .iter()
            .enumerate()
            .map(|(j, b)| {
                b.as_object()
                    .ok_or_else(|| wrong_type(&format!("{param}[{j}]"), "an object", b))
            })
            .collect(),
        v => Err(wrong_type(param, "a string or an array of content blocks", v)),
    }
}

fn block_text(b: &Map<String, Value>) -> &str {
    b.get("text").and_then(Value::as_str).unwrap_or("")
}

/// A tool result's content: a string, or text blocks (images refused by name).
fn result_text(param: &str, content: Option<&Value>) -> Result<String, ApiError> {
    match content {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(v) => {
            let mut out = Vec::new();
            for (j, b) in blocks(param, v)?.into_iter().enumerate() {
                match b.get("type").and_then(Value::as_str) {
                    Some("text") => out.push(block_text(b).to_string()),
                    Some(kind @ ("image" | "document")) => {
                        return Err(refused_block(&format!("{param}[{j}].type"), kind))
                    }
                    _ => {}
                }
            }
            Ok(out.join("\n"))
        }
    }
}

fn refused_block(param: &str, kind: &str) -> ApiError {
    ApiError::unsupported(
        param,
        format!("content blocks of type {kind:?} are not supported: the models served read text"),
    )
}

/// `system`: a string or text blocks; Claude Code's billing header dropped unless kept.
fn system_text(system: Option<&Value>, keep_billing_header: bool) -> Result<Option<String>, ApiError> {
    match system {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(v) => {
            let texts: Vec<&str> = blocks("system", v)?
                .into_iter()
                .map(block_text)
                .filter(|t| keep_billing_header || !t.starts_with(BILLING_HEADER))
                .collect();
            Ok((!texts.is_empty()).then(|| texts.join("\n\n")))
        }
    }
}

/// The messages in chat's shape: tool results become `tool` messages (before the user's
/// text of the same turn, as the API orders them), `tool_use` blocks calls, `thinking` the
/// turn's reasoning.
fn conversation(system: Option<String>, messages: &[Value]) -> Result<Vec<Value>, ApiError> {
    let mut out = Vec::new();
    if let Some(s) = system {
        out.push(json!({"role": "system", "content": s}));
    }
    for (i, m) in messages.iter().enumerate() {
        let p = format!("messages[{i}]");
        let Some(m) = m.as_object() else {
            return Err(wrong_type(&p, "an object", m));
        };
        let content = m.get("content").unwrap_or(&Value::Null);
        let role = match m.get("role").and_then(Value::as_str) {
            Some(r @ ("user" | "assistant")) => r,
            // Claude Code sends system reminders as `system` messages: they join the system
            // prompt (templates want it first and once).
            Some("system") => {
                let text = match content {
                    Value::String(s) => s.clone(),
                    v => blocks(&format!("{p}.content"), v)?
                        .into_iter()
                        .map(block_text)
                        .collect::<Vec<_>>()
                        .join("\n\n"),
                };
                match out.first_mut() {
                    Some(first) if first["role"] == "system" => {
                        let joined = format!("{}\n\n{text}", first["content"].as_str().unwrap_or(""));
                        first["content"] = json!(joined);
                    }
                    _ => out.insert(0, json!({"role": "system", "content": text})),
                }
                continue;
            }
            other => {
                return Err(ApiError::invalid(
                    &format!("{p}.role"),
                    format!(
                        "'role' must be user or assistant, got {}",
                        other.map_or("none".into(), |r| format!("{r:?}"))
                    ),
                ))
            }
        };
        if let Value::String(s) = content {
            out.push(json!({"role": role, "content": s}));
            continue;
        }
        let mut text = String::new();
        let mut calls = Vec::new();
        let mut reasoning = String::new();
        for (j, b) in blocks(&format!("{p}.content"), content)?.into_iter().enumerate() {
            let bp = format!("{p}.content[{j}]");
            match b.get("type").and_then(Value::as_str).unwrap_or("") {
                "text" => text.push_str(block_text(b)),
                kind @ ("image" | "document") => return Err(refused_block(&format!("{bp}.type"), kind)),
                "tool_result" if role == "user" => {
                    let Some(id) = b.get("tool_use_id").and_then(Value::as_str) else {
                        return Err(ApiError::invalid(
                            &format!("{bp}.tool_use_id"),
                            "a tool_result needs the 'tool_use_id' it answers",
                        ));
                    };
                    let mut result = result_text(&format!("{bp}.content"), b.get("content"))?;
                    if b.get("is_error") == Some(&Value::Bool(true)) {
                        result = format!("Error: {result}");
                    }
                    out.push(json!({"role": "tool", "tool_call_id": call_id(id), "content": result}));
                }
                "tool_use" if role == "assistant" => {
                    let (Some(id), Some(name)) = (
                        b.get("id").and_then(Value::as_str),
                        b.get("name").and_then(Value::as_str),
                    ) else {
                        return Err(ApiError::invalid(&bp, "a tool_use block needs 'id' and 'name'"));
                    };
                    let input = b.get("input").cloned().unwrap_or_else(|| json!({}));
                    calls.push(json!({"id": call_id(id), "type": "function",
                                      "function": {"name": name, "arguments": input.to_string()}}));
                }
                "thinking" if role == "assistant" => {
                    reasoning.push_str(b.get("thinking").and_then(Value::as_str).unwrap_or(""))
                }
                // Encrypted by another provider, and server tools' blocks: nothing to read.
                "redacted_thinking" | "server_tool_use" | "web_search_tool_result" => {}
                other => {
                    return Err(ApiError::invalid(
                        &format!("{bp}.type"),
                        format!("content blocks of type {other:?} are not accepted in a {role} message"),
                    ))
                }
            }
        }
        if role == "assistant" {
            let mut a = json!({"role": "assistant", "content": text});
            if !calls.is_empty() {
                a["tool_calls"] = Value::Array(calls);
            }
            if !reasoning.is_empty() {
                a["reasoning_content"] = json!(reasoning);
            }
            out.push(a);
        } else if !text.is_empty() || !out.last().is_some_and(|m: &Value| m["role"] == "tool") {
            out.push(json!({"role": "user", "content": text}));
        }
    }
    Ok(out)
}

/// Parses a Messages request (or, `count_only`, a count_tokens one: no `max_tokens`).
pub fn parse(
    body: &[u8],
    headers: &HeaderMap,
    hex: &str,
    keep_billing_header: bool,
    count_only: bool,
) -> Result<(ChatRequest, Request), ApiError> {
    let o = openai::parse_object(body)?;
    let mut chat = Map::new();
    // (`seed`, `ignore_eos`, `min_tokens`, `speculative`: Hearth's extensions, as on chat.)
    for key in [
        "model",
        "temperature",
        "top_p",
        "top_k",
        "stream",
        "seed",
        "ignore_eos",
        "min_tokens",
        "speculative",
    ] {
        if let Some(v) = get(&o, key) {
            chat.insert(key.into(), v.clone());
        }
    }
    match get(&o, "max_tokens") {
        Some(v) => {
            chat.insert("max_tokens".into(), v.clone());
        }
        None if count_only => {}
        None => return Err(ApiError::invalid("max_tokens", "max_tokens: Field required")),
    }
    if let Some(s) = get(&o, "stop_sequences") {
        chat.insert("stop".into(), s.clone());
    }
    let system = system_text(get(&o, "system"), keep_billing_header)?;
    let messages = match get(&o, "messages") {
        Some(Value::Array(a)) if !a.is_empty() => a,
        Some(Value::Array(_)) => return Err(ApiError::invalid("messages", "'messages' must not be empty")),
        Some(v) => return Err(wrong_type("messages", "an array", v)),
        None => return Err(ApiError::invalid("messages", "messages: Field required")),
    };
    chat.insert("messages".into(), Value::Array(conversation(system, messages)?));
    // Custom tools (no type, or "custom") in chat's shape; Anthropic's server and client
    // tools with their own types (bash, web search, …) are left out.
    let mut names = Vec::new();
    if let Some(tools) = get(&o, "tools") {
        let Some(list) = tools.as_array() else {
            return Err(wrong_type("tools", "an array", tools));
        };
        let mut functions = Vec::new();
        for (i, t) in list.iter().enumerate() {
            if t.get("type").and_then(Value::as_str).is_some_and(|k| k != "custom") {
                continue;
            }
            let Some(name) = t.get("name").and_then(Value::as_str) else {
                return Err(ApiError::invalid(&format!("tools[{i}].name"), "a tool needs a 'name'"));
            };
            names.push(name.to_string());
            let mut f = json!({"name": name, "parameters": t.get("input_schema").cloned().unwrap_or(json!({"type": "object"}))});
            if let Some(d) = t.get("description").filter(|d| d.is_string()) {
                f["description"] = d.clone();
            }
            functions.push(json!({"type": "function", "function": f}));
        }
        if !functions.is_empty() {
            chat.insert("tools".into(), Value::Array(functions));
        }
    }
    if let Some(choice) = get(&o, "tool_choice") {
        let Some(c) = choice.as_object() else {
            return Err(wrong_type("tool_choice", "an object", choice));
        };
        let tc = match c.get("type").and_then(Value::as_str) {
            Some("auto") => json!("auto"),
            Some("any") => json!("required"),
            Some("none") => json!("none"),
            Some("tool") => {
                json!({"type": "function", "function": {"name": c.get("name").cloned().unwrap_or(Value::Null)}})
            }
            other => {
                return Err(ApiError::invalid(
                    "tool_choice.type",
                    format!("'tool_choice.type' must be auto, any, tool or none, got {other:?}"),
                ))
            }
        };
        if !(names.is_empty() && tc == "auto") {
            chat.insert("tool_choice".into(), tc);
        }
        if c.get("disable_parallel_tool_use") == Some(&Value::Bool(true)) && !names.is_empty() {
            chat.insert("parallel_tool_calls".into(), json!(false));
        }
    }
    // Thinking only when asked for (the API's default is none).
    let thinking = get(&o, "thinking")
        .and_then(|t| t.get("type"))
        .and_then(Value::as_str)
        .is_some_and(|t| t == "enabled" || t == "adaptive");
    chat.insert("chat_template_kwargs".into(), json!({"enable_thinking": thinking}));
    let mut r = openai::parse_chat_object(&chat).map_err(rename)?;
    // Claude Code's session (its header, else the session in `metadata.user_id`) pins the
    // conversation to a worker.
    let session = headers
        .get("x-claude-code-session-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
        .or_else(|| {
            let user = get(&o, "metadata")?.get("user_id")?.as_str()?;
            Some(user.rsplit_once("session_").map_or(user, |(_, s)| s).to_string())
        })
        .filter(|s| !s.is_empty());
    if session.is_some() {
        r.common.session = session;
    }
    // `max_tokens` is a cap here: Claude Code asks for 32,000 whatever the model's context.
    r.common.clamp_max_tokens = true;
    Ok((r, Request { hex: hex.to_string() }))
}

/// The model's call id for a `toolu_…` id (templates check the shape of ids: Mistral's
/// want nine letters and digits, which is what the model wrote).
fn call_id(tool_use_id: &str) -> String {
    match tool_use_id.strip_prefix("toolu_") {
        Some(rest) if rest.len() == 16 && rest.bytes().all(|b| b.is_ascii_hexdigit()) => format!("call_{rest}"),
        Some(rest) => rest.to_string(),
        None => tool_use_id.to_string(),
    }
}

/// `toolu_…` for a call id of the model's tool format.
fn tool_use_id(call_id: &str) -> String {
    match call_id.strip_prefix("call_") {
        Some(rest) => format!("toolu_{rest}"),
        None if call_id.starts_with("toolu_") => call_id.to_string(),
        None => format!("toolu_{call_id}"),
    }
}

fn block_json(p: &Part) -> Value {
    match p.kind {
        Kind::Text => json!({"type": "text", "text": p.text}),
        // Hearth's reasoning is its own: the signature only marks the block as Hearth's.
        Kind::Reasoning => json!({"type": "thinking", "thinking": p.text, "signature": format!("hearth:{}", p.id)}),
        Kind::Call => json!({"type": "tool_use", "id": tool_use_id(&p.call_id), "name": p.name,
                             "input": serde_json::from_str::<Value>(&p.text).unwrap_or_else(|_| json!({}))}),
    }
}

fn start_json(p: &Part) -> Value {
    match p.kind {
        Kind::Text => json!({"type": "text", "text": ""}),
        Kind::Reasoning => json!({"type": "thinking", "thinking": "", "signature": ""}),
        Kind::Call => json!({"type": "tool_use", "id": tool_use_id(&p.call_id), "name": p.name, "input": {}}),
    }
}

/// Anthropic's usage: the three input counts add up to the prompt.
pub fn usage_json(u: &Usage) -> Value {
    json!({
        "input_tokens": u.prompt_tokens.saturating_sub(u.cached_tokens),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": u.cached_tokens,
        "output_tokens": u.completion_tokens,
    })
}

fn stop_reason(reason: FinishReason, calls: bool) -> &'static str {
    match reason {
        FinishReason::Length => "max_tokens",
        _ if calls => "tool_use",
        _ => "end_turn",
    }
}

/// What every message object of one response shares.
pub struct Shape {
    pub hex: String,
    pub model: String,
    pub prompt_tokens: u32,
}

impl Shape {
    fn message(&self, answer: &Answer, reason: Option<FinishReason>, usage: &Usage) -> Value {
        json!({
            "id": format!("msg_{}", self.hex), "type": "message", "role": "assistant", "model": self.model,
            "content": answer.parts.iter().map(block_json).collect::<Vec<_>>(),
            "stop_reason": reason.map(|r| stop_reason(r, answer.has_calls())),
            "stop_sequence": null, "usage": usage_json(usage),
        })
    }
}

/// The whole message.
pub async fn collect(
    shape: &Shape,
    output: &hearth_protocol::output::OutputSpec,
    mut events: EventStream,
) -> Result<Value, ApiError> {
    let mut answer = Answer::new(output, &shape.hex);
    while let Some(ev) = events.next().await {
        match answer.event(ev).1 {
            Some(End::Finished { reason, usage }) => return Ok(shape.message(&answer, Some(reason), &usage)),
            Some(End::Failed { code, message, .. }) => return Err(crate::api::respond::worker_error(&code, &message)),
            None => {}
        }
    }
    Err(ApiError::unavailable("the worker ended the stream without finishing"))
}

fn sse(kind: &str, data: &Value) -> Bytes {
    Bytes::from(format!("event: {kind}\ndata: {data}\n\n"))
}

fn change(a: &Answer, c: &Change, out: &mut Vec<Bytes>) {
    match c {
        Change::Open(i) => out.push(sse(
            "content_block_start",
            &json!({"type": "content_block_start", "index": i, "content_block": start_json(&a.parts[*i])}),
        )),
        Change::Append(i, text) => {
            let delta = match a.parts[*i].kind {
                Kind::Text => json!({"type": "text_delta", "text": text}),
                Kind::Reasoning => json!({"type": "thinking_delta", "thinking": text}),
                Kind::Call => json!({"type": "input_json_delta", "partial_json": text}),
            };
            out.push(sse(
                "content_block_delta",
                &json!({"type": "content_block_delta", "index": i, "delta": delta}),
            ));
        }
        Change::Close(i) => {
            let p = &a.parts[*i];
            if p.kind == Kind::Reasoning {
                let delta = json!({"type": "signature_delta", "signature": format!("hearth:{}", p.id)});
                out.push(sse(
                    "content_block_delta",
                    &json!({"type": "content_block_delta", "index": i, "delta": delta}),
                ));
            }
            out.push(sse(
                "content_block_stop",
                &json!({"type": "content_block_stop", "index": i}),
            ));
        }
    }
}

/// Anthropic's event sequence: `message_start`, `ping`, the content blocks, `message_delta`
/// (stop reason, cumulative usage), `message_stop`; a failure is an `error` event.
pub fn stream(shape: Shape, output: hearth_protocol::output::OutputSpec, mut events: EventStream) -> Response {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::convert::Infallible>>(64);
    tokio::spawn(async move {
        let mut answer = Answer::new(&output, &shape.hex);
        let start = Usage {
            prompt_tokens: shape.prompt_tokens,
            cached_tokens: 0,
            completion_tokens: 0,
        };
        let mut out = vec![
            sse(
                "message_start",
                &json!({"type": "message_start", "message": shape.message(&answer, None, &start)}),
            ),
            sse("ping", &json!({"type": "ping"})),
        ];
        loop {
            let ev = events.next().await.unwrap_or(hearth_protocol::GenerateEvent::Error {
                code: "worker_disconnected".into(),
                message: "the worker ended the stream without finishing".into(),
            });
            let (changes, end) = answer.event(ev);
            for c in &changes {
                change(&answer, c, &mut out);
            }
            let last = end.is_some();
            match end {
                Some(End::Finished { reason, usage }) => {
                    out.push(sse(
                        "message_delta",
                        &json!({"type": "message_delta",
                                "delta": {"stop_reason": stop_reason(reason, answer.has_calls()), "stop_sequence": null},
                                "usage": usage_json(&usage)}),
                    ));
                    out.push(sse("message_stop", &json!({"type": "message_stop"})));
                }
                Some(End::Failed { code, message, .. }) => {
                    let e = crate::api::respond::worker_error(&code, &message);
                    out.push(sse("error", &error_body(&e)));
                }
                None => {}
            }
            for b in out.drain(..) {
                if tx.send(Ok(b)).await.is_err() {
                    return; // the client went away: dropping `events` cancels the generation
                }
            }
            if last {
                return;
            }
        }
    });
    crate::api::respond::event_stream(tokio_stream::wrappers::ReceiverStream::new(rx))
}

/// Anthropic's error type and status for an error.
fn error_kind(e: &ApiError) -> (StatusCode, &'static str) {
    match e.status.as_u16() {
        400 => (e.status, "invalid_request_error"),
        401 => (e.status, "authentication_error"),
        402 => (e.status, "billing_error"),
        403 => (e.status, "permission_error"),
        404 => (e.status, "not_found_error"),
        413 => (e.status, "request_too_large"),
        429 => (e.status, "rate_limit_error"),
        503 if matches!(e.code, Some("overloaded" | "model_loading")) => {
            (StatusCode::from_u16(529).unwrap_or(e.status), "overloaded_error")
        }
        504 => (e.status, "timeout_error"),
        _ => (e.status, "api_error"),
    }
}

/// `{"type": "error", "error": {"type", "message"}}`.
pub fn error_body(e: &ApiError) -> Value {
    let (_, kind) = error_kind(e);
    let mut message = e.message.clone();
    if let Some(p) = &e.param {
        message = format!("{p}: {message}");
    }
    json!({"type": "error", "error": {"type": kind, "message": message}})
}

/// An error in Anthropic's shape and status (529 for a shed request), `retry-after` kept.
pub fn error_response(e: &ApiError) -> Response {
    let (status, _) = error_kind(e);
    let mut resp = (status, Json(error_body(e))).into_response();
    if let Some(secs) = e.retry_after {
        if let Ok(v) = header::HeaderValue::from_str(&secs.to_string()) {
            resp.headers_mut().insert(header::RETRY_AFTER, v);
        }
    }
    resp
}

/// `count_tokens`' answer.
pub fn count_json(prompt_tokens: u32) -> Value {
    json!({"input_tokens": prompt_tokens})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_json(v: Value) -> Result<(ChatRequest, Request), ApiError> {
        parse(v.to_string().as_bytes(), &HeaderMap::new(), "ab", false, false)
    }

    #[test]
    fn blocks_become_one_conversation() {
        let (chat, _) = parse_json(json!({
            "model": "m", "max_tokens": 32000,
            "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=123;"},
                       {"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}}],
            "messages": [
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "Use the tool.", "signature": "s"},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "21C"}]},
                    {"type": "text", "text": "thanks"}]}
            ],
            "tools": [{"name": "get_weather", "input_schema": {"type": "object"}},
                      {"type": "web_search_20250305", "name": "web_search"}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": true},
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "context_management": {"edits": []}, "output_config": {}, "metadata": {"user_id": "user_1_account__session_abc"}
        }))
        .unwrap();
        let m = &chat.messages;
        assert_eq!(m[0].content, "You are a coding agent.", "the billing header is dropped");
        assert_eq!(m[2].reasoning_content.as_deref(), Some("Use the tool."));
        assert_eq!(m[2].tool_calls[0].function.arguments, json!({"city": "Paris"}));
        assert_eq!(m[3].role, "tool");
        assert_eq!(m[3].name.as_deref(), Some("get_weather"));
        assert_eq!(m[4].content, "thanks");
        let tools = chat.common.tools.as_ref().unwrap();
        assert_eq!(tools.tools.len(), 1);
        assert!(tools.forced() && !tools.parallel);
        assert_eq!(chat.common.session.as_deref(), Some("abc"));
        assert_eq!(chat.template_kwargs["enable_thinking"], json!(true));
        let (kept, _) = parse(
            json!({"model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "x-anthropic-billing-header: a"}],
                   "messages": [{"role": "user", "content": "hi"}]})
            .to_string()
            .as_bytes(),
            &HeaderMap::new(),
            "ab",
            true,
            false,
        )
        .unwrap();
        assert_eq!(kept.messages[0].role, "system");
    }

    proptest::proptest! {
        /// Any JSON: a request or a 4xx, never a panic.
        #[test]
        fn parser_survives_random_json(input in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..64),
                                       kind in proptest::sample::select(vec!["text", "tool_use", "tool_result",
                                           "thinking", "image", "system", "user", "assistant", "x"])) {
            let text = String::from_utf8_lossy(&input).to_string();
            let bodies = [
                json!({"model": "m", "max_tokens": 4, "messages": [{"role": kind, "content": [
                    {"type": kind, "text": text, "id": text, "name": 5, "tool_use_id": text, "content": [{"type": kind}]}]}]}),
                json!({"model": "m", "max_tokens": 4, "system": [{"type": kind, "text": text}],
                       "messages": [{"role": "user", "content": text}], "tool_choice": {"type": kind}, "tools": [{"name": text}]}),
            ];
            for b in bodies {
                if let Err(e) = parse_json(b) {
                    proptest::prop_assert!(e.status.is_client_error());
                }
            }
        }
    }

    #[test]
    fn tool_ids_round_trip_to_the_models_own() {
        assert_eq!(call_id(&tool_use_id("call_0123456789abcdef")), "call_0123456789abcdef");
        assert_eq!(call_id(&tool_use_id("A1b2C3d4E")), "A1b2C3d4E");
    }

    #[test]
    fn errors_name_this_apis_parameters_and_take_its_shape() {
        for (body, param) in [
            (
                json!({"model": "m", "messages": [{"role": "user", "content": "x"}]}),
                "max_tokens",
            ),
            (json!({"model": "m", "max_tokens": 5}), "messages"),
            (
                json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}),
                "messages[0].content[0].type",
            ),
            (
                json!({"model": "m", "max_tokens": 5, "messages": [{"role": "tool", "content": "x"}]}),
                "messages[0].role",
            ),
            (
                json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "sometimes"}}),
                "tool_choice.type",
            ),
        ] {
            let e = parse_json(body.clone()).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
            let b = error_body(&e);
            assert_eq!(b["type"], "error");
            assert_eq!(b["error"]["type"], "invalid_request_error");
        }
        let shed = ApiError::overloaded("busy", 2);
        let r = error_response(&shed);
        assert_eq!(r.status().as_u16(), 529);
        assert_eq!(error_body(&shed)["error"]["type"], "overloaded_error");
        let u = usage_json(&Usage {
            prompt_tokens: 100,
            cached_tokens: 64,
            completion_tokens: 5,
        });
        assert_eq!(u["input_tokens"], 36);
        assert_eq!(u["cache_read_input_tokens"], 64);
    }
}

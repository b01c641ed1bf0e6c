//! The OpenAI Responses API (`POST /v1/responses`, what Codex, the openai-agents SDK and the
//! Vercel AI SDK speak) as a translation onto the chat pipeline: the request's items become
//! a chat request (validated by the same parser, its errors renamed to this API's
//! parameters); the worker's events become output items through [`Answer`], streamed as the
//! documented event sequence or returned whole; a stored response (`store: true`, the
//! default) is kept per tenant for `previous_response_id`, `GET`, `DELETE` and
//! `input_items`.
//!
//! Item ids are `<kind>_<response hex><n>`: an `item_reference` names its response, so it
//! is found without an index. Tool types other than `function` (`custom`, `namespace`,
//! `web_search`, …) are accepted and left out of the prompt: the models served cannot call
//! them. Input item types Hearth has no use for (hosted tools' calls) are skipped.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, Query, State};

use axum::response::Response;
use axum::Json;
use futures_util::StreamExt;
use hearth_protocol::{FinishReason, Usage};
use hearth_tenants::responses::StoredResponse;
use hearth_tenants::TenantContext;
use serde_json::{json, Map, Value};

use crate::api::answer::{Answer, Change, End, Kind, Part};
use crate::api::openai::{self, get, wrong_type, ChatRequest};
use crate::auth::{sees, Caller};
use crate::server::error::ApiError;
use crate::state::AppState;
use crate::upstream::workers::EventStream;

/// What a Responses request carries beyond the chat request it becomes.
#[derive(Debug, Clone)]
pub struct Request {
    /// This request's input items, normalized (each with an id).
    pub items: Vec<Value>,
    /// Items inherited from `previous_response_id` (filled in by the `recall` phase).
    pub inherited: Vec<Value>,
    pub instructions: Option<String>,
    pub previous_response_id: Option<String>,
    pub store: bool,
    /// The body, kept for the fields a response echoes back.
    pub echo: Map<String, Value>,
    /// The chat-shaped request the items translate into (without `messages`).
    chat: Map<String, Value>,
    /// This response's hex id (the request id's).
    pub hex: String,
}

/// Parameter names of the chat request → this API's.
fn rename(e: ApiError) -> ApiError {
    let Some(p) = e.param.clone() else { return e };
    let renamed = if p == "max_tokens" {
        "max_output_tokens".to_string()
    } else if let Some(rest) = p.strip_prefix("response_format") {
        format!("text.format{}", rest.replace(".json_schema", ""))
    } else if p.starts_with("tools") {
        "tools".to_string()
    } else if p.starts_with("messages") {
        "input".to_string()
    } else {
        p
    };
    e.with_param(renamed)
}

fn text_of(param: &str, content: &Value) -> Result<String, ApiError> {
    match content {
        Value::Null => Ok(String::new()),
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut text = String::new();
            for (j, p) in parts.iter().enumerate() {
                let kind = p.get("type").and_then(Value::as_str).unwrap_or("");
                match kind {
                    "input_text" | "output_text" | "text" | "summary_text" | "reasoning_text" => {
                        text.push_str(p.get("text").and_then(Value::as_str).unwrap_or(""))
                    }
                    "refusal" => text.push_str(p.get("refusal").and_then(Value::as_str).unwrap_or("")),
                    "input_image" | "input_file" | "input_audio" => {
                        return Err(ApiError::unsupported(
                            &format!("{param}[{j}].type"),
                            format!("content of type {kind:?} is not supported: the models served read text"),
                        ))
                    }
                    other => {
                        return Err(ApiError::invalid(
                            &format!("{param}[{j}].type"),
                            format!("unknown content type {other:?}"),
                        ))
                    }
                }
            }
            Ok(text)
        }
        v => Err(wrong_type(param, "a string or an array of content parts", v)),
    }
}

/// The input as items, each with an id (`input` as a string is one user message).
fn normalize(input: &Value, hex: &str) -> Result<Vec<Value>, ApiError> {
    let list = match input {
        Value::String(s) => vec![json!({"type": "message", "role": "user", "content": s})],
        Value::Array(a) => a.clone(),
        v => return Err(wrong_type("input", "a string or an array of items", v)),
    };
    let mut out = Vec::with_capacity(list.len());
    for (i, item) in list.into_iter().enumerate() {
        let Value::Object(mut o) = item else {
            return Err(wrong_type(&format!("input[{i}]"), "an object", &item));
        };
        let kind = match o.get("type").and_then(Value::as_str) {
            Some(k) => k.to_string(),
            None if o.contains_key("role") => "message".to_string(),
            None => {
                return Err(ApiError::invalid(
                    &format!("input[{i}].type"),
                    "each input item needs a 'type' (or a 'role' for a message)",
                ))
            }
        };
        o.insert("type".into(), json!(kind));
        let p = |f: &str| format!("input[{i}].{f}");
        match kind.as_str() {
            "message" => {
                let role = o.get("role").and_then(Value::as_str).unwrap_or("");
                if !matches!(role, "user" | "assistant" | "system" | "developer") {
                    return Err(ApiError::invalid(
                        &p("role"),
                        format!("unknown role {role:?}; use user, assistant, system or developer"),
                    ));
                }
                text_of(&p("content"), o.get("content").unwrap_or(&Value::Null))?;
            }
            "function_call" => {
                for f in ["call_id", "name"] {
                    if !o.get(f).is_some_and(Value::is_string) {
                        return Err(ApiError::invalid(
                            &p(f),
                            format!("a function_call needs a string '{f}'"),
                        ));
                    }
                }
            }
            "function_call_output" | "custom_tool_call_output" => {
                if !o.get("call_id").is_some_and(Value::is_string) {
                    return Err(ApiError::invalid(
                        &p("call_id"),
                        "a tool output needs the 'call_id' it answers",
                    ));
                }
                if let Some(v) = o.get("output").filter(|v| !v.is_string()) {
                    text_of(&p("output"), v)?;
                }
            }
            "item_reference" => {
                if !o.get("id").is_some_and(Value::is_string) {
                    return Err(ApiError::invalid(
                        &p("id"),
                        "an item_reference needs the 'id' of an item",
                    ));
                }
                out.push(Value::Object(o));
                continue;
            }
            _ => {}
        }
        if !o.get("id").is_some_and(Value::is_string) {
            let tag = match kind.as_str() {
                "function_call" => "fc",
                "function_call_output" => "fco",
                "reasoning" => "rs",
                _ => "msg",
            };
            o.insert("id".into(), json!(format!("{tag}_{hex}i{i:02}")));
        }
        out.push(Value::Object(o));
    }
    Ok(out)
}

/// The items as chat messages (consecutive assistant items — text, calls, reasoning — make
/// one assistant turn).
fn conversation(instructions: Option<&str>, items: &[Value]) -> Result<Vec<Value>, ApiError> {
    let mut messages: Vec<Value> = Vec::new();
    if let Some(i) = instructions.filter(|i| !i.is_empty()) {
        messages.push(json!({"role": "system", "content": i}));
    }
    let mut reasoning: Option<String> = None;
    // The assistant turn being built, if the last message is one.
    let assistant = |messages: &mut Vec<Value>, reasoning: &mut Option<String>| -> usize {
        let open = messages.last().is_some_and(|m| m["role"] == "assistant");
        if !open {
            messages.push(json!({"role": "assistant", "content": ""}));
        }
        let last = messages.len() - 1;
        if let Some(r) = reasoning.take() {
            messages[last]["reasoning_content"] = json!(r);
        }
        last
    };
    for (i, item) in items.iter().enumerate() {
        let p = format!("input[{i}]");
        match item["type"].as_str().unwrap_or("") {
            "message" => {
                let role = item["role"].as_str().unwrap_or("user");
                let text = text_of(&format!("{p}.content"), &item["content"])?;
                if role == "assistant" {
                    let a = assistant(&mut messages, &mut reasoning);
                    let joined = format!("{}{text}", messages[a]["content"].as_str().unwrap_or(""));
                    messages[a]["content"] = json!(joined);
                } else {
                    messages.push(json!({"role": role, "content": text}));
                }
            }
            "reasoning" => {
                let mut text = text_of(&format!("{p}.content"), &item["content"]).unwrap_or_default();
                if text.is_empty() {
                    text = text_of(&format!("{p}.summary"), &item["summary"]).unwrap_or_default();
                }
                if !text.is_empty() {
                    reasoning = Some(text);
                }
            }
            kind @ ("function_call" | "custom_tool_call") => {
                let arguments = if kind == "custom_tool_call" {
                    json!({"input": item["input"]}).to_string()
                } else {
                    match &item["arguments"] {
                        Value::String(s) => s.clone(),
                        Value::Null => "{}".into(),
                        v => v.to_string(),
                    }
                };
                let a = assistant(&mut messages, &mut reasoning);
                let call = json!({"id": item["call_id"], "type": "function",
                                  "function": {"name": item["name"], "arguments": arguments}});
                match messages[a].get_mut("tool_calls").and_then(Value::as_array_mut) {
                    Some(calls) => calls.push(call),
                    None => messages[a]["tool_calls"] = json!([call]),
                }
            }
            "function_call_output" | "custom_tool_call_output" => {
                let output = match &item["output"] {
                    Value::String(s) => s.clone(),
                    v => text_of(&format!("{p}.output"), v)?,
                };
                messages.push(json!({"role": "tool", "tool_call_id": item["call_id"], "content": output}));
            }
            // Hosted tools' calls and anything else Hearth has no use for.
            _ => {}
        }
    }
    Ok(messages)
}

/// Parses a Responses request into the chat request it becomes, and what it carries beyond.
pub fn parse(body: &[u8], hex: &str) -> Result<(ChatRequest, Request), ApiError> {
    let o = openai::parse_object(body)?;
    let input = get(&o, "input").ok_or_else(|| ApiError::invalid("input", "you must provide 'input'"))?;
    let items = normalize(input, hex)?;
    let instructions = match get(&o, "instructions") {
        None => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(v) => return Err(wrong_type("instructions", "a string", v)),
    };
    let previous_response_id = match get(&o, "previous_response_id") {
        None => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(v) => return Err(wrong_type("previous_response_id", "a string", v)),
    };
    let store = match get(&o, "store") {
        None => true,
        Some(Value::Bool(b)) => *b,
        Some(v) => return Err(wrong_type("store", "a boolean", v)),
    };
    openai::metadata(get(&o, "metadata"))?;
    if get(&o, "background") == Some(&Value::Bool(true)) {
        return Err(ApiError::unsupported(
            "background",
            "background responses are not supported; stream instead",
        ));
    }
    let mut chat = Map::new();
    // (`seed`, `top_k`, `ignore_eos`, `min_tokens`, `speculative`: Hearth's extensions, as on chat.)
    for key in [
        "model",
        "temperature",
        "top_p",
        "prompt_cache_key",
        "service_tier",
        "stream",
        "seed",
        "top_k",
        "ignore_eos",
        "min_tokens",
        "speculative",
    ] {
        if let Some(v) = get(&o, key) {
            chat.insert(key.into(), v.clone());
        }
    }
    if let Some(v) = get(&o, "max_output_tokens") {
        chat.insert("max_tokens".into(), v.clone());
    }
    if let Some(text) = get(&o, "text") {
        let Some(t) = text.as_object() else {
            return Err(wrong_type("text", "an object", text));
        };
        if let Some(f) = get(t, "format") {
            let Some(fo) = f.as_object() else {
                return Err(wrong_type("text.format", "an object", f));
            };
            // Chat's `response_format` nests the schema one level deeper.
            let rf = match fo.get("type").and_then(Value::as_str) {
                Some("json_schema") => {
                    let mut js = fo.clone();
                    js.remove("type");
                    json!({"type": "json_schema", "json_schema": js})
                }
                _ => f.clone(),
            };
            chat.insert("response_format".into(), rf);
        }
    }
    // Function tools, in chat's shape; other tool types are left out (the model cannot call them).
    let mut names = Vec::new();
    if let Some(tools) = get(&o, "tools") {
        let Some(list) = tools.as_array() else {
            return Err(wrong_type("tools", "an array", tools));
        };
        let mut functions = Vec::new();
        for (i, t) in list.iter().enumerate() {
            if t.get("type").and_then(Value::as_str) != Some("function") {
                continue;
            }
            let Some(name) = t.get("name").and_then(Value::as_str) else {
                return Err(ApiError::invalid(
                    &format!("tools[{i}].name"),
                    "a function tool needs a 'name'",
                ));
            };
            names.push(name.to_string());
            let mut f = json!({"name": name});
            for k in ["description", "parameters"] {
                if let Some(v) = get(t.as_object().unwrap_or(&Map::new()), k) {
                    f[k] = v.clone();
                }
            }
            functions.push(json!({"type": "function", "function": f}));
        }
        if !functions.is_empty() {
            chat.insert("tools".into(), Value::Array(functions));
        }
    }
    if let Some(choice) = get(&o, "tool_choice") {
        let c = match choice {
            Value::String(s) => Some(json!(s)),
            Value::Object(c) => match c.get("type").and_then(Value::as_str) {
                Some("function") => {
                    let name = c.get("name").cloned().unwrap_or(Value::Null);
                    Some(json!({"type": "function", "function": {"name": name}}))
                }
                Some("allowed_tools") => Some(json!(c.get("mode").and_then(Value::as_str).unwrap_or("auto"))),
                // A hosted tool (web_search, …) the model cannot call.
                Some(other) => {
                    return Err(ApiError::unsupported(
                        "tool_choice",
                        format!("tool_choice of type {other:?} is not supported: only function tools are called"),
                    ))
                }
                None => return Err(ApiError::invalid("tool_choice", "a tool_choice object needs a 'type'")),
            },
            v => return Err(wrong_type("tool_choice", "a string or an object", v)),
        };
        // "auto" with only hosted tools: nothing to call.
        if let Some(c) = c.filter(|c| !(names.is_empty() && c == "auto")) {
            chat.insert("tool_choice".into(), c);
        }
    }
    if let Some(v) = get(&o, "parallel_tool_calls") {
        chat.insert("parallel_tool_calls".into(), v.clone());
    }
    // Reasoning off when asked for no effort.
    if let Some(effort) = get(&o, "reasoning")
        .and_then(|r| r.get("effort"))
        .and_then(Value::as_str)
    {
        if matches!(effort, "none" | "minimal") {
            chat.insert("chat_template_kwargs".into(), json!({"enable_thinking": false}));
        }
    }
    let req = Request {
        items,
        inherited: Vec::new(),
        instructions,
        previous_response_id,
        store,
        echo: o,
        chat,
        hex: hex.to_string(),
    };
    let chat = req.chat_request()?;
    Ok((chat, req))
}

impl Request {
    /// The chat request: instructions, inherited items, then this request's.
    pub fn chat_request(&self) -> Result<ChatRequest, ApiError> {
        let mut all = self.inherited.clone();
        all.extend(self.items.iter().cloned());
        let mut messages = conversation(self.instructions.as_deref(), &all)?;
        if messages.is_empty() {
            let recall_pending = self.inherited.is_empty()
                && (self.previous_response_id.is_some() || self.items.iter().any(|i| i["type"] == "item_reference"));
            if !recall_pending {
                return Err(ApiError::invalid("input", "'input' has nothing for the model to read"));
            }
            // Validated again once `recall` has brought the stored items in.
            messages.push(json!({"role": "user", "content": ""}));
        }
        let mut chat = self.chat.clone();
        chat.insert("messages".into(), Value::Array(messages));
        let mut r = openai::parse_chat_object(&chat).map_err(rename)?;
        // `max_output_tokens` is an upper bound: cut to the room the prompt leaves.
        r.common.clamp_max_tokens = true;
        Ok(r)
    }

    pub fn id(&self) -> String {
        format!("resp_{}", self.hex)
    }
}

/// The `recall` phase's work: inherits the previous response's conversation (its chain of
/// responses, walked oldest first, within the conversation bound) and resolves
/// `item_reference`s (each names its response by its id). Unknown or another tenant's ids
/// are 404s; so is a conversation whose earlier response has expired or was deleted.
pub async fn recall(state: &AppState, caller: &TenantContext, req: &mut Request) -> Result<(), ApiError> {
    let tenant_id = caller.tenant_id.as_str();
    if let Some(prev) = req.previous_response_id.clone() {
        // The caller's own first (another key's, for a model-restricted key, is not found),
        // so that nothing of a conversation it may not see is told.
        let visible = state
            .tenants
            .stored_response(tenant_id, &prev)
            .await
            .map_err(store_error)?
            .is_some_and(|r| sees(caller, r.key_id.as_deref()));
        let chain = if visible {
            stored_conversation(state, tenant_id, &prev, "previous_response_id").await?
        } else {
            None
        };
        let chain = chain.ok_or_else(|| {
            ApiError::not_found(format!("Previous response with id '{prev}' not found."))
                .with_param("previous_response_id")
        })?;
        req.inherited = chain.iter().flat_map(items_of).collect();
    }
    let mut resolved = Vec::with_capacity(req.items.len());
    for (i, item) in std::mem::take(&mut req.items).into_iter().enumerate() {
        if item["type"] != "item_reference" {
            resolved.push(item);
            continue;
        }
        let id = item["id"].as_str().unwrap_or_default().to_string();
        let found = match req.inherited.iter().find(|it| it["id"] == id.as_str()) {
            Some(it) => Some(it.clone()),
            None => match response_of_item(&id) {
                Some(resp) => state
                    .tenants
                    .stored_response(tenant_id, &resp)
                    .await
                    .map_err(store_error)?
                    .filter(|s| sees(caller, s.key_id.as_deref()))
                    .and_then(|s| items_of(&s).into_iter().find(|it| it["id"] == id.as_str())),
                None => None,
            },
        };
        resolved.push(found.ok_or_else(|| {
            ApiError::not_found(format!("Item with id '{id}' not found.")).with_param(format!("input[{i}].id"))
        })?);
    }
    req.items = resolved;
    Ok(())
}

/// The conversation response `id` ends, oldest response first, within the conversation
/// bound (errors name `param`); None if the tenant has no response `id`.
async fn stored_conversation(
    state: &AppState,
    tenant_id: &str,
    id: &str,
    param: &str,
) -> Result<Option<Vec<StoredResponse>>, ApiError> {
    use hearth_tenants::responses::Conversation;
    let max = state.response_retention.max_conversation_bytes;
    match state
        .tenants
        .conversation(tenant_id, id, max)
        .await
        .map_err(store_error)?
    {
        Conversation::Found(chain) => Ok(Some(chain)),
        Conversation::NotFound => Ok(None),
        Conversation::Broken { missing } => Err(ApiError::not_found(format!(
            "Response '{missing}', earlier in the conversation of '{id}', has expired or was deleted: \
             that conversation can no longer be continued."
        ))
        .with_param(param)),
        Conversation::TooLarge { bytes } => Err(ApiError::invalid(
            param,
            format!(
                "The conversation of '{id}' holds {bytes} bytes; a continuation reads at most {max} \
                 (start a new conversation, or send the items you need with store: false)."
            ),
        )),
    }
}

/// A stored response's own items: its input, then its output.
fn items_of(r: &StoredResponse) -> Vec<Value> {
    let mut items = serde_json::from_str::<Vec<Value>>(&r.input_items).unwrap_or_default();
    items.extend(serde_json::from_str::<Vec<Value>>(&r.output).unwrap_or_default());
    items
}

/// The response an item id of Hearth's names (`<kind>_<24 hex>…`).
fn response_of_item(id: &str) -> Option<String> {
    let (_, rest) = id.split_once('_')?;
    let hex = rest.get(..24)?;
    hex.bytes()
        .all(|b| b.is_ascii_hexdigit())
        .then(|| format!("resp_{hex}"))
}

fn store_error(e: hearth_tenants::TenantError) -> ApiError {
    tracing::error!(error = %e, "stored responses unavailable");
    ApiError::unavailable("stored responses are temporarily unavailable")
}

/// What the response object is built from besides the answer.
pub struct Shape {
    pub req: Request,
    pub model: String,
    pub created_at: i64,
    /// Whose it is (the id keys the store, the name labels the metrics) and the key that
    /// asked (a model-restricted key sees only its own responses).
    pub tenant_id: String,
    pub tenant_name: String,
    pub key_id: String,
}

fn part_json(p: &Part, status: &str) -> Value {
    match p.kind {
        Kind::Text => json!({
            "id": p.id, "type": "message", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": p.text, "annotations": [], "logprobs": []}],
        }),
        Kind::Reasoning => json!({
            "id": p.id, "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": p.text}],
        }),
        Kind::Call => json!({
            "id": p.id, "type": "function_call", "status": status, "call_id": p.call_id,
            "name": p.name, "arguments": p.text,
        }),
    }
}

fn added_json(p: &Part) -> Value {
    let mut v = part_json(p, "in_progress");
    match p.kind {
        Kind::Text | Kind::Reasoning => v["content"] = json!([]),
        Kind::Call => v["arguments"] = json!(""),
    }
    v
}

fn usage_json(u: &Usage, reasoning_tokens: u32) -> Value {
    json!({
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    })
}

impl Shape {
    /// The response object. `answer` None: just created (no output yet).
    fn object(&self, status: &str, answer: Option<&Answer>, end: Option<&End>) -> Value {
        let e = &self.req.echo;
        let echo = |k: &str, default: Value| get(e, k).cloned().unwrap_or(default);
        let item_status = if status == "completed" {
            "completed"
        } else {
            "incomplete"
        };
        let output: Vec<Value> = answer
            .map(|a| a.parts.iter().map(|p| part_json(p, item_status)).collect())
            .unwrap_or_default();
        let (usage, error, incomplete) = match end {
            Some(End::Finished { reason, usage }) => (
                usage_json(usage, answer.map_or(0, Answer::reasoning_tokens)),
                Value::Null,
                (*reason == FinishReason::Length).then(|| json!({"reason": "max_output_tokens"})),
            ),
            Some(End::Failed { code, message, .. }) => {
                (Value::Null, json!({"code": error_code(code), "message": message}), None)
            }
            None => (Value::Null, Value::Null, None),
        };
        json!({
            "id": self.req.id(), "object": "response", "created_at": self.created_at,
            "status": status, "error": error, "incomplete_details": incomplete,
            "instructions": echo("instructions", Value::Null), "max_output_tokens": echo("max_output_tokens", Value::Null),
            "model": self.model, "output": output,
            "parallel_tool_calls": echo("parallel_tool_calls", json!(true)),
            "previous_response_id": echo("previous_response_id", Value::Null),
            "reasoning": echo("reasoning", json!({"effort": null, "summary": null})),
            "store": self.req.store, "temperature": echo("temperature", json!(1.0)),
            "text": echo("text", json!({"format": {"type": "text"}})),
            "tool_choice": echo("tool_choice", json!("auto")), "tools": echo("tools", json!([])),
            "top_p": echo("top_p", json!(1.0)), "truncation": echo("truncation", json!("disabled")),
            "metadata": echo("metadata", json!({})), "service_tier": echo("service_tier", json!("default")),
            "prompt_cache_key": echo("prompt_cache_key", Value::Null), "user": echo("user", Value::Null),
            "background": false, "usage": usage,
        })
    }

    fn status(end: &End) -> &'static str {
        match end {
            End::Finished {
                reason: FinishReason::Length,
                ..
            } => "incomplete",
            End::Finished { .. } => "completed",
            End::Failed { .. } => "failed",
        }
    }

    /// Keeps the finished response (store: true): its own items only (a continuation
    /// names the response it continues); failures are logged, never the client's.
    pub async fn store(&self, state: &AppState, object: &Value) {
        if !self.req.store {
            return;
        }
        let mut response = object.clone();
        let output = response
            .as_object_mut()
            .and_then(|o| o.remove("output"))
            .unwrap_or_else(|| json!([]));
        let r = StoredResponse {
            id: self.req.id(),
            tenant_id: self.tenant_id.clone(),
            created_at: self.created_at * 1000,
            expires_at: 0,
            response: response.to_string(),
            input_items: Value::Array(self.req.items.clone()).to_string(),
            output: output.to_string(),
            previous_id: self.req.previous_response_id.clone(),
            key_id: Some(self.key_id.clone()),
        };
        match state.tenants.store_response(&r, state.response_retention).await {
            Ok(stored) => state
                .metrics
                .stored_responses(&self.tenant_name, stored.count, stored.bytes),
            Err(e) => tracing::error!(error = %e, response = %r.id, "the response could not be stored"),
        }
    }
}

fn error_code(code: &str) -> &str {
    match code {
        c if c.starts_with("processor:") => &c["processor:".len()..],
        "overloaded" | "draining" | "shutting_down" | "worker_unavailable" => "server_error",
        c => c,
    }
}

/// The whole response (the relay's first event has already passed, so errors here are the
/// stream's end).
pub async fn collect(
    shape: &Shape,
    output: &hearth_protocol::output::OutputSpec,
    mut events: EventStream,
) -> Result<Value, ApiError> {
    let mut answer = Answer::new(output, &shape.req.hex);
    while let Some(ev) = events.next().await {
        let (_, end) = answer.event(ev);
        match end {
            Some(End::Failed { code, message, .. }) => return Err(crate::api::respond::worker_error(&code, &message)),
            Some(end) => return Ok(shape.object(Shape::status(&end), Some(&answer), Some(&end))),
            None => {}
        }
    }
    Err(ApiError::unavailable("the worker ended the stream without finishing"))
}

struct Writer {
    seq: u64,
    out: Vec<Bytes>,
}

impl Writer {
    fn emit(&mut self, kind: &str, mut data: Value) {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.seq);
        self.seq += 1;
        self.out.push(Bytes::from(format!("event: {kind}\ndata: {data}\n\n")));
    }

    fn change(&mut self, a: &Answer, c: &Change) {
        match c {
            Change::Open(i) => {
                let p = &a.parts[*i];
                self.emit(
                    "response.output_item.added",
                    json!({"output_index": i, "item": added_json(p)}),
                );
                let part = match p.kind {
                    Kind::Text => Some(json!({"type": "output_text", "text": "", "annotations": [], "logprobs": []})),
                    Kind::Reasoning => Some(json!({"type": "reasoning_text", "text": ""})),
                    Kind::Call => None,
                };
                if let Some(part) = part {
                    self.emit(
                        "response.content_part.added",
                        json!({"item_id": p.id, "output_index": i, "content_index": 0, "part": part}),
                    );
                }
            }
            Change::Append(i, text) => {
                let p = &a.parts[*i];
                let (kind, mut v) = match p.kind {
                    Kind::Text => (
                        "response.output_text.delta",
                        json!({"content_index": 0, "logprobs": []}),
                    ),
                    Kind::Reasoning => ("response.reasoning_text.delta", json!({"content_index": 0})),
                    Kind::Call => ("response.function_call_arguments.delta", json!({})),
                };
                v["item_id"] = json!(p.id);
                v["output_index"] = json!(i);
                v["delta"] = json!(text);
                self.emit(kind, v);
            }
            Change::Close(i) => {
                let p = &a.parts[*i];
                match p.kind {
                    Kind::Text => {
                        self.emit(
                            "response.output_text.done",
                            json!({"item_id": p.id, "output_index": i, "content_index": 0, "text": p.text, "logprobs": []}),
                        );
                        self.emit(
                            "response.content_part.done",
                            json!({"item_id": p.id, "output_index": i, "content_index": 0,
                                   "part": {"type": "output_text", "text": p.text, "annotations": [], "logprobs": []}}),
                        );
                    }
                    Kind::Reasoning => {
                        self.emit(
                            "response.reasoning_text.done",
                            json!({"item_id": p.id, "output_index": i, "content_index": 0, "text": p.text}),
                        );
                        self.emit(
                            "response.content_part.done",
                            json!({"item_id": p.id, "output_index": i, "content_index": 0,
                                   "part": {"type": "reasoning_text", "text": p.text}}),
                        );
                    }
                    Kind::Call => self.emit(
                        "response.function_call_arguments.done",
                        json!({"item_id": p.id, "output_index": i, "name": p.name, "arguments": p.text}),
                    ),
                }
                self.emit(
                    "response.output_item.done",
                    json!({"output_index": i, "item": part_json(p, "completed")}),
                );
            }
        }
    }
}

/// The documented event sequence, `sequence_number` on every event; the response is stored
/// before `response.completed` goes out, so a client may continue from it at once.
pub fn stream(
    state: Arc<AppState>,
    shape: Shape,
    output: hearth_protocol::output::OutputSpec,
    mut events: EventStream,
) -> Response {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::convert::Infallible>>(64);
    tokio::spawn(async move {
        let mut w = Writer {
            seq: 0,
            out: Vec::new(),
        };
        let created = shape.object("in_progress", None, None);
        w.emit("response.created", json!({"response": created}));
        w.emit("response.in_progress", json!({"response": created}));
        let mut answer = Answer::new(&output, &shape.req.hex);
        let mut end = None;
        while end.is_none() {
            let ev = match events.next().await {
                Some(ev) => ev,
                None => hearth_protocol::GenerateEvent::Error {
                    code: "worker_disconnected".into(),
                    message: "the worker ended the stream without finishing".into(),
                },
            };
            let (changes, e) = answer.event(ev);
            for c in &changes {
                w.change(&answer, c);
            }
            if let Some(e) = e {
                let status = Shape::status(&e);
                let object = shape.object(status, Some(&answer), Some(&e));
                if !matches!(e, End::Failed { .. }) {
                    shape.store(&state, &object).await;
                }
                let kind = match status {
                    "completed" => "response.completed",
                    "incomplete" => "response.incomplete",
                    _ => "response.failed",
                };
                w.emit(kind, json!({"response": object}));
                end = Some(e);
            }
            for b in w.out.drain(..) {
                if tx.send(Ok(b)).await.is_err() {
                    return; // the client went away: dropping `events` cancels the generation
                }
            }
        }
    });
    crate::api::respond::event_stream(tokio_stream::wrappers::ReceiverStream::new(rx))
}

/// The caller's stored response `id` (another key's, for a model-restricted key, is not
/// found).
async fn stored(state: &AppState, caller: &TenantContext, id: &str) -> Result<StoredResponse, ApiError> {
    state
        .tenants
        .stored_response(&caller.tenant_id, id)
        .await
        .map_err(store_error)?
        .filter(|r| sees(caller, r.key_id.as_deref()))
        .ok_or_else(|| ApiError::not_found(format!("Response with id '{id}' not found.")))
}

/// `GET /v1/responses/{id}`.
#[utoipa::path(get, path = "/v1/responses/{id}", summary = "A stored response.", tag = "inference", security(("bearer" = [])), params(("id" = String, Path, description = "A response id (`resp_…`).")),
    responses((status = 200, description = "The stored response (the tenant's own; another tenant's id is a 404).", body = crate::api::schema::ResponseObject), crate::server::error::Errors))]
pub async fn retrieve(
    State(state): State<Arc<AppState>>,
    Caller(ctx): Caller,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let r = stored(&state, &ctx, &id).await?;
    r.object()
        .map(Json)
        .ok_or_else(|| ApiError::internal("a stored response is unreadable"))
}

/// `DELETE /v1/responses/{id}`.
#[utoipa::path(delete, path = "/v1/responses/{id}", summary = "Deletes a stored response.", tag = "inference", security(("bearer" = [])), params(("id" = String, Path, description = "A response id (`resp_…`).")),
    responses((status = 200, description = "Deleted.", body = crate::api::schema::Deleted), crate::server::error::Errors))]
pub async fn delete(
    State(state): State<Arc<AppState>>,
    Caller(ctx): Caller,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    stored(&state, &ctx, &id).await?;
    if !state
        .tenants
        .delete_response(&ctx.tenant_id, &id)
        .await
        .map_err(store_error)?
    {
        return Err(ApiError::not_found(format!("Response with id '{id}' not found.")));
    }
    Ok(Json(json!({"id": id, "object": "response", "deleted": true})))
}

#[derive(serde::Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ListQuery {
    /// 1 to 100 (default 20).
    #[param(minimum = 1, maximum = 100)]
    limit: Option<usize>,
    /// `asc` or `desc` (default).
    #[param(pattern = "^(asc|desc)$")]
    order: Option<String>,
    /// An item id: list the items after it.
    after: Option<String>,
    /// An item id: list the items before it.
    before: Option<String>,
}

/// `GET /v1/responses/{id}/input_items`: OpenAI's list (newest first unless `order=asc`).
#[utoipa::path(get, path = "/v1/responses/{id}/input_items", summary = "A stored response's input items, newest first unless `order=asc`.", tag = "inference", security(("bearer" = [])),
    params(("id" = String, Path, description = "A response id (`resp_…`)."), ListQuery),
    responses((status = 200, description = "`{\"object\": \"list\", \"data\", \"first_id\", \"last_id\", \"has_more\"}`.", body = crate::api::schema::AnyObject), crate::server::error::Errors))]
pub async fn input_items(
    State(state): State<Arc<AppState>>,
    Caller(ctx): Caller,
    Path(id): Path<String>,
    q: Result<Query<ListQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<Value>, ApiError> {
    let Query(q) = q.map_err(|e| ApiError::invalid("query", e.body_text()))?;
    // Its input: the conversation before it (each earlier response's input and output),
    // then its own input items.
    stored(&state, &ctx, &id).await?;
    let chain = stored_conversation(&state, &ctx.tenant_id, &id, "id")
        .await?
        .ok_or_else(|| ApiError::not_found(format!("Response with id '{id}' not found.")))?;
    let (last, earlier) = chain
        .split_last()
        .ok_or_else(|| ApiError::internal("an empty conversation"))?;
    let mut items: Vec<Value> = earlier.iter().flat_map(items_of).collect();
    items.extend(serde_json::from_str::<Vec<Value>>(&last.input_items).unwrap_or_default());
    match q.order.as_deref() {
        None | Some("desc") => items.reverse(),
        Some("asc") => {}
        Some(o) => {
            return Err(ApiError::invalid(
                "order",
                format!("'order' must be asc or desc, got {o:?}"),
            ))
        }
    }
    let limit = q.limit.unwrap_or(20);
    if !(1..=100).contains(&limit) {
        return Err(ApiError::invalid("limit", "'limit' must be between 1 and 100"));
    }
    let start = match &q.after {
        Some(a) => items
            .iter()
            .position(|it| it["id"] == a.as_str())
            .map_or(items.len(), |p| p + 1),
        None => 0,
    };
    let end = match &q.before {
        Some(b) => items
            .iter()
            .position(|it| it["id"] == b.as_str())
            .unwrap_or(items.len()),
        None => items.len(),
    };
    let page: Vec<Value> = items
        .get(start..end.max(start))
        .unwrap_or_default()
        .iter()
        .take(limit)
        .cloned()
        .collect();
    let has_more = end.max(start) - start > page.len();
    Ok(Json(json!({
        "object": "list", "data": page,
        "first_id": page.first().map(|i| i["id"].clone()), "last_id": page.last().map(|i| i["id"].clone()),
        "has_more": has_more,
    })))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_json(v: Value) -> Result<(ChatRequest, Request), ApiError> {
        parse(v.to_string().as_bytes(), "0123456789abcdef01234567")
    }

    #[test]
    fn items_become_one_conversation() {
        let (chat, req) = parse_json(json!({
            "model": "m", "instructions": "Be brief.", "store": false,
            "input": [
                {"role": "user", "content": "weather?"},
                {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "Use the tool."}]},
                {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\":\"Paris\"}"},
                {"type": "function_call_output", "call_id": "call_1", "output": "21C"},
                {"type": "web_search_call", "id": "ws_1", "status": "completed"}
            ],
            "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}},
                      {"type": "web_search"}, {"type": "namespace", "name": "ns", "tools": []}],
            "max_output_tokens": 64, "text": {"format": {"type": "json_object"}},
            "include": ["reasoning.encrypted_content"], "client_metadata": {"x": 1}, "reasoning": {"effort": "low"}
        }))
        .unwrap();
        assert!(!req.store);
        let m = &chat.messages;
        assert_eq!(m[0].role, "system");
        assert_eq!(m[1].content, "weather?");
        assert_eq!(m[2].role, "assistant");
        assert_eq!(m[2].reasoning_content.as_deref(), Some("Use the tool."));
        assert_eq!(m[2].tool_calls[0].function.arguments, json!({"city": "Paris"}));
        assert_eq!(m[3].role, "tool");
        assert_eq!(m[3].name.as_deref(), Some("get_weather"));
        assert_eq!(m.len(), 4);
        assert_eq!(chat.common.max_tokens, Some(64));
        assert!(chat.common.constraint.is_some());
        assert_eq!(chat.common.tools.as_ref().unwrap().tools.len(), 1);
        assert_eq!(req.items[0]["id"], "msg_0123456789abcdef01234567i00");
        assert_eq!(
            response_of_item("msg_0123456789abcdef01234567i00").as_deref(),
            Some("resp_0123456789abcdef01234567")
        );
    }

    #[test]
    fn references_wait_for_recall_and_max_output_tokens_is_a_cap() {
        let (chat, req) =
            parse_json(json!({"model": "m", "input": [{"type": "item_reference", "id": "msg_x"}]})).unwrap();
        assert!(chat.common.clamp_max_tokens);
        assert_eq!(req.items[0]["type"], "item_reference");
        let (_, req) = parse_json(json!({"model": "m", "previous_response_id": "resp_1", "input": []})).unwrap();
        assert_eq!(req.previous_response_id.as_deref(), Some("resp_1"));
        let e = parse_json(json!({"model": "m", "input": []})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("input"));
    }

    proptest::proptest! {
        /// Any JSON: a request or a 4xx, never a panic.
        #[test]
        fn parser_survives_random_json(input in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..64),
                                       kind in proptest::sample::select(vec!["message", "function_call",
                                           "function_call_output", "reasoning", "item_reference", "x"])) {
            let text = String::from_utf8_lossy(&input).to_string();
            let bodies = [
                json!({"model": "m", "input": [{"type": kind, "content": text, "call_id": 1, "output": [text]}]}),
                json!({"model": "m", "input": [{"role": kind, "content": [{"type": kind, "text": text}]}], "tools": [{"type": kind}]}),
                json!({"model": "m", "input": text, "text": {"format": {"type": kind}}, "tool_choice": {"type": kind}}),
            ];
            for b in bodies {
                if let Err(e) = parse_json(b) {
                    proptest::prop_assert!(e.status.is_client_error());
                }
            }
        }
    }

    #[test]
    fn errors_name_this_apis_parameters() {
        for (body, param) in [
            (json!({"model": "m"}), "input"),
            (
                json!({"model": "m", "input": "x", "max_output_tokens": 0}),
                "max_output_tokens",
            ),
            (
                json!({"model": "m", "input": "x", "text": {"format": {"type": "yaml"}}}),
                "text.format.type",
            ),
            (
                json!({"model": "m", "input": [{"role": "wizard", "content": "x"}]}),
                "input[0].role",
            ),
            (
                json!({"model": "m", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}),
                "input[0].content[0].type",
            ),
            (
                json!({"model": "m", "input": "x", "tool_choice": {"type": "web_search"}}),
                "tool_choice",
            ),
            (json!({"model": "m", "input": "x", "temperature": 5}), "temperature"),
        ] {
            let e = parse_json(body.clone()).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
            assert!(e.status.is_client_error());
        }
    }
}

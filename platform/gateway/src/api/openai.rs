//! The OpenAI-compatible request surface: parsing and validating `/v1/chat/completions`
//! and `/v1/completions` bodies (with the offending `param` named in every error), and
//! building response objects and stream chunks.

use hearth_protocol::{ChatMessage, Constraint, SamplingParams, Usage};
use serde_json::{json, Map, Value};

use crate::api::tools::{self, Tools};
use crate::server::error::ApiError;

/// OpenAI allows at most four stop sequences.
const MAX_STOP: usize = 4;

/// At most this many choices per request.
pub const MAX_N: i64 = 16;

/// Fields both endpoints share.
#[derive(Debug, Clone, PartialEq)]
pub struct Common {
    pub model: String,
    /// `None`: up to the context length.
    pub max_tokens: Option<u32>,
    pub sampling: SamplingParams,
    pub stream: bool,
    pub include_usage: bool,
    pub n: u32,
    /// Separates prefix-cache entries within a tenant (OpenAI's `prompt_cache_key`).
    pub prompt_cache_key: Option<String>,
    /// OpenAI's `service_tier` (`flex` is Hearth's `batch` class; `auto`, `default`,
    /// `priority` are interactive; Hearth's names work too): lowers the request's class,
    /// never raises it.
    pub service_tier: Option<hearth_protocol::Priority>,
    /// What the output must match (`response_format`, or the tools under `required` /
    /// a named `tool_choice`): decoded under the engine's grammar mask.
    pub constraint: Option<Constraint>,
    /// The request's tools (chat only).
    pub tools: Option<Tools>,
    /// The session key routing pins to a worker when no `x-session-affinity` header is
    /// sent: `prompt_cache_key`, or what the API's own clients send (Claude Code's session).
    pub session: Option<String>,
    /// `max_tokens` is a cap, cut to the room the prompt leaves (the Messages and Responses
    /// APIs; chat completions refuses a request that cannot fit).
    pub clamp_max_tokens: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ChatRequest {
    pub common: Common,
    pub messages: Vec<ChatMessage>,
    /// `chat_template_kwargs`: extra variables for the model's template (`enable_thinking`).
    pub template_kwargs: Map<String, Value>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

#[derive(Debug, Clone, PartialEq)]
pub struct CompletionRequest {
    pub common: Common,
    pub prompt: Prompt,
}

pub(crate) fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

pub(crate) fn wrong_type(key: &str, want: &str, got: &Value) -> ApiError {
    ApiError::invalid(key, format!("'{key}' must be {want}, not {}", type_name(got)))
}

/// `metadata` as OpenAI bounds it (batches, stored responses): at most 16 string values,
/// keys of at most 64 characters and values of at most 512.
pub fn metadata(v: Option<&Value>) -> Result<Option<Map<String, Value>>, ApiError> {
    let bad = || {
        ApiError::invalid(
            "metadata",
            "'metadata' is an object of at most 16 string values (keys ≤ 64, values ≤ 512 characters)",
        )
    };
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Object(m)) => {
            let ok = m.len() <= 16
                && m.iter()
                    .all(|(k, v)| k.chars().count() <= 64 && v.as_str().is_some_and(|s| s.chars().count() <= 512));
            ok.then(|| Some(m.clone())).ok_or_else(bad)
        }
        Some(_) => Err(bad()),
    }
}

pub(crate) fn get<'a>(o: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    o.get(key).filter(|v| !v.is_null())
}

fn opt_f64(o: &Map<String, Value>, key: &str) -> Result<Option<f64>, ApiError> {
    get(o, key)
        .map(|v| v.as_f64().ok_or_else(|| wrong_type(key, "a number", v)))
        .transpose()
}

fn opt_bool(o: &Map<String, Value>, key: &str) -> Result<Option<bool>, ApiError> {
    get(o, key)
        .map(|v| v.as_bool().ok_or_else(|| wrong_type(key, "a boolean", v)))
        .transpose()
}

fn opt_i64(o: &Map<String, Value>, key: &str) -> Result<Option<i64>, ApiError> {
    get(o, key)
        .map(|v| v.as_i64().ok_or_else(|| wrong_type(key, "an integer", v)))
        .transpose()
}

fn in_range(key: &str, v: Option<f64>, lo: f64, hi: f64) -> Result<Option<f64>, ApiError> {
    match v {
        Some(x) if !(lo..=hi).contains(&x) => Err(ApiError::invalid(
            key,
            format!("'{key}' must be between {lo} and {hi}, got {x}"),
        )),
        _ => Ok(v),
    }
}

/// Parses the body as a JSON object.
pub fn parse_object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(o)) => Ok(o),
        Ok(other) => Err(ApiError::malformed_json(format!(
            "expected an object, got {}",
            type_name(&other)
        ))),
        Err(e) => Err(ApiError::malformed_json(e)),
    }
}

fn parse_common(o: &Map<String, Value>, max_tokens_keys: &[&str]) -> Result<Common, ApiError> {
    let model = match get(o, "model") {
        Some(Value::String(s)) if !s.is_empty() => s.clone(),
        Some(Value::String(_)) => return Err(ApiError::invalid("model", "'model' must not be empty")),
        Some(v) => return Err(wrong_type("model", "a non-empty string", v)),
        None => return Err(ApiError::invalid("model", "you must provide a model parameter")),
    };
    let mut max_tokens = None;
    for key in max_tokens_keys {
        if let Some(n) = opt_i64(o, key)? {
            if n < 1 || n > u32::MAX as i64 {
                return Err(ApiError::invalid(key, format!("'{key}' must be at least 1, got {n}")));
            }
            max_tokens = Some(n as u32);
        }
    }
    let temperature = in_range("temperature", opt_f64(o, "temperature")?, 0.0, 2.0)?.unwrap_or(1.0);
    let top_p = in_range("top_p", opt_f64(o, "top_p")?, 0.0, 1.0)?.unwrap_or(1.0);
    let top_k = match opt_i64(o, "top_k")? {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k > 0 && k <= u32::MAX as i64 => k as u32,
        Some(k) => {
            return Err(ApiError::invalid(
                "top_k",
                format!("'top_k' must be -1, 0 or positive, got {k}"),
            ))
        }
    };
    let seed = opt_i64(o, "seed")?.map(|s| s as u64);
    let stop = match get(o, "stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => {
            let v: Vec<String> = a
                .iter()
                .map(|s| {
                    s.as_str()
                        .map(str::to_string)
                        .ok_or_else(|| wrong_type("stop", "a string or array of strings", s))
                })
                .collect::<Result<_, _>>()?;
            if v.len() > MAX_STOP {
                return Err(ApiError::invalid(
                    "stop",
                    format!("at most {MAX_STOP} stop sequences are allowed"),
                ));
            }
            v
        }
        Some(v) => return Err(wrong_type("stop", "a string or array of strings", v)),
    };
    if stop.iter().any(String::is_empty) {
        return Err(ApiError::invalid("stop", "stop sequences must not be empty"));
    }
    let n = match opt_i64(o, "n")? {
        None => 1,
        Some(n) if (1..=MAX_N).contains(&n) => n as u32,
        Some(n) => {
            return Err(ApiError::invalid(
                "n",
                format!("'n' must be between 1 and {MAX_N}, got {n}"),
            ))
        }
    };
    let ignore_eos = opt_bool(o, "ignore_eos")?.unwrap_or(false);
    let min_tokens = match opt_i64(o, "min_tokens")? {
        None => 0,
        Some(m) if (0..=u32::MAX as i64).contains(&m) => m as u32,
        Some(m) => {
            return Err(ApiError::invalid(
                "min_tokens",
                format!("'min_tokens' must be at least 0, got {m}"),
            ))
        }
    };
    let prompt_cache_key = match get(o, "prompt_cache_key") {
        None => None,
        Some(Value::String(k)) if k.len() <= 256 => Some(k.clone()),
        Some(Value::String(_)) => {
            return Err(ApiError::invalid(
                "prompt_cache_key",
                "'prompt_cache_key' must be at most 256 characters",
            ))
        }
        Some(v) => return Err(wrong_type("prompt_cache_key", "a string", v)),
    };
    let service_tier = match get(o, "service_tier") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(hearth_protocol::Priority::parse(s).ok_or_else(|| {
            ApiError::invalid(
                "service_tier",
                format!(
                    "'service_tier' must be one of auto, default, flex, scale, priority, interactive, batch; got {s:?}"
                ),
            )
        })?),
        Some(v) => return Err(wrong_type("service_tier", "a string", v)),
    };
    for key in ["presence_penalty", "frequency_penalty"] {
        if let Some(p) = in_range(key, opt_f64(o, key)?, -2.0, 2.0)? {
            if p != 0.0 {
                return Err(ApiError::unsupported(
                    key,
                    format!("'{key}' is not supported yet; omit it or use 0"),
                ));
            }
        }
    }
    let constraint = tools::parse_response_format(o)?;
    // Hearth's extension: opt out of speculative decoding (the output is the same either way).
    let speculative = opt_bool(o, "speculative")?.unwrap_or(true);
    let stream = opt_bool(o, "stream")?.unwrap_or(false);
    let include_usage = match get(o, "stream_options") {
        None => false,
        Some(so) if !stream => {
            let _ = so;
            return Err(ApiError::invalid(
                "stream_options",
                "'stream_options' is only allowed when 'stream' is true",
            ));
        }
        Some(Value::Object(so)) => opt_bool(so, "include_usage")
            .map_err(|e| e.with_param("stream_options.include_usage"))?
            .unwrap_or(false),
        Some(v) => return Err(wrong_type("stream_options", "an object", v)),
    };
    Ok(Common {
        model,
        max_tokens,
        sampling: SamplingParams {
            temperature: temperature as f32,
            top_p: top_p as f32,
            top_k,
            seed,
            max_tokens: 0,
            stop,
            ignore_eos,
            min_tokens,
            logprobs: false,
            top_logprobs: 0,
            speculative,
            special_text: Vec::new(),
        },
        stream,
        include_usage,
        n,
        service_tier,
        session: prompt_cache_key.clone(),
        clamp_max_tokens: false,
        prompt_cache_key,
        constraint,
        tools: None,
    })
}

fn message_content(i: usize, v: Option<&Value>) -> Result<String, ApiError> {
    let param = format!("messages[{i}].content");
    match v {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for (j, p) in parts.iter().enumerate() {
                let kind = p.get("type").and_then(Value::as_str);
                match (kind, p.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(t)) => text.push_str(t),
                    (Some(other), _) if other != "text" => {
                        return Err(ApiError::unsupported(
                            &format!("{param}[{j}].type"),
                            format!("content parts of type {other:?} are not supported; this model reads text"),
                        ))
                    }
                    _ => {
                        return Err(ApiError::invalid(
                            &format!("{param}[{j}]"),
                            "a text part needs 'type': 'text' and a string 'text'",
                        ))
                    }
                }
            }
            Ok(text)
        }
        Some(v) => Err(wrong_type(&param, "a string or an array of content parts", v)),
    }
}

pub fn parse_chat(body: &[u8]) -> Result<ChatRequest, ApiError> {
    parse_chat_object(&parse_object(body)?)
}

/// A chat request from its JSON object (the Responses and Messages translations build one).
pub fn parse_chat_object(o: &Map<String, Value>) -> Result<ChatRequest, ApiError> {
    let mut common = parse_common(o, &["max_tokens", "max_completion_tokens"])?;
    common.sampling.logprobs = opt_bool(o, "logprobs")?.unwrap_or(false);
    if let Some(k) = opt_i64(o, "top_logprobs")? {
        if !(0..=20).contains(&k) {
            return Err(ApiError::invalid(
                "top_logprobs",
                format!("'top_logprobs' must be between 0 and 20, got {k}"),
            ));
        }
        if !common.sampling.logprobs {
            return Err(ApiError::invalid(
                "top_logprobs",
                "'top_logprobs' needs 'logprobs': true",
            ));
        }
        common.sampling.top_logprobs = k as u32;
    }
    let msgs = match get(o, "messages") {
        Some(Value::Array(a)) if !a.is_empty() => a,
        Some(Value::Array(_)) => return Err(ApiError::invalid("messages", "'messages' must not be empty")),
        Some(v) => return Err(wrong_type("messages", "an array", v)),
        None => return Err(ApiError::invalid("messages", "you must provide 'messages'")),
    };
    let tools = tools::parse_tools(o)?;
    let mut messages: Vec<ChatMessage> = Vec::with_capacity(msgs.len());
    for (i, m) in msgs.iter().enumerate() {
        let Some(m) = m.as_object() else {
            return Err(wrong_type(&format!("messages[{i}]"), "an object", m));
        };
        let role = match m.get("role").and_then(Value::as_str) {
            Some("developer") => "system",
            Some(r @ ("system" | "user" | "assistant" | "tool")) => r,
            Some(r) => {
                return Err(ApiError::invalid(
                    &format!("messages[{i}].role"),
                    format!("unknown role {r:?}; use system, developer, user, assistant or tool"),
                ))
            }
            None => {
                return Err(ApiError::invalid(
                    &format!("messages[{i}].role"),
                    "each message needs a 'role'",
                ))
            }
        };
        let mut msg = ChatMessage::new(role, &message_content(i, m.get("content"))?);
        match (role, get(m, "tool_calls")) {
            ("assistant", Some(Value::Array(calls))) => msg.tool_calls = history_calls(i, calls)?,
            (_, Some(Value::Array(_)) | None) => {}
            (_, Some(v)) => return Err(wrong_type(&format!("messages[{i}].tool_calls"), "an array", v)),
        }
        if role == "assistant" {
            // vLLM's and DeepSeek's field, and OpenRouter's name for it.
            for key in ["reasoning_content", "reasoning"] {
                match get(m, key) {
                    None => {}
                    Some(Value::String(r)) => msg.reasoning_content = Some(r.clone()),
                    Some(v) => return Err(wrong_type(&format!("messages[{i}].{key}"), "a string", v)),
                }
            }
        }
        match get(m, "name") {
            None => {}
            Some(Value::String(n)) => msg.name = Some(n.clone()),
            Some(v) => return Err(wrong_type(&format!("messages[{i}].name"), "a string", v)),
        }
        if role == "tool" {
            let Some(Value::String(id)) = get(m, "tool_call_id") else {
                return Err(ApiError::invalid(
                    &format!("messages[{i}].tool_call_id"),
                    "a 'tool' message needs the 'tool_call_id' it answers",
                ));
            };
            // The function's name, from the call it answers (templates print it).
            if msg.name.is_none() {
                msg.name = messages
                    .iter()
                    .rev()
                    .flat_map(|p| p.tool_calls.iter())
                    .find(|c| &c.id == id)
                    .map(|c| c.function.name.clone());
            }
            msg.tool_call_id = Some(id.clone());
        }
        messages.push(msg);
    }
    let template_kwargs = match get(o, "chat_template_kwargs") {
        None => Map::new(),
        Some(Value::Object(k)) => k.clone(),
        Some(v) => return Err(wrong_type("chat_template_kwargs", "an object", v)),
    };
    common.tools = tools;
    Ok(ChatRequest {
        common,
        messages,
        template_kwargs,
    })
}

/// An assistant message's `tool_calls` as templates read them: `arguments` as an object
/// (OpenAI sends a JSON string; a string that is not JSON is kept as the string).
fn history_calls(i: usize, calls: &[Value]) -> Result<Vec<hearth_protocol::ToolCall>, ApiError> {
    calls
        .iter()
        .enumerate()
        .map(|(j, c)| {
            let p = format!("messages[{i}].tool_calls[{j}]");
            let f = c
                .get("function")
                .and_then(Value::as_object)
                .ok_or_else(|| ApiError::invalid(&p, "a tool call needs a 'function' object"))?;
            let name = f
                .get("name")
                .and_then(Value::as_str)
                .ok_or_else(|| ApiError::invalid(&format!("{p}.function.name"), "a tool call needs a function name"))?;
            let arguments = match f.get("arguments") {
                Some(Value::String(s)) => serde_json::from_str::<Value>(s).unwrap_or_else(|_| json!(s)),
                Some(v @ Value::Object(_)) => v.clone(),
                None | Some(Value::Null) => json!({}),
                Some(v) => {
                    return Err(wrong_type(
                        &format!("{p}.function.arguments"),
                        "a JSON string or an object",
                        v,
                    ))
                }
            };
            Ok(hearth_protocol::ToolCall {
                id: c.get("id").and_then(Value::as_str).unwrap_or_default().to_string(),
                kind: "function".into(),
                function: hearth_protocol::FunctionCall {
                    name: name.to_string(),
                    arguments,
                },
            })
        })
        .collect()
}

pub fn parse_completion(body: &[u8]) -> Result<CompletionRequest, ApiError> {
    let o = parse_object(body)?;
    let mut common = parse_common(&o, &["max_tokens"])?;
    // The legacy API's `logprobs` is the number of alternatives (0-5).
    if let Some(k) = opt_i64(&o, "logprobs")? {
        if !(0..=5).contains(&k) {
            return Err(ApiError::invalid(
                "logprobs",
                format!("'logprobs' must be between 0 and 5, got {k}"),
            ));
        }
        common.sampling.logprobs = true;
        common.sampling.top_logprobs = k as u32;
    }
    let bad = || {
        ApiError::invalid(
            "prompt",
            "'prompt' must be a string, an array of token ids, or a one-element array of either",
        )
    };
    let token_ids = |a: &Vec<Value>| -> Option<Vec<u32>> {
        a.iter()
            .map(|v| v.as_u64().and_then(|n| u32::try_from(n).ok()))
            .collect()
    };
    let prompt = match get(&o, "prompt") {
        None => return Err(ApiError::invalid("prompt", "you must provide 'prompt'")),
        Some(Value::String(s)) => Prompt::Text(s.clone()),
        Some(Value::Array(a)) if a.len() == 1 => match &a[0] {
            Value::String(s) => Prompt::Text(s.clone()),
            Value::Array(inner) => Prompt::Tokens(token_ids(inner).ok_or_else(bad)?),
            Value::Number(_) => Prompt::Tokens(token_ids(a).ok_or_else(bad)?),
            _ => return Err(bad()),
        },
        Some(Value::Array(a)) if a.iter().all(Value::is_number) => Prompt::Tokens(token_ids(a).ok_or_else(bad)?),
        Some(Value::Array(_)) => {
            return Err(ApiError::unsupported(
                "prompt",
                "batches of several prompts are not supported yet; send one per request",
            ))
        }
        Some(_) => return Err(bad()),
    };
    match &prompt {
        Prompt::Text(s) if s.is_empty() => return Err(ApiError::invalid("prompt", "'prompt' must not be empty")),
        Prompt::Tokens(t) if t.is_empty() => return Err(ApiError::invalid("prompt", "'prompt' must not be empty")),
        _ => {}
    }
    if get(&o, "tools").is_some_and(|t| t.as_array().is_none_or(|a| !a.is_empty())) {
        return Err(ApiError::unsupported(
            "tools",
            "tools are a chat feature: use /v1/chat/completions",
        ));
    }
    if opt_bool(&o, "echo")? == Some(true) {
        return Err(ApiError::unsupported("echo", "'echo' is not supported yet"));
    }
    if let Some(s) = get(&o, "suffix") {
        if s.as_str().is_some_and(|s| !s.is_empty()) {
            return Err(ApiError::unsupported("suffix", "'suffix' is not supported"));
        }
    }
    Ok(CompletionRequest { common, prompt })
}

/// OpenAI's `usage` object.
pub fn usage_json(u: &Usage) -> Value {
    usage_json_with(u, 0)
}

/// OpenAI's `usage` object, with the completion's reasoning tokens (counted by the gateway's
/// reasoning parser).
pub fn usage_json_with(u: &Usage, reasoning_tokens: u32) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": reasoning_tokens},
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(v: Value) -> Result<ChatRequest, ApiError> {
        parse_chat(v.to_string().as_bytes())
    }

    /// JSON shaped like requests: the parameters' names (and a stranger) with any values,
    /// nested a little.
    fn request_json() -> impl proptest::strategy::Strategy<Value = Value> {
        use proptest::prelude::*;
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            any::<f64>().prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
            prop_oneof![
                Just("user".to_string()),
                Just("assistant".to_string()),
                Just("system".to_string()),
                Just("tool".to_string()),
                Just("json_schema".to_string()),
                Just("function".to_string()),
                Just("auto".to_string()),
                Just("required".to_string()),
                Just("m".to_string()),
                proptest::collection::vec(any::<char>(), 0..12).prop_map(|c| c.into_iter().collect()),
            ]
            .prop_map(Value::from),
        ];
        let keys = proptest::sample::select(vec![
            "model",
            "messages",
            "prompt",
            "role",
            "content",
            "max_tokens",
            "max_completion_tokens",
            "temperature",
            "top_p",
            "n",
            "stop",
            "seed",
            "stream",
            "stream_options",
            "include_usage",
            "logprobs",
            "top_logprobs",
            "tools",
            "tool_choice",
            "type",
            "function",
            "name",
            "parameters",
            "response_format",
            "json_schema",
            "schema",
            "text",
            "image_url",
            "tool_calls",
            "tool_call_id",
            "arguments",
            "prompt_cache_key",
            "min_tokens",
            "ignore_eos",
            "logit_bias",
            "user",
            "echo",
            "suffix",
            "best_of",
            "presence_penalty",
            "frequency_penalty",
            "properties",
            "required",
            "items",
            "enum",
            "zz",
        ]);
        leaf.prop_recursive(4, 48, 6, move |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
                proptest::collection::vec((keys.clone(), inner), 0..6)
                    .prop_map(|kv| { Value::Object(kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect()) }),
            ]
        })
    }

    fn fuzz_cases() -> u32 {
        std::env::var("HEARTH_FUZZ_CASES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(512)
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(fuzz_cases()))]

        /// Any JSON, and any bytes: the parsers answer (a request or a 400), never panic.
        #[test]
        fn parsers_survive_random_json(v in request_json(), messages in request_json(), prompt in request_json()) {
            let mut v = v;
            if let Value::Object(o) = &mut v {
                // Mostly well-formed tops, so the parsers get past the first checks.
                o.entry("model").or_insert(Value::from("m"));
                o.entry("messages").or_insert(messages);
                o.entry("prompt").or_insert(prompt);
            }
            let bytes = v.to_string();
            if let Err(e) = parse_chat(bytes.as_bytes()) {
                proptest::prop_assert!(e.status.is_client_error(), "{e:?}");
            }
            if let Err(e) = parse_completion(bytes.as_bytes()) {
                proptest::prop_assert!(e.status.is_client_error(), "{e:?}");
            }
        }

        #[test]
        fn parsers_survive_random_bytes(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..256)) {
            let _ = parse_chat(&bytes);
            let _ = parse_completion(&bytes);
        }
    }

    #[test]
    fn parses_a_full_chat_request() {
        let r = chat(json!({
            "model": "m", "messages": [{"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
                                        {"role": "user", "content": "hi"}],
            "temperature": 0, "top_p": 0.9, "max_completion_tokens": 5, "stop": "x", "seed": 7,
            "stream": true, "stream_options": {"include_usage": true}, "n": 3, "user": "u1",
            "logprobs": true, "top_logprobs": 2, "prompt_cache_key": "conv-1", "ignore_eos": true, "min_tokens": 2
        }))
        .unwrap();
        assert_eq!(r.common.n, 3);
        assert!(r.common.sampling.logprobs && r.common.sampling.top_logprobs == 2);
        assert_eq!(r.common.prompt_cache_key.as_deref(), Some("conv-1"));
        assert!(r.common.sampling.ignore_eos && r.common.sampling.min_tokens == 2);
        assert_eq!(r.messages[0], ChatMessage::new("system", "be brief"));
        assert_eq!(r.common.max_tokens, Some(5));
        assert_eq!(r.common.sampling.temperature, 0.0);
        assert_eq!(r.common.sampling.stop, ["x"]);
        assert_eq!(r.common.sampling.seed, Some(7));
        assert!(r.common.stream && r.common.include_usage);
    }

    #[test]
    fn history_reaches_the_template_with_structure() {
        let r = chat(json!({
            "model": "m", "chat_template_kwargs": {"enable_thinking": false},
            "messages": [
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": null, "reasoning_content": "Use the tool.",
                 "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "21C"}
            ]
        }))
        .unwrap();
        let a = &r.messages[1];
        assert_eq!(a.content, "");
        assert_eq!(a.reasoning_content.as_deref(), Some("Use the tool."));
        assert_eq!(a.tool_calls[0].function.arguments, json!({"city": "Paris"}));
        assert_eq!(
            r.messages[2].name.as_deref(),
            Some("get_weather"),
            "named from the call it answers"
        );
        assert_eq!(r.template_kwargs.get("enable_thinking"), Some(&json!(false)));
    }

    #[test]
    fn names_the_bad_parameter() {
        let cases = [
            (json!({"messages": [{"role": "user", "content": "x"}]}), "model"),
            (json!({"model": "m"}), "messages"),
            (json!({"model": "m", "messages": []}), "messages"),
            (
                json!({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}),
                "messages[0].role",
            ),
            (
                json!({"model": "m", "messages": [{"role": "user", "content": 5}]}),
                "messages[0].content",
            ),
            (
                json!({"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 3}),
                "temperature",
            ),
            (
                json!({"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}),
                "temperature",
            ),
            (
                json!({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}),
                "max_tokens",
            ),
            (
                json!({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 17}),
                "n",
            ),
            (
                json!({"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": ["a","b","c","d","e"]}),
                "stop",
            ),
            (
                json!({"model": "m", "messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": true}}),
                "stream_options",
            ),
            (
                json!({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
                "messages[0].content[0].type",
            ),
        ];
        for (body, param) in cases {
            let e = chat(body.clone()).unwrap_err();
            assert_eq!(e.status, 400, "{body}");
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
        }
        let e = parse_chat(b"{not json").unwrap_err();
        assert_eq!(e.code, Some("invalid_json"));
        let e = parse_chat(b"[1]").unwrap_err();
        assert_eq!(e.code, Some("invalid_json"));
    }

    #[test]
    fn completion_prompts() {
        let p =
            |v: Value| parse_completion(json!({"model": "m", "prompt": v}).to_string().as_bytes()).map(|r| r.prompt);
        assert_eq!(p(json!("hi")).unwrap(), Prompt::Text("hi".into()));
        assert_eq!(p(json!(["hi"])).unwrap(), Prompt::Text("hi".into()));
        assert_eq!(p(json!([1, 2])).unwrap(), Prompt::Tokens(vec![1, 2]));
        assert_eq!(p(json!([[3]])).unwrap(), Prompt::Tokens(vec![3]));
        assert_eq!(p(json!([-1])).unwrap_err().param.as_deref(), Some("prompt"));
        assert_eq!(p(json!("")).unwrap_err().param.as_deref(), Some("prompt"));
        assert_eq!(p(json!(["a", "b"])).unwrap_err().code, Some("unsupported_parameter"));
    }
}

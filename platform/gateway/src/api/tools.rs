//! Tool calling and structured outputs: OpenAI's `tools`, `tool_choice`,
//! `parallel_tool_calls` and `response_format`, and what the gateway makes of them for a
//! model — see [`hearth_protocol::output::tools`] for the per-family formats.
//!
//! A model whose chat template takes tools gets them through its template, writes calls in
//! its family's format, and has its history rendered by its template too. A template
//! without tools (the default SmolLM2's) gets **Hearth's tool format**: the definitions go
//! into the system message, one JSON object per line between `<tools>` and `</tools>`; the
//! model calls a function by answering with one block per call:
//!
//! ```text
//! <tool_call>
//! {"name": "get_weather", "arguments": {"city": "Paris"}}
//! </tool_call>
//! ```
//!
//! and an assistant message's `tool_calls` are written back into the conversation in that
//! form, a `role: "tool"` message's content between `<tool_response>` and
//! `</tool_response>`. With `tool_choice` `required` or a named function the output is
//! *constrained* to calls in the model's format (a Lark grammar whose arguments are the
//! tools' JSON Schemas), so the arguments always parse and validate; with `auto` the model
//! may answer in text, and calls it writes are parsed into `tool_calls`.

use hearth_protocol::output::tools::{grammar, ToolDef, ToolFormat};
use hearth_protocol::{layout_json, ChatMessage, Constraint};
use serde_json::{json, Map, Value};

use crate::server::error::ApiError;

#[derive(Debug, Clone, PartialEq)]
pub enum ToolChoice {
    None,
    Auto,
    Required,
    Function(String),
}

/// A request's tools.
#[derive(Debug, Clone, PartialEq)]
pub struct Tools {
    pub tools: Vec<ToolDef>,
    /// The client's tool objects, as sent (what a template that takes tools is given: their
    /// keys in the client's order, fields Hearth does not read kept).
    pub objects: Vec<Value>,
    pub choice: ToolChoice,
    pub parallel: bool,
}

fn is_valid_name(s: &str) -> bool {
    !s.is_empty() && s.len() <= 64 && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// Parses `tools`, `tool_choice` and `parallel_tool_calls` (None: no tools).
pub fn parse_tools(o: &Map<String, Value>) -> Result<Option<Tools>, ApiError> {
    let list = match o.get("tools") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => a.clone(),
        Some(_) => return Err(ApiError::invalid("tools", "'tools' must be an array")),
    };
    let mut tools = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        let p = |f: &str| format!("tools[{i}]{f}");
        if t.get("type").and_then(Value::as_str) != Some("function") {
            return Err(ApiError::invalid(&p(".type"), "each tool needs 'type': 'function'"));
        }
        let f = t
            .get("function")
            .and_then(Value::as_object)
            .ok_or_else(|| ApiError::invalid(&p(".function"), "each tool needs a 'function' object"))?;
        let name = f.get("name").and_then(Value::as_str).unwrap_or_default();
        if !is_valid_name(name) {
            return Err(ApiError::invalid(
                &p(".function.name"),
                format!("a function name must be 1-64 characters of a-z, A-Z, 0-9, _ and -; got {name:?}"),
            ));
        }
        if tools.iter().any(|t: &ToolDef| t.name == name) {
            return Err(ApiError::invalid(
                &p(".function.name"),
                format!("two tools are named {name:?}"),
            ));
        }
        let parameters = match f.get("parameters") {
            None | Some(Value::Null) => json!({"type": "object"}),
            Some(v @ Value::Object(_)) => v.clone(),
            Some(_) => {
                return Err(ApiError::invalid(
                    &p(".function.parameters"),
                    "'parameters' must be a JSON Schema object",
                ))
            }
        };
        tools.push(ToolDef {
            name: name.to_string(),
            description: f.get("description").and_then(Value::as_str).map(str::to_string),
            parameters,
        });
    }
    let choice = match o.get("tool_choice") {
        None | Some(Value::Null) => {
            if tools.is_empty() {
                ToolChoice::None
            } else {
                ToolChoice::Auto
            }
        }
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!("'tool_choice' must be none, auto, required or a function; got {other:?}"),
                ))
            }
        },
        Some(Value::Object(c)) => {
            let name = c
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .ok_or_else(|| {
                    ApiError::invalid(
                        "tool_choice",
                        "a named tool_choice is {\"type\": \"function\", \"function\": {\"name\": ...}}",
                    )
                })?;
            ToolChoice::Function(name.to_string())
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "tool_choice",
                "'tool_choice' must be a string or an object",
            ))
        }
    };
    match &choice {
        ToolChoice::Required | ToolChoice::Auto if tools.is_empty() => {
            return Err(ApiError::invalid("tool_choice", "'tool_choice' needs 'tools'"));
        }
        ToolChoice::Function(name) if !tools.iter().any(|t| &t.name == name) => {
            return Err(ApiError::invalid(
                "tool_choice",
                format!("tool_choice names {name:?}, which is not in 'tools'"),
            ));
        }
        _ => {}
    }
    let parallel = match o.get("parallel_tool_calls") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(ApiError::invalid(
                "parallel_tool_calls",
                "'parallel_tool_calls' must be a boolean",
            ))
        }
    };
    if tools.is_empty() {
        return Ok(None);
    }
    Ok(Some(Tools {
        tools,
        objects: list,
        choice,
        parallel,
    }))
}

/// Parses `response_format` into the constraint it asks for (None: free text).
pub fn parse_response_format(o: &Map<String, Value>) -> Result<Option<Constraint>, ApiError> {
    let Some(rf) = o.get("response_format").filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let Some(rf) = rf.as_object() else {
        return Err(ApiError::invalid(
            "response_format",
            "'response_format' must be an object",
        ));
    };
    match rf.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Constraint::JsonSchema {
            schema: json!({"type": "object"}),
        })),
        Some("json_schema") => {
            let js = rf.get("json_schema").and_then(Value::as_object).ok_or_else(|| {
                ApiError::invalid(
                    "response_format.json_schema",
                    "'json_schema' must be an object with 'name' and 'schema'",
                )
            })?;
            let name = js.get("name").and_then(Value::as_str).unwrap_or_default();
            if !is_valid_name(name) {
                return Err(ApiError::invalid(
                    "response_format.json_schema.name",
                    format!("'name' must be 1-64 characters of a-z, A-Z, 0-9, _ and -; got {name:?}"),
                ));
            }
            if js.get("strict").is_some_and(|s| !s.is_boolean() && !s.is_null()) {
                return Err(ApiError::invalid(
                    "response_format.json_schema.strict",
                    "'strict' must be a boolean",
                ));
            }
            let schema = match js.get("schema") {
                None | Some(Value::Null) => json!({}),
                Some(s @ (Value::Object(_) | Value::Bool(_))) => s.clone(),
                Some(_) => {
                    return Err(ApiError::invalid(
                        "response_format.json_schema.schema",
                        "'schema' must be a JSON Schema object",
                    ))
                }
            };
            // Constrained whatever `strict` says: the output always matches.
            Ok(Some(Constraint::JsonSchema { schema }))
        }
        other => Err(ApiError::invalid(
            "response_format.type",
            format!("'response_format.type' must be text, json_object or json_schema; got {other:?}"),
        )),
    }
}

impl Tools {
    /// Whether the model is told about the tools and its output parsed for calls.
    pub fn active(&self) -> bool {
        self.choice != ToolChoice::None
    }

    fn is_offered(&self, t: &ToolDef) -> bool {
        match &self.choice {
            ToolChoice::Function(name) => &t.name == name,
            _ => true,
        }
    }

    /// The tools the model is told about (only the named one under a named `tool_choice`).
    pub fn offered(&self) -> Vec<ToolDef> {
        self.tools.iter().filter(|t| self.is_offered(t)).cloned().collect()
    }

    /// The offered tools as the client sent them.
    pub fn offered_objects(&self) -> Vec<Value> {
        self.tools
            .iter()
            .zip(&self.objects)
            .filter(|(t, _)| self.is_offered(t))
            .map(|(_, o)| o.clone())
            .collect()
    }

    /// The system-message section that describes the tools in Hearth's format.
    pub fn system_prompt(&self) -> String {
        let mut s = String::from(
            "# Tools\n\nYou may call one or more functions to help with the user's request. \
             The functions are described below, one JSON object per line:\n<tools>\n",
        );
        for t in self.offered() {
            let mut d = json!({"name": t.name, "parameters": t.parameters});
            if let Some(desc) = &t.description {
                d["description"] = json!(desc);
            }
            s.push_str(&d.to_string());
            s.push('\n');
        }
        s.push_str("</tools>\n\nTo call a function, answer with one block per call:\n");
        s.push_str("<tool_call>\n{\"name\": \"<function name>\", \"arguments\": <the arguments as a JSON object>}\n</tool_call>\n");
        match &self.choice {
            ToolChoice::Required => s.push_str("You must call at least one function.\n"),
            ToolChoice::Function(n) => s.push_str(&format!("You must call the function {n}.\n")),
            _ => s.push_str("If no function helps, answer the user directly.\n"),
        }
        s
    }

    /// With `required` or a named function: a grammar that admits only calls of offered
    /// tools in `format`, with arguments valid for their schemas. `token`: a delimiter's id
    /// when the vocabulary has it as a special token.
    pub fn constraint(&self, format: ToolFormat, token: &dyn Fn(&str) -> Option<u32>) -> Option<Constraint> {
        self.constraint_for(&self.offered(), format, token)
    }

    /// [`constraint`](Self::constraint) for the offered tools already at hand.
    pub fn constraint_for(
        &self,
        offered: &[ToolDef],
        format: ToolFormat,
        token: &dyn Fn(&str) -> Option<u32>,
    ) -> Option<Constraint> {
        self.forced().then(|| Constraint::Lark {
            grammar: grammar(format, offered, self.parallel, token),
        })
    }

    /// `required` or a named function: the answer must be calls.
    pub fn forced(&self) -> bool {
        matches!(self.choice, ToolChoice::Required | ToolChoice::Function(_))
    }
}

/// The conversation in Hearth's tool format, for a template that takes no tools: the tool
/// definitions close the system message (when `tools` are active), assistant calls become
/// `<tool_call>` blocks and tool results `<tool_response>` blocks.
pub fn in_hearth_format(messages: &[ChatMessage], tools: Option<&Tools>) -> Vec<ChatMessage> {
    let mut out: Vec<ChatMessage> = messages
        .iter()
        .map(|m| {
            let mut m = m.clone();
            if !m.tool_calls.is_empty() {
                let blocks = render_calls(&m.tool_calls);
                m.content = if m.content.is_empty() {
                    blocks
                } else {
                    format!("{}\n{blocks}", m.content)
                };
                m.tool_calls.clear();
            }
            if m.role == "tool" {
                m.content = render_result(&m.content);
            }
            m
        })
        .collect();
    if let Some(t) = tools.filter(|t| t.active()) {
        let section = t.system_prompt();
        match out.first_mut() {
            Some(m) if m.role == "system" => m.content = format!("{}\n\n{section}", m.content),
            _ => out.insert(0, ChatMessage::new("system", &section)),
        }
    }
    out
}

/// An assistant message's `tool_calls`, written back in Hearth's format (the layout the
/// model writes and a constrained call has, so prompt lookup can draft it).
fn render_calls(calls: &[hearth_protocol::ToolCall]) -> String {
    calls
        .iter()
        .map(|c| {
            format!(
                "<tool_call>\n{}\n</tool_call>",
                layout_json(&json!({"name": c.function.name, "arguments": c.function.arguments}))
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// A tool result, as the model reads it.
fn render_result(content: &str) -> String {
    format!("<tool_response>\n{content}\n</tool_response>")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weather() -> Value {
        json!({"type": "function", "function": {"name": "get_weather", "description": "Weather now",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})
    }

    fn tools(v: Value) -> Result<Option<Tools>, ApiError> {
        parse_tools(v.as_object().unwrap())
    }

    #[test]
    fn parses_tools_and_choices_and_names_bad_params() {
        let t = tools(json!({"tools": [weather()]})).unwrap().unwrap();
        assert_eq!(t.choice, ToolChoice::Auto);
        assert!(t.parallel && t.active() && t.constraint(ToolFormat::Hearth, &|_| None).is_none());
        let t = tools(json!({"tools": [weather()], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "parallel_tool_calls": false}))
            .unwrap()
            .unwrap();
        assert_eq!(t.choice, ToolChoice::Function("get_weather".into()));
        let Some(Constraint::Lark { grammar }) = t.constraint(ToolFormat::Hearth, &|_| None) else {
            panic!()
        };
        assert!(grammar.starts_with("start: block\n"), "{grammar}");
        assert!(grammar.contains("\"const\":\"get_weather\""), "{grammar}");
        let t = tools(json!({"tools": [weather()], "tool_choice": "required"}))
            .unwrap()
            .unwrap();
        let Some(Constraint::Lark { grammar }) = t.constraint(ToolFormat::Hearth, &|_| None) else {
            panic!()
        };
        assert_eq!(
            grammar.matches(" block").count(),
            hearth_protocol::output::tools::MAX_PARALLEL_CALLS,
            "{grammar}"
        );
        assert!(tools(json!({"tools": []})).unwrap().is_none());
        for (body, param) in [
            (json!({"tools": [{"type": "retrieval"}]}), "tools[0].type"),
            (
                json!({"tools": [{"type": "function", "function": {"name": "a b"}}]}),
                "tools[0].function.name",
            ),
            (json!({"tools": [weather(), weather()]}), "tools[1].function.name"),
            (json!({"tools": [weather()], "tool_choice": "sometimes"}), "tool_choice"),
            (
                json!({"tools": [weather()], "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
                "tool_choice",
            ),
            (json!({"tool_choice": "required"}), "tool_choice"),
            (
                json!({"tools": [weather()], "parallel_tool_calls": "yes"}),
                "parallel_tool_calls",
            ),
        ] {
            let e = tools(body.clone()).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
        }
    }

    #[test]
    fn parses_response_formats() {
        let rf = |v: Value| parse_response_format(json!({"response_format": v}).as_object().unwrap());
        assert_eq!(rf(json!({"type": "text"})).unwrap(), None);
        assert_eq!(
            rf(json!({"type": "json_object"})).unwrap(),
            Some(Constraint::JsonSchema {
                schema: json!({"type": "object"})
            })
        );
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        assert_eq!(
            rf(json!({"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": true}})).unwrap(),
            Some(Constraint::JsonSchema { schema })
        );
        for (v, param) in [
            (json!({"type": "yaml"}), "response_format.type"),
            (json!({"type": "json_schema"}), "response_format.json_schema"),
            (
                json!({"type": "json_schema", "json_schema": {"schema": {}}}),
                "response_format.json_schema.name",
            ),
            (
                json!({"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}),
                "response_format.json_schema.schema",
            ),
            (json!("json"), "response_format"),
        ] {
            assert_eq!(rf(v.clone()).unwrap_err().param.as_deref(), Some(param), "{v}");
        }
    }

    #[test]
    fn history_calls_are_written_as_the_model_writes_them() {
        let mut a = ChatMessage::new("assistant", "");
        a.tool_calls = vec![
            hearth_protocol::ToolCall {
                id: "call_1".into(),
                kind: "function".into(),
                function: hearth_protocol::FunctionCall {
                    name: "get_weather".into(),
                    arguments: json!({"city": "Paris", "days": [1, 2]}),
                },
            },
            hearth_protocol::ToolCall {
                id: "call_2".into(),
                kind: "function".into(),
                function: hearth_protocol::FunctionCall {
                    name: "get_time".into(),
                    arguments: json!({}),
                },
            },
        ];
        let mut result = ChatMessage::new("tool", "21C");
        result.tool_call_id = Some("call_1".into());
        let t = tools(json!({"tools": [weather()]})).unwrap().unwrap();
        let out = in_hearth_format(&[ChatMessage::new("user", "Hi"), a, result], Some(&t));
        assert_eq!(out[0].role, "system");
        assert!(
            out[0].content.contains("<tools>\n{\"name\":\"get_weather\""),
            "{}",
            out[0].content
        );
        assert_eq!(
            out[2].content,
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": [1, 2]}}\n</tool_call>\n\
             <tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>"
        );
        assert!(out[2].tool_calls.is_empty());
        assert_eq!(out[3].content, "<tool_response>\n21C\n</tool_response>");
        // What the model writes in that format parses back into the same calls.
        let (_, parsed) = hearth_protocol::output::ToolStream::parse(ToolFormat::Hearth, &t.tools, &out[2].content);
        assert_eq!(parsed.len(), 2);
        assert_eq!(parsed[0].arguments, "{\"city\": \"Paris\", \"days\": [1, 2]}");
    }
}

//! Tool calling and structured outputs: OpenAI's `tools`, `tool_choice`,
//! `parallel_tool_calls` and `response_format`, mapped onto Hearth's own tool format and
//! the engine's constrained decoding.
//!
//! **Hearth's tool format** (used for every model: the default SmolLM2's chat template has
//! no tool support). The tool definitions go into the system message, one JSON object per
//! line between `<tools>` and `</tools>`; the model calls a function by answering with one
//! block per call:
//!
//! ```text
//! <tool_call>
//! {"name": "get_weather", "arguments": {"city": "Paris"}}
//! </tool_call>
//! ```
//!
//! An assistant message's `tool_calls` are written back into the conversation in that form,
//! and a `role: "tool"` message's content between `<tool_response>` and `</tool_response>`.
//! With `tool_choice` `required` or a named function the output is *constrained* to such
//! blocks (a Lark grammar whose calls are the tools' JSON Schemas), so the arguments always
//! parse and validate; with `auto` the model may answer in text, and blocks it writes are
//! parsed into `tool_calls` when they are well-formed.

use hearth_protocol::{json_layout, layout_json, Constraint};
use serde_json::{json, Map, Value};

use crate::error::ApiError;

pub const CALL_OPEN: &str = "<tool_call>";
pub const CALL_CLOSE: &str = "</tool_call>";
/// At most this many calls in one constrained answer (`parallel_tool_calls`).
pub const MAX_PARALLEL_CALLS: usize = 4;

/// One function the model may call.
#[derive(Debug, Clone, PartialEq)]
pub struct Tool {
    pub name: String,
    pub description: Option<String>,
    /// The arguments' JSON Schema (`{"type": "object"}` when absent).
    pub parameters: Value,
}

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
    pub tools: Vec<Tool>,
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
        if tools.iter().any(|t: &Tool| t.name == name) {
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
        tools.push(Tool {
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

    fn offered(&self) -> impl Iterator<Item = &Tool> {
        self.tools.iter().filter(move |t| match &self.choice {
            ToolChoice::Function(name) => &t.name == name,
            _ => true,
        })
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

    /// With `required` or a named function: a grammar that admits only tool-call blocks
    /// whose JSON is a call of an offered tool with arguments valid for its schema.
    pub fn constraint(&self) -> Option<Constraint> {
        if !matches!(self.choice, ToolChoice::Required | ToolChoice::Function(_)) {
            return None;
        }
        let calls: Vec<Value> = self
            .offered()
            .map(|t| {
                let mut args = t.parameters.clone();
                if let Some(o) = args.as_object_mut() {
                    o.insert("x-guidance".into(), json_layout());
                }
                json!({
                    "type": "object",
                    "properties": {"name": {"const": t.name}, "arguments": args},
                    "required": ["name", "arguments"],
                    "additionalProperties": false,
                })
            })
            .collect();
        let mut call = if calls.len() == 1 {
            calls.into_iter().next().unwrap_or_default()
        } else {
            json!({"anyOf": calls})
        };
        if let Some(o) = call.as_object_mut() {
            o.insert("x-guidance".into(), json_layout());
        }
        let blocks = if self.parallel { MAX_PARALLEL_CALLS } else { 1 };
        // block ("\n" block ("\n" block)?)? … : one to `blocks` calls.
        let mut start = String::from("block");
        let mut tail = String::new();
        for _ in 1..blocks {
            start.push_str(" (\"\\n\" block");
            tail.push_str(")?");
        }
        Some(Constraint::Lark {
            grammar: format!(
                "start: {start}{tail}\nblock: \"{CALL_OPEN}\\n\" call \"\\n{CALL_CLOSE}\"\ncall: %json {call}\n"
            ),
        })
    }
}

/// An assistant message's `tool_calls`, written back in Hearth's format.
pub fn render_calls(i: usize, calls: &[Value]) -> Result<String, ApiError> {
    let mut out = String::new();
    for (j, c) in calls.iter().enumerate() {
        let p = format!("messages[{i}].tool_calls[{j}]");
        let f = c
            .get("function")
            .and_then(Value::as_object)
            .ok_or_else(|| ApiError::invalid(&p, "a tool call needs a 'function' object"))?;
        let name = f
            .get("name")
            .and_then(Value::as_str)
            .ok_or_else(|| ApiError::invalid(&format!("{p}.function.name"), "a tool call needs a function name"))?;
        let args = match f.get("arguments") {
            Some(Value::String(s)) => serde_json::from_str::<Value>(s).unwrap_or_else(|_| json!(s)),
            Some(v @ Value::Object(_)) => v.clone(),
            _ => json!({}),
        };
        if !out.is_empty() {
            out.push('\n');
        }
        out.push_str(&format!(
            "{CALL_OPEN}\n{}\n{CALL_CLOSE}",
            layout_json(&json!({"name": name, "arguments": args}))
        ));
    }
    Ok(out)
}

/// A tool result, as the model reads it.
pub fn render_result(content: &str) -> String {
    format!("<tool_response>\n{content}\n</tool_response>")
}

/// A tool call the model made.
#[derive(Debug, Clone, PartialEq)]
pub struct Call {
    pub id: String,
    pub name: String,
    /// The arguments as a JSON string (OpenAI's shape).
    pub arguments: String,
}

impl Call {
    pub fn json(&self) -> Value {
        json!({"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}})
    }
}

pub fn call_id() -> String {
    format!("call_{}", crate::app::random_id())
}

/// A whole answer split into its text and its tool calls: blocks that are well-formed
/// (`{"name": string, "arguments": object}`) are calls; a malformed block stays text.
pub fn parse_output(text: &str) -> (Option<String>, Vec<Call>) {
    let mut calls = Vec::new();
    let mut content = String::new();
    let mut rest = text;
    while let Some(at) = rest.find(CALL_OPEN) {
        let after = &rest[at + CALL_OPEN.len()..];
        let mut it = serde_json::Deserializer::from_str(after).into_iter::<Value>();
        let parsed = match it.next() {
            Some(Ok(v)) => Some((v, it.byte_offset())),
            _ => None,
        };
        let call = parsed.and_then(|(v, end)| {
            let name = v.get("name")?.as_str()?.to_string();
            let args = v.get("arguments").filter(|a| a.is_object())?;
            let tail = after[end..].trim_start();
            let consumed = if let Some(t) = tail.strip_prefix(CALL_CLOSE) {
                after.len() - t.len()
            } else if tail.is_empty() {
                after.len() // cut off at the end: the call is complete anyway
            } else {
                return None;
            };
            // In the layout the model writes (and a constrained call has): the same text
            // a streamed call's arguments arrive as.
            Some((name, layout_json(args), consumed))
        });
        match call {
            Some((name, arguments, consumed)) => {
                content.push_str(&rest[..at]);
                calls.push(Call {
                    id: call_id(),
                    name,
                    arguments,
                });
                rest = &after[consumed..];
            }
            None => {
                content.push_str(&rest[..at + CALL_OPEN.len()]);
                rest = after;
            }
        }
    }
    content.push_str(rest);
    let content = if calls.is_empty() {
        content
    } else {
        content.trim().to_string()
    };
    ((!content.is_empty() || calls.is_empty()).then_some(content), calls)
}

/// What a streamed choice sends next: text, or a piece of a tool call.
#[derive(Debug, Clone, PartialEq)]
pub enum Delta {
    Content(String),
    /// The first piece of call `index`: its id and name (arguments follow).
    CallStart {
        index: usize,
        id: String,
        name: String,
    },
    /// More of call `index`'s arguments.
    Arguments {
        index: usize,
        text: String,
    },
}

#[derive(Debug, Default)]
enum Mode {
    /// Text; a suffix that may begin a call block is held back.
    #[default]
    Text,
    /// Inside a call block, before its arguments started.
    Header,
    /// Streaming the arguments object: nesting depth and string state.
    Arguments {
        depth: usize,
        in_string: bool,
        escaped: bool,
    },
    /// After the arguments, until the block closes.
    Closing,
}

/// Turns a streamed answer into content and tool-call deltas as it arrives: a call's id and
/// name once they are known, then its arguments piece by piece.
#[derive(Debug, Default)]
pub struct ToolStream {
    mode: Mode,
    buf: String,
    calls: usize,
}

impl ToolStream {
    /// Calls started so far.
    pub fn calls(&self) -> usize {
        self.calls
    }

    pub fn push(&mut self, text: &str) -> Vec<Delta> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        loop {
            let progressed = match self.mode {
                Mode::Text => self.text(&mut out),
                Mode::Header => self.header(&mut out),
                Mode::Arguments { .. } => self.arguments(&mut out),
                Mode::Closing => self.closing(),
            };
            if !progressed {
                break;
            }
        }
        out
    }

    /// The end of the answer: whatever is held back is text (an unfinished call is cut).
    pub fn finish(&mut self) -> Vec<Delta> {
        let rest = std::mem::take(&mut self.buf);
        match self.mode {
            Mode::Text if !rest.is_empty() && (self.calls == 0 || !rest.trim().is_empty()) => {
                vec![Delta::Content(rest)]
            }
            _ => Vec::new(),
        }
    }

    fn text(&mut self, out: &mut Vec<Delta>) -> bool {
        if let Some(at) = self.buf.find(CALL_OPEN) {
            let before = self.buf[..at].to_string();
            if !before.trim().is_empty() {
                out.push(Delta::Content(before));
            }
            self.buf.drain(..at + CALL_OPEN.len());
            self.mode = Mode::Header;
            return true;
        }
        // Hold back a suffix that could be the start of a block.
        let keep = (1..CALL_OPEN.len().min(self.buf.len() + 1))
            .rev()
            .find(|&n| {
                self.buf.is_char_boundary(self.buf.len() - n) && CALL_OPEN.starts_with(&self.buf[self.buf.len() - n..])
            })
            .unwrap_or(0);
        let send = self.buf.len() - keep;
        // Whitespace waits for what follows it (before and between calls it is not content).
        if send > 0 && !self.buf[..send].trim().is_empty() {
            out.push(Delta::Content(self.buf[..send].to_string()));
            self.buf.drain(..send);
        }
        false
    }

    fn header(&mut self, out: &mut Vec<Delta>) -> bool {
        // {"name": "<name>", "arguments": {
        let Some(obj) = self.buf.find('{') else { return false };
        let head = &self.buf[obj + 1..];
        let Some(args_at) = head.find("\"arguments\"") else {
            return false;
        };
        let before_args = &head[..args_at];
        let after = &head[args_at + "\"arguments\"".len()..];
        let Some(colon) = after.find(':') else { return false };
        let value = after[colon + 1..].trim_start();
        if value.is_empty() {
            return false;
        }
        let name = before_args
            .split_once("\"name\"")
            .and_then(|(_, r)| r.split_once(':'))
            .map(|(_, r)| r.trim())
            .and_then(|r| serde_json::Deserializer::from_str(r).into_iter::<String>().next())
            .and_then(Result::ok);
        let (Some(name), true) = (name, value.starts_with('{')) else {
            // Not the layout Hearth asks for: the whole block is parsed at its end.
            self.mode = Mode::Closing;
            return true;
        };
        out.push(Delta::CallStart {
            index: self.calls,
            id: call_id(),
            name,
        });
        self.calls += 1;
        let start = self.buf.len() - value.len();
        self.buf.drain(..start);
        self.mode = Mode::Arguments {
            depth: 0,
            in_string: false,
            escaped: false,
        };
        true
    }

    fn arguments(&mut self, out: &mut Vec<Delta>) -> bool {
        let Mode::Arguments {
            mut depth,
            mut in_string,
            mut escaped,
        } = self.mode
        else {
            return false;
        };
        let mut end = None;
        for (i, c) in self.buf.char_indices() {
            if in_string {
                match (escaped, c) {
                    (true, _) => escaped = false,
                    (false, '\\') => escaped = true,
                    (false, '"') => in_string = false,
                    _ => {}
                }
                continue;
            }
            match c {
                '"' => in_string = true,
                '{' | '[' => depth += 1,
                '}' | ']' => {
                    depth = depth.saturating_sub(1);
                    if depth == 0 {
                        end = Some(i + 1);
                        break;
                    }
                }
                _ => {}
            }
        }
        let take = end.unwrap_or(self.buf.len());
        if take > 0 {
            out.push(Delta::Arguments {
                index: self.calls - 1,
                text: self.buf[..take].to_string(),
            });
        }
        self.buf.drain(..take);
        if end.is_some() {
            self.mode = Mode::Closing;
            true
        } else {
            self.mode = Mode::Arguments {
                depth,
                in_string,
                escaped,
            };
            false
        }
    }

    fn closing(&mut self) -> bool {
        let Some(at) = self.buf.find(CALL_CLOSE) else {
            return false;
        };
        self.buf.drain(..at + CALL_CLOSE.len());
        self.mode = Mode::Text;
        true
    }
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
        assert!(t.parallel && t.active() && t.constraint().is_none());
        let t = tools(json!({"tools": [weather()], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "parallel_tool_calls": false}))
            .unwrap()
            .unwrap();
        assert_eq!(t.choice, ToolChoice::Function("get_weather".into()));
        let Some(Constraint::Lark { grammar }) = t.constraint() else {
            panic!()
        };
        assert!(grammar.starts_with("start: block\n"), "{grammar}");
        assert!(grammar.contains("\"const\":\"get_weather\""), "{grammar}");
        let t = tools(json!({"tools": [weather()], "tool_choice": "required"}))
            .unwrap()
            .unwrap();
        let Some(Constraint::Lark { grammar }) = t.constraint() else {
            panic!()
        };
        assert_eq!(grammar.matches(" block").count(), MAX_PARALLEL_CALLS, "{grammar}");
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
    fn parses_calls_out_of_an_answer() {
        let (content, calls) = parse_output(
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>",
        );
        assert_eq!(content, None);
        assert_eq!(calls.len(), 2);
        assert_eq!(
            (calls[0].name.as_str(), calls[0].arguments.as_str()),
            ("get_weather", "{\"city\": \"Paris\"}")
        );
        assert!(calls[0].id.starts_with("call_") && calls[0].id != calls[1].id);
        let (content, calls) =
            parse_output("Let me check. <tool_call>{\"name\": \"f\", \"arguments\": {\"x\": 1}}</tool_call>");
        assert_eq!((content.as_deref(), calls.len()), (Some("Let me check."), 1));
        // Malformed blocks stay text.
        let (content, calls) = parse_output("<tool_call>{\"name\": 3}</tool_call>");
        assert_eq!(
            (content.as_deref(), calls.len()),
            (Some("<tool_call>{\"name\": 3}</tool_call>"), 0)
        );
        assert_eq!(parse_output("Paris."), (Some("Paris.".into()), vec![]));
    }

    #[test]
    fn history_calls_are_written_as_the_model_writes_them() {
        let calls = json!([
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\",\"days\":[1,2]}"}},
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
        ]);
        let text = render_calls(0, calls.as_array().unwrap()).unwrap();
        assert_eq!(
            text,
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": [1, 2]}}\n</tool_call>\n\
             <tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>"
        );
        let (_, parsed) = parse_output(&text);
        assert_eq!(parsed.len(), 2);
        assert_eq!(parsed[0].arguments, "{\"city\": \"Paris\", \"days\": [1, 2]}");
    }

    #[test]
    fn streams_calls_piece_by_piece_in_any_chunking() {
        let answer = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Pa}ris\", \"days\": [1, 2]}}\n</tool_call>\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>";
        for chunk in [1, 2, 3, 7, 1000] {
            let mut s = ToolStream::default();
            let mut deltas = Vec::new();
            let chars: Vec<char> = answer.chars().collect();
            for piece in chars.chunks(chunk) {
                deltas.extend(s.push(&piece.iter().collect::<String>()));
            }
            deltas.extend(s.finish());
            let mut args = ["".to_string(), "".to_string()];
            let mut names = Vec::new();
            for d in deltas {
                match d {
                    Delta::CallStart { index, name, .. } => names.push((index, name)),
                    Delta::Arguments { index, text } => args[index].push_str(&text),
                    Delta::Content(c) => panic!("chunk {chunk}: unexpected content {c:?}"),
                }
            }
            assert_eq!(
                names,
                [(0, "get_weather".to_string()), (1, "f".to_string())],
                "chunk {chunk}"
            );
            assert_eq!(args[0], "{\"city\": \"Pa}ris\", \"days\": [1, 2]}", "chunk {chunk}");
            assert_eq!(args[1], "{}");
            assert_eq!(s.calls(), 2);
        }
        // Plain text passes through (a '<' that starts no block included).
        let mut s = ToolStream::default();
        let mut text = String::new();
        for piece in ["The answer", " is 1 <", " 2."] {
            for d in s.push(piece) {
                let Delta::Content(c) = d else { panic!() };
                text.push_str(&c);
            }
        }
        for d in s.finish() {
            let Delta::Content(c) = d else { panic!() };
            text.push_str(&c);
        }
        assert_eq!(text, "The answer is 1 < 2.");
    }
}

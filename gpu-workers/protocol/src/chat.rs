//! Chat templates: the model's own Jinja template (from the model file), rendered with
//! `minijinja` as Hugging Face `transformers.apply_chat_template` renders it with Jinja2, turns
//! a conversation into the exact prompt text the model was trained on.
//!
//! The template sees what `transformers` gives it: `messages` in the OpenAI shape (string
//! `content`, `tool_calls` with `function.arguments` as an object, `tool_call_id`, `name`,
//! `reasoning_content`), `tools` (OpenAI tool objects, or none), `add_generation_prompt`,
//! `bos_token`/`eos_token`, the request's `chat_template_kwargs` (`enable_thinking`, …),
//! `raise_exception`, `strftime_now` and a `tojson` with Python's `json.dumps` arguments;
//! blocks are trimmed as Jinja2's `trim_blocks`/`lstrip_blocks` do, values print as Python
//! prints them (`None`, `True`, `{'a': 1}`), and Python's string and dict methods work. The
//! differential test (`tests/templates.rs`) renders every template of llama.cpp's collection
//! with both and lists the few that differ, with the reason.

use minijinja::value::{Kwargs, Value as JValue, ValueKind};
use minijinja::{Environment, Error, ErrorKind, State};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// One message of a conversation, in the OpenAI shape templates read. Content parts are
/// flattened to text by the gateway (templates that take parts take strings too).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    /// Always present (an assistant turn with only tool calls has `""`): many templates read
    /// it unconditionally.
    #[serde(default)]
    pub content: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// A tool result's call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// A tool result's function name (filled in from the call it answers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// An assistant turn's reasoning (DeepSeek's and vLLM's field).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
}

impl ChatMessage {
    pub fn new(role: &str, content: &str) -> Self {
        Self {
            role: role.to_string(),
            content: content.to_string(),
            ..Default::default()
        }
    }
}

/// A call in an assistant turn.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    pub id: String,
    #[serde(rename = "type", default = "function_type")]
    pub kind: String,
    pub function: FunctionCall,
}

fn function_type() -> String {
    "function".into()
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FunctionCall {
    pub name: String,
    /// The arguments as an object (what templates index into and `tojson`).
    pub arguments: Value,
}

/// What a template renders.
#[derive(Debug, Clone, Copy)]
pub struct ChatInput<'a> {
    pub messages: &'a [ChatMessage],
    /// OpenAI tool objects (`{"type": "function", "function": {…}}`); None: no tools.
    pub tools: Option<&'a [Value]>,
    pub add_generation_prompt: bool,
    /// `chat_template_kwargs`: extra variables (`enable_thinking`, …). The standard names
    /// above, the template's functions and `__`-names cannot be overridden.
    pub kwargs: Option<&'a Map<String, Value>>,
}

#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error("chat template failed to compile: {0}")]
    Compile(String),
    #[error("chat template rejected the conversation: {0}")]
    Render(String),
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").finish_non_exhaustive()
    }
}

fn raise_exception(message: String) -> Result<String, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// The time `strftime_now` formats, in seconds since the epoch (UTC); a test fixes it.
fn now_secs(state: &State) -> i64 {
    if let Some(t) = state.lookup("__hearth_now").and_then(|v| i64::try_from(v).ok()) {
        return t;
    }
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

fn strftime_now(state: &State, fmt: String) -> String {
    strftime(now_secs(state), &fmt)
}

/// Python's `strftime` for the specifiers templates use (UTC). Unknown ones stay as written.
pub fn strftime(secs: i64, fmt: &str) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    let days = secs.div_euclid(86_400);
    let tod = secs.rem_euclid(86_400);
    let (h, mi, s) = (tod / 3600, tod / 60 % 60, tod % 60);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy_mar = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy_mar + 2) / 153;
    let d = doy_mar - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let cumulative = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cumulative[(m - 1) as usize] + d + i64::from(leap && m > 2);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let h12 = if h % 12 == 0 { 12 } else { h % 12 };
    let mut out = String::new();
    let mut chars = fmt.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let no_pad = chars.peek() == Some(&'-');
        if no_pad {
            chars.next();
        }
        let num = |v: i64, w: usize| if no_pad { v.to_string() } else { format!("{v:0w$}") };
        match chars.next() {
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&num(y % 100, 2)),
            Some('m') => out.push_str(&num(m, 2)),
            Some('d') => out.push_str(&num(d, 2)),
            Some('e') => out.push_str(&format!("{d:>2}")),
            Some('H') => out.push_str(&num(h, 2)),
            Some('I') => out.push_str(&num(h12, 2)),
            Some('M') => out.push_str(&num(mi, 2)),
            Some('S') => out.push_str(&num(s, 2)),
            Some('j') => out.push_str(&num(yday, 3)),
            Some('p') => out.push_str(if h < 12 { "AM" } else { "PM" }),
            Some('B') => out.push_str(MONTHS[(m - 1) as usize]),
            Some('b') | Some('h') => out.push_str(&MONTHS[(m - 1) as usize][..3]),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                if no_pad {
                    out.push('-');
                }
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// `tojson` as `transformers` defines it: `json.dumps(x, ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)` (positional arguments in that order).
fn tojson(value: JValue, args: minijinja::value::Rest<JValue>, kwargs: Kwargs) -> Result<String, Error> {
    let arg = |i: usize, name: &str| -> Result<Option<JValue>, Error> {
        Ok(match kwargs.get::<Option<JValue>>(name)? {
            Some(v) => Some(v),
            None => args.get(i).cloned(),
        })
    };
    let ensure_ascii = arg(0, "ensure_ascii")?.is_some_and(|v| v.is_true());
    let indent = arg(1, "indent")?.filter(|v| !v.is_none());
    let separators = arg(2, "separators")?.filter(|v| !v.is_none());
    let sort_keys = arg(3, "sort_keys")?.is_some_and(|v| v.is_true());
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.kind() == ValueKind::Number => Some(" ".repeat(i64::try_from(v)?.max(0) as usize)),
        Some(v) => Some(v.as_str().unwrap_or_default().to_string()),
    };
    let (item_sep, key_sep) = match separators {
        Some(s) => {
            let parts: Vec<JValue> = s.try_iter()?.collect();
            match parts.as_slice() {
                [a, b] => (a.to_string(), b.to_string()),
                _ => return Err(Error::new(ErrorKind::InvalidOperation, "separators must be a pair")),
            }
        }
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    if value.is_undefined() {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            "Object of type Undefined is not JSON serializable",
        ));
    }
    let json = serde_json::to_value(&value).map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    let mut out = String::new();
    let fmt = PyJson {
        indent: indent.as_deref(),
        item_sep: &item_sep,
        key_sep: &key_sep,
        sort_keys,
        ensure_ascii,
    };
    fmt.write(&json, 0, &mut out);
    Ok(out)
}

/// Python's `json.dumps` layout.
struct PyJson<'a> {
    indent: Option<&'a str>,
    item_sep: &'a str,
    key_sep: &'a str,
    sort_keys: bool,
    ensure_ascii: bool,
}

impl PyJson<'_> {
    fn newline(&self, depth: usize, out: &mut String) {
        if let Some(ind) = self.indent {
            out.push('\n');
            for _ in 0..depth {
                out.push_str(ind);
            }
        }
    }

    fn string(&self, s: &str, out: &mut String) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 || (self.ensure_ascii && !c.is_ascii()) => {
                    let mut buf = [0u16; 2];
                    for u in c.encode_utf16(&mut buf) {
                        out.push_str(&format!("\\u{u:04x}"));
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }

    fn write(&self, v: &Value, depth: usize, out: &mut String) {
        match v {
            Value::Null => out.push_str("null"),
            Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Value::Number(n) => match n.as_f64() {
                Some(f) if n.is_f64() => out.push_str(&py_float(f)),
                _ => out.push_str(&n.to_string()),
            },
            Value::String(s) => self.string(s, out),
            Value::Array(a) if a.is_empty() => out.push_str("[]"),
            Value::Array(a) => {
                out.push('[');
                for (i, x) in a.iter().enumerate() {
                    if i > 0 {
                        out.push_str(self.item_sep);
                    }
                    self.newline(depth + 1, out);
                    self.write(x, depth + 1, out);
                }
                self.newline(depth, out);
                out.push(']');
            }
            Value::Object(o) if o.is_empty() => out.push_str("{}"),
            Value::Object(o) => {
                let mut items: Vec<(&String, &Value)> = o.iter().collect();
                if self.sort_keys {
                    items.sort_by(|a, b| a.0.cmp(b.0));
                }
                out.push('{');
                for (i, (k, x)) in items.into_iter().enumerate() {
                    if i > 0 {
                        out.push_str(self.item_sep);
                    }
                    self.newline(depth + 1, out);
                    self.string(k, out);
                    out.push_str(self.key_sep);
                    self.write(x, depth + 1, out);
                }
                self.newline(depth, out);
                out.push('}');
            }
        }
    }
}

/// Python's `repr` of a float (`1.0`, `0.1`, `1e+20`).
fn py_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity".into() } else { "-Infinity".into() };
    }
    // Rust's shortest round-trip form switches to exponents where Python's does; only the
    // exponent is written differently (`1e-5` → `1e-05`, `1e16` → `1e+16`).
    let s = format!("{f:?}");
    match s.split_once('e') {
        Some((m, e)) => {
            let (sign, digits) = e.strip_prefix('-').map_or(("+", e), |d| ("-", d));
            format!("{m}e{sign}{digits:0>2}")
        }
        None => s,
    }
}

/// How Python prints a value: `None`, `True`/`False`, and containers as their `repr`.
fn python_format(out: &mut minijinja::Output, _state: &State, value: &JValue) -> Result<(), Error> {
    let text = match value.kind() {
        ValueKind::Undefined => String::new(),
        ValueKind::String => return out.write_str(value.as_str().unwrap_or_default()).map_err(Error::from),
        _ => python_repr(value, false),
    };
    out.write_str(&text).map_err(Error::from)
}

fn python_repr(v: &JValue, nested: bool) -> String {
    match v.kind() {
        ValueKind::Undefined => String::new(),
        ValueKind::None => "None".into(),
        ValueKind::Bool => if v.is_true() { "True" } else { "False" }.into(),
        ValueKind::String if nested => {
            let s = v.as_str().unwrap_or_default();
            if s.contains('\'') && !s.contains('"') {
                format!("\"{s}\"")
            } else {
                format!(
                    "'{}'",
                    s.replace('\\', "\\\\").replace('\'', "\\'").replace('\n', "\\n")
                )
            }
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<String> = v
                .try_iter()
                .into_iter()
                .flatten()
                .map(|x| python_repr(&x, true))
                .collect();
            format!("[{}]", items.join(", "))
        }
        ValueKind::Map => {
            let items: Vec<String> = v
                .try_iter()
                .into_iter()
                .flatten()
                .map(|k| {
                    let x = v.get_item(&k).unwrap_or_default();
                    format!("{}: {}", python_repr(&k, true), python_repr(&x, true))
                })
                .collect();
            format!("{{{}}}", items.join(", "))
        }
        ValueKind::Number => match f64::try_from(v.clone()) {
            Ok(f) if v.as_i64().is_none() => py_float(f),
            _ => v.to_string(),
        },
        _ => v.to_string(),
    }
}

/// `{% generation %}…{% endgeneration %}` (`transformers`' marker for assistant text)
/// renders its body: an always-true `if` keeps the tags' whitespace control.
fn without_generation_tags(source: &str) -> String {
    use std::sync::OnceLock;
    static TAG: OnceLock<regex::Regex> = OnceLock::new();
    let re = TAG.get_or_init(|| regex::Regex::new(r"\{%(-?)\s*(end)?generation\s*(-?)%\}").expect("a valid pattern"));
    re.replace_all(source, |c: &regex::Captures| {
        let body = if c.get(2).is_some() { "endif" } else { "if true" };
        format!("{{%{} {body} {}%}}", &c[1], &c[3])
    })
    .into_owned()
}

impl ChatTemplate {
    /// Compiles `source`; `bos_token`/`eos_token` are exposed to the template as Hugging Face does.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self, TemplateError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        // Hugging Face templates use Python string and dict methods (`.strip()`, `.items()`…).
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(python_format);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        // `str(x)`: Python's repr for containers, `None`, `True`.
        env.add_filter("string", |v: JValue| match v.as_str() {
            Some(s) => s.to_string(),
            None => python_repr(&v, false),
        });
        // Python's `iter(x)` succeeds for strings and containers only (`None is iterable` is
        // false, which templates test before `tools | length`).
        env.add_test("iterable", |v: JValue| {
            matches!(
                v.kind(),
                ValueKind::String | ValueKind::Seq | ValueKind::Map | ValueKind::Iterable
            )
        });
        env.add_template_owned("chat", without_generation_tags(source))
            .map_err(|e| TemplateError::Compile(e.to_string()))?;
        Ok(Self {
            env,
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
        })
    }

    /// Compiles `source` with the tokenizer's BOS and EOS text as `bos_token`/`eos_token`.
    pub fn for_tokenizer(source: &str, tokenizer: &crate::Tokenizer) -> Result<Self, TemplateError> {
        let text = |id| tokenizer.token_text(id).unwrap_or_default();
        Self::new(source, &text(tokenizer.bos_id()), &text(tokenizer.eos_id()))
    }

    /// Renders the conversation; with `add_generation_prompt` the text ends where the
    /// assistant's reply begins.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String, TemplateError> {
        self.render_input(&ChatInput {
            messages,
            tools: None,
            add_generation_prompt,
            kwargs: None,
        })
    }

    pub fn render_input(&self, input: &ChatInput) -> Result<String, TemplateError> {
        self.render_at(input, None)
    }

    /// As [`render_input`](Self::render_input), with `strftime_now` reading `now` (seconds
    /// since the epoch) instead of the clock.
    pub fn render_at(&self, input: &ChatInput, now: Option<i64>) -> Result<String, TemplateError> {
        let tmpl = self
            .env
            .get_template("chat")
            .map_err(|e| TemplateError::Compile(e.to_string()))?;
        // The request's variables, less any that would shadow the template's functions or
        // Hearth's own (`__…`).
        let mut ctx: Map<String, Value> = input
            .kwargs
            .into_iter()
            .flatten()
            .filter(|(k, _)| {
                !k.starts_with("__")
                    && !matches!(
                        k.as_str(),
                        "raise_exception" | "strftime_now" | "namespace" | "range" | "dict" | "cycler" | "joiner"
                    )
            })
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let messages = serde_json::to_value(input.messages).map_err(|e| TemplateError::Render(e.to_string()))?;
        ctx.insert("messages".into(), messages);
        ctx.insert(
            "tools".into(),
            input.tools.map_or(Value::Null, |t| Value::Array(t.to_vec())),
        );
        ctx.insert("documents".into(), Value::Null);
        ctx.insert("add_generation_prompt".into(), Value::Bool(input.add_generation_prompt));
        ctx.insert("bos_token".into(), Value::String(self.bos_token.clone()));
        ctx.insert("eos_token".into(), Value::String(self.eos_token.clone()));
        if let Some(t) = now {
            ctx.insert("__hearth_now".into(), Value::from(t));
        }
        tmpl.render(JValue::from_serialize(&ctx)).map_err(|e| {
            let mut msg = e.to_string();
            if let Some(detail) = e.detail() {
                if !msg.contains(detail) {
                    msg = format!("{msg}: {detail}");
                }
            }
            TemplateError::Render(msg)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shape of SmolLM2's ChatML template (default system prompt when none is given).
    const CHATML: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are helpful<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    #[test]
    fn renders_chatml_with_default_system_prompt() {
        let t = ChatTemplate::new(CHATML, "<|im_start|>", "<|im_end|>").unwrap();
        let msgs = [ChatMessage::new("user", "Hi")];
        assert_eq!(
            t.render(&msgs, true).unwrap(),
            "<|im_start|>system\nYou are helpful<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn python_methods_and_raise_exception_work() {
        let t = ChatTemplate::new(
            "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}{{ messages[0].content.strip() }}",
            "",
            "",
        )
        .unwrap();
        assert_eq!(t.render(&[ChatMessage::new("user", "  x ")], false).unwrap(), "x");
        let bad = [ChatMessage::new("system", "x")];
        assert!(matches!(t.render(&bad, false), Err(TemplateError::Render(m)) if m.contains("first must be user")));
    }

    #[test]
    fn tojson_writes_python_json_dumps() {
        let t = ChatTemplate::new(
            "{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ x | tojson(separators=(',', ':'), sort_keys=true) }}",
            "",
            "",
        )
        .unwrap();
        let tmpl = t.env.get_template("chat").unwrap();
        let x = serde_json::json!({"b": [1, 2.5, "é\n"], "a": {}});
        let out = tmpl.render(minijinja::context! { x => x }).unwrap();
        assert_eq!(
            out,
            "{\"b\": [1, 2.5, \"é\\n\"], \"a\": {}}|{\n  \"b\": [\n    1,\n    2.5,\n    \"é\\n\"\n  ],\n  \"a\": {}\n}|{\"a\":{},\"b\":[1,2.5,\"é\\n\"]}"
        );
    }

    #[test]
    fn values_print_as_python_prints_them() {
        let t = ChatTemplate::new("{{ none }} {{ true }} {{ [1, 'a', none] }} {{ {'k': false} }}", "", "").unwrap();
        assert_eq!(t.render(&[], false).unwrap(), "None True [1, 'a', None] {'k': False}");
    }

    #[test]
    fn strftime_formats_the_given_day() {
        // 2026-12-01 09:30:00 UTC, a Tuesday.
        let t = 1_796_117_400;
        assert_eq!(strftime(t, "%d %b %Y"), "01 Dec 2026");
        assert_eq!(
            strftime(t, "%A, %B %-d, %Y %H:%M:%S %p %j %y"),
            "Tuesday, December 1, 2026 09:30:00 AM 335 26"
        );
        assert_eq!(strftime(0, "%Y-%m-%d %a"), "1970-01-01 Thu");
        assert_eq!(strftime(951_782_400, "%Y-%m-%d %j"), "2000-02-29 060");
    }

    #[test]
    fn generation_tags_render_their_body() {
        let t = ChatTemplate::new("a{% generation %}b{% endgeneration %}c", "", "").unwrap();
        assert_eq!(t.render(&[], false).unwrap(), "abc");
    }
}

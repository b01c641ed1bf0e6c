//! Tool-call formats: how each model family writes a function call, read out of its output
//! as it streams, and a grammar that makes the model write one (`tool_choice` `required` or
//! named). One region parser per family behind one driver ([`ToolStream`]); the whole-answer
//! parse is the same driver fed everything at once, so streamed and non-streamed answers
//! always agree.
//!
//! | format | the model writes |
//! |---|---|
//! | `hermes` (Qwen 2.5/3, Hermes, and Hearth's own) | `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>` |
//! | `llama3_json` (Llama 3.1–3.3) | `{"name": …, "parameters": {…}}` as the whole answer, or after `<\|python_tag\|>` |
//! | `mistral` (Nemo, v3 tokenizers) | `[TOOL_CALLS][{"name": …, "arguments": {…}}, …]` |
//! | `mistral_args` (Small 3.2, Devstral, Magistral) | `[TOOL_CALLS]name[CALL_ID]id[ARGS]{…}`, `[CALL_ID]…` optional |
//! | `deepseek_v3` (V3, R1) | `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>name\n```json\n{…}\n```<｜tool▁call▁end｜>…<｜tool▁calls▁end｜>` |
//! | `deepseek_v31` (V3.1) | `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>name<｜tool▁sep｜>{…}<｜tool▁call▁end｜>…<｜tool▁calls▁end｜>` |
//! | `kimi_k2` | `<\|tool_calls_section_begin\|><\|tool_call_begin\|>functions.name:0<\|tool_call_argument_begin\|>{…}<\|tool_call_end\|>…<\|tool_calls_section_end\|>` |
//! | `qwen3_coder` | `<tool_call>\n<function=name>\n<parameter=k>\nv\n</parameter>\n</function>\n</tool_call>` |
//!
//! Text outside calls is content; whitespace next to a call and at the answer's ends is not.
//! A call is announced once its name is known and its arguments have begun, and its
//! arguments then stream as the model writes them. A block that turns out not to be a call
//! before that stays text.

use serde::Serialize;
use serde_json::{json, Value};

use super::json_scan::{call_object, skip_ws, value_end};

/// One function the model may call.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolDef {
    pub name: String,
    pub description: Option<String>,
    /// The arguments' JSON Schema (`{"type": "object"}` when absent).
    pub parameters: Value,
}

impl ToolDef {
    /// The tool as templates take it (OpenAI's tool object).
    pub fn openai_json(&self) -> Value {
        let mut f = json!({"name": self.name, "parameters": self.parameters});
        if let Some(d) = &self.description {
            f["description"] = json!(d);
        }
        json!({"type": "function", "function": f})
    }
}

/// A model family's way of writing tool calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolFormat {
    /// Hearth's own (Hermes' blocks, described in a system message Hearth writes): for
    /// templates that take no tools.
    Hearth,
    Hermes,
    Llama3Json,
    Mistral,
    MistralArgs,
    DeepseekV3,
    DeepseekV31,
    KimiK2,
    Qwen3Coder,
}

const HERMES_OPEN: &str = "<tool_call>";
const HERMES_CLOSE: &str = "</tool_call>";
const PYTHON_TAG: &str = "<|python_tag|>";
const MISTRAL_CALLS: &str = "[TOOL_CALLS]";
const MISTRAL_ARGS: &str = "[ARGS]";
const MISTRAL_CALL_ID: &str = "[CALL_ID]";
const DS_CALLS_BEGIN: &str = "<｜tool▁calls▁begin｜>";
const DS_CALLS_END: &str = "<｜tool▁calls▁end｜>";
const DS_CALL_BEGIN: &str = "<｜tool▁call▁begin｜>";
const DS_CALL_END: &str = "<｜tool▁call▁end｜>";
const DS_SEP: &str = "<｜tool▁sep｜>";
const KIMI_SECTION_BEGIN: &str = "<|tool_calls_section_begin|>";
const KIMI_SECTION_END: &str = "<|tool_calls_section_end|>";
const KIMI_CALL_BEGIN: &str = "<|tool_call_begin|>";
const KIMI_ARGS_BEGIN: &str = "<|tool_call_argument_begin|>";
const KIMI_CALL_END: &str = "<|tool_call_end|>";

impl ToolFormat {
    pub const ALL: [ToolFormat; 9] = [
        ToolFormat::Hearth,
        ToolFormat::Hermes,
        ToolFormat::Llama3Json,
        ToolFormat::Mistral,
        ToolFormat::MistralArgs,
        ToolFormat::DeepseekV3,
        ToolFormat::DeepseekV31,
        ToolFormat::KimiK2,
        ToolFormat::Qwen3Coder,
    ];

    pub fn name(self) -> &'static str {
        match self {
            ToolFormat::Hearth => "hearth",
            ToolFormat::Hermes => "hermes",
            ToolFormat::Llama3Json => "llama3_json",
            ToolFormat::Mistral => "mistral",
            ToolFormat::MistralArgs => "mistral_args",
            ToolFormat::DeepseekV3 => "deepseek_v3",
            ToolFormat::DeepseekV31 => "deepseek_v31",
            ToolFormat::KimiK2 => "kimi_k2",
            ToolFormat::Qwen3Coder => "qwen3_coder",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|f| f.name() == name)
    }

    /// The format a chat template writes tool calls in (Hearth's own when the template
    /// takes no tools, or writes them in a way Hearth does not read).
    pub fn detect(template: Option<&str>) -> Self {
        let Some(t) = template else { return ToolFormat::Hearth };
        if t.contains(DS_CALLS_BEGIN) {
            // V3 and R1 wrap the arguments in a fenced JSON block; V3.1 writes them bare.
            if t.contains("```json") {
                ToolFormat::DeepseekV3
            } else {
                ToolFormat::DeepseekV31
            }
        } else if t.contains(KIMI_SECTION_BEGIN) {
            ToolFormat::KimiK2
        } else if t.contains(MISTRAL_CALLS) {
            if t.contains(MISTRAL_ARGS) {
                ToolFormat::MistralArgs
            } else {
                ToolFormat::Mistral
            }
        } else if t.contains(HERMES_OPEN) && t.contains("<function=") && t.contains("<parameter=") {
            ToolFormat::Qwen3Coder
        } else if hermes_json_blocks(t) {
            ToolFormat::Hermes
        } else if t.contains("\"parameters\": dictionary of argument name") {
            ToolFormat::Llama3Json
        } else {
            ToolFormat::Hearth
        }
    }

    /// Whether the model's own template renders the tools and the calls (all but Hearth's).
    pub fn template_renders_tools(self) -> bool {
        self != ToolFormat::Hearth
    }

    /// Strings that start a call region (a streamed suffix that could begin one waits).
    fn markers(self) -> &'static [&'static str] {
        match self {
            ToolFormat::Hearth | ToolFormat::Hermes | ToolFormat::Qwen3Coder => &[HERMES_OPEN],
            ToolFormat::Llama3Json => &[PYTHON_TAG],
            ToolFormat::Mistral | ToolFormat::MistralArgs => &[MISTRAL_CALLS],
            ToolFormat::DeepseekV3 | ToolFormat::DeepseekV31 => &[DS_CALLS_BEGIN],
            ToolFormat::KimiK2 => &[KIMI_SECTION_BEGIN],
        }
    }

    /// Every delimiter the format's calls use: the ones the vocabulary has as special tokens
    /// must reach the gateway as text (the engine drops control tokens' text otherwise).
    pub fn delimiters(self) -> &'static [&'static str] {
        match self {
            ToolFormat::Hearth | ToolFormat::Hermes => &[HERMES_OPEN, HERMES_CLOSE],
            ToolFormat::Qwen3Coder => &[HERMES_OPEN, HERMES_CLOSE],
            ToolFormat::Llama3Json => &[PYTHON_TAG],
            ToolFormat::Mistral => &[MISTRAL_CALLS],
            ToolFormat::MistralArgs => &[MISTRAL_CALLS, MISTRAL_ARGS, MISTRAL_CALL_ID],
            ToolFormat::DeepseekV3 | ToolFormat::DeepseekV31 => {
                &[DS_CALLS_BEGIN, DS_CALLS_END, DS_CALL_BEGIN, DS_CALL_END, DS_SEP]
            }
            ToolFormat::KimiK2 => &[
                KIMI_SECTION_BEGIN,
                KIMI_SECTION_END,
                KIMI_CALL_BEGIN,
                KIMI_ARGS_BEGIN,
                KIMI_CALL_END,
            ],
        }
    }

    /// A new call id in the shape the family's templates accept (Mistral's: nine letters and
    /// digits).
    pub fn new_call_id(self) -> String {
        let r = random_u64();
        match self {
            ToolFormat::Mistral | ToolFormat::MistralArgs => {
                const ALNUM: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
                (0..9).map(|i| ALNUM[((r >> (i * 6)) % 62) as usize] as char).collect()
            }
            _ => format!("call_{r:016x}"),
        }
    }

    /// Where the next call region starts; `at_start`: nothing of the answer came before.
    fn find_start(self, text: &str, at_start: bool) -> Option<usize> {
        if self == ToolFormat::Llama3Json && at_start {
            let i = skip_ws(text, 0);
            if text[i..].starts_with('{') {
                return Some(i);
            }
        }
        self.markers().iter().filter_map(|m| text.find(m)).min()
    }

    /// Reads the call region at the start of `text`.
    fn region(self, text: &str, at_end: bool, tools: &[ToolDef]) -> Region {
        match self {
            ToolFormat::Hearth | ToolFormat::Hermes => hermes(text, at_end),
            ToolFormat::Llama3Json => llama3(text, at_end),
            ToolFormat::Mistral => mistral_json(text, at_end),
            ToolFormat::MistralArgs => mistral_args(text, at_end),
            ToolFormat::DeepseekV3 => deepseek(text, at_end, true),
            ToolFormat::DeepseekV31 => deepseek(text, at_end, false),
            ToolFormat::KimiK2 => kimi(text, at_end),
            ToolFormat::Qwen3Coder => qwen3_coder(text, at_end, tools),
        }
    }
}

/// Whether a template writes `<tool_call>` blocks of JSON (`{"name": …` soon after the tag),
/// as opposed to other formats that share the tag (GLM's `<tool_call>name<arg_key>…`,
/// Apriel's `<tool_calls>[…]`).
fn hermes_json_blocks(t: &str) -> bool {
    if t.contains("<arg_key>") || t.contains("<tool_calls>") {
        return false;
    }
    t.match_indices(HERMES_OPEN).any(|(i, _)| {
        let after = &t[i + HERMES_OPEN.len()..];
        let window = &after[..after.char_indices().nth(200).map_or(after.len(), |(j, _)| j)];
        window.contains("{\"name\"") || window.contains("{\\\"name\\\"")
    })
}

fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    if getrandom::fill(&mut b).is_err() {
        static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0x9e37_79b9_7f4a_7c15);
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        return t ^ N.fetch_add(0x9e37_79b9_7f4a_7c15, std::sync::atomic::Ordering::Relaxed);
    }
    u64::from_le_bytes(b)
}

/// A call read so far.
#[derive(Debug, Clone, PartialEq)]
struct PartCall {
    name: String,
    /// The model's own id, if it wrote one.
    id: Option<String>,
    /// The arguments as JSON text, as far as they go.
    args: String,
}

/// What a region turned out to be.
#[derive(Debug, PartialEq)]
enum Region {
    /// Calls; `end`: where the region ends, once it has.
    Calls { calls: Vec<PartCall>, end: Option<usize> },
    /// Not calls: text up to `end` (None: not known yet).
    Text { end: Option<usize> },
}

/// `lit` at `text[i..]`: Some(Ok(end)) it is there; Some(Err(())) the text ends inside it;
/// None it is not.
fn expect(text: &str, i: usize, lit: &str) -> Option<Result<usize, ()>> {
    let rest = &text[i.min(text.len())..];
    if rest.starts_with(lit) {
        Some(Ok(i + lit.len()))
    } else if lit.starts_with(rest) {
        Some(Err(()))
    } else {
        None
    }
}

/// The region ends at `close` (searched from `from`), or at the end of the text.
fn text_until(text: &str, from: usize, close: &str, at_end: bool) -> Region {
    match text[from.min(text.len())..].find(close) {
        Some(p) => Region::Text {
            end: Some(from + p + close.len()),
        },
        None => Region::Text {
            end: at_end.then_some(text.len()),
        },
    }
}

/// Waiting for more text, or (at the end) the calls so far with the region cut there.
fn cut(calls: Vec<PartCall>, text: &str, at_end: bool) -> Region {
    Region::Calls {
        calls,
        end: at_end.then_some(text.len()),
    }
}

/// A JSON call object at `text[i..]` (keys `name` + one of `arg_keys`): the call so far,
/// and where the object ends. `Err`: it is not a call (and nothing of it was announced).
fn json_call(text: &str, i: usize, arg_keys: &[&str]) -> Result<(Option<PartCall>, Option<usize>), ()> {
    let (c, ok) = match call_object(&text[i..], arg_keys) {
        Ok(c) => (c, true),
        Err(c) => (c, false),
    };
    let call = match (&c.name, c.args, c.args_object) {
        (Some(name), Some((s, e)), true) => Some(PartCall {
            name: name.clone(),
            id: c.id.clone(),
            args: text[i + s..i + e].to_string(),
        }),
        _ => None,
    };
    match (ok, &call, c.end) {
        (false, None, _) => Err(()),
        // A broken object after its call was announced: the call keeps what it has.
        (false, Some(_), _) => Ok((call, Some(text.len()))),
        (true, None, Some(_)) => Err(()),
        (true, _, end) => Ok((call, end.map(|e| i + e))),
    }
}

fn hermes(text: &str, at_end: bool) -> Region {
    let body = HERMES_OPEN.len();
    let i = skip_ws(text, body);
    if i >= text.len() {
        return cut(Vec::new(), text, at_end);
    }
    match json_call(text, i, &["arguments", "parameters"]) {
        Err(()) => text_until(text, body, HERMES_CLOSE, at_end),
        Ok((None, _)) => {
            if at_end {
                Region::Text { end: Some(text.len()) }
            } else {
                Region::Text { end: None }
            }
        }
        Ok((Some(call), end)) => {
            let calls = vec![call];
            let Some(end) = end else {
                return cut(calls, text, at_end);
            };
            let j = skip_ws(text, end);
            match expect(text, j, HERMES_CLOSE) {
                Some(Ok(e)) => Region::Calls { calls, end: Some(e) },
                Some(Err(())) => cut(calls, text, at_end),
                // Something else after the object: the call ends there, the rest is text.
                None => Region::Calls { calls, end: Some(end) },
            }
        }
    }
}

fn llama3(text: &str, at_end: bool) -> Region {
    let mut i = match expect(text, 0, PYTHON_TAG) {
        Some(Ok(e)) => e,
        _ => 0,
    };
    let mut calls = Vec::new();
    loop {
        i = skip_ws(text, i);
        if i >= text.len() {
            return cut(calls, text, at_end);
        }
        if !text[i..].starts_with('{') {
            // After calls: the rest is text. Before any: not a call answer.
            return if calls.is_empty() {
                Region::Text {
                    end: Some(text.len()).filter(|_| at_end),
                }
            } else {
                Region::Calls { calls, end: Some(i) }
            };
        }
        match json_call(text, i, &["parameters", "arguments"]) {
            Err(()) if calls.is_empty() => {
                return Region::Text {
                    end: at_end.then_some(text.len()),
                }
            }
            Err(()) => return Region::Calls { calls, end: Some(i) },
            Ok((None, _)) => {
                return if at_end {
                    if calls.is_empty() {
                        Region::Text { end: Some(text.len()) }
                    } else {
                        Region::Calls { calls, end: Some(i) }
                    }
                } else {
                    Region::Calls { calls, end: None }
                }
            }
            Ok((Some(call), end)) => {
                calls.push(call);
                let Some(end) = end else {
                    return cut(calls, text, at_end);
                };
                i = skip_ws(text, end);
                if text[i..].starts_with(';') {
                    i += 1;
                }
            }
        }
    }
}

fn mistral_json(text: &str, at_end: bool) -> Region {
    let mut i = skip_ws(text, MISTRAL_CALLS.len());
    if i >= text.len() {
        return cut(Vec::new(), text, at_end);
    }
    if !text[i..].starts_with('[') {
        return Region::Text {
            end: Some(MISTRAL_CALLS.len()),
        };
    }
    i += 1;
    let mut calls = Vec::new();
    loop {
        i = skip_ws(text, i);
        if i >= text.len() {
            return cut(calls, text, at_end);
        }
        match text.as_bytes()[i] {
            b']' => {
                return Region::Calls {
                    calls,
                    end: Some(i + 1),
                }
            }
            b',' => {
                i += 1;
                continue;
            }
            _ => {}
        }
        match json_call(text, i, &["arguments"]) {
            Err(()) if calls.is_empty() => {
                return Region::Text {
                    end: Some(MISTRAL_CALLS.len()),
                }
            }
            Err(()) => return Region::Calls { calls, end: Some(i) },
            Ok((None, _)) => return cut(calls, text, at_end),
            Ok((Some(call), end)) => {
                calls.push(call);
                match end {
                    Some(e) => i = e,
                    None => return cut(calls, text, at_end),
                }
            }
        }
    }
}

fn mistral_args(text: &str, at_end: bool) -> Region {
    let start = MISTRAL_CALLS.len();
    let rest = &text[start..];
    let (name_end, after_name) = match (rest.find(MISTRAL_CALL_ID), rest.find(MISTRAL_ARGS)) {
        (Some(c), Some(a)) if c < a => (c, start + c),
        (_, Some(a)) => (a, start + a),
        (Some(c), None) => (c, start + c),
        (None, None) => {
            let plausible = rest.chars().all(|c| c.is_alphanumeric() || "_-.[".contains(c)) && rest.len() < 128;
            return if plausible && !at_end {
                Region::Text { end: None }
            } else {
                Region::Text { end: Some(start) }
            };
        }
    };
    let name = rest[..name_end].trim().to_string();
    if name.is_empty() || !name.chars().all(|c| c.is_alphanumeric() || "_-.".contains(c)) {
        return Region::Text { end: Some(start) };
    }
    let mut i = after_name;
    let mut id = None;
    if let Some(Ok(e)) = expect(text, i, MISTRAL_CALL_ID) {
        match text[e..].find(MISTRAL_ARGS) {
            Some(p) => {
                id = Some(text[e..e + p].trim().to_string());
                i = e + p;
            }
            None => {
                return if at_end {
                    Region::Text { end: Some(start) }
                } else {
                    Region::Text { end: None }
                }
            }
        }
    }
    let Some(Ok(args_at)) = expect(text, i, MISTRAL_ARGS) else {
        return Region::Text { end: Some(start) };
    };
    let a = skip_ws(text, args_at);
    if a >= text.len() {
        return if at_end {
            Region::Text { end: Some(text.len()) }
        } else {
            Region::Text { end: None }
        };
    }
    if !text[a..].starts_with('{') {
        return Region::Text { end: Some(start) };
    }
    let call = |args: &str| PartCall {
        name: name.clone(),
        id: id.clone(),
        args: args.to_string(),
    };
    match value_end(&text[a..]) {
        Ok(Some(e)) => Region::Calls {
            calls: vec![call(&text[a..a + e])],
            end: Some(a + e),
        },
        Ok(None) => cut(vec![call(&text[a..])], text, at_end),
        Err(()) => Region::Calls {
            calls: vec![call(&text[a..])],
            end: Some(text.len()),
        },
    }
}

/// DeepSeek's sections: V3/R1 (`function<sep>name\n```json\n{…}\n```) or V3.1 (`name<sep>{…}`).
fn deepseek(text: &str, at_end: bool, v3: bool) -> Region {
    let mut i = DS_CALLS_BEGIN.len();
    let mut calls = Vec::new();
    loop {
        i = skip_ws(text, i);
        if i >= text.len() {
            return cut(calls, text, at_end);
        }
        if let Some(r) = expect(text, i, DS_CALLS_END) {
            return match r {
                Ok(e) => Region::Calls { calls, end: Some(e) },
                Err(()) => cut(calls, text, at_end),
            };
        }
        let after_begin = match expect(text, i, DS_CALL_BEGIN) {
            Some(Ok(e)) => e,
            Some(Err(())) => return cut(calls, text, at_end),
            None if calls.is_empty() => {
                return Region::Text {
                    end: Some(DS_CALLS_BEGIN.len()),
                }
            }
            None => return Region::Calls { calls, end: Some(i) },
        };
        let (name, args_from) = if v3 {
            let Some(sep) = text[after_begin..].find(DS_SEP) else {
                return cut(calls, text, at_end);
            };
            let name_at = after_begin + sep + DS_SEP.len();
            let Some(nl) = text[name_at..].find("```json") else {
                return cut(calls, text, at_end);
            };
            (
                text[name_at..name_at + nl].trim().to_string(),
                name_at + nl + "```json".len(),
            )
        } else {
            let Some(sep) = text[after_begin..].find(DS_SEP) else {
                return cut(calls, text, at_end);
            };
            (
                text[after_begin..after_begin + sep].trim().to_string(),
                after_begin + sep + DS_SEP.len(),
            )
        };
        let a = skip_ws(text, args_from);
        if a >= text.len() {
            return cut(calls, text, at_end);
        }
        if name.is_empty() || !text[a..].starts_with('{') {
            return if calls.is_empty() {
                text_until(text, 0, DS_CALLS_END, at_end)
            } else {
                Region::Calls { calls, end: Some(i) }
            };
        }
        match value_end(&text[a..]) {
            Ok(Some(e)) => {
                calls.push(PartCall {
                    name,
                    id: None,
                    args: text[a..a + e].to_string(),
                });
                let mut j = a + e;
                if v3 {
                    j = skip_ws(text, j);
                    match expect(text, j, "```") {
                        Some(Ok(e)) => j = e,
                        Some(Err(())) => return cut(calls, text, at_end),
                        None => {}
                    }
                }
                j = skip_ws(text, j);
                match expect(text, j, DS_CALL_END) {
                    Some(Ok(e)) => i = e,
                    Some(Err(())) => return cut(calls, text, at_end),
                    None => return Region::Calls { calls, end: Some(j) },
                }
            }
            Ok(None) => {
                calls.push(PartCall {
                    name,
                    id: None,
                    args: text[a..].to_string(),
                });
                return cut(calls, text, at_end);
            }
            Err(()) => {
                calls.push(PartCall {
                    name,
                    id: None,
                    args: text[a..].to_string(),
                });
                return Region::Calls {
                    calls,
                    end: Some(text.len()),
                };
            }
        }
    }
}

fn kimi(text: &str, at_end: bool) -> Region {
    let mut i = KIMI_SECTION_BEGIN.len();
    let mut calls = Vec::new();
    loop {
        i = skip_ws(text, i);
        if i >= text.len() {
            return cut(calls, text, at_end);
        }
        if let Some(r) = expect(text, i, KIMI_SECTION_END) {
            return match r {
                Ok(e) => Region::Calls { calls, end: Some(e) },
                Err(()) => cut(calls, text, at_end),
            };
        }
        let after_begin = match expect(text, i, KIMI_CALL_BEGIN) {
            Some(Ok(e)) => e,
            Some(Err(())) => return cut(calls, text, at_end),
            None if calls.is_empty() => {
                return Region::Text {
                    end: Some(KIMI_SECTION_BEGIN.len()),
                }
            }
            None => return Region::Calls { calls, end: Some(i) },
        };
        let Some(p) = text[after_begin..].find(KIMI_ARGS_BEGIN) else {
            return cut(calls, text, at_end);
        };
        let call_id = text[after_begin..after_begin + p].trim().to_string();
        // `functions.NAME:INDEX`.
        let name = call_id
            .strip_prefix("functions.")
            .unwrap_or(&call_id)
            .rsplit_once(':')
            .map_or(call_id.as_str(), |(n, _)| n)
            .to_string();
        let a = skip_ws(text, after_begin + p + KIMI_ARGS_BEGIN.len());
        if a >= text.len() {
            return cut(calls, text, at_end);
        }
        if name.is_empty() || !text[a..].starts_with('{') {
            return if calls.is_empty() {
                text_until(text, 0, KIMI_SECTION_END, at_end)
            } else {
                Region::Calls { calls, end: Some(i) }
            };
        }
        let call = |args: &str| PartCall {
            name: name.clone(),
            id: Some(call_id.clone()),
            args: args.to_string(),
        };
        match value_end(&text[a..]) {
            Ok(Some(e)) => {
                calls.push(call(&text[a..a + e]));
                let j = skip_ws(text, a + e);
                match expect(text, j, KIMI_CALL_END) {
                    Some(Ok(e)) => i = e,
                    Some(Err(())) => return cut(calls, text, at_end),
                    None => return Region::Calls { calls, end: Some(j) },
                }
            }
            Ok(None) => {
                calls.push(call(&text[a..]));
                return cut(calls, text, at_end);
            }
            Err(()) => {
                calls.push(call(&text[a..]));
                return Region::Calls {
                    calls,
                    end: Some(text.len()),
                };
            }
        }
    }
}

/// A Qwen3-Coder parameter's value as JSON: by the tool's schema (a string property stays
/// text); otherwise JSON when it parses as JSON, else text.
fn coder_value(tool: Option<&ToolDef>, key: &str, raw: &str) -> String {
    let ty = tool
        .and_then(|t| t.parameters.get("properties"))
        .and_then(|p| p.get(key))
        .and_then(|p| p.get("type"))
        .and_then(Value::as_str);
    if ty != Some("string") {
        if let Ok(v) = serde_json::from_str::<Value>(raw) {
            if ty.is_some() || !v.is_string() {
                return crate::layout_json(&v);
            }
        }
    }
    crate::layout_json(&Value::String(raw.to_string()))
}

fn qwen3_coder(text: &str, at_end: bool, tools: &[ToolDef]) -> Region {
    let i = skip_ws(text, HERMES_OPEN.len());
    if i >= text.len() {
        return cut(Vec::new(), text, at_end);
    }
    let f_at = match expect(text, i, "<function=") {
        Some(Ok(e)) => e,
        Some(Err(())) => {
            return if at_end {
                Region::Text { end: Some(text.len()) }
            } else {
                Region::Text { end: None }
            }
        }
        None => return text_until(text, 0, HERMES_CLOSE, at_end),
    };
    let Some(gt) = text[f_at..].find('>') else {
        return if at_end {
            Region::Text { end: Some(text.len()) }
        } else {
            Region::Text { end: None }
        };
    };
    let name = text[f_at..f_at + gt].trim().to_string();
    if name.is_empty() || name.contains('<') || name.contains('\n') {
        return text_until(text, 0, HERMES_CLOSE, at_end);
    }
    let tool = tools.iter().find(|t| t.name == name);
    let mut args = String::from("{");
    let mut first = true;
    let mut j = f_at + gt + 1;
    let call = |args: &str| PartCall {
        name: name.clone(),
        id: None,
        args: args.to_string(),
    };
    loop {
        j = skip_ws(text, j);
        if j >= text.len() {
            return cut(vec![call(&args)], text, at_end);
        }
        if let Some(r) = expect(text, j, "</function>") {
            let Ok(e) = r else {
                return cut(vec![call(&args)], text, at_end);
            };
            args.push('}');
            let k = skip_ws(text, e);
            return match expect(text, k, HERMES_CLOSE) {
                Some(Ok(e)) => Region::Calls {
                    calls: vec![call(&args)],
                    end: Some(e),
                },
                Some(Err(())) => cut(vec![call(&args)], text, at_end),
                None => Region::Calls {
                    calls: vec![call(&args)],
                    end: Some(e),
                },
            };
        }
        let p_at = match expect(text, j, "<parameter=") {
            Some(Ok(e)) => e,
            Some(Err(())) => return cut(vec![call(&args)], text, at_end),
            None => {
                // Not the format after all, past the name: end the call here.
                args.push('}');
                return Region::Calls {
                    calls: vec![call(&args)],
                    end: Some(j),
                };
            }
        };
        let Some(gt) = text[p_at..].find('>') else {
            return cut(vec![call(&args)], text, at_end);
        };
        let key = text[p_at..p_at + gt].trim().to_string();
        let v_at = p_at + gt + 1;
        let Some(close) = text[v_at..].find("</parameter>") else {
            return cut(vec![call(&args)], text, at_end);
        };
        let raw = &text[v_at..v_at + close];
        let raw = raw.strip_prefix('\n').unwrap_or(raw);
        let raw = raw.strip_suffix('\n').unwrap_or(raw);
        if !first {
            args.push_str(", ");
        }
        first = false;
        args.push_str(&crate::layout_json(&Value::String(key.clone())));
        args.push_str(": ");
        args.push_str(&coder_value(tool, &key, raw));
        j = v_at + close + "</parameter>".len();
    }
}

/// What a streamed answer sends next.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolDelta {
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

/// Turns an answer into content and tool-call deltas as it arrives.
#[derive(Debug)]
pub struct ToolStream {
    format: ToolFormat,
    tools: Vec<ToolDef>,
    buf: String,
    in_region: bool,
    /// Calls of the current region announced so far: (id, argument bytes sent).
    region_calls: Vec<(String, usize)>,
    /// Calls of earlier regions.
    calls_done: usize,
    /// Nothing of the answer was sent yet.
    at_start: bool,
    /// Drop leading whitespace of the next content (the answer's start, or after a call).
    strip_leading: bool,
    /// Trailing whitespace of content, sent only if more content follows.
    pending_ws: String,
}

impl ToolStream {
    pub fn new(format: ToolFormat, tools: Vec<ToolDef>) -> Self {
        Self {
            format,
            tools,
            buf: String::new(),
            in_region: false,
            region_calls: Vec::new(),
            calls_done: 0,
            at_start: true,
            strip_leading: true,
            pending_ws: String::new(),
        }
    }

    /// Calls started so far.
    pub fn calls(&self) -> usize {
        self.calls_done + self.region_calls.len()
    }

    pub fn push(&mut self, text: &str) -> Vec<ToolDelta> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        self.run(false, &mut out);
        out
    }

    /// The end of the answer: what was held back is resolved (an unfinished call keeps the
    /// arguments it has).
    pub fn finish(&mut self) -> Vec<ToolDelta> {
        let mut out = Vec::new();
        self.run(true, &mut out);
        let rest = std::mem::take(&mut self.buf);
        self.content(&rest, &mut out);
        let ws = std::mem::take(&mut self.pending_ws);
        if self.calls() == 0 && !ws.is_empty() && !self.at_start {
            out.push(ToolDelta::Content(ws));
        }
        out
    }

    /// A whole answer, as the stream would give it: content (None when the answer is only
    /// calls) and the calls.
    pub fn parse(format: ToolFormat, tools: &[ToolDef], text: &str) -> (Option<String>, Vec<ParsedCall>) {
        let mut s = ToolStream::new(format, tools.to_vec());
        let mut deltas = s.push(text);
        deltas.extend(s.finish());
        collect(deltas)
    }

    fn run(&mut self, at_end: bool, out: &mut Vec<ToolDelta>) {
        loop {
            if !self.in_region {
                match self
                    .format
                    .find_start(&self.buf, self.at_start && self.pending_ws.is_empty())
                {
                    Some(p) => {
                        // Its trailing whitespace waits: dropped if a call follows, kept
                        // if the region turns out to be text.
                        let before: String = self.buf.drain(..p).collect();
                        self.content(&before, out);
                        self.in_region = true;
                    }
                    None => {
                        let hold = if at_end { 0 } else { self.held_suffix() };
                        let send: String = self.buf.drain(..self.buf.len() - hold).collect();
                        self.content(&send, out);
                        return;
                    }
                }
            }
            match self.format.region(&self.buf, at_end, &self.tools) {
                Region::Calls { calls, end } => {
                    for (k, c) in calls.iter().enumerate() {
                        if k == self.region_calls.len() {
                            self.pending_ws.clear();
                            let id =
                                c.id.clone()
                                    .filter(|i| !i.is_empty())
                                    .unwrap_or_else(|| self.format.new_call_id());
                            out.push(ToolDelta::CallStart {
                                index: self.calls_done + k,
                                id: id.clone(),
                                name: c.name.clone(),
                            });
                            self.region_calls.push((id, 0));
                            self.at_start = false;
                        }
                        let sent = &mut self.region_calls[k].1;
                        if c.args.len() > *sent && c.args.is_char_boundary(*sent) {
                            out.push(ToolDelta::Arguments {
                                index: self.calls_done + k,
                                text: c.args[*sent..].to_string(),
                            });
                            *sent = c.args.len();
                        }
                    }
                    let Some(end) = end else { return };
                    self.buf.drain(..end.min(self.buf.len()));
                    self.calls_done += self.region_calls.len();
                    self.region_calls.clear();
                    self.in_region = false;
                    self.strip_leading = true;
                    self.pending_ws.clear();
                }
                Region::Text { end: Some(end) } => {
                    // Not a call: the marker and what follows are content (at least one
                    // character, so the marker is not found again).
                    let end = end
                        .max(self.buf.chars().next().map_or(1, char::len_utf8))
                        .min(self.buf.len());
                    let text: String = self.buf.drain(..end).collect();
                    self.content(&text, out);
                    self.in_region = false;
                }
                Region::Text { end: None } => return,
            }
            if at_end && self.buf.is_empty() {
                return;
            }
        }
    }

    /// The longest suffix of the buffer that could begin a call region.
    fn held_suffix(&self) -> usize {
        let b = &self.buf;
        let mut hold = 0;
        for m in self.format.markers() {
            for n in (1..m.len().min(b.len() + 1)).rev() {
                if n > hold && b.is_char_boundary(b.len() - n) && m.starts_with(&b[b.len() - n..]) {
                    hold = n;
                    break;
                }
            }
        }
        hold
    }

    /// Content, less whitespace at the answer's start or after a call; trailing whitespace
    /// waits for what follows.
    fn content(&mut self, text: &str, out: &mut Vec<ToolDelta>) {
        let mut s = std::mem::take(&mut self.pending_ws);
        s.push_str(text);
        let mut s = s.as_str();
        if self.strip_leading {
            s = s.trim_start();
            if s.is_empty() {
                return;
            }
            self.strip_leading = false;
        }
        let body = s.trim_end();
        self.pending_ws = s[body.len()..].to_string();
        if !body.is_empty() {
            out.push(ToolDelta::Content(body.to_string()));
            self.at_start = false;
        }
    }
}

/// A call in a whole answer.
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedCall {
    pub id: String,
    pub name: String,
    /// The arguments as JSON text, as the model wrote them (OpenAI's `arguments` string).
    pub arguments: String,
}

/// Deltas gathered into content and calls.
pub fn collect(deltas: Vec<ToolDelta>) -> (Option<String>, Vec<ParsedCall>) {
    let mut content = String::new();
    let mut calls: Vec<ParsedCall> = Vec::new();
    for d in deltas {
        match d {
            ToolDelta::Content(t) => content.push_str(&t),
            ToolDelta::CallStart { id, name, .. } => calls.push(ParsedCall {
                id,
                name,
                arguments: String::new(),
            }),
            ToolDelta::Arguments { index, text } => {
                if let Some(c) = calls.get_mut(index) {
                    c.arguments.push_str(&text);
                }
            }
        }
    }
    ((!content.is_empty() || calls.is_empty()).then_some(content), calls)
}

/// Grammars: the answer is one or more calls of the offered tools in the format, their
/// arguments valid for each tool's schema. `token`: the id of a delimiter the vocabulary
/// has as a special token (written `<[id]>`, since it cannot be spelled as text).
pub fn grammar(format: ToolFormat, tools: &[ToolDef], parallel: bool, token: &dyn Fn(&str) -> Option<u32>) -> String {
    let lit = |s: &str| match token(s) {
        Some(id) => format!("<[{id}]>"),
        None => serde_json::to_string(s).unwrap_or_default(),
    };
    let args = |t: &ToolDef| {
        let mut a = t.parameters.clone();
        if let Some(o) = a.as_object_mut() {
            o.insert("x-guidance".into(), crate::json_layout());
        }
        format!("%json {a}")
    };
    let max = if parallel { MAX_PARALLEL_CALLS } else { 1 };
    // "item (sep item (sep item)?)?": one to `max`.
    let repeat = |item: &str, sep: &str| {
        let mut s = item.to_string();
        let mut tail = String::new();
        for _ in 1..max {
            s.push_str(&format!(" ({sep} {item}"));
            tail.push(')');
            tail.push('?');
        }
        s + &tail
    };
    let mut rules = Vec::new();
    let alts: Vec<String> = tools.iter().enumerate().map(|(k, _)| format!("call{k}")).collect();
    let call = alts.join(" | ");
    let name = |t: &ToolDef| serde_json::to_string(&t.name).unwrap_or_default();
    let start = match format {
        ToolFormat::Hearth | ToolFormat::Hermes => {
            for (k, t) in tools.iter().enumerate() {
                let obj = json!({
                    "type": "object",
                    "properties": {"name": {"const": t.name}, "arguments": with_layout(&t.parameters)},
                    "required": ["name", "arguments"],
                    "additionalProperties": false,
                    "x-guidance": crate::json_layout(),
                });
                rules.push(format!("call{k}: %json {obj}"));
            }
            let block = format!("{} \"\\n\" call \"\\n\" {}", lit(HERMES_OPEN), lit(HERMES_CLOSE));
            rules.push(format!("block: {block}"));
            repeat("block", "\"\\n\"")
        }
        ToolFormat::Llama3Json => {
            for (k, t) in tools.iter().enumerate() {
                let obj = json!({
                    "type": "object",
                    "properties": {"name": {"const": t.name}, "parameters": with_layout(&t.parameters)},
                    "required": ["name", "parameters"],
                    "additionalProperties": false,
                    "x-guidance": crate::json_layout(),
                });
                rules.push(format!("call{k}: %json {obj}"));
            }
            repeat("call", "\"; \"")
        }
        ToolFormat::Mistral => {
            for (k, t) in tools.iter().enumerate() {
                let obj = json!({
                    "type": "object",
                    "properties": {"name": {"const": t.name}, "arguments": with_layout(&t.parameters)},
                    "required": ["name", "arguments"],
                    "additionalProperties": false,
                    "x-guidance": crate::json_layout(),
                });
                rules.push(format!("call{k}: %json {obj}"));
            }
            format!("{} \"[\" {} \"]\"", lit(MISTRAL_CALLS), repeat("call", "\", \""))
        }
        ToolFormat::MistralArgs => {
            for (k, t) in tools.iter().enumerate() {
                rules.push(format!("call{k}: {} {} {}", name(t), lit(MISTRAL_ARGS), args(t)));
            }
            rules.push(format!("block: {} call", lit(MISTRAL_CALLS)));
            repeat("block", "\"\"")
        }
        ToolFormat::DeepseekV3 | ToolFormat::DeepseekV31 => {
            for (k, t) in tools.iter().enumerate() {
                rules.push(if format == ToolFormat::DeepseekV3 {
                    format!(
                        "call{k}: {} \"function\" {} {} \"\\n```json\\n\" {} \"\\n```\" {}",
                        lit(DS_CALL_BEGIN),
                        lit(DS_SEP),
                        name(t),
                        args(t),
                        lit(DS_CALL_END)
                    )
                } else {
                    format!(
                        "call{k}: {} {} {} {} {}",
                        lit(DS_CALL_BEGIN),
                        name(t),
                        lit(DS_SEP),
                        args(t),
                        lit(DS_CALL_END)
                    )
                });
            }
            let sep = if format == ToolFormat::DeepseekV3 {
                "\"\\n\""
            } else {
                "\"\""
            };
            format!("{} {} {}", lit(DS_CALLS_BEGIN), repeat("call", sep), lit(DS_CALLS_END))
        }
        ToolFormat::KimiK2 => {
            for (k, t) in tools.iter().enumerate() {
                let fname = serde_json::to_string(&format!("functions.{}:", t.name)).unwrap_or_default();
                rules.push(format!(
                    "call{k}: {} {fname} /[0-9]/ {} {} {}",
                    lit(KIMI_CALL_BEGIN),
                    lit(KIMI_ARGS_BEGIN),
                    args(t),
                    lit(KIMI_CALL_END)
                ));
            }
            format!(
                "{} {} {}",
                lit(KIMI_SECTION_BEGIN),
                repeat("call", "\"\""),
                lit(KIMI_SECTION_END)
            )
        }
        ToolFormat::Qwen3Coder => {
            for (k, t) in tools.iter().enumerate() {
                let props = t.parameters.get("properties").and_then(Value::as_object);
                let mut params = Vec::new();
                for (p, (key, schema)) in props.into_iter().flatten().enumerate() {
                    let value = if schema.get("type").and_then(Value::as_str) == Some("string") {
                        // Text up to the closing tag.
                        "/[^<]+/".to_string()
                    } else {
                        format!("%json {}", with_layout(schema))
                    };
                    let open = serde_json::to_string(&format!("<parameter={key}>\n")).unwrap_or_default();
                    rules.push(format!("p{k}_{p}: {open} {value} \"\\n</parameter>\\n\""));
                    params.push(format!("p{k}_{p}"));
                }
                // In the schema's order: required parameters always, the others optional.
                let required: Vec<&str> = t
                    .parameters
                    .get("required")
                    .and_then(Value::as_array)
                    .map(|r| r.iter().filter_map(Value::as_str).collect())
                    .unwrap_or_default();
                let body = props
                    .into_iter()
                    .flatten()
                    .zip(&params)
                    .map(|((key, _), rule)| {
                        if required.contains(&key.as_str()) {
                            rule.clone()
                        } else {
                            format!("{rule}?")
                        }
                    })
                    .collect::<Vec<_>>()
                    .join(" ");
                let open = serde_json::to_string(&format!("<function={}>\n", t.name)).unwrap_or_default();
                rules.push(format!(
                    "call{k}: {} \"\\n\" {open} {body} \"</function>\\n\" {}",
                    lit(HERMES_OPEN),
                    lit(HERMES_CLOSE)
                ));
            }
            repeat("call", "\"\\n\"")
        }
    };
    let mut g = format!("start: {start}\ncall: {call}\n");
    for r in rules {
        g.push_str(&r);
        g.push('\n');
    }
    g
}

fn with_layout(schema: &Value) -> Value {
    let mut s = schema.clone();
    if let Some(o) = s.as_object_mut() {
        o.insert("x-guidance".into(), crate::json_layout());
    }
    s
}

/// At most this many calls in one constrained answer (`parallel_tool_calls`).
pub const MAX_PARALLEL_CALLS: usize = 4;

#[cfg(test)]
mod tests;

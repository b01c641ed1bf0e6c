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
use super::{held_back, with_pending, Delta};

/// One function the model may call.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolDef {
    pub name: String,
    pub description: Option<String>,
    /// The arguments' JSON Schema (`{"type": "object"}` when absent).
    pub parameters: Value,
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
    fn region(self, text: &str, tools: &[ToolDef]) -> Region {
        match self {
            ToolFormat::Hearth | ToolFormat::Hermes => hermes(text),
            ToolFormat::Llama3Json => llama3(text),
            ToolFormat::Mistral => mistral_json(text),
            ToolFormat::MistralArgs => mistral_args(text),
            ToolFormat::DeepseekV3 => deepseek(text, true),
            ToolFormat::DeepseekV31 => deepseek(text, false),
            ToolFormat::KimiK2 => kimi(text),
            ToolFormat::Qwen3Coder => qwen3_coder(text, tools),
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

/// What a region turned out to be. `end: None`: not known yet (at the answer's end, the
/// region runs to it).
#[derive(Debug, PartialEq)]
enum Region {
    /// Calls, and where the region ends.
    Calls { calls: Vec<PartCall>, end: Option<usize> },
    /// Not calls: text up to `end` (what follows is read again, as any other text).
    Text { end: Option<usize> },
}

impl Region {
    fn wait(calls: Vec<PartCall>) -> Self {
        if calls.is_empty() {
            Region::Text { end: None }
        } else {
            Region::Calls { calls, end: None }
        }
    }
}

/// `lit` at `text[i..]`.
enum Literal {
    Found(usize),
    /// The text ends inside it.
    Partial,
    Absent,
}

fn literal_at(text: &str, i: usize, lit: &str) -> Literal {
    let rest = &text[i.min(text.len())..];
    if rest.starts_with(lit) {
        Literal::Found(i + lit.len())
    } else if lit.starts_with(rest) {
        Literal::Partial
    } else {
        Literal::Absent
    }
}

/// A JSON call object read at `text[i..]` (keys `name` + one of `arg_keys`).
enum JsonCall {
    /// Not a call: shown at this byte.
    NotCall(usize),
    /// Too little of it yet to tell.
    Undecided,
    /// A call; where its object ends once it has.
    Call(PartCall, Option<usize>),
    /// A call whose object broke at this byte: it keeps the arguments it had, and the
    /// region ends there.
    Broken(PartCall, usize),
}

fn json_call(text: &str, i: usize, arg_keys: &[&str]) -> JsonCall {
    let (c, broke) = match call_object(&text[i..], arg_keys) {
        Ok(c) => (c, None),
        Err((c, at)) => (c, Some(i + at)),
    };
    let call = match (&c.name, c.args, c.args_object) {
        (Some(name), Some((s, e)), true) => Some(PartCall {
            name: name.clone(),
            id: c.id.clone(),
            args: text[i + s..i + e].to_string(),
        }),
        _ => None,
    };
    match (broke, call, c.end) {
        (Some(at), None, _) => JsonCall::NotCall(at),
        (Some(at), Some(call), _) => JsonCall::Broken(call, at),
        (None, None, Some(end)) => JsonCall::NotCall(i + end),
        (None, None, None) => JsonCall::Undecided,
        (None, Some(call), end) => JsonCall::Call(call, end.map(|e| i + e)),
    }
}

/// Arguments written as a bare JSON object at `text[a..]`.
fn json_args(name: &str, id: Option<String>, text: &str, a: usize) -> (PartCall, Result<Option<usize>, usize>) {
    let (args, end) = match value_end(&text[a..]) {
        Ok(Some(e)) => (&text[a..a + e], Ok(Some(a + e))),
        Ok(None) => (&text[a..], Ok(None)),
        Err(at) => (&text[a..a + at], Err(a + at)),
    };
    (
        PartCall {
            name: name.to_string(),
            id,
            args: args.to_string(),
        },
        end,
    )
}

fn hermes(text: &str) -> Region {
    let i = skip_ws(text, HERMES_OPEN.len());
    if i >= text.len() {
        return Region::Text { end: None };
    }
    match json_call(text, i, &["arguments", "parameters"]) {
        JsonCall::NotCall(_) => Region::Text {
            end: Some(HERMES_OPEN.len()),
        },
        JsonCall::Undecided => Region::Text { end: None },
        JsonCall::Broken(call, at) => Region::Calls {
            calls: vec![call],
            end: Some(at),
        },
        JsonCall::Call(call, None) => Region::wait(vec![call]),
        JsonCall::Call(call, Some(end)) => {
            let calls = vec![call];
            match literal_at(text, skip_ws(text, end), HERMES_CLOSE) {
                Literal::Found(e) => Region::Calls { calls, end: Some(e) },
                Literal::Partial => Region::wait(calls),
                // Something else after the object: the call ends there, the rest is text.
                Literal::Absent => Region::Calls { calls, end: Some(end) },
            }
        }
    }
}

fn llama3(text: &str) -> Region {
    let mut i = match literal_at(text, 0, PYTHON_TAG) {
        Literal::Found(e) => e,
        _ => 0,
    };
    let mut calls = Vec::new();
    loop {
        i = skip_ws(text, i);
        if i >= text.len() {
            return Region::wait(calls);
        }
        // After calls the rest is text; before any, the answer is not a call.
        let not_call = |calls: Vec<PartCall>, at: usize| {
            if calls.is_empty() {
                Region::Text { end: Some(at) }
            } else {
                Region::Calls { calls, end: Some(i) }
            }
        };
        if !text[i..].starts_with('{') {
            return not_call(calls, i);
        }
        match json_call(text, i, &["parameters", "arguments"]) {
            JsonCall::NotCall(at) => return not_call(calls, at),
            JsonCall::Undecided => return Region::wait(calls),
            JsonCall::Broken(call, at) => {
                calls.push(call);
                return Region::Calls { calls, end: Some(at) };
            }
            JsonCall::Call(call, None) => {
                calls.push(call);
                return Region::wait(calls);
            }
            JsonCall::Call(call, Some(end)) => {
                calls.push(call);
                i = skip_ws(text, end);
                if text[i..].starts_with(';') {
                    i += 1;
                }
            }
        }
    }
}

fn mistral_json(text: &str) -> Region {
    let marker = MISTRAL_CALLS.len();
    let mut i = skip_ws(text, marker);
    if i >= text.len() {
        return Region::Text { end: None };
    }
    if !text[i..].starts_with('[') {
        return Region::Text { end: Some(marker) };
    }
    i += 1;
    let mut calls = Vec::new();
    loop {
        i = skip_ws(text, i);
        if i >= text.len() {
            return Region::wait(calls);
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
            JsonCall::NotCall(_) if calls.is_empty() => return Region::Text { end: Some(marker) },
            JsonCall::NotCall(_) => return Region::Calls { calls, end: Some(i) },
            JsonCall::Undecided => return Region::wait(calls),
            JsonCall::Broken(call, at) => {
                calls.push(call);
                return Region::Calls { calls, end: Some(at) };
            }
            JsonCall::Call(call, end) => {
                calls.push(call);
                match end {
                    Some(e) => i = e,
                    None => return Region::wait(calls),
                }
            }
        }
    }
}

fn mistral_args(text: &str) -> Region {
    let start = MISTRAL_CALLS.len();
    let rest = &text[start..];
    let name_end = match (rest.find(MISTRAL_CALL_ID), rest.find(MISTRAL_ARGS)) {
        (Some(c), Some(a)) => c.min(a),
        (Some(c), None) => c,
        (None, Some(a)) => a,
        (None, None) => {
            // A name may still be coming (short, of name characters).
            let plausible = rest.len() < 128 && rest.chars().all(|c| c.is_alphanumeric() || "_-.[".contains(c));
            return Region::Text {
                end: (!plausible).then_some(start),
            };
        }
    };
    let name = rest[..name_end].trim();
    if name.is_empty() || !name.chars().all(|c| c.is_alphanumeric() || "_-.".contains(c)) {
        return Region::Text { end: Some(start) };
    }
    let mut i = start + name_end;
    let mut id = None;
    if let Literal::Found(e) = literal_at(text, i, MISTRAL_CALL_ID) {
        match text[e..].find(MISTRAL_ARGS) {
            Some(p) => {
                id = Some(text[e..e + p].trim().to_string());
                i = e + p;
            }
            None => return Region::Text { end: None },
        }
    }
    let Literal::Found(args_at) = literal_at(text, i, MISTRAL_ARGS) else {
        return Region::Text { end: Some(start) };
    };
    let a = skip_ws(text, args_at);
    if a >= text.len() {
        return Region::Text { end: None };
    }
    if !text[a..].starts_with('{') {
        return Region::Text { end: Some(start) };
    }
    match json_args(name, id, text, a) {
        (call, Ok(end)) => Region::Calls { calls: vec![call], end },
        (call, Err(at)) => Region::Calls {
            calls: vec![call],
            end: Some(at),
        },
    }
}

/// One call of a section, as read so far.
enum SectionCall {
    /// Not a call: the section ends before it.
    NotCall,
    /// Too little of it yet to tell.
    Wait,
    /// A call, and where it ends: `Ok(None)` not yet, `Err(at)` it ended without its closing
    /// delimiter (the section ends there too).
    Call(PartCall, Result<Option<usize>, usize>),
}

/// A section of calls (DeepSeek's, Kimi's): `begin`, then calls that each start with
/// `call_begin` and are read by `call`, then `end_marker`.
fn section(
    text: &str,
    begin: &str,
    end_marker: &str,
    call_begin: &str,
    call: &dyn Fn(&str, usize) -> SectionCall,
) -> Region {
    let mut i = begin.len();
    let mut calls = Vec::new();
    loop {
        i = skip_ws(text, i);
        if i >= text.len() {
            return Region::wait(calls);
        }
        match literal_at(text, i, end_marker) {
            Literal::Found(e) => return Region::Calls { calls, end: Some(e) },
            Literal::Partial => return Region::wait(calls),
            Literal::Absent => {}
        }
        let after_begin = match literal_at(text, i, call_begin) {
            Literal::Found(e) => e,
            Literal::Partial => return Region::wait(calls),
            Literal::Absent if calls.is_empty() => return Region::Text { end: Some(begin.len()) },
            Literal::Absent => return Region::Calls { calls, end: Some(i) },
        };
        match call(text, after_begin) {
            SectionCall::NotCall if calls.is_empty() => return Region::Text { end: Some(begin.len()) },
            SectionCall::NotCall => return Region::Calls { calls, end: Some(i) },
            SectionCall::Wait => return Region::wait(calls),
            SectionCall::Call(c, Ok(Some(e))) => {
                calls.push(c);
                i = e;
            }
            SectionCall::Call(c, Ok(None)) => {
                calls.push(c);
                return Region::wait(calls);
            }
            SectionCall::Call(c, Err(at)) => {
                calls.push(c);
                return Region::Calls { calls, end: Some(at) };
            }
        }
    }
}

/// A delimiter expected at `text[from..]` (after whitespace) that may still be coming:
/// found (its end), not yet, or absent (where it should have been).
fn delimiter(text: &str, from: usize, lit: &str) -> Result<Option<usize>, usize> {
    let j = skip_ws(text, from);
    match literal_at(text, j, lit) {
        Literal::Found(e) => Ok(Some(e)),
        Literal::Partial => Ok(None),
        Literal::Absent => Err(j),
    }
}

/// Text before `lit` in `text[from..]`: its end, or (not yet there) whether to wait for it
/// (a name is short: past 256 bytes it is not coming).
fn up_to(text: &str, from: usize, lit: &str) -> Result<usize, SectionCall> {
    match text[from..].find(lit) {
        Some(p) => Ok(from + p),
        None if text.len() - from < 256 => Err(SectionCall::Wait),
        None => Err(SectionCall::NotCall),
    }
}

/// A call's JSON arguments at `text[a..]`, then its closing delimiters, in order.
fn section_call(name: &str, id: Option<String>, text: &str, a: usize, closers: &[&str]) -> SectionCall {
    if a >= text.len() {
        return SectionCall::Wait;
    }
    if name.is_empty() || !text[a..].starts_with('{') {
        return SectionCall::NotCall;
    }
    let (c, end) = json_args(name, id, text, a);
    let mut end = match end {
        Ok(Some(e)) => e,
        other => return SectionCall::Call(c, other),
    };
    for lit in closers {
        match delimiter(text, end, lit) {
            Ok(Some(e)) => end = e,
            other => return SectionCall::Call(c, other),
        }
    }
    SectionCall::Call(c, Ok(Some(end)))
}

/// DeepSeek's sections: V3/R1 (`function<sep>name\n```json\n{…}\n```<end>`) or V3.1
/// (`name<sep>{…}<end>`).
fn deepseek(text: &str, v3: bool) -> Region {
    let call = |text: &str, at: usize| -> SectionCall {
        let sep = match up_to(text, at, DS_SEP) {
            Ok(s) => s,
            Err(c) => return c,
        };
        if v3 {
            let name_at = sep + DS_SEP.len();
            let fence = match up_to(text, name_at, "```json") {
                Ok(f) => f,
                Err(c) => return c,
            };
            let a = skip_ws(text, fence + "```json".len());
            section_call(text[name_at..fence].trim(), None, text, a, &["```", DS_CALL_END])
        } else {
            let a = skip_ws(text, sep + DS_SEP.len());
            section_call(text[at..sep].trim(), None, text, a, &[DS_CALL_END])
        }
    };
    section(text, DS_CALLS_BEGIN, DS_CALLS_END, DS_CALL_BEGIN, &call)
}

/// Kimi K2's section: `<call begin>functions.NAME:INDEX<argument begin>{…}<call end>`.
fn kimi(text: &str) -> Region {
    let call = |text: &str, at: usize| -> SectionCall {
        let p = match up_to(text, at, KIMI_ARGS_BEGIN) {
            Ok(p) => p,
            Err(c) => return c,
        };
        let call_id = text[at..p].trim();
        let name = call_id
            .strip_prefix("functions.")
            .unwrap_or(call_id)
            .rsplit_once(':')
            .map_or(call_id, |(n, _)| n);
        let a = skip_ws(text, p + KIMI_ARGS_BEGIN.len());
        section_call(name, Some(call_id.to_string()), text, a, &[KIMI_CALL_END])
    };
    section(text, KIMI_SECTION_BEGIN, KIMI_SECTION_END, KIMI_CALL_BEGIN, &call)
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

fn qwen3_coder(text: &str, tools: &[ToolDef]) -> Region {
    let marker = HERMES_OPEN.len();
    let i = skip_ws(text, marker);
    if i >= text.len() {
        return Region::Text { end: None };
    }
    let f_at = match literal_at(text, i, "<function=") {
        Literal::Found(e) => e,
        Literal::Partial => return Region::Text { end: None },
        Literal::Absent => return Region::Text { end: Some(marker) },
    };
    let gt = match text[f_at..].find('>') {
        Some(g) => f_at + g,
        None if text.len() - f_at < 256 => return Region::Text { end: None },
        None => return Region::Text { end: Some(marker) },
    };
    let name = text[f_at..gt].trim();
    if name.is_empty() || name.contains('<') || name.contains('\n') {
        return Region::Text { end: Some(marker) };
    }
    let tool = tools.iter().find(|t| t.name == name);
    let mut call = PartCall {
        name: name.to_string(),
        id: None,
        args: String::from("{"),
    };
    let mut first = true;
    let mut j = gt + 1;
    loop {
        j = skip_ws(text, j);
        if j >= text.len() {
            return Region::wait(vec![call]);
        }
        match literal_at(text, j, "</function>") {
            Literal::Found(e) => {
                call.args.push('}');
                let end = match delimiter(text, e, HERMES_CLOSE) {
                    Ok(None) => return Region::wait(vec![call]),
                    Ok(Some(end)) => end,
                    Err(_) => e,
                };
                return Region::Calls {
                    calls: vec![call],
                    end: Some(end),
                };
            }
            Literal::Partial => return Region::wait(vec![call]),
            Literal::Absent => {}
        }
        let p_at = match literal_at(text, j, "<parameter=") {
            Literal::Found(e) => e,
            Literal::Partial => return Region::wait(vec![call]),
            Literal::Absent => {
                // Not the format after all, past the name: the call ends here.
                call.args.push('}');
                return Region::Calls {
                    calls: vec![call],
                    end: Some(j),
                };
            }
        };
        let Some(gt) = text[p_at..].find('>') else {
            return Region::wait(vec![call]);
        };
        let key = text[p_at..p_at + gt].trim();
        let v_at = p_at + gt + 1;
        let Some(close) = text[v_at..].find("</parameter>") else {
            return Region::wait(vec![call]);
        };
        let raw = &text[v_at..v_at + close];
        let raw = raw.strip_prefix('\n').unwrap_or(raw);
        let raw = raw.strip_suffix('\n').unwrap_or(raw);
        if !first {
            call.args.push_str(", ");
        }
        first = false;
        call.args.push_str(&crate::layout_json(&Value::String(key.to_string())));
        call.args.push_str(": ");
        call.args.push_str(&coder_value(tool, key, raw));
        j = v_at + close + "</parameter>".len();
    }
}

/// Turns an answer into content and tool-call deltas as it arrives.
#[derive(Debug)]
pub struct ToolStream {
    format: ToolFormat,
    tools: std::sync::Arc<[ToolDef]>,
    buf: String,
    in_region: bool,
    /// Calls of the current region announced so far: argument bytes sent.
    region_calls: Vec<usize>,
    /// Calls of earlier regions.
    calls_done: usize,
    /// Nothing of the answer was sent yet.
    at_start: bool,
    /// Drop leading whitespace of the next content (the answer's start, or after a call).
    strip_leading: bool,
    /// Trailing whitespace of content, sent only if more content follows.
    pending_ws: String,
    /// An open region is read again only once it has grown to this many bytes (a long
    /// argument would otherwise be re-read whole for every token).
    parse_at: usize,
}

impl ToolStream {
    pub fn new(format: ToolFormat, tools: std::sync::Arc<[ToolDef]>) -> Self {
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
            parse_at: 0,
        }
    }

    /// Calls started so far.
    pub fn calls(&self) -> usize {
        self.calls_done + self.region_calls.len()
    }

    pub fn push(&mut self, text: &str) -> Vec<Delta> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        self.run(false, &mut out);
        out
    }

    /// The end of the answer: what was held back is resolved (an unfinished call keeps the
    /// arguments it has).
    pub fn finish(&mut self) -> Vec<Delta> {
        let mut out = Vec::new();
        self.run(true, &mut out);
        let rest = std::mem::take(&mut self.buf);
        self.content(&rest, &mut out);
        let ws = std::mem::take(&mut self.pending_ws);
        if self.calls() == 0 && !ws.is_empty() && !self.at_start {
            out.push(Delta::Content(ws));
        }
        out
    }

    /// A whole answer, as the stream would give it: content (None when the answer is only
    /// calls) and the calls.
    pub fn parse(format: ToolFormat, tools: &[ToolDef], text: &str) -> (Option<String>, Vec<ParsedCall>) {
        let mut s = ToolStream::new(format, tools.into());
        let mut deltas = s.push(text);
        deltas.extend(s.finish());
        collect(deltas)
    }

    fn run(&mut self, at_end: bool, out: &mut Vec<Delta>) {
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
                        self.parse_at = 0;
                    }
                    None => {
                        let hold = if at_end {
                            0
                        } else {
                            held_back(&self.buf, self.format.markers())
                        };
                        let send: String = self.buf.drain(..self.buf.len() - hold).collect();
                        self.content(&send, out);
                        return;
                    }
                }
            }
            if !at_end && self.buf.len() < self.parse_at {
                return;
            }
            let region = self.format.region(&self.buf, &self.tools);
            let end_at = |end: Option<usize>, len: usize| if at_end { Some(end.unwrap_or(len)) } else { end };
            match region {
                Region::Calls { calls, end } => {
                    for (k, c) in calls.iter().enumerate() {
                        if k == self.region_calls.len() {
                            self.pending_ws.clear();
                            let id =
                                c.id.clone()
                                    .filter(|i| !i.is_empty())
                                    .unwrap_or_else(|| self.format.new_call_id());
                            out.push(Delta::CallStart {
                                index: self.calls_done + k,
                                id,
                                name: c.name.clone(),
                            });
                            self.region_calls.push(0);
                            self.at_start = false;
                        }
                        let sent = &mut self.region_calls[k];
                        if c.args.len() > *sent && c.args.is_char_boundary(*sent) {
                            out.push(Delta::Arguments {
                                index: self.calls_done + k,
                                text: c.args[*sent..].to_string(),
                            });
                            *sent = c.args.len();
                        }
                    }
                    let Some(end) = end_at(end, self.buf.len()) else {
                        self.parse_at = self.buf.len() + self.buf.len() / 16;
                        return;
                    };
                    self.buf.drain(..end.min(self.buf.len()));
                    self.calls_done += self.region_calls.len();
                    self.region_calls.clear();
                    self.in_region = false;
                    self.strip_leading = true;
                    self.pending_ws.clear();
                }
                Region::Text { end } => {
                    let Some(end) = end_at(end, self.buf.len()) else {
                        self.parse_at = self.buf.len() + self.buf.len() / 16;
                        return;
                    };
                    // Not a call: the marker and what follows up to `end` are content (at
                    // least one character, so the marker is not found again).
                    let end = end
                        .max(self.buf.chars().next().map_or(1, char::len_utf8))
                        .min(self.buf.len());
                    let text: String = self.buf.drain(..end).collect();
                    self.content(&text, out);
                    self.in_region = false;
                }
            }
            if self.buf.is_empty() {
                return;
            }
        }
    }

    /// Content, less whitespace at the answer's start or after a call; trailing whitespace
    /// waits for what follows.
    fn content(&mut self, text: &str, out: &mut Vec<Delta>) {
        let mut text = text;
        if self.strip_leading {
            text = text.trim_start();
            if text.is_empty() {
                return;
            }
            self.strip_leading = false;
        }
        if let Some(body) = with_pending(&mut self.pending_ws, text) {
            out.push(Delta::Content(body));
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

/// Deltas gathered into content and calls (reasoning deltas are not this module's).
pub fn collect(deltas: impl IntoIterator<Item = Delta>) -> (Option<String>, Vec<ParsedCall>) {
    let mut content = String::new();
    let mut calls: Vec<ParsedCall> = Vec::new();
    for d in deltas {
        match d {
            Delta::Content(t) => content.push_str(&t),
            Delta::CallStart { id, name, .. } => calls.push(ParsedCall {
                id,
                name,
                arguments: String::new(),
            }),
            Delta::Arguments { index, text } => {
                if let Some(c) = calls.get_mut(index) {
                    c.arguments.push_str(&text);
                }
            }
            Delta::Reasoning(_) => {}
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
    let args = |t: &ToolDef| format!("%json {}", with_layout(&t.parameters));
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
    // `{"name": <the tool>, "<args key>": <its arguments>}` for each tool.
    let json_call_rules = |args_key: &str, rules: &mut Vec<String>| {
        for (k, t) in tools.iter().enumerate() {
            let obj = json!({
                "type": "object",
                "properties": {"name": {"const": t.name}, args_key: with_layout(&t.parameters)},
                "required": ["name", args_key],
                "additionalProperties": false,
                "x-guidance": crate::json_layout(),
            });
            rules.push(format!("call{k}: %json {obj}"));
        }
    };
    let start = match format {
        ToolFormat::Hearth | ToolFormat::Hermes => {
            json_call_rules("arguments", &mut rules);
            let block = format!("{} \"\\n\" call \"\\n\" {}", lit(HERMES_OPEN), lit(HERMES_CLOSE));
            rules.push(format!("block: {block}"));
            repeat("block", "\"\\n\"")
        }
        ToolFormat::Llama3Json => {
            json_call_rules("parameters", &mut rules);
            repeat("call", "\"; \"")
        }
        ToolFormat::Mistral => {
            json_call_rules("arguments", &mut rules);
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

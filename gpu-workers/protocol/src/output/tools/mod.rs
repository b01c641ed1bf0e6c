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
//! Each format's region parser is its own file (`hermes`, `llama3`, `mistral`, `deepseek`,
//! `kimi`, `qwen3_coder`) on the scanning they share (`scan`); [`ToolFormat`]'s methods are
//! the table from a format to its markers, delimiters and parser; the driver is in `stream`,
//! the grammars in `grammar`.
//!
//! Text outside calls is content; whitespace next to a call and at the answer's ends is not.
//! A call is announced once its name is known and its arguments have begun, and its
//! arguments then stream as the model writes them. A block that turns out not to be a call
//! before that stays text.

mod deepseek;
mod grammar;
mod hermes;
mod kimi;
mod llama3;
mod mistral;
mod qwen3_coder;
mod scan;
mod stream;

pub use grammar::grammar;
pub use stream::ToolStream;

use serde::Serialize;
use serde_json::Value;

use super::json_scan::skip_ws;
use super::Delta;

use deepseek::deepseek;
use hermes::{hermes, hermes_json_blocks};
use kimi::kimi;
use llama3::llama3;
use mistral::{mistral_args, mistral_json};
use qwen3_coder::qwen3_coder;
use scan::Region;

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

pub(super) const HERMES_OPEN: &str = "<tool_call>";
pub(super) const HERMES_CLOSE: &str = "</tool_call>";
pub(super) const PYTHON_TAG: &str = "<|python_tag|>";
pub(super) const MISTRAL_CALLS: &str = "[TOOL_CALLS]";
pub(super) const MISTRAL_ARGS: &str = "[ARGS]";
pub(super) const MISTRAL_CALL_ID: &str = "[CALL_ID]";
pub(super) const DS_CALLS_BEGIN: &str = "<｜tool▁calls▁begin｜>";
pub(super) const DS_CALLS_END: &str = "<｜tool▁calls▁end｜>";
pub(super) const DS_CALL_BEGIN: &str = "<｜tool▁call▁begin｜>";
pub(super) const DS_CALL_END: &str = "<｜tool▁call▁end｜>";
pub(super) const DS_SEP: &str = "<｜tool▁sep｜>";
pub(super) const KIMI_SECTION_BEGIN: &str = "<|tool_calls_section_begin|>";
pub(super) const KIMI_SECTION_END: &str = "<|tool_calls_section_end|>";
pub(super) const KIMI_CALL_BEGIN: &str = "<|tool_call_begin|>";
pub(super) const KIMI_ARGS_BEGIN: &str = "<|tool_call_argument_begin|>";
pub(super) const KIMI_CALL_END: &str = "<|tool_call_end|>";

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

/// At most this many calls in one constrained answer (`parallel_tool_calls`).
pub const MAX_PARALLEL_CALLS: usize = 4;

#[cfg(test)]
mod tests;

//! A model's answer as the API returns it: reasoning, content and tool calls, read out of the
//! generated text by the model family's formats ([`reasoning`], [`tools`]). Streaming and
//! whole answers go through the same [`AssistantStream`], so both always agree.

mod json_scan;
pub mod reasoning;
pub mod tools;

use std::sync::Arc;

pub use reasoning::{ReasoningFormat, ReasoningSplit};
pub use tools::{ParsedCall, ToolDef, ToolFormat, ToolStream};

/// How to read one request's answers.
#[derive(Debug, Clone, Default)]
pub struct OutputSpec {
    /// Parse tool calls in this format, for these tools.
    pub tools: Option<(ToolFormat, Arc<[ToolDef]>)>,
    /// Take reasoning out; `true`: the prompt already opened the thinking block.
    pub reasoning: Option<(ReasoningFormat, bool)>,
}

impl OutputSpec {
    /// Whether answers are plain text (nothing to parse).
    pub fn is_plain(&self) -> bool {
        self.tools.is_none() && self.reasoning.is_none()
    }

    pub fn stream(&self) -> AssistantStream {
        AssistantStream {
            reasoning: self.reasoning.map(|(f, inside)| ReasoningSplit::new(f, inside)),
            tools: self.tools.as_ref().map(|(f, t)| ToolStream::new(*f, Arc::clone(t))),
            reasoning_tokens: 0,
        }
    }
}

/// What a streamed answer sends next.
#[derive(Debug, Clone, PartialEq)]
pub enum Delta {
    Reasoning(String),
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

/// One choice's answer, read as it arrives.
#[derive(Debug)]
pub struct AssistantStream {
    reasoning: Option<ReasoningSplit>,
    tools: Option<ToolStream>,
    reasoning_tokens: u32,
}

impl AssistantStream {
    /// The text of one generated token.
    pub fn push_token(&mut self, text: &str) -> Vec<Delta> {
        // A token is reasoning if it came inside the block, or opened it.
        let before = self.reasoning.as_ref().is_some_and(ReasoningSplit::thinking);
        let out = self.push(text);
        let after = self.reasoning.as_ref().is_some_and(ReasoningSplit::thinking);
        if before || after || out.iter().any(|d| matches!(d, Delta::Reasoning(_))) {
            self.reasoning_tokens += 1;
        }
        out
    }

    /// Tokens generated inside the thinking block (its markers included).
    pub fn reasoning_tokens(&self) -> u32 {
        self.reasoning_tokens
    }

    /// Tool calls started so far.
    pub fn calls(&self) -> usize {
        self.tools.as_ref().map_or(0, ToolStream::calls)
    }

    pub fn push(&mut self, text: &str) -> Vec<Delta> {
        let pieces = match self.reasoning.as_mut() {
            Some(r) => r.push(text),
            None => vec![reasoning::Piece::Answer(text.to_string())],
        };
        self.answer(pieces, false)
    }

    pub fn finish(&mut self) -> Vec<Delta> {
        let pieces = self.reasoning.as_mut().map(ReasoningSplit::finish).unwrap_or_default();
        self.answer(pieces, true)
    }

    fn answer(&mut self, pieces: Vec<reasoning::Piece>, end: bool) -> Vec<Delta> {
        let mut out = Vec::new();
        for p in pieces {
            match p {
                reasoning::Piece::Reasoning(r) => out.push(Delta::Reasoning(r)),
                reasoning::Piece::Answer(a) => match self.tools.as_mut() {
                    Some(t) => out.extend(t.push(&a)),
                    None => out.push(Delta::Content(a)),
                },
            }
        }
        if end {
            if let Some(t) = self.tools.as_mut() {
                out.extend(t.finish());
            }
        }
        out
    }
}

/// A whole answer.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Assistant {
    pub reasoning: Option<String>,
    /// None when the answer is only tool calls.
    pub content: Option<String>,
    pub calls: Vec<ParsedCall>,
}

impl Assistant {
    /// Gathers deltas (a stream's, in order).
    pub fn collect(deltas: impl IntoIterator<Item = Delta>) -> Self {
        let mut reasoning = String::new();
        let mut rest = Vec::new();
        for d in deltas {
            match d {
                Delta::Reasoning(r) => reasoning.push_str(&r),
                d => rest.push(d),
            }
        }
        let (content, calls) = tools::collect(rest);
        Assistant {
            reasoning: (!reasoning.is_empty()).then_some(reasoning),
            content,
            calls,
        }
    }

    /// A whole answer's text read by `spec`.
    pub fn parse(spec: &OutputSpec, text: &str) -> Self {
        let mut s = spec.stream();
        let mut d = s.push(text);
        d.extend(s.finish());
        Self::collect(d)
    }
}

/// `pending` (whitespace held back) + `text`, less the new trailing whitespace, which becomes
/// `pending`: None while there is nothing but whitespace (appended in place, so a long run
/// of it costs no more than its length).
fn with_pending(pending: &mut String, text: &str) -> Option<String> {
    let body = text.trim_end();
    if body.is_empty() {
        pending.push_str(text);
        return None;
    }
    let mut s = std::mem::take(pending);
    s.push_str(body);
    pending.push_str(&text[body.len()..]);
    Some(s)
}

/// The longest suffix of `buf` that is the start of one of `markers` (held back: the
/// marker may be arriving).
fn held_back(buf: &str, markers: &[&str]) -> usize {
    markers
        .iter()
        .filter_map(|m| {
            (1..m.len().min(buf.len() + 1))
                .rev()
                .find(|&n| buf.is_char_boundary(buf.len() - n) && m.starts_with(&buf[buf.len() - n..]))
        })
        .max()
        .unwrap_or(0)
}

#[cfg(test)]
mod tests;

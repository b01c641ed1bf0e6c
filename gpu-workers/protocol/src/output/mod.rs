//! A model's answer as the API returns it: reasoning, content and tool calls, read out of the
//! generated text by the model family's formats ([`reasoning`], [`tools`]). Streaming and
//! whole answers go through the same [`AssistantStream`], so both always agree.

mod json_scan;
pub mod reasoning;
pub mod tools;

pub use reasoning::{ReasoningFormat, ReasoningSplit};
pub use tools::{ParsedCall, ToolDef, ToolDelta, ToolFormat, ToolStream};

/// How to read one request's answers.
#[derive(Debug, Clone, Default)]
pub struct OutputSpec {
    /// Parse tool calls in this format, for these tools.
    pub tools: Option<(ToolFormat, Vec<ToolDef>)>,
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
            tools: self.tools.as_ref().map(|(f, t)| ToolStream::new(*f, t.clone())),
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
                    Some(t) => out.extend(t.push(&a).into_iter().map(Delta::from)),
                    None => out.push(Delta::Content(a)),
                },
            }
        }
        if end {
            if let Some(t) = self.tools.as_mut() {
                out.extend(t.finish().into_iter().map(Delta::from));
            }
        }
        out
    }
}

impl From<ToolDelta> for Delta {
    fn from(d: ToolDelta) -> Self {
        match d {
            ToolDelta::Content(c) => Delta::Content(c),
            ToolDelta::CallStart { index, id, name } => Delta::CallStart { index, id, name },
            ToolDelta::Arguments { index, text } => Delta::Arguments { index, text },
        }
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
        let mut tool_deltas = Vec::new();
        for d in deltas {
            match d {
                Delta::Reasoning(r) => reasoning.push_str(&r),
                Delta::Content(c) => tool_deltas.push(ToolDelta::Content(c)),
                Delta::CallStart { index, id, name } => tool_deltas.push(ToolDelta::CallStart { index, id, name }),
                Delta::Arguments { index, text } => tool_deltas.push(ToolDelta::Arguments { index, text }),
            }
        }
        let (content, calls) = tools::collect(tool_deltas);
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

#[cfg(test)]
mod tests;

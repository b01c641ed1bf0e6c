//! One answer as the item-based APIs return it (the Responses API's output items, the
//! Messages API's content blocks): an ordered list of parts — reasoning, text, tool calls —
//! each with its id, built from the worker's events through the same [`AssistantStream`]
//! that reads chat answers. A stream renders the [`Change`]s as they happen and the final
//! object renders the parts, so the ids and texts of both are the same by construction.

use hearth_protocol::output::{AssistantStream, Delta, OutputSpec};
use hearth_protocol::{FinishReason, GenerateEvent, Usage};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Reasoning,
    Text,
    Call,
}

/// One part of the answer.
#[derive(Debug, Clone)]
pub struct Part {
    pub kind: Kind,
    /// The part's own id (`msg_…`, `rs_…`, `fc_…`; the Messages API shows only calls' ids).
    pub id: String,
    /// A call's id as the model's tool format gave it, and its function.
    pub call_id: String,
    pub name: String,
    /// The text, reasoning, or a call's arguments so far.
    pub text: String,
    pub done: bool,
}

/// What happened to the parts.
#[derive(Debug, Clone, PartialEq)]
pub enum Change {
    Open(usize),
    Append(usize, String),
    Close(usize),
}

/// How an answer ended.
#[derive(Debug, Clone)]
pub enum End {
    Finished { reason: FinishReason, usage: Usage },
    Failed { code: String, message: String },
}

/// The parts of choice 0, read as tokens arrive.
pub struct Answer {
    reader: AssistantStream,
    pub parts: Vec<Part>,
    open: Option<usize>,
    /// Call index (the tool format's) → part.
    calls: Vec<usize>,
    prefix: String,
}

impl Answer {
    /// `prefix`: prepended to generated ids (`msg`, `rs`, … get `<kind>_<prefix><n>`).
    pub fn new(output: &OutputSpec, prefix: &str) -> Self {
        Self {
            reader: output.stream(),
            parts: Vec::new(),
            open: None,
            calls: Vec::new(),
            prefix: prefix.to_string(),
        }
    }

    pub fn reasoning_tokens(&self) -> u32 {
        self.reader.reasoning_tokens()
    }

    /// Whether the answer made tool calls.
    pub fn has_calls(&self) -> bool {
        !self.calls.is_empty()
    }

    /// One worker event (choice 0 only); returns the changes and, for the last event, the end.
    pub fn event(&mut self, ev: GenerateEvent) -> (Vec<Change>, Option<End>) {
        match ev {
            GenerateEvent::Token { index: 0, text, .. } => {
                let deltas = self.reader.push_token(&text);
                (self.apply(deltas), None)
            }
            GenerateEvent::Token { .. } | GenerateEvent::Finish { .. } => (Vec::new(), None),
            GenerateEvent::Done {
                finish_reason, usage, ..
            } => {
                let deltas = self.reader.finish();
                let mut changes = self.apply(deltas);
                changes.extend(self.close());
                (
                    changes,
                    Some(End::Finished {
                        reason: finish_reason,
                        usage,
                    }),
                )
            }
            GenerateEvent::Error { code, message } => {
                let changes = self.close();
                (changes, Some(End::Failed { code, message }))
            }
        }
    }

    fn close(&mut self) -> Vec<Change> {
        match self.open.take() {
            Some(i) => {
                self.parts[i].done = true;
                vec![Change::Close(i)]
            }
            None => Vec::new(),
        }
    }

    fn open_part(&mut self, kind: Kind, call_id: String, name: String) -> Vec<Change> {
        let mut out = self.close();
        let i = self.parts.len();
        let tag = match kind {
            Kind::Reasoning => "rs",
            Kind::Text => "msg",
            Kind::Call => "fc",
        };
        self.parts.push(Part {
            kind,
            id: format!("{tag}_{}{i:02}", self.prefix),
            call_id,
            name,
            text: String::new(),
            done: false,
        });
        self.open = Some(i);
        out.push(Change::Open(i));
        out
    }

    fn append(&mut self, kind: Kind, text: String) -> Vec<Change> {
        let mut out = Vec::new();
        let current = self.open.filter(|&i| self.parts[i].kind == kind);
        let i = match current {
            Some(i) => i,
            None => {
                out.extend(self.open_part(kind, String::new(), String::new()));
                self.parts.len() - 1
            }
        };
        self.parts[i].text.push_str(&text);
        out.push(Change::Append(i, text));
        out
    }

    fn apply(&mut self, deltas: Vec<Delta>) -> Vec<Change> {
        let mut out = Vec::new();
        for d in deltas {
            match d {
                Delta::Reasoning(t) if !t.is_empty() => out.extend(self.append(Kind::Reasoning, t)),
                // Whitespace around calls is the format's, not an answer.
                Delta::Content(t)
                    if !t.trim().is_empty()
                        || (!t.is_empty() && self.open.is_some_and(|i| self.parts[i].kind == Kind::Text)) =>
                {
                    out.extend(self.append(Kind::Text, t))
                }
                Delta::Reasoning(_) | Delta::Content(_) => {}
                Delta::CallStart { index, id, name } => {
                    out.extend(self.open_part(Kind::Call, id, name));
                    if self.calls.len() <= index {
                        self.calls.resize(index + 1, usize::MAX);
                    }
                    self.calls[index] = self.parts.len() - 1;
                }
                Delta::Arguments { index, text } => {
                    let open = self
                        .calls
                        .get(index)
                        .copied()
                        .filter(|&i| i != usize::MAX && !self.parts[i].done);
                    if let Some(i) = open {
                        self.parts[i].text.push_str(&text);
                        out.push(Change::Append(i, text));
                    }
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hearth_protocol::output::{ToolDef, ToolFormat};

    fn token(text: &str) -> GenerateEvent {
        GenerateEvent::Token {
            index: 0,
            id: 1,
            text: text.into(),
            logprob: None,
            top_logprobs: Vec::new(),
        }
    }

    #[test]
    fn parts_follow_the_answer_and_close_in_order() {
        let spec = OutputSpec {
            tools: Some((
                ToolFormat::Hearth,
                vec![ToolDef {
                    name: "get_weather".into(),
                    description: None,
                    parameters: serde_json::json!({"type": "object"}),
                }]
                .into(),
            )),
            reasoning: None,
        };
        let mut a = Answer::new(&spec, "x");
        let mut changes = Vec::new();
        for t in [
            "Let me check.",
            "\n<tool_call>\n{\"name\": \"get_weather\", ",
            "\"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
        ] {
            changes.extend(a.event(token(t)).0);
        }
        let (c, end) = a.event(GenerateEvent::Done {
            finish_reason: FinishReason::Stop,
            usage: Usage::default(),
            timings: Default::default(),
        });
        changes.extend(c);
        assert!(matches!(end, Some(End::Finished { .. })));
        assert_eq!(a.parts.len(), 2, "{:?}", a.parts);
        assert_eq!(a.parts[0].kind, Kind::Text);
        assert_eq!(a.parts[0].text.trim(), "Let me check.");
        assert_eq!(a.parts[1].kind, Kind::Call);
        assert_eq!(a.parts[1].name, "get_weather");
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(&a.parts[1].text).unwrap(),
            serde_json::json!({"city": "Paris"})
        );
        assert!(a.parts.iter().all(|p| p.done));
        assert_eq!(changes.first(), Some(&Change::Open(0)));
        assert_eq!(changes.last(), Some(&Change::Close(1)));
        let opened = changes.iter().filter(|c| matches!(c, Change::Open(_))).count();
        let closed = changes.iter().filter(|c| matches!(c, Change::Close(_))).count();
        assert_eq!((opened, closed), (2, 2));
        assert!(a.has_calls());
    }
}

//! Reasoning formats: the markers a reasoning model writes its thinking between, taken out of
//! the answer as it streams (vLLM's and DeepSeek's `reasoning_content`).
//!
//! | format | markers | families |
//! |---|---|---|
//! | `think` | `<think>` … `</think>` | Qwen3, QwQ, DeepSeek-R1, Kimi-K2-Thinking, SmolLM3, … |
//! | `mistral_think` | `[THINK]` … `[/THINK]` | Magistral, Ministral reasoning |
//!
//! The reasoning is the text between the markers when the answer opens with the opening one,
//! or from the start when the prompt already opened it (DeepSeek-R1's template ends with
//! `<think>\n`); a thinking block cut off by `max_tokens` is all reasoning. Whitespace at
//! the reasoning's ends and before the answer is dropped.

use serde::Serialize;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ReasoningFormat {
    Think,
    MistralThink,
}

impl ReasoningFormat {
    pub fn name(self) -> &'static str {
        match self {
            ReasoningFormat::Think => "think",
            ReasoningFormat::MistralThink => "mistral_think",
        }
    }

    /// (open, close).
    pub fn markers(self) -> (&'static str, &'static str) {
        match self {
            ReasoningFormat::Think => ("<think>", "</think>"),
            ReasoningFormat::MistralThink => ("[THINK]", "[/THINK]"),
        }
    }

    /// The format a chat template's reasoning history uses, if any.
    pub fn detect(template: Option<&str>) -> Option<Self> {
        let t = template?;
        if t.contains("[THINK]") {
            Some(ReasoningFormat::MistralThink)
        } else if t.contains("<think>") || t.contains("</think>") {
            Some(ReasoningFormat::Think)
        } else {
            None
        }
    }

    /// Whether a rendered prompt leaves the model inside a thinking block: the generation
    /// prompt ends with the opening marker (a marker a user wrote earlier does not count).
    pub fn prompt_opens(self, prompt: &str) -> bool {
        prompt.trim_end().ends_with(self.markers().0)
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum State {
    /// Before anything but whitespace: the opening marker may come.
    Start,
    Reasoning,
    Answer,
}

/// One piece of a streamed answer.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    Reasoning(String),
    Answer(String),
}

/// Splits an answer into reasoning and the rest as it arrives.
#[derive(Debug)]
pub struct ReasoningSplit {
    format: ReasoningFormat,
    state: State,
    buf: String,
    /// Whitespace at the end of the reasoning so far, sent only if more reasoning follows.
    pending_ws: String,
    /// Nothing of the reasoning sent yet (its leading whitespace is dropped).
    reasoning_started: bool,
    /// Just after the closing marker: the answer's leading whitespace is dropped.
    strip_answer_ws: bool,
}

impl ReasoningSplit {
    /// `inside`: the prompt already opened a thinking block.
    pub fn new(format: ReasoningFormat, inside: bool) -> Self {
        Self {
            format,
            state: if inside { State::Reasoning } else { State::Start },
            buf: String::new(),
            pending_ws: String::new(),
            reasoning_started: false,
            strip_answer_ws: false,
        }
    }

    /// Whether the thinking block is open now.
    pub fn thinking(&self) -> bool {
        self.state == State::Reasoning
    }

    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        self.run(false, &mut out);
        out
    }

    pub fn finish(&mut self) -> Vec<Piece> {
        let mut out = Vec::new();
        self.run(true, &mut out);
        out
    }

    fn run(&mut self, at_end: bool, out: &mut Vec<Piece>) {
        let (open, close) = self.format.markers();
        loop {
            match self.state {
                State::Start => {
                    let t = self.buf.trim_start();
                    if t.starts_with(open) {
                        let skip = self.buf.len() - t.len() + open.len();
                        self.buf.drain(..skip);
                        self.state = State::Reasoning;
                    } else if !at_end && open.starts_with(t) {
                        return; // nothing but whitespace and a part of the marker yet
                    } else {
                        self.state = State::Answer;
                    }
                }
                State::Reasoning => match self.buf.find(close) {
                    Some(p) => {
                        let r: String = self.buf.drain(..p).collect();
                        self.reasoning(&r, out);
                        self.buf.drain(..close.len());
                        self.pending_ws.clear();
                        self.state = State::Answer;
                        self.strip_answer_ws = true;
                    }
                    None => {
                        let hold = if at_end {
                            0
                        } else {
                            super::held_back(&self.buf, &[close])
                        };
                        let r: String = self.buf.drain(..self.buf.len() - hold).collect();
                        self.reasoning(&r, out);
                        return;
                    }
                },
                State::Answer => {
                    if self.strip_answer_ws {
                        let t = self.buf.trim_start().len();
                        self.buf.drain(..self.buf.len() - t);
                        if self.buf.is_empty() {
                            return;
                        }
                        self.strip_answer_ws = false;
                    }
                    if !self.buf.is_empty() {
                        out.push(Piece::Answer(std::mem::take(&mut self.buf)));
                    }
                    return;
                }
            }
        }
    }

    /// Reasoning text, less whitespace at its start and (held back until more follows) at
    /// its end.
    fn reasoning(&mut self, text: &str, out: &mut Vec<Piece>) {
        let mut text = text;
        if !self.reasoning_started {
            text = text.trim_start();
            if text.is_empty() {
                return;
            }
            self.reasoning_started = true;
        }
        if let Some(body) = super::with_pending(&mut self.pending_ws, text) {
            out.push(Piece::Reasoning(body));
        }
    }
}

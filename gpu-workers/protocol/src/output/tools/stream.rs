//! The driver: one region parser per format behind [`ToolStream`], fed as the answer streams
//! (or all at once).

use super::super::{held_back, with_pending, Delta};
use super::scan::Region;
use super::{collect, ParsedCall, ToolDef, ToolFormat};

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

//! The scanning every format's region parser shares: a call read so far, a region's outcome,
//! literals and JSON calls at a position, and the section/call/delimiter layout of the
//! DeepSeek and Kimi formats.

use super::super::json_scan::{call_object, skip_ws, value_end};

/// A call read so far.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct PartCall {
    pub(super) name: String,
    /// The model's own id, if it wrote one.
    pub(super) id: Option<String>,
    /// The arguments as JSON text, as far as they go.
    pub(super) args: String,
}

/// What a region turned out to be. `end: None`: not known yet (at the answer's end, the
/// region runs to it).
#[derive(Debug, PartialEq)]
pub(super) enum Region {
    /// Calls, and where the region ends.
    Calls { calls: Vec<PartCall>, end: Option<usize> },
    /// Not calls: text up to `end` (what follows is read again, as any other text).
    Text { end: Option<usize> },
}

impl Region {
    pub(super) fn wait(calls: Vec<PartCall>) -> Self {
        if calls.is_empty() {
            Region::Text { end: None }
        } else {
            Region::Calls { calls, end: None }
        }
    }
}

/// `lit` at `text[i..]`.
pub(super) enum Literal {
    Found(usize),
    /// The text ends inside it.
    Partial,
    Absent,
}

pub(super) fn literal_at(text: &str, i: usize, lit: &str) -> Literal {
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
pub(super) enum JsonCall {
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

pub(super) fn json_call(text: &str, i: usize, arg_keys: &[&str]) -> JsonCall {
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
pub(super) fn json_args(
    name: &str,
    id: Option<String>,
    text: &str,
    a: usize,
) -> (PartCall, Result<Option<usize>, usize>) {
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

/// One call of a section, as read so far.
pub(super) enum SectionCall {
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
pub(super) fn section(
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
pub(super) fn delimiter(text: &str, from: usize, lit: &str) -> Result<Option<usize>, usize> {
    let j = skip_ws(text, from);
    match literal_at(text, j, lit) {
        Literal::Found(e) => Ok(Some(e)),
        Literal::Partial => Ok(None),
        Literal::Absent => Err(j),
    }
}

/// Text before `lit` in `text[from..]`: its end, or (not yet there) whether to wait for it
/// (a name is short: past 256 bytes it is not coming).
pub(super) fn up_to(text: &str, from: usize, lit: &str) -> Result<usize, SectionCall> {
    match text[from..].find(lit) {
        Some(p) => Ok(from + p),
        None if text.len() - from < 256 => Err(SectionCall::Wait),
        None => Err(SectionCall::NotCall),
    }
}

/// A call's JSON arguments at `text[a..]`, then its closing delimiters, in order.
pub(super) fn section_call(name: &str, id: Option<String>, text: &str, a: usize, closers: &[&str]) -> SectionCall {
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

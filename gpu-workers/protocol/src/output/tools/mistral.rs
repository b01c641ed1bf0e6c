//! `mistral` (`[TOOL_CALLS]` and a JSON array) and `mistral_args`
//! (`[TOOL_CALLS]name[CALL_ID]id[ARGS]{…}`).

use super::super::json_scan::skip_ws;
use super::scan::{json_args, json_call, literal_at, JsonCall, Literal, Region};
use super::{MISTRAL_ARGS, MISTRAL_CALLS, MISTRAL_CALL_ID};

pub(super) fn mistral_json(text: &str) -> Region {
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

pub(super) fn mistral_args(text: &str) -> Region {
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

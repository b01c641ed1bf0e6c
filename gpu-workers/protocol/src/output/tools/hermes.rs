//! `hermes` (and Hearth's own): `<tool_call>` blocks of JSON.

use super::super::json_scan::skip_ws;
use super::scan::{json_call, literal_at, JsonCall, Literal, Region};
use super::{HERMES_CLOSE, HERMES_OPEN};

/// Whether a template writes `<tool_call>` blocks of JSON (`{"name": …` soon after the tag),
/// as opposed to other formats that share the tag (GLM's `<tool_call>name<arg_key>…`,
/// Apriel's `<tool_calls>[…]`).
pub(super) fn hermes_json_blocks(t: &str) -> bool {
    if t.contains("<arg_key>") || t.contains("<tool_calls>") {
        return false;
    }
    t.match_indices(HERMES_OPEN).any(|(i, _)| {
        let after = &t[i + HERMES_OPEN.len()..];
        let window = &after[..after.char_indices().nth(200).map_or(after.len(), |(j, _)| j)];
        window.contains("{\"name\"") || window.contains("{\\\"name\\\"")
    })
}

pub(super) fn hermes(text: &str) -> Region {
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

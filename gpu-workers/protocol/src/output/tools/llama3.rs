//! `llama3_json`: a JSON call as the whole answer, or after `<|python_tag|>`.

use super::super::json_scan::skip_ws;
use super::scan::{json_call, literal_at, JsonCall, Literal, PartCall, Region};
use super::PYTHON_TAG;

pub(super) fn llama3(text: &str) -> Region {
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

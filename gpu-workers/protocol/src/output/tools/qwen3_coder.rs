//! `qwen3_coder`: `<function=name>` blocks of `<parameter=k>` values, typed by the tool's
//! schema.

use super::super::json_scan::skip_ws;
use super::scan::{delimiter, literal_at, Literal, PartCall, Region};
use super::{ToolDef, HERMES_CLOSE, HERMES_OPEN};
use serde_json::Value;

/// A Qwen3-Coder parameter's value as JSON: by the tool's schema (a string property stays
/// text); otherwise JSON when it parses as JSON, else text.
fn coder_value(tool: Option<&ToolDef>, key: &str, raw: &str) -> String {
    let ty = tool
        .and_then(|t| t.parameters.get("properties"))
        .and_then(|p| p.get(key))
        .and_then(|p| p.get("type"))
        .and_then(Value::as_str);
    if ty != Some("string") {
        if let Ok(v) = serde_json::from_str::<Value>(raw) {
            if ty.is_some() || !v.is_string() {
                return crate::layout_json(&v);
            }
        }
    }
    crate::layout_json(&Value::String(raw.to_string()))
}

pub(super) fn qwen3_coder(text: &str, tools: &[ToolDef]) -> Region {
    let marker = HERMES_OPEN.len();
    let i = skip_ws(text, marker);
    if i >= text.len() {
        return Region::Text { end: None };
    }
    let f_at = match literal_at(text, i, "<function=") {
        Literal::Found(e) => e,
        Literal::Partial => return Region::Text { end: None },
        Literal::Absent => return Region::Text { end: Some(marker) },
    };
    let gt = match text[f_at..].find('>') {
        Some(g) => f_at + g,
        None if text.len() - f_at < 256 => return Region::Text { end: None },
        None => return Region::Text { end: Some(marker) },
    };
    let name = text[f_at..gt].trim();
    if name.is_empty() || name.contains('<') || name.contains('\n') {
        return Region::Text { end: Some(marker) };
    }
    let tool = tools.iter().find(|t| t.name == name);
    let mut call = PartCall {
        name: name.to_string(),
        id: None,
        args: String::from("{"),
    };
    let mut first = true;
    let mut j = gt + 1;
    loop {
        j = skip_ws(text, j);
        if j >= text.len() {
            return Region::wait(vec![call]);
        }
        match literal_at(text, j, "</function>") {
            Literal::Found(e) => {
                call.args.push('}');
                let end = match delimiter(text, e, HERMES_CLOSE) {
                    Ok(None) => return Region::wait(vec![call]),
                    Ok(Some(end)) => end,
                    Err(_) => e,
                };
                return Region::Calls {
                    calls: vec![call],
                    end: Some(end),
                };
            }
            Literal::Partial => return Region::wait(vec![call]),
            Literal::Absent => {}
        }
        let p_at = match literal_at(text, j, "<parameter=") {
            Literal::Found(e) => e,
            Literal::Partial => return Region::wait(vec![call]),
            Literal::Absent => {
                // Not the format after all, past the name: the call ends here.
                call.args.push('}');
                return Region::Calls {
                    calls: vec![call],
                    end: Some(j),
                };
            }
        };
        let Some(gt) = text[p_at..].find('>') else {
            return Region::wait(vec![call]);
        };
        let key = text[p_at..p_at + gt].trim();
        let v_at = p_at + gt + 1;
        let Some(close) = text[v_at..].find("</parameter>") else {
            return Region::wait(vec![call]);
        };
        let raw = &text[v_at..v_at + close];
        let raw = raw.strip_prefix('\n').unwrap_or(raw);
        let raw = raw.strip_suffix('\n').unwrap_or(raw);
        if !first {
            call.args.push_str(", ");
        }
        first = false;
        call.args.push_str(&crate::layout_json(&Value::String(key.to_string())));
        call.args.push_str(": ");
        call.args.push_str(&coder_value(tool, key, raw));
        j = v_at + close + "</parameter>".len();
    }
}

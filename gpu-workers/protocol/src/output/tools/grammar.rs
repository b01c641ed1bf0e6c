//! The grammar that makes the model write calls of the offered tools in its format.

use super::{
    ToolDef, ToolFormat, DS_CALLS_BEGIN, DS_CALLS_END, DS_CALL_BEGIN, DS_CALL_END, DS_SEP, HERMES_CLOSE, HERMES_OPEN,
    KIMI_ARGS_BEGIN, KIMI_CALL_BEGIN, KIMI_CALL_END, KIMI_SECTION_BEGIN, KIMI_SECTION_END, MAX_PARALLEL_CALLS,
    MISTRAL_ARGS, MISTRAL_CALLS,
};
use serde_json::{json, Value};

/// Grammars: the answer is one or more calls of the offered tools in the format, their
/// arguments valid for each tool's schema. `token`: the id of a delimiter the vocabulary
/// has as a special token (written `<[id]>`, since it cannot be spelled as text).
pub fn grammar(format: ToolFormat, tools: &[ToolDef], parallel: bool, token: &dyn Fn(&str) -> Option<u32>) -> String {
    let lit = |s: &str| match token(s) {
        Some(id) => format!("<[{id}]>"),
        None => serde_json::to_string(s).unwrap_or_default(),
    };
    let args = |t: &ToolDef| format!("%json {}", with_layout(&t.parameters));
    let max = if parallel { MAX_PARALLEL_CALLS } else { 1 };
    // "item (sep item (sep item)?)?": one to `max`.
    let repeat = |item: &str, sep: &str| {
        let mut s = item.to_string();
        let mut tail = String::new();
        for _ in 1..max {
            s.push_str(&format!(" ({sep} {item}"));
            tail.push(')');
            tail.push('?');
        }
        s + &tail
    };
    let mut rules = Vec::new();
    let alts: Vec<String> = tools.iter().enumerate().map(|(k, _)| format!("call{k}")).collect();
    let call = alts.join(" | ");
    let name = |t: &ToolDef| serde_json::to_string(&t.name).unwrap_or_default();
    // `{"name": <the tool>, "<args key>": <its arguments>}` for each tool.
    let json_call_rules = |args_key: &str, rules: &mut Vec<String>| {
        for (k, t) in tools.iter().enumerate() {
            let obj = json!({
                "type": "object",
                "properties": {"name": {"const": t.name}, args_key: with_layout(&t.parameters)},
                "required": ["name", args_key],
                "additionalProperties": false,
                "x-guidance": crate::json_layout(),
            });
            rules.push(format!("call{k}: %json {obj}"));
        }
    };
    let start = match format {
        ToolFormat::Hearth | ToolFormat::Hermes => {
            json_call_rules("arguments", &mut rules);
            let block = format!("{} \"\\n\" call \"\\n\" {}", lit(HERMES_OPEN), lit(HERMES_CLOSE));
            rules.push(format!("block: {block}"));
            repeat("block", "\"\\n\"")
        }
        ToolFormat::Llama3Json => {
            json_call_rules("parameters", &mut rules);
            repeat("call", "\"; \"")
        }
        ToolFormat::Mistral => {
            json_call_rules("arguments", &mut rules);
            format!("{} \"[\" {} \"]\"", lit(MISTRAL_CALLS), repeat("call", "\", \""))
        }
        ToolFormat::MistralArgs => {
            for (k, t) in tools.iter().enumerate() {
                rules.push(format!("call{k}: {} {} {}", name(t), lit(MISTRAL_ARGS), args(t)));
            }
            rules.push(format!("block: {} call", lit(MISTRAL_CALLS)));
            repeat("block", "\"\"")
        }
        ToolFormat::DeepseekV3 | ToolFormat::DeepseekV31 => {
            for (k, t) in tools.iter().enumerate() {
                rules.push(if format == ToolFormat::DeepseekV3 {
                    format!(
                        "call{k}: {} \"function\" {} {} \"\\n```json\\n\" {} \"\\n```\" {}",
                        lit(DS_CALL_BEGIN),
                        lit(DS_SEP),
                        name(t),
                        args(t),
                        lit(DS_CALL_END)
                    )
                } else {
                    format!(
                        "call{k}: {} {} {} {} {}",
                        lit(DS_CALL_BEGIN),
                        name(t),
                        lit(DS_SEP),
                        args(t),
                        lit(DS_CALL_END)
                    )
                });
            }
            let sep = if format == ToolFormat::DeepseekV3 {
                "\"\\n\""
            } else {
                "\"\""
            };
            format!("{} {} {}", lit(DS_CALLS_BEGIN), repeat("call", sep), lit(DS_CALLS_END))
        }
        ToolFormat::KimiK2 => {
            for (k, t) in tools.iter().enumerate() {
                let fname = serde_json::to_string(&format!("functions.{}:", t.name)).unwrap_or_default();
                rules.push(format!(
                    "call{k}: {} {fname} /[0-9]/ {} {} {}",
                    lit(KIMI_CALL_BEGIN),
                    lit(KIMI_ARGS_BEGIN),
                    args(t),
                    lit(KIMI_CALL_END)
                ));
            }
            format!(
                "{} {} {}",
                lit(KIMI_SECTION_BEGIN),
                repeat("call", "\"\""),
                lit(KIMI_SECTION_END)
            )
        }
        ToolFormat::Qwen3Coder => {
            for (k, t) in tools.iter().enumerate() {
                let props = t.parameters.get("properties").and_then(Value::as_object);
                let mut params = Vec::new();
                for (p, (key, schema)) in props.into_iter().flatten().enumerate() {
                    let value = if schema.get("type").and_then(Value::as_str) == Some("string") {
                        // Text up to the closing tag.
                        "/[^<]+/".to_string()
                    } else {
                        format!("%json {}", with_layout(schema))
                    };
                    let open = serde_json::to_string(&format!("<parameter={key}>\n")).unwrap_or_default();
                    rules.push(format!("p{k}_{p}: {open} {value} \"\\n</parameter>\\n\""));
                    params.push(format!("p{k}_{p}"));
                }
                // In the schema's order: required parameters always, the others optional.
                let required: Vec<&str> = t
                    .parameters
                    .get("required")
                    .and_then(Value::as_array)
                    .map(|r| r.iter().filter_map(Value::as_str).collect())
                    .unwrap_or_default();
                let body = props
                    .into_iter()
                    .flatten()
                    .zip(&params)
                    .map(|((key, _), rule)| {
                        if required.contains(&key.as_str()) {
                            rule.clone()
                        } else {
                            format!("{rule}?")
                        }
                    })
                    .collect::<Vec<_>>()
                    .join(" ");
                let open = serde_json::to_string(&format!("<function={}>\n", t.name)).unwrap_or_default();
                rules.push(format!(
                    "call{k}: {} \"\\n\" {open} {body} \"</function>\\n\" {}",
                    lit(HERMES_OPEN),
                    lit(HERMES_CLOSE)
                ));
            }
            repeat("call", "\"\\n\"")
        }
    };
    let mut g = format!("start: {start}\ncall: {call}\n");
    for r in rules {
        g.push_str(&r);
        g.push('\n');
    }
    g
}

fn with_layout(schema: &Value) -> Value {
    let mut s = schema.clone();
    if let Some(o) = s.as_object_mut() {
        o.insert("x-guidance".into(), crate::json_layout());
    }
    s
}

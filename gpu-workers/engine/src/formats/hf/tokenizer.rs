//! `tokenizer.json` and `tokenizer_config.json` as GGUF tokenizer metadata: the vocabulary,
//! merges and added tokens, and the pre-tokenizer or SentencePiece variant Hearth recognises
//! (anything else refused by name).

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use serde_json::Value;

use crate::formats::gguf::MetaValue;
use crate::formats::hf::error::{invalid, read_json, HfError};

/// A token in `tokenizer_config.json`: a string or `{"content": …}`.
fn token_text(v: Option<&Value>) -> Option<&str> {
    match v? {
        Value::String(s) => Some(s),
        Value::Object(o) => o.get("content")?.as_str(),
        _ => None,
    }
}

/// `tokenizer.json` (+ `tokenizer_config.json`) → GGUF `tokenizer.ggml.*` metadata.
pub(super) fn tokenizer_metadata(dir: &Path, meta: &mut HashMap<String, MetaValue>) -> Result<(), HfError> {
    let path = dir.join("tokenizer.json");
    let tj = read_json(&path)?;
    let unsupported = |what: String| HfError::Unsupported(format!("{}: {what}", path.display()));
    let model = tj.get("model").ok_or_else(|| invalid(&path, "no model"))?;
    let ty = model.get("type").and_then(Value::as_str).unwrap_or("");
    if ty != "BPE" {
        return Err(unsupported(format!(
            "tokenizer model {ty:?} is not supported (Hearth runs BPE: byte-level, or SentencePiece-style with byte fallback)"
        )));
    }
    let byte_fallback = model.get("byte_fallback").and_then(Value::as_bool).unwrap_or(false);
    for (key, ok) in [
        ("continuing_subword_prefix", Value::Null),
        ("end_of_word_suffix", Value::Null),
        ("dropout", Value::Null),
    ]
    .into_iter()
    .chain((!byte_fallback).then_some(("unk_token", Value::Null)))
    {
        if let Some(v) = model.get(key) {
            if *v != ok && !(v.is_string() && v.as_str() == Some("")) {
                return Err(unsupported(format!("BPE option {key} = {v} is not supported")));
            }
        }
    }
    let normalizer = tj.get("normalizer").unwrap_or(&Value::Null);
    let pre_tokenizer = tj.get("pre_tokenizer").unwrap_or(&Value::Null);
    let (kind, pre): (&str, String) = if byte_fallback {
        // SentencePiece as tokenizer.json writes it: BPE over `▁`-text with byte fallback.
        let variant = spm_variant(normalizer, pre_tokenizer).ok_or_else(|| {
            unsupported(format!(
                "byte-fallback BPE with normalizer {normalizer} and pre-tokenizer {pre_tokenizer} is not a SentencePiece layout Hearth reproduces (Prepend + Replace, Replace, or Metaspace)"
            ))
        })?;
        ("spm-bpe", variant)
    } else {
        if !normalizer.is_null() {
            return Err(unsupported("a normalizer is not supported with byte-level BPE".into()));
        }
        let pre = pre_tokenizer_name(pre_tokenizer).ok_or_else(|| {
            unsupported(format!(
                "pre-tokenizer {} is not one Hearth reproduces (byte-level BPE with the patterns of {})",
                pre_tokenizer,
                hearth_protocol::tokenizer::supported_pre()
            ))
        })?;
        ("gpt2", pre.to_string())
    };
    let wants_ignore =
        hearth_protocol::tokenizer::pretokenize::lookup(&pre).is_some_and(|d| d.ignore_merges && kind == "gpt2");
    if model.get("ignore_merges").and_then(Value::as_bool).unwrap_or(false) != wants_ignore {
        return Err(unsupported(format!(
            "BPE option ignore_merges = {} is not what the {pre} pre-tokenizer's models use",
            !wants_ignore
        )));
    }
    let unk = model
        .get("unk_token")
        .and_then(Value::as_str)
        .filter(|u| !u.is_empty())
        .map(str::to_string);
    let vocab = model
        .get("vocab")
        .and_then(Value::as_object)
        .ok_or_else(|| invalid(&path, "model.vocab is not an object"))?;
    // id → (text, GGUF token type): 1 normal, 3 control (special), 4 user-defined.
    let mut by_id: BTreeMap<u64, (String, i64)> = BTreeMap::new();
    let (mut lstrip, mut rstrip) = (Vec::new(), Vec::new());
    for (tok, id) in vocab {
        let id = id
            .as_u64()
            .ok_or_else(|| invalid(&path, format!("vocab[{tok:?}] is not an id")))?;
        // With byte fallback, `<0xXX>` pieces are bytes and the unknown token is unknown.
        use hearth_protocol::tokenizer::{parse_byte_token, TOKEN_TYPE_BYTE, TOKEN_TYPE_NORMAL, TOKEN_TYPE_UNKNOWN};
        let ty = if byte_fallback && parse_byte_token(tok).is_some() {
            TOKEN_TYPE_BYTE
        } else if unk.as_deref() == Some(tok.as_str()) {
            TOKEN_TYPE_UNKNOWN
        } else {
            TOKEN_TYPE_NORMAL
        };
        by_id.insert(id, (tok.clone(), ty as i64));
    }
    for a in tj.get("added_tokens").and_then(Value::as_array).into_iter().flatten() {
        let (Some(id), Some(content)) = (
            a.get("id").and_then(Value::as_u64),
            a.get("content").and_then(Value::as_str),
        ) else {
            return Err(invalid(&path, "an added token lacks id or content"));
        };
        if a.get("single_word").and_then(Value::as_bool) == Some(true) {
            return Err(unsupported(format!(
                "added token {content:?} has single_word, which is not supported"
            )));
        }
        for (flag, list) in [("lstrip", &mut lstrip), ("rstrip", &mut rstrip)] {
            if a.get(flag).and_then(Value::as_bool) == Some(true) {
                list.push(MetaValue::I64(id as i64));
            }
        }
        let special = a.get("special").and_then(Value::as_bool).unwrap_or(false);
        by_id.insert(id, (content.to_string(), if special { 3 } else { 4 }));
    }
    let n = by_id.len() as u64;
    if by_id.keys().next_back().is_some_and(|&last| last + 1 != n) {
        return Err(invalid(&path, "token ids are not contiguous from 0"));
    }
    let merges = model
        .get("merges")
        .and_then(Value::as_array)
        .ok_or_else(|| invalid(&path, "model.merges is not a list"))?
        .iter()
        .map(|m| match m {
            Value::String(s) => Some(s.clone()),
            Value::Array(p) if p.len() == 2 => Some(format!("{} {}", p[0].as_str()?, p[1].as_str()?)),
            _ => None,
        })
        .collect::<Option<Vec<String>>>()
        .ok_or_else(|| invalid(&path, "a merge is neither \"a b\" nor [a, b]"))?;
    let ids: HashMap<&str, u64> = by_id.iter().map(|(id, (t, _))| (t.as_str(), *id)).collect();
    let strs = |v: Vec<String>| MetaValue::Array(v.into_iter().map(MetaValue::String).collect());
    meta.insert("tokenizer.ggml.model".into(), MetaValue::String(kind.into()));
    meta.insert("tokenizer.ggml.pre".into(), MetaValue::String(pre));
    meta.insert(
        "tokenizer.ggml.token_type".into(),
        MetaValue::Array(by_id.values().map(|(_, t)| MetaValue::I64(*t)).collect()),
    );
    meta.insert("tokenizer.ggml.merges".into(), strs(merges));
    meta.insert("tokenizer.hearth.lstrip".into(), MetaValue::Array(lstrip));
    meta.insert("tokenizer.hearth.rstrip".into(), MetaValue::Array(rstrip));
    let cfg_path = dir.join("tokenizer_config.json");
    if cfg_path.exists() {
        let tc = read_json(&cfg_path)?;
        for (key, gkey) in [
            ("bos_token", "tokenizer.ggml.bos_token_id"),
            ("eos_token", "tokenizer.ggml.eos_token_id"),
        ] {
            if let Some(t) = token_text(tc.get(key)) {
                let id = ids
                    .get(t)
                    .ok_or_else(|| invalid(&cfg_path, format!("{key} {t:?} is not in the vocabulary")))?;
                meta.insert(gkey.into(), MetaValue::U64(*id));
            }
        }
        if let Some(b) = tc.get("add_bos_token").and_then(Value::as_bool) {
            meta.insert("tokenizer.ggml.add_bos_token".into(), MetaValue::Bool(b));
        }
        let template = match tc.get("chat_template") {
            Some(Value::String(s)) => Some(s.clone()),
            // A list of named templates: the one called "default".
            Some(Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                .and_then(|t| t.get("template")?.as_str().map(str::to_string)),
            _ => None,
        };
        if let Some(t) = template {
            meta.insert("tokenizer.chat_template".into(), MetaValue::String(t));
        }
    }
    // The post-processor (after tokenizer_config.json: it is what the tokenizer does): none,
    // ByteLevel (offsets only), or a template that puts one special token before a single
    // sequence (BOS, as `add_bos_token`).
    match tj.get("post_processor") {
        None | Some(Value::Null) => {}
        Some(p) if p.get("type").and_then(Value::as_str) == Some("ByteLevel") => {}
        Some(p) if p.get("type").and_then(Value::as_str) == Some("TemplateProcessing") => {
            let single = p.get("single").and_then(Value::as_array).cloned().unwrap_or_default();
            let special = |v: &Value| v.get("SpecialToken")?.get("id")?.as_str().map(str::to_string);
            let is_sequence = |v: &Value| v.get("Sequence").is_some();
            match single.as_slice() {
                [seq] if is_sequence(seq) => {
                    meta.insert("tokenizer.ggml.add_bos_token".into(), MetaValue::Bool(false));
                }
                [bos, seq] if is_sequence(seq) && special(bos).is_some() => {
                    let bos = special(bos).unwrap_or_default();
                    let id = ids.get(bos.as_str()).ok_or_else(|| {
                        invalid(&path, format!("post-processor token {bos:?} is not in the vocabulary"))
                    })?;
                    meta.insert("tokenizer.ggml.bos_token_id".into(), MetaValue::U64(*id));
                    meta.insert("tokenizer.ggml.add_bos_token".into(), MetaValue::Bool(true));
                }
                _ => {
                    return Err(unsupported(
                        "a post-processor template other than [BOS] + sequence is not supported".into(),
                    ))
                }
            }
        }
        Some(p) => {
            return Err(unsupported(format!(
                "post-processor {} is not supported",
                p.get("type").unwrap_or(&Value::Null)
            )))
        }
    }
    meta.insert(
        "tokenizer.ggml.tokens".into(),
        strs(by_id.into_values().map(|(t, _)| t).collect()),
    );
    Ok(())
}

/// The patterns a `tokenizer.json` pre-tokenizer splits by, in order, if it is made only of
/// pieces Hearth runs: `Split` (a regex, `Isolated`), `Digits`, and `ByteLevel` (its GPT-2
/// regex when `use_regex`). None when there is no final byte-level step.
fn pre_tokenizer_patterns(p: &Value) -> Option<Vec<String>> {
    let steps: Vec<&Value> = match p.get("type").and_then(Value::as_str)? {
        "Sequence" => p.get("pretokenizers")?.as_array()?.iter().collect(),
        _ => vec![p],
    };
    let (last, rest) = steps.split_last()?;
    if last.get("type").and_then(Value::as_str) != Some("ByteLevel")
        || last.get("add_prefix_space").and_then(Value::as_bool) == Some(true)
    {
        return None;
    }
    let mut patterns = Vec::new();
    for step in rest {
        match step.get("type").and_then(Value::as_str)? {
            "Split" => {
                let behavior = step.get("behavior").and_then(Value::as_str).unwrap_or("Isolated");
                if behavior != "Isolated" || step.get("invert").and_then(Value::as_bool) == Some(true) {
                    return None;
                }
                patterns.push(step.get("pattern")?.get("Regex")?.as_str()?.to_string());
            }
            "Digits" => patterns.push(
                if step.get("individual_digits").and_then(Value::as_bool) == Some(true) {
                    r"\p{N}"
                } else {
                    r"\p{N}+"
                }
                .to_string(),
            ),
            _ => return None,
        }
    }
    if last.get("use_regex").and_then(Value::as_bool) != Some(false) {
        patterns.push(hearth_protocol::tokenizer::pretokenize::GPT2.to_string());
    }
    Some(patterns)
}

/// The `spm-bpe` variant (see `hearth_protocol::tokenizer::SPM_BPE_VARIANTS`) of a
/// byte-fallback tokenizer.json: `Prepend("▁")` + `Replace(" ", "▁")`, `Replace` alone, or a
/// `Metaspace` pre-tokenizer.
pub(super) fn spm_variant(normalizer: &Value, pre: &Value) -> Option<String> {
    let ty = |v: &Value| v.get("type").and_then(Value::as_str).map(str::to_string);
    let is_replace = |v: &Value| {
        ty(v).as_deref() == Some("Replace")
            && v.get("pattern").and_then(|p| p.get("String")).and_then(Value::as_str) == Some(" ")
            && v.get("content").and_then(Value::as_str) == Some("▁")
    };
    let is_prepend =
        |v: &Value| ty(v).as_deref() == Some("Prepend") && v.get("prepend").and_then(Value::as_str) == Some("▁");
    match (normalizer, pre) {
        (n, Value::Null) if is_replace(n) => Some("never".into()),
        (n, Value::Null) if ty(n).as_deref() == Some("Sequence") => {
            match n.get("normalizers")?.as_array()?.as_slice() {
                [a, b] if is_prepend(a) && is_replace(b) => Some("prepend".into()),
                [a] if is_replace(a) => Some("never".into()),
                _ => None,
            }
        }
        (Value::Null, p) if ty(p).as_deref() == Some("Metaspace") => {
            if p.get("replacement").and_then(Value::as_str).unwrap_or("▁") != "▁" {
                return None;
            }
            let scheme = match p.get("prepend_scheme").and_then(Value::as_str) {
                Some(s @ ("always" | "first" | "never")) => s.to_string(),
                Some(_) => return None,
                None if p.get("add_prefix_space").and_then(Value::as_bool) == Some(false) => "never".into(),
                None => "always".into(),
            };
            let split = p.get("split").and_then(Value::as_bool).unwrap_or(true);
            Some(format!("metaspace-{scheme}{}", if split { "-split" } else { "" }))
        }
        _ => None,
    }
}

/// Hearth's name for a pre-tokenizer it reproduces exactly, if it is one.
pub(super) fn pre_tokenizer_name(p: &Value) -> Option<&'static str> {
    let patterns = pre_tokenizer_patterns(p)?;
    let refs: Vec<&str> = patterns.iter().map(String::as_str).collect();
    hearth_protocol::tokenizer::pretokenize::name_of(&refs)
}

//! Model families' own formats end to end, over HTTP against `hearth serve` on the default
//! model with another family's real chat template (`--chat-template`, from llama.cpp's
//! collection that `scripts/reference-data` fetches): the tools go through that template,
//! a required `tool_choice` is constrained to that family's call format and read back into
//! `tool_calls` (streamed and not), the history renders through the template, and a
//! reasoning model's thinking comes back as `reasoning_content`, never `content`, counted
//! in `usage.completion_tokens_details.reasoning_tokens`. Every request is one usage row.

use std::path::PathBuf;

use crate::harness::*;
use serde_json::{json, Value};

fn template(name: &str) -> PathBuf {
    hearth_testkit::tier::needs(hearth_testkit::tier::Tier::Reference);
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/reference-data");
    let out = std::process::Command::new(&script)
        .output()
        .expect("scripts/reference-data");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
        .join("templates")
        .join(name)
}

fn serve_with(data: &std::path::Path, template_file: &str) -> Proc {
    let t = template(template_file);
    spawn(&[
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--data-dir",
        data.to_str().unwrap(),
        "--chat-template",
        t.to_str().unwrap(),
    ])
}

fn tools() -> Value {
    json!([
        {"type": "function", "function": {
            "name": "get_weather", "description": "Current weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                           "required": ["city"], "additionalProperties": false}}},
        {"type": "function", "function": {
            "name": "get_time", "description": "Local time in a time zone.",
            "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 30}},
                           "required": ["zone"], "additionalProperties": false}}}
    ])
}

fn valid(name: &str, args: &str) -> bool {
    let t = tools();
    let Some(tool) = t.as_array().unwrap().iter().find(|x| x["function"]["name"] == name) else {
        return false;
    };
    serde_json::from_str::<Value>(args).is_ok_and(|a| jsonschema::is_valid(&tool["function"]["parameters"], &a))
}

/// A streamed chat: (content, reasoning, calls as (id, name, arguments), finish, usage).
async fn stream(
    url: &str,
    key: &str,
    mut body: Value,
) -> (String, String, Vec<(String, String, String)>, String, Value) {
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let resp = client().post(url).bearer_auth(key).json(&body).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    let events = sse_events(resp).await;
    let (mut content, mut reasoning, mut calls, mut finish, mut usage) = (
        String::new(),
        String::new(),
        Vec::<(String, String, String)>::new(),
        String::new(),
        Value::Null,
    );
    for e in events.iter().filter(|e| *e != "[DONE]") {
        let c: Value = serde_json::from_str(e).unwrap();
        if !c["usage"].is_null() {
            usage = c["usage"].clone();
        }
        let Some(choice) = c["choices"].get(0) else { continue };
        content += choice["delta"]["content"].as_str().unwrap_or_default();
        reasoning += choice["delta"]["reasoning_content"].as_str().unwrap_or_default();
        for tc in choice["delta"]["tool_calls"].as_array().into_iter().flatten() {
            let i = tc["index"].as_u64().unwrap() as usize;
            if i == calls.len() {
                calls.push((tc["id"].as_str().unwrap().into(), String::new(), String::new()));
            }
            calls[i].1 += tc["function"]["name"].as_str().unwrap_or_default();
            calls[i].2 += tc["function"]["arguments"].as_str().unwrap_or_default();
        }
        if let Some(f) = choice["finish_reason"].as_str() {
            finish = f.into();
        }
    }
    (content, reasoning, calls, finish, usage)
}

/// Required tool calls through `template_file`'s own tool format; `id_ok` checks the ids the
/// family's templates accept.
async fn tool_calls_in_the_family_format(template_file: &str, id_ok: fn(&str) -> bool) {
    let data = temp_dir("formats");
    let server = serve_with(&data, template_file);
    let key = new_key(&data, "formats");
    let url = format!("{}/v1/chat/completions", server.url);
    let ask = json!([{"role": "user", "content": "What's the weather in Oslo?"}]);
    let mut requests = 0;
    for seed in 0..3 {
        let body = json!({"model": MODEL, "messages": ask, "tools": tools(), "tool_choice": "required",
                          "temperature": 1.0, "seed": seed, "max_tokens": 200});
        let (status, _, r) = post(&url, Some(&key), &body).await;
        requests += 1;
        assert_eq!(status, 200, "{r}");
        let choice = &r["choices"][0];
        assert_eq!(
            choice["finish_reason"], "tool_calls",
            "{template_file} seed {seed}: {r}"
        );
        let calls = choice["message"]["tool_calls"].as_array().unwrap();
        assert!(!calls.is_empty(), "{r}");
        for c in calls {
            assert!(id_ok(c["id"].as_str().unwrap()), "{template_file}: id {}", c["id"]);
            assert!(
                valid(
                    c["function"]["name"].as_str().unwrap(),
                    c["function"]["arguments"].as_str().unwrap()
                ),
                "{c}"
            );
        }
        let (_, _, calls, finish, _) = stream(&url, &key, body).await;
        requests += 1;
        assert_eq!(finish, "tool_calls", "{template_file} seed {seed} streamed");
        assert!(!calls.is_empty());
        for (id, name, args) in &calls {
            assert!(id_ok(id), "{template_file}: streamed id {id}");
            assert!(valid(name, args), "{template_file} streamed: {name} {args}");
        }
    }
    // The history through the family's template: the call, its result, then an answer.
    let (status, _, r) = post(
        &url,
        Some(&key),
        &json!({"model": MODEL, "tools": tools(), "max_tokens": 16, "temperature": 0,
                "messages": [ask[0],
                    {"role": "assistant", "content": null, "tool_calls": [{"id": "abcDEF123", "type": "function",
                        "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
                    {"role": "tool", "tool_call_id": "abcDEF123", "content": "{\"temperature\": 4}"}]}),
    )
    .await;
    requests += 1;
    assert_eq!(status, 200, "{r}");
    drop(server);
    assert_eq!(usage_rows(&data).len(), requests, "one usage row per request");
}

#[tokio::test]
async fn qwen_templates_take_the_tools_and_calls_come_back_as_hermes_blocks() {
    tool_calls_in_the_family_format("Qwen-Qwen2.5-7B-Instruct.jinja", |id| id.starts_with("call_")).await;
}

#[tokio::test]
async fn mistral_templates_get_mistral_calls_with_nine_character_ids() {
    tool_calls_in_the_family_format("Mistral-Small-3.2-24B-Instruct-2506.jinja", |id| {
        id.len() == 9 && id.chars().all(|c| c.is_ascii_alphanumeric())
    })
    .await;
}

#[tokio::test]
async fn llama3_templates_get_json_calls() {
    tool_calls_in_the_family_format("meta-llama-Llama-3.1-8B-Instruct.jinja", |id| id.starts_with("call_")).await;
}

#[tokio::test]
async fn a_reasoning_models_thinking_is_reasoning_content_never_content() {
    let data = temp_dir("reasoning");
    // Qwen3.5's template opens the thinking block in the generation prompt: everything the
    // model writes until `</think>` is reasoning (the default model never closes it).
    let server = serve_with(&data, "Qwen3.5-4B.jinja");
    let key = new_key(&data, "reasoning");
    let url = format!("{}/v1/chat/completions", server.url);
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "What is 2+2?"}],
                      "temperature": 0, "max_tokens": 24});
    let (status, _, r) = post(&url, Some(&key), &body).await;
    assert_eq!(status, 200, "{r}");
    let msg = &r["choices"][0]["message"];
    assert!(msg["reasoning_content"].as_str().is_some_and(|s| !s.is_empty()), "{r}");
    assert!(
        msg["content"].as_str().unwrap_or_default().is_empty(),
        "thinking reached content: {r}"
    );
    let usage = &r["usage"];
    assert_eq!(
        usage["completion_tokens_details"]["reasoning_tokens"], usage["completion_tokens"],
        "{usage}"
    );
    let (content, reasoning, _, _, usage) = stream(&url, &key, body.clone()).await;
    assert!(content.is_empty(), "streamed thinking reached content: {content:?}");
    assert_eq!(
        reasoning,
        msg["reasoning_content"].as_str().unwrap(),
        "streamed and whole answers agree"
    );
    assert_eq!(
        usage["completion_tokens_details"]["reasoning_tokens"],
        usage["completion_tokens"]
    );

    // The template's switch through chat_template_kwargs: thinking off closes the block in
    // the prompt, so the answer is content.
    let mut off = body.clone();
    off["chat_template_kwargs"] = json!({"enable_thinking": false});
    let (status, _, r) = post(&url, Some(&key), &off).await;
    assert_eq!(status, 200, "{r}");
    let msg = &r["choices"][0]["message"];
    assert!(msg["reasoning_content"].is_null(), "{r}");
    assert!(msg["content"].as_str().is_some_and(|s| !s.is_empty()), "{r}");
    assert_eq!(r["usage"]["completion_tokens_details"]["reasoning_tokens"], 0);
    drop(server);
    assert_eq!(usage_rows(&data).len(), 3);
}

/// `hearth model inspect` on each of llama.cpp's vocabulary GGUFs: the tokenizer kind and
/// pre-tokenizer Hearth chose, the template's tool-call and reasoning formats, and what it
/// refuses by name.
#[test]
fn inspect_names_each_vocabularys_tokenizer_and_formats() {
    let dir = template("x").parent().unwrap().parent().unwrap().join("vocab");
    for (vocab, kind, pre) in [
        ("llama-bpe", Some("byte-level BPE"), Some("llama-bpe")),
        ("llama-spm", Some("SentencePiece"), None),
        ("qwen2", Some("byte-level BPE"), Some("qwen2")),
        ("qwen35", Some("byte-level BPE"), Some("qwen35")),
        ("phi-3", Some("SentencePiece"), None),
        ("gemma-4", Some("SentencePiece-style BPE"), None),
        ("deepseek-llm", Some("byte-level BPE"), Some("deepseek-llm")),
        ("deepseek-coder", Some("byte-level BPE"), Some("deepseek-coder")),
        ("gpt-2", Some("byte-level BPE"), Some("gpt-2")),
        ("starcoder", Some("byte-level BPE"), Some("starcoder")),
        ("falcon", Some("byte-level BPE"), Some("falcon")),
        ("command-r", Some("byte-level BPE"), Some("command-r")),
        ("refact", Some("byte-level BPE"), Some("refact")),
        ("mpt", Some("byte-level BPE"), Some("mpt")),
        ("bert-bge", None, None),
        ("nomic-bert-moe", None, None),
    ] {
        let path = dir.join(format!("ggml-vocab-{vocab}.gguf"));
        let out = std::process::Command::new(bin())
            .args(["model", "inspect", path.to_str().unwrap(), "--json"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{vocab}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let r: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(r["tokenizer"]["kind"].as_str(), kind, "{vocab}: {r}");
        assert_eq!(r["tokenizer"]["pre_tokenizer"].as_str(), pre, "{vocab}");
        if kind.is_none() {
            assert!(
                r["refused"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|x| x.as_str().unwrap().contains("unsupported tokenizer model")),
                "{vocab}: {r}"
            );
        }
        assert!(r["template"]["tool_format"].is_string(), "{vocab}");
        // The text report says the same.
        let text = std::process::Command::new(bin())
            .args(["model", "inspect", path.to_str().unwrap()])
            .output()
            .unwrap();
        let text = String::from_utf8(text.stdout).unwrap();
        assert!(
            text.contains("tokenizer") && text.contains("tool calls") && text.contains("reasoning"),
            "{text}"
        );
    }
}

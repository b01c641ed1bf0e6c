//! Agent workloads end to end, over HTTP against `hearth serve` and the real default model:
//! tool calls (constrained by `tool_choice: "required"`) and `response_format` json_schema
//! at temperature 1.0 over several seeds, streamed and not — every answer parses and
//! validates against its schema (a JSON Schema validator crate checks); tool history
//! round trips; unsupported schemas and misplaced tools are clear 400s; every request is a
//! usage row. (The schemas bound their strings: a temperature-1.0 string can otherwise run
//! to `max_tokens`, and a cut-off answer is not complete JSON.)

use crate::harness::*;
use serde_json::{json, Value};

fn tools() -> Value {
    json!([
        {"type": "function", "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": {"type": "object",
                "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"], "additionalProperties": false}}},
        {"type": "function", "function": {
            "name": "get_time",
            "description": "Local time in a time zone.",
            "parameters": {"type": "object",
                "properties": {"zone": {"type": "string", "maxLength": 40}, "hours_ahead": {"type": "integer", "minimum": 0, "maximum": 48}},
                "required": ["zone"], "additionalProperties": false}}}
    ])
}

fn person_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "age": {"type": "integer", "minimum": 0, "maximum": 130},
            "email": {"type": "string"},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
            "role": {"enum": ["admin", "user", "guest"]}
        },
        "required": ["name", "age", "role"],
        "additionalProperties": false
    })
}

/// Checks a call's arguments against its tool's schema.
fn call_is_valid(name: &str, arguments: &str) -> bool {
    let tools = tools();
    let Some(tool) = tools.as_array().unwrap().iter().find(|t| t["function"]["name"] == name) else {
        return false;
    };
    serde_json::from_str::<Value>(arguments).is_ok_and(|a| jsonschema::is_valid(&tool["function"]["parameters"], &a))
}

/// A streamed chat's chunks: (content, calls as (id, name, arguments) by index, finish).
async fn stream(url: &str, key: &str, body: Value) -> (String, Vec<(String, String, String)>, String) {
    let mut body = body;
    body["stream"] = json!(true);
    let resp = client().post(url).bearer_auth(key).json(&body).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    let events = sse_events(resp).await;
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let (mut content, mut calls, mut finish) = (String::new(), Vec::<(String, String, String)>::new(), String::new());
    for e in &events[..events.len() - 1] {
        let c: Value = serde_json::from_str(e).unwrap();
        let Some(choice) = c["choices"].get(0) else { continue };
        content += choice["delta"]["content"].as_str().unwrap_or_default();
        for tc in choice["delta"]["tool_calls"].as_array().into_iter().flatten() {
            let i = tc["index"].as_u64().unwrap() as usize;
            if i == calls.len() {
                // A call's first chunk names it.
                assert!(tc["id"].as_str().unwrap().starts_with("call_"), "{tc}");
                assert_eq!(tc["type"], "function");
                calls.push((tc["id"].as_str().unwrap().into(), String::new(), String::new()));
            }
            let slot = &mut calls[i];
            if let Some(n) = tc["function"]["name"].as_str() {
                slot.1 += n;
            }
            slot.2 += tc["function"]["arguments"].as_str().unwrap_or_default();
        }
        if let Some(f) = choice["finish_reason"].as_str() {
            finish = f.into();
        }
    }
    (content, calls, finish)
}

#[tokio::test]
async fn constrained_tool_calls_and_structured_outputs_always_validate() {
    let data = temp_dir("agent");
    let server = serve(&data);
    let key = new_key(&data, "agents");
    let url = format!("{}/v1/chat/completions", server.url);
    let mut requests = 0;
    let ask = json!([{"role": "user", "content": "What's the weather in Oslo, and what time is it there?"}]);

    // Required tool calls at temperature 1.0: always calls of offered tools whose
    // arguments validate; plain and streamed.
    for seed in 0..4 {
        let body = json!({"model": MODEL, "messages": ask, "tools": tools(), "tool_choice": "required",
                          "temperature": 1.0, "seed": seed, "max_tokens": 400});
        let (status, _, r) = post(&url, Some(&key), &body).await;
        requests += 1;
        assert_eq!(status, 200, "{r}");
        let choice = &r["choices"][0];
        assert_eq!(choice["finish_reason"], "tool_calls", "{r}");
        let calls = choice["message"]["tool_calls"].as_array().unwrap();
        assert!(!calls.is_empty() && calls.len() <= 4, "{r}");
        for c in calls {
            assert!(c["id"].as_str().unwrap().starts_with("call_"));
            let f = &c["function"];
            assert!(
                call_is_valid(f["name"].as_str().unwrap(), f["arguments"].as_str().unwrap()),
                "seed {seed}: {c}"
            );
        }

        let (content, calls, finish) = stream(&url, &key, body).await;
        requests += 1;
        assert_eq!(finish, "tool_calls", "seed {seed}: {content:?} {calls:?}");
        assert!(!calls.is_empty(), "seed {seed}");
        for (_, name, args) in &calls {
            assert!(call_is_valid(name, args), "seed {seed} streamed: {name} {args}");
        }
    }

    // A named function: exactly that one.
    let body = json!({"model": MODEL, "messages": ask, "tools": tools(), "temperature": 1.0, "seed": 7,
                      "tool_choice": {"type": "function", "function": {"name": "get_time"}}, "max_tokens": 400});
    let (status, _, r) = post(&url, Some(&key), &body).await;
    requests += 1;
    assert_eq!(status, 200, "{r}");
    let calls = r["choices"][0]["message"]["tool_calls"].as_array().unwrap();
    assert!(calls.iter().all(|c| c["function"]["name"] == "get_time"), "{r}");

    // The round trip: the call and its result in the history, then a text answer.
    let call = &calls[0];
    let history = json!([
        ask[0],
        {"role": "assistant", "content": null, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "{\"zone\": \"Europe/Oslo\", \"time\": \"14:05\"}"}
    ]);
    let body = json!({"model": MODEL, "messages": history, "tools": tools(), "tool_choice": "none",
                      "temperature": 0, "max_tokens": 40});
    let (status, _, r) = post(&url, Some(&key), &body).await;
    requests += 1;
    assert_eq!(status, 200, "{r}");
    assert!(r["choices"][0]["message"]["tool_calls"].is_null(), "{r}");
    assert!(
        !r["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .trim()
            .is_empty(),
        "{r}"
    );
    // A tool message must say which call it answers.
    let bad = json!({"model": MODEL, "messages": [ask[0], {"role": "tool", "content": "x"}]});
    let (status, _, r) = post(&url, Some(&key), &bad).await;
    requests += 1;
    assert_eq!(
        (status, r["error"]["param"].as_str()),
        (400, Some("messages[1].tool_call_id")),
        "{r}"
    );

    // Structured outputs at temperature 1.0, streamed and not: valid JSON for the schema.
    let schema = person_schema();
    for seed in 0..4 {
        let body = json!({"model": MODEL, "temperature": 1.0, "seed": seed, "max_tokens": 200,
            "messages": [{"role": "user", "content": "Invent a user of our website and describe them as JSON."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "strict": true, "schema": schema}}});
        let (status, _, r) = post(&url, Some(&key), &body).await;
        requests += 1;
        assert_eq!(status, 200, "{r}");
        assert_eq!(r["choices"][0]["finish_reason"], "stop", "{r}");
        let text = r["choices"][0]["message"]["content"].as_str().unwrap();
        let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("seed {seed}: {e}: {text}"));
        assert!(jsonschema::is_valid(&schema, &v), "seed {seed}: {text}");

        let (content, calls, finish) = stream(&url, &key, body).await;
        requests += 1;
        assert_eq!((finish.as_str(), calls.len()), ("stop", 0), "seed {seed}: {content}");
        let v: Value = serde_json::from_str(&content).unwrap_or_else(|e| panic!("seed {seed}: {e}: {content}"));
        assert!(jsonschema::is_valid(&schema, &v), "seed {seed} streamed: {content}");
    }
    // json_object: any JSON object.
    let body = json!({"model": MODEL, "temperature": 0, "max_tokens": 300,
        "messages": [{"role": "user", "content": "What is the capital of France? Answer as JSON with one key, \"capital\"."}],
        "response_format": {"type": "json_object"}});
    let (status, _, r) = post(&url, Some(&key), &body).await;
    requests += 1;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["choices"][0]["finish_reason"], "stop", "{r}");
    let text = r["choices"][0]["message"]["content"].as_str().unwrap();
    let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"));
    assert!(v.is_object() && v.to_string().contains("Paris"), "{text}");

    // Refusals: a schema feature the grammar engine lacks is named, not ignored; tools
    // belong to chat; a malformed tool is pointed at.
    let unsupported = json!({"model": MODEL, "messages": ask,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema":
            {"type": "object", "dependentSchemas": {"a": {"required": ["b"]}}}}}});
    let (status, _, r) = post(&url, Some(&key), &unsupported).await;
    requests += 1;
    assert_eq!(
        (status, r["error"]["param"].as_str()),
        (400, Some("response_format")),
        "{r}"
    );
    assert!(
        r["error"]["message"].as_str().unwrap().contains("dependentSchemas"),
        "{r}"
    );
    let on_completions = json!({"model": MODEL, "prompt": "Hi", "tools": tools()});
    let (status, _, r) = post(&format!("{}/v1/completions", server.url), Some(&key), &on_completions).await;
    requests += 1;
    assert_eq!((status, r["error"]["param"].as_str()), (400, Some("tools")), "{r}");
    let malformed =
        json!({"model": MODEL, "messages": ask, "tools": [{"type": "function", "function": {"name": "bad name!"}}]});
    let (status, _, r) = post(&url, Some(&key), &malformed).await;
    requests += 1;
    assert_eq!(
        (status, r["error"]["param"].as_str()),
        (400, Some("tools[0].function.name")),
        "{r}"
    );

    // Speculation is invisible to a greedy answer.
    let body = chat_body(json!({"max_tokens": 24}));
    let mut off = body.clone();
    off["speculative"] = json!(false);
    let (on_status, _, on_r) = post(&url, Some(&key), &body).await;
    let (off_status, _, off_r) = post(&url, Some(&key), &off).await;
    requests += 2;
    assert_eq!((on_status, off_status), (200, 200), "{on_r} {off_r}");
    assert!(on_r["choices"][0]["message"]["content"].is_string(), "{on_r}");
    assert_eq!(
        on_r["choices"][0]["message"]["content"], off_r["choices"][0]["message"]["content"],
        "{on_r} {off_r}"
    );

    // Nothing is lost: every request above is a usage row (refusals included).
    let rows = usage_rows(&data);
    assert_eq!(rows.len(), requests, "{rows:?}");
}

//! OpenTelemetry end to end: a `hearth gateway` and a `hearth worker`, both exporting to a
//! small OTLP/HTTP (JSON) receiver in this test, answer one chat request; the trace must
//! hold the gateway's pipeline phases (with GenAI attributes) and, joined through
//! `traceparent`, the worker's queue/prefill/decode spans.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::harness::*;
use axum::body::Bytes;
use serde_json::{json, Value};

/// Every span the receiver got, flattened: (service, span JSON).
type Received = Arc<Mutex<Vec<(String, Value)>>>;

async fn receiver() -> (String, Received) {
    let got: Received = Arc::default();
    let sink = got.clone();
    let app = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(move |body: Bytes| {
            let sink = sink.clone();
            async move {
                let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                for rs in v["resourceSpans"].as_array().into_iter().flatten() {
                    let service = rs["resource"]["attributes"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .find(|a| a["key"] == "service.name")
                        .and_then(|a| a["value"]["stringValue"].as_str())
                        .unwrap_or("")
                        .to_string();
                    for ss in rs["scopeSpans"].as_array().into_iter().flatten() {
                        for span in ss["spans"].as_array().into_iter().flatten() {
                            sink.lock().unwrap().push((service.clone(), span.clone()));
                        }
                    }
                }
                axum::Json(json!({}))
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, got)
}

fn attr<'a>(span: &'a Value, key: &str) -> Option<&'a Value> {
    span["attributes"]
        .as_array()?
        .iter()
        .find(|a| a["key"] == key)
        .map(|a| &a["value"])
}

#[tokio::test]
async fn one_chat_request_is_one_trace_across_gateway_and_worker() {
    let (otlp, got) = receiver().await;
    let data = temp_dir("otel");
    // Export quickly: the batch processor's delay, in milliseconds.
    let env = [("OTEL_BSP_SCHEDULE_DELAY", "100")];
    let (_worker, gateway) = worker_and_gateway_with(&data, &["--otlp-endpoint", &otlp], &env);
    let key = new_key(&data, "traced");
    let (status, _, body) = post(
        &format!("{}/v1/chat/completions", gateway.url),
        Some(&key),
        &chat_body(json!({"max_tokens": 8})),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let id = body["id"].as_str().unwrap().trim_start_matches("chatcmpl-").to_string();

    let phases = [
        "authenticate",
        "budget",
        "preprocess",
        "parse",
        "resolve",
        "tokenize",
        "limit",
        "dispatch",
        "route",
        "relay",
        "meter",
        "postprocess",
    ];
    let engine = ["worker.generate", "queue", "prefill", "decode"];
    let deadline = Instant::now() + Duration::from_secs(30);
    let spans = loop {
        let spans = got.lock().unwrap().clone();
        let root = spans.iter().find(|(_, s)| {
            attr(s, "gen_ai.response.id").and_then(|v| v["stringValue"].as_str()) == Some(&format!("req_{id}"))
        });
        if let Some((_, root)) = root {
            let trace = root["traceId"].clone();
            let in_trace: Vec<(String, Value)> = spans.into_iter().filter(|(_, s)| s["traceId"] == trace).collect();
            let have = |n: &str| in_trace.iter().any(|(_, s)| s["name"] == n);
            if phases.iter().chain(&engine).all(|n| have(n)) {
                break in_trace;
            }
        }
        assert!(Instant::now() < deadline, "spans so far: {:#?}", got.lock().unwrap());
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let find = |name: &str| {
        spans
            .iter()
            .find(|(_, s)| s["name"] == name)
            .unwrap_or_else(|| panic!("no span {name}"))
    };
    // The root: named after the operation and model, with GenAI attributes.
    let (service, root) = spans
        .iter()
        .find(|(_, s)| attr(s, "gen_ai.operation.name").is_some())
        .expect("the request's root span");
    assert_eq!(service, "hearth-gateway");
    assert_eq!(root["name"], format!("chat {MODEL}"));
    assert_eq!(attr(root, "gen_ai.operation.name").unwrap()["stringValue"], "chat");
    assert_eq!(attr(root, "gen_ai.request.model").unwrap()["stringValue"], MODEL);
    let tokens = |s: &Value, k: &str| attr(s, k).and_then(|v| v["intValue"].as_str().map(str::to_string));
    assert_eq!(
        tokens(root, "gen_ai.usage.input_tokens").as_deref(),
        Some(body["usage"]["prompt_tokens"].to_string().as_str()),
        "{root:#}"
    );
    assert_eq!(tokens(root, "gen_ai.usage.output_tokens").as_deref(), Some("8"));
    // Every phase is a child of the root (route and meter one level further down).
    for p in phases {
        let (_, s) = find(p);
        let parent = match p {
            "route" => find("dispatch").1["spanId"].clone(),
            "meter" => find("relay").1["spanId"].clone(),
            _ => root["spanId"].clone(),
        };
        assert_eq!(s["parentSpanId"], parent, "{p}: {s:#}");
    }
    // The worker's span continues the trace under the dispatch phase, its engine phases
    // under it, in order.
    let (wservice, w) = find("worker.generate");
    assert_eq!(wservice, "hearth-worker");
    assert_eq!(w["parentSpanId"], find("dispatch").1["spanId"]);
    let mut last_end = 0u128;
    for p in ["queue", "prefill", "decode"] {
        let (_, s) = find(p);
        assert_eq!(s["parentSpanId"], w["spanId"], "{p}");
        let t = |k: &str| s[k].as_str().and_then(|v| v.parse::<u128>().ok()).unwrap();
        assert!(
            t("startTimeUnixNano") + 1000 >= last_end,
            "{p} starts before the previous phase ends"
        );
        last_end = t("endTimeUnixNano");
    }
}

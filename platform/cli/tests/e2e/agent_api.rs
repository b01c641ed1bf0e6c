//! The agent APIs' money and limits, through real `hearth` processes on the sim backend (the
//! real scheduler and prefix cache, no maths): the tenants suite's token-limit and
//! hard-budget tests run once per route — chat completions, the Responses API, the Messages
//! API — and every request leaves exactly one usage row whose tokens are the response's.

use std::path::Path;

use crate::harness::*;
use serde_json::{json, Value};

#[derive(Clone, Copy, Debug, PartialEq)]
enum Route {
    Chat,
    Responses,
    Messages,
}

const ROUTES: [Route; 3] = [Route::Chat, Route::Responses, Route::Messages];

impl Route {
    fn path(self) -> &'static str {
        match self {
            Route::Chat => "/v1/chat/completions",
            Route::Responses => "/v1/responses",
            Route::Messages => "/v1/messages",
        }
    }

    /// A request for `max` completion tokens that generates all of them (`ignore_eos`).
    fn body(self, prompt: &str, max: u32) -> Value {
        match self {
            Route::Chat => json!({"model": MODEL, "ignore_eos": true, "max_tokens": max,
                                  "messages": [{"role": "user", "content": prompt}]}),
            Route::Responses => json!({"model": MODEL, "ignore_eos": true, "max_output_tokens": max,
                                       "store": false, "input": prompt}),
            Route::Messages => json!({"model": MODEL, "ignore_eos": true, "max_tokens": max,
                                      "messages": [{"role": "user", "content": prompt}]}),
        }
    }

    /// (prompt, cached, completion) as the response reports them.
    fn usage(self, r: &Value) -> (i64, i64, i64) {
        let n = |v: &Value| v.as_i64().unwrap_or_else(|| panic!("{self:?}: {r}"));
        match self {
            Route::Chat => (
                n(&r["usage"]["prompt_tokens"]),
                n(&r["usage"]["prompt_tokens_details"]["cached_tokens"]),
                n(&r["usage"]["completion_tokens"]),
            ),
            Route::Responses => (
                n(&r["usage"]["input_tokens"]),
                n(&r["usage"]["input_tokens_details"]["cached_tokens"]),
                n(&r["usage"]["output_tokens"]),
            ),
            Route::Messages => {
                let u = &r["usage"];
                assert_eq!(u["cache_creation_input_tokens"], 0, "{r}");
                let cached = n(&u["cache_read_input_tokens"]);
                (n(&u["input_tokens"]) + cached, cached, n(&u["output_tokens"]))
            }
        }
    }

    /// The error's code or type, checking the route's error shape.
    fn error(self, r: &Value) -> String {
        match self {
            Route::Messages => {
                assert_eq!(r["type"], "error", "{r}");
                assert!(r["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{r}");
                r["error"]["type"].as_str().unwrap().to_string()
            }
            _ => {
                assert!(r["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{r}");
                r["error"]["code"].as_str().unwrap_or("").to_string()
            }
        }
    }

    async fn send(self, base: &str, key: &str, body: &Value) -> (u16, Value) {
        let mut req = client().post(format!("{base}{}", self.path())).json(body);
        req = match self {
            // Anthropic's clients send the key as `x-api-key`.
            Route::Messages => req.header("x-api-key", key).header("anthropic-version", "2023-06-01"),
            _ => req.bearer_auth(key),
        };
        let resp = req.send().await.unwrap();
        let status = resp.status().as_u16();
        (status, resp.json().await.unwrap_or(Value::Null))
    }
}

fn sim_serve(data: &Path, speedup: &str) -> Proc {
    sim_serve_with(data, speedup, &[])
}

/// 300 tokens a minute: of eight requests of about 130 tokens (prompt and 100 generated) at
/// most two are served, the rest get a 429 in the route's shape, and then even a small one
/// is refused — on every route.
#[tokio::test]
async fn token_limits_bound_every_route() {
    let data = temp_dir("agent-tpm");
    let server = sim_serve(&data, "100000");
    for route in ROUTES {
        let tenant = format!("tpm-{route:?}");
        let key = new_key(&data, &tenant);
        admin(&data, &["tenant", "limits", &tenant, "--tpm", "300"]);
        let mut served = 0;
        for _ in 0..8 {
            let (s, r) = route.send(&server.url, &key, &route.body("Write a story.", 100)).await;
            match s {
                200 => served += 1,
                429 => {
                    let code = route.error(&r);
                    let want = if route == Route::Messages {
                        "rate_limit_error"
                    } else {
                        "rate_limit_exceeded"
                    };
                    assert_eq!(code, want, "{route:?}: {r}");
                }
                other => panic!("{route:?}: {other} {r}"),
            }
        }
        assert!(
            (1..=2).contains(&served),
            "{route:?}: {served} of 8 served under 300 tokens/minute"
        );
        let (s, r) = route.send(&server.url, &key, &route.body("Again.", 20)).await;
        assert_eq!(s, 429, "{route:?}: the minute's tokens are spent: {r}");
    }
}

/// A hard budget of $0.001, hit by 10 concurrent requests of up to 100 completion tokens:
/// spend never passes it, and the refusals are 402s in the route's shape — on every route.
#[tokio::test]
async fn hard_budgets_hold_on_every_route() {
    let data = temp_dir("agent-budget");
    // Slow enough that the requests overlap.
    let server = sim_serve(&data, "50");
    admin(&data, &TEST_PRICE);
    for route in ROUTES {
        let tenant = format!("capped-{route:?}");
        let key = new_key(&data, &tenant);
        admin(&data, &["tenant", "budget", &tenant, "--monthly-usd", "0.001"]);
        let mut tasks = Vec::new();
        for _ in 0..10 {
            let (url, key, body) = (server.url.clone(), key.clone(), route.body("Write a long story.", 100));
            tasks.push(tokio::spawn(async move { route.send(&url, &key, &body).await }));
        }
        let mut ok = 0;
        for t in tasks {
            let (s, r) = t.await.unwrap();
            match s {
                200 => ok += 1,
                402 => {
                    let want = if route == Route::Messages {
                        "billing_error"
                    } else {
                        "budget_exceeded"
                    };
                    assert_eq!(route.error(&r), want, "{route:?}: {r}");
                }
                other => panic!("{route:?}: unexpected {other}: {r}"),
            }
        }
        assert!(ok >= 1, "{route:?}: nothing was served");
        let rows = usage_rows(&data);
        let spent: i64 = rows
            .iter()
            // One tenant per route here.
            .filter(|r| r["endpoint"] == route.path())
            .map(|r| r["cost"]["total_nusd"].as_i64().unwrap())
            .sum();
        assert!(
            spent <= 1_000_000,
            "{route:?}: {ok} served, {spent} nUSD spent against a budget of 1,000,000 nUSD"
        );
    }
}

/// Every request — served or refused — leaves one usage row named by its route,
/// with the tokens the response reported (Anthropic's three input parts add up to the
/// row's prompt).
#[tokio::test]
async fn one_usage_row_per_request_with_the_responses_tokens() {
    let data = temp_dir("agent-usage");
    let server = sim_serve(&data, "100000");
    let key = new_key(&data, "metered");
    let mut reported = Vec::new();
    for route in ROUTES {
        for prompt in ["Tell me about Paris.", "Tell me about Paris."] {
            let (s, r) = route.send(&server.url, &key, &route.body(prompt, 12)).await;
            assert_eq!(s, 200, "{route:?}: {r}");
            reported.push((route.path(), route.usage(&r)));
        }
        // A bad request is refused in the route's shape and still recorded (no tokens).
        let mut bad = route.body("x", 12);
        bad["temperature"] = json!(9);
        let (s, r) = route.send(&server.url, &key, &bad).await;
        assert_eq!(s, 400, "{route:?}: {r}");
        route.error(&r);
    }
    let (s, r) = Route::Messages
        .send(
            &server.url,
            &key,
            &json!({"model": MODEL, "messages": [{"role": "user", "content": "Tell me about Paris."}]}),
        )
        .await;
    assert_eq!(s, 400, "max_tokens is required: {r}");
    let counted = client()
        .post(format!("{}/v1/messages/count_tokens", server.url))
        .header("x-api-key", &key)
        .json(&json!({"model": MODEL, "messages": [{"role": "user", "content": "Tell me about Paris."}]}))
        .send()
        .await
        .unwrap()
        .json::<Value>()
        .await
        .unwrap();
    let rows = usage_rows(&data);
    for route in ROUTES {
        let mine: Vec<&Value> = rows.iter().filter(|r| r["endpoint"] == route.path()).collect();
        let failed = mine.iter().filter(|r| r["status"] == "failed").count();
        let extra = usize::from(route == Route::Messages);
        assert_eq!(mine.len(), 3 + extra, "{route:?}: {mine:?}");
        assert_eq!(failed, 1 + extra, "{route:?}: {mine:?}");
        let mut got: Vec<(i64, i64, i64)> = mine
            .iter()
            .filter(|r| r["status"] != "failed")
            .map(|r| {
                (
                    r["prompt_tokens"].as_i64().unwrap(),
                    r["cached_tokens"].as_i64().unwrap(),
                    r["completion_tokens"].as_i64().unwrap(),
                )
            })
            .collect();
        let mut want: Vec<(i64, i64, i64)> = reported
            .iter()
            .filter(|(p, _)| *p == route.path())
            .map(|(_, u)| *u)
            .collect();
        got.sort_unstable();
        want.sort_unstable();
        assert_eq!(got, want, "{route:?}");
        if route == Route::Messages {
            assert_eq!(
                counted["input_tokens"].as_i64(),
                Some(want[0].0),
                "count_tokens = billed input"
            );
        }
    }
    assert!(
        rows.iter().all(|r| r["endpoint"] != "/v1/messages/count_tokens"),
        "count_tokens is not metered"
    );
}

/// Issue 78, finding 1: a chain of stored responses, each turn carrying a 150 KB reasoning
/// item (not tokenized: it costs almost nothing to send). Each response stores its own
/// items once, so the tenant's stored bytes grow with the conversation, not with its
/// square (copying the chain into every row stored ~3.6 MB by the eighth turn); the
/// continuation still reads the whole conversation; the conversation bound refuses a
/// continuation past it; a body over the per-response bound and metadata past OpenAI's
/// caps are refused before they run, and the stored bytes are in `/metrics`.
#[tokio::test]
async fn chained_responses_store_each_item_once_within_quotas() {
    let data = temp_dir("agent-chain");
    let server = sim_serve_with(
        &data,
        "100000",
        &["--response-max-bytes", "1000000", "--conversation-max-bytes", "1500000"],
    );
    let key = new_key(&data, "chain");
    let thought = "t".repeat(150_000);
    let turn = |previous: Option<&str>, i: usize| {
        json!({"model": MODEL, "max_output_tokens": 4, "previous_response_id": previous,
               "input": [{"type": "reasoning", "id": format!("rs_turn{i}"),
                          "summary": [{"type": "summary_text", "text": thought}]},
                         {"role": "user", "content": format!("Turn {i}.")}]})
    };
    let mut previous: Option<String> = None;
    let mut refused_at = None;
    for i in 0..12 {
        let (s, r) = Route::Responses
            .send(&server.url, &key, &turn(previous.as_deref(), i))
            .await;
        if s == 400 {
            assert_eq!(r["error"]["param"], "previous_response_id", "{r}");
            assert!(r["error"]["message"].as_str().unwrap().contains("1500000"), "{r}");
            refused_at = Some(i);
            break;
        }
        assert_eq!(s, 200, "turn {i}: {r}");
        previous = Some(r["id"].as_str().unwrap().to_string());
        let m = metrics(&server.url).await;
        let stored = metric_sum(&m, "hearth_stored_response_bytes{tenant=\"chain\"}");
        assert!(
            stored < (i as f64 + 1.0) * 170_000.0,
            "turn {i}: {stored} bytes stored for {} turns of 150 KB",
            i + 1
        );
        if i == 5 {
            // The sixth response's input is the whole conversation, the first turn's
            // reasoning item included.
            let items: Value = client()
                .get(format!(
                    "{}/v1/responses/{}/input_items?order=asc&limit=100",
                    server.url,
                    r["id"].as_str().unwrap()
                ))
                .bearer_auth(&key)
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            assert_eq!(items["data"][0]["id"], "rs_turn0", "{items}");
            let ids: Vec<&str> = items["data"]
                .as_array()
                .unwrap()
                .iter()
                .filter_map(|i| i["id"].as_str())
                .collect();
            assert_eq!(ids.iter().filter(|id| id.starts_with("rs_turn")).count(), 6, "{ids:?}");
        }
    }
    // 1.5 MB of conversation holds nine turns of 150 KB, not ten.
    assert!(matches!(refused_at, Some(9 | 10)), "refused at {refused_at:?}");
    // A fresh conversation still runs.
    let (s, r) = Route::Responses.send(&server.url, &key, &turn(None, 100)).await;
    assert_eq!(s, 200, "{r}");

    // Over the per-response bound: refused before it runs unless not stored.
    let mut big = turn(None, 0);
    big["input"][0]["summary"][0]["text"] = json!("t".repeat(1_200_000));
    let (s, r) = Route::Responses.send(&server.url, &key, &big).await;
    assert_eq!((s, r["error"]["param"].as_str()), (400, Some("store")), "{r}");
    big["store"] = json!(false);
    let (s, r) = Route::Responses.send(&server.url, &key, &big).await;
    assert_eq!(s, 200, "{r}");

    // Metadata as OpenAI caps it: 16 values of at most 512 characters.
    for metadata in [
        json!((0..17)
            .map(|i| (format!("k{i}"), json!("v")))
            .collect::<serde_json::Map<_, _>>()),
        json!({"k": "v".repeat(513)}),
        json!({"k": {"nested": true}}),
    ] {
        let mut req = turn(None, 0);
        req["metadata"] = metadata;
        let (s, r) = Route::Responses.send(&server.url, &key, &req).await;
        assert_eq!((s, r["error"]["param"].as_str()), (400, Some("metadata")), "{r}");
    }
}

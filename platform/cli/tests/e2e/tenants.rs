//! End-to-end for tenants at scale: gateways sharing Redis (and PostgreSQL), JWTs and scoped
//! keys, prices, budgets, exports and the self-service API, through real `hearth` processes.
//! The sim backend (the real scheduler and prefix cache, no maths) keeps these fast.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::harness::*;
use jsonwebtoken::{encode, Algorithm, EncodingKey, Header};
use serde_json::{json, Value};

const RSA_PRIVATE: &str = include_str!("../../../../tenants/tests/fixtures/rsa_private.pem");
const RSA_PUBLIC_PATH: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../tenants/tests/fixtures/rsa_public.pem"
);
const HS_SECRET: &str = "an-hmac-secret-of-at-least-32-bytes!!";

fn sim_serve(data: &Path, extra: &[&str]) -> Proc {
    sim_serve_with(data, "100000", extra)
}

fn unique(tag: &str) -> String {
    format!("{tag}-{}-{}", std::process::id(), hearth_tenants::now_ms())
}

async fn get(url: &str, bearer: &str) -> (u16, reqwest::header::HeaderMap, Value) {
    let resp = client().get(url).bearer_auth(bearer).send().await.unwrap();
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    (status, headers, resp.json().await.unwrap_or(Value::Null))
}

fn assert_openai_error(body: &Value) {
    let e = &body["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{body}");
    assert!(e["type"].is_string(), "{body}");
    assert!(e.get("param").is_some() && e.get("code").is_some(), "{body}");
}

/// A tenant with 10 requests/minute, hit by two gateways that share Redis (and, when
/// `DATABASE_URL` is set, one PostgreSQL database): 10 successes in total, every request
/// metered once.
#[tokio::test]
async fn two_gateways_sharing_redis_enforce_one_limit() {
    let data_a = temp_dir("shared-a");
    let data_b = temp_dir("shared-b");
    let (_pg, db_url) = one_database(&data_a).await;
    let prefix = format!("{}:", unique("hearth-e2e"));
    let shared = [
        "--database-url",
        db_url.as_str(),
        "--redis-url",
        &redis_url(),
        "--redis-prefix",
        &prefix,
    ];
    let a = sim_serve(&data_a, &shared);
    let b = sim_serve(&data_b, &shared);
    let cli = |args: &[&str]| {
        let mut full = vec!["--database-url", db_url.as_str()];
        full.extend_from_slice(args);
        admin(&data_a, &full)
    };
    cli(&["tenant", "create", "shared"]);
    cli(&["tenant", "limits", "shared", "--rpm", "10"]);
    let out = cli(&["key", "create", "--tenant", "shared"]);
    let key = out
        .split_whitespace()
        .find(|w| w.starts_with("hk_"))
        .unwrap()
        .to_string();
    let body = json!({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]});
    let mut ok = 0;
    let mut limited = 0;
    for i in 0..30 {
        let url = format!("{}/v1/chat/completions", if i % 2 == 0 { &a.url } else { &b.url });
        let (s, h, r) = post(&url, Some(&key), &body).await;
        match s {
            200 => ok += 1,
            429 => {
                limited += 1;
                assert_openai_error(&r);
                assert_eq!(r["error"]["code"], "rate_limit_exceeded");
                assert!(h.contains_key("retry-after"));
                assert_eq!(h["x-ratelimit-limit-requests"], "10");
                assert_eq!(h["x-ratelimit-remaining-requests"], "0");
            }
            other => panic!("unexpected {other}: {r}"),
        }
    }
    assert_eq!((ok, limited), (10, 20), "the limit must hold across both gateways");
    // Every request has exactly one usage record, whichever gateway served it.
    let rows = usage_rows_with(&data_a, &["--database-url", db_url.as_str()]);
    assert_eq!(rows.len(), 30);
    assert_eq!(
        rows.iter().filter(|r| r["error_code"] == "rate_limit_exceeded").count(),
        20
    );
}

/// Tokens per minute bound completions too, the same in-process and with Redis: with a
/// limit of 300, requests asking for 400 completion tokens are refused up front (at most 2
/// of 8 may be served — here none), and one that leaves `max_tokens` unset is shortened to
/// what the limit allows, after which the minute is used up.
#[tokio::test]
async fn token_limits_bound_completions() {
    for shared in [false, true] {
        let data = temp_dir("tpm");
        let prefix = format!("{}:", unique("hearth-tpm"));
        let redis = redis_url();
        let mut extra = vec![];
        if shared {
            extra.extend_from_slice(&["--redis-url", redis.as_str(), "--redis-prefix", prefix.as_str()]);
        }
        let server = sim_serve(&data, &extra);
        admin(&data, &["tenant", "create", "metered"]);
        admin(&data, &["tenant", "limits", "metered", "--tpm", "300"]);
        let out = admin(&data, &["key", "create", "--tenant", "metered"]);
        let key = out
            .split_whitespace()
            .find(|w| w.starts_with("hk_"))
            .unwrap()
            .to_string();
        let url = format!("{}/v1/chat/completions", server.url);
        let ask = |max: Option<u32>| {
            let mut b = json!({"model": MODEL, "ignore_eos": true, "messages": [{"role": "user", "content": "Write a story."}]});
            if let Some(m) = max {
                b["max_tokens"] = json!(m);
            }
            b
        };
        let mut served = 0;
        for _ in 0..8 {
            let (s, _, r) = post(&url, Some(&key), &ask(Some(400))).await;
            match s {
                200 => served += 1,
                429 => {
                    assert_eq!(r["error"]["type"], "tokens", "{r}");
                    assert!(r["error"]["message"].as_str().unwrap().contains("max_tokens"), "{r}");
                }
                other => panic!("shared={shared}: {other} {r}"),
            }
        }
        assert!(
            served <= 2,
            "shared={shared}: {served} of 8 served under 300 tokens/minute"
        );
        let (s, h, r) = post(&url, Some(&key), &ask(None)).await;
        assert_eq!(s, 200, "shared={shared}: {r}");
        let used = r["usage"]["total_tokens"].as_u64().unwrap();
        assert!(
            used <= 300,
            "shared={shared}: {used} tokens in one request under 300/minute"
        );
        assert!(r["usage"]["completion_tokens"].as_u64().unwrap() > 100, "{r}");
        assert!(h.contains_key("x-ratelimit-remaining-tokens"));
        let (s, _, r) = post(&url, Some(&key), &ask(Some(20))).await;
        assert_eq!(s, 429, "shared={shared}: the minute's tokens are spent: {r}");
    }
}

/// A hard budget of $0.001 at $1 / $0.1 / $2 per million input / cached / output tokens,
/// hit by 10 concurrent requests of up to 100 completion tokens (about $0.00024 each at
/// worst): spend never passes the budget — in one gateway (reservations in memory) and
/// across two gateways sharing Redis and the database (reservations in Redis).
#[tokio::test]
async fn hard_budgets_hold_under_concurrency() {
    for shared in [false, true] {
        let data_a = temp_dir("budget-a");
        let data_b = temp_dir("budget-b");
        let (_pg, db_url) = one_database(&data_a).await;
        let prefix = format!("{}:", unique("hearth-budget"));
        let redis = redis_url();
        let mut args = vec![
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--backend",
            "sim",
            // Slow enough that the requests overlap.
            "--sim-speedup",
            "50",
            "--database-url",
            db_url.as_str(),
        ];
        if shared {
            args.extend_from_slice(&["--redis-url", &redis, "--redis-prefix", &prefix]);
        }
        let start = |data: &Path| {
            let mut a = args.clone();
            a.extend_from_slice(&["--data-dir", data.to_str().unwrap()]);
            spawn(&a)
        };
        let gateways = if shared {
            vec![start(&data_a), start(&data_b)]
        } else {
            vec![start(&data_a)]
        };
        let cli = |a: &[&str]| {
            let mut full = vec!["--database-url", db_url.as_str()];
            full.extend_from_slice(a);
            admin(&data_a, &full)
        };
        cli(&["tenant", "create", "capped"]);
        cli(&TEST_PRICE);
        cli(&["tenant", "budget", "capped", "--monthly-usd", "0.001"]);
        let out = cli(&["key", "create", "--tenant", "capped"]);
        let key = out
            .split_whitespace()
            .find(|w| w.starts_with("hk_"))
            .unwrap()
            .to_string();
        let body = json!({"model": MODEL, "max_tokens": 100, "ignore_eos": true,
                          "messages": [{"role": "user", "content": "Write a long story."}]});
        let mut tasks = Vec::new();
        for i in 0..10 {
            let url = format!("{}/v1/chat/completions", gateways[i % gateways.len()].url);
            let (key, body) = (key.clone(), body.clone());
            tasks.push(tokio::spawn(async move { post(&url, Some(&key), &body).await }));
        }
        let mut ok = 0;
        for t in tasks {
            let (s, _, r) = t.await.unwrap();
            match s {
                200 => ok += 1,
                402 => {
                    assert_openai_error(&r);
                    assert_eq!(r["error"]["code"], "budget_exceeded", "{r}");
                }
                other => panic!("unexpected {other}: {r}"),
            }
        }
        let rows = usage_rows_with(&data_a, &["--database-url", db_url.as_str()]);
        let spent: i64 = rows.iter().map(|r| r["cost"]["total_nusd"].as_i64().unwrap()).sum();
        assert!(ok >= 1, "shared={shared}: nothing was served");
        assert!(
            spent <= 1_000_000,
            "shared={shared}: {ok} served, ${spent} nUSD spent against a budget of 1,000,000 nUSD"
        );
        drop(gateways);
    }
}

fn jwt(alg: Algorithm, key: &EncodingKey, claims: Value) -> String {
    encode(&Header::new(alg), &claims, key).unwrap()
}

fn now_s() -> i64 {
    hearth_tenants::now_ms() / 1000
}

/// JWTs (HS256 over the admin API, RS256 over the CLI) and scoped, expiring keys, refused
/// and accepted over HTTP with OpenAI-shaped errors.
#[tokio::test]
async fn jwts_and_scoped_keys_over_http() {
    let data = temp_dir("jwt");
    let server = sim_serve(&data, &[]);
    admin(&data, &["tenant", "create", "idp"]);
    let resp = client()
        .post(format!("{}/admin/v1/tenants/idp/jwt-issuers", server.url))
        .bearer_auth(ADMIN_TOKEN)
        .json(&json!({"issuer": "https://hs.example", "audience": "hearth", "algorithm": "HS256", "key": HS_SECRET}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 201);
    let hs_issuer: Value = resp.json().await.unwrap();
    let hs_issuer_id = hs_issuer["id"].as_str().unwrap().to_string();
    admin(
        &data,
        &[
            "jwt",
            "add",
            "--tenant",
            "idp",
            "--issuer",
            "https://rs.example",
            "--audience",
            "hearth",
            "--algorithm",
            "RS256",
            "--key-file",
            RSA_PUBLIC_PATH,
        ],
    );
    let url = format!("{}/v1/chat/completions", server.url);
    let body = json!({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]});
    let hs = EncodingKey::from_secret(HS_SECRET.as_bytes()).unwrap();
    let rs = EncodingKey::from_rsa_pem(RSA_PRIVATE.as_bytes()).unwrap();
    let claims = |iss: &str, aud: &str, exp_in: i64| json!({"iss": iss, "aud": aud, "sub": "alice", "exp": now_s() + exp_in, "scope": "inference"});
    for tok in [
        jwt(Algorithm::HS256, &hs, claims("https://hs.example", "hearth", 300)),
        jwt(Algorithm::RS256, &rs, claims("https://rs.example", "hearth", 300)),
    ] {
        let (s, _, r) = post(&url, Some(&tok), &body).await;
        assert_eq!(s, 200, "{r}");
    }
    // The JWT's principal is metered…
    let rows = usage_rows(&data);
    assert!(rows.iter().any(|r| r["key_id"].as_str().unwrap().ends_with(":alice")));
    // …and can be given limits of its own, like a key (a fresh subject, read at its first
    // request).
    let bob = format!("jwt:{hs_issuer_id}:bob");
    let set = client()
        .put(format!("{}/admin/v1/keys/{bob}/limits", server.url))
        .bearer_auth(ADMIN_TOKEN)
        .json(&json!({"rpm": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(set.status(), 200, "{}", set.text().await.unwrap());
    let mut c = claims("https://hs.example", "hearth", 300);
    c["sub"] = json!("bob");
    let tok = jwt(Algorithm::HS256, &hs, c);
    assert_eq!(post(&url, Some(&tok), &body).await.0, 200);
    let (s, _, r) = post(&url, Some(&tok), &body).await;
    assert_eq!(s, 429, "bob's own limit of 1 request/minute: {r}");
    assert!(r["error"]["message"].as_str().unwrap().contains(&bob), "{r}");
    // A key minted with a 10-minute token expires with the token.
    let mut c = claims("https://hs.example", "hearth", 600);
    c["scope"] = json!("inference manage");
    let manager = jwt(Algorithm::HS256, &hs, c);
    let minted = client()
        .post(format!("{}/v1/tenant/keys", server.url))
        .bearer_auth(&manager)
        .json(&json!({"name": "from-a-token"}))
        .send()
        .await
        .unwrap();
    assert_eq!(minted.status(), 201);
    let minted: Value = minted.json().await.unwrap();
    let exp = minted["expires_at"].as_i64().expect("bounded by the token");
    assert!(exp <= (now_s() + 600) * 1000 + 1000, "{minted}");

    let forged = jwt(
        Algorithm::HS256,
        &EncodingKey::from_secret(b"not-the-secret-not-the-secret-not-it").unwrap(),
        claims("https://hs.example", "hearth", 300),
    );
    let expired = jwt(Algorithm::RS256, &rs, claims("https://rs.example", "hearth", -3600));
    let wrong_aud = jwt(Algorithm::RS256, &rs, claims("https://rs.example", "someone-else", 300));
    let confused = jwt(
        Algorithm::HS256,
        &EncodingKey::from_secret(std::fs::read(RSA_PUBLIC_PATH).unwrap().as_slice()).unwrap(),
        claims("https://rs.example", "hearth", 300),
    );
    let none = {
        let enc = |v: &Value| {
            let s = v.to_string();
            // base64url without padding, by hand (tests only).
            const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
            let mut out = String::new();
            for c in s.as_bytes().chunks(3) {
                let n = c
                    .iter()
                    .enumerate()
                    .fold(0u32, |a, (i, b)| a | (*b as u32) << (16 - 8 * i));
                for i in 0..=c.len() {
                    out.push(A[(n >> (18 - 6 * i) & 63) as usize] as char);
                }
            }
            out
        };
        format!(
            "{}.{}.",
            enc(&json!({"alg": "none", "typ": "JWT"})),
            enc(&claims("https://hs.example", "hearth", 300))
        )
    };
    for (tok, why) in [
        (forged, "signature"),
        (expired, "expired"),
        (wrong_aud, "audience"),
        (confused, "algorithm"),
        (none, "none"),
    ] {
        let (s, _, r) = post(&url, Some(&tok), &body).await;
        assert_eq!(s, 401, "{why}: {r}");
        assert_openai_error(&r);
        assert_eq!(r["error"]["type"], "invalid_request_error");
        assert!(r["error"]["message"].as_str().unwrap().contains(why), "{why}: {r}");
    }

    // A key restricted to another model, an inference-only key on the self-service API,
    // a key that has expired.
    let out = admin(
        &data,
        &["key", "create", "--tenant", "idp", "--models", "some-other-model"],
    );
    let narrow = out
        .split_whitespace()
        .find(|w| w.starts_with("hk_"))
        .unwrap()
        .to_string();
    let (s, _, r) = post(&url, Some(&narrow), &body).await;
    assert_eq!(s, 403, "{r}");
    assert_eq!(r["error"]["code"], "model_not_allowed");
    let (_, _, models) = get(&format!("{}/v1/models", server.url), &narrow).await;
    assert_eq!(
        models["data"].as_array().unwrap().len(),
        0,
        "listed models follow the key"
    );
    let out = admin(&data, &["key", "create", "--tenant", "idp", "--scopes", "inference"]);
    let infer = out
        .split_whitespace()
        .find(|w| w.starts_with("hk_"))
        .unwrap()
        .to_string();
    let (s, _, r) = get(&format!("{}/v1/tenant/keys", server.url), &infer).await;
    assert_eq!((s, r["error"]["code"].as_str()), (403, Some("missing_scope")), "{r}");
    let out = admin(&data, &["key", "create", "--tenant", "idp", "--expires-in", "1s"]);
    let short = out
        .split_whitespace()
        .find(|w| w.starts_with("hk_"))
        .unwrap()
        .to_string();
    assert_eq!(post(&url, Some(&short), &body).await.0, 200);
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let (s, _, r) = post(&url, Some(&short), &body).await;
    assert_eq!(s, 401, "{r}");
    assert!(r["error"]["message"].as_str().unwrap().contains("expired"));
}

fn usage_sum(bodies: &[Value]) -> (i64, i64, i64) {
    bodies.iter().fold((0, 0, 0), |(p, c, o), b| {
        let u = &b["usage"];
        (
            p + u["prompt_tokens"].as_i64().unwrap(),
            c + u["prompt_tokens_details"]["cached_tokens"].as_i64().unwrap(),
            o + u["completion_tokens"].as_i64().unwrap(),
        )
    })
}

fn csv_column_sum(text: &str, column: &str) -> i64 {
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    let i = header.iter().position(|h| *h == column).unwrap();
    lines
        .map(|l| l.split(',').nth(i).unwrap().parse::<i64>().unwrap())
        .sum()
}

/// Prices with cached-token discounts, exports that reconcile with the responses' usage,
/// price history, budgets (hard and soft), and the self-service API.
#[tokio::test]
async fn prices_exports_budgets_and_self_service() {
    let data = temp_dir("billing");
    let server = sim_serve(&data, &[]);
    let key = new_key(&data, "payer");
    let set_price = |input: &str, cached: &str, output: &str| {
        let url = format!("{}/admin/v1/prices", server.url);
        let body = json!({"model": MODEL, "input": input, "cached_input": cached, "output": output});
        async move {
            let r = client()
                .post(url)
                .bearer_auth(ADMIN_TOKEN)
                .json(&body)
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 201);
            r.json::<Value>().await.unwrap()
        }
    };
    // $1 / $0.25 / $2 per million tokens.
    set_price("1", "0.25", "2").await;
    let url = format!("{}/v1/chat/completions", server.url);
    let system = "You are a careful assistant. ".repeat(40);
    let mut bodies = Vec::new();
    for i in 0..6 {
        let b = json!({"model": MODEL, "max_tokens": 4 + i, "messages": [
            {"role": "system", "content": system}, {"role": "user", "content": format!("question {i}")}]});
        let (s, _, r) = post(&url, Some(&key), &b).await;
        assert_eq!(s, 200, "{r}");
        bodies.push(r);
    }
    let (prompt, cached, output) = usage_sum(&bodies);
    assert!(cached > 0, "repeated system prompts must hit the prefix cache");
    let expected_nusd = (prompt - cached) * 1000 + cached * 250 + output * 2000;

    // The admin export: per request, CSV; totals in headers and in the lines.
    let export = client()
        .get(format!(
            "{}/admin/v1/billing/export?tenant=payer&format=csv&granularity=request",
            server.url
        ))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(export.status(), 200);
    let h = export.headers().clone();
    let csv = export.text().await.unwrap();
    assert_eq!(h["x-hearth-export-requests"], "6");
    assert_eq!(h["x-hearth-export-cost-nusd"], expected_nusd.to_string().as_str());
    assert_eq!(csv_column_sum(&csv, "cached_input_tokens"), cached);
    assert_eq!(csv_column_sum(&csv, "uncached_input_tokens"), prompt - cached);
    assert_eq!(csv_column_sum(&csv, "output_tokens"), output);
    assert_eq!(
        csv_column_sum(&csv, "cost_cached_nusd"),
        cached * 250,
        "cached input at the cached rate"
    );
    assert_eq!(csv_column_sum(&csv, "cost_nusd"), expected_nusd);
    // Per day, JSON Lines, through the self-service API: the same totals.
    let day = client()
        .get(format!(
            "{}/v1/tenant/usage/export?format=jsonl&granularity=day",
            server.url
        ))
        .bearer_auth(&key)
        .send()
        .await
        .unwrap();
    assert_eq!(day.status(), 200);
    let lines: Vec<Value> = day
        .text()
        .await
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(
        lines.iter().map(|l| l["cost_nusd"].as_i64().unwrap()).sum::<i64>(),
        expected_nusd
    );
    // The CLI's Parquet export writes a file and prints the same totals.
    let pq = data.join("usage.parquet");
    let out = std::process::Command::new(bin())
        .args([
            "billing",
            "export",
            "--data-dir",
            data.to_str().unwrap(),
            "--tenant",
            "payer",
        ])
        .args([
            "--from",
            "2020-01-01",
            "--format",
            "parquet",
            "--out",
            pq.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("6 requests"), "{stderr}");
    assert!(
        stderr.contains(&format!("cost ${}", hearth_billing::format_nusd(expected_nusd))),
        "{stderr}"
    );
    assert!(std::fs::read(&pq).unwrap().starts_with(b"PAR1"));

    // A price change applies to later requests only; the first requests keep their price.
    let before = usage_rows(&data);
    set_price("10", "10", "10").await;
    let (s, _, r) = post(
        &url,
        Some(&key),
        &json!({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}),
    )
    .await;
    assert_eq!(s, 200, "{r}");
    let after = usage_rows(&data);
    for old in &before {
        let same = after.iter().find(|r| r["request_id"] == old["request_id"]).unwrap();
        assert_eq!(same["cost"], old["cost"], "history is never rewritten");
    }
    let newest = after
        .iter()
        .find(|r| !before.iter().any(|o| o["request_id"] == r["request_id"]))
        .unwrap();
    let u = &r["usage"];
    assert_eq!(
        newest["cost"]["total_nusd"].as_i64().unwrap(),
        (u["prompt_tokens"].as_i64().unwrap() + u["completion_tokens"].as_i64().unwrap()) * 10_000
    );

    // Self-service: the tenant sees its spend, lists and creates keys, cannot escalate.
    let (s, _, me) = get(&format!("{}/v1/tenant", server.url), &key).await;
    assert_eq!(s, 200, "{me}");
    let spent = me["spend"]["nusd"].as_i64().unwrap();
    assert_eq!(
        spent,
        after
            .iter()
            .map(|r| r["cost"]["total_nusd"].as_i64().unwrap())
            .sum::<i64>()
    );
    let (s, _, usage) = get(&format!("{}/v1/tenant/usage", server.url), &key).await;
    assert_eq!(s, 200);
    assert_eq!(usage["totals"]["cost_nusd"].as_i64().unwrap(), spent);
    assert_eq!(usage["totals"]["requests"], 7);
    let created = client()
        .post(format!("{}/v1/tenant/keys", server.url))
        .bearer_auth(&key)
        .json(&json!({"name": "ci", "scopes": ["inference"], "expires_in": 3600}))
        .send()
        .await
        .unwrap();
    assert_eq!(created.status(), 201);
    let created: Value = created.json().await.unwrap();
    let ci_key = created["key"].as_str().unwrap().to_string();
    let escalate = client()
        .post(format!("{}/v1/tenant/keys", server.url))
        .bearer_auth(&ci_key)
        .json(&json!({"scopes": ["manage"]}))
        .send()
        .await
        .unwrap();
    assert_eq!(escalate.status(), 403, "an inference-only key cannot manage");
    let (_, _, keys) = get(&format!("{}/v1/tenant/keys", server.url), &key).await;
    assert_eq!(keys["data"].as_array().unwrap().len(), 2);
    let del = client()
        .delete(format!(
            "{}/v1/tenant/keys/{}",
            server.url,
            created["id"].as_str().unwrap()
        ))
        .bearer_auth(&key)
        .send()
        .await
        .unwrap();
    assert_eq!(del.status(), 200);
    assert_eq!(post(&url, Some(&ci_key), &json!({"model": MODEL})).await.0, 401);

    // Minting only narrows: a child of an expiring, rate-limited manage key expires no
    // later than its parent and carries its parent's per-key limits and class.
    let mint = |bearer: String, body: Value| {
        let url = format!("{}/v1/tenant/keys", server.url);
        async move {
            let r = client().post(url).bearer_auth(bearer).json(&body).send().await.unwrap();
            assert_eq!(r.status(), 201);
            r.json::<Value>().await.unwrap()
        }
    };
    let parent = mint(key.clone(), json!({"name": "parent", "expires_in": 600})).await;
    let parent_key = parent["key"].as_str().unwrap().to_string();
    let parent_id = parent["id"].as_str().unwrap().to_string();
    let limited = client()
        .put(format!("{}/admin/v1/keys/{parent_id}/limits", server.url))
        .bearer_auth(ADMIN_TOKEN)
        .json(&json!({"rpm": 2, "priority": "batch"}))
        .send()
        .await
        .unwrap();
    assert_eq!(limited.status(), 200);
    let child = mint(parent_key.clone(), json!({"name": "child"})).await;
    let (pe, ce) = (parent["expires_at"].as_i64().unwrap(), child["expires_at"].as_i64());
    assert!(ce.is_some_and(|c| c <= pe), "child {child} outlives parent {parent}");
    let child_key = child["key"].as_str().unwrap().to_string();
    let (s, _, me) = get(&format!("{}/v1/tenant", server.url), &child_key).await;
    assert_eq!(s, 200, "{me}");
    assert_eq!(me["limits"]["credential"]["rpm"], 2, "{me}");
    assert_eq!(me["limits"]["credential"]["priority"], "batch", "{me}");

    // A manage key restricted to one model revokes only keys within its models.
    let out = admin(
        &data,
        &[
            "key",
            "create",
            "--tenant",
            "payer",
            "--scopes",
            "inference,manage",
            "--models",
            MODEL,
        ],
    );
    let narrow = out
        .split_whitespace()
        .find(|w| w.starts_with("hk_"))
        .unwrap()
        .to_string();
    let revoke = |bearer: String, id: String| {
        let url = format!("{}/v1/tenant/keys/{id}", server.url);
        async move { client().delete(url).bearer_auth(bearer).send().await.unwrap() }
    };
    let r = revoke(narrow.clone(), parent_id.clone()).await;
    assert_eq!(r.status(), 403, "an unrestricted key is beyond a model-restricted one");
    let own = mint(narrow.clone(), json!({"name": "narrower"})).await;
    let r = revoke(narrow, own["id"].as_str().unwrap().to_string()).await;
    assert_eq!(r.status(), 200);

    // Budgets: soft warns, hard refuses with 402 in OpenAI's shape, on the next request.
    let budget = |usd: &str, mode: &str| {
        let url = format!("{}/admin/v1/tenants/payer/budget", server.url);
        let body = json!({"monthly_usd": usd, "mode": mode});
        async move {
            let r = client()
                .put(url)
                .bearer_auth(ADMIN_TOKEN)
                .json(&body)
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
        }
    };
    let small = json!({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]});
    budget("0.000001", "soft").await;
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let (s, h, r) = post(&url, Some(&key), &small).await;
        assert_eq!(s, 200, "{r}");
        if h.contains_key("x-hearth-budget-warning") {
            break;
        }
        assert!(Instant::now() < deadline, "no budget warning");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    budget("0.000001", "hard").await;
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let (s, _, r) = post(&url, Some(&key), &small).await;
        if s == 402 {
            assert_openai_error(&r);
            assert_eq!(r["error"]["code"], "budget_exceeded");
            assert_eq!(r["error"]["type"], "insufficient_quota");
            break;
        }
        assert!(Instant::now() < deadline, "the hard budget never applied: {s} {r}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Raising the budget lets requests through again.
    budget("1000", "hard").await;
    let deadline = Instant::now() + Duration::from_secs(15);
    while post(&url, Some(&key), &small).await.0 != 200 {
        assert!(Instant::now() < deadline, "a raised budget must apply");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Write-before-ack: the usage record is committed before the client sees the end of its
/// response, so killing the server (SIGKILL) the moment the response arrives loses nothing.
#[tokio::test]
async fn usage_is_committed_before_the_response_ends() {
    let data = temp_dir("durable");
    let key = new_key(&data, "durable");
    let mut ids = Vec::new();
    for stream in [false, true] {
        let mut server = sim_serve(&data, &[]);
        let url = format!("{}/v1/chat/completions", server.url);
        let body = json!({"model": MODEL, "max_tokens": 3, "stream": stream,
                          "messages": [{"role": "user", "content": "hello"}]});
        let resp = client().post(&url).bearer_auth(&key).json(&body).send().await.unwrap();
        assert_eq!(resp.status(), 200);
        ids.push(resp.headers()["x-request-id"].to_str().unwrap().to_string());
        let text = resp.text().await.unwrap();
        // The whole response is in hand: kill at once, no graceful shutdown.
        server.child.kill().unwrap();
        server.child.wait().unwrap();
        if stream {
            assert!(text.trim_end().ends_with("data: [DONE]"));
        }
    }
    let rows = usage_rows(&data);
    for id in &ids {
        let r = rows.iter().find(|r| r["request_id"] == *id.as_str());
        let r = r.unwrap_or_else(|| panic!("usage of {id} was lost: {rows:?}"));
        assert_eq!(r["status"], "completed");
        assert_eq!(r["completion_tokens"], 3);
    }
}

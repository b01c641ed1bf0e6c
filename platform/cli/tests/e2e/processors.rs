//! End-to-end for tenant processors: the SDK's examples (built by `sdk/processors/build`
//! into `$HEARTH_PROCESSOR_EXAMPLES`) and hostile WAT guests, uploaded through the admin
//! API, the self-service API and the CLI, changing real requests and responses of a real
//! `hearth serve` (the default model), in order, streamed and not.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::harness::*;
use hearth_runtime::wat_guest::{component, guest};
use serde_json::{json, Value};

fn examples() -> PathBuf {
    hearth_testkit::tier::needs(hearth_testkit::tier::Tier::Model);
    PathBuf::from(
        std::env::var_os("HEARTH_PROCESSOR_EXAMPLES").expect(
            "HEARTH_PROCESSOR_EXAMPLES must name the built examples (run sdk/processors/build; scripts/test does)",
        ),
    )
}

/// A pre-processor that rejects every request with status 418 and the body it was given as
/// the message: it shows what earlier processors did to the request.
fn inspector() -> Vec<u8> {
    component(&guest(
        r#"(i32.store8 (i32.const 128) (i32.const 2))
           (i32.store16 (i32.const 132) (i32.const 418))
           (i32.store (i32.const 136) (local.get 6))
           (i32.store (i32.const 140) (local.get 7))
           (i32.const 128)"#,
        "",
    ))
    .unwrap()
}

async fn upload(base: &str, tenant: &str, name: &str, wasm: Vec<u8>, query: &str) -> Value {
    let r = client()
        .post(format!(
            "{base}/admin/v1/tenants/{tenant}/processors?name={name}&activate=true{query}"
        ))
        .bearer_auth(ADMIN_TOKEN)
        .header("content-type", "application/wasm")
        .body(wasm)
        .send()
        .await
        .unwrap();
    let status = r.status();
    let body: Value = r.json().await.unwrap();
    assert_eq!(status, 201, "{body}");
    body
}

fn example(name: &str) -> Vec<u8> {
    std::fs::read(examples().join(format!("{name}.wasm"))).unwrap_or_else(|e| panic!("{name}.wasm: {e}"))
}

fn enc(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

fn serve_with_cache(data: &std::path::Path) -> Proc {
    // Compiled examples are shared between test processes through the cache.
    std::env::set_var("HEARTH_PROCESSOR_CACHE", examples().join("cache"));
    serve(data)
}

/// The text of a streamed chat answer; panics on an error event.
async fn streamed_text(resp: reqwest::Response) -> String {
    let mut text = String::new();
    for e in sse_events(resp).await {
        if e == "[DONE]" {
            continue;
        }
        let v: Value = serde_json::from_str(&e).unwrap();
        assert!(v.get("error").is_none(), "{v}");
        if let Some(t) = v["choices"][0]["delta"]["content"].as_str() {
            text.push_str(t);
        }
    }
    text
}

/// `hearth processor list --json` for a tenant.
fn processor_list(data: &std::path::Path, tenant: &str) -> Value {
    let out = std::process::Command::new(bin())
        .args([
            "processor",
            "list",
            "--json",
            "--data-dir",
            data.to_str().unwrap(),
            "--tenant",
            tenant,
        ])
        .output()
        .unwrap();
    serde_json::from_slice(&out.stdout).unwrap()
}

#[tokio::test]
async fn example_processors_change_requests_and_responses() {
    let data = temp_dir("processors");
    let server = serve_with_cache(&data);
    let base = server.url.clone();
    let url = format!("{base}/v1/chat/completions");
    // Processor time is priced: $1 per CPU-second, tokens free.
    admin(
        &data,
        &[
            "price",
            "set",
            "--model",
            "*",
            "--input",
            "0",
            "--cached-input",
            "0",
            "--output",
            "0",
            "--processor",
            "1",
        ],
    );

    // 1. PII redaction (Python), then the inspector: it sees the redacted body.
    let pii_key = new_key(&data, "pii");
    upload(
        &base,
        "pii",
        "pii-redactor",
        example("pii-redactor"),
        "&position=10&cpu_ms=1000&memory_mib=256",
    )
    .await;
    upload(&base, "pii", "inspector", inspector(), "&position=20").await;
    let body = json!({"model": MODEL, "messages": [{"role": "user",
        "content": "I am jane.doe@example.com, phone +1 (555) 123-4567."}]});
    let (s, _, r) = post(&url, Some(&pii_key), &body).await;
    assert_eq!(s, 418, "{r}");
    let seen = r["error"]["message"].as_str().unwrap();
    assert!(seen.contains("I am [EMAIL], phone [PHONE]."), "{seen}");
    assert!(!seen.contains("jane.doe"), "{seen}");
    assert_eq!(r["error"]["code"], "processor_rejected");
    assert!(seen.contains("rejected by processor 'inspector' v1"), "{seen}");

    // 2. The system-prompt injector (JavaScript), uploaded by the tenant itself.
    let sp_key = new_key(&data, "pirate");
    let cfg = enc(r#"{"system_prompt":"Answer like a pirate.","mode":"enforce"}"#);
    let r = client()
        .post(format!(
            "{base}/v1/tenant/processors?name=system-prompt&activate=true&position=10&cpu_ms=1000&memory_mib=256&config={cfg}"
        ))
        .bearer_auth(&sp_key)
        .body(example("system-prompt"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201, "{}", r.text().await.unwrap());
    let body = json!({"model": MODEL, "max_tokens": 8, "messages": [
        {"role": "system", "content": "You are a calm librarian."}, {"role": "user", "content": "Hello"}]});
    // Without an inspector the request goes through, with the injected prompt counted.
    let (s, _, plain) = post(&url, Some(&new_key(&data, "plain")), &body).await;
    assert_eq!(s, 200, "{plain}");
    let (s, _, injected) = post(&url, Some(&sp_key), &body).await;
    assert_eq!(s, 200, "{injected}");
    assert_ne!(
        injected["usage"]["prompt_tokens"], plain["usage"]["prompt_tokens"],
        "the model saw another prompt"
    );
    upload(&base, "pirate", "inspector", inspector(), "&position=20").await;
    let (s, _, r) = post(&url, Some(&sp_key), &body).await;
    assert_eq!(s, 418, "{r}");
    let seen = r["error"]["message"].as_str().unwrap();
    assert!(
        seen.contains("Answer like a pirate.") && !seen.contains("calm librarian"),
        "{seen}"
    );

    // 3. The response filter (JavaScript), through the CLI: the real model's answer,
    //    "The capital of France is Paris.", masked — streamed and not.
    let filter_key = new_key(&data, "filtered");
    let wasm_path = examples().join("response-filter.wasm");
    admin(&data, &["tenant", "list"]);
    let out = std::process::Command::new(bin())
        .args([
            "processor",
            "upload",
            "--data-dir",
            data.to_str().unwrap(),
            "--tenant",
            "filtered",
        ])
        .args([
            "--name",
            "response-filter",
            "--activate",
            "--cpu-ms",
            "1000",
            "--memory-mib",
            "256",
        ])
        .args(["--config", r#"{"blocked_words":["Paris"],"mode":"mask"}"#])
        .arg(&wasm_path)
        .env("HEARTH_PROCESSOR_CACHE", examples().join("cache"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let q = json!({"model": MODEL, "temperature": 0, "messages": [{"role": "user", "content": QUESTION}]});
    // The gateway picks the CLI's upload up within its 5 s cache.
    let deadline = Instant::now() + Duration::from_secs(20);
    let answer = loop {
        let (s, _, r) = post(&url, Some(&filter_key), &q).await;
        assert_eq!(s, 200, "{r}");
        let text = r["choices"][0]["message"]["content"].as_str().unwrap().to_string();
        if !text.contains("Paris") {
            break text;
        }
        assert!(Instant::now() < deadline, "the filter never applied: {text}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    assert_eq!(answer, "The capital of France is ****.");
    let mut sq = q.clone();
    sq["stream"] = json!(true);
    let resp = client()
        .post(&url)
        .bearer_auth(&filter_key)
        .json(&sq)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let streamed = streamed_text(resp).await;
    assert_eq!(streamed, "The capital of France is ****.");
    // Usage is metered from the model's tokens, whatever the filter did to the text, and
    // with the time the processors ran (streamed and not).
    let rows = usage_rows(&data);
    let filter_key_id = filter_key.split('_').nth(1).unwrap();
    let filtered: Vec<&Value> = rows
        .iter()
        .filter(|r| r["key_id"] == filter_key_id && r["status"] == "completed" && r["completion_tokens"] == 8)
        .collect();
    assert!(filtered.len() >= 2, "{rows:?}");
    assert!(
        filtered.iter().all(|r| r["processor_us"].as_u64().unwrap() > 0),
        "{filtered:?}"
    );
    // At $1 per CPU-second: 1,000 nUSD per ms of processor time.
    for r in &filtered {
        let (us, nusd) = (
            r["processor_us"].as_i64().unwrap(),
            r["cost"]["processor_nusd"].as_i64().unwrap(),
        );
        assert_eq!(nusd, (us * 1_000_000 + 500) / 1000, "{r}");
        assert_eq!(r["cost"]["total_nusd"], nusd, "{r}");
    }

    // Block mode: refused (non-streamed), an error event (streamed).
    let list: Value = serde_json::from_str(&admin(&data, &["--json", "tenant", "list"])).unwrap();
    assert!(list.as_array().unwrap().len() >= 4);
    let ps: Value = processor_list(&data, "filtered");
    let id = ps[0]["id"].as_str().unwrap().to_string();
    let cfg = enc(r#"{"blocked_words":["Paris"],"mode":"block"}"#);
    upload(
        &base,
        "filtered",
        "response-filter",
        example("response-filter"),
        &format!("&cpu_ms=1000&memory_mib=256&config={cfg}"),
    )
    .await;
    let (s, h, r) = post(&url, Some(&filter_key), &q).await;
    assert_eq!(s, 451, "{r}");
    assert!(
        r["error"]["message"].as_str().unwrap().contains("blocked content"),
        "{r}"
    );
    // The model did generate: the refused answer is metered with its tokens, by the relay
    // alone (one record, not a second, failed one from the refusal).
    let refused_id = h["x-request-id"].to_str().unwrap().to_string();
    let rows = usage_rows(&data);
    let mine: Vec<&Value> = rows.iter().filter(|r| r["request_id"] == refused_id.as_str()).collect();
    assert_eq!(mine.len(), 1, "{rows:?}");
    assert_eq!(mine[0]["status"], "completed", "{:?}", mine[0]);
    assert_eq!(mine[0]["completion_tokens"], 8, "{:?}", mine[0]);
    let resp = client()
        .post(&url)
        .bearer_auth(&filter_key)
        .json(&sq)
        .send()
        .await
        .unwrap();
    let events = sse_events(resp).await;
    assert!(
        events.iter().any(|e| e.contains("processor_rejected")),
        "the stream must end with the rejection: {events:?}"
    );
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    // Post-processors run by descending position: a mask at 20 sees the answer before a
    // block at 10, so the block never sees the word (ascending order would refuse it).
    let ordered = new_key(&data, "ordered");
    let block = enc(r#"{"blocked_words":["Paris"],"mode":"block"}"#);
    let mask = enc(r#"{"blocked_words":["Paris"],"mode":"mask"}"#);
    let q_small = "&cpu_ms=1000&memory_mib=256";
    upload(
        &base,
        "ordered",
        "blocker",
        example("response-filter"),
        &format!("{q_small}&position=10&config={block}"),
    )
    .await;
    upload(
        &base,
        "ordered",
        "masker",
        example("response-filter"),
        &format!("{q_small}&position=20&config={mask}"),
    )
    .await;
    let (s, _, r) = post(&url, Some(&ordered), &q).await;
    assert_eq!(s, 200, "{r}");
    assert_eq!(r["choices"][0]["message"]["content"], "The capital of France is ****.");
    let resp = client()
        .post(&url)
        .bearer_auth(&ordered)
        .json(&sq)
        .send()
        .await
        .unwrap();
    let streamed = streamed_text(resp).await;
    assert_eq!(streamed, "The capital of France is ****.");

    // The first version is kept, inactive.
    let ps: Value = processor_list(&data, "filtered");
    let first = ps.as_array().unwrap().iter().find(|p| p["id"] == id.as_str()).unwrap();
    assert_eq!(
        (first["version"].as_i64(), first["active"].as_bool()),
        (Some(1), Some(false))
    );

    // Every instance given to a request is counted by source; a processor's second request
    // a moment after its first finds its instance made ahead.
    let instances = || async {
        let text = metrics(&base).await;
        let n = |source: &str| {
            metric_sum(
                &text,
                &format!("hearth_processor_instances_total{{source=\"{source}\"}}"),
            )
        };
        (n("warm"), n("made"))
    };
    let (warm0, made0) = instances().await;
    assert!(made0 >= 1.0, "{made0}");
    let mut warm_now = warm0;
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let (s, _, r) = post(&url, Some(&ordered), &q).await;
        assert_eq!(s, 200, "{r}");
        // The two versions share their code and differ in configuration: each has its shelf.
        assert_eq!(r["choices"][0]["message"]["content"], "The capital of France is ****.");
        warm_now = instances().await.0;
        if warm_now >= warm0 + 2.0 {
            break;
        }
    }
    assert!(
        warm_now >= warm0 + 2.0,
        "no instance was taken warm: {warm0} -> {warm_now}"
    );
}

/// Hostile guests fail their own requests — quickly, with an error naming the processor and
/// the limit — and the gateway keeps serving everyone else meanwhile.
#[tokio::test]
async fn hostile_processors_are_contained() {
    let data = std::env::temp_dir().join(format!("hearth-e2e-hostile-{}", std::process::id()));
    std::fs::create_dir_all(&data).unwrap();
    let server = serve(&data);
    let base = server.url.clone();
    let url = format!("{base}/v1/chat/completions");
    let body = json!({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]});
    let good = new_key(&data, "good");
    let cases: [(&str, String, &str, &str); 4] = [
        (
            "spin",
            guest("(loop (br 0)) (i32.const 0)", ""),
            "&cpu_ms=30",
            "processor_cpu_limit",
        ),
        (
            "bomb",
            guest("(loop (drop (memory.grow (i32.const 16))) (br 0)) (i32.const 0)", ""),
            "&memory_mib=16",
            "processor_memory_limit",
        ),
        (
            "recurse",
            guest(
                "(call $down (i32.const 0))",
                "(func $down (param i32) (result i32) (call $down (i32.add (local.get 0) (i32.const 1))))",
            ),
            "",
            "processor_trap",
        ),
        (
            "huge",
            guest(
                r#"(drop (memory.grow (i32.const 40)))
                   (i32.store8 (i32.const 128) (i32.const 1))
                   (i32.store (i32.const 132) (i32.const 65536))
                   (i32.store (i32.const 136) (i32.const 2097152))
                   (i32.const 128)"#,
                "",
            ),
            "",
            "processor_output_too_large",
        ),
    ];
    for (name, wat, query, code) in cases {
        let key = new_key(&data, name);
        upload(&base, name, name, component(&wat).unwrap(), query).await;
        // A hostile request and a good one at the same time: the good one is not held up.
        let hostile = {
            let url = url.clone();
            let body = body.clone();
            tokio::spawn(async move {
                let t = Instant::now();
                let r = post(&url, Some(&key), &body).await;
                (r, t.elapsed())
            })
        };
        let (s, _, r) = post(&url, Some(&good), &body).await;
        assert_eq!(s, 200, "{name}: a good tenant failed: {r}");
        let ((s, _, r), took) = hostile.await.unwrap();
        assert_eq!(s, 500, "{name}: {r}");
        assert_eq!(r["error"]["code"], code, "{name}: {r}");
        assert_eq!(r["error"]["type"], "processor_error");
        let m = r["error"]["message"].as_str().unwrap();
        assert!(m.contains(&format!("processor '{name}' v1")), "{m}");
        assert!(took < Duration::from_secs(5), "{name} took {took:?}");
    }
    // A component importing something the world does not offer is refused at upload.
    let evil = hearth_runtime::wat_guest::component_for(
        r#"(module
  (import "$root" "steal-secrets" (func (param i32)))
  (memory (export "memory") 1)
  (func (export "cabi_realloc") (param i32 i32 i32 i32) (result i32) (i32.const 1024))
  (func (export "on-request") (result i32) (i32.const 0)))"#,
        "package evil:guest;\nworld processor {\n  import steal-secrets: func() -> string;\n  export on-request: func() -> u32;\n}",
        "processor",
    )
    .unwrap();
    let r = client()
        .post(format!("{base}/admin/v1/tenants/good/processors?name=evil"))
        .bearer_auth(ADMIN_TOKEN)
        .body(evil)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let e: Value = r.json().await.unwrap();
    assert!(e["error"]["message"].as_str().unwrap().contains("steal-secrets"), "{e}");
    // Still serving.
    assert_eq!(post(&url, Some(&good), &body).await.0, 200);
    std::fs::remove_dir_all(&data).ok();
}

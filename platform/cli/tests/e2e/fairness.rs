//! Admission control end to end: a gateway in front of a slow sim worker with a small
//! queue. A flooding tenant fills the queue and is shed with 503 `overloaded` and a
//! `retry-after`; a steady tenant is still admitted beside it; batch work (by the tenant's
//! class or the request's `service_tier`) is shed first; every refusal is a usage row and a
//! metric by tenant and class.

use std::time::Duration;

use crate::harness::*;
use serde_json::{json, Value};

/// The worker's queue, in prompt tokens not yet computed.
const QUEUE: &str = "600";

/// A completion request whose prompt (about 100 tokens) shares nothing with the others', so
/// that all of it queues.
fn body(i: usize, extra: Value) -> Value {
    let prompt: Vec<String> = (0..30).map(|k| format!("r{i}w{k}")).collect();
    let mut b = json!({"model": MODEL, "max_tokens": 1, "prompt": prompt.join(" ")});
    b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    b
}

#[tokio::test]
async fn a_saturated_pool_sheds_the_flooder_and_batch_work_first() {
    let data = temp_dir("fairness");
    // 0.01× the sim's cost model: prefill at 120 tokens/s, so the queue takes seconds.
    let worker = spawn(&[
        "worker",
        "--listen",
        "127.0.0.1:0",
        "--backend",
        "sim",
        "--sim-speedup",
        "0.01",
        "--max-queue-tokens",
        QUEUE,
    ]);
    let gateway = gateway_with(&data, &worker.url, &[], &[]);
    let flood = new_key(&data, "flood");
    let steady = new_key(&data, "steady");
    let bulk = new_key(&data, "bulk");
    admin(&data, &["tenant", "limits", "bulk", "--priority", "batch"]);
    let url = format!("{}/v1/completions", gateway.url);

    // A bad class is a clear 400.
    let r = client()
        .post(&url)
        .bearer_auth(&steady)
        .header("x-hearth-priority", "urgent")
        .json(&body(0, json!({})))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["param"], "x-hearth-priority", "{e}");

    // The flooder sends 40 at once: the queue holds about six.
    let floods: Vec<_> = (0..40)
        .map(|i| {
            let (url, key) = (url.clone(), flood.clone());
            tokio::spawn(async move { post(&url, Some(&key), &body(i, json!({}))).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(700)).await;
    // While the flood is queued: the steady tenant is admitted (it holds nothing of the
    // queue), batch work is shed (the queue is past half), by class or by service_tier.
    // (At once: the steady request waits in the queue for seconds.)
    let (steady_body, bulk_body, flex_body) = (
        body(100, json!({})),
        body(101, json!({})),
        body(102, json!({"service_tier": "flex"})),
    );
    let ((steady_status, _, steady_body), (bulk_status, bulk_headers, bulk_body), (flex_status, _, flex_body)) = tokio::join!(
        post(&url, Some(&steady), &steady_body),
        post(&url, Some(&bulk), &bulk_body),
        post(&url, Some(&steady), &flex_body),
    );
    let mut shed = 0;
    let mut ok = 0;
    for f in floods {
        let (status, headers, b) = f.await.unwrap();
        match status {
            200 => ok += 1,
            503 => {
                assert_eq!(b["error"]["code"], "overloaded", "{b}");
                assert_eq!(b["error"]["type"], "server_error", "{b}");
                let retry: u64 = headers["retry-after"].to_str().unwrap().parse().unwrap();
                assert!((1..=60).contains(&retry), "retry-after {retry}");
                shed += 1;
            }
            s => panic!("flood request: {s} {b}"),
        }
    }
    assert!(
        ok > 0 && shed > 0,
        "the flood was partly served ({ok}) and partly shed ({shed})"
    );
    assert_eq!(
        steady_status, 200,
        "the steady tenant is admitted beside the flood: {steady_body}"
    );
    assert_eq!(bulk_status, 503, "batch work is shed first: {bulk_body}");
    assert_eq!(bulk_body["error"]["code"], "overloaded");
    assert!(bulk_headers.contains_key("retry-after"));
    assert_eq!(flex_status, 503, "service_tier flex is batch: {flex_body}");

    let metrics = metrics(&gateway.url).await;
    let shed_flood = metric_sum(
        &metrics,
        &format!("hearth_shed_requests_total{{model=\"{MODEL}\",tenant=\"flood\",priority=\"interactive\"}}"),
    );
    // Those the worker itself refused (the gateway's view lags its queue by a moment)
    // are 503s too, but not the gateway's sheds.
    assert!(shed_flood >= 1.0 && shed_flood <= shed as f64, "{shed_flood} vs {shed}");
    assert_eq!(
        metric_sum(
            &metrics,
            &format!("hearth_shed_requests_total{{model=\"{MODEL}\",tenant=\"bulk\",priority=\"batch\"}}")
        ),
        1.0
    );
    assert!(metrics.contains("hearth_tenant_time_to_first_token_seconds_count{"));

    // Every request, served or shed, has its usage row.
    let rows = usage_rows(&data);
    assert_eq!(rows.len(), 1 + 40 + 3, "{} rows", rows.len());
    let overloaded = rows.iter().filter(|r| r["error_code"] == "overloaded").count();
    assert_eq!(overloaded, shed + 2);

    // Once the queue has drained, batch work is admitted again (work-conserving).
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (status, _, b) = post(&url, Some(&bulk), &body(103, json!({}))).await;
    assert_eq!(status, 200, "{b}");
}

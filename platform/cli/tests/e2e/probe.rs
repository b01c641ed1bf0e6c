//! The outside probe of issue 78, its requests replayed against real `hearth` processes on
//! the sim backend: credentials are checked before a large body is read, and the body
//! budget is shared out so that one tenant or client cannot hold all of it; one tenant's
//! batches cannot starve another's.

use std::time::Duration;

use crate::harness::*;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Sends a request head announcing `length` bytes of body (and none of it, or `send` bytes
/// of it); returns the connection.
async fn head(url: &str, method_path: &str, auth: &str, length: usize, send: usize) -> TcpStream {
    let addr = url.trim_start_matches("http://");
    let mut s = TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "{method_path} HTTP/1.1\r\nHost: {addr}\r\n{auth}Content-Type: multipart/form-data; boundary=b\r\nContent-Length: {length}\r\n\r\n"
    );
    s.write_all(head.as_bytes()).await.unwrap();
    let chunk = vec![b'x'; 1 << 20];
    let mut sent = 0;
    while sent < send {
        let n = chunk.len().min(send - sent);
        if s.write_all(&chunk[..n]).await.is_err() {
            break; // refused: the server closed the connection
        }
        sent += n;
    }
    s
}

/// The status line's code of the answer on `s`, if one comes within `wait`.
async fn answer(s: &mut TcpStream, wait: Duration) -> Option<u16> {
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(wait, s.read(&mut buf)).await.ok()?.ok()?;
    let text = String::from_utf8_lossy(&buf[..n]).to_string();
    text.split_whitespace().nth(1)?.parse().ok()
}

/// Issue 78, finding 2: a 50 MB upload without a credential (or with a wrong one, or
/// without the scope, or past the file quota) is answered at once, before its body is sent;
/// one tenant holding uploads open cannot take the body budget from another tenant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credentials_are_checked_before_large_bodies_and_the_budget_is_shared() {
    let data = temp_dir("probe-bodies");
    let server = sim_serve_with(
        &data,
        "100000",
        &["--body-read-timeout-secs", "120", "--tenant-file-bytes", "100000000"],
    );
    let key_a = new_key(&data, "hog");
    let key_b = new_key(&data, "neighbour");
    let wait = Duration::from_secs(10);
    let bearer = |k: &str| format!("Authorization: Bearer {k}\r\n");
    for (path, auth, want) in [
        ("POST /v1/files", String::new(), 401),
        ("POST /v1/files", bearer("hk_wrong"), 401),
        ("POST /v1/tenant/adapters", String::new(), 401),
        (
            "POST /admin/v1/tenants/hog/adapters",
            bearer("not-the-admin-token"),
            401,
        ),
        // Past the tenant's file quota (100 MB; within the route's 101 MiB): 413 before the
        // body.
        ("POST /v1/files", bearer(&key_a), 413),
    ] {
        let length = if want == 413 { 101_000_000 } else { 50_000_000 };
        let mut s = head(&server.url, path, &auth, length, 0).await;
        assert_eq!(answer(&mut s, wait).await, Some(want), "{path} with {auth:?}");
    }

    // Tenant A opens six uploads of 99 MB and sends 90 MB of each, holding them open: it
    // may hold its share of the 512 MiB budget (a quarter, or its largest upload), not all.
    let mut held = Vec::new();
    let mut refused = 0;
    for _ in 0..6 {
        let mut s = head(&server.url, "POST /v1/files", &bearer(&key_a), 99_000_000, 90_000_000).await;
        // Still being read (held), or refused: a 503, or the connection closed (the reset
        // of a socket closed with unread data can overtake the 503).
        let mut buf = [0u8; 4096];
        match tokio::time::timeout(Duration::from_millis(500), s.read(&mut buf)).await {
            Err(_) => {}
            Ok(Ok(n)) if n > 0 => {
                let text = String::from_utf8_lossy(&buf[..n]).to_string();
                assert!(text.contains(" 503 "), "{text}");
                refused += 1;
            }
            Ok(_) => refused += 1,
        }
        held.push(s);
    }
    assert!(refused >= 3, "{refused} of A's six uploads refused");
    // Tenant B's 9 MB upload is served beside them.
    let form = reqwest::multipart::Form::new().text("purpose", "batch").part(
        "file",
        reqwest::multipart::Part::bytes(vec![b'\n'; 9_000_000]).file_name("b.jsonl"),
    );
    let r = client()
        .post(format!("{}/v1/files", server.url))
        .bearer_auth(&key_b)
        .multipart(form)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let body: Value = r.json().await.unwrap_or(Value::Null);
    assert!(status < 500, "B's upload was starved: {status} {body}");
    drop(held);
}

/// Issue 78, finding 7: a key restricted to some models sees only the files, batches and
/// stored responses it created; an unrestricted key of the tenant sees all of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_restricted_key_sees_only_its_own_files_batches_and_responses() {
    use serde_json::json;
    let data = temp_dir("probe-visibility");
    let server = sim_serve_with(&data, "100000", &[]);
    let all = new_key(&data, "shared");
    let out = admin(&data, &["key", "create", "--tenant", "shared", "--models", MODEL]);
    let narrow = out
        .split_whitespace()
        .find(|w| w.starts_with("hk_"))
        .unwrap()
        .to_string();
    let url = &server.url;
    let upload = |key: String| async move {
        let form = reqwest::multipart::Form::new().text("purpose", "batch").part(
            "file",
            reqwest::multipart::Part::bytes(
                json!({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}})
                .to_string()
                .into_bytes(),
            )
            .file_name("in.jsonl"),
        );
        let r = client()
            .post(format!("{url}/v1/files"))
            .bearer_auth(&key)
            .multipart(form)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        r.json::<Value>().await.unwrap()["id"].as_str().unwrap().to_string()
    };
    let get = |path: String, key: String| async move {
        let r = client()
            .get(format!("{url}{path}"))
            .bearer_auth(&key)
            .send()
            .await
            .unwrap();
        (r.status().as_u16(), r.json::<Value>().await.unwrap_or(Value::Null))
    };
    let theirs = upload(all.clone()).await;
    let mine = upload(narrow.clone()).await;
    let (s, _, batch) = post(
        &format!("{url}/v1/batches"),
        Some(&all),
        &json!({"input_file_id": theirs, "endpoint": "/v1/chat/completions", "completion_window": "24h"}),
    )
    .await;
    assert_eq!(s, 200, "{batch}");
    let batch = batch["id"].as_str().unwrap().to_string();
    let (s, _, resp) = post(
        &format!("{url}/v1/responses"),
        Some(&all),
        &json!({"model": MODEL, "input": "hi", "max_output_tokens": 2}),
    )
    .await;
    assert_eq!(s, 200, "{resp}");
    let resp = resp["id"].as_str().unwrap().to_string();

    // The narrow key: none of the other key's, by id or in a list.
    for path in [
        format!("/v1/files/{theirs}"),
        format!("/v1/files/{theirs}/content"),
        format!("/v1/batches/{batch}"),
        format!("/v1/responses/{resp}"),
        format!("/v1/responses/{resp}/input_items"),
    ] {
        assert_eq!(get(path.clone(), narrow.clone()).await.0, 404, "{path}");
    }
    let (_, files) = get("/v1/files".into(), narrow.clone()).await;
    let ids: Vec<&str> = files["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|f| f["id"].as_str())
        .collect();
    assert_eq!(ids, vec![mine.as_str()], "{files}");
    let (_, batches) = get("/v1/batches".into(), narrow.clone()).await;
    assert_eq!(batches["data"].as_array().unwrap().len(), 0, "{batches}");
    let (s, _, r) = post(
        &format!("{url}/v1/responses"),
        Some(&narrow),
        &json!({"model": MODEL, "input": "more", "max_output_tokens": 2, "previous_response_id": resp}),
    )
    .await;
    assert_eq!(s, 404, "{r}");
    let (s, _, r) = post(
        &format!("{url}/v1/batches"),
        Some(&narrow),
        &json!({"input_file_id": theirs, "endpoint": "/v1/chat/completions", "completion_window": "24h"}),
    )
    .await;
    assert_eq!((s, r["error"]["param"].as_str()), (400, Some("input_file_id")), "{r}");
    let (s, _, r) = post(&format!("{url}/v1/batches/{batch}/cancel"), Some(&narrow), &json!({})).await;
    assert_eq!(s, 404, "another key's batch cannot be cancelled: {r}");
    // The unrestricted key sees the narrow key's file as well as its own.
    assert_eq!(get(format!("/v1/files/{mine}"), all.clone()).await.0, 200);
    let (_, files) = get("/v1/files".into(), all.clone()).await;
    assert_eq!(files["data"].as_array().unwrap().len(), 2, "{files}");
    let _ = post(&format!("{url}/v1/batches/{batch}/cancel"), Some(&all), &json!({})).await;
}

/// Issue 78, finding 4 (in flight): `count_tokens` takes one of the tenant's requests in
/// flight like any request: with one allowed and a generation streaming, it is refused
/// (429, Anthropic's shape); once the generation ends it is counted again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn count_tokens_waits_for_the_requests_in_flight() {
    use futures_util::StreamExt;
    use serde_json::json;
    let data = temp_dir("probe-count-inflight");
    // 30 ms a token: 150 tokens stream for about 4.5 s.
    let server = sim_serve_with(&data, "1", &[]);
    let key = new_key(&data, "one-at-a-time");
    admin(&data, &["tenant", "limits", "one-at-a-time", "--concurrent", "1"]);
    let url = &server.url;
    let count = || {
        client()
            .post(format!("{url}/v1/messages/count_tokens"))
            .header("x-api-key", &key)
            .json(&json!({"model": MODEL, "messages": [{"role": "user", "content": "Tell me about Paris."}]}))
            .send()
    };
    let stream = client()
        .post(format!("{url}/v1/chat/completions"))
        .bearer_auth(&key)
        .json(
            &json!({"model": MODEL, "stream": true, "max_tokens": 150, "ignore_eos": true,
                      "messages": [{"role": "user", "content": "Go on."}]}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(stream.status(), 200);
    let mut body = stream.bytes_stream();
    // The first token is out: the generation holds the tenant's one slot.
    let _ = body.next().await;
    let r = count().await.unwrap();
    assert_eq!(r.status(), 429);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["type"], "rate_limit_error", "{v}");
    while body.next().await.is_some() {}
    let r = count().await.unwrap();
    assert_eq!(r.status(), 200, "{:?}", r.text().await);
}

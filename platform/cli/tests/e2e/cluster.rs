//! Scale-out end to end: two gateways and three workers that registered themselves in
//! Redis (plus one with the wrong token, which never joins), sharing one database. The
//! same `x-session-affinity` reaches the same worker through either gateway; a SIGKILLed
//! worker leaves both pools within its heartbeat window and its stream in flight continues
//! on another worker; a new worker joins; a SIGTERMed worker finishes its
//! stream, refuses new work (served by the others) and exits; every request has exactly
//! one usage record.
//!
//! Workers run the sim backend (the real worker server, scheduler and registration, with
//! simulated compute), so streams last a predictable time.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::harness::*;
use futures_util::StreamExt;
use serde_json::{json, Value};

const TOKEN: &str = "cluster-e2e-worker-token";
const HEARTBEAT_MS: u64 = 300;

struct Cluster {
    prefix: String,
    redis: String,
}

impl Cluster {
    fn worker(&self, region: &str, token: &str) -> Proc {
        let hb = HEARTBEAT_MS.to_string();
        spawn_with_env(
            &[
                "worker",
                "--listen",
                "127.0.0.1:0",
                "--backend",
                "sim",
                "--sim-speedup",
                "10",
                "--region",
                region,
                "--redis-url",
                &self.redis,
                "--redis-prefix",
                &self.prefix,
                "--heartbeat-ms",
                &hb,
                "--drain-timeout-secs",
                "20",
            ],
            &[("HEARTH_WORKER_TOKEN", token)],
        )
    }

    fn gateway(&self, data: &Path, db_url: &str, region: &str) -> Proc {
        spawn_with_env(
            &[
                "gateway",
                "--listen",
                "127.0.0.1:0",
                "--data-dir",
                data.to_str().unwrap(),
                "--database-url",
                db_url,
                "--redis-url",
                &self.redis,
                "--redis-prefix",
                &self.prefix,
                "--discover",
                "--discovery-interval-ms",
                "200",
                "--region",
                region,
                "--shutdown-delay-secs",
                "1",
                "--drain-timeout-secs",
                "3",
            ],
            &[("HEARTH_WORKER_TOKEN", TOKEN)],
        )
    }
}

/// The gateway's pool for the model: worker name → prompt tokens it finished.
async fn pool(gateway: &str) -> Vec<(String, u64)> {
    let r = get_json(&format!("{gateway}/admin/v1/routing"), ADMIN_TOKEN).await;
    let Some(model) = r["data"]
        .as_array()
        .and_then(|d| d.iter().find(|m| m["model"] == MODEL))
    else {
        return Vec::new();
    };
    let mut v: Vec<(String, u64)> = model["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| {
            (
                w["name"].as_str().unwrap().to_string(),
                w["prompt_tokens"].as_u64().unwrap(),
            )
        })
        .collect();
    v.sort();
    v
}

fn names(p: &[(String, u64)]) -> Vec<String> {
    p.iter().map(|(n, _)| n.clone()).collect()
}

/// Waits until both gateways' pools are exactly `want` (sorted worker URLs).
async fn wait_for_pools(gateways: [&str; 2], want: &[String], within: Duration) -> Duration {
    let start = Instant::now();
    loop {
        let a = names(&pool(gateways[0]).await);
        let b = names(&pool(gateways[1]).await);
        if a == want && b == want {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < within,
            "pools {a:?} / {b:?}, want {want:?} within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Each session its own cache namespace (`prompt_cache_key`): sessions do not share cached
/// prefixes, so the router spreads them over the workers rather than onto the one that
/// holds the chat template's common start.
fn body(session_text: &str, max_tokens: u32, stream: bool) -> Value {
    json!({"model": MODEL, "max_tokens": max_tokens, "stream": stream, "prompt_cache_key": session_text,
        "messages": [{"role": "user", "content": format!("Tell me about {session_text}.")}]})
}

/// Sends one request for `session` through `gateway`; the worker it went to (by the
/// gateway's own accounting) and the status.
async fn one(gateway: &str, key: &str, session: &str) -> (String, u16) {
    let before = pool(gateway).await;
    let resp = client()
        .post(format!("{gateway}/v1/chat/completions"))
        .bearer_auth(key)
        .header("x-session-affinity", session)
        .json(&body(session, 3, false))
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let text = resp.text().await.unwrap();
    assert_eq!(status, 200, "{text}");
    // The relay counts the usage right after the answer.
    for _ in 0..100 {
        let after = pool(gateway).await;
        let moved: Vec<&String> = after
            .iter()
            .filter(|(n, t)| before.iter().find(|(b, _)| b == n).map_or(*t > 0, |(_, bt)| t > bt))
            .map(|(n, _)| n)
            .collect();
        if moved.len() == 1 {
            return (moved[0].clone(), status);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("could not tell which worker served {session}");
}

/// A streamed request: the response, once its first content chunk arrived.
async fn start_stream(
    gateway: &str,
    key: &str,
    session: &str,
    max_tokens: u32,
) -> futures_util::stream::BoxStream<'static, reqwest::Result<axum::body::Bytes>> {
    let resp = client()
        .post(format!("{gateway}/v1/chat/completions"))
        .bearer_auth(key)
        .header("x-session-affinity", session)
        .json(&body(session, max_tokens, true))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut s = resp.bytes_stream().boxed();
    let first = tokio::time::timeout(Duration::from_secs(10), s.next())
        .await
        .expect("a first chunk")
        .unwrap()
        .unwrap();
    futures_util::stream::iter([Ok(first)]).chain(s).boxed()
}

/// The rest of an SSE stream, as text, within `within` (it must not hang).
async fn finish_stream(
    mut s: futures_util::stream::BoxStream<'static, reqwest::Result<axum::body::Bytes>>,
    within: Duration,
) -> String {
    let mut text = String::new();
    tokio::time::timeout(within, async {
        while let Some(chunk) = s.next().await {
            match chunk {
                Ok(b) => text.push_str(&String::from_utf8_lossy(&b)),
                Err(e) => {
                    text.push_str(&format!("\n<transport error: {e}>"));
                    break;
                }
            }
        }
    })
    .await
    .expect("the stream ended in time");
    text
}

fn signal(p: &Proc, sig: &str) {
    let ok = std::process::Command::new("kill")
        .args([format!("-{sig}"), p.child.id().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill -{sig}");
}

#[tokio::test]
async fn gateways_share_sessions_and_follow_workers_joining_leaving_and_draining() {
    let data_a = temp_dir("cluster-a");
    let data_b = temp_dir("cluster-b");
    let (_pg, db_url) = one_database(&data_a).await;
    let c = Cluster {
        prefix: format!("hearth-cluster-{}-{}:", std::process::id(), hearth_tenants::now_ms()),
        redis: redis_url(),
    };
    let mut workers = vec![c.worker("eu", TOKEN), c.worker("eu", TOKEN), c.worker("us", TOKEN)];
    // A process without the workers' token registers too, and is never used.
    let stray = c.worker("eu", "not-the-token");
    // Gateways in two regions: each prefers its own region's workers, and a session
    // placed through one stays on its worker through the other.
    let ga = c.gateway(&data_a, &db_url, "eu");
    let gb = c.gateway(&data_b, &db_url, "us");
    let (ga_url, gb_url) = (ga.url.clone(), gb.url.clone());
    let gws = [ga_url.as_str(), gb_url.as_str()];
    let mut want: Vec<String> = workers.iter().map(|w| w.url.clone()).collect();
    want.sort();
    wait_for_pools(gws, &want, Duration::from_secs(30)).await;
    assert!(!names(&pool(&ga.url).await).contains(&stray.url));

    let cli = |args: &[&str]| {
        let mut full = vec!["--database-url", db_url.as_str()];
        full.extend_from_slice(args);
        admin(&data_a, &full)
    };
    cli(&["tenant", "create", "acme"]);
    let out = cli(&["key", "create", "--tenant", "acme"]);
    let key = out
        .split_whitespace()
        .find(|w| w.starts_with("hk_"))
        .unwrap()
        .to_string();
    let mut sent = 0usize;
    let mut succeeded = 0usize;

    // Shared affinity: each session's requests, alternating between the gateways, reach
    // one worker.
    let mut placed: Vec<(String, String)> = Vec::new(); // (session, worker)
    for i in 0..24 {
        let session = format!("session-{i}");
        let mut seen = Vec::new();
        for round in 0..4 {
            let (w, _) = one(gws[(round + i) % 2], &key, &session).await;
            seen.push(w);
            sent += 1;
            succeeded += 1;
        }
        assert!(
            seen.iter().all(|w| *w == seen[0]),
            "{session} went to {seen:?} through the two gateways"
        );
        placed.push((session, seen[0].clone()));
        // Enough sessions to have one on each worker (they spread by load and cache).
        if i >= 5 && want.iter().all(|w| placed.iter().any(|(_, p)| p == w)) {
            break;
        }
    }
    // Redis is unreachable for 2 s and comes back without the registry (a restart without
    // persistence): both gateways keep their pools all along, and the workers re-register.
    let redis_cli = |args: &[&str]| {
        let out = std::process::Command::new("redis-cli")
            .args(["-u", &c.redis])
            .args(args)
            .output()
            .expect("redis-cli");
        assert!(out.status.success(), "redis-cli {args:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    let pattern = format!("{}worker*", c.prefix);
    let keys = redis_cli(&["--scan", "--pattern", &pattern]);
    let mut del = vec!["DEL"];
    del.extend(keys.split_whitespace());
    assert!(del.len() >= 5, "the index and the records: {del:?}");
    redis_cli(&["CLIENT", "PAUSE", "2000", "ALL"]);
    redis_cli(&del); // runs when the pause ends
    let until = Instant::now() + Duration::from_secs(3);
    while Instant::now() < until {
        assert_eq!(names(&pool(gws[0]).await), want, "a pool changed after the outage");
        assert_eq!(names(&pool(gws[1]).await), want, "a pool changed after the outage");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        !redis_cli(&["--scan", "--pattern", &pattern]).trim().is_empty(),
        "re-registered"
    );

    let on = |worker: &str| {
        placed
            .iter()
            .find(|(_, p)| p == worker)
            .map(|(s, _)| s.clone())
            .unwrap_or_else(|| panic!("no session on {worker}: {placed:?}"))
    };

    // SIGKILL a worker with a stream in flight: the stream continues on another worker
    // (failover from the tokens already sent), and both gateways drop the worker within
    // its heartbeat window.
    let victim = workers.remove(1);
    let victim_session = on(&victim.url);
    let stream = start_stream(&ga.url, &key, &victim_session, 2000).await;
    sent += 1;
    let mut victim = victim;
    victim.child.kill().unwrap();
    victim.child.wait().unwrap();
    let killed_at = Instant::now();
    let text = finish_stream(stream, Duration::from_secs(30)).await;
    assert!(
        !text.contains("\"error\""),
        "the stream continues on another worker: {text}"
    );
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    succeeded += 1;
    want.retain(|w| *w != victim.url);
    wait_for_pools(gws, &want, Duration::from_millis(3 * HEARTBEAT_MS + 2_000)).await;
    let gone_after = killed_at.elapsed();
    // Its sessions move to one live worker, through both gateways.
    let mut moved = Vec::new();
    for round in 0..4 {
        moved.push(one(gws[round % 2], &key, &victim_session).await.0);
        sent += 1;
        succeeded += 1;
    }
    assert!(moved.iter().all(|w| *w == moved[0]), "{moved:?}");

    // A new worker joins both pools.
    let added = c.worker("us", TOKEN);
    want.push(added.url.clone());
    want.sort();
    let joined_in = wait_for_pools(gws, &want, Duration::from_secs(10)).await;
    workers.push(added);

    // SIGTERM a worker with a stream in flight: the stream finishes normally, new
    // requests (even its own sessions') are served by the others, and it exits.
    let leaving = workers.remove(0);
    let leaving_session = on(&leaving.url);
    let stream = start_stream(&gb.url, &key, &leaving_session, 300).await;
    sent += 1;
    signal(&leaving, "TERM");
    let deadline = Instant::now() + Duration::from_secs(5);
    while client()
        .get(format!("{}/readyz", leaving.url))
        .send()
        .await
        .is_ok_and(|r| r.status() == 200)
    {
        assert!(Instant::now() < deadline, "the worker reports draining");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for round in 0..4 {
        let (w, _) = one(gws[round % 2], &key, &leaving_session).await;
        assert_ne!(w, leaving.url, "a draining worker takes nothing new");
        sent += 1;
        succeeded += 1;
    }
    let text = finish_stream(stream, Duration::from_secs(20)).await;
    assert!(!text.contains("\"error\""), "the drained stream finishes: {text}");
    assert!(text.contains("\"finish_reason\":\"length\""), "{text}");
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    succeeded += 1;
    let mut leaving = leaving;
    let status = wait_exit(&mut leaving, Duration::from_secs(15)).await;
    assert!(status.success(), "the drained worker exits cleanly: {status}");
    want.retain(|w| *w != leaving.url);
    wait_for_pools(gws, &want, Duration::from_secs(5)).await;

    // SIGTERM a gateway with two streams in flight: it stops being ready at once; the
    // short stream (≈ 2 s) outlives the 1 s shutdown delay and finishes, the long one
    // (≈ 15 s) is ended at the 3 s drain timeout with `shutting_down` and a usage record;
    // it flushes its usage and exits.
    let stream = start_stream(&gb.url, &key, "last-words", 600).await;
    let long = start_stream(&gb.url, &key, "cut-off", 5000).await;
    sent += 2;
    signal(&gb, "TERM");
    // Within its shutdown delay (1 s) the gateway still answers, and says it is not ready.
    let mut not_ready = false;
    for _ in 0..40 {
        match client().get(format!("{}/readyz", gb.url)).send().await {
            Ok(r) if r.status() == 503 => {
                not_ready = true;
                break;
            }
            Ok(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            Err(_) => break,
        }
    }
    assert!(not_ready, "a draining gateway reports it is not ready");
    let text = finish_stream(stream, Duration::from_secs(20)).await;
    assert!(!text.contains("\"error\""), "{text}");
    assert!(text.contains("\"finish_reason\":\"length\""), "{text}");
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    succeeded += 1;
    let text = finish_stream(long, Duration::from_secs(20)).await;
    assert!(text.contains("\"error\"") && text.contains("drain timeout"), "{text}");
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    let mut gb = gb;
    let status = wait_exit(&mut gb, Duration::from_secs(15)).await;
    assert!(status.success(), "the drained gateway exits cleanly: {status}");
    let ready = client().get(format!("{}/readyz", ga.url)).send().await.unwrap();
    assert_eq!(ready.status(), 200);

    // Every request has exactly one usage record, whichever gateway served it: the
    // successes completed (the killed worker's stream among them), the stream cut at the
    // drain timeout failed with what it had generated.
    let rows = usage_rows_with(&data_a, &["--database-url", db_url.as_str()]);
    assert_eq!(rows.len(), sent, "{rows:?}");
    let completed = rows.iter().filter(|r| r["status"] == "completed").count();
    assert_eq!(completed, succeeded);
    let mut failed: Vec<&Value> = rows.iter().filter(|r| r["status"] == "failed").collect();
    failed.sort_by_key(|r| r["error_code"].as_str().unwrap_or("").to_string());
    let codes: Vec<&str> = failed.iter().map(|r| r["error_code"].as_str().unwrap_or("")).collect();
    assert_eq!(codes, ["shutting_down"], "{failed:?}");
    assert!(failed.iter().all(|r| r["completion_tokens"].as_u64().unwrap() > 0));
    eprintln!(
        "cluster e2e: {sent} requests, {} sessions placed; killed worker left both pools after {gone_after:?}; new worker joined in {joined_in:?}",
        placed.len()
    );
}

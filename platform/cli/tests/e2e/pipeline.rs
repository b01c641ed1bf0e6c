//! Pipeline parallelism through the whole product, as separate processes: `hearth serve
//! --pipeline N` answers as one process does on 2 and 3 stages; a model one worker refuses
//! under a memory budget is served by two stages under the same budget each; a stage
//! SIGKILLed mid-stream ends the stream with a clear error and one usage row, and the
//! group serves again once the stage is back.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::harness::*;
use futures_util::StreamExt;
use serde_json::json;

async fn answer(p: &Proc, key: &str) -> (u16, String) {
    let (status, _, body) = post(
        &format!("{}/v1/chat/completions", p.url),
        Some(key),
        &chat_body(json!({"max_tokens": 24, "temperature": 0})),
    )
    .await;
    let text = body["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    (status, if status == 200 { text } else { body.to_string() })
}

fn serve_args<'a>(data: &'a Path, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec!["serve", "--listen", "127.0.0.1:0", "--data-dir", data.to_str().unwrap()];
    args.extend_from_slice(extra);
    args
}

/// The stage processes `serve --pipeline` started (children of any of its threads).
fn stage_pids(parent: u32) -> Vec<u32> {
    let mut pids = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{parent}/task"))
        .unwrap()
        .map(Result::unwrap)
    {
        let children = std::fs::read_to_string(task.path().join("children")).unwrap_or_default();
        pids.extend(children.split_whitespace().filter_map(|p| p.parse::<u32>().ok()));
    }
    pids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pipeline_group_answers_as_one_process_and_survives_a_lost_stage() {
    let data = temp_dir("pipeline");
    let one = spawn(&serve_args(&data, &["--kv-cache-mib", "32"]));
    let key = new_key(&data, "pipe");
    let (status, want) = answer(&one, &key).await;
    assert_eq!(status, 200, "{want}");
    drop(one);
    for n in ["2", "3"] {
        let group = spawn(&serve_args(&data, &["--kv-cache-mib", "32", "--pipeline", n]));
        let (status, got) = answer(&group, &key).await;
        assert_eq!((status, got.as_str()), (200, want.as_str()), "{n} stages");
    }

    // A follower killed mid-stream.
    let group = spawn(&serve_args(&data, &["--kv-cache-mib", "32", "--pipeline", "2"]));
    assert_eq!(answer(&group, &key).await.0, 200);
    let before = usage_rows(&data).len();
    let resp = client()
        .post(format!("{}/v1/chat/completions", group.url))
        .bearer_auth(&key)
        .json(&chat_body(json!({"max_tokens": 400, "temperature": 0, "stream": true,
            "stream_options": {"include_usage": true}})))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut stream = resp.bytes_stream();
    let mut text = String::new();
    while !text.contains("\"content\"") {
        text.push_str(&String::from_utf8_lossy(&stream.next().await.unwrap().unwrap()));
    }
    let stages = stage_pids(group.child.id());
    assert_eq!(stages.len(), 1, "{stages:?}");
    unsafe { libc::kill(stages[0] as i32, libc::SIGKILL) };
    let rest = tokio::time::timeout(Duration::from_secs(60), async {
        while let Some(chunk) = stream.next().await {
            text.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
        }
    })
    .await;
    assert!(rest.is_ok(), "the stream hung after its stage died");
    assert!(text.contains("\"error\""), "the stream ended without an error: {text}");
    assert!(text.trim_end().ends_with("[DONE]"), "{text}");
    // One usage row for the request, not two and not none.
    assert_eq!(usage_rows(&data).len(), before + 1);
    // The stage is started again and the group serves again.
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let (status, got) = answer(&group, &key).await;
        if status == 200 {
            assert_eq!(got, want, "after the stage came back");
            break;
        }
        assert!(Instant::now() < deadline, "the group did not come back: {got}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let again = stage_pids(group.child.id());
    assert_eq!(again.len(), 1);
    assert_ne!(again, stages);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_one_worker_refuses_is_served_by_two_stages_under_the_same_budget() {
    let data = temp_dir("pipeline-budget");
    let model = hearth_engine::formats::fetch::ensure_model(
        hearth_engine::formats::fetch::DEFAULT_MODEL_ID,
        &hearth_engine::formats::fetch::hearth_home(),
        &mut |_| {},
    )
    .unwrap();
    let file_mib = std::fs::metadata(&model).unwrap().len() >> 20;
    // Under the whole model (and its 16 MiB of KV), over the larger of two stages.
    let budget = (file_mib * 85 / 100 + 16).to_string();
    let out = std::process::Command::new(bin())
        .args([
            "worker",
            "--listen",
            "127.0.0.1:0",
            "--kv-cache-mib",
            "16",
            "--memory-budget-mib",
            &budget,
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--pipeline") && err.contains("--stage"), "{err}");
    let group = spawn(&serve_args(
        &data,
        &[
            "--pipeline",
            "2",
            "--kv-cache-mib",
            "16",
            "--memory-budget-mib",
            &budget,
        ],
    ));
    let key = new_key(&data, "budget");
    let (status, body) = answer(&group, &key).await;
    assert_eq!(status, 200, "{body}");
    assert!(!body.is_empty());
}

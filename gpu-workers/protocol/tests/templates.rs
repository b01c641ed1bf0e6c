//! Every chat template of llama.cpp's collection (`models/templates/*.jinja`, from the
//! llama-cpp-python sdist `scripts/reference-data` fetches) rendered by Hearth and by Python
//! Jinja2 configured as `transformers.apply_chat_template` configures it
//! (`scripts/template_reference.py`), over a fixed set of conversations
//! (`tests/data/chat_cases.json`: system, multi-turn, tools, a tool call and its result,
//! parallel calls, reasoning history, thinking off, no generation prompt). The outputs must
//! be identical, and a conversation one renderer refuses the other must refuse too — except
//! for the templates listed in [`KNOWN_DIFFERENCES`], each with its reason.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use hearth_protocol::{ChatInput, ChatMessage, ChatTemplate};
use serde::Deserialize;
use serde_json::{Map, Value};

/// (template file, case name or "without tools" (every case that offers none), why
/// Hearth's output differs from Jinja2's).
const KNOWN_DIFFERENCES: &[(&str, &str, &str)] = &[
    // Jinja2's `"…"|safe + text` is a Markup object, and adding a string to it HTML-escapes
    // the string (`"` → `&#34;`): the tool schemas reach the model escaped there. Hearth has no
    // Markup type and writes them as they are.
    (
        "meetkai-functionary-medium-v3.1.jinja",
        "tools_offered",
        "Markup concatenation escapes in Jinja2",
    ),
    (
        "meetkai-functionary-medium-v3.1.jinja",
        "tool_call_and_result",
        "Markup concatenation escapes in Jinja2",
    ),
    (
        "meetkai-functionary-medium-v3.1.jinja",
        "parallel_tool_calls",
        "Markup concatenation escapes in Jinja2",
    ),
    // Tool-use templates that loop over `tools` unconditionally: Jinja2 cannot iterate None and
    // refuses a conversation without tools; minijinja iterates none as empty, so Hearth renders
    // it with no tool section.
    (
        "CohereForAI-c4ai-command-r-plus-tool_use.jinja",
        "without tools",
        "iterating None",
    ),
    (
        "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja",
        "without tools",
        "iterating None",
    ),
    (
        "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja",
        "without tools",
        "iterating None",
    ),
    // `tools | map(…) | tojson`: Jinja2's `map` is a generator, which `json.dumps` refuses;
    // minijinja's is a list, so Hearth renders what the template means.
    (
        "llama-cpp-deepseek-r1.jinja",
        "tools_offered",
        "map is a generator in Jinja2",
    ),
    (
        "llama-cpp-deepseek-r1.jinja",
        "tool_call_and_result",
        "map is a generator in Jinja2",
    ),
    (
        "llama-cpp-deepseek-r1.jinja",
        "parallel_tool_calls",
        "map is a generator in Jinja2",
    ),
];

#[derive(Deserialize)]
struct Cases {
    bos_token: String,
    eos_token: String,
    now: String,
    tools: Vec<Value>,
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    name: String,
    messages: Vec<ChatMessage>,
    #[serde(default)]
    tools: bool,
    #[serde(default = "yes")]
    add_generation_prompt: bool,
    #[serde(default)]
    kwargs: Map<String, Value>,
}

fn yes() -> bool {
    true
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Outcome {
    Text { text: String },
    Error { error: String },
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn reference() -> PathBuf {
    hearth_testkit::tier::needs(hearth_testkit::tier::Tier::Reference);
    let script = root().join("scripts/reference-data");
    let out = std::process::Command::new(&script)
        .stderr(std::process::Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", script.display()));
    assert!(out.status.success(), "{} failed", script.display());
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

/// 2026-12-01T09:30:00 as seconds since the epoch (the cases' `now`, UTC).
fn now_secs(iso: &str) -> i64 {
    assert_eq!(iso, "2026-12-01T09:30:00", "the test's fixed time");
    1_796_117_400
}

#[test]
fn every_template_renders_as_transformers_renders_it() {
    let refdir = reference();
    let cases_path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/chat_cases.json");
    let cases: Cases = serde_json::from_str(&std::fs::read_to_string(&cases_path).unwrap()).unwrap();
    let out = std::process::Command::new(refdir.join("venv/bin/python"))
        .arg(root().join("scripts/template_reference.py"))
        .arg(&cases_path)
        .arg(refdir.join("templates"))
        .output()
        .expect("the Python reference");
    assert!(
        out.status.success(),
        "template_reference.py: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let expected: BTreeMap<String, BTreeMap<String, Outcome>> = serde_json::from_slice(&out.stdout).unwrap();
    let now = now_secs(&cases.now);
    let mut failures = Vec::new();
    let (mut same, mut known) = (0, 0);
    for (file, results) in &expected {
        let source = std::fs::read_to_string(refdir.join("templates").join(file)).unwrap();
        let tmpl = match ChatTemplate::new(&source, &cases.bos_token, &cases.eos_token) {
            Ok(t) => t,
            Err(e) => {
                failures.push(format!("{file}: does not compile: {e}"));
                continue;
            }
        };
        for case in &cases.cases {
            let Some(want) = results.get(&case.name) else { continue };
            let input = ChatInput {
                messages: &case.messages,
                tools: case.tools.then_some(cases.tools.as_slice()),
                add_generation_prompt: case.add_generation_prompt,
                kwargs: Some(&case.kwargs),
            };
            let got = tmpl.render_at(&input, Some(now));
            let agree = match (want, &got) {
                (Outcome::Text { text }, Ok(g)) => text == g,
                (Outcome::Error { .. }, Err(_)) => true,
                _ => false,
            };
            let listed = KNOWN_DIFFERENCES
                .iter()
                .any(|(f, c, _)| f == file && (*c == case.name || (*c == "without tools" && !case.tools)));
            match (agree, listed) {
                (true, false) => same += 1,
                (false, true) => known += 1,
                (true, true) => failures.push(format!(
                    "{file} / {}: listed as differing but now agrees: unlist it",
                    case.name
                )),
                (false, false) => failures.push(match (want, got) {
                    (Outcome::Text { text }, Ok(g)) => {
                        format!("{file} / {}: differs\n--- jinja2\n{text}\n--- hearth\n{g}", case.name)
                    }
                    (Outcome::Text { .. }, Err(e)) => format!("{file} / {}: Hearth refused: {e}", case.name),
                    (Outcome::Error { error }, Ok(_)) => {
                        format!("{file} / {}: Jinja2 refused ({error}), Hearth rendered", case.name)
                    }
                    (Outcome::Error { .. }, Err(_)) => unreachable!(),
                }),
            }
        }
    }
    eprintln!(
        "{} templates: {same} renderings identical, {known} known differences",
        expected.len()
    );
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n\n")
    );
}

/// The tool-call and reasoning formats chosen for the families' real templates.
#[test]
fn each_familys_template_gets_its_formats() {
    use hearth_protocol::output::{ReasoningFormat, ToolFormat};
    let dir = reference().join("templates");
    let mut table = Vec::new();
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.ends_with(".jinja"))
        .collect();
    names.sort();
    for name in &names {
        let src = std::fs::read_to_string(dir.join(name)).unwrap();
        let f = ToolFormat::detect(Some(&src));
        let r = ReasoningFormat::detect(Some(&src));
        table.push(format!(
            "{name}: {} / {}",
            f.name(),
            r.map_or("-", ReasoningFormat::name)
        ));
    }
    eprintln!("{}", table.join("\n"));
    for (file, tools, reasoning) in [
        ("Qwen-Qwen2.5-7B-Instruct.jinja", ToolFormat::Hermes, None),
        (
            "Qwen-Qwen3-0.6B.jinja",
            ToolFormat::Hermes,
            Some(ReasoningFormat::Think),
        ),
        ("Qwen-QwQ-32B.jinja", ToolFormat::Hermes, Some(ReasoningFormat::Think)),
        ("Qwen3-Coder.jinja", ToolFormat::Qwen3Coder, None),
        (
            "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja",
            ToolFormat::Hermes,
            None,
        ),
        ("meta-llama-Llama-3.1-8B-Instruct.jinja", ToolFormat::Llama3Json, None),
        ("meta-llama-Llama-3.2-3B-Instruct.jinja", ToolFormat::Llama3Json, None),
        ("meta-llama-Llama-3.3-70B-Instruct.jinja", ToolFormat::Llama3Json, None),
        ("mistralai-Mistral-Nemo-Instruct-2407.jinja", ToolFormat::Mistral, None),
        (
            "Mistral-Small-3.2-24B-Instruct-2506.jinja",
            ToolFormat::MistralArgs,
            None,
        ),
        (
            "unsloth-mistral-Devstral-Small-2507.jinja",
            ToolFormat::MistralArgs,
            None,
        ),
        (
            "mistralai-Ministral-3-14B-Reasoning-2512.jinja",
            ToolFormat::MistralArgs,
            Some(ReasoningFormat::MistralThink),
        ),
        (
            "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
            ToolFormat::DeepseekV3,
            Some(ReasoningFormat::Think),
        ),
        (
            "deepseek-ai-DeepSeek-V3.1.jinja",
            ToolFormat::DeepseekV31,
            Some(ReasoningFormat::Think),
        ),
        ("moonshotai-Kimi-K2.jinja", ToolFormat::KimiK2, None),
        (
            "Kimi-K2-Thinking.jinja",
            ToolFormat::KimiK2,
            Some(ReasoningFormat::Think),
        ),
        ("google-gemma-2-2b-it.jinja", ToolFormat::Hearth, None),
    ] {
        let src = std::fs::read_to_string(dir.join(file)).unwrap();
        assert_eq!(ToolFormat::detect(Some(&src)), tools, "{file}");
        assert_eq!(ReasoningFormat::detect(Some(&src)), reasoning, "{file}");
    }
}

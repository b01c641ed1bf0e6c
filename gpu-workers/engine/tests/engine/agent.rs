//! Agent workloads on the real default model: speculative decoding gives the same greedy
//! output as decoding one token at a time (alone and batched), and constrained decoding's
//! outputs always parse and validate against their JSON Schema — at temperature 1 over many
//! seeds — while a schema llguidance cannot honour is refused, naming what is wrong.

use std::sync::OnceLock;

use hearth_engine::formats::fetch::DEFAULT_MODEL_ID;
use hearth_engine::{EngineConfig, EngineHandle};
use hearth_protocol::{ChatMessage, ChatTemplate, Constraint, GenerateEvent, GenerateRequest, SamplingParams};
use serde_json::{json, Value};

fn engine() -> &'static EngineHandle {
    static E: OnceLock<EngineHandle> = OnceLock::new();
    E.get_or_init(|| {
        let cfg = EngineConfig {
            threads: 2,
            kv_cache_mib: Some(64),
            ..Default::default()
        };
        EngineHandle::load(&crate::harness::default_model(), DEFAULT_MODEL_ID, &cfg).expect("engine")
    })
}

fn chat(e: &EngineHandle, system: &str, user: &str) -> Vec<u32> {
    let spec = &e.info().tokenizer;
    let tmpl = ChatTemplate::new(spec.chat_template.as_deref().unwrap(), "<|im_start|>", "<|im_end|>").unwrap();
    let tok = hearth_protocol::Tokenizer::from_spec(spec).unwrap();
    let msg = ChatMessage::new;
    tok.encode(&tmpl.render(&[msg("system", system), msg("user", user)], true).unwrap())
}

struct Out {
    ids: Vec<u32>,
    text: String,
    finish: Option<String>,
    error: Option<(String, String)>,
}

async fn generate(e: &EngineHandle, prompt: Vec<u32>, sampling: SamplingParams, constraint: Option<Constraint>) -> Out {
    let mut rx = e.generate(GenerateRequest {
        request_id: "t".into(),
        model: DEFAULT_MODEL_ID.into(),
        prompt,
        sampling,
        cache_namespace: "agent-test".into(),
        n: 1,
        prefill_only: false,
        resume: Vec::new(),
        kv_source: None,
        qos: Default::default(),
        constraint,
        adapter: None,
    });
    let mut out = Out {
        ids: Vec::new(),
        text: String::new(),
        finish: None,
        error: None,
    };
    while let Some(ev) = rx.recv().await {
        match ev {
            GenerateEvent::Token { id, text, .. } => {
                out.ids.push(id);
                out.text.push_str(&text);
            }
            GenerateEvent::Finish { finish_reason, .. } => out.finish = Some(finish_reason.as_str().into()),
            GenerateEvent::Done { .. } => break,
            GenerateEvent::Error { code, message } => {
                out.error = Some((code, message));
                break;
            }
        }
    }
    out
}

fn greedy(max_tokens: u32, speculative: bool) -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        max_tokens,
        speculative,
        ..Default::default()
    }
}

const DOCUMENT: &str = "The quarterly report shows revenue of 4.2 million dollars, up 12 percent from last year. \
Operating costs rose to 3.1 million dollars, mainly from new hires in the support team. \
The board approved a budget of 500 thousand dollars for the new data centre in Lisbon.";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn speculation_gives_the_same_greedy_output_alone_and_batched() {
    let e = engine();
    let prompts = [
        chat(
            e,
            "You are a careful editor.",
            &format!("Repeat this text exactly, replacing 'Lisbon' with 'Porto':\n\n{DOCUMENT}"),
        ),
        chat(e, "You are a helpful assistant.", "Write a short poem about the sea."),
        chat(
            e,
            "Extract the fields as JSON.",
            &format!("{DOCUMENT}\n\nGive revenue, costs and the city."),
        ),
    ];
    let metrics = e.metrics();
    let accepted_before = metrics.spec_accepted.get();
    for p in &prompts {
        let plain = generate(e, p.clone(), greedy(48, false), None).await;
        let spec = generate(e, p.clone(), greedy(48, true), None).await;
        assert!(plain.error.is_none(), "{:?}", plain.error);
        assert_eq!(
            plain.ids, spec.ids,
            "speculation changed the greedy output:\n{}\n---\n{}",
            plain.text, spec.text
        );
        assert_eq!(plain.finish, spec.finish);
    }
    // Batched: all three at once, speculating, against their one-at-a-time outputs.
    let singles: Vec<Vec<u32>> = {
        let mut v = Vec::new();
        for p in &prompts {
            v.push(generate(e, p.clone(), greedy(48, false), None).await.ids);
        }
        v
    };
    let batched =
        futures_util::future::join_all(prompts.iter().map(|p| generate(e, p.clone(), greedy(48, true), None))).await;
    for (b, s) in batched.iter().zip(&singles) {
        assert_eq!(&b.ids, s, "batched speculation changed the greedy output");
    }
    assert!(
        metrics.spec_accepted.get() > accepted_before,
        "the editing prompt repeats its context: some draft tokens must be accepted"
    );
    // Sampled with a seed: one random draw per emitted token either way, so the same text.
    for seed in [3u64, 17] {
        let sampled = |speculative| SamplingParams {
            temperature: 1.0,
            seed: Some(seed),
            max_tokens: 48,
            speculative,
            ..Default::default()
        };
        let plain = generate(e, prompts[0].clone(), sampled(false), None).await;
        let spec = generate(e, prompts[0].clone(), sampled(true), None).await;
        assert_eq!(plain.ids, spec.ids, "seed {seed}:\n{}\n---\n{}", plain.text, spec.text);
    }
}

fn person_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 130},
            "city": {"type": "string", "enum": ["Paris", "Lisbon", "Tokyo", "Other"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
            "employed": {"type": "boolean"}
        },
        "required": ["name", "age", "city", "tags", "employed"],
        "additionalProperties": false
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn constrained_speculation_drafts_what_the_grammar_forces_and_keeps_greedy_output() {
    let e = engine();
    let schema = person_schema();
    let prompt = chat(e, "Reply in JSON.", "Describe a person who lives in Lisbon.");
    let constraint = Some(Constraint::JsonSchema { schema: schema.clone() });
    let metrics = e.metrics();
    let plain = generate(e, prompt.clone(), greedy(200, false), constraint.clone()).await;
    let (drafted, accepted) = (metrics.spec_drafted.get(), metrics.spec_accepted.get());
    let spec = generate(e, prompt.clone(), greedy(200, true), constraint).await;
    assert!(
        plain.error.is_none() && spec.error.is_none(),
        "{:?} {:?}",
        plain.error,
        spec.error
    );
    assert_eq!(plain.ids, spec.ids, "{}\n---\n{}", plain.text, spec.text);
    assert_eq!(plain.finish.as_deref(), Some("stop"));
    let v: Value = serde_json::from_str(&spec.text).unwrap();
    assert!(jsonschema::is_valid(&schema, &v), "{}", spec.text);
    // The prompt repeats nothing of the answer's keys: the drafts come from the grammar
    // (`"name": "`, `", "age": `…), and most of them are kept.
    let (d, a) = (
        metrics.spec_drafted.get() - drafted,
        metrics.spec_accepted.get() - accepted,
    );
    assert!(d >= 10 && a * 2 >= d, "drafted {d}, accepted {a}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn constrained_outputs_always_validate_at_temperature_one() {
    let e = engine();
    let schema = person_schema();
    let validator = jsonschema::validator_for(&schema).unwrap();
    let prompt = chat(e, "Reply in JSON.", "Describe a person who lives in Lisbon.");
    let masks_before = e.metrics().grammar_masks.get();
    for seed in 0..12u64 {
        let sampling = SamplingParams {
            temperature: 1.0,
            seed: Some(seed),
            max_tokens: 200,
            speculative: seed % 2 == 0,
            ..Default::default()
        };
        let out = generate(
            e,
            prompt.clone(),
            sampling,
            Some(Constraint::JsonSchema { schema: schema.clone() }),
        )
        .await;
        assert!(out.error.is_none(), "{:?}", out.error);
        assert_eq!(out.finish.as_deref(), Some("stop"), "seed {seed}: {}", out.text);
        let v: Value = serde_json::from_str(&out.text).unwrap_or_else(|e| panic!("seed {seed}: {e}: {}", out.text));
        let errors: Vec<String> = validator.iter_errors(&v).map(|e| e.to_string()).collect();
        assert!(errors.is_empty(), "seed {seed}: {} → {errors:?}", out.text);
    }
    assert!(e.metrics().grammar_masks.get() > masks_before);

    let small = json!({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": false});
    let out = generate(
        e,
        prompt.clone(),
        SamplingParams {
            temperature: 1.0,
            seed: Some(99),
            max_tokens: 300,
            ..Default::default()
        },
        Some(Constraint::JsonSchema { schema: small.clone() }),
    )
    .await;
    let v: Value = serde_json::from_str(&out.text).unwrap();
    // (JSON Schema integers are unbounded: `a` may not fit an i64.)
    assert!(jsonschema::is_valid(&small, &v), "{}", out.text);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lark_grammar_with_an_embedded_schema_constrains_tool_calls() {
    let e = engine();
    let args = json!({"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                      "required": ["city"], "additionalProperties": false, "x-guidance": hearth_protocol::json_layout()});
    let call = json!({"type": "object", "properties": {"name": {"const": "get_weather"}, "arguments": args},
                      "required": ["name", "arguments"], "additionalProperties": false, "x-guidance": hearth_protocol::json_layout()});
    let grammar = format!("start: \"<tool_call>\\n\" call \"\\n</tool_call>\"\ncall: %json {call}\n");
    let prompt = chat(e, "You can call get_weather.", "What's the weather in Paris?");
    for seed in 0..4u64 {
        let out = generate(
            e,
            prompt.clone(),
            SamplingParams {
                temperature: 1.0,
                seed: Some(seed),
                max_tokens: 100,
                ..Default::default()
            },
            Some(Constraint::Lark {
                grammar: grammar.clone(),
            }),
        )
        .await;
        assert!(out.error.is_none(), "{:?}", out.error);
        let body = out
            .text
            .strip_prefix("<tool_call>\n")
            .and_then(|t| t.strip_suffix("\n</tool_call>"))
            .unwrap_or_else(|| panic!("seed {seed}: {:?}", out.text));
        let v: Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["name"], "get_weather");
        assert!(v["arguments"]["city"].is_string(), "{body}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schemas_that_cannot_be_honoured_are_refused() {
    let e = engine();
    let prompt = chat(e, "Reply in JSON.", "Anything.");
    let refuse = |schema: Value| {
        let prompt = prompt.clone();
        async move {
            generate(e, prompt, greedy(8, true), Some(Constraint::JsonSchema { schema }))
                .await
                .error
                .expect("refused")
        }
    };
    let (code, message) =
        refuse(json!({"type": "object", "properties": {"a": {"type": "string"}}, "dependentSchemas": {"a": {}}})).await;
    assert_eq!(code, "unsupported_schema", "{message}");
    assert!(message.contains("dependentSchemas"), "{message}");
    let (code, message) = refuse(json!({"type": "nonsense"})).await;
    assert_eq!(code, "invalid_schema", "{message}");
    let (code, _) = refuse(json!([1, 2])).await;
    assert_eq!(code, "invalid_schema");
}

/// Every tool-call format's grammar (`tool_choice` required, two tools, parallel calls), on
/// the real model at temperature 1 over several seeds: the output is calls in that format,
/// which the format's own parser reads back, with arguments valid for the tool's schema. The
/// default model has none of the formats' special tokens, so their delimiters are text here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_native_tool_format_is_written_under_its_grammar_and_reads_back() {
    use hearth_protocol::output::tools::{grammar, ToolDef, ToolFormat, ToolStream};
    let e = engine();
    let tools = vec![
        ToolDef {
            name: "get_weather".into(),
            description: Some("Current weather for a city".into()),
            parameters: json!({"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "days"], "additionalProperties": false}),
        },
        ToolDef {
            name: "get_time".into(),
            description: None,
            parameters: json!({"type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}}, "required": ["zone"], "additionalProperties": false}),
        },
    ];
    let prompt = chat(
        e,
        "You call tools.",
        "What is the weather in Paris for 3 days, and the time in Tokyo?",
    );
    for format in ToolFormat::ALL {
        let g = grammar(format, &tools, true, &|_| None);
        for seed in 0..3 {
            let sampling = SamplingParams {
                temperature: 1.0,
                seed: Some(seed),
                max_tokens: 200,
                ..Default::default()
            };
            let out = generate(
                e,
                prompt.clone(),
                sampling,
                Some(Constraint::Lark { grammar: g.clone() }),
            )
            .await;
            assert!(out.error.is_none(), "{format:?}: {:?}\n{g}", out.error);
            if out.finish.as_deref() == Some("length") {
                continue; // cut off by max_tokens: nothing to check
            }
            let (_, calls) = ToolStream::parse(format, &tools, &out.text);
            assert!(
                !calls.is_empty(),
                "{format:?} seed {seed}: no calls read from {:?}",
                out.text
            );
            for c in &calls {
                let tool = tools
                    .iter()
                    .find(|t| t.name == c.name)
                    .unwrap_or_else(|| panic!("{format:?}: unknown tool {}", c.name));
                let args: Value = serde_json::from_str(&c.arguments)
                    .unwrap_or_else(|err| panic!("{format:?}: {err}: {:?}", out.text));
                assert!(
                    jsonschema::is_valid(&tool.parameters, &args),
                    "{format:?}: {args} against {}",
                    tool.parameters
                );
            }
        }
    }
}

/// A grammar names a special token by id (`<[id]>`), as the native formats' delimiters are
/// written; asked for in `special_text`, the token's text reaches the stream (control
/// tokens' text is dropped otherwise).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn special_tokens_in_grammars_reach_the_stream_when_asked_for() {
    let e = engine();
    let tok = hearth_protocol::Tokenizer::from_spec(&e.info().tokenizer).unwrap();
    let id = tok.token_id("<|im_start|>").unwrap();
    assert!(tok.is_special(id));
    let grammar = format!("start: <[{id}]> \"ok\"\n");
    let prompt = chat(e, "Answer.", "Say ok.");
    for (special_text, want) in [(vec![id], "<|im_start|>ok"), (vec![], "ok")] {
        let sampling = SamplingParams {
            special_text,
            ..greedy(8, false)
        };
        let out = generate(
            e,
            prompt.clone(),
            sampling,
            Some(Constraint::Lark {
                grammar: grammar.clone(),
            }),
        )
        .await;
        assert!(out.error.is_none(), "{:?}", out.error);
        assert_eq!(out.ids.first(), Some(&id));
        assert_eq!(out.text, want);
    }
}

/// A tight `max_tokens` at temperature 1: the answer closes the structure in time (the
/// grammar's shortest valid end) and reports `length`; every one parses and validates.
/// Speculation on and off, since a closing answer drafts its plan.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn constrained_outputs_end_valid_within_a_tight_budget() {
    let e = engine();
    let schema = person_schema();
    let validator = jsonschema::validator_for(&schema).unwrap();
    let prompt = chat(e, "Reply in JSON.", "Describe a person who lives in Lisbon.");
    let mut cut = 0;
    for seed in 0..12u64 {
        // (The shortest valid answer is about 32 tokens.)
        let max_tokens = 40 + (seed as u32 % 3) * 5;
        let sampling = SamplingParams {
            temperature: 1.0,
            seed: Some(seed),
            max_tokens,
            speculative: seed % 2 == 0,
            ..Default::default()
        };
        let out = generate(
            e,
            prompt.clone(),
            sampling,
            Some(Constraint::JsonSchema { schema: schema.clone() }),
        )
        .await;
        assert!(out.error.is_none(), "{:?}", out.error);
        assert!(
            out.ids.len() <= max_tokens as usize,
            "seed {seed}: {} tokens",
            out.ids.len()
        );
        let v: Value = serde_json::from_str(&out.text).unwrap_or_else(|e| panic!("seed {seed}: {e}: {}", out.text));
        let errors: Vec<String> = validator.iter_errors(&v).map(|e| e.to_string()).collect();
        assert!(errors.is_empty(), "seed {seed}: {} → {errors:?}", out.text);
        cut += usize::from(out.finish.as_deref() == Some("length"));
    }
    assert!(cut > 0, "no answer needed closing: the budget is not tight");
}

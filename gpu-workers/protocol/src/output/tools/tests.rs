use super::*;
use proptest::prelude::*;
use serde_json::json;

fn tools() -> Vec<ToolDef> {
    vec![
        ToolDef {
            name: "get_weather".into(),
            description: None,
            parameters: json!({"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}),
        },
        ToolDef {
            name: "get_time".into(),
            description: None,
            parameters: json!({"type": "object", "properties": {"zone": {"type": "string"}}}),
        },
    ]
}

/// A format, an answer as the family writes it, its content, and its calls (name, arguments).
type Sample = (
    ToolFormat,
    &'static str,
    Option<&'static str>,
    Vec<(&'static str, &'static str)>,
);

fn samples() -> Vec<Sample> {
    let two = vec![
        ("get_weather", r#"{"city": "Paris", "days": 2}"#),
        ("get_time", r#"{"zone": "Asia/Tokyo"}"#),
    ];
    vec![
        (
            ToolFormat::Hermes,
            "Checking both.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 2}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"zone\": \"Asia/Tokyo\"}}\n</tool_call>",
            Some("Checking both."),
            two.clone(),
        ),
        (
            ToolFormat::Llama3Json,
            "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\", \"days\": 2}}; {\"name\": \"get_time\", \"parameters\": {\"zone\": \"Asia/Tokyo\"}}",
            None,
            two.clone(),
        ),
        (
            ToolFormat::Llama3Json,
            "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\", \"days\": 2}}",
            None,
            vec![two[0]],
        ),
        (
            ToolFormat::Mistral,
            "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 2}, \"id\": \"abcDEF123\"}, {\"name\": \"get_time\", \"arguments\": {\"zone\": \"Asia/Tokyo\"}}]",
            None,
            two.clone(),
        ),
        (
            ToolFormat::MistralArgs,
            "Checking both.[TOOL_CALLS]get_weather[CALL_ID]abcDEF123[ARGS]{\"city\": \"Paris\", \"days\": 2}[TOOL_CALLS]get_time[ARGS]{\"zone\": \"Asia/Tokyo\"}",
            Some("Checking both."),
            two.clone(),
        ),
        (
            ToolFormat::DeepseekV3,
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\", \"days\": 2}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{\"zone\": \"Asia/Tokyo\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
            None,
            two.clone(),
        ),
        (
            ToolFormat::DeepseekV31,
            "Checking both.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Paris\", \"days\": 2}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{\"zone\": \"Asia/Tokyo\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
            Some("Checking both."),
            two.clone(),
        ),
        (
            ToolFormat::KimiK2,
            "Checking both.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{\"city\": \"Paris\", \"days\": 2}<|tool_call_end|><|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{\"zone\": \"Asia/Tokyo\"}<|tool_call_end|><|tool_calls_section_end|>",
            Some("Checking both."),
            two.clone(),
        ),
        (
            ToolFormat::Qwen3Coder,
            "Checking both.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n<parameter=zone>\nAsia/Tokyo\n</parameter>\n</function>\n</tool_call>",
            Some("Checking both."),
            two,
        ),
    ]
}

fn names_and_args(calls: &[ParsedCall]) -> Vec<(String, String)> {
    calls.iter().map(|c| (c.name.clone(), c.arguments.clone())).collect()
}

#[test]
fn each_format_reads_its_calls() {
    for (format, text, content, want) in samples() {
        let (c, calls) = ToolStream::parse(format, &tools(), text);
        assert_eq!(c.as_deref(), content, "{format:?}");
        let want: Vec<(String, String)> = want.iter().map(|(n, a)| (n.to_string(), a.to_string())).collect();
        assert_eq!(names_and_args(&calls), want, "{format:?}");
        for call in &calls {
            let v: Value = serde_json::from_str(&call.arguments).unwrap_or_else(|e| panic!("{format:?}: {e}"));
            assert!(v.is_object());
            assert!(!call.id.is_empty());
        }
    }
    // The model's own ids are kept.
    let (_, calls) = ToolStream::parse(ToolFormat::Mistral, &tools(), samples()[3].1);
    assert_eq!(calls[0].id, "abcDEF123");
    let (_, calls) = ToolStream::parse(ToolFormat::KimiK2, &tools(), samples()[7].1);
    assert_eq!(calls[1].id, "functions.get_time:1");
}

#[test]
fn text_that_is_no_call_stays_text() {
    for (format, text) in [
        (ToolFormat::Hermes, "<tool_call>{\"name\": 3}</tool_call>"),
        (ToolFormat::Hermes, "The answer is 1 < 2."),
        (ToolFormat::Hermes, "Use <tool_call> blocks."),
        (ToolFormat::Llama3Json, "{\"answer\": 42}"),
        (ToolFormat::Llama3Json, "Paris. {\"name\": \"x\", \"parameters\": {}}"),
        (ToolFormat::Mistral, "[TOOL_CALLS] is a marker"),
        (ToolFormat::MistralArgs, "[TOOL_CALLS] is a marker"),
        (ToolFormat::Qwen3Coder, "<tool_call>\nplain\n</tool_call>"),
    ] {
        let (c, calls) = ToolStream::parse(format, &tools(), text);
        assert!(calls.is_empty(), "{format:?} {text:?}: {calls:?}");
        assert_eq!(c.as_deref(), Some(text), "{format:?}");
    }
}

#[test]
fn a_call_cut_off_keeps_what_it_has() {
    let (_, calls) = ToolStream::parse(
        ToolFormat::Hermes,
        &tools(),
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Pa",
    );
    assert_eq!(
        names_and_args(&calls),
        [("get_weather".to_string(), "{\"city\": \"Pa".to_string())]
    );
    let (content, calls) = ToolStream::parse(
        ToolFormat::Hermes,
        &tools(),
        "Sure.<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {}}",
    );
    assert_eq!((content.as_deref(), calls.len()), (Some("Sure."), 1));
}

#[test]
fn formats_are_detected_from_templates() {
    assert_eq!(ToolFormat::detect(None), ToolFormat::Hearth);
    assert_eq!(ToolFormat::detect(Some("{{ messages }}")), ToolFormat::Hearth);
    assert_eq!(
        ToolFormat::detect(Some("{{- '<tool_call>\\n{\"name\": \"' }}")),
        ToolFormat::Hermes
    );
    assert_eq!(
        ToolFormat::detect(Some("{{ '<tool_call>' + tc.name }}<arg_key>")),
        ToolFormat::Hearth
    );
    assert_eq!(ToolFormat::detect(Some("[TOOL_CALLS][ARGS]")), ToolFormat::MistralArgs);
    assert_eq!(ToolFormat::detect(Some("[TOOL_CALLS]")), ToolFormat::Mistral);
    for f in ToolFormat::ALL {
        assert_eq!(ToolFormat::from_name(f.name()), Some(f));
    }
}

#[test]
fn mistral_ids_are_nine_letters_and_digits() {
    for _ in 0..50 {
        let id = ToolFormat::MistralArgs.new_call_id();
        assert!(id.len() == 9 && id.chars().all(|c| c.is_ascii_alphanumeric()), "{id}");
    }
    assert!(ToolFormat::Hermes.new_call_id().starts_with("call_"));
}

#[test]
fn grammars_name_every_tool_and_use_special_tokens_by_id() {
    for f in ToolFormat::ALL {
        let g = grammar(f, &tools(), true, &|t| (t == "[TOOL_CALLS]").then_some(5));
        assert!(g.starts_with("start: "), "{f:?}: {g}");
        assert!(g.contains("get_weather") && g.contains("get_time"), "{f:?}: {g}");
        if matches!(f, ToolFormat::Mistral | ToolFormat::MistralArgs) {
            assert!(g.contains("<[5]>"), "{f:?}: {g}");
        }
    }
    let single = grammar(ToolFormat::Hermes, &tools()[..1], false, &|_| None);
    assert!(single.starts_with("start: block\n"), "{single}");
}

proptest! {
    /// Streamed in any chunking, every format gives exactly what the whole answer gives.
    #[test]
    fn streaming_agrees_with_the_whole_answer(cuts in proptest::collection::vec(0usize..400, 0..12), which in 0usize..9) {
        let (format, text, _, _) = samples()[which].clone();
        let whole = ToolStream::parse(format, &tools(), text);
        let mut bounds: Vec<usize> = cuts.into_iter().map(|c| c % (text.len() + 1)).filter(|&c| text.is_char_boundary(c)).collect();
        bounds.push(0);
        bounds.push(text.len());
        bounds.sort_unstable();
        bounds.dedup();
        let mut s = ToolStream::new(format, tools().into());
        let mut deltas = Vec::new();
        for w in bounds.windows(2) {
            deltas.extend(s.push(&text[w[0]..w[1]]));
        }
        deltas.extend(s.finish());
        let streamed = collect(deltas);
        prop_assert_eq!(&streamed.0, &whole.0);
        prop_assert_eq!(names_and_args(&streamed.1), names_and_args(&whole.1));
    }
}

/// Pieces answers are made of in every format: its delimiters, call-object fragments, JSON
/// that breaks, text that looks like markup.
fn piece() -> impl Strategy<Value = &'static str> {
    proptest::sample::select(vec![
        "<tool_call>",
        "</tool_call>",
        "<|python_tag|>",
        "[TOOL_CALLS]",
        "[ARGS]",
        "[CALL_ID]",
        "<｜tool▁calls▁begin｜>",
        "<｜tool▁call▁begin｜>",
        "<｜tool▁sep｜>",
        "<｜tool▁call▁end｜>",
        "<｜tool▁calls▁end｜>",
        "<|tool_calls_section_begin|>",
        "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>",
        "<|tool_call_end|>",
        "<|tool_calls_section_end|>",
        "<function=get_weather>",
        "<parameter=city>",
        "</parameter>",
        "</function>",
        "functions.get_time:0",
        "function",
        "```json",
        "```",
        "{",
        "}",
        "[",
        "]",
        ",",
        ": ",
        "\"name\": ",
        "\"get_weather\"",
        "\"arguments\": ",
        "\"parameters\": ",
        "{\"city\": \"Pa",
        "ris\"}",
        "3",
        "nul",
        "\"x",
        "\\\"",
        "\n",
        " ",
        "  \n",
        "Sure.",
        "a < b",
        "é",
        "🤖",
        "get_time",
    ])
}

proptest! {
    /// Any answer, well-formed or not, streamed in any chunking: the same content and calls
    /// as the whole answer, never a panic.
    #[test]
    fn any_answer_streams_as_it_reads_whole(pieces in proptest::collection::vec(piece(), 0..24), cuts in proptest::collection::vec(0usize..600, 0..10), which in 0usize..9) {
        let format = ToolFormat::ALL[which];
        let text = pieces.concat();
        let whole = ToolStream::parse(format, &tools(), &text);
        let mut bounds: Vec<usize> = cuts.into_iter().map(|c| c % (text.len() + 1)).filter(|&c| text.is_char_boundary(c)).collect();
        bounds.extend([0, text.len()]);
        bounds.sort_unstable();
        bounds.dedup();
        let mut s = ToolStream::new(format, tools().into());
        let mut deltas = Vec::new();
        for w in bounds.windows(2) {
            deltas.extend(s.push(&text[w[0]..w[1]]));
        }
        deltas.extend(s.finish());
        let streamed = collect(deltas);
        prop_assert_eq!(&streamed.0, &whole.0, "{:?} {:?}", format, text);
        prop_assert_eq!(names_and_args(&streamed.1), names_and_args(&whole.1), "{:?} {:?}", format, text);
    }
}

#[test]
fn a_long_argument_is_not_read_again_for_every_token() {
    // 40k tokens of arguments: the open region is re-read only as it grows by a sixteenth.
    let mut s = ToolStream::new(ToolFormat::Hermes, tools().into());
    let mut deltas = s.push("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"");
    for _ in 0..40_000 {
        deltas.extend(s.push("ab"));
    }
    deltas.extend(s.push("\"}}\n</tool_call>"));
    deltas.extend(s.finish());
    let (_, calls) = collect(deltas);
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].arguments.len(), "{\"city\": \"\"}".len() + 80_000);
}

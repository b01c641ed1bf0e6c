use super::*;
use proptest::prelude::*;

fn think() -> OutputSpec {
    OutputSpec {
        tools: None,
        reasoning: Some((ReasoningFormat::Think, false)),
    }
}

#[test]
fn thinking_never_reaches_the_content() {
    let a = Assistant::parse(&think(), "<think>\nThe user wants the capital.\n</think>\n\nParis.");
    assert_eq!(a.reasoning.as_deref(), Some("The user wants the capital."));
    assert_eq!(a.content.as_deref(), Some("Paris."));
    // The prompt opened the block (DeepSeek-R1): reasoning from the first token.
    let inside = OutputSpec {
        tools: None,
        reasoning: Some((ReasoningFormat::Think, true)),
    };
    let a = Assistant::parse(&inside, "Hmm.</think>Paris.");
    assert_eq!(
        (a.reasoning.as_deref(), a.content.as_deref()),
        (Some("Hmm."), Some("Paris."))
    );
    // Cut off while thinking: all reasoning.
    let a = Assistant::parse(&think(), "<think>Still going");
    assert_eq!(
        (a.reasoning.as_deref(), a.content),
        (Some("Still going"), None::<String>.or(Some(String::new())))
    );
    // No thinking block: content as written.
    let a = Assistant::parse(&think(), "Paris.");
    assert_eq!((a.reasoning, a.content.as_deref()), (None, Some("Paris.")));
    let m = OutputSpec {
        tools: None,
        reasoning: Some((ReasoningFormat::MistralThink, false)),
    };
    let a = Assistant::parse(&m, "[THINK]x[/THINK]y");
    assert_eq!((a.reasoning.as_deref(), a.content.as_deref()), (Some("x"), Some("y")));
}

#[test]
fn reasoning_then_tool_calls() {
    let spec = OutputSpec {
        tools: Some((
            ToolFormat::Hermes,
            vec![ToolDef {
                name: "f".into(),
                description: None,
                parameters: serde_json::json!({"type": "object"}),
            }]
            .into(),
        )),
        reasoning: Some((ReasoningFormat::Think, false)),
    };
    let a = Assistant::parse(
        &spec,
        "<think>Call f. <tool_call> is how.</think>\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>",
    );
    assert_eq!(a.reasoning.as_deref(), Some("Call f. <tool_call> is how."));
    assert_eq!(a.content, None);
    assert_eq!(a.calls.len(), 1);
}

#[test]
fn reasoning_tokens_are_counted() {
    let mut s = think().stream();
    for t in ["<think>", "a", "b", "</think>", "\n\n", "Paris", "."] {
        s.push_token(t);
    }
    s.finish();
    assert_eq!(s.reasoning_tokens(), 4);
}

#[test]
fn prompts_that_open_the_block_are_recognised() {
    let f = ReasoningFormat::Think;
    assert!(f.prompt_opens("<|im_start|>assistant\n<think>\n"));
    assert!(!f.prompt_opens("<|im_start|>assistant\n<think>\n\n</think>\n\n"));
    assert!(!f.prompt_opens("<|im_start|>assistant\n"));
    // A user who writes the marker does not open the block.
    assert!(!f.prompt_opens("<|im_start|>user\nWhat does <think> do?<|im_end|>\n<|im_start|>assistant\n"));
    assert_eq!(
        ReasoningFormat::detect(Some("{{ '<think>' }}")),
        Some(ReasoningFormat::Think)
    );
    assert_eq!(
        ReasoningFormat::detect(Some("[THINK]")),
        Some(ReasoningFormat::MistralThink)
    );
    assert_eq!(ReasoningFormat::detect(Some("{{ x }}")), None);
}

proptest! {
    #[test]
    fn reasoning_streams_as_the_whole_answer_reads(cuts in proptest::collection::vec(0usize..80, 0..10), inside in any::<bool>()) {
        let text = if inside { "  thinking <think> hard \n</think>\n\n  Answer </think> here" } else { "\n<think>\n step one\n step two \n</think>\n\nParis <think>." };
        let spec = OutputSpec { tools: None, reasoning: Some((ReasoningFormat::Think, inside)) };
        let whole = Assistant::parse(&spec, text);
        let mut bounds: Vec<usize> = cuts.into_iter().map(|c| c % (text.len() + 1)).collect();
        bounds.extend([0, text.len()]);
        bounds.sort_unstable();
        bounds.dedup();
        let mut s = spec.stream();
        let mut d = Vec::new();
        for w in bounds.windows(2) {
            d.extend(s.push(&text[w[0]..w[1]]));
        }
        d.extend(s.finish());
        prop_assert_eq!(Assistant::collect(d), whole);
    }
}

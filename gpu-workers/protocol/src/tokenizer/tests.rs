use super::*;

#[test]
fn byte_table_is_a_bijection() {
    let t = byte_to_char_table();
    let mut seen = std::collections::HashSet::new();
    for c in t {
        assert!(seen.insert(c));
    }
    assert_eq!(t[b'A' as usize], 'A');
    assert_eq!(t[b' ' as usize], 'Ġ');
    assert_eq!(t[b'\n' as usize], 'Ċ');
}

fn byte_level(pre: &str, extra: &[&str], merges: &[&str]) -> TokenizerSpec {
    let b2c = byte_to_char_table();
    let mut tokens: Vec<String> = b2c.iter().map(|c| c.to_string()).collect();
    let mut types = vec![TOKEN_TYPE_NORMAL; 256];
    for t in extra {
        tokens.push(t.to_string());
        types.push(if t.starts_with("<|") {
            TOKEN_TYPE_CONTROL
        } else if t.starts_with('<') {
            TOKEN_TYPE_USER_DEFINED
        } else {
            TOKEN_TYPE_NORMAL
        });
    }
    TokenizerSpec {
        model: "gpt2".into(),
        pre: pre.into(),
        tokens,
        token_types: types,
        merges: merges.iter().map(|m| m.to_string()).collect(),
        eos_id: Some(261),
        ..Default::default()
    }
}

fn tiny() -> Tokenizer {
    let spec = byte_level(
        "smollm",
        &["he", "ll", "hell", "hello", "Ġw", "<|end|>", "<tool>"],
        &["h e", "l l", "he ll", "hell o", "Ġ w"],
    );
    Tokenizer::from_spec(&spec).unwrap()
}

#[test]
fn bpe_applies_merges_by_rank_and_round_trips() {
    let t = tiny();
    let ids = t.encode("hello world<|end|>42");
    assert_eq!(ids[0], 259); // "hello"
    assert_eq!(ids[1], 260); // "Ġw"
    assert!(ids.contains(&261));
    assert_eq!(t.decode(&ids, false).unwrap(), "hello world<|end|>42");
    assert_eq!(t.decode(&ids, true).unwrap(), "hello world42");
    // Digits are isolated, so "42" is two byte tokens.
    assert_eq!(
        &ids[ids.len() - 2..],
        &[t.byte_ids[b'4' as usize].unwrap(), t.byte_ids[b'2' as usize].unwrap()]
    );
    assert!(t.end_of_generation().contains(&261), "<|end|> ends generation");
}

#[test]
fn control_strings_stay_text_unless_parsed_but_added_tokens_split_always() {
    let t = tiny();
    let end = t.token_id("<|end|>").unwrap();
    let tool = t.token_id("<tool>").unwrap();
    assert!(!t.encode_with("a<|end|>", false, false).contains(&end));
    assert!(t.encode_with("a<|end|>", false, true).contains(&end));
    assert!(t.encode_with("a<tool>b", false, false).contains(&tool));
    assert!(t.is_special(end) && !t.is_special(tool));
}

#[test]
fn arbitrary_text_round_trips() {
    let t = tiny();
    for s in ["", " ", "ünïcödé 🚀\n\t x", "a'b 'll 12.5e3", "\u{0}\u{7f}"] {
        assert_eq!(t.decode(&t.encode(s), false).unwrap(), s);
    }
}

#[test]
fn long_words_take_the_heap_and_agree_with_short_ones() {
    let t = tiny();
    let word = "hello".repeat(400);
    let ids = t.encode(&word);
    assert_eq!(ids.len(), 400);
    assert!(ids.iter().all(|&i| i == 259));
}

#[test]
fn rstrip_tokens_swallow_the_whitespace_after_them() {
    let mut spec = byte_level("gpt-2", &["<|user|>"], &[]);
    let user = 256;
    spec.rstrip = vec![user];
    spec.eos_id = None;
    let t = Tokenizer::from_spec(&spec).unwrap();
    let ids = t.encode("<|user|>\n  hi");
    assert_eq!(ids[0], user);
    assert_eq!(t.decode(&ids[1..], false).unwrap(), "hi");
}

fn spm() -> Tokenizer {
    // Bytes, then pieces with scores (higher merges first).
    let mut tokens = vec!["<unk>".to_string(), "<s>".into(), "</s>".into()];
    let mut types = vec![TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_CONTROL, TOKEN_TYPE_CONTROL];
    let mut scores = vec![0.0, 0.0, 0.0];
    for b in 0..=255u8 {
        tokens.push(byte_token(b));
        types.push(TOKEN_TYPE_BYTE);
        scores.push(0.0);
    }
    for (t, s) in [
        ("▁", -1.0),
        ("h", -2.0),
        ("i", -2.0),
        ("▁h", -1.5),
        ("▁hi", -0.5),
        ("!", -3.0),
    ] {
        tokens.push(t.into());
        types.push(TOKEN_TYPE_NORMAL);
        scores.push(s);
    }
    Tokenizer::from_spec(&TokenizerSpec {
        model: "llama".into(),
        tokens,
        token_types: types,
        scores,
        bos_id: Some(1),
        eos_id: Some(2),
        ..Default::default()
    })
    .unwrap()
}

#[test]
fn sentencepiece_adds_the_space_prefix_merges_by_score_and_falls_back_to_bytes() {
    let t = spm();
    let hi = t.token_id("▁hi").unwrap();
    let ids = t.encode_with("hi hi!é", false, false);
    // "▁hi▁hi!é": two "▁hi", "!", then é's two UTF-8 bytes.
    assert_eq!(&ids[..3], &[hi, hi, t.token_id("!").unwrap()]);
    assert_eq!(
        &ids[3..],
        &[t.token_id("<0xC3>").unwrap(), t.token_id("<0xA9>").unwrap()]
    );
    assert_eq!(t.decode(&ids, false).unwrap(), "hi hi!é");
    // Raw prompts start with BOS (SentencePiece's default), which decoding skips.
    let p = t.encode_prompt("hi");
    assert_eq!(p, [1, hi]);
    assert_eq!(t.decode(&p, true).unwrap(), "hi");
    // The space comes again after a special token.
    let ids = t.encode("<s>hi");
    assert_eq!(ids, [1, hi]);
}

#[test]
fn unsupported_kinds_are_refused_by_name() {
    for (model, pre, why) in [
        ("bert", "", "WordPiece"),
        ("t5", "", "Unigram"),
        ("gpt2", "kimi-k2", "kimi-k2"),
    ] {
        let spec = TokenizerSpec {
            model: model.into(),
            pre: pre.into(),
            ..Default::default()
        };
        let e = Tokenizer::from_spec(&spec).unwrap_err().to_string();
        assert!(e.contains(why), "{e}");
    }
}

#[test]
fn lstrip_tokens_swallow_the_whitespace_before_them_and_strips_never_overlap() {
    let mut spec = byte_level("gpt-2", &["<|a|>", "\n<|b|>", "<mask>"], &[]);
    spec.eos_id = None;
    let (a, b, mask) = (256, 257, 258);
    spec.rstrip = vec![a];
    spec.lstrip = vec![mask];
    let t = Tokenizer::from_spec(&spec).unwrap();
    let ids = t.encode("x  <mask>y");
    assert_eq!(t.decode(&ids, false).unwrap(), "x<mask>y");
    // `<|a|>` swallows the newline `\n<|b|>` starts with: no panic, and `<|b|>` is text.
    let ids = t.encode("<|a|>\n<|b|>z");
    assert_eq!(ids[0], a);
    assert!(!ids.contains(&b));
    assert_eq!(t.decode(&ids, false).unwrap(), "<|a|><|b|>z");
}

//! Byte-level BPE tokenizer (GPT-2 family) built from a model file's vocabulary.
//!
//! Owns: splitting out special tokens, the pre-tokenizer (the GPT-2 word pattern, with the
//! `smollm` variant that isolates every digit), byte-to-unicode mapping, rank-ordered BPE
//! merges and decoding back to bytes. Token ids must match the model's reference tokenizer
//! exactly, because the KV cache and the router both key on them.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

/// GGUF token type of control tokens (`<|im_start|>`…) and user-defined added tokens.
const TOKEN_TYPE_CONTROL: i32 = 3;
const TOKEN_TYPE_USER_DEFINED: i32 = 4;

/// Everything needed to rebuild a tokenizer, as read from the model file. Small enough
/// (a few MB of JSON) for a worker to hand it to a gateway.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TokenizerSpec {
    /// `tokenizer.ggml.model` (only `gpt2`, byte-level BPE, is supported).
    pub model: String,
    /// `tokenizer.ggml.pre` (`smollm`, `gpt2`, `default`).
    pub pre: String,
    pub tokens: Vec<String>,
    pub token_types: Vec<i32>,
    pub merges: Vec<String>,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
    /// Whether raw (un-templated) prompts start with BOS (`tokenizer.ggml.add_bos_token`).
    #[serde(default)]
    pub add_bos: bool,
    /// Jinja chat template from the model file, if any.
    pub chat_template: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    #[error("unsupported tokenizer model {0:?} (Hearth supports byte-level BPE, `gpt2`)")]
    UnsupportedModel(String),
    #[error("unsupported pre-tokenizer {0:?} (supported: smollm, gpt2, default)")]
    UnsupportedPre(String),
    #[error("malformed tokenizer: {0}")]
    Malformed(String),
    #[error("token id {0} is outside the vocabulary")]
    UnknownId(u32),
}

/// A ready-to-use tokenizer.
#[derive(Debug, Clone)]
pub struct Tokenizer {
    spec_model: String,
    vocab: HashMap<String, u32>,
    /// (left, right) → (rank, merged id).
    merges: HashMap<(u32, u32), (u32, u32)>,
    /// Byte-level char → id of its single-char token, per byte value. Some vocabularies
    /// (SmolLM2's among them) lack a few control bytes; like the reference tokenizer
    /// (BPE without byte fallback or unk token), such bytes are dropped.
    byte_ids: [Option<u32>; 256],
    /// Decoded bytes of every token.
    token_bytes: Vec<Vec<u8>>,
    /// Special (control / added) tokens, longest first, for splitting.
    specials: Vec<(String, u32)>,
    is_special: Vec<bool>,
    split_digits: bool,
    add_bos: bool,
    bos_id: Option<u32>,
    eos_id: Option<u32>,
}

/// GPT-2's reversible byte → printable char mapping.
fn byte_to_char_table() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..256u32 {
        let printable = (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        table[b as usize] = if printable {
            char::from_u32(b).unwrap_or('\0')
        } else {
            n += 1;
            char::from_u32(255 + n).unwrap_or('\0')
        };
    }
    table
}

impl Tokenizer {
    pub fn from_spec(spec: &TokenizerSpec) -> Result<Self, TokenizeError> {
        if spec.model != "gpt2" {
            return Err(TokenizeError::UnsupportedModel(spec.model.clone()));
        }
        let split_digits = match spec.pre.as_str() {
            "smollm" => true,
            "gpt2" | "default" | "" => false,
            other => return Err(TokenizeError::UnsupportedPre(other.to_string())),
        };
        if spec.token_types.len() != spec.tokens.len() {
            return Err(TokenizeError::Malformed(format!(
                "{} tokens but {} token types",
                spec.tokens.len(),
                spec.token_types.len()
            )));
        }
        let b2c = byte_to_char_table();
        let mut c2b: HashMap<char, u8> = HashMap::with_capacity(256);
        for (b, c) in b2c.iter().enumerate() {
            c2b.insert(*c, b as u8);
        }
        let mut vocab = HashMap::with_capacity(spec.tokens.len());
        let mut token_bytes = Vec::with_capacity(spec.tokens.len());
        let mut specials = Vec::new();
        let mut is_special = vec![false; spec.tokens.len()];
        for (i, (tok, &ty)) in spec.tokens.iter().zip(&spec.token_types).enumerate() {
            let id = i as u32;
            vocab.entry(tok.clone()).or_insert(id);
            if ty == TOKEN_TYPE_CONTROL || ty == TOKEN_TYPE_USER_DEFINED {
                specials.push((tok.clone(), id));
                is_special[i] = ty == TOKEN_TYPE_CONTROL;
                token_bytes.push(tok.as_bytes().to_vec());
            } else {
                // Byte-level tokens map back through the table; anything unmappable is kept as UTF-8.
                let bytes: Option<Vec<u8>> = tok.chars().map(|c| c2b.get(&c).copied()).collect();
                token_bytes.push(bytes.unwrap_or_else(|| tok.as_bytes().to_vec()));
            }
        }
        specials.retain(|(s, _)| !s.is_empty());
        specials.sort_by_key(|s| std::cmp::Reverse(s.0.len()));
        let mut byte_ids = [None; 256];
        for (b, c) in b2c.iter().enumerate() {
            byte_ids[b] = vocab.get(&c.to_string()).copied();
        }
        if byte_ids.iter().filter(|b| b.is_some()).count() < 128 {
            return Err(TokenizeError::Malformed("the vocabulary is not byte-level".into()));
        }
        let mut merges = HashMap::with_capacity(spec.merges.len());
        for (rank, m) in spec.merges.iter().enumerate() {
            let (l, r) = m
                .split_once(' ')
                .ok_or_else(|| TokenizeError::Malformed(format!("merge {m:?} has no space")))?;
            let (Some(&li), Some(&ri), Some(&mi)) = (vocab.get(l), vocab.get(r), vocab.get(&format!("{l}{r}"))) else {
                continue; // A merge whose parts are not in the vocabulary can never apply.
            };
            merges.entry((li, ri)).or_insert((rank as u32, mi));
        }
        Ok(Self {
            spec_model: spec.model.clone(),
            vocab,
            merges,
            byte_ids,
            token_bytes,
            specials,
            is_special,
            split_digits,
            add_bos: spec.add_bos,
            bos_id: spec.bos_id,
            eos_id: spec.eos_id,
        })
    }

    pub fn vocab_size(&self) -> usize {
        self.token_bytes.len()
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos_id
    }

    pub fn eos_id(&self) -> Option<u32> {
        self.eos_id
    }

    /// Encodes a raw prompt (no chat template): BOS first when the model asks for it.
    pub fn encode_prompt(&self, text: &str) -> Vec<u32> {
        let mut ids = Vec::new();
        if let (true, Some(bos)) = (self.add_bos, self.bos_id) {
            ids.push(bos);
        }
        ids.extend(self.encode(text));
        ids
    }

    /// The id of a token given by its exact text (e.g. `<|im_end|>`).
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.vocab.get(token).copied()
    }

    pub fn kind(&self) -> &str {
        &self.spec_model
    }

    /// Encodes text; special-token strings in it (`<|im_start|>`…) become their ids.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 4);
        let mut rest = text;
        while !rest.is_empty() {
            // Find the earliest special token occurrence.
            let mut found: Option<(usize, &str, u32)> = None;
            for (s, id) in &self.specials {
                if let Some(pos) = rest.find(s.as_str()) {
                    if found.is_none_or(|(p, fs, _)| pos < p || (pos == p && s.len() > fs.len())) {
                        found = Some((pos, s.as_str(), *id));
                    }
                }
            }
            match found {
                Some((pos, s, id)) => {
                    self.encode_ordinary(&rest[..pos], &mut out);
                    out.push(id);
                    rest = &rest[pos + s.len()..];
                }
                None => {
                    self.encode_ordinary(rest, &mut out);
                    rest = "";
                }
            }
        }
        out
    }

    /// Encodes text with no special-token parsing.
    pub fn encode_ordinary(&self, text: &str, out: &mut Vec<u32>) {
        if text.is_empty() {
            return;
        }
        if self.split_digits {
            // The `Digits(individual)` pre-tokenizer: every numeric char is its own piece.
            let mut start = 0;
            for (i, c) in text.char_indices() {
                if c.is_numeric() {
                    self.encode_piece(&text[start..i], out);
                    self.encode_piece(&text[i..i + c.len_utf8()], out);
                    start = i + c.len_utf8();
                }
            }
            self.encode_piece(&text[start..], out);
        } else {
            self.encode_piece(text, out);
        }
    }

    fn encode_piece(&self, piece: &str, out: &mut Vec<u32>) {
        for word in Gpt2Words::new(piece) {
            self.bpe_word(word.as_bytes(), out);
        }
    }

    fn bpe_word(&self, bytes: &[u8], out: &mut Vec<u32>) {
        let mut ids: Vec<u32> = bytes.iter().filter_map(|&b| self.byte_ids[b as usize]).collect();
        while ids.len() > 1 {
            let mut best: Option<(u32, usize, u32)> = None;
            for i in 0..ids.len() - 1 {
                if let Some(&(rank, merged)) = self.merges.get(&(ids[i], ids[i + 1])) {
                    if best.is_none_or(|(r, _, _)| rank < r) {
                        best = Some((rank, i, merged));
                    }
                }
            }
            let Some((_, i, merged)) = best else { break };
            ids[i] = merged;
            ids.remove(i + 1);
        }
        out.extend_from_slice(&ids);
    }

    /// The raw bytes of one token (special tokens give their literal text).
    pub fn token_bytes(&self, id: u32) -> Result<&[u8], TokenizeError> {
        self.token_bytes
            .get(id as usize)
            .map(|b| b.as_slice())
            .ok_or(TokenizeError::UnknownId(id))
    }

    pub fn is_special(&self, id: u32) -> bool {
        self.is_special.get(id as usize).copied().unwrap_or(false)
    }

    /// Decodes ids to text; invalid UTF-8 is replaced. Control tokens are skipped when asked.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TokenizeError> {
        let mut bytes = Vec::new();
        for &id in ids {
            if skip_special && self.is_special(id) {
                continue;
            }
            bytes.extend_from_slice(self.token_bytes(id)?);
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }
}

/// The GPT-2 word pattern,
/// `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`,
/// as a hand-written scanner (the look-ahead is beyond the `regex` crate).
struct Gpt2Words<'a> {
    s: &'a str,
    pos: usize,
}

#[derive(PartialEq, Clone, Copy)]
enum Class {
    Letter,
    Number,
    Space,
    Other,
}

/// The pattern's classes exactly as the reference's regex engine has them: `\p{L}` and
/// `\p{N}` are Unicode general categories (not Rust's `is_alphabetic`, which also takes in
/// combining marks such as U+065F and letter numbers), `\s` is `White_Space` — read from
/// `regex-syntax`'s tables, the ones the `regex`/`fancy-regex` engines match with.
fn class(c: char) -> Class {
    if c.is_ascii() {
        return if c.is_ascii_alphabetic() {
            Class::Letter
        } else if c.is_ascii_digit() {
            Class::Number
        } else if c.is_ascii_whitespace() || c == '\u{b}' {
            Class::Space
        } else {
            Class::Other
        };
    }
    static TABLES: std::sync::OnceLock<[Vec<(char, char)>; 3]> = std::sync::OnceLock::new();
    let [letters, numbers, spaces] = TABLES.get_or_init(|| [ranges(r"\p{L}"), ranges(r"\p{N}"), ranges(r"\s")]);
    if in_ranges(c, letters) {
        Class::Letter
    } else if in_ranges(c, numbers) {
        Class::Number
    } else if in_ranges(c, spaces) {
        Class::Space
    } else {
        Class::Other
    }
}

/// The code point ranges of a one-class pattern.
fn ranges(pattern: &str) -> Vec<(char, char)> {
    use regex_syntax::hir::{Class as HirClass, HirKind};
    let hir = regex_syntax::Parser::new()
        .parse(pattern)
        .expect("a built-in character class");
    match hir.kind() {
        HirKind::Class(HirClass::Unicode(u)) => u.ranges().iter().map(|r| (r.start(), r.end())).collect(),
        _ => Vec::new(),
    }
}

fn in_ranges(c: char, ranges: &[(char, char)]) -> bool {
    ranges
        .binary_search_by(|&(lo, hi)| {
            if hi < c {
                std::cmp::Ordering::Less
            } else if lo > c {
                std::cmp::Ordering::Greater
            } else {
                std::cmp::Ordering::Equal
            }
        })
        .is_ok()
}

impl<'a> Gpt2Words<'a> {
    fn new(s: &'a str) -> Self {
        Self { s, pos: 0 }
    }

    /// End of a run of chars of class `cls` starting at byte `from`.
    fn run_end(&self, from: usize, cls: Class) -> usize {
        self.s[from..]
            .char_indices()
            .find(|&(_, c)| class(c) != cls)
            .map_or(self.s.len(), |(i, _)| from + i)
    }
}

impl<'a> Iterator for Gpt2Words<'a> {
    type Item = &'a str;

    fn next(&mut self) -> Option<&'a str> {
        let rest = &self.s[self.pos..];
        let mut chars = rest.chars();
        let c = chars.next()?;
        let start = self.pos;
        let end = 'end: {
            if c == '\'' {
                for suffix in ["s", "t", "re", "ve", "m", "ll", "d"] {
                    if rest[1..].starts_with(suffix) {
                        break 'end start + 1 + suffix.len();
                    }
                }
            }
            // ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`
            let (body_start, body) = if c == ' ' {
                match chars.next() {
                    Some(n) if class(n) != Class::Space => (start + 1, n),
                    _ => (start, c),
                }
            } else {
                (start, c)
            };
            let cls = class(body);
            if cls != Class::Space {
                break 'end self.run_end(body_start, cls);
            }
            // `\s+(?!\S)` then `\s+`.
            let run_end = self.run_end(start, Class::Space);
            if run_end == self.s.len() {
                break 'end run_end;
            }
            let last_len = self.s[..run_end].chars().next_back().map_or(1, char::len_utf8);
            if run_end - start > last_len {
                run_end - last_len
            } else {
                run_end
            }
        };
        self.pos = end;
        Some(&self.s[start..end])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(s: &str) -> Vec<&str> {
        Gpt2Words::new(s).collect()
    }

    #[test]
    fn gpt2_pattern_splits_like_the_regex() {
        assert_eq!(words("Hello world"), ["Hello", " world"]);
        assert_eq!(words("it's"), ["it", "'s"]);
        assert_eq!(words("a  b"), ["a", " ", " b"]);
        assert_eq!(words("a\n\nb"), ["a", "\n", "\n", "b"]);
        assert_eq!(words("x   "), ["x", "   "]);
        assert_eq!(words("hi!? there"), ["hi", "!?", " there"]);
        assert_eq!(words(" \nx"), [" ", "\n", "x"]);
        assert_eq!(words("über 12"), ["über", " 12"]);
    }

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

    fn tiny() -> Tokenizer {
        let b2c = byte_to_char_table();
        let mut tokens: Vec<String> = b2c.iter().map(|c| c.to_string()).collect();
        let mut types = vec![1; 256];
        for t in ["he", "ll", "hell", "hello", "Ġw", "<|end|>"] {
            tokens.push(t.to_string());
            types.push(if t.starts_with('<') { 3 } else { 1 });
        }
        let spec = TokenizerSpec {
            model: "gpt2".into(),
            pre: "smollm".into(),
            tokens,
            token_types: types,
            merges: vec![
                "h e".into(),
                "l l".into(),
                "he ll".into(),
                "hell o".into(),
                "Ġ w".into(),
            ],
            bos_id: None,
            eos_id: Some(261),
            add_bos: false,
            chat_template: None,
        };
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
    }

    #[test]
    fn arbitrary_text_round_trips() {
        let t = tiny();
        for s in ["", " ", "ünïcödé 🚀\n\t x", "a'b 'll 12.5e3", "\u{0}\u{7f}"] {
            assert_eq!(t.decode(&t.encode(s), false).unwrap(), s);
        }
    }
}

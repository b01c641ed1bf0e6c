//! Pre-tokenizers: how a byte-level BPE tokenizer cuts text into pieces before merging.
//!
//! Owns the table of the pre-tokenizers Hearth reproduces, by the name GGUF files carry in
//! `tokenizer.ggml.pre` (llama.cpp's names), each as the list of regular expressions the
//! model's own `tokenizer.json` splits with, in order: every expression cuts each piece so far
//! into its matches and the text between them, all kept (Hugging Face's `Split` with
//! `Isolated`, llama.cpp's `unicode_regex_split`).
//!
//! The expressions are the Hugging Face originals, so that a `tokenizer.json` is recognised by
//! comparing strings and the differential tests can hand the very same patterns to the
//! `tokenizers` crate. The `regex` crate runs them; the one construct it lacks, the trailing
//! `\s+(?!\S)` ("a run of whitespace, less its last character when a word follows"), is
//! emulated: the pattern runs with `\s+` in its place and a whitespace-only match that came
//! from that alternative, is followed by a non-space and is longer than one character gives
//! back its last character. Patterns with any other look-around are not in the table.

use regex::Regex;

/// GPT-2's word pattern (`ByteLevel` with `use_regex`).
pub const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
/// Llama 3's (`tiktoken`'s cl100k with digits in threes).
const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN35: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Mistral's Tekken (Mistral Nemo, Pixtral, Mistral Small 3).
const TEKKEN: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// o200k (GPT-4o; Llama 4).
const GPT4O: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const DEEPSEEK3: &str = r##"[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"##;
const SEED_CODER: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+";
const GPT2_DIGITS: &str = r"\p{N}";
const DEEPSEEK_LETTERS: &str = "\\s?[A-Za-z\u{b5}\u{c0}-\u{d6}\u{d8}-\u{f6}\u{f8}-\u{1ba}\u{1bc}-\u{1bf}\u{1c4}-\u{293}\u{295}-\u{2af}\u{370}-\u{373}\u{376}\u{377}\u{37b}-\u{37d}\u{37f}\u{386}\u{388}-\u{38a}\u{38c}\u{38e}-\u{3a1}\u{3a3}-\u{3f5}\u{3f7}-\u{481}\u{48a}-\u{52f}\u{531}-\u{556}\u{10a0}-\u{10c5}\u{13a0}-\u{13f5}\u{13f8}-\u{13fd}\u{1c90}-\u{1cba}\u{1cbd}-\u{1cbf}\u{1d00}-\u{1d2b}\u{1d6b}-\u{1d77}\u{1d79}-\u{1d9a}\u{1e00}-\u{1f15}\u{1f18}-\u{1f1d}\u{1f20}-\u{1f45}\u{1f48}-\u{1f4d}\u{1f50}-\u{1f57}\u{1f59}\u{1f5b}\u{1f5d}\u{1f5f}-\u{1f7d}\u{1f80}-\u{1fb4}\u{1fb6}-\u{1fbc}\u{1fbe}\u{1fc2}-\u{1fc4}\u{1fc6}-\u{1fcc}\u{1fd0}-\u{1fd3}\u{1fd6}-\u{1fdb}\u{1fe0}-\u{1fec}\u{1ff2}-\u{1ff4}\u{1ff6}-\u{1ffc}\u{2102}\u{2107}\u{210a}-\u{2113}\u{2115}\u{2119}-\u{211d}\u{2124}\u{2126}\u{2128}\u{212a}-\u{212d}\u{212f}-\u{2134}\u{2139}\u{213c}-\u{213f}\u{2145}-\u{2149}\u{214e}\u{2183}\u{2184}\u{2c00}-\u{2c7b}\u{2c7e}-\u{2ce4}\u{2ceb}-\u{2cee}\u{2cf2}\u{2cf3}\u{a640}-\u{a66d}\u{a680}-\u{a69b}\u{a722}-\u{a76f}\u{a771}-\u{a787}\u{a78b}-\u{a78e}\u{ab70}-\u{abbf}\u{fb00}-\u{fb06}\u{fb13}-\u{fb17}\u{ff21}-\u{ff3a}\u{ff41}-\u{ff5a}\u{10400}-\u{1044f}\u{104b0}-\u{104d3}\u{104d8}-\u{104fb}\u{10c80}-\u{10cb2}\u{10cc0}-\u{10cf2}\u{118a0}-\u{118df}\u{1e900}-\u{1e943}]+";
const DEEPSEEK_PUNCT: &str = "\\s?[!-/:-~\u{ff01}-\u{ff0f}\u{ff1a}-\u{ff5e}\u{2018}-\u{201f}\u{3000}-\u{3002}]+";
const CJK: &str = "[\u{4e00}-\u{9fa5}\u{800}-\u{4e00}\u{ac00}-\u{d7ff}]+";

/// A pre-tokenizer Hearth reproduces: its `tokenizer.ggml.pre` names and its patterns.
pub struct PreTokenizerDef {
    /// The name GGUF files carry, then the other names llama.cpp gives the same rules.
    pub names: &'static [&'static str],
    /// The patterns, applied in order (Hugging Face originals).
    pub patterns: &'static [&'static str],
    /// Use a whole piece as one token when the vocabulary has it, before any merge (the
    /// BPE option `ignore_merges`, which these models' `tokenizer.json` sets).
    pub ignore_merges: bool,
    /// Raw prompts start with BOS unless the file says otherwise (llama.cpp's default).
    pub add_bos: bool,
}

/// Every pre-tokenizer Hearth reproduces. Names not here are refused by name.
pub const PRE_TOKENIZERS: &[PreTokenizerDef] = &[
    PreTokenizerDef {
        names: &[
            "gpt-2",
            "gpt2",
            "mpt",
            "olmo",
            "phi-2",
            "jais",
            "trillion",
            "exaone4",
            "granite-docling",
        ],
        patterns: &[GPT2],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizerDef {
        // Digits(individual) then ByteLevel: SmolLM, StarCoder 2, Refact, Command-R.
        names: &[
            "smollm",
            "starcoder",
            "refact",
            "command-r",
            "codeshell",
            "exaone",
            "minerva-7b",
            "mellum2",
        ],
        patterns: &[GPT2_DIGITS, GPT2],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizerDef {
        names: &[
            "llama-bpe",
            "llama3",
            "llama-v3",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "dbrx",
            "smaug-bpe",
        ],
        patterns: &[LLAMA3],
        ignore_merges: true,
        add_bos: true,
    },
    PreTokenizerDef {
        names: &[
            "qwen2",
            "deepseek-r1-qwen",
            "megrez",
            "stablelm2",
            "hunyuan",
            "solar-open",
            "kormo",
            "grok-2",
        ],
        patterns: &[QWEN2],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizerDef {
        names: &["qwen35"],
        patterns: &[QWEN35],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizerDef {
        names: &["chatglm-bpe", "glm4", "glm5"],
        patterns: &[LLAMA3],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizerDef {
        names: &["tekken"],
        patterns: &[TEKKEN],
        ignore_merges: true,
        add_bos: true,
    },
    PreTokenizerDef {
        names: &["gpt-4o", "llama4", "minimax-m2", "kanana2"],
        patterns: &[GPT4O],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizerDef {
        names: &["deepseek-llm"],
        patterns: &[r"[\r\n]", DEEPSEEK_LETTERS, DEEPSEEK_PUNCT, r"\s+$", CJK, r"\p{N}+"],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizerDef {
        names: &["deepseek-coder"],
        patterns: &[r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", CJK, r"\p{N}"],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizerDef {
        names: &["deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"],
        patterns: &[r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+", DEEPSEEK3],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizerDef {
        // Punctuation, ByteLevel, then digits in threes (llama.cpp's rendering of Falcon's
        // `Punctuation` + `ByteLevel` + `Digits` sequence).
        names: &["falcon"],
        patterns: &[r"[\p{P}\$\+<=>\^~\|`]+", GPT2, r"[0-9][0-9][0-9]"],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizerDef {
        // llama.cpp's fallback for BPE files that name no pre-tokenizer.
        names: &["default", ""],
        patterns: &[r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizerDef {
        names: &["seed-coder"],
        patterns: &[SEED_CODER],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizerDef {
        names: &["poro-chat", "bloom", "gpt3-finnish"],
        patterns: &[r" ?[^(\s|.,!?…。，、।۔،)]+"],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizerDef {
        names: &["viking"],
        patterns: &[r" ?[^(\s|.,!?…。，、।۔،)]+", r"\p{N}"],
        ignore_merges: false,
        add_bos: false,
    },
];

/// The definition behind a `tokenizer.ggml.pre` name.
pub fn lookup(name: &str) -> Option<&'static PreTokenizerDef> {
    PRE_TOKENIZERS.iter().find(|d| d.names.contains(&name))
}

/// The name of the pre-tokenizer whose patterns are exactly these, if Hearth has one.
pub fn name_of(patterns: &[&str]) -> Option<&'static str> {
    PRE_TOKENIZERS
        .iter()
        .find(|d| d.patterns == patterns)
        .map(|d| d.names[0])
}

/// The emulated look-ahead, as it ends a pattern.
const WS_LOOKAHEAD: [&str; 2] = [r"|\s+(?!\S)|\s+", r"|\s+(?!\S)"];

/// One compiled pattern.
#[derive(Debug, Clone)]
struct Stage {
    re: Regex,
    /// With the look-ahead emulated: the pattern's alternatives before `\s+(?!\S)`,
    /// anchored, to tell whose match a whitespace-only match is.
    before_ws: Option<Regex>,
}

/// A compiled pre-tokenizer.
#[derive(Debug, Clone)]
pub struct PreTokenizer {
    stages: Vec<Stage>,
}

#[derive(Debug, thiserror::Error)]
#[error("pattern {pattern:?}: {reason}")]
pub struct PatternError {
    pattern: String,
    reason: String,
}

impl PreTokenizer {
    pub fn new(patterns: &[&str]) -> Result<Self, PatternError> {
        let stages = patterns
            .iter()
            .map(|p| {
                let err = |reason: String| PatternError {
                    pattern: p.to_string(),
                    reason,
                };
                let (body, before_ws) = match WS_LOOKAHEAD.iter().find_map(|s| p.strip_suffix(s)) {
                    Some(base) => (
                        format!(r"{base}|\s+"),
                        Some(Regex::new(&format!(r"\A(?:{base})")).map_err(|e| err(e.to_string()))?),
                    ),
                    None => (p.to_string(), None),
                };
                if body.contains("(?=") || body.contains("(?!") || body.contains("(?<") {
                    return Err(err("look-around other than a final \\s+(?!\\S) is not supported".into()));
                }
                Ok(Stage {
                    re: Regex::new(&body).map_err(|e| err(e.to_string()))?,
                    before_ws,
                })
            })
            .collect::<Result<_, _>>()?;
        Ok(Self { stages })
    }

    /// Cuts `text` into pieces (their concatenation is `text`); `f` gets each in order.
    pub fn split<'t>(&self, text: &'t str, f: &mut dyn FnMut(&'t str)) {
        self.split_from(0, text, f);
    }

    fn split_from<'t>(&self, stage: usize, text: &'t str, f: &mut dyn FnMut(&'t str)) {
        let Some(s) = self.stages.get(stage) else {
            if !text.is_empty() {
                f(text);
            }
            return;
        };
        let mut emit = |piece: &'t str| self.split_from(stage + 1, piece, f);
        let mut last = 0;
        let mut at = 0;
        while at < text.len() {
            let Some(m) = s.re.find_at(text, at) else { break };
            let (start, mut end) = (m.start(), m.end());
            if end == start {
                // An empty match (a pattern like `\s+$` never gives one, but a file's might):
                // step over one character.
                at = end + text[end..].chars().next().map_or(1, char::len_utf8);
                continue;
            }
            if let Some(before) = &s.before_ws {
                let piece = &text[start..end];
                let next_is_word = text[end..].chars().next().is_some_and(|c| !c.is_whitespace());
                if next_is_word
                    && piece.chars().nth(1).is_some()
                    && piece.chars().all(char::is_whitespace)
                    && !before.is_match(&text[start..])
                {
                    end -= piece.chars().next_back().map_or(0, char::len_utf8);
                }
            }
            if start > last {
                emit(&text[last..start]);
            }
            emit(&text[start..end]);
            last = end;
            at = end;
        }
        if last < text.len() {
            emit(&text[last..]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pieces(pre: &PreTokenizer, s: &str) -> Vec<String> {
        let mut out = Vec::new();
        pre.split(s, &mut |p| out.push(p.to_string()));
        out
    }

    #[test]
    fn gpt2_pattern_splits_like_the_regex() {
        let p = PreTokenizer::new(&[GPT2]).unwrap();
        let w = |s| pieces(&p, s);
        assert_eq!(w("Hello world"), ["Hello", " world"]);
        assert_eq!(w("it's"), ["it", "'s"]);
        assert_eq!(w("a  b"), ["a", " ", " b"]);
        assert_eq!(w("a\n\nb"), ["a", "\n", "\n", "b"]);
        assert_eq!(w("x   "), ["x", "   "]);
        assert_eq!(w("hi!? there"), ["hi", "!?", " there"]);
        assert_eq!(w(" \nx"), [" ", "\n", "x"]);
        assert_eq!(w("über 12"), ["über", " 12"]);
        assert_eq!(w("\t\tx"), ["\t", "\t", "x"]);
    }

    #[test]
    fn a_whitespace_match_of_an_earlier_alternative_keeps_its_length() {
        // Llama 3's `\s*[\r\n]+` matches "\n\n" before a word; only `\s+(?!\S)` gives back.
        let p = PreTokenizer::new(&[LLAMA3]).unwrap();
        assert_eq!(pieces(&p, "a\n\nb"), ["a", "\n\n", "b"]);
        assert_eq!(pieces(&p, "a   b"), ["a", "  ", " b"]);
        assert_eq!(pieces(&p, "12345"), ["123", "45"]);
        assert_eq!(pieces(&p, "I'LL"), ["I", "'LL"]);
    }

    #[test]
    fn stages_split_each_piece_and_keep_the_gaps() {
        let p = PreTokenizer::new(&[GPT2_DIGITS, GPT2]).unwrap();
        assert_eq!(pieces(&p, "ab 123x"), ["ab", " ", "1", "2", "3", "x"]);
    }

    #[test]
    fn every_table_entry_compiles_and_names_are_unique() {
        let mut seen = std::collections::HashSet::new();
        for d in PRE_TOKENIZERS {
            PreTokenizer::new(d.patterns).unwrap();
            for n in d.names {
                assert!(seen.insert(*n), "{n} twice");
            }
        }
        assert_eq!(name_of(&[LLAMA3]), Some("llama-bpe"));
        assert!(lookup("kimi-k2").is_none());
    }

    #[test]
    fn other_look_arounds_are_refused() {
        assert!(PreTokenizer::new(&[r"\d{1,3}(?=(?:\d{3})*\b)"]).is_err());
    }
}

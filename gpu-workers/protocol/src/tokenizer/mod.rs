//! Tokenizers, built from a model file's vocabulary: byte-level BPE with each pre-tokenizer
//! llama.cpp names (GPT-2, Llama 3, Qwen 2/3.5, DeepSeek, Falcon, StarCoder, Command-R, …),
//! SentencePiece (score-based merges, byte fallback, `▁` spaces, the added space prefix:
//! Llama 2, Mistral, Phi-3, Gemma 2/3) and SentencePiece-style BPE on raw UTF-8 (Gemma 4).
//!
//! Owns: splitting out special and added tokens (longest match first, with the tokens'
//! strip flags), the per-kind encoding, decoding back to bytes, BOS handling and the set of
//! tokens that end generation. Token ids must match the reference tokenizer exactly, because
//! the KV cache and the router both key on them; the tests check them against llama.cpp's
//! vocabulary test vectors and, on random text, against Hugging Face's `tokenizers`.
//! Anything Hearth cannot reproduce (WordPiece, Unigram, RWKV, pre-tokenizers with
//! look-arounds) is refused by name.

use std::collections::HashMap;

use aho_corasick::{AhoCorasick, MatchKind};
use serde::{Deserialize, Serialize};

mod merge;
pub mod pretokenize;

use merge::{FastHash, MergeTable};
use pretokenize::PreTokenizer;

/// GGUF token types (`tokenizer.ggml.token_type`).
pub const TOKEN_TYPE_NORMAL: i32 = 1;
pub const TOKEN_TYPE_UNKNOWN: i32 = 2;
pub const TOKEN_TYPE_CONTROL: i32 = 3;
pub const TOKEN_TYPE_USER_DEFINED: i32 = 4;
pub const TOKEN_TYPE_UNUSED: i32 = 5;
pub const TOKEN_TYPE_BYTE: i32 = 6;

/// Tokens that end generation wherever a vocabulary has them (llama.cpp's list, less the
/// ones for families Hearth does not serve), besides the file's EOS/EOT/EOM.
const END_OF_GENERATION: &[&str] = &[
    "<|eot_id|>",
    "<|eom_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "</s>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<｜end▁of▁sentence｜>",
];

/// Everything needed to rebuild a tokenizer, as read from the model file. Small enough
/// (a few MB of JSON) for a worker to hand it to a gateway.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct TokenizerSpec {
    /// `tokenizer.ggml.model`: `gpt2` (byte-level BPE), `llama` (SentencePiece) or `gemma4`
    /// (SentencePiece-style BPE).
    pub model: String,
    /// `tokenizer.ggml.pre` (byte-level BPE's pre-tokenizer; see [`pretokenize`]).
    pub pre: String,
    pub tokens: Vec<String>,
    pub token_types: Vec<i32>,
    /// SentencePiece's per-token scores (empty for BPE).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub scores: Vec<f32>,
    pub merges: Vec<String>,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
    /// End of turn and end of message (`<|eot_id|>`, `<|eom_id|>`), when the file names them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eot_id: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eom_id: Option<u32>,
    /// Whether raw (un-templated) prompts start with BOS (`tokenizer.ggml.add_bos_token`;
    /// absent: the tokenizer kind's default, as llama.cpp has it).
    #[serde(default)]
    pub add_bos: Option<bool>,
    /// SentencePiece's added space before text (`tokenizer.ggml.add_space_prefix`; absent:
    /// on for SentencePiece).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub add_space_prefix: Option<bool>,
    /// Special tokens that swallow the whitespace after / before them when split out of
    /// text (Hugging Face's `rstrip` / `lstrip`; llama.cpp gives Phi-3's these).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rstrip: Vec<u32>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub lstrip: Vec<u32>,
    /// Jinja chat template from the model file, if any.
    pub chat_template: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    #[error("unsupported tokenizer model {0:?} (Hearth runs byte-level BPE `gpt2`, SentencePiece `llama` and SentencePiece-style BPE `gemma4` and `spm-bpe`; {why})", why = refusal(.0))]
    UnsupportedModel(String),
    #[error("unsupported pre-tokenizer {0:?} (supported: {names})", names = supported_pre())]
    UnsupportedPre(String),
    #[error("malformed tokenizer: {0}")]
    Malformed(String),
    #[error("token id {0} is outside the vocabulary")]
    UnknownId(u32),
}

fn refusal(model: &str) -> &'static str {
    match model {
        "bert" => "WordPiece vocabularies belong to embedding models",
        "t5" => "Unigram vocabularies are not implemented",
        "rwkv" | "plamo2" | "hybriddna" | "whitespace" => "this tokenizer is not implemented",
        _ => "unknown tokenizer",
    }
}

/// The pre-tokenizer names Hearth reproduces, for messages.
pub fn supported_pre() -> String {
    pretokenize::PRE_TOKENIZERS
        .iter()
        .map(|d| d.names[0])
        .filter(|n| !n.is_empty())
        .collect::<Vec<_>>()
        .join(", ")
}

/// How a text fragment becomes ids.
#[derive(Debug, Clone)]
enum Kind {
    /// Byte-level BPE: pieces from the pre-tokenizer, bytes mapped to GPT-2's printable
    /// characters, merged by rank.
    ByteBpe { pre: PreTokenizer, ignore_merges: bool },
    /// SentencePiece: the whole fragment, spaces as `▁`, merged by score; characters that
    /// form no token fall back to `<0xXX>` byte tokens.
    Spm,
    /// BPE over raw UTF-8 with spaces as `▁`, with byte fallback: Gemma 4's GGUFs (split at
    /// newlines, a run of newlines one token when the vocabulary has it), and the
    /// `tokenizer.json` of SentencePiece models (Llama 2, Mistral, Gemma; `spm-bpe`).
    SpmBpe { split: SpmSplit },
}

/// How SentencePiece-style BPE cuts a fragment before merging.
#[derive(Debug, Clone)]
enum SpmSplit {
    /// Gemma 4: runs of newlines apart from the rest.
    Newlines(PreTokenizer),
    /// One word: the whole fragment.
    Whole,
    /// Before every `▁` (Hugging Face's `Metaspace` with `split`).
    Words,
}

/// Where a `▁` is put before text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SpacePrefix {
    Never,
    /// Before every fragment (llama.cpp's SentencePiece: the text's start and after every
    /// special token; Hugging Face's `Prepend` normalizer).
    Every,
    /// Before every fragment that does not start with one already (`Metaspace`, `always`).
    Always,
    /// Before the input's first fragment only, unless it starts with one (`Metaspace`, `first`).
    First,
}

/// `tokenizer.json` SentencePiece-style BPE variants (`tokenizer.ggml.pre` of model
/// `spm-bpe`, a Hearth name): how the `▁` prefix is added, and `-split` for `Metaspace`'s
/// split into words.
pub const SPM_BPE_VARIANTS: &[&str] = &[
    "prepend",
    "never",
    "metaspace-always",
    "metaspace-first",
    "metaspace-never",
    "metaspace-always-split",
    "metaspace-first-split",
    "metaspace-never-split",
];

/// A `spm-bpe` variant name: (how the prefix is added, whether words are split at `▁`).
fn spm_bpe_variant(pre: &str) -> Option<(SpacePrefix, bool)> {
    if !SPM_BPE_VARIANTS.contains(&pre) {
        return None;
    }
    let split = pre.ends_with("-split");
    let prefix = match pre.trim_end_matches("-split") {
        "prepend" => SpacePrefix::Every,
        "metaspace-always" => SpacePrefix::Always,
        "metaspace-first" => SpacePrefix::First,
        _ => SpacePrefix::Never,
    };
    Some((prefix, split))
}

/// What a tokenizer is, for `hearth model inspect` and error messages.
#[derive(Debug, Clone, Serialize)]
pub struct TokenizerSummary {
    pub kind: &'static str,
    pub model: String,
    pub pre_tokenizer: Option<String>,
    pub vocab_size: usize,
    pub merges: usize,
    pub special_tokens: usize,
    pub bos: Option<String>,
    pub eos: Option<String>,
    pub add_bos: bool,
    pub add_space_prefix: bool,
    pub end_of_generation: Vec<String>,
}

// Per-token attributes (llama.cpp's, from the GGUF token types, plus the strip flags).
const NORMAL: u8 = 1;
const UNKNOWN: u8 = 2;
const CONTROL: u8 = 4;
const USER_DEFINED: u8 = 8;
const UNUSED: u8 = 16;
const BYTE: u8 = 32;
const LSTRIP: u8 = 64;
const RSTRIP: u8 = 128;

/// A ready-to-use tokenizer.
#[derive(Debug, Clone)]
pub struct Tokenizer {
    kind: Kind,
    model: String,
    pre: String,
    /// Exact text (as stored in the vocabulary) → id.
    vocab: HashMap<String, u32>,
    /// Decoded bytes → id, for tokens whose bytes are their identity (SentencePiece pieces,
    /// byte-level pieces for `ignore_merges`).
    by_bytes: HashMap<Vec<u8>, u32, FastHash>,
    merges: MergeTable,
    /// Byte → the id that stands for it: GPT-2's printable character (byte-level BPE) or the
    /// `<0xXX>` token (byte fallback). Some vocabularies (SmolLM2's among them) lack a few
    /// control bytes; like the reference, such bytes are dropped.
    byte_ids: [Option<u32>; 256],
    scores: Vec<f32>,
    /// Decoded bytes of every token.
    token_bytes: Vec<Vec<u8>>,
    attrs: Vec<u8>,
    /// Special and added tokens (control, user-defined, unknown), longest match first; and
    /// the user-defined ones alone, for text whose control-token strings must stay text.
    specials: Option<(AhoCorasick, Vec<u32>)>,
    added_only: Option<(AhoCorasick, Vec<u32>)>,
    add_bos: bool,
    space_prefix: SpacePrefix,
    bos_id: Option<u32>,
    eos_id: Option<u32>,
    /// The unknown token, where the vocabulary has one (byte fallback's last resort).
    unk_id: Option<u32>,
    end_of_generation: Vec<u32>,
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

/// `<0xXX>`: a byte-fallback token's text.
fn byte_token(b: u8) -> String {
    format!("<0x{b:02X}>")
}

const SPACE_MARK: char = '▁';

fn automaton(tokens: &[String], ids: Vec<u32>) -> Result<Option<(AhoCorasick, Vec<u32>)>, TokenizeError> {
    if ids.is_empty() {
        return Ok(None);
    }
    let ac = AhoCorasick::builder()
        .match_kind(MatchKind::LeftmostLongest)
        .build(ids.iter().map(|&i| tokens[i as usize].as_str()))
        .map_err(|e| TokenizeError::Malformed(format!("special tokens: {e}")))?;
    Ok(Some((ac, ids)))
}

impl Tokenizer {
    pub fn from_spec(spec: &TokenizerSpec) -> Result<Self, TokenizeError> {
        let n = spec.tokens.len();
        if spec.token_types.len() != n {
            return Err(TokenizeError::Malformed(format!(
                "{n} tokens but {} token types",
                spec.token_types.len()
            )));
        }
        let kind = match spec.model.as_str() {
            "gpt2" => {
                let def =
                    pretokenize::lookup(&spec.pre).ok_or_else(|| TokenizeError::UnsupportedPre(spec.pre.clone()))?;
                Kind::ByteBpe {
                    pre: PreTokenizer::new(def.patterns).map_err(|e| TokenizeError::Malformed(e.to_string()))?,
                    ignore_merges: def.ignore_merges,
                }
            }
            "llama" => {
                if spec.scores.len() != n {
                    return Err(TokenizeError::Malformed(format!(
                        "a SentencePiece vocabulary needs a score per token ({n} tokens, {} scores)",
                        spec.scores.len()
                    )));
                }
                Kind::Spm
            }
            "gemma4" => Kind::SpmBpe {
                split: SpmSplit::Newlines(
                    PreTokenizer::new(&[r"[^\n]+|[\n]+"]).map_err(|e| TokenizeError::Malformed(e.to_string()))?,
                ),
            },
            "spm-bpe" if spm_bpe_variant(&spec.pre).is_some() => Kind::SpmBpe {
                split: if spm_bpe_variant(&spec.pre).is_some_and(|(_, split)| split) {
                    SpmSplit::Words
                } else {
                    SpmSplit::Whole
                },
            },
            "spm-bpe" => return Err(TokenizeError::UnsupportedPre(spec.pre.clone())),
            other => return Err(TokenizeError::UnsupportedModel(other.to_string())),
        };
        for (what, id) in [
            ("BOS", spec.bos_id),
            ("EOS", spec.eos_id),
            ("EOT", spec.eot_id),
            ("EOM", spec.eom_id),
        ] {
            if id.is_some_and(|i| i as usize >= n) {
                return Err(TokenizeError::Malformed(format!(
                    "the {what} id is outside the vocabulary"
                )));
            }
        }
        let byte_level = matches!(kind, Kind::ByteBpe { .. });
        let b2c = byte_to_char_table();
        let c2b: HashMap<char, u8> = b2c.iter().enumerate().map(|(b, c)| (*c, b as u8)).collect();

        let mut vocab = HashMap::with_capacity(n);
        let mut by_bytes = HashMap::with_capacity_and_hasher(n, FastHash);
        let mut token_bytes = Vec::with_capacity(n);
        let mut attrs = Vec::with_capacity(n);
        for (i, (tok, &ty)) in spec.tokens.iter().zip(&spec.token_types).enumerate() {
            let id = i as u32;
            vocab.entry(tok.clone()).or_insert(id);
            let mut attr = match ty {
                TOKEN_TYPE_UNKNOWN => UNKNOWN,
                TOKEN_TYPE_CONTROL => CONTROL,
                TOKEN_TYPE_USER_DEFINED => USER_DEFINED,
                TOKEN_TYPE_UNUSED => UNUSED,
                TOKEN_TYPE_BYTE => BYTE,
                _ => NORMAL,
            };
            if END_OF_GENERATION.contains(&tok.as_str()) && attr & (USER_DEFINED | NORMAL) != 0 {
                // llama.cpp's override: a token that ends turns is a control token.
                attr = CONTROL;
            }
            let bytes = if attr & (CONTROL | USER_DEFINED | UNKNOWN) != 0 {
                tok.as_bytes().to_vec()
            } else if attr & BYTE != 0 {
                parse_byte_token(tok).map_or_else(|| tok.as_bytes().to_vec(), |b| vec![b])
            } else if attr & UNUSED != 0 {
                Vec::new()
            } else if byte_level {
                // Byte-level tokens map back through the table; anything unmappable is kept as UTF-8.
                let bytes: Option<Vec<u8>> = tok.chars().map(|c| c2b.get(&c).copied()).collect();
                bytes.unwrap_or_else(|| tok.as_bytes().to_vec())
            } else {
                tok.replace(SPACE_MARK, " ").into_bytes()
            };
            if attr & (NORMAL | USER_DEFINED) != 0 {
                // The SentencePiece loop and `ignore_merges` look pieces up by their text:
                // escaped (`▁`) for SentencePiece, as decoded bytes for byte-level BPE.
                let key = if byte_level {
                    bytes.clone()
                } else {
                    tok.as_bytes().to_vec()
                };
                by_bytes.entry(key).or_insert(id);
            }
            token_bytes.push(bytes);
            attrs.push(attr);
        }
        for &id in &spec.rstrip {
            if let Some(a) = attrs.get_mut(id as usize) {
                *a |= RSTRIP;
            }
        }
        for &id in &spec.lstrip {
            if let Some(a) = attrs.get_mut(id as usize) {
                *a |= LSTRIP;
            }
        }

        let mut byte_ids = [None; 256];
        for b in 0..=255u8 {
            byte_ids[b as usize] = if byte_level {
                vocab.get(&b2c[b as usize].to_string()).copied()
            } else {
                vocab
                    .get(&byte_token(b))
                    .or_else(|| (b < 0x80).then(|| vocab.get(&(b as char).to_string())).flatten())
                    .copied()
            };
        }
        if byte_level && byte_ids.iter().filter(|b| b.is_some()).count() < 128 {
            return Err(TokenizeError::Malformed("the vocabulary is not byte-level".into()));
        }

        let mut merges = HashMap::with_capacity_and_hasher(spec.merges.len(), FastHash);
        if !matches!(kind, Kind::Spm) {
            for (rank, m) in spec.merges.iter().enumerate() {
                // The separator is the first space after the first character (a merge's left
                // side may itself be a space in raw-UTF-8 vocabularies).
                let split = m
                    .char_indices()
                    .skip(1)
                    .find(|&(_, c)| c == ' ')
                    .map(|(i, _)| i)
                    .ok_or_else(|| TokenizeError::Malformed(format!("merge {m:?} has no space")))?;
                let (l, r) = (&m[..split], &m[split + 1..]);
                let (Some(&li), Some(&ri), Some(&mi)) = (vocab.get(l), vocab.get(r), vocab.get(&format!("{l}{r}")))
                else {
                    continue; // A merge whose parts are not in the vocabulary can never apply.
                };
                merges.entry((li, ri)).or_insert((rank as u32, mi));
            }
        }

        let mut end_of_generation: Vec<u32> = [spec.eos_id, spec.eot_id, spec.eom_id].into_iter().flatten().collect();
        for t in END_OF_GENERATION {
            if let Some(&id) = vocab.get(*t) {
                if attrs[id as usize] & CONTROL != 0 && !end_of_generation.contains(&id) {
                    end_of_generation.push(id);
                }
            }
        }

        let mut special_ids: Vec<u32> = (0..n as u32)
            .filter(|&i| {
                attrs[i as usize] & (CONTROL | USER_DEFINED | UNKNOWN) != 0 && !spec.tokens[i as usize].is_empty()
            })
            .collect();
        special_ids.sort_by_key(|&i| std::cmp::Reverse(spec.tokens[i as usize].len()));
        let added: Vec<u32> = special_ids
            .iter()
            .copied()
            .filter(|&i| attrs[i as usize] & USER_DEFINED != 0)
            .collect();
        let specials = automaton(&spec.tokens, special_ids)?;
        let added_only = automaton(&spec.tokens, added)?;

        // BOS by default as llama.cpp has it: SentencePiece, and the pre-tokenizers that ask
        // for it (Llama 3, Tekken); Gemma 4 always.
        let spm_like = matches!(kind, Kind::Spm);
        let pre_wants_bos = pretokenize::lookup(&spec.pre).is_some_and(|d| d.add_bos);
        let always_bos = matches!(
            kind,
            Kind::SpmBpe {
                split: SpmSplit::Newlines(_)
            }
        );
        let add_bos = always_bos || spec.add_bos.unwrap_or(spm_like || pre_wants_bos);
        let unk_id = if byte_level {
            None
        } else {
            attrs.iter().position(|&a| a & UNKNOWN != 0).map(|i| i as u32)
        };
        Ok(Self {
            kind,
            model: spec.model.clone(),
            pre: spec.pre.clone(),
            vocab,
            by_bytes,
            merges,
            byte_ids,
            scores: spec.scores.clone(),
            token_bytes,
            attrs,
            specials,
            added_only,
            add_bos: add_bos && spec.bos_id.is_some(),
            space_prefix: match (spec.model.as_str(), spec.pre.as_str()) {
                ("llama", _) if spec.add_space_prefix.unwrap_or(true) => SpacePrefix::Every,
                ("spm-bpe", p) => spm_bpe_variant(p).map_or(SpacePrefix::Never, |(prefix, _)| prefix),
                _ => SpacePrefix::Never,
            },
            bos_id: spec.bos_id,
            eos_id: spec.eos_id,
            unk_id,
            end_of_generation,
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

    /// The tokens that end generation: EOS, EOT, EOM and the turn-ending control tokens
    /// the vocabulary has (`<|im_end|>`, `<|eot_id|>`, `<end_of_turn>`, …).
    pub fn end_of_generation(&self) -> &[u32] {
        &self.end_of_generation
    }

    /// Encodes a raw prompt (no chat template): BOS first when the model asks for it.
    pub fn encode_prompt(&self, text: &str) -> Vec<u32> {
        self.encode_with(text, true, true)
    }

    /// The id of a token given by its exact text (e.g. `<|im_end|>`).
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.vocab.get(token).copied()
    }

    /// Encodes text; special-token strings in it (`<|im_start|>`…) become their ids.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        self.encode_with(text, false, true)
    }

    /// Encodes text. `add_special`: BOS first when the model asks for it. `parse_special`:
    /// control-token strings in the text become their ids (added tokens always do).
    pub fn encode_with(&self, text: &str, add_special: bool, parse_special: bool) -> Vec<u32> {
        self.encode_impl(text, add_special, parse_special, false)
    }

    /// Encodes text that continues earlier output (what a grammar forces next): never
    /// SentencePiece's added space, no special tokens parsed.
    pub fn encode_continuation(&self, text: &str) -> Vec<u32> {
        self.encode_impl(text, false, false, true)
    }

    fn encode_impl(&self, text: &str, add_special: bool, parse_special: bool, continuation: bool) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 4);
        if let (true, true, Some(bos)) = (add_special, self.add_bos, self.bos_id) {
            out.push(bos);
        }
        let automaton = if parse_special {
            &self.specials
        } else {
            &self.added_only
        };
        let mut rest_start = 0;
        if let Some((ac, ids)) = automaton {
            for m in ac.find_iter(text) {
                if m.start() < rest_start {
                    // Inside whitespace the previous token's rstrip swallowed.
                    continue;
                }
                let id = ids[m.pattern().as_usize()];
                let attr = self.attrs[id as usize];
                let mut end = m.start();
                if attr & LSTRIP != 0 {
                    end = rest_start + text[rest_start..end].trim_end().len();
                }
                if end > rest_start {
                    self.encode_fragment(
                        &text[rest_start..end],
                        rest_start == 0 && !continuation,
                        continuation,
                        &mut out,
                    );
                }
                out.push(id);
                rest_start = m.end();
                if attr & RSTRIP != 0 {
                    rest_start = text.len() - text[rest_start..].trim_start().len();
                }
            }
        }
        if rest_start < text.len() {
            self.encode_fragment(
                &text[rest_start..],
                rest_start == 0 && !continuation,
                continuation,
                &mut out,
            );
        }
        out
    }

    /// Spaces as `▁`, with the prefix the tokenizer adds (`at_start`: the fragment begins the
    /// input; `continuation`: it continues earlier text, and gets none).
    fn escape(&self, text: &str, at_start: bool, continuation: bool) -> String {
        let mut e = String::with_capacity(text.len() + 3);
        let starts_marked = text.starts_with(' ') || text.starts_with(SPACE_MARK);
        let add = !continuation
            && match self.space_prefix {
                SpacePrefix::Never => false,
                SpacePrefix::Every => true,
                SpacePrefix::Always => !starts_marked,
                SpacePrefix::First => at_start && !starts_marked,
            };
        if add {
            e.push(SPACE_MARK);
        }
        e.extend(text.chars().map(|c| if c == ' ' { SPACE_MARK } else { c }));
        e
    }

    fn encode_fragment(&self, text: &str, at_start: bool, continuation: bool, out: &mut Vec<u32>) {
        match &self.kind {
            Kind::ByteBpe { pre, ignore_merges } => {
                pre.split(text, &mut |piece| {
                    if *ignore_merges {
                        if let Some(&id) = self.by_bytes.get(piece.as_bytes()) {
                            out.push(id);
                            return;
                        }
                    }
                    let mut ids: Vec<u32> = piece.bytes().filter_map(|b| self.byte_ids[b as usize]).collect();
                    merge::bpe(&mut ids, &self.merges);
                    out.extend_from_slice(&ids);
                });
            }
            Kind::Spm => {
                let escaped = self.escape(text, at_start, continuation);
                let token = |b: &[u8]| self.by_bytes.get(b).copied();
                let score = |id: u32| self.scores.get(id as usize).copied().unwrap_or(0.0);
                for (start, len) in merge::spm(&escaped, &token, &score) {
                    let piece = &escaped.as_bytes()[start as usize..(start + len) as usize];
                    self.push_piece_or_bytes(piece, out);
                }
            }
            Kind::SpmBpe { split } => {
                let escaped = self.escape(text, at_start, continuation);
                let mut word = |piece: &str| {
                    if matches!(split, SpmSplit::Newlines(_)) && piece.bytes().all(|b| b == b'\n') {
                        if let Some(&id) = self.by_bytes.get(piece.as_bytes()) {
                            out.push(id);
                            return;
                        }
                    }
                    self.spm_bpe_word(piece, out);
                };
                match split {
                    SpmSplit::Newlines(pre) => pre.split(&escaped, &mut word),
                    SpmSplit::Whole => word(&escaped),
                    SpmSplit::Words => {
                        let mut start = 0;
                        for (i, _) in escaped.match_indices(SPACE_MARK).filter(|&(i, _)| i > 0) {
                            word(&escaped[start..i]);
                            start = i;
                        }
                        if start < escaped.len() {
                            word(&escaped[start..]);
                        }
                    }
                }
            }
        }
    }

    /// One word of SentencePiece-style BPE: runs of characters that are tokens merge; any
    /// other character becomes its bytes (no merge can involve it).
    fn spm_bpe_word(&self, piece: &str, out: &mut Vec<u32>) {
        let mut run: Vec<u32> = Vec::new();
        for (i, c) in piece.char_indices() {
            let ch = &piece.as_bytes()[i..i + c.len_utf8()];
            match self.by_bytes.get(ch) {
                Some(&id) => run.push(id),
                None => {
                    merge::bpe(&mut run, &self.merges);
                    out.append(&mut run);
                    self.push_bytes(ch, out);
                }
            }
        }
        merge::bpe(&mut run, &self.merges);
        out.append(&mut run);
    }

    fn push_piece_or_bytes(&self, piece: &[u8], out: &mut Vec<u32>) {
        match self.by_bytes.get(piece) {
            Some(&id) => out.push(id),
            None => self.push_bytes(piece, out),
        }
    }

    /// Bytes as their byte tokens; a byte the vocabulary has no token for becomes the
    /// unknown token (or, without one, is dropped, as the reference drops it).
    fn push_bytes(&self, bytes: &[u8], out: &mut Vec<u32>) {
        out.extend(bytes.iter().filter_map(|&b| self.byte_ids[b as usize].or(self.unk_id)));
    }

    /// The raw bytes of one token (special tokens give their literal text).
    pub fn token_bytes(&self, id: u32) -> Result<&[u8], TokenizeError> {
        self.token_bytes
            .get(id as usize)
            .map(|b| b.as_slice())
            .ok_or(TokenizeError::UnknownId(id))
    }

    /// A token's text (lossy UTF-8), e.g. BOS's for a template's `bos_token`.
    pub fn token_text(&self, id: Option<u32>) -> Option<String> {
        id.and_then(|i| self.token_bytes(i).ok())
            .map(|b| String::from_utf8_lossy(b).into_owned())
    }

    /// Control tokens (and the unknown token): never shown as text in generated output.
    pub fn is_special(&self, id: u32) -> bool {
        self.attrs
            .get(id as usize)
            .is_some_and(|a| a & (CONTROL | UNKNOWN) != 0)
    }

    /// Decodes ids to text; invalid UTF-8 is replaced. Control tokens are skipped when asked.
    /// SentencePiece's added space before the first piece is taken off again, so that
    /// `decode(encode(x)) == x`.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TokenizeError> {
        let mut bytes = Vec::new();
        let mut first = true;
        for &id in ids {
            if skip_special && self.is_special(id) {
                continue;
            }
            let b = self.token_bytes(id)?;
            match (first, self.space_prefix) {
                // The added space comes off the first piece: one space (llama.cpp's
                // SentencePiece, `tokenizer.json`'s `Strip`), or every `▁` of it
                // (`Metaspace`'s decoder).
                (true, SpacePrefix::Every) => bytes.extend_from_slice(b.strip_prefix(b" ").unwrap_or(b)),
                (true, SpacePrefix::Always | SpacePrefix::First) => bytes.extend(b.iter().filter(|&&c| c != b' ')),
                _ => bytes.extend_from_slice(b),
            }
            first = false;
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// What this tokenizer is.
    pub fn summary(&self) -> TokenizerSummary {
        let name = |id: Option<u32>| self.token_text(id);
        TokenizerSummary {
            kind: match self.kind {
                Kind::ByteBpe { .. } => "byte-level BPE",
                Kind::Spm => "SentencePiece",
                Kind::SpmBpe { .. } => "SentencePiece-style BPE",
            },
            model: self.model.clone(),
            pre_tokenizer: (matches!(self.kind, Kind::ByteBpe { .. }) || self.model == "spm-bpe")
                .then(|| self.pre.clone()),
            vocab_size: self.vocab_size(),
            merges: self.merges.len(),
            special_tokens: self.specials.as_ref().map_or(0, |s| s.1.len()),
            bos: name(self.bos_id),
            eos: name(self.eos_id),
            add_bos: self.add_bos,
            add_space_prefix: self.space_prefix != SpacePrefix::Never,
            end_of_generation: self.end_of_generation.iter().filter_map(|&i| name(Some(i))).collect(),
        }
    }
}

/// The byte of a `<0xXX>` token.
pub fn parse_byte_token(tok: &str) -> Option<u8> {
    let hex = tok.strip_prefix("<0x")?.strip_suffix('>')?;
    (hex.len() == 2).then(|| u8::from_str_radix(hex, 16).ok()).flatten()
}

/// The same tokenizer as a Hugging Face `tokenizer.json` (what `tokenizers` reads): the
/// vocabulary, merges and added tokens; for byte-level BPE the pre-tokenizer as its patterns
/// (`Split`, `Isolated`) before a `ByteLevel` without its own regex; for `spm-bpe` the
/// `▁` normalizer or `Metaspace` pre-tokenizer, with byte fallback; SentencePiece (`llama`,
/// scores) as byte-fallback BPE whose merges are ranked by score, as Hugging Face converts
/// it. Gemma 4's GGUF rules (its newline runs) have no exact `tokenizer.json`.
pub fn hf_tokenizer_json(spec: &TokenizerSpec) -> Result<serde_json::Value, TokenizeError> {
    use serde_json::json;
    // SentencePiece with scores is written as byte-fallback BPE, as Hugging Face converts
    // it: merges ranked by the joined piece's score, the legacy space prefix.
    let spm;
    let (spec, merges) = match spec.model.as_str() {
        "llama" => {
            spm = TokenizerSpec {
                model: "spm-bpe".into(),
                pre: if spec.add_space_prefix == Some(false) {
                    "never"
                } else {
                    "prepend"
                }
                .into(),
                ..spec.clone()
            };
            (&spm, spm_merges(spec))
        }
        _ => (spec, spec.merges.clone()),
    };
    let (normalizer, pre_tokenizer, decoder, byte_fallback, ignore_merges) = match spec.model.as_str() {
        "gpt2" => {
            let def = pretokenize::lookup(&spec.pre).ok_or_else(|| TokenizeError::UnsupportedPre(spec.pre.clone()))?;
            let mut pre: Vec<serde_json::Value> = def
                .patterns
                .iter()
                .map(|p| json!({"type": "Split", "pattern": {"Regex": p}, "behavior": "Isolated", "invert": false}))
                .collect();
            pre.push(json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}));
            (
                serde_json::Value::Null,
                json!({"type": "Sequence", "pretokenizers": pre}),
                json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true}),
                false,
                def.ignore_merges,
            )
        }
        "spm-bpe" => {
            let (prefix, split) =
                spm_bpe_variant(&spec.pre).ok_or_else(|| TokenizeError::UnsupportedPre(spec.pre.clone()))?;
            let replace = json!({"type": "Replace", "pattern": {"String": " "}, "content": "▁"});
            let bytes_decoder = |strip: bool| {
                let mut d = vec![
                    json!({"type": "Replace", "pattern": {"String": "▁"}, "content": " "}),
                    json!({"type": "ByteFallback"}),
                    json!({"type": "Fuse"}),
                ];
                if strip {
                    d.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
                }
                json!({"type": "Sequence", "decoders": d})
            };
            let scheme = match prefix {
                SpacePrefix::Always => "always",
                SpacePrefix::First => "first",
                SpacePrefix::Never | SpacePrefix::Every => "never",
            };
            match (spec.pre.as_str(), prefix) {
                ("prepend", _) => (
                    json!({"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"}, replace]}),
                    serde_json::Value::Null,
                    bytes_decoder(true),
                    true,
                    false,
                ),
                ("never", _) => (replace, serde_json::Value::Null, bytes_decoder(false), true, false),
                _ => {
                    let m = json!({"type": "Metaspace", "replacement": "▁", "prepend_scheme": scheme, "split": split});
                    let d = json!({"type": "Sequence", "decoders": [m.clone(), {"type": "ByteFallback"}, {"type": "Fuse"}]});
                    (serde_json::Value::Null, m, d, true, false)
                }
            }
        }
        other => return Err(TokenizeError::UnsupportedModel(other.to_string())),
    };
    let added: Vec<serde_json::Value> = spec
        .tokens
        .iter()
        .zip(&spec.token_types)
        .enumerate()
        .filter(|(_, (_, &ty))| ty == TOKEN_TYPE_CONTROL || ty == TOKEN_TYPE_USER_DEFINED)
        .map(|(id, (t, &ty))| {
            json!({"id": id, "content": t, "single_word": false,
                   "lstrip": spec.lstrip.contains(&(id as u32)), "rstrip": spec.rstrip.contains(&(id as u32)),
                   "normalized": false, "special": ty == TOKEN_TYPE_CONTROL})
        })
        .collect();
    let vocab: serde_json::Map<String, serde_json::Value> = spec
        .tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), json!(i)))
        .collect();
    let unk = spec
        .tokens
        .iter()
        .zip(&spec.token_types)
        .find(|(_, &ty)| ty == TOKEN_TYPE_UNKNOWN)
        .map(|(t, _)| t.clone())
        .filter(|_| byte_fallback);
    Ok(json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
        "normalizer": normalizer, "pre_tokenizer": pre_tokenizer,
        "post_processor": null,
        "decoder": decoder,
        "model": {"type": "BPE", "dropout": null, "unk_token": unk, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": byte_fallback, "byte_fallback": byte_fallback,
                  "ignore_merges": ignore_merges, "vocab": vocab, "merges": merges},
    }))
}

/// BPE merges equivalent to a SentencePiece BPE model's scores (Hugging Face's
/// `SentencePieceExtractor`): every split of a normal piece into two vocabulary pieces,
/// ranked by the piece's score (ties: by piece id, then by the halves' ids).
fn spm_merges(spec: &TokenizerSpec) -> Vec<String> {
    let ids: std::collections::HashMap<&str, usize> =
        spec.tokens.iter().enumerate().map(|(i, t)| (t.as_str(), i)).collect();
    let mut merges: Vec<(f32, usize, usize, usize)> = Vec::new();
    for (id, piece) in spec.tokens.iter().enumerate() {
        if spec.token_types.get(id).is_some_and(|&t| t != TOKEN_TYPE_NORMAL) {
            continue;
        }
        let score = spec.scores.get(id).copied().unwrap_or(0.0);
        for (i, _) in piece.char_indices().skip(1) {
            let (l, r) = piece.split_at(i);
            if let (Some(&a), Some(&b)) = (ids.get(l), ids.get(r)) {
                merges.push((score, id, a, b));
            }
        }
    }
    merges.sort_by(|x, y| y.0.total_cmp(&x.0).then((x.1, x.2, x.3).cmp(&(y.1, y.2, y.3))));
    merges
        .into_iter()
        .map(|(_, _, a, b)| format!("{} {}", spec.tokens[a], spec.tokens[b]))
        .collect()
}

#[cfg(test)]
mod tests;

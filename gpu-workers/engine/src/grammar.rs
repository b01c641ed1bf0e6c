//! Constrained decoding: a request's [`Constraint`] compiled by llguidance into a matcher
//! that gives, at every step, the set of tokens that keep the output inside the grammar.
//!
//! The tokenizer's view llguidance needs (a token trie over the vocabulary, special tokens
//! marked with `0xff`, the model's end-of-generation tokens as EOS) is built once per
//! engine, on the first constrained request, so that cold starts do not pay for it. Each
//! choice of each request gets its own [`Grammar`]: constraints never cross requests.

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use hearth_protocol::{json_layout, Constraint, Tokenizer};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};

/// Why a constraint was refused.
#[derive(Debug, thiserror::Error)]
pub enum GrammarError {
    /// The schema uses a JSON Schema feature llguidance does not implement.
    #[error("{0}")]
    Unsupported(String),
    /// The schema or grammar is malformed or unsatisfiable.
    #[error("{0}")]
    Invalid(String),
    /// The worker cannot constrain at all (its token tables failed to build): not the
    /// request's fault.
    #[error("{0}")]
    Unavailable(String),
}

impl GrammarError {
    /// The worker error code the gateway maps to a 400.
    pub fn code(&self) -> &'static str {
        match self {
            GrammarError::Unsupported(_) => "unsupported_schema",
            GrammarError::Invalid(_) => "invalid_schema",
            GrammarError::Unavailable(_) => "grammar_unavailable",
        }
    }
}

/// llguidance's view of Hearth's tokenizer.
struct Env {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    /// Text a grammar forces continues the output: SentencePiece adds no space before it
    /// (else a forced "o" after "n" would become " o").
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        match std::str::from_utf8(s) {
            Ok(text) => self.tokenizer.encode_continuation(text),
            Err(_) => self.trie.greedy_tokenize(s),
        }
    }
}

/// Compiles constraints for one model; the token trie and llguidance's per-tokenizer
/// tables are built on first use.
pub struct Grammars {
    tokenizer: Arc<Tokenizer>,
    vocab: usize,
    end_of_generation: Vec<u32>,
    factory: OnceLock<Result<ParserFactory, String>>,
}

impl Grammars {
    /// `vocab` is the model's (logit rows; may exceed the tokenizer's with padding).
    pub fn new(tokenizer: Arc<Tokenizer>, vocab: usize, end_of_generation: Vec<u32>) -> Self {
        Self {
            tokenizer,
            vocab,
            end_of_generation,
            factory: OnceLock::new(),
        }
    }

    fn factory(&self) -> Result<&ParserFactory, GrammarError> {
        self.factory
            .get_or_init(|| {
                let started = Instant::now();
                let words: Vec<Vec<u8>> = (0..self.vocab as u32)
                    .map(|id| match self.tokenizer.token_bytes(id) {
                        Ok(b) if self.tokenizer.is_special(id) => {
                            let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                            w.extend_from_slice(b);
                            w
                        }
                        Ok(b) => b.to_vec(),
                        Err(_) => Vec::new(), // padding rows: never allowed
                    })
                    .collect();
                let eos = self.end_of_generation.first().copied().unwrap_or(0);
                let trie = TokTrie::from(&TokRxInfo::new(self.vocab as u32, eos), &words)
                    .with_eos_tokens(&self.end_of_generation);
                let env: TokEnv = Arc::new(Env {
                    trie,
                    tokenizer: self.tokenizer.clone(),
                });
                let mut f = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
                f.quiet();
                tracing::info!(ms = started.elapsed().as_millis() as u64, "grammar tables built");
                Ok(f)
            })
            .as_ref()
            .map_err(|e| GrammarError::Unavailable(format!("constrained decoding is unavailable on this worker: {e}")))
    }

    /// A fresh matcher for `c`, or why it cannot be compiled.
    pub fn compile(&self, c: &Constraint) -> Result<Grammar, GrammarError> {
        let grammar = match c {
            Constraint::JsonSchema { schema } => {
                if !schema.is_object() && !schema.is_boolean() {
                    return Err(GrammarError::Invalid("a JSON Schema must be an object".into()));
                }
                let mut schema = schema.clone();
                if let Some(o) = schema.as_object_mut() {
                    o.insert("x-guidance".into(), json_layout());
                }
                TopLevelGrammar::from_json_schema(schema)
            }
            // Its `%json` schemas carry their own layout (see `json_layout`).
            Constraint::Lark { grammar } => TopLevelGrammar::from_lark(grammar.clone()),
        };
        let factory = self.factory()?;
        let parser = factory.create_parser(grammar).map_err(|e| classify(&e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(classify(&e));
        }
        Ok(Grammar {
            matcher,
            vocab: self.vocab,
            end_of_generation: self.end_of_generation.clone(),
        })
    }
}

fn classify(message: &str) -> GrammarError {
    let m = message.trim().to_string();
    if m.contains("Unimplemented keys") || m.contains("not supported") || m.contains("Unsupported") {
        GrammarError::Unsupported(m)
    } else {
        GrammarError::Invalid(m)
    }
}

/// One choice's grammar state.
#[derive(Clone)]
pub struct Grammar {
    matcher: Matcher,
    vocab: usize,
    end_of_generation: Vec<u32>,
}

impl Grammar {
    /// Sets the logits of every token the grammar does not allow next to -inf; returns the
    /// time the mask took. An internal grammar error leaves only the EOS tokens allowed.
    pub fn mask(&mut self, logits: &mut [f32]) -> Duration {
        let started = Instant::now();
        match self.matcher.compute_mask_or_eos() {
            Ok(allowed) => {
                for (t, l) in logits.iter_mut().enumerate().take(self.vocab) {
                    if !allowed.is_allowed(t as u32) {
                        *l = f32::NEG_INFINITY;
                    }
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "grammar failed; ending the output");
                let end: Vec<f32> = self.end_of_generation.iter().map(|&t| logits[t as usize]).collect();
                logits.fill(f32::NEG_INFINITY);
                for (&t, l) in self.end_of_generation.iter().zip(end) {
                    logits[t as usize] = if l.is_finite() { l } else { 0.0 };
                }
            }
        }
        started.elapsed()
    }

    /// Up to `k` tokens the grammar forces next (the rest of a JSON key, `": "` after it…):
    /// certain drafts for speculative decoding.
    pub fn forced(&mut self, k: usize) -> Vec<u32> {
        let mut f = self.matcher.compute_ff_tokens();
        f.truncate(k);
        f
    }

    /// How many of `tokens`, in order, the grammar accepts from here (its state unchanged):
    /// a draft is cut where the grammar would refuse it.
    pub fn valid_prefix(&mut self, tokens: &[u32]) -> usize {
        self.matcher.validate_tokens(tokens).unwrap_or(0)
    }

    /// Advances past a generated token (EOS tokens end the output and are not consumed).
    pub fn advance(&mut self, token: u32) {
        if let Err(e) = self.matcher.consume_token(token) {
            tracing::warn!(error = %e, token, "grammar refused a generated token");
        }
    }

    /// The grammar has ended (only EOS may follow).
    pub fn is_stopped(&self) -> bool {
        self.matcher.is_stopped()
    }
}

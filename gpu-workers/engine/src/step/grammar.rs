//! Constrained decoding: a request's [`Constraint`] compiled by llguidance into a matcher
//! that gives, at every step, the set of tokens that keep the output inside the grammar.
//!
//! The tokenizer's view llguidance needs (a token trie over the vocabulary, special tokens
//! marked with `0xff`, the model's end-of-generation tokens as EOS) is built once per
//! engine, on the first constrained request, so that cold starts do not pay for it. Each
//! choice of each request gets its own [`Grammar`]: constraints never cross requests.
//!
//! **A constrained answer ends valid within its budget.** A grammar state has a shortest
//! way to an accepting end (close the string, the arrays and objects, give required fields
//! their shortest values, then end); [`Grammar::mask_within`] plans it by walking a copy of
//! the matcher — forced tokens first, else the most closing token the grammar allows
//! ([`Closers`]) — and once the tokens left reach that plan's length, the answer follows
//! the plan. An answer that is already complete (a tool call ended) is ended there when
//! the budget could not hold another whole one, rather than starting a call it would cut.
//! Such an answer reports `length` (it was cut short) with content that parses.

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
    closers: OnceLock<Arc<Closers>>,
}

/// The tokens a closing plan prefers. Inside a string (where a letter is allowed) the
/// quotes that end it, longest first (`"}]` closes three things at once); elsewhere the
/// runs of `}` and `]`, longest first, then separators, then the shortest values (`0`,
/// `""`, `[]`, `{}`, …), then single letters for strings that must be longer.
pub struct Closers {
    quotes: Vec<u32>,
    rest: Vec<u32>,
    letter: Option<u32>,
}

impl Closers {
    fn new(tokenizer: &Tokenizer, vocab: usize) -> Self {
        let text = |id: u32| -> Option<String> {
            if tokenizer.is_special(id) {
                return None;
            }
            let b = tokenizer.token_bytes(id).ok()?;
            std::str::from_utf8(b).ok().map(str::to_string)
        };
        let (mut quotes, mut closing, mut separators, mut exact) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut letter = None;
        const VALUES: [&str; 13] = [
            "0", "\"\"", "[]", "{}", "\"", "null", "true", "false", "[", "{", "1", "-", "a",
        ];
        for id in 0..vocab as u32 {
            let Some(t) = text(id) else { continue };
            let core = t.trim();
            if t == "a" {
                letter = Some(id);
            }
            if core.is_empty() {
                continue;
            }
            let quote_run = core.starts_with('"') && core.chars().all(|c| matches!(c, '"' | '}' | ']'));
            if quote_run && core.len() == t.len() {
                quotes.push((std::cmp::Reverse(core.len()), id));
            }
            // (A value may also be a quote run: `"` opens a string, `""` is the empty one.)
            if let Some(rank) = VALUES.iter().position(|v| *v == t) {
                exact.push((rank, id));
            } else if !quote_run && core.chars().all(|c| matches!(c, '}' | ']')) {
                closing.push((std::cmp::Reverse(core.len()), id));
            } else if core == "," {
                separators.push((t.len(), id));
            }
        }
        quotes.sort_unstable();
        closing.sort_unstable();
        separators.sort_unstable();
        exact.sort_unstable();
        let rest = closing
            .into_iter()
            .map(|(_, id)| id)
            .chain(separators.into_iter().map(|(_, id)| id))
            .chain(exact.into_iter().map(|(_, id)| id))
            .collect();
        Self {
            quotes: quotes.into_iter().map(|(_, id)| id).collect(),
            rest,
            letter,
        }
    }

    /// The most closing token `allowed` admits.
    fn pick(&self, allowed: impl Fn(u32) -> bool) -> Option<u32> {
        let in_string = self.letter.is_some_and(&allowed);
        let first: &[u32] = if in_string { &self.quotes } else { &[] };
        first.iter().chain(&self.rest).copied().find(|&t| allowed(t))
    }
}

impl Grammars {
    /// `vocab` is the model's (logit rows; may exceed the tokenizer's with padding).
    pub fn new(tokenizer: Arc<Tokenizer>, vocab: usize, end_of_generation: Vec<u32>) -> Self {
        Self {
            tokenizer,
            vocab,
            end_of_generation,
            factory: OnceLock::new(),
            closers: OnceLock::new(),
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
        let closers = self
            .closers
            .get_or_init(|| Arc::new(Closers::new(&self.tokenizer, self.vocab)))
            .clone();
        Ok(Grammar {
            matcher,
            vocab: self.vocab,
            end_of_generation: self.end_of_generation.clone(),
            closers,
            budget: Budget::default(),
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
    closers: Arc<Closers>,
    budget: Budget,
}

/// Where the answer stands against its token budget.
#[derive(Clone, Default)]
struct Budget {
    /// The length of a whole shortest answer, planned from the start when the budget is
    /// tight from the start (else unknown: 0).
    whole: Option<usize>,
    /// A mask has been asked for.
    started: bool,
    /// The last plan's length.
    estimate: usize,
    /// Steps since the plan was last made.
    since: usize,
    /// Closing: the tokens left to follow (the last may be an end-of-generation token).
    plan: Option<std::collections::VecDeque<u32>>,
    /// The plan forces tokens (an answer only ended where it was complete is not cut).
    cut: bool,
    /// The last plan found no end within [`MAX_PLAN`]: re-plan only every [`REPLAN_EVERY`].
    stuck: bool,
}

/// Plans are made within this many tokens; a structure that cannot close sooner is cut.
const MAX_PLAN: usize = 128;
/// Re-plan when the tokens left come within this many of the last plan's length…
const SLACK: usize = 8;
/// …and at least this often.
const REPLAN_EVERY: usize = 16;
/// Start closing this many tokens before the plan would no longer fit (a token may open
/// more than one structure).
const MARGIN: usize = 2;

impl Grammar {
    /// [`mask`](Self::mask) for an answer with `remaining` tokens left (this one included):
    /// once they reach the shortest way to end validly, only that way is allowed.
    pub fn mask_within(&mut self, logits: &mut [f32], remaining: usize) -> Duration {
        let started = Instant::now();
        self.plan_budget(remaining);
        if let Some(next) = self.budget.plan.as_ref().and_then(|p| p.front().copied()) {
            let keep = logits
                .get(next as usize)
                .copied()
                .filter(|l| l.is_finite())
                .unwrap_or(0.0);
            logits.fill(f32::NEG_INFINITY);
            if let Some(l) = logits.get_mut(next as usize) {
                *l = keep;
            }
            return started.elapsed();
        }
        self.mask(logits);
        started.elapsed()
    }

    /// Whether the answer is being cut short to fit (its finish is `length`); an answer
    /// ended where it was already complete is not.
    pub fn closing(&self) -> bool {
        self.budget.plan.is_some() && self.budget.cut
    }

    fn plan_budget(&mut self, remaining: usize) {
        let first = !std::mem::replace(&mut self.budget.started, true);
        // Far from the end no plan matters (and none is made: the first tokens pay nothing).
        if self.budget.plan.is_some() || self.matcher.is_stopped() || remaining > MAX_PLAN + SLACK + MARGIN {
            return;
        }
        if self.budget.whole.is_none() {
            let whole = if first {
                self.close_plan().map_or(MAX_PLAN, |p| p.len())
            } else {
                0
            };
            self.budget.whole = Some(whole);
            self.budget.estimate = whole;
        }
        self.budget.since += 1;
        let near = !self.budget.stuck && remaining <= self.budget.estimate + SLACK + MARGIN;
        if !near && self.budget.since < REPLAN_EVERY {
            return;
        }
        self.budget.since = 0;
        // A complete answer that could not fit another whole one ends here.
        let whole = self.budget.whole.unwrap_or(MAX_PLAN);
        if remaining < whole + SLACK && self.matcher.is_accepting().unwrap_or(false) {
            if let Some(&eos) = self.end_of_generation.first() {
                self.budget.plan = Some([eos].into());
            }
            return;
        }
        let Some(plan) = self.close_plan() else {
            self.budget.stuck = true;
            return;
        };
        self.budget.stuck = false;
        self.budget.estimate = plan.len();
        if plan.len() + MARGIN >= remaining {
            self.budget.cut = plan.iter().any(|t| !self.end_of_generation.contains(t));
            self.budget.plan = Some(plan.into());
        }
    }

    /// The shortest way found from here to a valid end (its last token an end-of-generation
    /// token unless the grammar stops by itself), or None within [`MAX_PLAN`] tokens.
    fn close_plan(&self) -> Option<Vec<u32>> {
        let mut m = self.matcher.deep_clone();
        let mut plan = Vec::new();
        while plan.len() < MAX_PLAN {
            if m.is_stopped() {
                return Some(plan);
            }
            if m.is_accepting().ok()? {
                plan.push(*self.end_of_generation.first()?);
                return Some(plan);
            }
            let forced = m.compute_ff_tokens();
            if !forced.is_empty() {
                m.consume_tokens(&forced).ok()?;
                plan.extend(forced);
                continue;
            }
            let mask = m.compute_mask().ok()?;
            let pick = self.closers.pick(|t| mask.is_allowed(t)).or_else(|| {
                (0..self.vocab as u32).find(|&t| mask.is_allowed(t) && !self.end_of_generation.contains(&t))
            })?;
            m.consume_token(pick).ok()?;
            plan.push(pick);
        }
        None
    }

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
        if let Some(plan) = &self.budget.plan {
            let eos = &self.end_of_generation;
            return plan.iter().copied().take_while(|t| !eos.contains(t)).take(k).collect();
        }
        let mut f = self.matcher.compute_ff_tokens();
        f.truncate(k);
        f
    }

    /// How many of `tokens`, in order, the grammar accepts from here (its state unchanged):
    /// a draft is cut where the grammar would refuse it.
    pub fn valid_prefix(&mut self, tokens: &[u32]) -> usize {
        if let Some(plan) = &self.budget.plan {
            return tokens.iter().zip(plan).take_while(|(a, b)| a == b).count();
        }
        self.matcher.validate_tokens(tokens).unwrap_or(0)
    }

    /// Advances past a generated token (EOS tokens end the output and are not consumed).
    pub fn advance(&mut self, token: u32) {
        if let Some(plan) = self.budget.plan.as_mut() {
            if plan.front() == Some(&token) {
                plan.pop_front();
            }
        }
        if let Err(e) = self.matcher.consume_token(token) {
            tracing::warn!(error = %e, token, "grammar refused a generated token");
        }
    }

    /// The grammar has ended (only EOS may follow).
    pub fn is_stopped(&self) -> bool {
        self.matcher.is_stopped()
    }
}

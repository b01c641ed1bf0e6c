//! Speculative decoding: draft tokens proposed cheaply, verified by the model in one
//! batched forward pass (the draft positions ride along the sequence's decode row), the
//! longest agreeing prefix kept and the K/V of the rest left behind (positions past a
//! sequence's computed length are never read, and are overwritten by its next tokens).
//!
//! The drafter here is prompt lookup (n-gram): agents repeat their context constantly —
//! quoting a document they edit, copying field values into JSON, restating tool results —
//! so the tokens that followed the last few tokens' most recent earlier occurrence are a
//! good guess. Drafts come only from the sequence's own tokens: they never cross requests.
//!
//! [`Drafter`] is the seam for a draft model or an EAGLE-style head: such a drafter needs
//! its own KV (a small model's, or the head's over the target's hidden states — which
//! `forward_batch` would have to return for the draft rows), and a draft with
//! probabilities q would make verification accept with `min(1, p/q)` and redraw from the
//! residual `max(0, p − q)`, instead of today's sample-and-compare (exact only for a
//! draft proposed with certainty).

/// Proposes up to `k` tokens to follow `tokens`.
pub trait Drafter {
    fn draft(&self, tokens: &[u32], k: usize) -> Vec<u32>;
}

/// Prompt lookup: the longest suffix of `max_ngram` down to `min_ngram` tokens that occurred
/// earlier in the sequence; the draft is what followed its most recent occurrence.
#[derive(Debug, Clone, Copy)]
pub struct PromptLookup {
    pub min_ngram: usize,
    pub max_ngram: usize,
    /// Look back at most this many tokens (bounds the search on long contexts).
    pub window: usize,
}

impl Default for PromptLookup {
    fn default() -> Self {
        Self {
            min_ngram: 2,
            max_ngram: 4,
            window: 8192,
        }
    }
}

impl Drafter for PromptLookup {
    fn draft(&self, tokens: &[u32], k: usize) -> Vec<u32> {
        let len = tokens.len();
        if k == 0 {
            return Vec::new();
        }
        let from = len.saturating_sub(self.window);
        for n in (self.min_ngram..=self.max_ngram).rev() {
            if len <= n {
                continue;
            }
            let suffix = &tokens[len - n..];
            // Most recent earlier occurrence first, with at least one token after it.
            let mut start = len - n;
            while start > from {
                start -= 1;
                if tokens[start..start + n] == *suffix {
                    let after = start + n;
                    return tokens[after..(after + k).min(len)].to_vec();
                }
            }
        }
        Vec::new()
    }
}

/// One sequence's speculation: the draft length adapts to what gets accepted (longer after
/// a fully accepted draft, shorter after a rejection), and after drafts that were rejected
/// outright it pauses (1, 2, 4 … up to 16 steps, doubling while they keep failing), so that
/// text the context does not predict costs little: a rejected draft token still costs its
/// row in the forward pass.
#[derive(Debug, Clone, Copy)]
pub struct Speculation {
    k: usize,
    max: usize,
    /// Drafts rejected outright in a row.
    misses: u32,
    /// Steps left before drafting again.
    pause: u32,
}

/// The longest pause after failed drafts, in steps.
const MAX_PAUSE: u32 = 16;

impl Speculation {
    pub fn new(max: usize) -> Self {
        Self {
            k: max,
            max,
            misses: 0,
            pause: 0,
        }
    }

    /// Draft tokens to propose this step (0 while paused); called once per step.
    pub fn draft_len(&mut self) -> usize {
        if self.pause > 0 {
            self.pause -= 1;
            return 0;
        }
        self.k
    }

    pub fn is_off(&self) -> bool {
        self.max == 0
    }

    /// Records a verification: `accepted` of `drafted` draft tokens were kept.
    pub fn record(&mut self, drafted: usize, accepted: usize) {
        if drafted == 0 {
            return;
        }
        if accepted == 0 {
            self.misses += 1;
            self.pause = (1u32 << (self.misses - 1).min(4)).min(MAX_PAUSE);
        } else {
            self.misses = 0;
        }
        self.k = if accepted == drafted {
            (self.k + 2).min(self.max)
        } else {
            (accepted + 1).clamp(1, self.max)
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drafts_what_followed_the_last_occurrence() {
        let d = PromptLookup::default();
        // "a b c d e ... a b c" → "d e"
        let t = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3];
        assert_eq!(d.draft(&t, 2), [4, 5]);
        assert_eq!(d.draft(&t, 10), [4, 5, 9, 9, 1, 2, 3]);
        // The most recent occurrence wins.
        let t = [7, 8, 1, 7, 8, 2, 7, 8];
        assert_eq!(d.draft(&t, 1), [2]);
        // No repeated n-gram of at least two tokens: no draft.
        assert!(d.draft(&[1, 2, 3, 4, 1], 4).is_empty());
        assert!(d.draft(&[1, 2, 1, 2], 0).is_empty());
    }

    #[test]
    fn draft_length_adapts() {
        let mut s = Speculation::new(8);
        assert_eq!(s.draft_len(), 8);
        s.record(8, 1);
        assert_eq!(s.draft_len(), 2);
        s.record(2, 2);
        assert_eq!(s.draft_len(), 4);
        s.record(0, 0);
        assert_eq!(s.draft_len(), 4);
        assert!(Speculation::new(0).is_off());
    }

    #[test]
    fn drafts_rejected_outright_pause_drafting_longer_each_time() {
        let mut s = Speculation::new(6);
        // Rejected outright: one step without a draft, then a one-token draft.
        s.record(6, 0);
        assert_eq!((s.draft_len(), s.draft_len()), (0, 1));
        // Again: two steps, then four, …, capped at 16.
        s.record(1, 0);
        assert_eq!([s.draft_len(), s.draft_len(), s.draft_len()], [0, 0, 1]);
        for misses in 3..8u32 {
            s.record(1, 0);
            let pause = (1u32 << (misses - 1)).min(16);
            for _ in 0..pause {
                assert_eq!(s.draft_len(), 0, "after {misses} misses");
            }
            assert_eq!(s.draft_len(), 1);
        }
        // One accepted token ends the streak.
        s.record(1, 1);
        assert_eq!(s.draft_len(), 3);
        s.record(3, 0);
        assert_eq!((s.draft_len(), s.draft_len()), (0, 1));
    }
}

//! Choosing the next token: greedy, temperature, top-k, top-p, seeded.

use hearth_protocol::SamplingParams;

/// SplitMix64: small, fast, and reproducible across platforms for a given seed.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// A seed from the process's random hasher state (no seed requested).
    pub fn from_entropy() -> Self {
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64),
        );
        Self(h.finish())
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[derive(Debug, Clone)]
pub struct Sampler {
    temperature: f32,
    top_k: usize,
    top_p: f32,
    rng: Rng,
}

/// Temperatures at or below this are treated as greedy.
const GREEDY_BELOW: f32 = 1e-5;

pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

impl Sampler {
    pub fn new(p: &SamplingParams) -> Self {
        Self {
            temperature: p.temperature,
            top_k: p.top_k as usize,
            top_p: p.top_p,
            rng: p.seed.map_or_else(Rng::from_entropy, Rng::new),
        }
    }

    /// Advances the random stream past one token generated elsewhere (a disaggregated
    /// request's first token, sampled by its prefill worker from the same seed), so that the
    /// next token gets the draw colocated serving would give it.
    pub fn skip(&mut self) {
        if !self.greedy() {
            self.rng.next_f64();
        }
    }

    fn greedy(&self) -> bool {
        self.temperature <= GREEDY_BELOW || self.top_k == 1
    }

    /// The distribution sampling draws from, after temperature, top-k and top-p: candidates
    /// with unnormalised weights, and their total.
    fn distribution(&self, logits: &[f32]) -> (Vec<(u32, f32)>, f64) {
        let inv_t = 1.0 / self.temperature;
        let mut cand: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .filter(|(_, l)| l.is_finite())
            .map(|(i, &l)| (i as u32, l * inv_t))
            .collect();
        if cand.is_empty() {
            // Everything masked: nothing better to offer than the argmax.
            return (vec![(argmax(logits), 1.0)], 1.0);
        }
        let by_logit_desc = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1);
        if self.top_k > 0 && self.top_k < cand.len() {
            cand.select_nth_unstable_by(self.top_k - 1, by_logit_desc);
            cand.truncate(self.top_k);
        }
        let restrict_p = self.top_p < 1.0;
        if restrict_p {
            cand.sort_unstable_by(by_logit_desc);
        }
        let max = cand.iter().fold(f32::NEG_INFINITY, |m, c| m.max(c.1));
        let mut total = 0f64;
        for c in cand.iter_mut() {
            c.1 = (c.1 - max).exp();
            total += c.1 as f64;
        }
        if restrict_p {
            // Smallest prefix (by probability) whose mass reaches top_p; always keep one.
            let mut acc = 0f64;
            let mut keep = cand.len();
            for (i, c) in cand.iter().enumerate() {
                acc += c.1 as f64 / total;
                if acc >= self.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
            cand.truncate(keep.max(1));
            total = cand.iter().map(|c| c.1 as f64).sum();
        }
        (cand, total)
    }

    fn draw(&mut self, cand: &[(u32, f32)], total: f64) -> u32 {
        let mut r = self.rng.next_f64() * total;
        for c in cand {
            r -= c.1 as f64;
            if r < 0.0 {
                return c.0;
            }
        }
        cand.last().map_or(0, |c| c.0)
    }

    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.greedy() {
            return argmax(logits);
        }
        let (cand, total) = self.distribution(logits);
        self.draw(&cand, total)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_k: u32, top_p: f32, seed: u64) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
            seed: Some(seed),
            ..Default::default()
        }
    }

    #[test]
    fn greedy_is_argmax() {
        let mut s = Sampler::new(&params(0.0, 0, 1.0, 1));
        assert_eq!(s.sample(&[0.1, 3.0, -1.0, 2.9]), 1);
    }

    #[test]
    fn same_seed_same_tokens_and_top_k_restricts() {
        let logits: Vec<f32> = (0..100).map(|i| ((i * 37) % 100) as f32 * 0.02).collect();
        let run = |seed| {
            let mut s = Sampler::new(&params(1.0, 0, 1.0, seed));
            (0..50).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(run(5), run(5));
        assert_ne!(run(5), run(6));
        let mut s = Sampler::new(&params(5.0, 3, 1.0, 9));
        let mut top: Vec<u32> = (0..100).collect();
        top.sort_by(|a, b| logits[*b as usize].total_cmp(&logits[*a as usize]));
        for _ in 0..200 {
            assert!(top[..3].contains(&s.sample(&logits)));
        }
    }

    #[test]
    fn top_p_keeps_only_the_nucleus() {
        // One token holds ~88% of the mass; top_p 0.5 must always pick it.
        let logits = [5.0, 2.0, 1.0, 0.0];
        let mut s = Sampler::new(&params(1.0, 0, 0.5, 3));
        for _ in 0..100 {
            assert_eq!(s.sample(&logits), 0);
        }
        // With top_p 1 the others appear.
        let mut s = Sampler::new(&params(1.0, 0, 1.0, 3));
        assert!((0..500).any(|_| s.sample(&logits) != 0));
    }
}

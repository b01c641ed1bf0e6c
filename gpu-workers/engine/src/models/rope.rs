//! Rotary position embeddings: which elements rotate together ([`RopeLayout`]), the
//! frequencies, and how they are stretched for a longer context ([`RopeScaling`]: linear
//! interpolation, Llama 3's per-frequency factors, YaRN, Phi-3's LongRoPE factors).
//!
//! Every kind reduces to one effective frequency per pair and one magnitude `mscale` that
//! multiplies cos and sin (YaRN's attention-temperature correction; 1 otherwise), so a
//! step computes one table of `(cos, sin)` per position and every layer of that table's
//! kind reads it. The arithmetic is llama.cpp's `rope_yarn` / `ggml_rope_yarn_corr_dims`,
//! which equals transformers' `_compute_yarn_parameters` and `_compute_llama3_parameters`.

use std::f32::consts::PI;
use std::fmt;

/// Which elements of a head RoPE rotates together.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RopeLayout {
    /// Pairs (2i, 2i+1): llama.cpp's layout for `llama` files, whose converter permutes
    /// the Q/K rows.
    #[default]
    Adjacent,
    /// Pairs (i, i + d/2): Hugging Face's `rotate_half`, on unpermuted Q/K rows (and
    /// llama.cpp's "NeoX" layout for Qwen, Gemma and Phi-3 files).
    Halves,
}

/// How the rotary frequencies are stretched beyond the trained context.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RopeScalingKind {
    #[default]
    None,
    /// Positions divided by the factor (position interpolation).
    Linear,
    /// Llama 3.1's: low frequencies divided by the factor, high ones kept, a smooth ramp
    /// between (GGUF files carry the result as the `rope_freqs` tensor).
    Llama3,
    /// YaRN: interpolation for low frequencies, extrapolation for high ones, a ramp
    /// between, and cos/sin scaled by `0.1·ln(factor) + 1`.
    Yarn,
    /// Phi-3's LongRoPE: per-frequency factors from the file (long or short set, by the
    /// context served) and an attention factor.
    LongRope,
}

impl RopeScalingKind {
    pub fn name(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Linear => "linear",
            Self::Llama3 => "llama3",
            Self::Yarn => "yarn",
            Self::LongRope => "longrope",
        }
    }
}

/// RoPE scaling: the kind and its parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeScaling {
    pub kind: RopeScalingKind,
    /// Context multiplier (≥ 1).
    pub factor: f32,
    /// The context the model was trained on, which the factor stretches (0: the model's
    /// own context length).
    pub original_context: usize,
    /// Llama 3: frequencies with wavelength above `original / low` are divided by the
    /// factor, below `original / high` kept.
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    /// YaRN's ramp ends, in rotations over the original context.
    pub beta_fast: f32,
    pub beta_slow: f32,
    /// Multiplies cos and sin (GGUF `rope.scaling.attn_factor`; LongRoPE's correction).
    pub attn_factor: f32,
}

impl Default for RopeScaling {
    fn default() -> Self {
        Self {
            kind: RopeScalingKind::None,
            factor: 1.0,
            original_context: 0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attn_factor: 1.0,
        }
    }
}

impl RopeScaling {
    /// Parses an operator's setting: `none`, or `KIND:FACTOR[:ORIGINAL_CONTEXT]` with KIND
    /// one of `linear`, `llama3`, `yarn` (e.g. `yarn:4`, `linear:2:4096`).
    pub fn parse(s: &str) -> Result<Self, String> {
        let s = s.trim().to_ascii_lowercase();
        if s == "none" {
            return Ok(Self::default());
        }
        let mut parts = s.split(':');
        let kind = match parts.next().unwrap_or("") {
            "linear" => RopeScalingKind::Linear,
            "llama3" => RopeScalingKind::Llama3,
            "yarn" => RopeScalingKind::Yarn,
            other => {
                return Err(format!(
                    "unknown RoPE scaling {other:?} (none, or linear, llama3, yarn as KIND:FACTOR[:ORIGINAL_CONTEXT], e.g. yarn:4)"
                ))
            }
        };
        let factor: f32 = match parts.next() {
            Some(f) => f
                .parse()
                .map_err(|_| format!("RoPE scaling factor {f:?} is not a number"))?,
            None => return Err(format!("RoPE scaling {s:?} needs a factor, e.g. {}:4", kind.name())),
        };
        if !(factor.is_finite() && (1.0..=1024.0).contains(&factor)) {
            return Err(format!("RoPE scaling factor {factor} is out of range (1 to 1024)"));
        }
        let original_context = match parts.next() {
            Some(c) => c
                .parse::<usize>()
                .ok()
                .filter(|c| (1..=1 << 24).contains(c))
                .ok_or_else(|| format!("original context {c:?} is not a token count"))?,
            None => 0,
        };
        if parts.next().is_some() {
            return Err(format!(
                "RoPE scaling {s:?} has too many parts (KIND:FACTOR[:ORIGINAL_CONTEXT])"
            ));
        }
        Ok(Self {
            kind,
            factor,
            original_context,
            // Llama 3.1's published values.
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            ..Self::default()
        })
    }

    /// The context the scaled model serves: the original times the factor (LongRoPE's
    /// factors are fitted to the file's own context length).
    pub fn stretched(&self, trained: usize) -> usize {
        match self.kind {
            RopeScalingKind::None | RopeScalingKind::LongRope => trained,
            _ => (self.original(trained) as f64 * self.factor as f64) as usize,
        }
    }

    fn original(&self, trained: usize) -> usize {
        if self.original_context > 0 {
            self.original_context
        } else {
            trained
        }
    }
}

impl fmt::Display for RopeScaling {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            RopeScalingKind::None => write!(f, "none"),
            RopeScalingKind::LongRope => write!(f, "longrope (attn_factor {})", self.attn_factor),
            k => {
                write!(f, "{}:{}", k.name(), self.factor)?;
                if self.original_context > 0 {
                    write!(f, ":{}", self.original_context)?;
                }
                Ok(())
            }
        }
    }
}

/// One kind of rotation: the effective frequency of each pair and the cos/sin magnitude.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeFreqs {
    pub inv_freq: Vec<f32>,
    pub mscale: f32,
}

impl RopeFreqs {
    /// The frequencies for `dims` rotated elements with base `theta`, scaled as `scaling`
    /// says. `factors`: per-pair divisors from the file (Llama 3's `rope_freqs`, LongRoPE's
    /// long or short set), used instead of computing Llama 3's; `trained`: the model's
    /// context length (the default original context).
    pub fn new(theta: f32, dims: usize, scaling: &RopeScaling, factors: Option<&[f32]>, trained: usize) -> Self {
        let n = dims / 2;
        let base: Vec<f32> = (0..n).map(|i| theta.powf(-((2 * i) as f32) / dims as f32)).collect();
        let original = scaling.original(trained) as f32;
        let s = scaling.factor.max(1.0);
        let llama3 = |f: f32| {
            let (low, high) = (original / scaling.low_freq_factor, original / scaling.high_freq_factor);
            let wavelen = 2.0 * PI / f;
            if wavelen < high {
                1.0
            } else if wavelen > low {
                s
            } else {
                let smooth = (original / wavelen - scaling.low_freq_factor)
                    / (scaling.high_freq_factor - scaling.low_freq_factor);
                1.0 / ((1.0 - smooth) / s + smooth)
            }
        };
        let divisor = |i: usize, f: f32| match (factors, scaling.kind) {
            (Some(ff), _) => ff.get(i).copied().unwrap_or(1.0),
            (None, RopeScalingKind::Llama3) => llama3(f),
            _ => 1.0,
        };
        let mut mscale = scaling.attn_factor;
        let inv_freq = match scaling.kind {
            RopeScalingKind::Linear => base.iter().enumerate().map(|(i, &f)| f / divisor(i, f) / s).collect(),
            RopeScalingKind::Yarn => {
                // The pairs between the ramp's ends mix interpolation and extrapolation.
                let corr = |beta: f32| dims as f32 * (original / (beta * 2.0 * PI)).ln() / (2.0 * theta.ln());
                let lo = corr(scaling.beta_fast).floor().max(0.0);
                let hi = corr(scaling.beta_slow).ceil().min(dims as f32 - 1.0);
                mscale *= 1.0 + 0.1 * s.ln();
                base.iter()
                    .enumerate()
                    .map(|(i, &f)| {
                        let y = (i as f32 - lo) / (hi - lo).max(0.001);
                        let mix = 1.0 - y.clamp(0.0, 1.0);
                        f / divisor(i, f) * ((1.0 - mix) / s + mix)
                    })
                    .collect()
            }
            _ => base.iter().enumerate().map(|(i, &f)| f / divisor(i, f)).collect(),
        };
        Self { inv_freq, mscale }
    }

    /// `(cos, sin)` of every pair at each position (times `mscale`), computed once per
    /// step and shared by every layer that rotates this way.
    pub fn table(&self, positions: &[usize]) -> Vec<(f32, f32)> {
        let mut t = Vec::with_capacity(positions.len() * self.inv_freq.len());
        for &pos in positions {
            let p = pos as f32;
            t.extend(self.inv_freq.iter().map(|f| {
                let (s, c) = (p * f).sin_cos();
                (c * self.mscale, s * self.mscale)
            }));
        }
        t
    }
}

/// Rotates each head of each row (`n_heads` heads of `head_dim`) by its row's entries of
/// `table` (from [`RopeFreqs::table`]).
pub fn rotate(x: &mut [f32], n_heads: usize, head_dim: usize, layout: RopeLayout, table: &[(f32, f32)]) {
    let width = n_heads * head_dim;
    let nf = table.len() / (x.len() / width).max(1);
    if nf == 0 {
        return;
    }
    // Element i of a pair and its partner: (2i, 2i+1) or (i, i + nf).
    let (stride, partner) = match layout {
        RopeLayout::Adjacent => (2, 1),
        RopeLayout::Halves => (1, nf),
    };
    for (row, cs) in x.chunks_exact_mut(width).zip(table.chunks_exact(nf)) {
        for head in row.chunks_exact_mut(head_dim) {
            for (i, &(c, s)) in cs.iter().enumerate() {
                let (ia, ib) = (stride * i, stride * i + partner);
                let (a, b) = (head[ia], head[ib]);
                head[ia] = a * c - b * s;
                head[ib] = a * s + b * c;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn operator_settings_parse_or_are_refused_clearly() {
        let y = RopeScaling::parse("yarn:4").unwrap();
        assert_eq!((y.kind, y.factor, y.original_context), (RopeScalingKind::Yarn, 4.0, 0));
        let l = RopeScaling::parse("LINEAR:2:4096").unwrap();
        assert_eq!(
            (l.kind, l.factor, l.original_context),
            (RopeScalingKind::Linear, 2.0, 4096)
        );
        assert_eq!(RopeScaling::parse("none").unwrap().kind, RopeScalingKind::None);
        for bad in [
            "yarn",
            "yarn:x",
            "yarn:0.5",
            "dynamic:2",
            "yarn:4:0",
            "yarn:4:8192:1",
            "yarn:inf",
        ] {
            assert!(RopeScaling::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(y.stretched(8192), 32768);
        assert_eq!(l.stretched(8192), 8192);
        assert_eq!(y.to_string(), "yarn:4");
    }

    /// YaRN's frequencies as transformers computes them (`_compute_yarn_parameters`, in
    /// f64 here): extrapolated above the fast end, interpolated below the slow end, and the
    /// attention factor 0.1·ln(s) + 1.
    #[test]
    fn yarn_matches_the_reference_formula() {
        let (theta, dims, s, orig) = (10000f64, 64usize, 4f64, 2048f64);
        let scaling = RopeScaling {
            original_context: orig as usize,
            ..RopeScaling::parse("yarn:4").unwrap()
        };
        let got = RopeFreqs::new(theta as f32, dims, &scaling, None, 8192);
        let corr = |rot: f64| dims as f64 * (orig / (rot * 2.0 * std::f64::consts::PI)).ln() / (2.0 * theta.ln());
        let (lo, hi) = (corr(32.0).floor().max(0.0), corr(1.0).ceil().min(dims as f64 - 1.0));
        for i in 0..dims / 2 {
            let extra = theta.powf(-((2 * i) as f64) / dims as f64);
            let ramp = ((i as f64 - lo) / (hi - lo)).clamp(0.0, 1.0);
            let extrapolation = 1.0 - ramp;
            let want = extra / s * (1.0 - extrapolation) + extra * extrapolation;
            let g = got.inv_freq[i] as f64;
            assert!((g - want).abs() <= 1e-6 * want, "pair {i}: {g} vs {want}");
        }
        assert!((got.mscale as f64 - (0.1 * s.ln() + 1.0)).abs() < 1e-6);
    }

    /// Llama 3's factors as llama.cpp's converter writes them into `rope_freqs`.
    #[test]
    fn llama3_divides_low_frequencies_and_keeps_high_ones() {
        let scaling = RopeScaling {
            original_context: 8192,
            ..RopeScaling::parse("llama3:8").unwrap()
        };
        let plain = RopeFreqs::new(500000.0, 128, &RopeScaling::default(), None, 131072);
        let got = RopeFreqs::new(500000.0, 128, &scaling, None, 131072);
        assert_eq!(got.inv_freq[0], plain.inv_freq[0]);
        let last = got.inv_freq.len() - 1;
        assert!((got.inv_freq[last] * 8.0 - plain.inv_freq[last]).abs() <= 1e-6 * plain.inv_freq[last]);
        // The same factors given as a tensor give the same frequencies.
        let factors: Vec<f32> = plain.inv_freq.iter().zip(&got.inv_freq).map(|(p, g)| p / g).collect();
        let from_tensor = RopeFreqs::new(500000.0, 128, &RopeScaling::default(), Some(&factors), 131072);
        for (a, b) in from_tensor.inv_freq.iter().zip(&got.inv_freq) {
            assert!((a - b).abs() <= 1e-6 * b);
        }
    }

    #[test]
    fn linear_divides_every_frequency() {
        let plain = RopeFreqs::new(10000.0, 64, &RopeScaling::default(), None, 2048);
        let lin = RopeFreqs::new(10000.0, 64, &RopeScaling::parse("linear:2").unwrap(), None, 2048);
        for (p, l) in plain.inv_freq.iter().zip(&lin.inv_freq) {
            assert_eq!(p / 2.0, *l);
        }
        assert_eq!(lin.mscale, 1.0);
    }
}

//! Pipeline stages: which of a model's layers a process computes ([`StageSpan`]), how a
//! stage is asked for ([`StagePlan`]: the K-th of N stages, balanced by cost, or explicit
//! layers), and a file's identity that every stage of a group must share
//! ([`fingerprint`]).
//!
//! The first stage also embeds the tokens; the last holds the final norm and the logits.
//! Balanced stages are cut so that the costliest stage is as cheap as it can be, counting
//! each layer by the bytes of weights a decode step reads (a routed expert's by the share of
//! experts a token uses) and half the logits' matrix on the last stage: a decode step reads
//! the whole matrix (of a large vocabulary it weighs several layers), a prefill step
//! multiplies it by one row per sequence only, and a server runs both.

use std::ops::Range;

use crate::formats::gguf::GgufFile;

use super::config::ModelConfig;
use super::ModelError;

/// The layers `start..end` of a model of `n_layers`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StageSpan {
    pub start: usize,
    pub end: usize,
    pub n_layers: usize,
}

impl StageSpan {
    /// Every layer: one process holds the whole model.
    pub fn whole(n_layers: usize) -> Self {
        Self {
            start: 0,
            end: n_layers,
            n_layers,
        }
    }

    /// Embeds the tokens.
    pub fn first(&self) -> bool {
        self.start == 0
    }

    /// Holds the final norm and computes the logits.
    pub fn last(&self) -> bool {
        self.end == self.n_layers
    }

    pub fn is_whole(&self) -> bool {
        self.first() && self.last()
    }

    pub fn layers(&self) -> Range<usize> {
        self.start..self.end
    }

    pub fn len(&self) -> usize {
        self.end - self.start
    }

    pub fn is_empty(&self) -> bool {
        self.start == self.end
    }
}

impl std::fmt::Display for StageSpan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "layers {}..{} of {}", self.start, self.end, self.n_layers)
    }
}

/// How a process asks for its stage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StagePlan {
    /// Stage `index` (from 0) of `count`, cut by [`balanced_stages`].
    Balanced { index: usize, count: usize },
    /// Exactly these layers (for hosts of unequal sizes).
    Layers(Range<usize>),
}

impl StagePlan {
    /// `K/N` (K from 1) or `A..B` (layers, B excluded).
    pub fn parse(s: &str) -> Result<Self, String> {
        let s = s.trim();
        if let Some((a, b)) = s.split_once("..") {
            let (a, b) = (a.trim().parse::<usize>(), b.trim().parse::<usize>());
            return match (a, b) {
                (Ok(a), Ok(b)) if a < b => Ok(StagePlan::Layers(a..b)),
                _ => Err(format!(
                    "stage layers {s:?}: want START..END with START < END, e.g. 0..12"
                )),
            };
        }
        let bad = || format!("stage {s:?}: want K/N (the K-th of N stages, from 1) or START..END layers");
        let (k, n) = s.split_once('/').ok_or_else(bad)?;
        let (k, n) = (
            k.trim().parse::<usize>().map_err(|_| bad())?,
            n.trim().parse::<usize>().map_err(|_| bad())?,
        );
        if n == 0 || k == 0 || k > n {
            return Err(bad());
        }
        Ok(StagePlan::Balanced { index: k - 1, count: n })
    }

    /// The layers this plan names in `file`.
    pub fn resolve(&self, file: &GgufFile, c: &ModelConfig) -> Result<StageSpan, ModelError> {
        let n = c.n_layers;
        let range = match self {
            StagePlan::Layers(r) => {
                if r.end > n {
                    return Err(ModelError::Config(format!(
                        "stage layers {}..{} reach past the model's {n} layers",
                        r.start, r.end
                    )));
                }
                r.clone()
            }
            StagePlan::Balanced { index, count } => {
                if *count > n {
                    return Err(ModelError::Config(format!(
                        "{count} pipeline stages for a model of {n} layers: a stage needs at least one layer"
                    )));
                }
                balanced_stages(&layer_costs(file, c), output_cost(file) / 2, *count)[*index].clone()
            }
        };
        Ok(StageSpan {
            start: range.start,
            end: range.end,
            n_layers: n,
        })
    }
}

/// What each layer costs a decode step: the bytes of its weights read per token (a routed
/// expert's tensors by the share of experts a token uses).
pub fn layer_costs(file: &GgufFile, c: &ModelConfig) -> Vec<u64> {
    let share = c
        .moe
        .as_ref()
        .map_or((1, 1), |m| (m.used.max(1) as u64, m.experts.max(1) as u64));
    let mut costs = vec![0u64; c.n_layers];
    for t in &file.tensors {
        let Some(rest) = t.name.strip_prefix("blk.") else {
            continue;
        };
        let Some((l, name)) = rest.split_once('.') else {
            continue;
        };
        let Ok(l) = l.parse::<usize>() else { continue };
        if let Some(cost) = costs.get_mut(l) {
            let bytes = t.len as u64;
            *cost += match name.contains("_exps") {
                true => bytes * share.0 / share.1,
                false => bytes,
            };
        }
    }
    costs
}

/// The logits' matrix (the embedding's when tied): the last stage's extra cost.
pub fn output_cost(file: &GgufFile) -> u64 {
    file.tensor("output.weight")
        .or_else(|| file.tensor("token_embd.weight"))
        .map_or(0, |t| t.len as u64)
}

/// Bytes of the file a stage maps and computes with: its layers' tensors, the embedding
/// (the first stage) and the final norm and logits' matrix (the last).
pub fn resident_bytes(file: &GgufFile, span: StageSpan) -> u64 {
    file.tensors
        .iter()
        .filter(|t| computes_with(file, span, &t.name))
        .map(|t| t.len as u64)
        .sum()
}

/// Whether a stage reads tensor `name`: its layers', the embedding (the first stage, and
/// the last when the logits reuse it), the final norm and logits (the last).
pub fn computes_with(file: &GgufFile, span: StageSpan, name: &str) -> bool {
    match name.strip_prefix("blk.").and_then(|r| r.split_once('.')) {
        Some((l, _)) => l.parse::<usize>().is_ok_and(|l| span.layers().contains(&l)),
        None => match name {
            "token_embd.weight" => span.first() || (span.last() && file.tensor("output.weight").is_none()),
            _ => span.last(),
        },
    }
}

/// `count` contiguous stages over layers of these costs (the last also paying `last_extra`),
/// each at least one layer, cut so that the costliest stage costs as little as possible.
///
/// # Panics
/// If `count` is 0 or exceeds the layers.
pub fn balanced_stages(costs: &[u64], last_extra: u64, count: usize) -> Vec<Range<usize>> {
    let n = costs.len();
    assert!(count >= 1 && count <= n, "{count} stages of {n} layers");
    // Greedy from the back: the last stage starts with the logits' cost. Returns the
    // stages' starts (descending) if `limit` is met with at most `count` stages.
    let cut = |limit: u64| -> Option<Vec<usize>> {
        let mut starts = Vec::new();
        let (mut sum, mut end) = (last_extra, n);
        for l in (0..n).rev() {
            if sum + costs[l] > limit && l + 1 < end {
                starts.push(l + 1);
                sum = 0;
                end = l + 1;
            }
            sum += costs[l];
            if sum > limit {
                return None;
            }
        }
        starts.push(0);
        (starts.len() <= count).then_some(starts)
    };
    let (mut lo, mut hi) = (0u64, costs.iter().sum::<u64>() + last_extra);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        match cut(mid) {
            Some(_) => hi = mid,
            None => lo = mid + 1,
        }
    }
    let mut starts = cut(hi).expect("the whole model in one stage meets its own cost");
    starts.reverse();
    let mut stages: Vec<Range<usize>> = starts
        .iter()
        .zip(starts.iter().skip(1).copied().chain([n]))
        .map(|(&a, b)| a..b)
        .collect();
    // Fewer stages than asked (a few layers outweigh the rest): split the widest (which
    // lowers no stage's cost below the limit, so the maximum stays).
    while stages.len() < count {
        let (i, _) = stages
            .iter()
            .enumerate()
            .max_by_key(|(i, r)| (r.len(), usize::MAX - i))
            .expect("at least one stage");
        let r = stages[i].clone();
        let mid = r.start + r.len() / 2;
        stages.splice(i..=i, [r.start..mid, mid..r.end]);
    }
    stages
}

/// A file's identity for a pipeline group: its tensors' names, shapes, types and sizes, its
/// architecture and a sample of bytes from the start of three tensors (first, middle,
/// last). Two stages of one group compute with files of equal fingerprints; a different
/// model or quantization differs.
pub fn fingerprint(file: &GgufFile) -> u64 {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    let mut tensors: Vec<_> = file.tensors.iter().collect();
    tensors.sort_by(|a, b| a.name.cmp(&b.name));
    for t in &tensors {
        h.update(t.name.as_bytes());
        for d in &t.dims {
            h.update(&d.to_le_bytes());
        }
        h.update(&t.ty.name().into_bytes());
        h.update(&(t.len as u64).to_le_bytes());
    }
    if let Ok(arch) = file.get_str("general.architecture") {
        h.update(arch.as_bytes());
    }
    if let Some(last) = tensors.len().checked_sub(1) {
        for i in [0, last / 2, last] {
            let data = file.tensor_data(tensors[i]);
            h.update(&data[..data.len().min(4096)]);
        }
    }
    h.digest()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cost(costs: &[u64], extra: u64, r: &Range<usize>, n: usize) -> u64 {
        costs[r.clone()].iter().sum::<u64>() + if r.end == n { extra } else { 0 }
    }

    #[test]
    fn balanced_stages_cover_every_layer_once_and_weigh_the_logits() {
        let costs = vec![10u64; 16];
        assert_eq!(balanced_stages(&costs, 0, 2), vec![0..8, 8..16]);
        // A logits matrix worth four layers moves two layers to the first stage.
        assert_eq!(balanced_stages(&costs, 40, 2), vec![0..10, 10..16]);
        for count in 1..=16 {
            for extra in [0, 15, 100] {
                let s = balanced_stages(&costs, extra, count);
                assert_eq!(s.len(), count);
                assert_eq!(s[0].start, 0);
                assert_eq!(s[count - 1].end, 16);
                assert!(s.windows(2).all(|w| w[0].end == w[1].start && !w[0].is_empty()));
                // No cut does better than the one chosen (checked against every 2-cut).
                if count == 2 {
                    let best = (1..16)
                        .map(|m| cost(&costs, extra, &(0..m), 16).max(cost(&costs, extra, &(m..16), 16)))
                        .min()
                        .unwrap();
                    let got = s.iter().map(|r| cost(&costs, extra, r, 16)).max().unwrap();
                    assert_eq!(got, best);
                }
            }
        }
        // A huge last layer still gives every stage a layer.
        assert_eq!(balanced_stages(&[1, 1, 1, 1000], 0, 3).len(), 3);
    }

    #[test]
    fn plans_parse_and_refuse_clearly() {
        assert_eq!(StagePlan::parse("2/3"), Ok(StagePlan::Balanced { index: 1, count: 3 }));
        assert_eq!(StagePlan::parse("4..12"), Ok(StagePlan::Layers(4..12)));
        for bad in ["0/2", "3/2", "2", "a/b", "5..5", "7..3"] {
            assert!(StagePlan::parse(bad).is_err(), "{bad}");
        }
    }
}

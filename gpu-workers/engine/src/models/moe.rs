//! Mixture-of-experts MLPs (Mixtral, Qwen3-MoE, DeepSeek-V2/V3, Kimi K2).
//!
//! A router scores every expert for every row; each row runs its best `used` experts and
//! sums their outputs weighted by their scores (plus, for DeepSeek, shared experts every
//! row runs). A step's rows are **grouped by expert**: each chosen expert multiplies all of
//! its rows at once, so its weights are read once per step however many rows chose it —
//! the CPU analogue of a grouped GEMM, and where batching wins for a mixture (at 32 rows
//! and 8 of 64 experts each expert serves ~4 rows per read instead of 1).
//!
//! Routing follows llama.cpp's `build_moe_ffn`:
//!
//! ```text
//! logits = h · Wrouter                       (f32: routing is discrete, never quantized)
//! p      = softmax(logits) | sigmoid(logits)
//! choose = p [+ bias]                        (DeepSeek-V3's selection bias; weights use p)
//!          [only the best `groups_used` groups, a group scoring its best two]
//! top    = the `used` best of choose
//! w      = p[top] [/ Σ p[top]] [· scale]
//! out    = Σ w · expert(h) [+ shared(h)]
//! ```
//!
//! Every expert's matrices are ordinary [`Matrix`]es sliced from the file's 3-D tensors and
//! repacked like dense ones, in every type the kernels take. Each routed row is counted
//! per layer and expert ([`ExpertLoad`]): the statistics expert placement needs
//! (`hearth_moe_expert_tokens_total`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use rayon::prelude::*;

use crate::formats::gguf::GgufFile;

use super::layers::{load_mlp, matrices_3d, matrix, opt_vector, GateUp, Matrix, Mlp, MlpBufs};
use super::lora::LoraRows;
use super::{ForwardScratch, Gating, Model, ModelConfig, ModelError, MoeSpec};

/// One layer's experts.
#[derive(Debug)]
pub(crate) struct Moe {
    /// The router, `experts` rows of `d_model` floats.
    router: Vec<f32>,
    /// DeepSeek-V3's per-expert selection bias (`exp_probs_b`).
    bias: Option<Vec<f32>>,
    experts: Vec<Mlp>,
    /// The shared experts, one MLP `shared · ff_expert` wide.
    shared: Option<Mlp>,
    /// Rows routed to each expert since load (shared with the metrics: [`ExpertLoad`]).
    tokens: Arc<[AtomicU64]>,
    spec: MoeSpec,
}

impl Moe {
    pub(super) fn load(file: &GgufFile, c: &ModelConfig, spec: &MoeSpec, l: usize) -> Result<Self, ModelError> {
        let (d, n, ff) = (c.d_model, spec.experts, spec.ff_expert);
        let name = |s: &str| format!("blk.{l}.{s}.weight");
        let router_m = matrix(file, &name("ffn_gate_inp"), n, d)?;
        let mut router = vec![0f32; n * d];
        let view = super::layers::weight_view(file, &router_m);
        for (e, row) in router.chunks_exact_mut(d).enumerate() {
            crate::kernels::dequantize_row(view.ty, view.row(e), row);
        }
        let downs = matrices_3d(file, &name("ffn_down_exps"), n, d, ff)?;
        let gate_ups: Vec<GateUp> = match file.tensor(&name("ffn_gate_up_exps")) {
            Some(_) => matrices_3d(file, &name("ffn_gate_up_exps"), n, 2 * ff, d)?
                .into_iter()
                .map(GateUp::Fused)
                .collect(),
            None => matrices_3d(file, &name("ffn_gate_exps"), n, ff, d)?
                .into_iter()
                .zip(matrices_3d(file, &name("ffn_up_exps"), n, ff, d)?)
                .map(|(gate, up)| GateUp::Split { gate, up })
                .collect(),
        };
        let experts = gate_ups
            .into_iter()
            .zip(downs)
            .map(|(gate_up, down)| Mlp { gate_up, down })
            .collect();
        let shared = match spec.shared {
            0 => None,
            k => Some(load_mlp(file, l, "_shexp", d, k * ff)?),
        };
        Ok(Self {
            router,
            bias: opt_vector(file, &format!("blk.{l}.exp_probs_b.bias"), n)?,
            experts,
            shared,
            tokens: (0..n).map(|_| AtomicU64::new(0)).collect(),
            spec: spec.clone(),
        })
    }

    /// Every matrix: the routed experts' in order, then the shared experts'.
    pub(super) fn matrices(&self) -> Vec<&Matrix> {
        self.experts
            .iter()
            .chain(&self.shared)
            .flat_map(|m| m.matrices())
            .collect()
    }

    pub(super) fn matrices_mut(&mut self) -> Vec<&mut Matrix> {
        self.experts
            .iter_mut()
            .chain(&mut self.shared)
            .flat_map(|m| m.matrices_mut())
            .collect()
    }

    /// What one row's step reads: `used` experts' matrices and the shared ones.
    pub(super) fn decode_matrices(&self, used: usize) -> Vec<&Matrix> {
        self.experts
            .iter()
            .take(used)
            .chain(&self.shared)
            .flat_map(|m| m.matrices())
            .collect()
    }

    /// The counters of rows routed to each expert.
    pub(super) fn counters(&self) -> Arc<[AtomicU64]> {
        self.tokens.clone()
    }

    /// The mixture's output for every row of `h` into `out`.
    pub(super) fn forward(
        &self,
        model: &Model,
        h: &[f32],
        bufs: &mut MlpBufs,
        out: &mut [f32],
        s: &mut ForwardScratch,
    ) {
        let (d, n) = (model.config.d_model, self.experts.len());
        let rows = h.len() / d;
        let mut logits = vec![0f32; rows * n];
        logits.par_chunks_mut(n).zip(h.par_chunks(d)).for_each(|(lo, x)| {
            for (l, w) in lo.iter_mut().zip(self.router.chunks_exact(d)) {
                *l = w.iter().zip(x).map(|(a, b)| a * b).sum();
            }
        });
        // Each expert's rows and their weights.
        let mut chosen: Vec<Vec<(usize, f32)>> = vec![Vec::new(); n];
        let mut scratch = RouteScratch::default();
        for (r, lo) in logits.chunks_exact(n).enumerate() {
            for &(e, w) in route(&self.spec, lo, self.bias.as_deref(), &mut scratch) {
                chosen[e].push((r, w));
            }
        }
        // The chosen experts run side by side, one task each (a decode step's experts
        // have a row or a few: splitting each one's matrices between threads costs more in
        // synchronisation than it gains); their outputs are added in expert order, so a
        // row's result does not depend on the scheduling.
        let work: Vec<(usize, &[(usize, f32)])> = chosen
            .iter()
            .enumerate()
            .filter(|(_, p)| !p.is_empty())
            .map(|(e, p)| (e, p.as_slice()))
            .collect();
        let precise = s.mm.precise;
        let scratch = || {
            let mut s = ForwardScratch::default();
            s.mm.precise = precise;
            (s, MlpBufs::default(), Vec::new())
        };
        let outputs: Vec<Vec<f32>> = work
            .par_iter()
            .map_init(scratch, |(s, bufs, xe), &(e, picks)| {
                self.tokens[e].fetch_add(picks.len() as u64, Ordering::Relaxed);
                xe.clear();
                for &(r, _) in picks {
                    xe.extend_from_slice(&h[r * d..(r + 1) * d]);
                }
                let mut ye = vec![0f32; picks.len() * d];
                self.experts[e].forward(model, &xe[..], LoraRows::NONE, bufs, &mut ye, s);
                ye
            })
            .collect();
        out.fill(0.0);
        for (&(_, picks), ye) in work.iter().zip(&outputs) {
            for (&(r, w), y) in picks.iter().zip(ye.chunks_exact(d)) {
                out[r * d..(r + 1) * d].iter_mut().zip(y).for_each(|(o, y)| *o += w * y);
            }
        }
        let mut ye = Vec::new();
        if let Some(shared) = &self.shared {
            ye.resize(rows * d, 0.0);
            shared.forward(model, h, LoraRows::NONE, bufs, &mut ye, s);
            out.iter_mut().zip(&ye).for_each(|(o, y)| *o += y);
        }
    }
}

/// Rows routed to each expert of each mixture layer since load: `(layer, per-expert
/// counters)`, shared by the engine's model and its metrics.
#[derive(Debug, Clone, Default)]
pub struct ExpertLoad(pub Vec<(usize, Arc<[AtomicU64]>)>);

impl ExpertLoad {
    /// The counts now, per layer.
    pub fn snapshot(&self) -> Vec<(usize, Vec<u64>)> {
        self.0
            .iter()
            .map(|(l, c)| (*l, c.iter().map(|t| t.load(Ordering::Relaxed)).collect()))
            .collect()
    }
}

/// Scratch for [`route`].
#[derive(Debug, Default)]
pub struct RouteScratch {
    probs: Vec<f32>,
    choose: Vec<f32>,
    order: Vec<usize>,
    picked: Vec<(usize, f32)>,
}

/// One row's experts and their weights, from its router logits (see the module doc).
pub fn route<'s>(spec: &MoeSpec, logits: &[f32], bias: Option<&[f32]>, s: &'s mut RouteScratch) -> &'s [(usize, f32)] {
    let n = logits.len();
    s.probs.clear();
    match spec.gating {
        Gating::Softmax => {
            let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            s.probs.extend(logits.iter().map(|&v| (v - max).exp()));
            let sum: f32 = s.probs.iter().sum();
            s.probs.iter_mut().for_each(|p| *p /= sum);
        }
        Gating::Sigmoid => s.probs.extend(logits.iter().map(|&v| 1.0 / (1.0 + (-v).exp()))),
    }
    s.choose.clear();
    s.choose.extend_from_slice(&s.probs);
    if let Some(b) = bias {
        s.choose.iter_mut().zip(b).for_each(|(c, b)| *c += b);
    }
    if spec.groups > 1 {
        // A group scores the sum of its best two; only the best `groups_used` stay.
        let per = n / spec.groups;
        let score = |g: &[f32]| {
            let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
            for &v in g {
                if v > a {
                    (a, b) = (v, a);
                } else if v > b {
                    b = v;
                }
            }
            a + if per > 1 { b } else { 0.0 }
        };
        let scores: Vec<f32> = s.choose.chunks_exact(per).map(score).collect();
        s.order.clear();
        s.order.extend(0..spec.groups);
        s.order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]));
        for &g in &s.order[spec.groups_used..] {
            s.choose[g * per..(g + 1) * per].fill(f32::NEG_INFINITY);
        }
    }
    s.order.clear();
    s.order.extend(0..n);
    let choose = &s.choose;
    s.order
        .select_nth_unstable_by(spec.used - 1, |&a, &b| choose[b].total_cmp(&choose[a]));
    s.order.truncate(spec.used);
    s.order.sort_by(|&a, &b| choose[b].total_cmp(&choose[a]));
    s.picked.clear();
    s.picked.extend(s.order.iter().map(|&e| (e, s.probs[e])));
    if spec.norm_weights {
        // llama.cpp's clamp: the smallest normal f16.
        let sum = s.picked.iter().map(|p| p.1).sum::<f32>().max(6.103_515_6e-5);
        s.picked.iter_mut().for_each(|p| p.1 /= sum);
    }
    if spec.weights_scale != 1.0 {
        s.picked.iter_mut().for_each(|p| p.1 *= spec.weights_scale);
    }
    &s.picked
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(experts: usize, used: usize) -> MoeSpec {
        MoeSpec {
            experts,
            used,
            shared: 0,
            ff_expert: 256,
            gating: Gating::Softmax,
            norm_weights: false,
            weights_scale: 1.0,
            groups: 0,
            groups_used: 0,
            leading_dense: 0,
        }
    }

    #[test]
    fn softmax_top_k_renormalized() {
        let mut s = RouteScratch::default();
        let logits = [0.0, 2.0, 1.0, -1.0];
        let mut sp = spec(4, 2);
        let raw = route(&sp, &logits, None, &mut s).to_vec();
        assert_eq!(raw.iter().map(|p| p.0).collect::<Vec<_>>(), [1, 2]);
        let z: f32 = logits.iter().map(|v| v.exp()).sum();
        assert!((raw[0].1 - 2f32.exp() / z).abs() < 1e-6);
        sp.norm_weights = true;
        let norm = route(&sp, &logits, None, &mut s).to_vec();
        assert!((norm[0].1 + norm[1].1 - 1.0).abs() < 1e-6);
        assert!((norm[0].1 - 2f32.exp() / (2f32.exp() + 1f32.exp())).abs() < 1e-6);
    }

    /// DeepSeek-V3: sigmoid scores, a bias that changes the choice but not the weights,
    /// group-limited choice, renormalized and scaled weights.
    #[test]
    fn sigmoid_bias_groups_and_scale() {
        let mut s = RouteScratch::default();
        let mut sp = spec(8, 2);
        sp.gating = Gating::Sigmoid;
        // Groups of 2: {0,1} {2,3} {4,5} {6,7}.
        let logits = [3.0, -3.0, 0.5, 0.4, 2.9, 2.8, -1.0, -1.0];
        let picked = route(&sp, &logits, None, &mut s).to_vec();
        assert_eq!(picked.iter().map(|p| p.0).collect::<Vec<_>>(), [0, 4]);
        // The bias lifts expert 6 into the choice; its weight stays its own sigmoid.
        let bias = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 2.0, 0.0];
        let picked = route(&sp, &logits, Some(&bias), &mut s).to_vec();
        assert_eq!(picked.iter().map(|p| p.0).collect::<Vec<_>>(), [6, 0]);
        assert!((picked[0].1 - 1.0 / (1.0 + 1f32.exp())).abs() < 1e-6);
        // One group of four used: {4,5} (2.9 + 2.8) beats {0,1} (3.0 − 3.0).
        sp.groups = 4;
        sp.groups_used = 1;
        sp.norm_weights = true;
        sp.weights_scale = 2.5;
        let picked = route(&sp, &logits, None, &mut s).to_vec();
        assert_eq!(picked.iter().map(|p| p.0).collect::<Vec<_>>(), [4, 5]);
        assert!((picked[0].1 + picked[1].1 - 2.5).abs() < 1e-5);
    }
}

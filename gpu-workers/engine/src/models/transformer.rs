//! The dense transformer every family runs: the weights (memory-mapped; matrices repacked
//! for the SIMD kernels at load), and the batched forward pass over the paged KV cache.
//! A family's differences arrive as a [`BlockSpec`] and as optional tensors found here:
//! Q/K/V biases, fused QKV and gate-up projections, Q/K norms, post-norms, RoPE factors.
//!
//! One block, with its optional parts in brackets:
//!
//! ```text
//! x = embed(token) [· embed_scale]
//! per layer:  h = rmsnorm(x)
//!             q, k, v = h·Wq [+bq], h·Wk [+bk], h·Wv [+bv]      (or one fused h·Wqkv)
//!             [q, k = rmsnorm_per_head(q), rmsnorm_per_head(k)]
//!             q, k = rope(q), rope(k)                            (the layer's table)
//!             a = attention(q, K, V)   scores scale·q·k [soft-capped], [within a window]
//!             x += [rmsnorm](a·Wo)
//!             x += [rmsnorm](act(h'·Wgate) ⊙ h'·Wup · Wdown)     h' = rmsnorm(x); act SiLU or GELU
//! logits = rmsnorm(x)·Wout [soft-capped]
//! ```

use std::sync::Arc;

use rayon::prelude::*;

use crate::attention::{attend_group, HeadSpec, Query, Scoring, MAX_GROUP};
use crate::formats::gguf::{GgmlType, GgufFile};
use crate::kernels::pack_cache::{self, LoadProgress, PackCache, PackMode, Wanted, WeightsSource};
use crate::kernels::packed::PackKind;
use crate::kernels::{
    dequantize_row, gelu_mul, isa, matmul, matmul_many, rms_norm, rms_norm_in_place, silu_mul, soft_cap, MatmulScratch,
    PackedMatrix, WeightView, QK,
};
use crate::kv::pool::{KvDtype, KvPool, KvShape};

use super::layers::{
    load_mlp, matrix, norm, opt_vector, pack_one, split_rows, weight_view, GateUp, Matrix, Mlp, MlpBufs, Tile,
};
use super::lora::{LoraAdapter, LoraGroups, LoraRows, Target};
use super::mla::Latent;
use super::moe::Moe;
use super::options::{FloatWeights, LoadOptions, PreparedPack};
use super::rope::{self, RopeFreqs, RopeScaling, RopeScalingKind};
use super::stage::StageSpan;
use super::{Activation, Arch, ModelConfig, ModelError};

/// The attention's input projections: three matrices, or one of `q + 2·kv` rows (Phi-3).
#[derive(Debug)]
pub(super) enum Qkv {
    Split { q: Matrix, k: Matrix, v: Matrix },
    Fused(Matrix),
}

/// Grouped-query attention over full keys and values.
#[derive(Debug)]
struct HeadsAttention {
    qkv: Qkv,
    /// Q, K and V biases (Qwen2), each where present.
    bias: [Option<Vec<f32>>; 3],
    /// Per-head RMSNorm weights for Q and K (Qwen3, Gemma 3).
    qk_norm: Option<(Vec<f32>, Vec<f32>)>,
}

#[derive(Debug)]
enum Attention {
    Heads(HeadsAttention),
    /// Multi-head latent attention (DeepSeek): [`super::mla`].
    Latent(Latent),
}

#[derive(Debug)]
enum Ffn {
    Dense(Mlp),
    /// A mixture of experts: [`super::moe`].
    Experts(Box<Moe>),
}

#[derive(Debug)]
struct Layer {
    attn_norm: Vec<f32>,
    attn: Attention,
    wo: Matrix,
    attn_post_norm: Option<Vec<f32>>,
    ffn_norm: Vec<f32>,
    ffn: Ffn,
    ffn_post_norm: Option<Vec<f32>>,
}

impl Layer {
    /// Every matrix of the layer, in a fixed order (the pack cache's).
    fn matrices_mut(&mut self) -> Vec<&mut Matrix> {
        let mut ms = Vec::with_capacity(7);
        match &mut self.attn {
            Attention::Heads(a) => match &mut a.qkv {
                Qkv::Split { q, k, v } => ms.extend([q, k, v]),
                Qkv::Fused(m) => ms.push(m),
            },
            Attention::Latent(a) => ms.extend(a.matrices_mut()),
        }
        ms.push(&mut self.wo);
        match &mut self.ffn {
            Ffn::Dense(m) => ms.extend(m.matrices_mut()),
            Ffn::Experts(m) => ms.extend(m.matrices_mut()),
        }
        ms
    }

    fn matrices(&self) -> Vec<&Matrix> {
        let mut ms = Vec::with_capacity(7);
        match &self.attn {
            Attention::Heads(a) => match &a.qkv {
                Qkv::Split { q, k, v } => ms.extend([q, k, v]),
                Qkv::Fused(m) => ms.push(m),
            },
            Attention::Latent(a) => ms.extend(a.matrices()),
        }
        ms.push(&self.wo);
        match &self.ffn {
            Ffn::Dense(m) => ms.extend(m.matrices()),
            Ffn::Experts(m) => ms.extend(m.matrices()),
        }
        ms
    }

    /// The matrices one decode step of one sequence reads: every matrix but a mixture's
    /// unchosen experts (it reads `used` of them, and the shared ones).
    fn decode_matrices(&self, used: usize) -> Vec<&Matrix> {
        let mut ms = self.matrices();
        if let Ffn::Experts(m) = &self.ffn {
            ms.truncate(ms.len() - m.matrices().len());
            ms.extend(m.decode_matrices(used));
        }
        ms
    }
}

/// The MLP's forward pass, with the model whose weights it reads.
impl Mlp {
    /// The MLP of `h` (rows of `d_model`) into `out`, with the rows' adapters' updates;
    /// `bufs` are scratch.
    pub(super) fn forward(
        &self,
        model: &Model,
        h: &[f32],
        lora: LoraRows<'_>,
        bufs: &mut MlpBufs,
        out: &mut [f32],
        s: &mut ForwardScratch,
    ) {
        let rows = h.len() / model.config.d_model;
        let ff = self.down.cols;
        let MlpBufs { gate, up, fused } = bufs;
        gate.resize(rows * ff, 0.0);
        up.resize(rows * ff, 0.0);
        match &self.gate_up {
            GateUp::Split { gate: wg, up: wu } => matmul_many(
                &[model.view(wg), model.view(wu)],
                h,
                &mut [&mut gate[..], &mut up[..]],
                &mut s.mm,
            ),
            GateUp::Fused(w) => {
                fused.resize(2 * rows * ff, 0.0);
                matmul(&model.view(w), h, fused, &mut s.mm);
                lora.apply(Target::Up, h, fused);
                split_rows(fused, rows, &mut [&mut gate[..], &mut up[..]]);
            }
        }
        if let GateUp::Split { .. } = &self.gate_up {
            lora.apply(Target::Gate, h, gate);
            lora.apply(Target::Up, h, up);
        }
        match model.config.block.activation {
            Activation::Silu => silu_mul(gate, up),
            Activation::GeluTanh => gelu_mul(gate, up),
        }
        matmul(&model.view(&self.down), gate, out, &mut s.mm);
        lora.apply(Target::Down, gate, out);
    }
}

/// A loaded model. Matrices stay in the memory-mapped file (with their repacked copies);
/// norms, biases and RoPE factors are copied.
pub struct Model {
    file: GgufFile,
    pub config: ModelConfig,
    /// The layers this process computes (a pipeline stage's, or all).
    span: StageSpan,
    /// This stage's layers, `span.start` first.
    layers: Vec<Layer>,
    embed: Matrix,
    output: Matrix,
    output_norm: Vec<f32>,
    /// Rotation of global layers, and of windowed ones when they have their own base.
    rope: RopeFreqs,
    rope_local: Option<RopeFreqs>,
    n_params: u64,
    packed_bytes: usize,
    repack_seconds: f64,
    packed_from_cache: bool,
    pack_cache: PackCache,
    /// How float matrices are computed (quantized to Q8_0 when repacked, or not).
    float_weights: FloatWeights,
    /// How far the packed weights are ready (for `/metrics`).
    progress: Arc<LoadProgress>,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// Reusable buffers for forward passes.
#[derive(Debug, Default)]
pub struct ForwardScratch {
    pub(super) mm: MatmulScratch,
}

impl ForwardScratch {
    /// Float activations throughout (see [`MatmulScratch::precise`]): for numerics checks.
    pub fn precise() -> Self {
        let mut mm = MatmulScratch::default();
        mm.precise = true;
        Self { mm }
    }
}

/// Adds `bias` to every row of `x`.
fn add_bias(x: &mut [f32], bias: Option<&Vec<f32>>) {
    if let Some(b) = bias {
        for row in x.chunks_exact_mut(b.len()) {
            row.iter_mut().zip(b).for_each(|(v, b)| *v += b);
        }
    }
}

/// Cuts a step's attention into [`Tile`]s of at most [`MAX_GROUP`] queries: a GQA group's
/// heads together, and as many consecutive rows of the same sequence (a prefill chunk,
/// speculative drafts) as fit beside them.
fn attention_tiles(b: &Batch<'_>, n_heads: usize, n_kv_heads: usize) -> Vec<Tile> {
    let group = n_heads / n_kv_heads;
    let (heads, per_tile) = if group >= MAX_GROUP {
        (MAX_GROUP, 1)
    } else {
        (group, MAX_GROUP / group)
    };
    let same_run = |r: usize| {
        let (a, z) = (b.tables[r - 1], b.tables[r]);
        std::ptr::eq(a, z) && b.positions[r] == b.positions[r - 1] + 1
    };
    let mut tiles = Vec::new();
    let mut start = 0;
    for r in 1..=b.tokens.len() {
        if r < b.tokens.len() && same_run(r) {
            continue;
        }
        for kv_head in 0..n_kv_heads {
            for row in (start..r).step_by(per_tile) {
                for head in (kv_head * group..(kv_head + 1) * group).step_by(heads) {
                    tiles.push(Tile {
                        row,
                        rows: per_tile.min(r - row),
                        kv_head,
                        head,
                        heads: heads.min((kv_head + 1) * group - head),
                    });
                }
            }
        }
        start = r;
    }
    tiles
}

impl Model {
    /// Loads with the pack cache as `HEARTH_PACK_CACHE` says (default: map a prepared pack
    /// beside the model, write none).
    pub fn load(file: GgufFile) -> Result<Self, ModelError> {
        Self::load_options(file, LoadOptions::default())
    }

    /// Loads; `use_pack_cache`: map a pack beside the model, or write one after a repack
    /// ([`PackMode::Write`]); false: neither. Float matrices as [`FloatWeights::Auto`].
    pub fn load_with(file: GgufFile, use_pack_cache: bool) -> Result<Self, ModelError> {
        Self::load_options(
            file,
            LoadOptions {
                pack_cache: match use_pack_cache {
                    true => PackCache::writing(),
                    false => PackCache::OFF,
                },
                ..LoadOptions::default()
            },
        )
    }

    /// Loads with these options, repacking for the SIMD kernels.
    pub fn load_options(file: GgufFile, o: LoadOptions) -> Result<Self, ModelError> {
        let mut m = Self::load_inner(file, &o)?;
        if isa().is_simd() {
            let t = std::time::Instant::now();
            // Only a pack written by choice can fail, and that failure is logged there.
            let _ = m.repack(false);
            m.repack_seconds = t.elapsed().as_secs_f64();
        }
        Ok(m)
    }

    /// Loads without repacking for the CPU kernels: for a backend that keeps its own copy
    /// of the weights (the CUDA backend reads them from [`Model::weights`]).
    pub fn load_unpacked(file: GgufFile, o: LoadOptions) -> Result<Self, ModelError> {
        Self::load_inner(
            file,
            &LoadOptions {
                pack_cache: PackCache::OFF,
                ..o
            },
        )
    }

    fn load_layer(file: &GgufFile, c: &ModelConfig, l: usize) -> Result<Layer, ModelError> {
        let d = c.d_model;
        let n = |s: &str| format!("blk.{l}.{s}.weight");
        let sh = c.norm_shift;
        let (attn, wo_cols) = match &c.mla {
            Some(m) => (Attention::Latent(Latent::load(file, c, m, l)?), c.n_heads * m.v_head),
            None => (Attention::Heads(Self::load_heads(file, c, l)?), c.q_dim()),
        };
        let ffn = match &c.moe {
            Some(m) if m.is_moe_layer(l) => Ffn::Experts(Box::new(Moe::load(file, c, m, l)?)),
            _ => Ffn::Dense(load_mlp(file, l, "", d, c.n_ff)?),
        };
        let post = |s: &str| match c.block.post_norms {
            true => norm(file, &n(s), d, sh).map(Some),
            false => Ok(None),
        };
        Ok(Layer {
            attn_norm: norm(file, &n("attn_norm"), d, sh)?,
            attn,
            wo: matrix(file, &n("attn_output"), d, wo_cols)?,
            attn_post_norm: post("post_attention_norm")?,
            ffn_norm: norm(file, &n("ffn_norm"), d, sh)?,
            ffn,
            ffn_post_norm: post("post_ffw_norm")?,
        })
    }

    fn load_heads(file: &GgufFile, c: &ModelConfig, l: usize) -> Result<HeadsAttention, ModelError> {
        let (d, qd, kv) = (c.d_model, c.q_dim(), c.kv_dim());
        let n = |s: &str| format!("blk.{l}.{s}.weight");
        let b = |s: &str| format!("blk.{l}.{s}.bias");
        let (qkv, bias) = if file.tensor(&n("attn_qkv")).is_some() {
            let m = matrix(file, &n("attn_qkv"), qd + 2 * kv, d)?;
            let bias = match opt_vector(file, &b("attn_qkv"), qd + 2 * kv)? {
                Some(all) => [
                    Some(all[..qd].to_vec()),
                    Some(all[qd..qd + kv].to_vec()),
                    Some(all[qd + kv..].to_vec()),
                ],
                None => [None, None, None],
            };
            (Qkv::Fused(m), bias)
        } else {
            let qkv = Qkv::Split {
                q: matrix(file, &n("attn_q"), qd, d)?,
                k: matrix(file, &n("attn_k"), kv, d)?,
                v: matrix(file, &n("attn_v"), kv, d)?,
            };
            let bias = [
                opt_vector(file, &b("attn_q"), qd)?,
                opt_vector(file, &b("attn_k"), kv)?,
                opt_vector(file, &b("attn_v"), kv)?,
            ];
            (qkv, bias)
        };
        let qk_norm = match c.block.qk_norm {
            true => Some((
                norm(file, &n("attn_q_norm"), c.head_dim, c.norm_shift)?,
                norm(file, &n("attn_k_norm"), c.head_dim, c.norm_shift)?,
            )),
            false => None,
        };
        Ok(HeadsAttention { qkv, bias, qk_norm })
    }

    /// Biases Hearth would not add: refused by name rather than silently dropped.
    fn check_unused_biases(file: &GgufFile) -> Result<(), ModelError> {
        const USED: [&str; 5] = [
            "attn_q.bias",
            "attn_k.bias",
            "attn_v.bias",
            "attn_qkv.bias",
            "exp_probs_b.bias",
        ];
        match file
            .tensors
            .iter()
            .find(|t| t.name.ends_with(".bias") && !USED.iter().any(|u| t.name.ends_with(u)))
        {
            Some(t) => Err(ModelError::Config(format!(
                "tensor {} is a bias Hearth does not apply (it adds Q/K/V biases only)",
                t.name
            ))),
            None => Ok(()),
        }
    }

    /// The rotation of global layers: the configured scaling, with the file's per-pair
    /// divisors as llama.cpp's `get_rope_factors` picks them — Llama 3's `rope_freqs`, else
    /// LongRoPE's long set when serving past the original context and its short set
    /// otherwise (Phi-3's converter writes the sets without a scaling type).
    fn rope_freqs(file: &GgufFile, c: &ModelConfig, max_context: Option<usize>) -> Result<RopeFreqs, ModelError> {
        let n = c.rope_dims / 2;
        let s = &c.rope_scaling;
        let original = match s.original_context {
            0 => c.context_length,
            o => o,
        };
        let long = max_context.unwrap_or(c.context_length) > original;
        let factors = match opt_vector(file, "rope_freqs.weight", n)? {
            Some(f) => Some(f),
            None if long => opt_vector(file, "rope_factors_long.weight", n)?,
            None => opt_vector(file, "rope_factors_short.weight", n)?,
        };
        if let Some(f) = &factors {
            if f.iter().any(|v| !(v.is_finite() && *v > 0.0)) {
                return Err(ModelError::Config("RoPE factors must be positive numbers".into()));
            }
        }
        Ok(RopeFreqs::new(
            c.rope_theta,
            c.rope_dims,
            s,
            factors.as_deref(),
            c.context_length,
        ))
    }

    fn load_inner(file: GgufFile, o: &LoadOptions) -> Result<Self, ModelError> {
        let mut c = ModelConfig::from_gguf(&file)?;
        if let Some(s) = o.rope_scaling {
            if s.kind == RopeScalingKind::Llama3 && file.tensor("rope_freqs.weight").is_some() {
                return Err(ModelError::Config(
                    "the file carries Llama 3's RoPE factors already (rope_freqs); stretch it with yarn or linear scaling".into(),
                ));
            }
            c.set_rope_scaling(s);
        }
        Self::check_unused_biases(&file)?;
        let d = c.d_model;
        let span = match &o.stage {
            Some(plan) => plan.resolve(&file, &c)?,
            None => StageSpan::whole(c.n_layers),
        };
        let layers = span
            .layers()
            .map(|l| Self::load_layer(&file, &c, l))
            .collect::<Result<Vec<_>, _>>()?;
        let embed = matrix(&file, "token_embd.weight", c.vocab_size, d)?;
        // Tied embeddings: no `output.weight`, the logits reuse the embedding matrix.
        let output = match file.tensor("output.weight") {
            Some(_) => matrix(&file, "output.weight", c.vocab_size, d)?,
            None => embed.clone(),
        };
        let output_norm = norm(&file, "output_norm.weight", d, c.norm_shift)?;
        let mut rope = Self::rope_freqs(&file, &c, o.max_context)?;
        if c.mla.is_some() {
            // Latent attention rotates at the file's magnitude and scales its scores for
            // YaRN instead (`ModelConfig::mla_score_scale`), as llama.cpp does.
            rope.mscale = c.rope_scaling.attn_factor;
        }
        // Windowed layers' own rotation (never scaled), when it differs from the global one.
        let rope_local = c
            .block
            .swa_rope_theta
            .map(|theta| RopeFreqs::new(theta, c.rope_dims, &RopeScaling::default(), None, c.context_length))
            .filter(|local| *local != rope);
        let n_params = file.tensors.iter().map(|t| t.n_elements()).sum();
        let float_weights = o.float_weights.resolve(file.has_routed_experts());
        Ok(Self {
            file,
            config: c,
            span,
            layers,
            embed,
            output,
            output_norm,
            rope,
            rope_local,
            n_params,
            packed_bytes: 0,
            repack_seconds: 0.0,
            packed_from_cache: false,
            pack_cache: o.pack_cache.clone(),
            float_weights,
            progress: Arc::default(),
        })
    }

    /// Repacks every quantized matrix for the SIMD kernels (see [`crate::kernels::packed`]),
    /// releasing each one's file pages once its copy exists, so that resident memory holds
    /// one copy of the weights, not two. The embedding stays in the file (rows are looked
    /// up, not multiplied); with tied embeddings its packed copy serves the logits.
    ///
    /// A prepared pack ([`crate::kernels::pack_cache`]: in the pack directory, else beside
    /// the model) is mapped, not copied, when one is current; otherwise the matrices are
    /// repacked in memory, in parallel, and — with [`PackMode::Write`] — the pack written
    /// for the next load. `rewrite`: repack and write the pack whatever is there
    /// (`hearth model pack`); returns the path written, if any.
    fn repack(&mut self, rewrite: bool) -> std::io::Result<Option<std::path::PathBuf>> {
        let file = &self.file;
        let embed = (self.embed.shard, self.embed.offset, self.embed.len);
        let is_embed = |m: &Matrix| (m.shard, m.offset) == (embed.0, embed.1);
        // Every matrix, in a fixed order: each layer's, then the output (the layer of each
        // kept, for the progress count).
        let n_layers = self.layers.len();
        let mut ms: Vec<&mut Matrix> = Vec::new();
        let mut layer_of = Vec::new();
        for (l, layer) in self.layers.iter_mut().enumerate() {
            for m in layer.matrices_mut() {
                ms.push(m);
                layer_of.push(l);
            }
        }
        if self.span.last() {
            ms.push(&mut self.output);
            layer_of.push(n_layers);
        }
        let mut wanted = Vec::new();
        let mut layer_of = layer_of.into_iter();
        let float_as_q8_0 = self.float_weights == FloatWeights::Q8_0;
        let kind_of = |ty: GgmlType| match PackKind::of(ty) {
            None if float_as_q8_0 && !ty.is_quantized() => Some(PackKind::Byte),
            k => k,
        };
        let mut kept_layers = Vec::new();
        ms.retain(|m| match (kind_of(m.ty), layer_of.next()) {
            (Some(kind), Some(l)) if m.cols.is_multiple_of(QK * kind.blocks_per_super()) => {
                kept_layers.push(l);
                wanted.push(Wanted {
                    kind,
                    rows: m.rows,
                    cols: m.cols,
                    tensor_offset: m.offset as u64 | (m.shard as u64) << 48,
                });
                true
            }
            _ => false,
        });
        if ms.is_empty() {
            // Nothing to repack or cache (float weights kept as floats).
            return Ok(None);
        }
        // Matrices counted at each layer's end, for the progress count.
        let layer_ends: Vec<usize> = (0..kept_layers.len())
            .filter(|&i| kept_layers.get(i + 1) != Some(&kept_layers[i]))
            .map(|i| i + 1)
            .collect();
        let total_bytes = wanted
            .iter()
            .map(|w| PackedMatrix::size_for(w.kind, w.rows, w.cols) as u64)
            .sum();
        let progress = self.progress.clone();
        progress.start(WeightsSource::Pack, total_bytes, layer_ends);
        let cached = match rewrite {
            true => Err("rewriting".into()),
            false => pack_cache::load(&file.path, &self.pack_cache, &wanted, &progress),
        };
        let mut total = 0;
        let mut written = None;
        match cached {
            Ok(packed) => {
                for (m, p) in ms.iter_mut().zip(packed) {
                    total += p.bytes().len();
                    m.packed = Some(Arc::new(p));
                    if !is_embed(m) {
                        file.release(m.shard, m.offset, m.len);
                    }
                }
                self.packed_from_cache = true;
            }
            Err(why) => {
                progress.set_source(WeightsSource::Repacked);
                match self.pack_cache.candidates(&file.path).iter().any(|p| p.exists()) {
                    true => tracing::info!(reason = %why, "pack not used: repacking in memory"),
                    false => tracing::debug!(reason = %why, "no pack: repacking in memory"),
                }
                // Matrices in parallel (each one's groups in parallel too): the model's
                // many small matrices — a mixture's experts — keep both cores busy.
                total = ms
                    .par_iter_mut()
                    .map(|m| match pack_one(&weight_view(file, m)) {
                        Some(p) => {
                            let n = p.bytes().len();
                            progress.ready(n as u64);
                            m.packed = Some(Arc::new(p));
                            // This matrix's file pages leave the resident set at once, so
                            // that memory holds one copy of the weights, not two.
                            if !is_embed(m) {
                                file.release(m.shard, m.offset, m.len);
                            }
                            n
                        }
                        None => 0,
                    })
                    .sum();
                let all: Option<Vec<(Wanted, &PackedMatrix)>> = ms
                    .iter()
                    .zip(&wanted)
                    .map(|(m, w)| Some((*w, m.packed.as_deref()?)))
                    .collect();
                match (rewrite, self.pack_cache.mode, all) {
                    (true, _, None) => {
                        return Err(std::io::Error::other(
                            "a matrix did not pack (a scale overflows f16): no pack written",
                        ))
                    }
                    (true, _, Some(all)) => written = Some(pack_cache::store(&file.path, &self.pack_cache, &all)?),
                    (false, PackMode::Write, Some(all)) => {
                        match pack_cache::store(&file.path, &self.pack_cache, &all) {
                            Ok(p) => {
                                tracing::info!(path = %p.display(), "pack written for the next load");
                                written = Some(p);
                            }
                            Err(e) => {
                                tracing::info!(error = %e, "pack not written (the directory is not writable?)")
                            }
                        }
                    }
                    _ => {}
                }
            }
        }
        // The embedding's rows are still read from the file for lookups (with tied
        // embeddings its packed copy serves the logits); they fault in as needed.
        file.release(embed.0, embed.1, embed.2);
        self.packed_bytes = total;
        Ok(written)
    }

    /// Repacks `file` in memory and writes its pack where `o.pack_cache` says (its
    /// directory, else beside the model), whatever is there already: `hearth model pack`,
    /// which prepares a model once for every worker that maps it.
    pub fn prepare_pack(file: GgufFile, o: LoadOptions) -> Result<PreparedPack, ModelError> {
        let mut m = Self::load_inner(file, &o)?;
        let t = std::time::Instant::now();
        let path = m
            .repack(true)
            .map_err(|e| ModelError::Config(format!("writing the pack: {e}")))?
            .ok_or_else(|| ModelError::Config("nothing to pack: every matrix is computed as floats".into()))?;
        Ok(PreparedPack {
            path,
            bytes: m.packed_bytes,
            seconds: t.elapsed().as_secs_f64(),
        })
    }

    /// How far the packed weights are ready: counted as they are repacked, or as a mapped
    /// pack's are checked (in the background, after the load returns).
    pub fn load_progress(&self) -> Arc<LoadProgress> {
        self.progress.clone()
    }

    /// How float matrices are computed ([`FloatWeights::Auto`] resolved for this model).
    pub fn float_weights(&self) -> FloatWeights {
        self.float_weights
    }

    /// Whether the repacked weights were mapped from the on-disk cache.
    pub fn packed_from_cache(&self) -> bool {
        self.packed_from_cache
    }

    /// Seconds the repacking took at load (0 on the scalar path).
    pub fn repack_seconds(&self) -> f64 {
        self.repack_seconds
    }

    /// Bytes of repacked weights held in memory.
    pub fn packed_bytes(&self) -> usize {
        self.packed_bytes
    }

    /// Weight bytes one decode step reads: every layer's matrices (of a mixture, the
    /// experts one token uses) and the output matrix once (their repacked copies where
    /// they have one; the embedding row is negligible).
    pub fn decode_weight_bytes(&self) -> usize {
        let size = |m: &Matrix| m.packed.as_ref().map_or(m.len, |p| p.bytes().len());
        // A mixture's step reads the experts its token chose: `used` of them.
        let used = self.config.moe.as_ref().map_or(0, |m| m.used);
        let layers: usize = self.layers.iter().flat_map(|l| l.decode_matrices(used)).map(size).sum();
        layers + if self.span.last() { size(&self.output) } else { 0 }
    }

    /// The mixture layers' per-expert row counters (empty for a dense model).
    pub fn expert_load(&self) -> super::moe::ExpertLoad {
        super::moe::ExpertLoad(
            self.layers
                .iter()
                .enumerate()
                .filter_map(|(l, layer)| match &layer.ffn {
                    Ffn::Experts(m) => Some((l, m.counters())),
                    Ffn::Dense(_) => None,
                })
                .collect(),
        )
    }

    pub fn n_params(&self) -> u64 {
        self.n_params
    }

    pub fn file(&self) -> &GgufFile {
        &self.file
    }

    pub(super) fn view<'a>(&'a self, m: &'a Matrix) -> WeightView<'a> {
        weight_view(&self.file, m)
    }

    /// Every weight, as stored: for backends that keep their own copy (see
    /// [`Model::load_unpacked`]), which compute the plain Llama block only. Anything else
    /// (biases, fused projections, the other families' norms) is refused here.
    pub fn weights(&self) -> Result<ModelWeights<'_>, String> {
        if !self.span.is_whole() {
            return Err(format!("a pipeline stage ({}) is computed on the CPU only", self.span));
        }
        if !self.config.plain_block() || self.rope.mscale != 1.0 {
            return Err(format!(
                "the {} block (its norms, windows, soft-caps or RoPE magnitude) is computed on the CPU only",
                self.config.arch
            ));
        }
        let layers = self
            .layers
            .iter()
            .map(|l| match (&l.attn, &l.ffn) {
                (
                    Attention::Heads(HeadsAttention {
                        qkv: Qkv::Split { q, k, v },
                        bias: [None, None, None],
                        ..
                    }),
                    Ffn::Dense(Mlp {
                        gate_up: GateUp::Split { gate, up },
                        down,
                    }),
                ) => Ok(LayerWeights {
                    attn_norm: &l.attn_norm,
                    wq: self.view(q),
                    wk: self.view(k),
                    wv: self.view(v),
                    wo: self.view(&l.wo),
                    ffn_norm: &l.ffn_norm,
                    w_gate: self.view(gate),
                    w_up: self.view(up),
                    w_down: self.view(down),
                }),
                _ => Err(
                    "fused projections, biases, experts and latent attention are computed on the CPU only".to_string(),
                ),
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(ModelWeights {
            layers,
            embed: self.view(&self.embed),
            output: self.view(&self.output),
            tied: (self.output.shard, self.output.offset) == (self.embed.shard, self.embed.offset),
            output_norm: &self.output_norm,
            inv_freq: &self.rope.inv_freq,
        })
    }

    /// The shape (rows, columns) of the matrix a LoRA adapter's `target` updates in layer
    /// `layer`, or why adapters cannot update it in this model.
    pub(super) fn lora_target(&self, layer: usize, target: Target) -> Result<(usize, usize), &'static str> {
        if !self.span.is_whole() {
            return Err("a pipeline stage takes no adapters yet (each stage would need the adapter's layers)");
        }
        let l = self.layers.get(layer).ok_or("no such layer")?;
        let m = match target {
            Target::O => &l.wo,
            Target::Q | Target::K | Target::V | Target::Qkv => match (&l.attn, target) {
                (Attention::Latent(_), _) => return Err("latent attention's projections take no adapters"),
                (Attention::Heads(a), _) => match (&a.qkv, target) {
                    (Qkv::Split { q, .. }, Target::Q) => q,
                    (Qkv::Split { k, .. }, Target::K) => k,
                    (Qkv::Split { v, .. }, Target::V) => v,
                    (Qkv::Fused(m), Target::Qkv) => m,
                    (Qkv::Split { .. }, _) => return Err("this model has separate Q, K and V projections"),
                    (Qkv::Fused(_), _) => return Err("this model's Q, K and V are one fused projection (qkv_proj)"),
                },
            },
            Target::Gate | Target::Up | Target::Down => match &l.ffn {
                Ffn::Experts(_) => return Err("a mixture of experts' MLP takes no adapters"),
                Ffn::Dense(mlp) => match (&mlp.gate_up, target) {
                    (_, Target::Down) => &mlp.down,
                    (GateUp::Split { gate, .. }, Target::Gate) => gate,
                    (GateUp::Split { up, .. }, _) => up,
                    (GateUp::Fused(_), Target::Gate) => {
                        return Err("this model's gate and up are one fused projection (gate_up_proj)")
                    }
                    (GateUp::Fused(m), _) => m,
                },
            },
        };
        Ok((m.rows, m.cols))
    }

    /// The attention's projections of `h` into `q`, `k`, `v`, with the rows' adapters'
    /// updates and the biases.
    fn project_qkv(
        &self,
        layer: &HeadsAttention,
        h: &[f32],
        lora: LoraRows<'_>,
        qkv: [&mut Vec<f32>; 3],
        fused: &mut Vec<f32>,
        s: &mut ForwardScratch,
    ) {
        let [q, k, v] = qkv;
        match &layer.qkv {
            Qkv::Split { q: wq, k: wk, v: wv } => matmul_many(
                &[self.view(wq), self.view(wk), self.view(wv)],
                h,
                &mut [&mut q[..], &mut k[..], &mut v[..]],
                &mut s.mm,
            ),
            Qkv::Fused(w) => {
                fused.resize(q.len() + k.len() + v.len(), 0.0);
                matmul(&self.view(w), h, fused, &mut s.mm);
                lora.apply(Target::Qkv, h, fused);
                let rows = h.len() / self.config.d_model;
                split_rows(fused, rows, &mut [&mut q[..], &mut k[..], &mut v[..]]);
            }
        }
        if let Qkv::Split { .. } = &layer.qkv {
            lora.apply(Target::Q, h, q);
            lora.apply(Target::K, h, k);
            lora.apply(Target::V, h, v);
        }
        for (x, bias) in [q, k, v].into_iter().zip(&layer.bias) {
            add_bias(x, bias.as_ref());
        }
    }

    /// Runs one step for many sequences at once: row `t` is token `tokens[t]` at position
    /// `positions[t]` of the sequence whose block table is `tables[t]`. Every weight row is
    /// read once for all rows. K/V of every row are written into the pool; attention for a
    /// row sees its own sequence up to its position (within the layer's window). Returns
    /// logits (`vocab` floats) for each row in `logit_rows`, in that order.
    pub fn forward_batch(&self, b: &Batch<'_>, pool: &mut KvPool, s: &mut ForwardScratch) -> Vec<f32> {
        self.forward_batch_until(b, pool, s, &mut |_| false)
            .expect("a step that is never stopped completes")
    }

    /// [`Self::forward_batch`], asking `stop(layer)` before each layer after the first
    /// whether to give the step up: `None` if it did. The K/V it wrote for the step's
    /// positions are then stale until a later step computes those positions again (the
    /// scheduler counts none of them as computed).
    pub fn forward_batch_until(
        &self,
        b: &Batch<'_>,
        pool: &mut KvPool,
        s: &mut ForwardScratch,
        stop: &mut dyn FnMut(usize) -> bool,
    ) -> Option<Vec<f32>> {
        assert!(self.span.is_whole(), "a pipeline stage computes with forward_stage");
        self.forward_stage(b, StageInput::Tokens, pool, s, stop)
    }

    /// This stage's part of a step: the rows' hidden states in (`StageInput::Hidden`, `t ·
    /// d_model` floats, from the stage before) or the tokens embedded (the first stage),
    /// then this stage's layers; returns the logits of `logit_rows` on the last stage and
    /// the hidden states otherwise. `stop` as [`Self::forward_batch_until`] (asked with
    /// this stage's layer index).
    pub fn forward_stage(
        &self,
        b: &Batch<'_>,
        input: StageInput,
        pool: &mut KvPool,
        s: &mut ForwardScratch,
        stop: &mut dyn FnMut(usize) -> bool,
    ) -> Option<Vec<f32>> {
        let c = &self.config;
        let (t, d) = (b.tokens.len(), c.d_model);
        let bt = pool.block_tokens();
        assert_eq!(
            pool.shape(),
            self.kv_shape(bt),
            "the KV pool was built for another model shape"
        );
        let mut x = match input {
            StageInput::Tokens => {
                assert!(self.span.first(), "only the first stage embeds tokens");
                self.embed_rows(b.tokens)
            }
            StageInput::Hidden(x) => {
                assert!(!self.span.first(), "the first stage embeds its tokens");
                assert_eq!(x.len(), t * d, "hidden states for {t} rows of {d}");
                x
            }
        };
        if !self.run_layers(b, &mut x, pool, s, stop) {
            return None;
        }
        if !self.span.last() {
            return Some(x);
        }
        Some(self.logits(b, &x, s))
    }

    fn embed_rows(&self, tokens: &[u32]) -> Vec<f32> {
        let d = self.config.d_model;
        let mut x = vec![0f32; tokens.len() * d];
        let embed = self.view(&self.embed);
        for (row, &tok) in x.chunks_exact_mut(d).zip(tokens) {
            dequantize_row(embed.ty, embed.row(tok as usize), row);
        }
        if let Some(scale) = self.config.block.embed_scale {
            x.iter_mut().for_each(|v| *v *= scale);
        }
        x
    }

    /// This stage's layers over `x`; false if `stop` gave the step up.
    fn run_layers(
        &self,
        b: &Batch<'_>,
        x: &mut [f32],
        pool: &mut KvPool,
        s: &mut ForwardScratch,
        stop: &mut dyn FnMut(usize) -> bool,
    ) -> bool {
        let c = &self.config;
        let (t, d, hd) = (b.tokens.len(), c.d_model, c.head_dim);
        // Grouped-query layers' projections (latent attention has its own).
        let (qd, kvd) = match c.mla {
            Some(_) => (0, 0),
            None => (c.q_dim(), c.kv_dim()),
        };
        let bt = pool.block_tokens();
        let mut h = vec![0f32; t * d];
        let mut q = vec![0f32; t * qd];
        let mut k = vec![0f32; t * kvd];
        let mut v = vec![0f32; t * kvd];
        let mut att = Vec::new();
        let mut o = vec![0f32; t * d];
        let mut bufs = MlpBufs::default();
        let mut fused = Vec::new();
        let tiles = attention_tiles(b, c.n_heads, c.n_kv_heads);
        let rope_global = self.rope.table(b.positions);
        let rope_local = self.rope_local.as_ref().map(|r| r.table(b.positions));
        assert!(
            b.adapters.is_empty() || b.adapters.len() == t,
            "adapters are given for every row of a step or for none"
        );
        let groups = LoraGroups::new(b.adapters);
        // `l` indexes this stage's layers (and its KV pool); `at` is the model's layer.
        for (l, layer) in self.layers.iter().enumerate() {
            let at = self.span.start + l;
            if l > 0 && stop(l) {
                return false;
            }
            let window = c.window(at);
            let lora = groups.at(at);
            rms_norm(x, &layer.attn_norm, c.rms_eps, &mut h);
            att.resize(t * layer.wo.cols, 0.0);
            match &layer.attn {
                Attention::Heads(a) => {
                    self.project_qkv(a, &h, lora, [&mut q, &mut k, &mut v], &mut fused, s);
                    if let Some((qn, kn)) = &a.qk_norm {
                        rms_norm_in_place(&mut q, qn, c.rms_eps);
                        rms_norm_in_place(&mut k, kn, c.rms_eps);
                    }
                    let table = match (window, &rope_local) {
                        (Some(_), Some(local)) => local,
                        _ => &rope_global,
                    };
                    rope::rotate(&mut q, c.n_heads, hd, c.rope_layout, table);
                    rope::rotate(&mut k, c.n_kv_heads, hd, c.rope_layout, table);
                    for r in 0..t {
                        let p = b.positions[r];
                        pool.write(
                            b.tables[r][p / bt],
                            p % bt,
                            l,
                            &k[r * kvd..(r + 1) * kvd],
                            &v[r * kvd..(r + 1) * kvd],
                        );
                    }
                    self.attention(b, l, window, &tiles, &q, hd, hd, pool, &mut att);
                }
                Attention::Latent(a) => a.forward(self, b, l, &h, &rope_global, &tiles, pool, &mut att, s),
            }
            matmul(&self.view(&layer.wo), &att, &mut o, &mut s.mm);
            lora.apply(Target::O, &att, &mut o);
            Self::residual(x, &mut o, layer.attn_post_norm.as_deref(), c.rms_eps);
            rms_norm(x, &layer.ffn_norm, c.rms_eps, &mut h);
            match &layer.ffn {
                Ffn::Dense(m) => m.forward(self, &h, lora, &mut bufs, &mut o, s),
                Ffn::Experts(m) => m.forward(self, &h, &mut bufs, &mut o, s),
            }
            Self::residual(x, &mut o, layer.ffn_post_norm.as_deref(), c.rms_eps);
        }
        true
    }

    /// The final norm and the logits of `b.logit_rows` (the last stage's).
    fn logits(&self, b: &Batch<'_>, x: &[f32], s: &mut ForwardScratch) -> Vec<f32> {
        let c = &self.config;
        let d = c.d_model;
        if b.logit_rows.is_empty() {
            return Vec::new();
        }
        let mut last = vec![0f32; b.logit_rows.len() * d];
        for (dst, &r) in last.chunks_exact_mut(d).zip(b.logit_rows) {
            rms_norm(&x[r * d..(r + 1) * d], &self.output_norm, c.rms_eps, dst);
        }
        let mut logits = vec![0f32; b.logit_rows.len() * c.vocab_size];
        matmul(&self.view(&self.output), &last, &mut logits, &mut s.mm);
        if let Some(cap) = c.block.final_softcap {
            soft_cap(&mut logits, cap);
        }
        logits
    }

    /// Attention of every row and head of layer `l` into `att`, a tile at a time (see
    /// [`attention_tiles`]): each tile's queries read their KV head's blocks once. Every
    /// head's query is `qh` wide and its output `vh` (narrower for latent attention, whose
    /// values are its keys' leading part).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention(
        &self,
        b: &Batch<'_>,
        l: usize,
        window: Option<usize>,
        tiles: &[Tile],
        q: &[f32],
        qh: usize,
        vh: usize,
        pool: &KvPool,
        att: &mut [f32],
    ) {
        let c = &self.config;
        let (qd, vd) = (c.n_heads * qh, c.n_heads * vh);
        let scoring = Scoring {
            scale: c.block.attn_scale,
            softcap: c.block.attn_softcap,
        };
        let outs: Vec<Vec<f32>> = tiles
            .par_iter()
            .map_init(Vec::new, |scores, t| {
                let queries: Vec<Query<'_>> = (t.row..t.row + t.rows)
                    .flat_map(|r| {
                        let end = b.positions[r] + 1;
                        let start = window.map_or(0, |w| end.saturating_sub(w));
                        (t.head..t.head + t.heads).map(move |head| Query {
                            q: &q[r * qd + head * qh..][..qh],
                            span: start..end,
                        })
                    })
                    .collect();
                let spec = HeadSpec {
                    layer: l,
                    kv_head: t.kv_head,
                    head_dim: qh,
                    kv_dim: pool.shape().kv_dim(),
                };
                let mut out = vec![0f32; queries.len() * vh];
                attend_group(&queries, b.tables[t.row], pool, spec, scoring, &mut out, scores);
                out
            })
            .collect();
        for (t, out) in tiles.iter().zip(outs) {
            let rows = (t.row..t.row + t.rows).flat_map(|r| (t.head..t.head + t.heads).map(move |h| (r, h)));
            for ((r, head), o) in rows.zip(out.chunks_exact(vh)) {
                att[r * vd + head * vh..][..vh].copy_from_slice(o);
            }
        }
    }

    /// `x += o`, with `o` normalized first when the block has a post-norm there.
    fn residual(x: &mut [f32], o: &mut [f32], post_norm: Option<&[f32]>, eps: f32) {
        if let Some(w) = post_norm {
            rms_norm_in_place(o, w, eps);
        }
        x.iter_mut().zip(o.iter()).for_each(|(a, b)| *a += b);
    }

    /// The KV cache's shape for this model.
    pub fn kv_shape(&self, block_tokens: usize) -> KvShape {
        KvShape {
            n_layers: self.span.len(),
            ..self.config.kv_shape(block_tokens)
        }
    }

    /// The layers this process computes.
    pub fn span(&self) -> StageSpan {
        self.span
    }

    /// KV bytes per cached token.
    pub fn kv_bytes_per_token(&self, dtype: KvDtype) -> usize {
        KvPool::block_bytes(self.kv_shape(1), dtype)
    }

    /// The architecture.
    pub fn arch(&self) -> Arch {
        self.config.arch
    }

    /// A hash of how keys are rotated (every layer kind's frequencies and magnitude): two
    /// engines share KV blocks only when it is equal (see [`crate::kv::block::KvLayout`]).
    pub fn rope_fingerprint(&self) -> u64 {
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        for r in std::iter::once(&self.rope).chain(&self.rope_local) {
            for f in r.inv_freq.iter().chain([&r.mscale]) {
                h.update(&f.to_bits().to_le_bytes());
            }
        }
        h.update(&[self.config.rope_layout as u8]);
        h.digest()
    }
}

/// One layer's weights (see [`Model::weights`]).
#[derive(Debug)]
pub struct LayerWeights<'a> {
    pub attn_norm: &'a [f32],
    pub wq: WeightView<'a>,
    pub wk: WeightView<'a>,
    pub wv: WeightView<'a>,
    pub wo: WeightView<'a>,
    pub ffn_norm: &'a [f32],
    pub w_gate: WeightView<'a>,
    pub w_up: WeightView<'a>,
    pub w_down: WeightView<'a>,
}

/// A model's weights (see [`Model::weights`]).
#[derive(Debug)]
pub struct ModelWeights<'a> {
    pub layers: Vec<LayerWeights<'a>>,
    pub embed: WeightView<'a>,
    /// The logits' matrix: the embedding's when `tied`.
    pub output: WeightView<'a>,
    pub tied: bool,
    pub output_norm: &'a [f32],
    /// RoPE's frequencies, `rope_dims / 2` of them.
    pub inv_freq: &'a [f32],
}

/// What a stage starts its part of a step from (see [`Model::forward_stage`]).
#[derive(Debug)]
pub enum StageInput {
    /// The batch's tokens, embedded here (the first stage).
    Tokens,
    /// The rows' hidden states from the stage before, `rows · d_model` floats.
    Hidden(Vec<f32>),
}

/// One forward step's rows (see [`Model::forward_batch`]).
#[derive(Debug, Clone, Copy)]
pub struct Batch<'a> {
    pub tokens: &'a [u32],
    pub positions: &'a [usize],
    pub tables: &'a [&'a [u32]],
    pub logit_rows: &'a [usize],
    /// The LoRA adapter each row runs under (None: the base model's weights), one per row;
    /// empty when no row has one.
    pub adapters: &'a [Option<&'a LoraAdapter>],
}

/// One sequence over its own small paged cache: for tests, tools and numerics checks.
pub struct Session<'m> {
    model: &'m Model,
    pool: KvPool,
    table: Vec<u32>,
    len: usize,
    scratch: ForwardScratch,
    adapter: Option<&'m LoraAdapter>,
}

impl<'m> Session<'m> {
    /// A session that can hold `capacity` tokens, with the engine's default KV storage
    /// (f32 with float activations, which are for numerics checks).
    pub fn new(model: &'m Model, capacity: usize, scratch: ForwardScratch) -> Self {
        let dtype = if scratch.mm.precise {
            KvDtype::F32
        } else {
            KvDtype::default()
        };
        Self::with_kv(model, capacity, scratch, dtype)
    }

    pub fn with_kv(model: &'m Model, capacity: usize, scratch: ForwardScratch, dtype: KvDtype) -> Self {
        let bt = hearth_protocol::DEFAULT_BLOCK_TOKENS;
        let blocks = capacity.div_ceil(bt);
        Self {
            model,
            pool: KvPool::new(model.kv_shape(bt), dtype, blocks),
            table: (0..blocks as u32).collect(),
            len: 0,
            scratch,
            adapter: None,
        }
    }

    /// The session with a LoRA adapter applied to every token.
    pub fn with_adapter(mut self, adapter: &'m LoraAdapter) -> Self {
        self.adapter = Some(adapter);
        self
    }

    /// Appends tokens and returns the logits after the last one.
    pub fn feed(&mut self, tokens: &[u32]) -> Vec<f32> {
        let positions: Vec<usize> = (self.len..self.len + tokens.len()).collect();
        let tables = vec![&self.table[..]; tokens.len()];
        let adapters = match self.adapter {
            Some(a) => vec![Some(a); tokens.len()],
            None => Vec::new(),
        };
        let batch = Batch {
            tokens,
            positions: &positions,
            tables: &tables,
            logit_rows: &[tokens.len() - 1],
            adapters: &adapters,
        };
        self.len += tokens.len();
        self.model.forward_batch(&batch, &mut self.pool, &mut self.scratch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Tiles cover every (row, head) once, with at most MAX_GROUP queries, rows of one
    /// sequence at consecutive positions, heads of one KV head.
    #[test]
    fn attention_tiles_cover_every_row_and_head_once() {
        let (a, b2) = (vec![0u32, 1, 2], vec![5u32, 6]);
        let tables: Vec<&[u32]> = vec![&a, &a, &a, &a, &a, &b2, &a, &b2, &b2];
        let positions = [10, 11, 12, 13, 14, 3, 20, 7, 8];
        let tokens = [1u32; 9];
        let batch = Batch {
            tokens: &tokens,
            positions: &positions,
            tables: &tables,
            logit_rows: &[],
            adapters: &[],
        };
        for (heads, kv) in [(9, 3), (16, 8), (32, 32), (32, 4), (8, 1)] {
            let tiles = attention_tiles(&batch, heads, kv);
            let mut seen = vec![0; tokens.len() * heads];
            for t in &tiles {
                assert!(t.rows * t.heads <= MAX_GROUP && t.rows > 0 && t.heads > 0, "{t:?}");
                let group = heads / kv;
                assert!(t.head >= t.kv_head * group && t.head + t.heads <= (t.kv_head + 1) * group);
                for r in t.row..t.row + t.rows {
                    assert!(std::ptr::eq(tables[r], tables[t.row]));
                    assert_eq!(positions[r], positions[t.row] + (r - t.row));
                    for h in t.head..t.head + t.heads {
                        seen[r * heads + h] += 1;
                    }
                }
            }
            assert!(seen.iter().all(|&n| n == 1), "{heads}/{kv}: {seen:?}");
        }
    }
}

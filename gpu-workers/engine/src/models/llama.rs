//! The Llama architecture (SmolLM2, Llama 2/3, TinyLlama, …) as stored in GGUF or a Hugging
//! Face directory: GQA attention, RMSNorm, SwiGLU, RoPE, optionally tied embeddings. RoPE
//! pairs differ by format: GGUF permutes `attn_q`/`attn_k` rows so that pairs (2i, 2i+1)
//! rotate together; Hugging Face checkpoints rotate the two halves of each head (i, i + d/2)
//! ([`RopeLayout`]).

use std::sync::Arc;

use rayon::prelude::*;

use crate::attention::{attend_head, HeadSpec};
use crate::gguf::{GgmlType, GgufError, GgufFile, TensorInfo};
use crate::kernels::packed::PackKind;
use crate::kernels::{dequantize_row, isa, matmul, matmul_many, silu_mul, MatmulScratch, PackedMatrix, WeightView, QK};
use crate::kv::{KvDtype, KvPool, KvShape};
use crate::pack_cache::{self, Wanted};

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("unsupported architecture {0:?} (Hearth serves `llama` models)")]
    Architecture(String),
    #[error("tensor {name} has type {ty}, which Hearth cannot compute with (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K; requantize the file with llama-quantize, e.g. to Q4_K_M)")]
    TensorType { name: String, ty: GgmlType },
    #[error("tensor {name} has shape {got:?}, expected {want:?}")]
    Shape {
        name: String,
        got: Vec<u64>,
        want: Vec<u64>,
    },
    #[error("invalid model configuration: {0}")]
    Config(String),
}

/// Which elements of a head RoPE rotates together.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RopeLayout {
    /// Pairs (2i, 2i+1): llama.cpp's layout, whose converter permutes the Q/K rows.
    #[default]
    Adjacent,
    /// Pairs (i, i + d/2): Hugging Face's `rotate_half`, on unpermuted Q/K rows.
    Halves,
}

/// The metadata key a Hugging Face directory sets (to `"halves"`) when opened as a model
/// view; GGUF files never carry it.
pub const ROPE_LAYOUT_KEY: &str = "hearth.rope.layout";

/// Hyper-parameters, from the GGUF metadata.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    pub n_layers: usize,
    pub d_model: usize,
    pub n_ff: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub rope_dims: usize,
    pub rope_theta: f32,
    pub rms_eps: f32,
    pub context_length: usize,
    pub vocab_size: usize,
    pub rope_layout: RopeLayout,
}

impl LlamaConfig {
    pub fn from_gguf(g: &GgufFile) -> Result<Self, ModelError> {
        let arch = g.get_str("general.architecture")?;
        if arch != "llama" {
            return Err(ModelError::Architecture(arch.to_string()));
        }
        let u = |k: &str| g.get_u64(&format!("llama.{k}")).map(|v| v as usize);
        let n_heads = u("attention.head_count")?;
        let d_model = u("embedding_length")?;
        if n_heads == 0 || d_model % n_heads != 0 {
            return Err(ModelError::Config(format!(
                "{d_model} dims do not split into {n_heads} heads"
            )));
        }
        let head_dim = d_model / n_heads;
        let n_kv_heads = u("attention.head_count_kv").unwrap_or(n_heads);
        if n_kv_heads == 0 || n_heads % n_kv_heads != 0 {
            return Err(ModelError::Config(format!(
                "{n_heads} heads do not group into {n_kv_heads} KV heads"
            )));
        }
        let rope_dims = u("rope.dimension_count").unwrap_or(head_dim);
        if rope_dims > head_dim || rope_dims % 2 != 0 {
            return Err(ModelError::Config(format!(
                "rope dimension {rope_dims} invalid for head dim {head_dim}"
            )));
        }
        let vocab_size = match u("vocab_size") {
            Ok(v) => v,
            Err(_) => g.get_str_array("tokenizer.ggml.tokens")?.len(),
        };
        // Implausible sizes are a corrupt or hostile file, refused before any allocation.
        let n_layers = u("block_count")?;
        let n_ff = u("feed_forward_length")?;
        for (what, v, max) in [
            ("layers", n_layers, 1 << 12),
            ("embedding length", d_model, 1 << 17),
            ("feed-forward length", n_ff, 1 << 20),
            ("vocabulary", vocab_size, 1 << 22),
        ] {
            if v == 0 || v > max {
                return Err(ModelError::Config(format!("{what} {v} is out of range (1..={max})")));
            }
        }
        Ok(Self {
            n_layers,
            d_model,
            n_ff,
            n_heads,
            n_kv_heads,
            head_dim,
            rope_dims,
            rope_theta: g.get_f64("llama.rope.freq_base").unwrap_or(10000.0) as f32,
            rms_eps: g.get_f64("llama.attention.layer_norm_rms_epsilon").unwrap_or(1e-5) as f32,
            context_length: u("context_length").unwrap_or(2048),
            vocab_size,
            rope_layout: match g.get_str(ROPE_LAYOUT_KEY) {
                Ok("halves") => RopeLayout::Halves,
                Ok("adjacent") | Err(_) => RopeLayout::Adjacent,
                Ok(other) => return Err(ModelError::Config(format!("unknown RoPE layout {other:?}"))),
            },
        })
    }

    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
}

/// A weight matrix: where it is in the file, its shape, and its repacked copy (built at
/// load for the SIMD kernels; then the file's pages of it are no longer read).
#[derive(Debug, Clone)]
struct Matrix {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    shard: usize,
    offset: usize,
    len: usize,
    packed: Option<Arc<PackedMatrix>>,
}

#[derive(Debug)]
struct Layer {
    attn_norm: Vec<f32>,
    wq: Matrix,
    wk: Matrix,
    wv: Matrix,
    wo: Matrix,
    ffn_norm: Vec<f32>,
    w_gate: Matrix,
    w_up: Matrix,
    w_down: Matrix,
}

/// A loaded Llama model. Matrices stay in the memory-mapped file; only norms are copied.
pub struct LlamaModel {
    file: GgufFile,
    pub config: LlamaConfig,
    layers: Vec<Layer>,
    embed: Matrix,
    output: Matrix,
    output_norm: Vec<f32>,
    inv_freq: Vec<f32>,
    n_params: u64,
    packed_bytes: usize,
    repack_seconds: f64,
    packed_from_cache: bool,
    use_pack_cache: bool,
    /// How float matrices are computed (quantized to Q8_0 when repacked, or not).
    float_weights: FloatWeights,
}

impl std::fmt::Debug for LlamaModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LlamaModel")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

fn tensor<'a>(g: &'a GgufFile, name: &str) -> Result<&'a TensorInfo, ModelError> {
    g.tensor(name)
        .ok_or_else(|| ModelError::Gguf(GgufError::MissingTensor(name.to_string())))
}

fn matrix(g: &GgufFile, name: &str, rows: usize, cols: usize) -> Result<Matrix, ModelError> {
    let t = tensor(g, name)?;
    if t.dims != [cols as u64, rows as u64] {
        return Err(ModelError::Shape {
            name: name.into(),
            got: t.dims.clone(),
            want: vec![cols as u64, rows as u64],
        });
    }
    let (per_block, _) = t.ty.block_layout().ok_or(ModelError::TensorType {
        name: name.into(),
        ty: t.ty,
    })?;
    if !cols.is_multiple_of(per_block) || (per_block > 1 && !cols.is_multiple_of(QK)) {
        return Err(ModelError::Config(format!(
            "{name}: row length {cols} is not a whole number of blocks"
        )));
    }
    Ok(Matrix {
        ty: t.ty,
        rows,
        cols,
        shard: t.shard,
        offset: t.offset,
        len: t.len,
        packed: None,
    })
}

fn vector(g: &GgufFile, name: &str, n: usize) -> Result<Vec<f32>, ModelError> {
    let t = tensor(g, name)?;
    if t.dims != [n as u64] {
        return Err(ModelError::Shape {
            name: name.into(),
            got: t.dims.clone(),
            want: vec![n as u64],
        });
    }
    if t.ty.block_layout().is_none() {
        return Err(ModelError::TensorType {
            name: name.into(),
            ty: t.ty,
        });
    }
    let mut v = vec![0f32; n];
    dequantize_row(t.ty, g.tensor_data(t), &mut v);
    Ok(v)
}

/// A matrix's bytes in the file, with its repacked copy when it has one.
fn weight_view<'a>(file: &'a GgufFile, m: &'a Matrix) -> WeightView<'a> {
    let t = TensorInfo {
        name: String::new(),
        dims: vec![],
        ty: m.ty,
        offset: m.offset,
        len: m.len,
        shard: m.shard,
    };
    WeightView {
        ty: m.ty,
        rows: m.rows,
        cols: m.cols,
        data: file.tensor_data(&t),
        packed: m.packed.as_deref(),
    }
}

/// Reusable buffers for forward passes.
#[derive(Debug, Default)]
pub struct ForwardScratch {
    mm: MatmulScratch,
}

impl ForwardScratch {
    /// Float activations throughout (see [`MatmulScratch::precise`]): for numerics checks.
    pub fn precise() -> Self {
        let mut mm = MatmulScratch::default();
        mm.precise = true;
        Self { mm }
    }
}

fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    for (xr, or) in x.chunks_exact(w.len()).zip(out.chunks_exact_mut(w.len())) {
        let ms = xr.iter().map(|v| v * v).sum::<f32>() / w.len() as f32;
        let s = 1.0 / (ms + eps).sqrt();
        for ((o, v), g) in or.iter_mut().zip(xr).zip(w) {
            *o = v * s * g;
        }
    }
}

/// How float (F32, F16, BF16) weight matrices are computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FloatWeights {
    /// Quantized to Q8_0 at load (as llama.cpp's quantizer would) for the integer kernels:
    /// the speed of a Q8_0 GGUF (the pack cache keeps the result).
    #[default]
    Q8_0,
    /// Multiplied as floats (dequantize a row, then FMA): several times slower.
    Float,
}

impl FloatWeights {
    pub fn parse(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "q8_0" | "q8" => Ok(FloatWeights::Q8_0),
            "float" | "f32" => Ok(FloatWeights::Float),
            other => Err(format!("unknown float-weights mode {other:?} (q8_0 or float)")),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            FloatWeights::Q8_0 => "q8_0",
            FloatWeights::Float => "float",
        }
    }
}

impl LlamaModel {
    /// Loads with the pack cache on unless `HEARTH_PACK_CACHE=0`.
    pub fn load(file: GgufFile) -> Result<Self, ModelError> {
        Self::load_with(file, pack_cache::enabled_by_env())
    }

    /// Loads; `use_pack_cache`: map (or write) the on-disk cache of repacked weights.
    /// Float matrices are quantized to Q8_0 ([`FloatWeights::Q8_0`]).
    pub fn load_with(file: GgufFile, use_pack_cache: bool) -> Result<Self, ModelError> {
        Self::load_options(file, use_pack_cache, FloatWeights::Q8_0)
    }

    /// Loads; `float_weights`: how float (F32/F16/BF16) matrices are computed.
    pub fn load_options(file: GgufFile, use_pack_cache: bool, float_weights: FloatWeights) -> Result<Self, ModelError> {
        let mut m = Self::load_inner(file, use_pack_cache)?;
        m.float_weights = float_weights;
        if isa().is_simd() {
            let t = std::time::Instant::now();
            m.repack();
            m.repack_seconds = t.elapsed().as_secs_f64();
        }
        Ok(m)
    }

    /// Loads without repacking for the CPU kernels: for a backend that keeps its own copy
    /// of the weights (the CUDA backend reads them from [`LlamaModel::weights`]).
    pub fn load_unpacked(file: GgufFile) -> Result<Self, ModelError> {
        Self::load_inner(file, false)
    }

    fn load_inner(file: GgufFile, use_pack_cache: bool) -> Result<Self, ModelError> {
        let c = LlamaConfig::from_gguf(&file)?;
        let (d, kv) = (c.d_model, c.kv_dim());
        let mut layers = Vec::with_capacity(c.n_layers);
        for l in 0..c.n_layers {
            let n = |s: &str| format!("blk.{l}.{s}.weight");
            layers.push(Layer {
                attn_norm: vector(&file, &n("attn_norm"), d)?,
                wq: matrix(&file, &n("attn_q"), d, d)?,
                wk: matrix(&file, &n("attn_k"), kv, d)?,
                wv: matrix(&file, &n("attn_v"), kv, d)?,
                wo: matrix(&file, &n("attn_output"), d, d)?,
                ffn_norm: vector(&file, &n("ffn_norm"), d)?,
                w_gate: matrix(&file, &n("ffn_gate"), c.n_ff, d)?,
                w_up: matrix(&file, &n("ffn_up"), c.n_ff, d)?,
                w_down: matrix(&file, &n("ffn_down"), d, c.n_ff)?,
            });
        }
        let embed = matrix(&file, "token_embd.weight", c.vocab_size, d)?;
        // Tied embeddings: no `output.weight`, the logits reuse the embedding matrix.
        let output = match file.tensor("output.weight") {
            Some(_) => matrix(&file, "output.weight", c.vocab_size, d)?,
            None => embed.clone(),
        };
        let output_norm = vector(&file, "output_norm.weight", d)?;
        let inv_freq = (0..c.rope_dims / 2)
            .map(|i| c.rope_theta.powf(-((2 * i) as f32) / c.rope_dims as f32))
            .collect();
        let n_params = file.tensors.iter().map(|t| t.n_elements()).sum();
        Ok(Self {
            file,
            config: c,
            layers,
            embed,
            output,
            output_norm,
            inv_freq,
            n_params,
            packed_bytes: 0,
            repack_seconds: 0.0,
            packed_from_cache: false,
            use_pack_cache,
            float_weights: FloatWeights::Float,
        })
    }

    /// Repacks every quantized matrix for the SIMD kernels (see [`crate::kernels::packed`]),
    /// releasing each one's file pages once its copy exists, so that resident memory holds
    /// one copy of the weights, not two. The embedding stays in the file (rows are looked
    /// up, not multiplied); with tied embeddings its packed copy serves the logits.
    ///
    /// The packed layout is first looked for in the on-disk cache beside the model
    /// ([`crate::pack_cache`]; mapped, not copied); on a miss the matrices are repacked and
    /// the cache written for the next load. `HEARTH_PACK_CACHE=0` turns the cache off.
    fn repack(&mut self) {
        let file = &self.file;
        let embed = (self.embed.shard, self.embed.offset, self.embed.len);
        let is_embed = |m: &Matrix| (m.shard, m.offset) == (embed.0, embed.1);
        // Every quantized matrix, in a fixed order: each layer's seven, then the output.
        let mut ms: Vec<&mut Matrix> = Vec::new();
        for layer in &mut self.layers {
            ms.extend([
                &mut layer.wq,
                &mut layer.wk,
                &mut layer.wv,
                &mut layer.wo,
                &mut layer.w_gate,
                &mut layer.w_up,
                &mut layer.w_down,
            ]);
        }
        ms.push(&mut self.output);
        let mut wanted = Vec::new();
        let float_as_q8_0 = self.float_weights == FloatWeights::Q8_0;
        let kind_of = |ty: GgmlType| match PackKind::of(ty) {
            None if float_as_q8_0 && !ty.is_quantized() => Some(PackKind::Byte),
            k => k,
        };
        ms.retain(|m| match kind_of(m.ty) {
            Some(kind) if m.cols.is_multiple_of(QK * kind.blocks_per_super()) => {
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
            return;
        }
        let use_cache = self.use_pack_cache;
        let cached = if use_cache {
            pack_cache::load(&file.path, &wanted)
        } else {
            Err("turned off".into())
        };
        let mut total = 0;
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
                tracing::debug!(reason = %why, "pack cache not used: repacking");
                for m in ms.iter_mut() {
                    let w = weight_view(file, m);
                    let packed = match w.ty.is_quantized() {
                        true => PackedMatrix::pack(&w),
                        false => PackedMatrix::pack_float_as_q8_0(&w),
                    };
                    if let Some(p) = packed {
                        total += p.bytes().len();
                        m.packed = Some(Arc::new(p));
                        // This matrix's file pages leave the resident set at once, so that
                        // memory holds one copy of the weights, not two.
                        if !is_embed(m) {
                            file.release(m.shard, m.offset, m.len);
                        }
                    }
                }
                let all: Option<Vec<(Wanted, &PackedMatrix)>> = ms
                    .iter()
                    .zip(&wanted)
                    .map(|(m, w)| Some((*w, m.packed.as_deref()?)))
                    .collect();
                if let (true, Some(all)) = (use_cache, all) {
                    match pack_cache::store(&file.path, &all) {
                        Ok(p) => tracing::info!(path = %p.display(), "pack cache written for the next load"),
                        Err(e) => {
                            tracing::info!(error = %e, "pack cache not written (the model's directory is not writable?)")
                        }
                    }
                }
            }
        }
        // The embedding's rows are still read from the file for lookups (with tied
        // embeddings its packed copy serves the logits); they fault in as needed.
        file.release(embed.0, embed.1, embed.2);
        self.packed_bytes = total;
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

    /// Weight bytes one decode step reads: every layer's matrices and the output matrix
    /// once (their repacked copies where they have one; the embedding row is negligible).
    pub fn decode_weight_bytes(&self) -> usize {
        let size = |m: &Matrix| m.packed.as_ref().map_or(m.len, |p| p.bytes().len());
        let layers: usize = self
            .layers
            .iter()
            .flat_map(|l| [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down])
            .map(size)
            .sum();
        layers + size(&self.output)
    }

    pub fn n_params(&self) -> u64 {
        self.n_params
    }

    pub fn file(&self) -> &GgufFile {
        &self.file
    }

    fn view<'a>(&'a self, m: &'a Matrix) -> WeightView<'a> {
        weight_view(&self.file, m)
    }

    /// Every weight, as stored: for backends that keep their own copy (see
    /// [`LlamaModel::load_unpacked`]).
    pub fn weights(&self) -> ModelWeights<'_> {
        ModelWeights {
            layers: self
                .layers
                .iter()
                .map(|l| LayerWeights {
                    attn_norm: &l.attn_norm,
                    wq: self.view(&l.wq),
                    wk: self.view(&l.wk),
                    wv: self.view(&l.wv),
                    wo: self.view(&l.wo),
                    ffn_norm: &l.ffn_norm,
                    w_gate: self.view(&l.w_gate),
                    w_up: self.view(&l.w_up),
                    w_down: self.view(&l.w_down),
                })
                .collect(),
            embed: self.view(&self.embed),
            output: self.view(&self.output),
            tied: (self.output.shard, self.output.offset) == (self.embed.shard, self.embed.offset),
            output_norm: &self.output_norm,
            inv_freq: &self.inv_freq,
        }
    }

    /// `(cos, sin)` of every rotary frequency at each position, computed once per step and
    /// shared by every layer.
    fn rope_table(&self, positions: &[usize]) -> Vec<(f32, f32)> {
        let mut t = Vec::with_capacity(positions.len() * self.inv_freq.len());
        for &pos in positions {
            let p = pos as f32;
            t.extend(self.inv_freq.iter().map(|f| {
                let (s, c) = (p * f).sin_cos();
                (c, s)
            }));
        }
        t
    }

    /// Rotates each head's pairs by position, in the model's [`RopeLayout`].
    fn rope(&self, x: &mut [f32], n_heads: usize, table: &[(f32, f32)]) {
        let hd = self.config.head_dim;
        let width = n_heads * hd;
        let nf = self.inv_freq.len();
        if nf == 0 {
            return;
        }
        // Element i of a pair and its partner: (2i, 2i+1) or (i, i + nf).
        let (stride, partner) = match self.config.rope_layout {
            RopeLayout::Adjacent => (2, 1),
            RopeLayout::Halves => (1, nf),
        };
        for (row, cs) in x.chunks_exact_mut(width).zip(table.chunks_exact(nf)) {
            for head in row.chunks_exact_mut(hd) {
                for (i, &(c, s)) in cs.iter().enumerate() {
                    let (ia, ib) = (stride * i, stride * i + partner);
                    let (a, b) = (head[ia], head[ib]);
                    head[ia] = a * c - b * s;
                    head[ib] = a * s + b * c;
                }
            }
        }
    }

    /// Runs one step for many sequences at once: row `t` is token `tokens[t]` at position
    /// `positions[t]` of the sequence whose block table is `tables[t]`. Every weight row is
    /// read once for all rows. K/V of every row are written into the pool; attention for a
    /// row sees its own sequence up to its position. Returns logits (`vocab` floats) for
    /// each row in `logit_rows`, in that order.
    pub fn forward_batch(&self, b: &Batch<'_>, pool: &mut KvPool, s: &mut ForwardScratch) -> Vec<f32> {
        let c = &self.config;
        let (t, d, kvd, hd) = (b.tokens.len(), c.d_model, c.kv_dim(), c.head_dim);
        let bt = pool.block_tokens();
        assert_eq!(
            pool.shape(),
            self.kv_shape(bt),
            "the KV pool was built for another model shape"
        );
        let mut x = vec![0f32; t * d];
        let embed = self.view(&self.embed);
        for (row, &tok) in x.chunks_exact_mut(d).zip(b.tokens) {
            dequantize_row(embed.ty, embed.row(tok as usize), row);
        }
        let mut h = vec![0f32; t * d];
        let mut q = vec![0f32; t * d];
        let mut k = vec![0f32; t * kvd];
        let mut v = vec![0f32; t * kvd];
        let mut att = vec![0f32; t * d];
        let mut o = vec![0f32; t * d];
        let mut gate = vec![0f32; t * c.n_ff];
        let mut up = vec![0f32; t * c.n_ff];
        let group = c.n_heads / c.n_kv_heads;
        let rope = self.rope_table(b.positions);
        for (l, layer) in self.layers.iter().enumerate() {
            rms_norm(&x, &layer.attn_norm, c.rms_eps, &mut h);
            matmul_many(
                &[self.view(&layer.wq), self.view(&layer.wk), self.view(&layer.wv)],
                &h,
                &mut [&mut q, &mut k, &mut v],
                &mut s.mm,
            );
            self.rope(&mut q, c.n_heads, &rope);
            self.rope(&mut k, c.n_kv_heads, &rope);
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
            let pool_ref: &KvPool = pool;
            att.par_chunks_mut(hd)
                .enumerate()
                .for_each_init(Vec::new, |scores, (i, out)| {
                    let (r, head) = (i / c.n_heads, i % c.n_heads);
                    let spec = HeadSpec {
                        layer: l,
                        kv_head: head / group,
                        head_dim: hd,
                        kv_dim: kvd,
                    };
                    let qh = &q[r * d + head * hd..][..hd];
                    attend_head(qh, b.positions[r] + 1, b.tables[r], pool_ref, spec, out, scores);
                });
            matmul(&self.view(&layer.wo), &att, &mut o, &mut s.mm);
            x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
            rms_norm(&x, &layer.ffn_norm, c.rms_eps, &mut h);
            matmul_many(
                &[self.view(&layer.w_gate), self.view(&layer.w_up)],
                &h,
                &mut [&mut gate, &mut up],
                &mut s.mm,
            );
            silu_mul(&mut gate, &up);
            matmul(&self.view(&layer.w_down), &gate, &mut o, &mut s.mm);
            x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
        }
        if b.logit_rows.is_empty() {
            return Vec::new();
        }
        let mut last = vec![0f32; b.logit_rows.len() * d];
        for (dst, &r) in last.chunks_exact_mut(d).zip(b.logit_rows) {
            rms_norm(&x[r * d..(r + 1) * d], &self.output_norm, c.rms_eps, dst);
        }
        let mut logits = vec![0f32; b.logit_rows.len() * c.vocab_size];
        matmul(&self.view(&self.output), &last, &mut logits, &mut s.mm);
        logits
    }

    /// The KV cache's shape for this model.
    pub fn kv_shape(&self, block_tokens: usize) -> KvShape {
        KvShape {
            n_layers: self.config.n_layers,
            kv_heads: self.config.n_kv_heads,
            head_dim: self.config.head_dim,
            block_tokens,
        }
    }

    /// KV bytes per cached token.
    pub fn kv_bytes_per_token(&self, dtype: KvDtype) -> usize {
        KvPool::block_bytes(self.kv_shape(1), dtype)
    }
}

/// One layer's weights (see [`LlamaModel::weights`]).
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

/// A model's weights (see [`LlamaModel::weights`]).
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

/// One forward step's rows (see [`LlamaModel::forward_batch`]).
#[derive(Debug, Clone, Copy)]
pub struct Batch<'a> {
    pub tokens: &'a [u32],
    pub positions: &'a [usize],
    pub tables: &'a [&'a [u32]],
    pub logit_rows: &'a [usize],
}

/// One sequence over its own small paged cache: for tests, tools and numerics checks.
pub struct Session<'m> {
    model: &'m LlamaModel,
    pool: KvPool,
    table: Vec<u32>,
    len: usize,
    scratch: ForwardScratch,
}

impl<'m> Session<'m> {
    /// A session that can hold `capacity` tokens, with the engine's default KV storage
    /// (f32 with float activations, which are for numerics checks).
    pub fn new(model: &'m LlamaModel, capacity: usize, scratch: ForwardScratch) -> Self {
        let dtype = if scratch.mm.precise {
            KvDtype::F32
        } else {
            KvDtype::default()
        };
        Self::with_kv(model, capacity, scratch, dtype)
    }

    pub fn with_kv(model: &'m LlamaModel, capacity: usize, scratch: ForwardScratch, dtype: KvDtype) -> Self {
        let bt = hearth_protocol::DEFAULT_BLOCK_TOKENS;
        let blocks = capacity.div_ceil(bt);
        Self {
            model,
            pool: KvPool::new(model.kv_shape(bt), dtype, blocks),
            table: (0..blocks as u32).collect(),
            len: 0,
            scratch,
        }
    }

    /// Appends tokens and returns the logits after the last one.
    pub fn feed(&mut self, tokens: &[u32]) -> Vec<f32> {
        let positions: Vec<usize> = (self.len..self.len + tokens.len()).collect();
        let tables = vec![&self.table[..]; tokens.len()];
        let batch = Batch {
            tokens,
            positions: &positions,
            tables: &tables,
            logit_rows: &[tokens.len() - 1],
        };
        self.len += tokens.len();
        self.model.forward_batch(&batch, &mut self.pool, &mut self.scratch)
    }
}

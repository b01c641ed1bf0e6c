//! The Llama architecture (SmolLM2, Llama 2/3, TinyLlama, …) as stored in GGUF:
//! GQA attention, RMSNorm, SwiGLU, RoPE over adjacent pairs (GGUF permutes `attn_q`/`attn_k`
//! rows so that pairs (2i, 2i+1) rotate together), optionally tied embeddings.

use rayon::prelude::*;

use crate::gguf::{GgmlType, GgufError, GgufFile, TensorInfo};
use crate::kernels::{dequantize_row, dot_f32, matmul, MatmulScratch, WeightView, QK};
use crate::kv::KvCache;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("unsupported architecture {0:?} (Hearth serves `llama` models)")]
    Architecture(String),
    #[error("tensor {name} has type {ty:?}, which Hearth cannot compute with (F32, F16, BF16, Q4_0, Q4_1, Q8_0)")]
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
        Ok(Self {
            n_layers: u("block_count")?,
            d_model,
            n_ff: u("feed_forward_length")?,
            n_heads,
            n_kv_heads,
            head_dim,
            rope_dims,
            rope_theta: g.get_f64("llama.rope.freq_base").unwrap_or(10000.0) as f32,
            rms_eps: g
                .get_f64("llama.attention.layer_norm_rms_epsilon")
                .unwrap_or(1e-5) as f32,
            context_length: u("context_length").unwrap_or(2048),
            vocab_size,
        })
    }

    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
}

/// A weight matrix: where it is in the file and its shape.
#[derive(Debug, Clone)]
struct Matrix {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    offset: usize,
    len: usize,
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
        offset: t.offset,
        len: t.len,
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

impl LlamaModel {
    pub fn load(file: GgufFile) -> Result<Self, ModelError> {
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
        })
    }

    pub fn n_params(&self) -> u64 {
        self.n_params
    }

    pub fn file(&self) -> &GgufFile {
        &self.file
    }

    fn view(&self, m: &Matrix) -> WeightView<'_> {
        let t = TensorInfo {
            name: String::new(),
            dims: vec![],
            ty: m.ty,
            offset: m.offset,
            len: m.len,
        };
        WeightView {
            ty: m.ty,
            rows: m.rows,
            cols: m.cols,
            data: self.file.tensor_data(&t),
        }
    }

    /// Rotates adjacent pairs of each head by position (GGUF's RoPE layout).
    fn rope(&self, x: &mut [f32], n_heads: usize, pos0: usize) {
        let hd = self.config.head_dim;
        let width = n_heads * hd;
        for (t, row) in x.chunks_exact_mut(width).enumerate() {
            let p = (pos0 + t) as f32;
            let cs: Vec<(f32, f32)> = self
                .inv_freq
                .iter()
                .map(|f| (p * f).sin_cos())
                .map(|(s, c)| (c, s))
                .collect();
            for head in row.chunks_exact_mut(hd) {
                for (i, &(c, s)) in cs.iter().enumerate() {
                    let (a, b) = (head[2 * i], head[2 * i + 1]);
                    head[2 * i] = a * c - b * s;
                    head[2 * i + 1] = a * s + b * c;
                }
            }
        }
    }

    /// Causal attention of `t` new queries (positions `pos0..pos0+t`) over the cache.
    fn attention(&self, q: &[f32], kv: &KvCache, layer: usize, pos0: usize, out: &mut [f32]) {
        let c = &self.config;
        let (hd, h, group) = (c.head_dim, c.n_heads, c.n_heads / c.n_kv_heads);
        let kv_dim = c.kv_dim();
        let scale = 1.0 / (hd as f32).sqrt();
        let (keys, values) = kv.layer(layer);
        out.par_chunks_mut(hd).enumerate().for_each_init(
            Vec::new,
            |scores: &mut Vec<f32>, (i, o)| {
                let (t, head) = (i / h, i % h);
                let g = head / group;
                let qh = &q[t * h * hd + head * hd..][..hd];
                let n = pos0 + t + 1;
                scores.clear();
                scores.extend(
                    (0..n).map(|j| dot_f32(qh, &keys[j * kv_dim + g * hd..][..hd]) * scale),
                );
                let max = scores.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
                let mut sum = 0f32;
                for s in scores.iter_mut() {
                    *s = (*s - max).exp();
                    sum += *s;
                }
                o.fill(0.0);
                for (j, s) in scores.iter().enumerate() {
                    let w = s / sum;
                    for (ov, vv) in o.iter_mut().zip(&values[j * kv_dim + g * hd..][..hd]) {
                        *ov += w * vv;
                    }
                }
            },
        );
    }

    /// Runs `tokens` (appended after what `kv` holds) and returns the logits of the last one.
    pub fn forward(&self, tokens: &[u32], kv: &mut KvCache, s: &mut ForwardScratch) -> Vec<f32> {
        let c = &self.config;
        let (t, d, kvd) = (tokens.len(), c.d_model, c.kv_dim());
        let pos0 = kv.len();
        let mut x = vec![0f32; t * d];
        let embed = self.view(&self.embed);
        for (row, &tok) in x.chunks_exact_mut(d).zip(tokens) {
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
        for (l, layer) in self.layers.iter().enumerate() {
            rms_norm(&x, &layer.attn_norm, c.rms_eps, &mut h);
            matmul(&self.view(&layer.wq), &h, &mut q, &mut s.mm);
            matmul(&self.view(&layer.wk), &h, &mut k, &mut s.mm);
            matmul(&self.view(&layer.wv), &h, &mut v, &mut s.mm);
            self.rope(&mut q, c.n_heads, pos0);
            self.rope(&mut k, c.n_kv_heads, pos0);
            kv.append(l, &k, &v);
            self.attention(&q, kv, l, pos0, &mut att);
            matmul(&self.view(&layer.wo), &att, &mut o, &mut s.mm);
            x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
            rms_norm(&x, &layer.ffn_norm, c.rms_eps, &mut h);
            matmul(&self.view(&layer.w_gate), &h, &mut gate, &mut s.mm);
            matmul(&self.view(&layer.w_up), &h, &mut up, &mut s.mm);
            for (g, u) in gate.iter_mut().zip(&up) {
                *g = *g / (1.0 + (-*g).exp()) * u;
            }
            matmul(&self.view(&layer.w_down), &gate, &mut o, &mut s.mm);
            x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
        }
        kv.commit(t);
        let mut last = vec![0f32; d];
        rms_norm(&x[(t - 1) * d..], &self.output_norm, c.rms_eps, &mut last);
        let mut logits = vec![0f32; c.vocab_size];
        matmul(&self.view(&self.output), &last, &mut logits, &mut s.mm);
        logits
    }

    /// A fresh cache for one sequence.
    pub fn new_cache(&self) -> KvCache {
        KvCache::new(self.config.n_layers, self.config.kv_dim())
    }
}

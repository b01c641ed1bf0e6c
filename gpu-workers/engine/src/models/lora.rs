//! LoRA adapters: a fine-tune's low-rank updates `W' = W + s·B·A`, kept apart from the base
//! model's weights so that one step can serve sequences of many adapters and of the base
//! model together.
//!
//! The base model's matrices run once for every row of a step, as without adapters; then
//! each row that has an adapter adds its own low-rank term `s·B·(A·x)` to the projection's
//! output, reading its adapter's `A` and `B` (the CPU form of Punica's batched gather
//! matrix-vector product; `A` and `B` are small enough to stay in cache across the rows of
//! one adapter). The term is added where the projection's output is, before biases, norms
//! and RoPE, so the result is the merged model's up to float rounding (`tests/engine/lora.rs`).
//!
//! Two files are read:
//! * a PEFT directory: `adapter_config.json` (`peft_type: LORA`, `r`, `lora_alpha`,
//!   `use_rslora`) and `adapter_model.safetensors` (`base_model.model.<module>.lora_A.weight`
//!   of `r × in` and `lora_B.weight` of `out × r`, F32, F16 or BF16);
//! * a GGUF LoRA as llama.cpp's `convert_lora_to_gguf.py` writes it: `general.type =
//!   adapter`, `adapter.type = lora`, `adapter.lora.alpha`, and `blk.N.<tensor>.weight.lora_a`
//!   / `.lora_b` (GGUF dimensions `[in, r]` and `[r, out]`).
//!
//! The scale is `alpha / r` (`alpha / √r` with rsLoRA), with `r` each module's own rank
//! (so PEFT's `rank_pattern` needs nothing more), folded into `B` at load.
//!
//! Q and K rows are in the base model's order: a GGUF Llama's rows are permuted so that
//! RoPE pairs are adjacent (see [`crate::formats::hf`]); a PEFT adapter's `B` rows are permuted the
//! same way when it is applied to such a file, and a GGUF LoRA's un-permuted when applied to
//! a Hugging Face directory.
//!
//! Adapters apply to the attention's Q/K/V (or fused QKV) and output projections and to a
//! dense MLP's gate, up (or fused gate-up) and down projections. A module the base model
//! computes otherwise (latent attention, a mixture's experts) is refused by name, as are
//! PEFT's variants Hearth does not compute (DoRA, `fan_in_fan_out`, trained biases,
//! `modules_to_save`, `alpha_pattern`, embedding adapters).

use std::path::Path;

use rayon::prelude::*;
use safetensors::SafeTensors;
use serde_json::Value;

use crate::formats::gguf::{GgmlType, GgufFile, MetaValue};
use crate::kernels::{axpy, dequantize_row, lora_expand, lora_shrink};

use super::rope::RopeLayout;
use super::transformer::Model;

/// A projection an adapter may update.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Target {
    Q,
    K,
    V,
    /// Phi-3's fused Q, K and V.
    Qkv,
    O,
    Gate,
    /// The up projection, or Phi-3's fused gate-up.
    Up,
    Down,
}

impl Target {
    const ALL: [Target; 8] = [
        Target::Q,
        Target::K,
        Target::V,
        Target::Qkv,
        Target::O,
        Target::Gate,
        Target::Up,
        Target::Down,
    ];

    /// The GGUF tensor of a layer this target updates (`blk.N.<stem>.weight`).
    fn gguf_stem(self) -> &'static str {
        match self {
            Target::Q => "attn_q",
            Target::K => "attn_k",
            Target::V => "attn_v",
            Target::Qkv => "attn_qkv",
            Target::O => "attn_output",
            Target::Gate => "ffn_gate",
            Target::Up => "ffn_up",
            Target::Down => "ffn_down",
        }
    }

    fn from_gguf_stem(stem: &str) -> Option<Target> {
        Target::ALL.into_iter().find(|t| t.gguf_stem() == stem)
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Limits an adapter must be within to load.
#[derive(Debug, Clone, Copy)]
pub struct LoraLimits {
    /// The largest rank of any module.
    pub max_rank: usize,
    /// The largest adapter file (the PEFT weights, or the GGUF file).
    pub max_bytes: u64,
}

impl Default for LoraLimits {
    fn default() -> Self {
        Self {
            max_rank: 64,
            max_bytes: 512 << 20,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LoraError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// The files are not a LoRA adapter Hearth reads, or are damaged.
    #[error("{0}")]
    Invalid(String),
    /// The adapter was made for another model (names, shapes or architecture differ).
    #[error("the adapter does not fit this base model: {0}")]
    Mismatch(String),
    /// The adapter is beyond a configured limit.
    #[error("{0}")]
    Limit(String),
    /// A variant of LoRA Hearth does not compute.
    #[error("{0}")]
    Unsupported(String),
}

/// One module's update: `a` is `rank × cols`, `bt` is `scale·Bᵀ`, `rank × rows`, both
/// stored as f16 (bits): half the memory traffic of f32, the precision adapters are
/// trained in.
#[derive(Debug)]
struct Pair {
    cols: usize,
    rows: usize,
    a: Vec<u16>,
    bt: Vec<u16>,
}

/// A loaded adapter, checked against the base model it was loaded for.
#[derive(Debug)]
pub struct LoraAdapter {
    /// SHA-256 of the files read (hex): the adapter's identity, e.g. in cache namespaces.
    pub digest: String,
    /// The largest module rank.
    pub rank: usize,
    /// `(layer, target)` pairs updated.
    pub modules: usize,
    /// Per layer, per [`Target`].
    layers: Vec<[Option<Pair>; Target::ALL.len()]>,
}

impl LoraAdapter {
    /// Reads an adapter for `model`: a PEFT directory, or a GGUF LoRA file.
    pub fn open(path: &Path, model: &Model, limits: LoraLimits) -> Result<Self, LoraError> {
        if path.is_dir() {
            open_peft(path, model, limits)
        } else {
            open_gguf(path, model, limits)
        }
    }

    /// Bytes the adapter's matrices take in memory.
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .flatten()
            .flatten()
            .map(|p| (p.a.len() + p.bt.len()) * 2)
            .sum()
    }

    fn pair(&self, layer: usize, target: Target) -> Option<&Pair> {
        self.layers.get(layer)?[target.index()].as_ref()
    }
}

/// The most rows of one adapter computed together (more are split, to spread over threads).
const GROUP_ROWS: usize = 8;

/// The rows of a step grouped by adapter: each group reads its adapter's matrices once.
#[derive(Debug, Default)]
pub(super) struct LoraGroups<'a> {
    groups: Vec<(&'a LoraAdapter, Vec<usize>)>,
    rows: usize,
}

impl<'a> LoraGroups<'a> {
    /// Groups the rows of a step by their adapters (rows without one are left out).
    pub(super) fn new(adapters: &[Option<&'a LoraAdapter>]) -> Self {
        // Small steps are split finer, so that every thread has a group.
        let per_group = (adapters.len() / rayon::current_num_threads()).clamp(1, GROUP_ROWS);
        let mut groups: Vec<(&'a LoraAdapter, Vec<usize>)> = Vec::new();
        for (r, a) in adapters.iter().enumerate() {
            let Some(a) = *a else { continue };
            match groups
                .iter_mut()
                .rev()
                .find(|(g, rows)| std::ptr::eq(*g, a) && rows.len() < per_group)
            {
                Some((_, rows)) => rows.push(r),
                None => groups.push((a, vec![r])),
            }
        }
        Self {
            groups,
            rows: adapters.len(),
        }
    }

    /// The groups at one layer.
    pub(super) fn at(&self, layer: usize) -> LoraRows<'_> {
        LoraRows {
            groups: &self.groups,
            rows: self.rows,
            layer,
        }
    }
}

/// A step's rows grouped by adapter (see [`LoraGroups`]), at one layer.
#[derive(Debug, Clone, Copy)]
pub(super) struct LoraRows<'a> {
    groups: &'a [(&'a LoraAdapter, Vec<usize>)],
    rows: usize,
    layer: usize,
}

impl LoraRows<'_> {
    /// No adapter on any row.
    pub(super) const NONE: LoraRows<'static> = LoraRows {
        groups: &[],
        rows: 0,
        layer: 0,
    };

    /// `y[r] += s·B·(A·x[r])` for every row `r` whose adapter updates `target` at this
    /// layer; `x` and `y` hold the rows of the projection's input and output. Groups run in
    /// parallel; within one, each row of `A` and of `s·Bᵀ` is read once for all its rows.
    pub(super) fn apply(self, target: Target, x: &[f32], y: &mut [f32]) {
        let tasks: Vec<(&Pair, &[usize])> = self
            .groups
            .iter()
            .filter_map(|(a, rows)| Some((a.pair(self.layer, target)?, &rows[..])))
            .collect();
        if tasks.is_empty() {
            return;
        }
        let (cols, out) = (x.len() / self.rows, y.len() / self.rows);
        let deltas: Vec<Vec<f32>> = tasks
            .par_iter()
            .map(|(p, rows)| {
                debug_assert_eq!((p.cols, p.rows), (cols, out));
                let rank = p.a.len() / cols;
                let mut t = vec![0f32; rank];
                let mut d = vec![0f32; rows.len() * out];
                for (&r, d) in rows.iter().zip(d.chunks_exact_mut(out)) {
                    lora_shrink(&p.a, &x[r * cols..(r + 1) * cols], &mut t);
                    lora_expand(&p.bt, &t, d);
                }
                d
            })
            .collect();
        for ((_, rows), d) in tasks.iter().zip(deltas) {
            for (&r, d) in rows.iter().zip(d.chunks_exact(out)) {
                axpy(1.0, d, &mut y[r * out..(r + 1) * out]);
            }
        }
    }
}

/// An update as read: `a` (`rank × cols`) and `b` (`rows × rank`), row-major.
struct Raw {
    layer: usize,
    target: Target,
    a: Vec<f32>,
    b: Vec<f32>,
    rank: usize,
}

/// How the Q/K rows of an adapter's `B` are ordered (see the module's docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum QkOrder {
    /// Hugging Face's: each head's two halves rotated together.
    Halves,
    /// GGUF Llama's: RoPE's pairs adjacent.
    Adjacent,
}

/// The order of the base model's Q/K rows.
fn base_order(model: &Model) -> QkOrder {
    let c = &model.config;
    if c.mla.is_none() && c.rope_layout == RopeLayout::Adjacent {
        QkOrder::Adjacent
    } else {
        QkOrder::Halves
    }
}

/// Reorders each head's rows of `b` (`heads · hd` rows of `cols`) from one order to the
/// other: Hugging Face's row `h·d + s·d/2 + i` is GGUF Llama's `h·d + 2i + s`.
fn reorder(b: &[f32], cols: usize, hd: usize, from: QkOrder, to: QkOrder) -> Vec<f32> {
    if from == to {
        return b.to_vec();
    }
    let half = hd / 2;
    let mut out = vec![0f32; b.len()];
    for h in 0..b.len() / cols / hd {
        for i in 0..half {
            for s in 0..2 {
                let halves = (h * hd + s * half + i) * cols;
                let adjacent = (h * hd + 2 * i + s) * cols;
                let (src, dst) = match to {
                    QkOrder::Adjacent => (halves, adjacent),
                    QkOrder::Halves => (adjacent, halves),
                };
                out[dst..dst + cols].copy_from_slice(&b[src..src + cols]);
            }
        }
    }
    out
}

/// Checks every update against the base model and builds the adapter.
fn build(
    raws: Vec<Raw>,
    scale: impl Fn(usize) -> f32,
    order: QkOrder,
    model: &Model,
    limits: LoraLimits,
    digest: String,
) -> Result<LoraAdapter, LoraError> {
    let c = &model.config;
    if raws.is_empty() {
        return Err(LoraError::Invalid("the adapter updates no module".into()));
    }
    let mut layers: Vec<[Option<Pair>; Target::ALL.len()]> = (0..c.n_layers).map(|_| Default::default()).collect();
    let (mut max_rank, mut modules) = (0, 0);
    for r in raws {
        let name = format!("blk.{}.{}", r.layer, r.target.gguf_stem());
        if r.layer >= c.n_layers {
            return Err(LoraError::Mismatch(format!(
                "{name}: the base model has {} layers",
                c.n_layers
            )));
        }
        if r.rank == 0 || r.rank > limits.max_rank {
            return Err(LoraError::Limit(format!(
                "{name}: rank {} is outside 1..={} (the rank limit)",
                r.rank, limits.max_rank
            )));
        }
        let (rows, cols) = model
            .lora_target(r.layer, r.target)
            .map_err(|why| LoraError::Unsupported(format!("{name}: {why}")))?;
        if r.a.len() != r.rank * cols || r.b.len() != rows * r.rank {
            return Err(LoraError::Mismatch(format!(
                "{name}: A is {}×{} and B {}×{}, but the base matrix is {rows}×{cols}",
                r.rank,
                r.a.len() / r.rank,
                r.b.len() / r.rank,
                r.rank
            )));
        }
        if r.a.iter().chain(&r.b).any(|v| !v.is_finite()) {
            return Err(LoraError::Invalid(format!("{name}: the weights hold NaN or infinity")));
        }
        let slot = &mut layers[r.layer][r.target.index()];
        if slot.is_some() {
            return Err(LoraError::Invalid(format!("{name} is updated twice")));
        }
        let b = if matches!(r.target, Target::Q | Target::K) {
            reorder(&r.b, r.rank, c.head_dim, order, base_order(model))
        } else {
            r.b
        };
        let s = scale(r.rank);
        let mut bt = vec![0f32; rows * r.rank];
        for (o, row) in b.chunks_exact(r.rank).enumerate() {
            for (j, &v) in row.iter().enumerate() {
                bt[j * rows + o] = s * v;
            }
        }
        let (a, bt) = (to_f16(&r.a, &name)?, to_f16(&bt, &name)?);
        max_rank = max_rank.max(r.rank);
        modules += 1;
        *slot = Some(Pair { cols, rows, a, bt });
    }
    Ok(LoraAdapter {
        digest,
        rank: max_rank,
        modules,
        layers,
    })
}

/// Floats as f16 bits (SIMD where the CPU has it), refusing values beyond f16's range.
fn to_f16(v: &[f32], name: &str) -> Result<Vec<u16>, LoraError> {
    use half::slice::HalfFloatSliceExt;
    use half::vec::HalfFloatVecExt;
    let mut h = vec![half::f16::ZERO; v.len()];
    h.convert_from_f32_slice(v);
    if let Some(i) = h.iter().position(|x| !x.is_finite()) {
        return Err(LoraError::Invalid(format!(
            "{name}: a weight ({}) is beyond the f16 range adapters are kept in",
            v[i]
        )));
    }
    Ok(h.reinterpret_into())
}

fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> LoraError + '_ {
    move |source| LoraError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Refuses a file over the size limit.
fn within_size(path: &Path, limits: LoraLimits) -> Result<(), LoraError> {
    let len = std::fs::metadata(path).map_err(io_error(path))?.len();
    if len > limits.max_bytes {
        return Err(LoraError::Limit(format!(
            "{} is {len} bytes; the limit is {}",
            path.display(),
            limits.max_bytes
        )));
    }
    Ok(())
}

fn read(path: &Path, limits: LoraLimits) -> Result<Vec<u8>, LoraError> {
    within_size(path, limits)?;
    std::fs::read(path).map_err(io_error(path))
}

/// A float tensor's values (F32, F16, BF16 or a block type whose rows are whole blocks).
fn floats(ty: GgmlType, data: &[u8], n: usize, name: &str) -> Result<Vec<f32>, LoraError> {
    let (per_block, block_bytes) = ty
        .block_layout()
        .ok_or_else(|| LoraError::Unsupported(format!("{name} has type {ty}")))?;
    if !n.is_multiple_of(per_block) || data.len() != n / per_block * block_bytes {
        return Err(LoraError::Invalid(format!(
            "{name}: {} bytes for {n} {ty} values",
            data.len()
        )));
    }
    let mut out = vec![0f32; n];
    dequantize_row(ty, data, &mut out);
    Ok(out)
}

/// `(layer, target)` of a Hugging Face module path (`model.layers.3.self_attn.q_proj`).
fn hf_module(path: &str, model: &Model) -> Option<(usize, Target)> {
    let gguf = crate::formats::hf::names::gguf_name(&format!("{path}.weight"), model.config.arch)?;
    let (layer, stem) = gguf.strip_prefix("blk.")?.strip_suffix(".weight")?.split_once('.')?;
    Some((layer.parse().ok()?, Target::from_gguf_stem(stem)?))
}

fn open_peft(dir: &Path, model: &Model, limits: LoraLimits) -> Result<LoraAdapter, LoraError> {
    let config_path = dir.join("adapter_config.json");
    let weights_path = dir.join("adapter_model.safetensors");
    if !config_path.exists() {
        return Err(LoraError::Invalid(format!(
            "{}: no adapter_config.json (a PEFT LoRA directory has adapter_config.json and adapter_model.safetensors)",
            dir.display()
        )));
    }
    if !weights_path.exists() {
        return Err(LoraError::Invalid(format!(
            "{}: no adapter_model.safetensors (Hearth reads safetensors weights, not adapter_model.bin)",
            dir.display()
        )));
    }
    let config_bytes = read(&config_path, limits)?;
    let weights = read(&weights_path, limits)?;
    let cfg: Value =
        serde_json::from_slice(&config_bytes).map_err(|e| LoraError::Invalid(format!("adapter_config.json: {e}")))?;
    let peft_type = cfg.get("peft_type").and_then(Value::as_str).unwrap_or("");
    if peft_type != "LORA" {
        return Err(LoraError::Unsupported(format!(
            "adapter_config.json: peft_type is {peft_type:?}; Hearth serves LORA adapters"
        )));
    }
    let flag = |k: &str| cfg.get(k).and_then(Value::as_bool).unwrap_or(false);
    let nonempty = |k: &str| match cfg.get(k) {
        None | Some(Value::Null) => false,
        Some(Value::Object(m)) => !m.is_empty(),
        Some(Value::Array(a)) => !a.is_empty(),
        Some(_) => true,
    };
    for (refused, why) in [
        (flag("use_dora"), "use_dora (DoRA's magnitude vectors)"),
        (flag("fan_in_fan_out"), "fan_in_fan_out (transposed Conv1D weights)"),
        (nonempty("modules_to_save"), "modules_to_save (fully trained modules)"),
        (nonempty("alpha_pattern"), "alpha_pattern (per-module alphas)"),
    ] {
        if refused {
            return Err(LoraError::Unsupported(format!(
                "adapter_config.json sets {why}, which Hearth does not compute"
            )));
        }
    }
    if let Some(bias) = cfg.get("bias").and_then(Value::as_str) {
        if bias != "none" {
            return Err(LoraError::Unsupported(format!(
                "adapter_config.json: bias is {bias:?}; Hearth serves adapters without trained biases (\"none\")"
            )));
        }
    }
    let alpha = cfg
        .get("lora_alpha")
        .and_then(Value::as_f64)
        .ok_or_else(|| LoraError::Invalid("adapter_config.json: no numeric lora_alpha".into()))?;
    let rslora = flag("use_rslora");
    // Bounded before parsing: a crafted header of many tiny tensors costs nothing to refuse.
    hearth_protocol::adapter::check_safetensors_header(&weights).map_err(LoraError::Invalid)?;
    let st = SafeTensors::deserialize(&weights)
        .map_err(|e| LoraError::Invalid(format!("adapter_model.safetensors: {e}")))?;
    // Module path → [A, B], each as values and shape.
    type Half = Option<(Vec<f32>, Vec<usize>)>;
    let mut halves: std::collections::BTreeMap<String, [Half; 2]> = Default::default();
    for (name, view) in st.tensors() {
        let bad = |why: &str| LoraError::Invalid(format!("adapter_model.safetensors: tensor {name}: {why}"));
        let rest = name
            .strip_prefix("base_model.model.")
            .ok_or_else(|| bad("not under base_model.model. (not a PEFT LoRA tensor)"))?;
        let (module, which) = if let Some(m) = rest.strip_suffix(".lora_A.weight") {
            (m, 0)
        } else if let Some(m) = rest.strip_suffix(".lora_B.weight") {
            (m, 1)
        } else if rest.contains("lora_embedding_") || rest.contains("lora_magnitude_vector") {
            return Err(LoraError::Unsupported(format!(
                "tensor {name}: embedding adapters and DoRA are not computed by Hearth"
            )));
        } else {
            return Err(bad("neither lora_A.weight nor lora_B.weight"));
        };
        let ty = crate::formats::hf::import::ggml_type(view.dtype())
            .ok_or_else(|| bad(&format!("{:?} (Hearth reads F32, F16 and BF16)", view.dtype())))?;
        let shape = view.shape().to_vec();
        if shape.len() != 2 {
            return Err(bad(&format!("shape {shape:?} is not a matrix")));
        }
        let v = floats(ty, view.data(), shape[0] * shape[1], &name)?;
        halves.entry(module.to_string()).or_default()[which] = Some((v, shape));
    }
    let mut raws = Vec::with_capacity(halves.len());
    for (module, [a, b]) in halves {
        let (Some((a, sa)), Some((b, sb))) = (a, b) else {
            return Err(LoraError::Invalid(format!(
                "adapter_model.safetensors: {module} has only one of lora_A and lora_B"
            )));
        };
        let (layer, target) = hf_module(&module, model).ok_or_else(|| {
            LoraError::Unsupported(format!(
                "{module} is not a module Hearth applies adapters to in a {} model (the attention's q/k/v/o and a dense MLP's gate/up/down projections)",
                model.config.arch
            ))
        })?;
        if sa[0] != sb[1] {
            return Err(LoraError::Invalid(format!(
                "{module}: lora_A has rank {} but lora_B {}",
                sa[0], sb[1]
            )));
        }
        raws.push(Raw {
            layer,
            target,
            a,
            b,
            rank: sa[0],
        });
    }
    let digest = hearth_protocol::adapter::peft_digest(&config_bytes, &weights);
    let scale = move |r: usize| {
        if rslora {
            (alpha / (r as f64).sqrt()) as f32
        } else {
            (alpha / r as f64) as f32
        }
    };
    build(raws, scale, QkOrder::Halves, model, limits, digest)
}

fn open_gguf(path: &Path, model: &Model, limits: LoraLimits) -> Result<LoraAdapter, LoraError> {
    within_size(path, limits)?;
    let g = GgufFile::open(path).map_err(|e| LoraError::Invalid(format!("{}: {e}", path.display())))?;
    let text = |k: &str| g.get(k).and_then(MetaValue::as_str).unwrap_or("");
    if text("general.type") != "adapter" || text("adapter.type") != "lora" {
        return Err(LoraError::Invalid(format!(
            "{}: not a GGUF LoRA (general.type {:?}, adapter.type {:?}; llama.cpp's convert_lora_to_gguf.py writes adapter/lora)",
            path.display(),
            text("general.type"),
            text("adapter.type")
        )));
    }
    let arch = text("general.architecture");
    let base = model.config.arch.family().gguf.unwrap_or("llama");
    if arch != base {
        return Err(LoraError::Mismatch(format!(
            "the adapter is for a {arch:?} model; the base model is {base:?}"
        )));
    }
    let digest = hearth_protocol::adapter::gguf_digest(&read(path, limits)?);
    let alpha = g.get_f64("adapter.lora.alpha").unwrap_or(0.0);
    let mut raws = Vec::new();
    for t in &g.tensors {
        let Some(stem) = t.name.strip_suffix(".weight.lora_a") else {
            if t.name.ends_with(".weight.lora_b") {
                continue;
            }
            return Err(LoraError::Invalid(format!(
                "tensor {} is not a LoRA tensor (…weight.lora_a or …weight.lora_b)",
                t.name
            )));
        };
        let b_name = format!("{stem}.weight.lora_b");
        let bt = g
            .tensor(&b_name)
            .ok_or_else(|| LoraError::Invalid(format!("{} has no {b_name}", t.name)))?;
        let parsed = stem
            .strip_prefix("blk.")
            .and_then(|r| r.split_once('.'))
            .and_then(|(l, s)| Some((l.parse::<usize>().ok()?, Target::from_gguf_stem(s)?)));
        let (layer, target) = parsed.ok_or_else(|| {
            LoraError::Unsupported(format!(
                "{} is not a tensor Hearth applies adapters to (attn_q/k/v/qkv/output, ffn_gate/up/down)",
                t.name
            ))
        })?;
        // GGUF dimensions: A is [in, rank], B is [rank, out].
        let (&[cols, rank], &[rank_b, rows]) = (t.dims.as_slice(), bt.dims.as_slice()) else {
            return Err(LoraError::Invalid(format!("{stem}: LoRA tensors must be matrices")));
        };
        if rank != rank_b {
            return Err(LoraError::Invalid(format!(
                "{stem}: lora_a has rank {rank} but lora_b {rank_b}"
            )));
        }
        let (rank, rows, cols) = (rank as usize, rows as usize, cols as usize);
        raws.push(Raw {
            layer,
            target,
            a: floats(t.ty, g.tensor_data(t), rank * cols, &t.name)?,
            b: floats(bt.ty, g.tensor_data(bt), rows * rank, &b_name)?,
            rank,
        });
    }
    // llama.cpp's converter permutes a Llama's Q/K rows, as for the model itself.
    let order = if arch == "llama" {
        QkOrder::Adjacent
    } else {
        QkOrder::Halves
    };
    let scale = move |r: usize| if alpha == 0.0 { 1.0 } else { (alpha / r as f64) as f32 };
    build(raws, scale, order, model, limits, digest)
}

/// The digest [`LoraAdapter::digest`] will have, without loading the adapter: what an
/// adapter store records when the files are uploaded.
pub fn digest(path: &Path) -> Result<String, LoraError> {
    let read = |p: &Path| std::fs::read(p).map_err(io_error(p));
    if path.is_dir() {
        let config = read(&path.join("adapter_config.json"))?;
        Ok(hearth_protocol::adapter::peft_digest(
            &config,
            &read(&path.join("adapter_model.safetensors"))?,
        ))
    } else {
        Ok(hearth_protocol::adapter::gguf_digest(&read(path)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qk_reorder_round_trips_and_matches_the_hf_export() {
        // 2 heads of 4 rows, 3 columns; row r's values are r·10 + column.
        let b: Vec<f32> = (0..8).flat_map(|r| (0..3).map(move |c| (r * 10 + c) as f32)).collect();
        let adj = reorder(&b, 3, 4, QkOrder::Halves, QkOrder::Adjacent);
        // Adjacent row h·4 + 2i + s comes from Hugging Face row h·4 + s·2 + i.
        let rows: Vec<f32> = adj.chunks(3).map(|r| r[0] / 10.0).collect();
        assert_eq!(rows, [0.0, 2.0, 1.0, 3.0, 4.0, 6.0, 5.0, 7.0]);
        assert_eq!(reorder(&adj, 3, 4, QkOrder::Adjacent, QkOrder::Halves), b);
    }
}

//! A dense transformer's hyper-parameters, read from GGUF metadata (a Hugging Face
//! directory is presented as the same keys, see [`crate::formats::hf`]): what every family shares
//! ([`ModelConfig`]) and what the families choose differently ([`BlockSpec`]). The family
//! files read their own keys into the latter.

use std::fmt;

use crate::formats::gguf::{GgufError, GgufFile, MetaValue};
use crate::kv::pool::{KvDtype, KvPool, KvShape};

use super::rope::{RopeLayout, RopeScaling, RopeScalingKind};
use super::{Arch, ModelError};

/// The metadata key a Hugging Face directory sets (to `"halves"`) when opened as a model
/// view of a `llama` model; GGUF files never carry it.
pub const ROPE_LAYOUT_KEY: &str = "hearth.rope.layout";

/// The metadata key a Hugging Face directory of a Gemma model sets (to 1): its norm weights
/// are `w` where the model multiplies by `1 + w`, which GGUF files store summed.
pub const NORM_SHIFT_KEY: &str = "hearth.norm.shift";

/// The longest context Hearth serves (the wire carries it as a `u32`).
pub const MAX_CONTEXT: usize = 1 << 24;

/// The gated MLP's activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Activation {
    /// SwiGLU: `silu(gate) · up`.
    #[default]
    Silu,
    /// GeGLU with GELU's tanh approximation: `gelu(gate) · up` (Gemma).
    GeluTanh,
}

/// What differs between the dense families' blocks. Everything here is read once from the
/// file; optional tensors (biases, fused projections) are found at load.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockSpec {
    /// RMSNorm over each head of Q and K before RoPE (Qwen3, Gemma 3).
    pub qk_norm: bool,
    /// RMSNorm on the attention and MLP outputs before the residual add (Gemma 2/3).
    pub post_norms: bool,
    pub activation: Activation,
    /// Embeddings multiplied by this (Gemma: √d).
    pub embed_scale: Option<f32>,
    /// Attention scores are `scale · q·k` (default 1/√head_dim).
    pub attn_scale: f32,
    /// Attention scores soft-capped: `cap · tanh(s / cap)` (Gemma 2).
    pub attn_softcap: Option<f32>,
    /// Logits soft-capped the same way (Gemma 2).
    pub final_softcap: Option<f32>,
    /// Windowed layers attend to the last `window` positions, their own included.
    pub sliding_window: Option<usize>,
    /// Which layers are windowed (all of them when a window is set and this is empty).
    pub swa_layers: Vec<bool>,
    /// RoPE base of windowed layers, which are never scaled (Gemma 2/3's local layers).
    pub swa_rope_theta: Option<f32>,
}

impl Default for BlockSpec {
    fn default() -> Self {
        Self {
            qk_norm: false,
            post_norms: false,
            activation: Activation::Silu,
            embed_scale: None,
            attn_scale: 0.0,
            attn_softcap: None,
            final_softcap: None,
            sliding_window: None,
            swa_layers: Vec::new(),
            swa_rope_theta: None,
        }
    }
}

/// Hyper-parameters, from the GGUF metadata.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    pub n_layers: usize,
    pub d_model: usize,
    pub n_ff: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub rope_dims: usize,
    pub rope_theta: f32,
    pub rope_layout: RopeLayout,
    /// As the file says, or as the operator overrides it.
    pub rope_scaling: RopeScaling,
    pub rms_eps: f32,
    /// The context the model serves by default: the file's, or stretched by an operator's
    /// RoPE scaling ([`ModelConfig::set_rope_scaling`]).
    pub context_length: usize,
    pub vocab_size: usize,
    pub block: BlockSpec,
    /// Added to every norm weight at load ([`NORM_SHIFT_KEY`]).
    pub norm_shift: f32,
    /// Mixture-of-experts MLPs (Mixtral, Qwen3-MoE, DeepSeek-V2/V3).
    pub moe: Option<MoeSpec>,
    /// Multi-head latent attention (DeepSeek-V2/V3, Kimi K2).
    pub mla: Option<MlaSpec>,
}

/// How a mixture-of-experts layer scores its router's logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gating {
    /// Softmax over every expert (Mixtral, Qwen3-MoE, DeepSeek-V2).
    Softmax,
    /// A sigmoid per expert (DeepSeek-V3, Kimi K2), chosen with a per-expert bias.
    Sigmoid,
}

/// A mixture-of-experts MLP, as `{arch}.expert_*` say (llama.cpp's keys).
#[derive(Debug, Clone, PartialEq)]
pub struct MoeSpec {
    /// Routed experts per layer.
    pub experts: usize,
    /// Experts each token uses.
    pub used: usize,
    /// Shared experts every token runs (DeepSeek), as one MLP of `shared · ff_expert` rows.
    pub shared: usize,
    /// Each expert's feed-forward width.
    pub ff_expert: usize,
    pub gating: Gating,
    /// The chosen experts' weights divided by their sum.
    pub norm_weights: bool,
    /// The chosen experts' weights multiplied by this (DeepSeek's routed scaling factor).
    pub weights_scale: f32,
    /// Group-limited routing (DeepSeek-V3): experts fall into `groups` groups, a group
    /// scores the sum of its best two, and only the best `groups_used` groups are chosen
    /// from. 0 or 1: no groups.
    pub groups: usize,
    pub groups_used: usize,
    /// The first layers keep a dense MLP (`leading_dense_block_count`).
    pub leading_dense: usize,
}

impl MoeSpec {
    /// The file's `expert_*` keys (None: the file has no experts). `ff_default` is the
    /// experts' width where the file does not say.
    pub fn read(h: &Hparams<'_>, n_layers: usize, ff_default: usize) -> Result<Option<Self>, ModelError> {
        let Some(experts) = h.opt_u("expert_count")?.filter(|&n| n > 0) else {
            return Ok(None);
        };
        let bad = |m: String| Err(ModelError::Config(m));
        let used = h.u("expert_used_count")?;
        let gating = match h.opt_u("expert_gating_func")? {
            None | Some(0) | Some(1) => Gating::Softmax,
            Some(2) => Gating::Sigmoid,
            Some(other) => {
                return bad(format!(
                    "expert gating function {other} is not supported (1: softmax, 2: sigmoid)"
                ))
            }
        };
        let spec = Self {
            experts,
            used,
            shared: h.opt_u("expert_shared_count")?.unwrap_or(0),
            ff_expert: h
                .opt_u("expert_feed_forward_length")?
                .filter(|&f| f > 0)
                .unwrap_or(ff_default),
            gating,
            norm_weights: h.opt_bool("expert_weights_norm")?.unwrap_or(false),
            weights_scale: h.opt_f("expert_weights_scale")?.filter(|&s| s != 0.0).unwrap_or(1.0),
            groups: h.opt_u("expert_group_count")?.unwrap_or(0),
            groups_used: h.opt_u("expert_group_used_count")?.unwrap_or(0),
            leading_dense: h.opt_u("leading_dense_block_count")?.unwrap_or(0),
        };
        if experts > 1 << 12 || used == 0 || used > experts || spec.shared > 64 {
            return bad(format!(
                "{used} of {experts} experts ({} shared) is out of range",
                spec.shared
            ));
        }
        if spec.ff_expert == 0 || spec.ff_expert > 1 << 20 || spec.leading_dense > n_layers {
            return bad(format!(
                "expert width {} / {} leading dense layers of {n_layers} out of range",
                spec.ff_expert, spec.leading_dense
            ));
        }
        if !(spec.weights_scale.is_finite() && spec.weights_scale > 0.0) {
            return bad(format!(
                "expert weights scale {} is not a positive number",
                spec.weights_scale
            ));
        }
        if spec.groups > 1
            && (experts % spec.groups != 0
                || spec.groups_used == 0
                || spec.groups_used >= spec.groups
                || spec.groups_used * (experts / spec.groups) < used)
        {
            return bad(format!(
                "{} expert groups ({} used) do not divide {experts} experts choosing {used}",
                spec.groups, spec.groups_used
            ));
        }
        Ok(Some(spec))
    }

    /// Whether layer `l` routes to experts.
    pub fn is_moe_layer(&self, l: usize) -> bool {
        l >= self.leading_dense
    }
}

/// Multi-head latent attention: keys and values are decompressed per head from one latent
/// vector per position, which is all the KV cache stores (with the shared RoPE key).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MlaSpec {
    /// Rank of the queries' compression (0: queries projected directly, the Lite models).
    pub q_lora_rank: usize,
    /// Width of the latent vector the cache stores per position.
    pub kv_lora_rank: usize,
    /// Per-head query/key dims without RoPE, and with it (shared by every head's key).
    pub qk_nope: usize,
    pub qk_rope: usize,
    /// Per-head value dims.
    pub v_head: usize,
    /// YaRN's `mscale_all_dim` (0: none), which scales the scores (see
    /// [`ModelConfig::mla_score_scale`]).
    pub yarn_log_mul: f32,
}

impl MlaSpec {
    /// What the cache stores per position and layer: the latent vector, then the RoPE key.
    pub fn latent_dim(&self) -> usize {
        self.kv_lora_rank + self.qk_rope
    }
}

/// Reads `{arch}.*` keys: missing optional keys are `None`, present ones of the wrong type
/// an error.
pub struct Hparams<'a> {
    pub file: &'a GgufFile,
    pub prefix: &'a str,
}

impl Hparams<'_> {
    fn key(&self, k: &str) -> String {
        format!("{}.{k}", self.prefix)
    }

    pub fn get(&self, k: &str) -> Option<&MetaValue> {
        self.file.get(&self.key(k))
    }

    pub fn u(&self, k: &str) -> Result<usize, ModelError> {
        Ok(self.file.get_u64(&self.key(k))? as usize)
    }

    pub fn opt_u(&self, k: &str) -> Result<Option<usize>, ModelError> {
        match self.get(k) {
            None => Ok(None),
            Some(_) => self.u(k).map(Some),
        }
    }

    pub fn opt_f(&self, k: &str) -> Result<Option<f32>, ModelError> {
        match self.get(k) {
            None => Ok(None),
            Some(_) => Ok(Some(self.file.get_f64(&self.key(k))? as f32)),
        }
    }

    pub fn opt_bool(&self, k: &str) -> Result<Option<bool>, ModelError> {
        match self.get(k) {
            None => Ok(None),
            Some(MetaValue::Bool(b)) => Ok(Some(*b)),
            Some(other) => other.as_u64().map(|v| Some(v != 0)).ok_or_else(|| {
                ModelError::Gguf(GgufError::KeyType {
                    key: self.key(k),
                    expected: "a boolean",
                })
            }),
        }
    }

    pub fn opt_str(&self, k: &str) -> Result<Option<&str>, ModelError> {
        match self.get(k) {
            None => Ok(None),
            Some(_) => Ok(Some(self.file.get_str(&self.key(k))?)),
        }
    }

    /// `attention.sliding_window_pattern`: a period `p` (every `p`-th layer global, as
    /// llama.cpp's `set_swa_pattern`), or one flag per layer; `default` when absent.
    pub fn swa_pattern(&self, n_layers: usize, default: usize) -> Result<Vec<bool>, ModelError> {
        let k = "attention.sliding_window_pattern";
        let period = match self.get(k) {
            Some(MetaValue::Array(flags)) => {
                if flags.len() < n_layers {
                    return Err(ModelError::Config(format!(
                        "{}: {} flags for {n_layers} layers",
                        self.key(k),
                        flags.len()
                    )));
                }
                return flags
                    .iter()
                    .take(n_layers)
                    .map(|f| match f {
                        MetaValue::Bool(b) => Ok(*b),
                        other => other.as_u64().map(|v| v != 0).ok_or_else(|| {
                            ModelError::Gguf(GgufError::KeyType {
                                key: self.key(k),
                                expected: "an array of booleans",
                            })
                        }),
                    })
                    .collect();
            }
            Some(_) => self.u(k)?,
            None => default,
        };
        Ok((0..n_layers).map(|l| period == 0 || l % period < period - 1).collect())
    }
}

impl ModelConfig {
    /// The configuration of a model file, by its architecture's family.
    pub fn from_gguf(g: &GgufFile) -> Result<Self, ModelError> {
        let name = g.get_str("general.architecture")?;
        let arch = Arch::from_gguf(name).ok_or_else(|| ModelError::Architecture(name.to_string()))?;
        let h = Hparams { file: g, prefix: name };
        let mut c = Self::common(&h, arch)?;
        (arch.family().configure)(&h, &mut c)?;
        c.check()?;
        Ok(c)
    }

    /// What every family reads the same way.
    fn common(h: &Hparams<'_>, arch: Arch) -> Result<Self, ModelError> {
        let g = h.file;
        let n_heads = h.u("attention.head_count")?;
        let d_model = h.u("embedding_length")?;
        if n_heads == 0 || (d_model % n_heads != 0 && h.get("attention.key_length").is_none()) {
            return Err(ModelError::Config(format!(
                "{d_model} dims do not split into {n_heads} heads"
            )));
        }
        let head_dim = h.opt_u("attention.key_length")?.unwrap_or(d_model / n_heads);
        if let Some(v) = h.opt_u("attention.value_length")? {
            // Latent-attention files declare the latent's widths here (the family reads them).
            if v != head_dim && arch != Arch::Deepseek2 {
                return Err(ModelError::Config(format!(
                    "value heads of {v} differ from key heads of {head_dim} (only latent-attention models do that)"
                )));
            }
        }
        let n_kv_heads = h.opt_u("attention.head_count_kv")?.unwrap_or(n_heads);
        if n_kv_heads == 0 || n_heads % n_kv_heads != 0 {
            return Err(ModelError::Config(format!(
                "{n_heads} heads do not group into {n_kv_heads} KV heads"
            )));
        }
        let rope_dims = h.opt_u("rope.dimension_count")?.unwrap_or(head_dim);
        if rope_dims > head_dim || rope_dims % 2 != 0 {
            return Err(ModelError::Config(format!(
                "rope dimension {rope_dims} invalid for head dim {head_dim}"
            )));
        }
        let vocab_size = match h.opt_u("vocab_size")? {
            Some(v) => v,
            None => g.get_str_array("tokenizer.ggml.tokens")?.len(),
        };
        // Implausible sizes are a corrupt or hostile file, refused before any allocation.
        let n_layers = h.u("block_count")?;
        let n_ff = h.u("feed_forward_length")?;
        for (what, v, max) in [
            ("layers", n_layers, 1 << 12),
            ("embedding length", d_model, 1 << 17),
            ("feed-forward length", n_ff, 1 << 20),
            ("vocabulary", vocab_size, 1 << 22),
            ("head dimension", head_dim, 1 << 10),
            ("heads", n_heads, 1 << 12),
            ("KV heads", n_kv_heads, 1 << 12),
        ] {
            if v == 0 || v > max {
                return Err(ModelError::Config(format!("{what} {v} is out of range (1..={max})")));
            }
        }
        // The file's own context, as llama.cpp takes it (a file that declares scaling may
        // serve up to its stretched context when asked: see `context_limit`).
        let context_length = h.opt_u("context_length")?.unwrap_or(2048).clamp(1, MAX_CONTEXT);
        let rope_scaling = Self::file_rope_scaling(h)?;
        let rope_theta = h.opt_f("rope.freq_base")?.unwrap_or(10000.0);
        if !(rope_theta.is_finite() && rope_theta > 1.0) {
            return Err(ModelError::Config(format!(
                "RoPE base {rope_theta} is not a number above 1"
            )));
        }
        Ok(Self {
            arch,
            n_layers,
            d_model,
            n_ff,
            n_heads,
            n_kv_heads,
            head_dim,
            rope_dims,
            rope_theta,
            rope_layout: match g.get_str(ROPE_LAYOUT_KEY) {
                Ok("halves") => RopeLayout::Halves,
                Ok("adjacent") | Err(_) => RopeLayout::Adjacent,
                Ok(other) => return Err(ModelError::Config(format!("unknown RoPE layout {other:?}"))),
            },
            rope_scaling,
            rms_eps: h.opt_f("attention.layer_norm_rms_epsilon")?.unwrap_or(1e-5),
            context_length,
            vocab_size,
            norm_shift: g.get_f64(NORM_SHIFT_KEY).map_or(0.0, |v| v as f32),
            block: BlockSpec {
                attn_scale: 1.0 / (head_dim as f32).sqrt(),
                ..BlockSpec::default()
            },
            moe: None,
            mla: None,
        })
    }

    /// `rope.scaling.*` as llama.cpp's converter writes them.
    fn file_rope_scaling(h: &Hparams<'_>) -> Result<RopeScaling, ModelError> {
        // llama.cpp reads an absent type as `linear` (of factor 1 unless a factor is given).
        let kind = match h.opt_str("rope.scaling.type")? {
            None => RopeScalingKind::Linear,
            Some("none") => RopeScalingKind::None,
            Some("linear") => RopeScalingKind::Linear,
            Some("yarn") => RopeScalingKind::Yarn,
            Some("llama3") => RopeScalingKind::Llama3,
            Some("longrope") => RopeScalingKind::LongRope,
            Some(other) => {
                return Err(ModelError::Config(format!(
                    "RoPE scaling {other:?} is not supported (none, linear, llama3, yarn, longrope)"
                )))
            }
        };
        let factor = h
            .opt_f("rope.scaling.factor")?
            .or(h.opt_f("rope.scale_linear")?)
            .unwrap_or(1.0);
        let d = RopeScaling::default();
        let s = RopeScaling {
            kind: if factor == 1.0 && kind == RopeScalingKind::Linear {
                RopeScalingKind::None
            } else {
                kind
            },
            factor,
            original_context: h.opt_u("rope.scaling.original_context_length")?.unwrap_or(0),
            low_freq_factor: h.opt_f("rope.scaling.low_freq_factor")?.unwrap_or(d.low_freq_factor),
            high_freq_factor: h.opt_f("rope.scaling.high_freq_factor")?.unwrap_or(d.high_freq_factor),
            beta_fast: h.opt_f("rope.scaling.yarn_beta_fast")?.unwrap_or(d.beta_fast),
            beta_slow: h.opt_f("rope.scaling.yarn_beta_slow")?.unwrap_or(d.beta_slow),
            attn_factor: h.opt_f("rope.scaling.attn_factor")?.unwrap_or(1.0),
        };
        if !(s.factor.is_finite() && s.factor >= 1.0 && s.attn_factor.is_finite() && s.attn_factor > 0.0) {
            return Err(ModelError::Config(format!(
                "RoPE scaling factor {} / attention factor {} out of range",
                s.factor, s.attn_factor
            )));
        }
        if !(s.low_freq_factor > 0.0
            && s.high_freq_factor > s.low_freq_factor
            && s.beta_fast > s.beta_slow
            && s.beta_slow > 0.0)
        {
            return Err(ModelError::Config(format!(
                "RoPE scaling parameters out of range (frequency factors {} < {}, YaRN betas {} > {} > 0 expected)",
                s.low_freq_factor, s.high_freq_factor, s.beta_fast, s.beta_slow
            )));
        }
        Ok(s)
    }

    /// Applies an operator's RoPE scaling in place of the file's: the context grows to the
    /// original context times the factor.
    pub fn set_rope_scaling(&mut self, mut s: RopeScaling) {
        if s.original_context == 0 {
            // The trained context: the file's original (if it declares one) or its own.
            s.original_context = match self.rope_scaling.original_context {
                0 => self.context_length,
                o => o,
            };
        }
        self.context_length = s.stretched(self.context_length).clamp(1, MAX_CONTEXT);
        self.rope_scaling = s;
        self.block.attn_scale = self.mla_score_scale();
    }

    /// The most context this model may serve: its own, or, when the file declares linear
    /// or YaRN scaling of an original context (Qwen2.5: 32k × 4), the stretched one.
    pub fn context_limit(&self) -> usize {
        let s = &self.rope_scaling;
        match s.kind {
            RopeScalingKind::Linear | RopeScalingKind::Yarn if s.original_context > 0 => {
                self.context_length.max(s.stretched(self.context_length))
            }
            _ => self.context_length,
        }
        .min(MAX_CONTEXT)
    }

    /// The context to serve: `requested` (at least 1), or the model's. Past the model's
    /// limit it is refused, naming the RoPE scaling that would reach it.
    pub fn served_context(&self, requested: Option<usize>) -> Result<usize, ModelError> {
        match requested {
            None => Ok(self.context_length),
            Some(n) if n <= self.context_limit() => Ok(n.max(1)),
            Some(n) => Err(ModelError::Config(format!(
                "a context of {n} tokens exceeds the model's {} (RoPE scaling {}); stretch it with --rope-scaling (catalogue `rope_scaling`), e.g. yarn:{}",
                self.context_limit(),
                self.rope_scaling,
                n.div_ceil(self.context_length.max(1)).max(2)
            ))),
        }
    }

    fn check(&self) -> Result<(), ModelError> {
        if let Some(w) = self.block.sliding_window {
            if w == 0 {
                return Err(ModelError::Config("a sliding window of 0 tokens".into()));
            }
        }
        if !self.block.swa_layers.is_empty() && self.block.swa_layers.len() != self.n_layers {
            return Err(ModelError::Config(format!(
                "{} sliding-window flags for {} layers",
                self.block.swa_layers.len(),
                self.n_layers
            )));
        }
        for (what, v) in [
            ("attention scale", Some(self.block.attn_scale)),
            ("attention soft-cap", self.block.attn_softcap),
            ("final soft-cap", self.block.final_softcap),
            ("embedding scale", self.block.embed_scale),
        ] {
            if v.is_some_and(|v| !(v.is_finite() && v > 0.0)) {
                return Err(ModelError::Config(format!("{what} {v:?} is not a positive number")));
            }
        }
        Ok(())
    }

    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// Width of the attention's queries (and of its output): `n_heads · head_dim`, which
    /// need not be `d_model` (Gemma, Qwen3).
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }

    /// Latent attention's score scale, as llama.cpp computes it for `deepseek2`: RoPE
    /// rotates at magnitude `attn_factor` (YaRN's own magnitude cancelled), and the scores
    /// take `mscale² / √(qk_nope + qk_rope)` with `mscale = (1 + 0.1 · mscale_all_dim ·
    /// ln factor)` (times the linear correction, which llama.cpp does not cancel).
    pub fn mla_score_scale(&self) -> f32 {
        let Some(m) = self.mla else {
            return self.block.attn_scale;
        };
        let s = &self.rope_scaling;
        let ln_f = match s.kind {
            RopeScalingKind::Yarn | RopeScalingKind::Linear => s.factor.ln(),
            _ => 0.0,
        };
        let linear = match s.kind {
            RopeScalingKind::Linear => 1.0 + 0.1 * ln_f,
            _ => 1.0,
        };
        let mscale = s.attn_factor * linear * (1.0 + 0.1 * m.yarn_log_mul * ln_f);
        mscale * mscale / ((m.qk_nope + m.qk_rope) as f32).sqrt()
    }

    /// The KV cache's shape: every KV head's keys and values, or latent attention's one
    /// latent per position.
    pub fn kv_shape(&self, block_tokens: usize) -> KvShape {
        let (kv_heads, head_dim) = match self.mla {
            Some(m) => (1, m.latent_dim()),
            None => (self.n_kv_heads, self.head_dim),
        };
        KvShape {
            n_layers: self.n_layers,
            kv_heads,
            head_dim,
            block_tokens,
            latent: self.mla.is_some(),
        }
    }

    /// KV bytes per token the same model would cache with full attention (every head's key
    /// and value: latent attention decompressed), beside what it caches
    /// ([`ModelConfig::kv_shape`]).
    pub fn full_attention_kv_bytes_per_token(&self, dtype: KvDtype) -> usize {
        let per_layer = match self.mla {
            Some(m) => self.n_heads * (m.qk_nope + m.qk_rope + m.v_head),
            None => 2 * self.n_kv_heads * self.head_dim,
        };
        self.n_layers * per_layer * dtype.bytes()
    }

    /// What the cache holds per token against full attention (`/v1/worker/info`).
    pub fn kv_footprint(&self, dtype: KvDtype) -> hearth_protocol::KvFootprint {
        hearth_protocol::KvFootprint {
            layout: match self.mla {
                Some(_) => hearth_protocol::KvLayoutKind::Latent,
                None => hearth_protocol::KvLayoutKind::Heads,
            },
            bytes_per_token: KvPool::block_bytes(self.kv_shape(1), dtype) as u64,
            full_attention_bytes_per_token: self.full_attention_kv_bytes_per_token(dtype) as u64,
        }
    }

    /// The attention window of layer `l`, if it has one.
    pub fn window(&self, l: usize) -> Option<usize> {
        let w = self.block.sliding_window?;
        (self.block.swa_layers.is_empty() || self.block.swa_layers.get(l) == Some(&true)).then_some(w)
    }

    /// Whether this is the plain Llama block (what the CUDA backend computes): no biases
    /// or norms beyond Llama's, SiLU, no soft-caps, windows or scaled embeddings.
    pub fn plain_block(&self) -> bool {
        let b = &self.block;
        !b.qk_norm
            && !b.post_norms
            && b.activation == Activation::Silu
            && b.embed_scale.is_none()
            && b.attn_softcap.is_none()
            && b.final_softcap.is_none()
            && b.sliding_window.is_none()
            && self.moe.is_none()
            && self.mla.is_none()
            && (b.attn_scale - 1.0 / (self.head_dim as f32).sqrt()).abs() < 1e-6
    }
}

impl fmt::Display for ModelConfig {
    /// The settings `hearth model inspect` prints.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = &self.block;
        writeln!(
            f,
            "{} layers, d_model {}, feed-forward {} ({}), vocabulary {}",
            self.n_layers,
            self.d_model,
            self.n_ff,
            match b.activation {
                Activation::Silu => "SwiGLU",
                Activation::GeluTanh => "GeGLU (tanh)",
            },
            self.vocab_size
        )?;
        writeln!(
            f,
            "attention: {} heads, {} KV heads, head dim {}, score scale {:.4}{}{}",
            self.n_heads,
            self.n_kv_heads,
            self.head_dim,
            b.attn_scale,
            b.attn_softcap.map_or(String::new(), |c| format!(", soft-cap {c}")),
            if b.qk_norm { ", Q/K RMSNorm" } else { "" }
        )?;
        match b.sliding_window {
            None => writeln!(f, "window: none (every layer global)")?,
            Some(w) => {
                let n = (0..self.n_layers).filter(|&l| self.window(l).is_some()).count();
                writeln!(f, "window: {w} tokens on {n} of {} layers", self.n_layers)?
            }
        }
        writeln!(
            f,
            "RoPE: {} of {} dims, {:?} pairs, base {}{}, scaling {}",
            self.rope_dims,
            self.head_dim,
            self.rope_layout,
            self.rope_theta,
            b.swa_rope_theta
                .map_or(String::new(), |t| format!(" (windowed layers {t})")),
            self.rope_scaling
        )?;
        writeln!(
            f,
            "norms: RMSNorm eps {}{}; embeddings ×{}; logits soft-cap {}",
            self.rms_eps,
            if b.post_norms {
                ", post-attention and post-MLP norms"
            } else {
                ""
            },
            b.embed_scale.map_or("1".into(), |s| format!("{s:.3}")),
            b.final_softcap.map_or("none".into(), |c| c.to_string())
        )?;
        if let Some(m) = &self.moe {
            writeln!(
                f,
                "experts: {} of {} per token ({:?}{}{}{}), width {}, {} shared; the first {} layers dense",
                m.used,
                m.experts,
                m.gating,
                if m.norm_weights { ", renormalized" } else { "" },
                if m.weights_scale != 1.0 {
                    format!(", ×{}", m.weights_scale)
                } else {
                    String::new()
                },
                if m.groups > 1 {
                    format!(", best {} of {} groups", m.groups_used, m.groups)
                } else {
                    String::new()
                },
                m.ff_expert,
                m.shared,
                m.leading_dense
            )?;
        }
        if let Some(m) = &self.mla {
            writeln!(
                f,
                "latent attention: KV latent {} + RoPE key {} per position (cached), queries {}, per head {} + {} key dims and {} value dims",
                m.kv_lora_rank,
                m.qk_rope,
                match m.q_lora_rank {
                    0 => "projected directly".to_string(),
                    r => format!("through rank {r}"),
                },
                m.qk_nope,
                m.qk_rope,
                m.v_head
            )?;
        }
        let kv = self.kv_footprint(KvDtype::F16);
        writeln!(
            f,
            "KV cache: {} bytes per token at f16{}",
            kv.bytes_per_token,
            match self.mla {
                Some(_) => format!(
                    " (latent; full attention at these dims: {}, {:.1}x more)",
                    kv.full_attention_bytes_per_token,
                    kv.full_attention_bytes_per_token as f64 / kv.bytes_per_token.max(1) as f64
                ),
                None => String::new(),
            }
        )?;
        write!(f, "context: {} tokens", self.context_length)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::models::Arch;

    /// A metadata-only model file of `arch`: 6 layers, d 256, 4 heads (2 KV), context 4096.
    fn file(arch: &str, extra: Vec<(&str, MetaValue)>) -> GgufFile {
        let mut meta: HashMap<String, MetaValue> = [
            ("embedding_length", MetaValue::U64(256)),
            ("attention.head_count", MetaValue::U64(4)),
            ("attention.head_count_kv", MetaValue::U64(2)),
            ("block_count", MetaValue::U64(6)),
            ("feed_forward_length", MetaValue::U64(512)),
            ("vocab_size", MetaValue::U64(1000)),
            ("context_length", MetaValue::U64(4096)),
        ]
        .into_iter()
        .map(|(k, v)| (format!("{arch}.{k}"), v))
        .collect();
        meta.insert("general.architecture".into(), MetaValue::String(arch.into()));
        for (k, v) in extra {
            meta.insert(format!("{arch}.{k}"), v);
        }
        GgufFile::from_parts("test.gguf".into(), Vec::new(), 0, meta, Vec::new())
    }

    fn config(arch: &str, extra: Vec<(&str, MetaValue)>) -> Result<ModelConfig, ModelError> {
        ModelConfig::from_gguf(&file(arch, extra))
    }

    #[test]
    fn families_read_their_windows_caps_and_rope() {
        let g2 = config("gemma2", vec![("attention.sliding_window", MetaValue::U64(64))]).unwrap();
        assert_eq!(g2.block.swa_layers, [true, false, true, false, true, false]);
        assert_eq!(
            (g2.block.attn_softcap, g2.block.final_softcap),
            (Some(50.0), Some(30.0))
        );
        assert_eq!((g2.window(0), g2.window(1)), (Some(64), None));
        assert_eq!(g2.block.embed_scale, Some(16.0));
        // A cap of 0 is none (a config's null).
        let uncapped = config("gemma2", vec![("attn_logit_softcapping", MetaValue::F32(0.0))]).unwrap();
        assert_eq!(uncapped.block.attn_softcap, None);
        let g3 = config("gemma3", vec![("attention.sliding_window", MetaValue::U64(512))]).unwrap();
        assert_eq!(g3.block.swa_layers, [true, true, true, true, true, false]);
        assert_eq!((g3.block.qk_norm, g3.block.attn_softcap), (true, None));
        assert_eq!(g3.block.swa_rope_theta, Some(10000.0));
        let flags = MetaValue::Array([true, false, false, true, true, false].map(MetaValue::Bool).to_vec());
        let g3 = config(
            "gemma3",
            vec![
                ("attention.sliding_window", MetaValue::U64(512)),
                ("attention.sliding_window_pattern", flags),
            ],
        )
        .unwrap();
        assert_eq!(g3.block.swa_layers, [true, false, false, true, true, false]);
        let mistral = config("llama", vec![("attention.sliding_window", MetaValue::U64(4096))]).unwrap();
        assert_eq!((mistral.arch, mistral.window(5)), (Arch::Mistral, Some(4096)));
        assert_eq!(config("llama", vec![]).unwrap().window(0), None);
        assert_eq!(config("qwen3", vec![]).unwrap().rope_layout, RopeLayout::Halves);
        assert!(config("qwen3", vec![]).unwrap().block.qk_norm);
    }

    #[test]
    fn contexts_are_served_within_the_limit_and_refused_past_it() {
        let c = config("llama", vec![]).unwrap();
        assert_eq!(c.served_context(None).unwrap(), 4096);
        assert_eq!(c.served_context(Some(1000)).unwrap(), 1000);
        let e = c.served_context(Some(10000)).unwrap_err().to_string();
        assert!(e.contains("--rope-scaling") && e.contains("yarn:3"), "{e}");
        // Declared YaRN over an original context: up to the stretched one when asked.
        let yarn = config(
            "qwen2",
            vec![
                ("rope.scaling.type", MetaValue::String("yarn".into())),
                ("rope.scaling.factor", MetaValue::F32(4.0)),
                ("rope.scaling.original_context_length", MetaValue::U64(4096)),
            ],
        )
        .unwrap();
        assert_eq!((yarn.context_length, yarn.context_limit()), (4096, 16384));
        // The operator's scaling stretches the served context.
        let mut c = config("llama", vec![]).unwrap();
        c.set_rope_scaling(RopeScaling::parse("yarn:4").unwrap());
        assert_eq!((c.context_length, c.rope_scaling.original_context), (16384, 4096));
        c.set_rope_scaling(RopeScaling::parse("linear:1024:16777216").unwrap());
        assert_eq!(c.context_length, MAX_CONTEXT);
        // llama.cpp's reading of a factor without a type: linear.
        let lin = config("llama", vec![("rope.scaling.factor", MetaValue::F32(2.0))]).unwrap();
        assert_eq!(lin.rope_scaling.kind, RopeScalingKind::Linear);
    }

    #[test]
    fn implausible_files_are_refused_not_computed() {
        for (key, value) in [
            ("attention.head_count", MetaValue::U64(0)),
            ("attention.head_count", MetaValue::U64(1 << 40)),
            ("attention.head_count_kv", MetaValue::U64(3)),
            ("attention.key_length", MetaValue::U64(1 << 20)),
            ("rope.freq_base", MetaValue::F32(1.0)),
            ("rope.dimension_count", MetaValue::U64(63)),
            ("rope.scaling.type", MetaValue::String("dynamic".into())),
            ("rope.scaling.factor", MetaValue::F32(0.5)),
            ("rope.scaling.high_freq_factor", MetaValue::F32(1.0)),
            (
                "attention.sliding_window_pattern",
                MetaValue::Array(vec![MetaValue::Bool(true)]),
            ),
            ("block_count", MetaValue::String("six".into())),
        ] {
            let arch = if key.contains("sliding") { "gemma3" } else { "llama" };
            let mut extra = vec![(key, value.clone())];
            if arch == "gemma3" {
                extra.push(("attention.sliding_window", MetaValue::U64(8)));
            }
            assert!(config(arch, extra).is_err(), "{key} = {value:?} was accepted");
        }
        assert!(matches!(config("mamba", vec![]), Err(ModelError::Architecture(_))));
    }
}

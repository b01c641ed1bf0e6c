//! How a model is loaded: [`LoadOptions`] (packs, float weights, RoPE), how float weights
//! are computed ([`FloatWeights`]), and what `hearth model pack` wrote ([`PreparedPack`]).

use crate::kernels::pack_cache::PackCache;

use super::rope::RopeScaling;
use super::stage::StagePlan;

/// What [`Model::prepare_pack`] wrote.
#[derive(Debug, Clone)]
pub struct PreparedPack {
    pub path: std::path::PathBuf,
    /// Bytes of packed matrices.
    pub bytes: usize,
    /// Seconds the repacking and writing took.
    pub seconds: f64,
}

/// How a model is loaded.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// Which prepared packs of repacked weights are mapped, and whether a repack writes one.
    pub pack_cache: PackCache,
    /// How float matrices are computed.
    pub float_weights: FloatWeights,
    /// RoPE scaling instead of the file's (the context grows with it).
    pub rope_scaling: Option<RopeScaling>,
    /// The context that will be served (None: the model's); chooses LongRoPE's factors.
    pub max_context: Option<usize>,
    /// The layers this process computes as a pipeline stage (None: every layer).
    pub stage: Option<StagePlan>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            pack_cache: PackCache::from_env(),
            float_weights: FloatWeights::Auto,
            rope_scaling: None,
            max_context: None,
            stage: None,
        }
    }
}

/// How float (F32, F16, BF16) weight matrices are computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FloatWeights {
    /// `Q8_0` for a dense model, `Float` for a mixture of experts: a router's choice is
    /// discrete, and 8-bit activations in front of it flip the choice at near-ties that
    /// llama.cpp's float path (16-bit activations) keeps — the synthetic DeepSeek and
    /// Qwen3-MoE F16 files leave llama.cpp's greedy path under `Q8_0` (even with only the
    /// experts quantized) and follow it every step as floats.
    #[default]
    Auto,
    /// Quantized to Q8_0 at load (as llama.cpp's quantizer would: the tensors it keeps
    /// float stay float) for the integer kernels: the speed of a Q8_0 GGUF.
    Q8_0,
    /// Multiplied as floats (dequantize a row, then FMA): several times slower.
    Float,
}

impl FloatWeights {
    pub fn parse(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(FloatWeights::Auto),
            "q8_0" | "q8" => Ok(FloatWeights::Q8_0),
            "float" | "f32" => Ok(FloatWeights::Float),
            other => Err(format!("unknown float-weights mode {other:?} (auto, q8_0 or float)")),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            FloatWeights::Auto => "auto",
            FloatWeights::Q8_0 => "q8_0",
            FloatWeights::Float => "float",
        }
    }

    /// What `Auto` means for a model that has (`moe`) or has not a layer of routed experts.
    pub fn resolve(self, moe: bool) -> Self {
        match (self, moe) {
            (FloatWeights::Auto, true) => FloatWeights::Float,
            (FloatWeights::Auto, false) => FloatWeights::Q8_0,
            (other, _) => other,
        }
    }
}

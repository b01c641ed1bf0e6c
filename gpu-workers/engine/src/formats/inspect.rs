//! `hearth model inspect`: what a model file or directory is and what Hearth makes of it —
//! architecture, tensor types, tokenizer kind and pre-tokenizer, the chat template and the
//! tool-call and reasoning formats chosen from it, the context length — and, when Hearth
//! would refuse to serve it, every reason, from the metadata alone (no weights read).

use std::collections::BTreeMap;
use std::path::Path;

use hearth_protocol::output::{ReasoningFormat, ToolFormat};
use hearth_protocol::tokenizer::TokenizerSummary;
use hearth_protocol::{ChatMessage, ChatTemplate, Tokenizer};
use serde::Serialize;

use crate::formats::gguf::GgmlType;
use crate::models::ModelConfig;

#[derive(Debug, Serialize)]
pub struct ModelReport {
    pub path: String,
    pub format: String,
    pub architecture: Option<String>,
    pub parameters: u64,
    pub context_length: Option<u64>,
    /// Tensor type → how many tensors have it.
    pub tensor_types: BTreeMap<String, usize>,
    /// The architecture's settings as Hearth reads them (one line each), when it can.
    pub settings: Vec<String>,
    pub tokenizer: Option<TokenizerSummary>,
    pub template: TemplateReport,
    /// What a load does to float (F32/F16/BF16) weights, one line each (empty: no float
    /// matrices): which are quantized to Q8_0 and which stay float, as llama.cpp's quantizer
    /// chooses, and what the default (`auto`) does for this model.
    pub at_load: Vec<String>,
    /// Why Hearth would not serve it (empty: it would).
    pub refused: Vec<String>,
}

#[derive(Debug, Serialize)]
pub struct TemplateReport {
    pub found: bool,
    pub bytes: usize,
    /// Whether it compiles and renders a one-message conversation (else the error).
    pub renders: Result<(), String>,
    pub takes_tools: bool,
    pub tool_format: ToolFormat,
    pub reasoning_format: Option<ReasoningFormat>,
}

/// Reads `path` (a GGUF file or a Hugging Face directory) and reports on it.
pub fn inspect(path: &Path) -> Result<ModelReport, crate::formats::hf::error::HfError> {
    let file = crate::formats::hf::open_model(path)?;
    let mut refused = Vec::new();
    let architecture = file.get_str("general.architecture").ok().map(str::to_string);
    let arch = architecture.clone().unwrap_or_else(|| "llama".into());
    let mut tensor_types = BTreeMap::new();
    for t in &file.tensors {
        *tensor_types.entry(t.ty.name()).or_insert(0) += 1;
    }
    let mut settings = Vec::new();
    if file.tensors.is_empty() {
        refused.push("no tensors: a vocabulary-only file".to_string());
    } else {
        match ModelConfig::from_gguf(&file) {
            Ok(c) => settings = c.to_string().lines().map(str::to_string).collect(),
            Err(e) => refused.push(e.to_string()),
        }
        let bad: std::collections::BTreeSet<String> = file
            .tensors
            .iter()
            .filter(|t| t.ty.block_layout().is_none())
            .map(|t| t.ty.name())
            .collect();
        if !bad.is_empty() {
            let known: Vec<String> = [GgmlType::F32, GgmlType::F16, GgmlType::BF16]
                .into_iter()
                .chain(GgmlType::QUANTIZED)
                .map(|t| t.name())
                .collect();
            refused.push(format!(
                "tensor types Hearth cannot compute with: {} (it runs {}; requantize with llama-quantize, e.g. to Q4_K_M)",
                bad.into_iter().collect::<Vec<_>>().join(", "),
                known.join(", ")
            ));
        }
    }
    let spec = crate::formats::gguf::tokenizer_spec(&file);
    let tokenizer = match &spec {
        Ok(s) => match Tokenizer::from_spec(s) {
            Ok(t) => Some(t),
            Err(e) => {
                refused.push(e.to_string());
                None
            }
        },
        Err(e) => {
            refused.push(format!("tokenizer: {e}"));
            None
        }
    };
    let source = spec.as_ref().ok().and_then(|s| s.chat_template.clone());
    let template = TemplateReport {
        found: source.is_some(),
        bytes: source.as_ref().map_or(0, String::len),
        renders: match (&source, &tokenizer) {
            (None, _) => Err("no chat template: chat requests are refused, completions work".into()),
            (Some(src), tok) => match tok {
                Some(t) => ChatTemplate::for_tokenizer(src, t),
                None => ChatTemplate::new(src, "", ""),
            }
            .and_then(|t| t.render(&[ChatMessage::new("user", "Hello")], true))
            .map(|_| ())
            .map_err(|e| e.to_string()),
        },
        takes_tools: source.as_deref().is_some_and(|s| s.contains("tools")),
        tool_format: ToolFormat::detect(source.as_deref()),
        reasoning_format: ReasoningFormat::detect(source.as_deref()),
    };
    let is_dir = path.is_dir();
    Ok(ModelReport {
        path: path.display().to_string(),
        format: if is_dir {
            "Hugging Face directory".into()
        } else {
            "GGUF".into()
        },
        parameters: file.tensors.iter().map(|t| t.n_elements()).sum(),
        context_length: file.get_u64(&format!("{arch}.context_length")).ok(),
        architecture,
        tensor_types,
        settings,
        tokenizer: tokenizer.as_ref().map(Tokenizer::summary),
        template,
        at_load: at_load(&file),
        refused,
    })
}

/// Whether a load that quantizes float weights (`--float-weights q8_0`, and `auto` for a
/// dense model) quantizes the float tensor `name` of
/// `dims` (GGUF order, columns first) to Q8_0, as llama.cpp's quantizer would
/// (`llama-quant.cpp`): matrices and experts, not vectors (norms, biases), not the expert
/// routers (`ffn_gate_inp`, whose choice is discrete), not rows that are not whole blocks;
/// the embedding's rows are looked up as floats (tied to the logits, its Q8_0 copy computes
/// them).
pub fn quantized_at_load(name: &str, dims: &[u64]) -> bool {
    dims.len() >= 2
        && dims[0].is_multiple_of(crate::kernels::QK as u64)
        && name.ends_with(".weight")
        && !name.contains("_norm")
        && !name.contains("ffn_gate_inp")
        && name != "token_embd.weight"
}

/// [`ModelReport::at_load`].
fn at_load(file: &crate::formats::gguf::GgufFile) -> Vec<String> {
    let float: Vec<_> = file.tensors.iter().filter(|t| !t.ty.is_quantized()).collect();
    if float.is_empty() {
        return Vec::new();
    }
    let (quantized, kept): (Vec<&&crate::formats::gguf::TensorInfo>, Vec<_>) =
        float.iter().partition(|t| quantized_at_load(&t.name, &t.dims));
    if quantized.is_empty() {
        // Only vectors (norms, biases) are float: nothing to say.
        return Vec::new();
    }
    let bytes = |ts: &[&&crate::formats::gguf::TensorInfo]| ts.iter().map(|t| t.len as u64).sum::<u64>() >> 20;
    let mut kinds: BTreeMap<&str, usize> = BTreeMap::new();
    for t in &kept {
        let kind = match t.name.as_str() {
            n if n.contains("ffn_gate_inp") => "expert routers (ffn_gate_inp)",
            "token_embd.weight" => "the embedding (rows looked up)",
            n if t.dims.len() < 2 && n.contains("_norm") => "norms",
            _ if t.dims.len() < 2 => "vectors (biases, factors)",
            _ => "matrices of rows that are not whole 32-value blocks",
        };
        *kinds.entry(kind).or_default() += 1;
    }
    let moe = file.has_routed_experts();
    let mut lines = vec![match moe {
        false => format!(
            "{} float tensors ({} MiB) quantized to Q8_0 at load (the default, `auto`, for a dense model; `--float-weights float` keeps them)",
            quantized.len(),
            bytes(&quantized)
        ),
        true => format!(
            "a mixture of experts: computed as floats by default (`auto`: a router's choice is discrete); `--float-weights q8_0` quantizes {} float tensors ({} MiB) at load",
            quantized.len(),
            bytes(&quantized)
        ),
    }];
    let kept_text: Vec<String> = kinds.iter().map(|(k, n)| format!("{k} ×{n}")).collect();
    lines.push(format!("kept float: {}", kept_text.join(", ")));
    if file.tensor("output.weight").is_none() && file.tensor("token_embd.weight").is_some_and(|t| !t.ty.is_quantized())
    {
        lines.push("tied logits: the embedding's Q8_0 copy computes them".into());
    }
    lines
}

impl ModelReport {
    pub fn text(&self) -> String {
        let mut s = format!("model         {} ({})\n", self.path, self.format);
        s.push_str(&format!(
            "architecture  {}   parameters {:.1} M   context {}\n",
            self.architecture.as_deref().unwrap_or("(none)"),
            self.parameters as f64 / 1e6,
            self.context_length.map_or("(not given)".into(), |c| c.to_string())
        ));
        if !self.tensor_types.is_empty() {
            let types: Vec<String> = self.tensor_types.iter().map(|(t, n)| format!("{t} ×{n}")).collect();
            s.push_str(&format!("tensors       {}\n", types.join(", ")));
        }
        for (i, line) in self.settings.iter().enumerate() {
            s.push_str(&format!("{:<14}{line}\n", if i == 0 { "settings" } else { "" }));
        }
        for (i, line) in self.at_load.iter().enumerate() {
            s.push_str(&format!("{:<14}{line}\n", if i == 0 { "at load" } else { "" }));
        }
        match &self.tokenizer {
            Some(t) => {
                s.push_str(&format!(
                    "tokenizer     {} (`{}`{}), {} tokens, {} merges, {} special and added\n",
                    t.kind,
                    t.model,
                    t.pre_tokenizer
                        .as_ref()
                        .map_or(String::new(), |p| format!(", pre-tokenizer `{p}`")),
                    t.vocab_size,
                    t.merges,
                    t.special_tokens
                ));
                s.push_str(&format!(
                    "              BOS {} ({} raw prompts), EOS {}{}\n",
                    t.bos.as_deref().unwrap_or("(none)"),
                    if t.add_bos { "starts" } else { "not added to" },
                    t.eos.as_deref().unwrap_or("(none)"),
                    if t.add_space_prefix { ", space prefix added" } else { "" }
                ));
                s.push_str(&format!(
                    "              ends generation at {}\n",
                    t.end_of_generation.join(", ")
                ));
            }
            None => s.push_str("tokenizer     (refused, see below)\n"),
        }
        let tmpl = &self.template;
        if tmpl.found {
            s.push_str(&format!(
                "template      from the file, {} bytes, {}\n",
                tmpl.bytes,
                match &tmpl.renders {
                    Ok(()) => "renders".to_string(),
                    Err(e) => format!("does not render: {e}"),
                }
            ));
        } else {
            s.push_str("template      none (chat requests are refused; /v1/completions works)\n");
        }
        s.push_str(&format!(
            "tool calls    {}{}\n",
            tmpl.tool_format.name(),
            if tmpl.tool_format.template_renders_tools() {
                " (the template renders the tools and the calls)"
            } else {
                " (Hearth's format: the tools go into the system message)"
            }
        ));
        s.push_str(&format!(
            "reasoning     {}\n",
            tmpl.reasoning_format.map_or("none", ReasoningFormat::name)
        ));
        if self.refused.is_empty() {
            s.push_str("verdict       Hearth serves it\n");
        } else {
            s.push_str("verdict       Hearth would refuse it:\n");
            for r in &self.refused {
                s.push_str(&format!("              - {r}\n"));
            }
        }
        s
    }
}

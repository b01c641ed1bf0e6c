//! Phase `tokenize`: the chat template and the tokenizer at the gateway, so that routing
//! sees the very token blocks the engine will cache; fixes `max_tokens` against the context.
//!
//! A chat request meets its model's formats here (see `hearth_protocol::output`): the tools
//! go through the template when it takes them, else into Hearth's system prompt; a forced
//! `tool_choice` becomes a grammar in the model's tool format; the answer will be read for
//! that format's calls and for reasoning; the delimiters that are special tokens are asked
//! for as text.

use hearth_protocol::output::{OutputSpec, ToolDef};
use hearth_protocol::ChatInput;
use serde_json::Value;

use super::parse::Input;
use super::RequestContext;
use crate::api::openai::Prompt;
use crate::api::tools;
use crate::server::error::ApiError;
use crate::upstream::registry::ServedModel;

pub fn run(ctx: &mut RequestContext) -> Result<(), ApiError> {
    let model = ctx.model()?.clone();
    let request = ctx.request()?;
    let mut chat = None;
    let ids = match &request.input {
        Input::Chat { messages, kwargs } => {
            let tmpl = model.template.as_ref().ok_or_else(|| {
                ApiError::invalid(
                    "model",
                    format!("model {} has no chat template; use /v1/completions", model.id),
                )
            })?;
            let format = model.tool_format;
            let active = request.common.tools.as_ref().filter(|t| t.active());
            let offered: Option<std::sync::Arc<[ToolDef]>> = active.map(|t| t.offered().into());
            let template_tools: Option<Vec<Value>> = active
                .filter(|_| format.template_renders_tools())
                .map(|t| t.offered_objects());
            let hearth_style;
            let messages = if format.template_renders_tools() {
                messages.as_slice()
            } else {
                hearth_style = tools::in_hearth_format(messages, active);
                hearth_style.as_slice()
            };
            let text = tmpl
                .render_input(&ChatInput {
                    messages,
                    tools: template_tools.as_deref(),
                    add_generation_prompt: true,
                    kwargs: Some(kwargs),
                })
                .map_err(|e| ApiError::invalid("messages", e.to_string()))?;
            let constraint = active
                .zip(offered.as_deref())
                .and_then(|(t, o)| t.constraint_for(o, format, &|d| special_id(&model, d)));
            let output = OutputSpec {
                tools: offered.map(|o| (format, o)),
                reasoning: model.reasoning_format.map(|f| (f, f.prompt_opens(&text))),
            };
            let special_text = special_text(&model, &output);
            chat = Some((constraint, special_text, output));
            model.tokenizer.encode(&text)
        }
        Input::Prompt(Prompt::Text(t)) => model.tokenizer.encode_prompt(t),
        Input::Prompt(Prompt::Tokens(ids)) => {
            let vocab = model.tokenizer.vocab_size() as u32;
            if let Some(bad) = ids.iter().find(|&&t| t >= vocab) {
                return Err(ApiError::invalid(
                    "prompt",
                    format!("token id {bad} is outside the vocabulary (size {vocab})"),
                ));
            }
            ids.clone()
        }
    };
    if ids.is_empty() {
        return Err(ApiError::invalid("prompt", "the prompt encodes to no tokens"));
    }
    if ctx.endpoint == super::Endpoint::CountTokens {
        // Counted, not run: no completion budget to fit.
        ctx.prompt_tokens = ids.len() as u32;
        return Ok(());
    }
    if let Some((constraint, special_text, output)) = chat {
        let request = ctx.request.as_mut().ok_or_else(|| ApiError::internal("no request"))?;
        if let Some(c) = constraint {
            request.common.constraint = Some(c);
        }
        request.common.sampling.special_text = special_text;
        ctx.output = output;
    }
    let request = ctx.request()?;
    let limit = model.context_length;
    let prompt = ids.len() as u32;
    let room = limit.saturating_sub(prompt);
    let max_tokens = match request.common.max_tokens {
        _ if room == 0 => 0,
        None => ctx.default_max_tokens.map_or(room, |d| d.min(room)),
        Some(m) if m <= room => m,
        Some(_) if request.common.clamp_max_tokens => room,
        Some(m) => {
            return Err(ApiError::context_length(format!(
                "This model's maximum context length is {limit} tokens. However, you requested {} tokens ({prompt} in the prompt, {m} in the completion). Reduce the prompt or max_tokens.",
                prompt as u64 + m as u64
            )))
        }
    };
    if max_tokens == 0 {
        return Err(ApiError::context_length(format!(
            "This model's maximum context length is {limit} tokens; the prompt has {prompt}, leaving no room for a completion."
        )));
    }
    ctx.prompt_tokens = prompt;
    if let Some(u) = ctx.usage.as_mut() {
        u.prompt_tokens = prompt;
    }
    ctx.prompt = ids;
    ctx.max_tokens = max_tokens;
    Ok(())
}

/// The id of `text` when the vocabulary has it as one special token.
fn special_id(model: &ServedModel, text: &str) -> Option<u32> {
    model
        .tokenizer
        .token_id(text)
        .filter(|&id| model.tokenizer.is_special(id))
}

/// The special tokens whose text the answer's parsers need to see (tool-call delimiters,
/// reasoning markers): the engine sends their text instead of dropping it.
fn special_text(model: &ServedModel, output: &OutputSpec) -> Vec<u32> {
    let mut marks: Vec<&str> = Vec::new();
    if let Some((f, _)) = &output.tools {
        marks.extend(f.delimiters());
    }
    if let Some((r, _)) = &output.reasoning {
        let (open, close) = r.markers();
        marks.extend([open, close]);
    }
    let mut ids: Vec<u32> = marks.into_iter().filter_map(|m| special_id(model, m)).collect();
    ids.sort_unstable();
    ids.dedup();
    ids
}

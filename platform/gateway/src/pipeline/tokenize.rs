//! Phase `tokenize`: the chat template and the tokenizer at the gateway, so that routing
//! sees the very token blocks the engine will cache; fixes `max_tokens` against the context.

use super::parse::Input;
use super::RequestContext;
use crate::error::ApiError;
use crate::openai::Prompt;

pub fn run(ctx: &mut RequestContext) -> Result<(), ApiError> {
    let model = ctx.model()?.clone();
    let request = ctx.request()?;
    let ids = match &request.input {
        Input::Chat(messages) => {
            let tmpl = model.template.as_ref().ok_or_else(|| {
                ApiError::invalid(
                    "model",
                    format!("model {} has no chat template; use /v1/completions", model.id),
                )
            })?;
            let text = tmpl
                .render(messages, true)
                .map_err(|e| ApiError::invalid("messages", e.to_string()))?;
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
    let limit = model.context_length;
    let prompt = ids.len() as u32;
    let room = limit.saturating_sub(prompt);
    let max_tokens = match request.common.max_tokens {
        _ if room == 0 => 0,
        None => room,
        Some(m) if m <= room => m,
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

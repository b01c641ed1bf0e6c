//! Phase `parse`: the body as a typed request (every error names its `param`). The
//! Responses and Messages APIs' bodies are translated into a chat request here, and what
//! they carry beyond it is kept in [`Api`] for their responses.

use hearth_protocol::ChatMessage;
use serde_json::{Map, Value};

use super::{Endpoint, RequestContext};
use crate::api::openai::{self, Common, Prompt};
use crate::server::error::ApiError;

/// What the request asks for.
pub enum Input {
    Chat {
        messages: Vec<ChatMessage>,
        /// `chat_template_kwargs`.
        kwargs: Map<String, Value>,
    },
    Prompt(Prompt),
}

/// What an API carries beyond the chat request it becomes.
pub enum Api {
    OpenAi,
    Responses(Box<crate::api::responses::Request>),
    Messages(crate::api::anthropic::Request),
}

/// A validated request.
pub struct Parsed {
    pub common: Common,
    pub input: Input,
    pub api: Api,
}

impl Parsed {
    /// The request's leading text as `prefix_aware` routing reads it; token-id prompts use
    /// their ids.
    pub fn routing_text(&self) -> String {
        match &self.input {
            Input::Chat { messages, .. } => messages
                .iter()
                .map(|m| m.content.as_str())
                .collect::<Vec<_>>()
                .join("\n"),
            Input::Prompt(Prompt::Text(t)) => t.clone(),
            Input::Prompt(Prompt::Tokens(ids)) => {
                ids.iter().take(512).map(u32::to_string).collect::<Vec<_>>().join(" ")
            }
        }
    }
}

pub fn run(ctx: &mut RequestContext, keep_billing_header: bool) -> Result<(), ApiError> {
    let hex = ctx.request_id.trim_start_matches("req_").to_string();
    let hex = hex.as_str();
    let body = match &ctx.body {
        Ok(b) => b,
        Err(e) => return Err(ApiError::invalid("body", e.body_text())),
    };
    let parsed = match ctx.endpoint {
        Endpoint::Chat => {
            let r = openai::parse_chat(body)?;
            Parsed {
                common: r.common,
                input: Input::Chat {
                    messages: r.messages,
                    kwargs: r.template_kwargs,
                },
                api: Api::OpenAi,
            }
        }
        Endpoint::Completions => {
            let r = openai::parse_completion(body)?;
            Parsed {
                common: r.common,
                input: Input::Prompt(r.prompt),
                api: Api::OpenAi,
            }
        }
        Endpoint::Responses => {
            let (r, extra) = crate::api::responses::parse(body, hex)?;
            Parsed {
                common: r.common,
                input: Input::Chat {
                    messages: r.messages,
                    kwargs: r.template_kwargs,
                },
                api: Api::Responses(Box::new(extra)),
            }
        }
        Endpoint::Messages | Endpoint::CountTokens => {
            let (r, extra) = crate::api::anthropic::parse(
                body,
                &ctx.headers,
                hex,
                keep_billing_header,
                ctx.endpoint == Endpoint::CountTokens,
            )?;
            Parsed {
                common: r.common,
                input: Input::Chat {
                    messages: r.messages,
                    kwargs: r.template_kwargs,
                },
                api: Api::Messages(extra),
            }
        }
    };
    if let Some(u) = ctx.usage.as_mut() {
        u.model = parsed.common.model.clone();
    }
    let (c, span) = (&parsed.common, &ctx.span);
    // Signed: OpenTelemetry's integers are i64 (unsigned ones are exported as text).
    span.record("gen_ai.request.choice.count", i64::from(c.n));
    if let Some(m) = c.max_tokens {
        span.record("gen_ai.request.max_tokens", i64::from(m));
    }
    span.record("gen_ai.request.temperature", f64::from(c.sampling.temperature));
    span.record("gen_ai.request.top_p", f64::from(c.sampling.top_p));
    if let Some(seed) = c.sampling.seed.and_then(|s| i64::try_from(s).ok()) {
        span.record("gen_ai.request.seed", seed);
    }
    ctx.request = Some(parsed);
    Ok(())
}

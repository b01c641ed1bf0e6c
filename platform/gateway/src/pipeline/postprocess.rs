//! Phase `postprocess`: the response — streamed (each delta through the tenant's
//! post-processors, with their end hook) or whole (the complete object through them), in
//! the shape of the endpoint it came in on: OpenAI's chat or completions objects, the
//! Responses API's response object and events (stored when asked), or Anthropic's message.
//! Processors see each API's own object (`on-response`) and the answer's text deltas
//! (`on-chunk`) whatever the API.

use std::sync::Arc;

use axum::response::{IntoResponse, Response};
use axum::Json;
use hearth_tenants::now_ms;
use serde_json::Value;

use super::parse::Api;
use super::RequestContext;
use crate::api::respond::{collect_response, sse_response, Kind, Shape};
use crate::api::{anthropic, responses};
use crate::server::error::ApiError;
use crate::state::AppState;
use crate::upstream::workers::EventStream;

/// The API's renderer, built from the parsed request.
enum Render {
    OpenAi(Shape),
    Responses(Box<responses::Shape>),
    Messages(anthropic::Shape),
}

pub async fn run(state: &Arc<AppState>, ctx: &mut RequestContext, events: EventStream) -> Result<Response, ApiError> {
    let model = ctx.model()?.clone();
    let (tenant_id, tenant_name, key_id) = {
        let t = ctx.tenant()?;
        (t.tenant_id.clone(), t.tenant_name.clone(), t.key_id.clone())
    };
    let hex = ctx.request_id.trim_start_matches("req_").to_string();
    let created = now_ms() / 1000;
    let request = ctx.request.as_mut().ok_or_else(|| ApiError::internal("no request"))?;
    let (stream, include_usage) = (request.common.stream, request.common.include_usage);
    let render = match std::mem::replace(&mut request.api, Api::OpenAi) {
        Api::OpenAi => Render::OpenAi(Shape {
            endpoint: if ctx.endpoint == super::Endpoint::Completions {
                Kind::Completions
            } else {
                Kind::Chat
            },
            id: hex,
            model: model.clone(),
            created,
            n: request.common.n as usize,
            output: ctx.output.clone(),
            prompt_tokens: ctx.prompt_tokens,
        }),
        Api::Responses(req) => Render::Responses(Box::new(responses::Shape {
            req: *req,
            model: model.id.clone(),
            created_at: created,
            tenant_id,
            tenant_name,
            key_id,
        })),
        Api::Messages(req) => Render::Messages(anthropic::Shape {
            hex: req.hex,
            model: model.id.clone(),
            prompt_tokens: ctx.prompt_tokens,
        }),
    };
    let mut chain = ctx.chain.take();
    let post_done = ctx.post_done.take();
    if stream {
        let events = match chain {
            Some(c) => c.stream(events, post_done),
            None => events,
        };
        let output = ctx.output.clone();
        return Ok(match render {
            Render::OpenAi(shape) => sse_response(shape, include_usage, events),
            Render::Responses(shape) => responses::stream(state.clone(), *shape, output, events),
            Render::Messages(shape) => anthropic::stream(shape, output, events),
        });
    }
    let mut body: Value = match &render {
        Render::OpenAi(shape) => collect_response(shape, events).await?,
        Render::Responses(shape) => responses::collect(shape, &ctx.output, events).await?,
        Render::Messages(shape) => anthropic::collect(shape, &ctx.output, events).await?,
    };
    if let Some(c) = &mut chain {
        let started = std::time::Instant::now();
        let processed = c.post(&model.id, body).await;
        state.metrics.observe_processor("post", started.elapsed());
        // The record (with the processors' time) is durable before the answer goes out.
        if let Some(tx) = post_done {
            crate::policy::processors::report_post(tx, c.spent_us()).await;
        }
        body = processed?;
    }
    if let Render::Responses(shape) = &render {
        shape.store(state, &body).await;
    }
    Ok(Json(body).into_response())
}

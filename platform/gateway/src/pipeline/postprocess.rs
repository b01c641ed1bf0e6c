//! Phase `postprocess`: the response — streamed (each delta through the tenant's
//! post-processors, with their end hook) or whole (the complete object through them).

use axum::response::{IntoResponse, Response};
use axum::Json;
use hearth_tenants::now_ms;

use super::respond::{collect_response, sse_response, Shape};
use super::RequestContext;
use crate::error::ApiError;
use crate::state::AppState;
use crate::workers::EventStream;

pub async fn run(state: &AppState, ctx: &mut RequestContext, events: EventStream) -> Result<Response, ApiError> {
    let model = ctx.model()?.clone();
    let common = &ctx.request()?.common;
    let (stream, include_usage) = (common.stream, common.include_usage);
    let shape = Shape {
        endpoint: ctx.endpoint,
        id: ctx.request_id.trim_start_matches("req_").to_string(),
        model: model.clone(),
        created: now_ms() / 1000,
        n: common.n as usize,
        output: ctx.output.clone(),
        prompt_tokens: ctx.prompt_tokens,
    };
    let mut chain = ctx.chain.take();
    let post_done = ctx.post_done.take();
    if stream {
        let events = match chain {
            Some(c) => c.stream(events, post_done),
            None => events,
        };
        Ok(sse_response(shape, include_usage, events))
    } else {
        let mut body = collect_response(&shape, events).await?;
        if let Some(c) = &mut chain {
            let started = std::time::Instant::now();
            let processed = c.post(&model.id, body).await;
            state.metrics.observe_processor("post", started.elapsed());
            // The record (with the processors' time) is durable before the answer goes out.
            if let Some(tx) = post_done {
                super::relay::report_post(tx, c.spent_us()).await;
            }
            body = processed?;
        }
        Ok(Json(body).into_response())
    }
}

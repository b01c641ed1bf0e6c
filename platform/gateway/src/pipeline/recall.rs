//! Phase `recall` (Responses API only): a stored conversation joins the request — the
//! items of `previous_response_id` before the new input, and `item_reference`s replaced by
//! the items they name — and the chat request is rebuilt from the whole. The prefix cache
//! makes the continuation cheap: the inherited turns are the previous prompt's prefix.
//! A request that would store more than a response may hold (its body, reasoning, metadata
//! and hosted-tool items included: all are kept) is refused here, before it runs.

use super::parse::{Api, Input};
use super::RequestContext;
use crate::server::error::ApiError;
use crate::state::AppState;

pub async fn run(state: &AppState, ctx: &mut RequestContext) -> Result<(), ApiError> {
    let caller = ctx.tenant()?.clone();
    let body_bytes = ctx.body.as_ref().map_or(0, |b| b.len()) as u64;
    let Some(parsed) = ctx.request.as_mut() else {
        return Ok(());
    };
    let Api::Responses(req) = &mut parsed.api else {
        return Ok(());
    };
    let max = state.response_retention.max_response_bytes;
    if req.store && body_bytes > max {
        return Err(ApiError::invalid(
            "store",
            format!(
                "A stored response keeps at most {max} bytes of input, instructions, tools and metadata; \
                 this request sends {body_bytes} (send store: false, or less)."
            ),
        ));
    }
    let referenced = req.items.iter().any(|i| i["type"] == "item_reference");
    if req.previous_response_id.is_none() && !referenced {
        return Ok(());
    }
    crate::api::responses::recall(state, &caller, req).await?;
    // Item references are stored resolved: the bound holds for what is kept.
    let kept = serde_json::to_vec(&req.items).map_or(0, |v| v.len()) as u64;
    if req.store && kept > max {
        return Err(ApiError::invalid(
            "store",
            format!(
                "A stored response keeps at most {max} bytes of input; this request's items, references resolved, \
                 are {kept} (send store: false, or less)."
            ),
        ));
    }
    let chat = req.chat_request()?;
    parsed.input = Input::Chat {
        messages: chat.messages,
        kwargs: chat.template_kwargs,
    };
    Ok(())
}

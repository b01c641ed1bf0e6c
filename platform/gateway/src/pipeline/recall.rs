//! Phase `recall` (Responses API only): a stored conversation joins the request — the
//! items of `previous_response_id` before the new input, and `item_reference`s replaced by
//! the items they name — and the chat request is rebuilt from the whole. The prefix cache
//! makes the continuation cheap: the inherited turns are the previous prompt's prefix.

use super::parse::{Api, Input};
use super::RequestContext;
use crate::server::error::ApiError;
use crate::state::AppState;

pub async fn run(state: &AppState, ctx: &mut RequestContext) -> Result<(), ApiError> {
    let tenant_id = ctx.tenant()?.tenant_id.clone();
    let Some(parsed) = ctx.request.as_mut() else {
        return Ok(());
    };
    let Api::Responses(req) = &mut parsed.api else {
        return Ok(());
    };
    let referenced = req.items.iter().any(|i| i["type"] == "item_reference");
    if req.previous_response_id.is_none() && !referenced {
        return Ok(());
    }
    crate::api::responses::recall(state, &tenant_id, req).await?;
    let chat = req.chat_request()?;
    parsed.input = Input::Chat {
        messages: chat.messages,
        kwargs: chat.template_kwargs,
    };
    Ok(())
}

//! Phase `resolve`: the model asked for, among those this gateway serves and those the
//! credential may use.

use super::RequestContext;
use crate::error::ApiError;
use crate::state::AppState;

pub fn run(state: &AppState, ctx: &mut RequestContext) -> Result<(), ApiError> {
    let name = &ctx.request()?.common.model;
    let model = state.models.get(name).ok_or_else(|| ApiError::model_not_found(name))?;
    // A model the tenant may not see is one it cannot tell from a missing one.
    if ctx.tenant.as_ref().is_some_and(|t| !model.visible_to(t)) {
        return Err(ApiError::model_not_found(name));
    }
    if let Some(t) = &ctx.tenant {
        if !t.allows_model(&model.id) {
            return Err(ApiError::permission(
                "model_not_allowed",
                format!("This credential may not use model {}.", model.id),
            )
            .with_param("model"));
        }
    }
    // The model is named in the trace once resolved (never the client's raw text).
    ctx.span.record("gen_ai.request.model", model.id.as_str());
    ctx.span.record("gen_ai.response.model", model.id.as_str());
    crate::telemetry::rename(&ctx.span, format!("{} {}", ctx.endpoint.operation(), model.id));
    ctx.model = Some(model.clone());
    Ok(())
}

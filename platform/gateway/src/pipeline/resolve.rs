//! Phase `resolve`: the model asked for, among those this gateway serves and those the
//! credential may use, and the tenant's LoRA adapter when the name is `BASE:ADAPTER`.

use hearth_protocol::AdapterRef;

use super::RequestContext;
use crate::server::error::{store_error, ApiError};
use crate::state::AppState;

pub async fn run(state: &AppState, ctx: &mut RequestContext) -> Result<(), ApiError> {
    let name = ctx.request()?.common.model.clone();
    // A served model's own name first (model ids may contain ':'), then `BASE:ADAPTER`.
    let (model, adapter) = match state.models.get(&name) {
        Some(m) => (m, None),
        None => match hearth_tenants::adapters::split_model_name(&name) {
            Some((base, adapter)) => (
                state.models.get(base).ok_or_else(|| ApiError::model_not_found(&name))?,
                Some(adapter),
            ),
            _ => return Err(ApiError::model_not_found(&name)),
        },
    };
    // A model the tenant may not see is one it cannot tell from a missing one.
    if ctx.tenant.as_ref().is_some_and(|t| !model.visible_to(t)) {
        return Err(ApiError::model_not_found(&name));
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
    if let Some(adapter) = adapter {
        let tenant = &ctx.tenant()?.tenant_id;
        // Another tenant's adapter is one this tenant cannot tell from a missing one.
        let a = state
            .tenants
            .find_adapter(tenant, &model.id, adapter)
            .await
            .map_err(store_error)?
            .ok_or_else(|| ApiError::model_not_found(&name))?;
        if state.adapter_dir.is_none() {
            return Err(ApiError::unavailable(
                "This gateway has no adapter store (--adapter-dir), so it serves no adapters.",
            ));
        }
        let usage = ctx.usage_mut()?;
        usage.model = model.id.clone();
        usage.adapter = Some(a.name.clone());
        ctx.adapter = Some(AdapterRef {
            name: hearth_tenants::adapters::model_name(&model.id, &a.name),
            path: a.store_path(),
            digest: a.digest,
        });
    }
    // The model is named in the trace once resolved (never the client's raw text).
    ctx.span.record("gen_ai.request.model", model.id.as_str());
    ctx.span.record("gen_ai.response.model", model.id.as_str());
    crate::server::telemetry::rename(&ctx.span, format!("{} {}", ctx.endpoint.operation(), model.id));
    ctx.model = Some(model.clone());
    Ok(())
}

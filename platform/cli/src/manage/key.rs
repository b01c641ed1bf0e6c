//! `hearth admin key …`: API keys: create, list, revoke, per-key limits — through the admin
//! API ([`remote`]), on the database ([`direct`]), and the answer as text ([`text`]).

use hearth_billing::UsageLedger;
use hearth_gateway::manage::{Actor, Management};
use hearth_tenants::TenantStore;
use reqwest::Method;
use serde_json::{json, Value};

use super::*;
use crate::args::KeyCommand;

/// Through the gateway's admin API.
pub(super) async fn remote(gw: &AdminClient, command: &KeyCommand) -> anyhow::Result<Value> {
    Ok(match command {
        KeyCommand::Create {
            tenant,
            name,
            scopes,
            models,
            expires_in,
        } => {
            let scopes = hearth_tenants::Scopes::parse(scopes)?;
            let mut body = json!({"name": name, "scopes": scopes.names(), "models": models});
            if let Some(ms) = expires_in_ms(expires_in)? {
                body["expires_in"] = json!((ms + 999) / 1000);
            }
            gw.call(Method::POST, &["tenants", tenant, "keys"], &[], Some(body))
                .await?
        }
        KeyCommand::List { tenant } => gw.get(&["tenants", tenant, "keys"], &[]).await?,
        KeyCommand::Revoke { key_id } => gw.call(Method::DELETE, &["keys", key_id], &[], None).await?,
        KeyCommand::Limits { key_id, limits: l } => {
            gw.call(
                Method::PUT,
                &["keys", key_id, "limits"],
                &[],
                Some(limits_json(l.limits())),
            )
            .await?
        }
    })
}

/// On the database, through the management service.
pub(super) async fn direct(
    manage: &Management<'_>,
    _store: &TenantStore,
    _ledger: &UsageLedger,
    command: &KeyCommand,
) -> anyhow::Result<Value> {
    Ok(match command {
        KeyCommand::Create {
            tenant,
            name,
            scopes,
            models,
            expires_in,
        } => {
            let spec = hearth_tenants::KeySpec {
                name: name.clone(),
                scopes: Some(hearth_tenants::Scopes::parse(scopes)?),
                models: models.clone(),
                expires_at: expires_in_ms(expires_in)?.map(|ms| hearth_tenants::now_ms() + ms),
            };
            json!(manage.create_key(Actor::Operator, Some(tenant), spec).await?)
        }
        KeyCommand::List { tenant } => json!(manage.list_keys(Actor::Operator, Some(tenant)).await?),
        KeyCommand::Revoke { key_id } => json!(manage.revoke_key(Actor::Operator, key_id).await?),
        KeyCommand::Limits { key_id, limits } => {
            let l = limits.limits();
            manage.set_key_limits(key_id, l).await?;
            json!({"key": key_id, "limits": l})
        }
    })
}

/// The answer `v` (the admin API's JSON) as text.
pub(super) fn text(command: &KeyCommand, v: &Value) -> String {
    match command {
        KeyCommand::Create { .. } => format!(
            "Created API key {} for tenant {}. Copy it now; it is not shown again:\n\n{}\n",
            s(v, "id"),
            s(v, "tenant"),
            s(v, "key")
        ),
        KeyCommand::List { .. } => lines(
            list(v).iter().map(|k| {
                let state = if k["revoked_at"].is_null() { "active" } else { "revoked" };
                format!("{}\t{state}\t{}", s(k, "id"), s(k, "name"))
            }),
            "No keys.",
        ),
        KeyCommand::Revoke { .. } => format!(
            "Revoked key {} (running servers stop accepting it within 5 s).",
            s(v, "id")
        ),
        KeyCommand::Limits { .. } => format!("Key {} limits: {}.", s(v, "key"), limits_text(&v["limits"])),
    }
}

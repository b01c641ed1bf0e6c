//! `hearth admin jwt …`: JWT issuers: add, list, remove — through the admin API
//! ([`remote`]), on the database ([`direct`]), and the answer as text ([`text`]).

use hearth_billing::UsageLedger;
use hearth_gateway::manage::Management;
use hearth_tenants::TenantStore;
use reqwest::Method;
use serde_json::{json, Value};

use super::*;
use crate::args::JwtCommand;

/// Through the gateway's admin API.
pub(super) async fn remote(gw: &AdminClient, command: &JwtCommand) -> anyhow::Result<Value> {
    Ok(match command {
        JwtCommand::Add {
            tenant,
            issuer,
            audience,
            algorithm,
            key_file,
            jwks_file,
            jwks_url,
        } => {
            let spec = issuer_spec(issuer, audience, algorithm, key_file, jwks_file, jwks_url)?;
            gw.call(
                Method::POST,
                &["tenants", tenant, "jwt-issuers"],
                &[],
                Some(json!(spec)),
            )
            .await?
        }
        JwtCommand::List { tenant: Some(t) } => gw.get(&["tenants", t, "jwt-issuers"], &[]).await?,
        JwtCommand::List { tenant: None } => {
            // The admin API lists issuers per tenant: every tenant's, in turn, in the
            // database path's order.
            let mut all = Vec::new();
            for t in gw.get(&["tenants"], &[]).await?.as_array().into_iter().flatten() {
                let id = t["id"].as_str().unwrap_or_default();
                if let serde_json::Value::Array(is) = gw.get(&["tenants", id, "jwt-issuers"], &[]).await? {
                    all.extend(is);
                }
            }
            all.sort_by_key(|i| (i["created_at"].as_i64(), i["id"].as_str().map(str::to_string)));
            serde_json::Value::Array(all)
        }
        JwtCommand::Remove { id } => gw.call(Method::DELETE, &["jwt-issuers", id], &[], None).await?,
    })
}

/// On the database, through the management service.
pub(super) async fn direct(
    manage: &Management<'_>,
    store: &TenantStore,
    _ledger: &UsageLedger,
    command: &JwtCommand,
) -> anyhow::Result<Value> {
    Ok(match command {
        JwtCommand::Add {
            tenant,
            issuer,
            audience,
            algorithm,
            key_file,
            jwks_file,
            jwks_url,
        } => {
            let spec = issuer_spec(issuer, audience, algorithm, key_file, jwks_file, jwks_url)?;
            json!(manage.add_issuer(tenant, &spec).await?)
        }
        JwtCommand::List { tenant } => json!(store.list_issuers(tenant.as_deref()).await?),
        JwtCommand::Remove { id } => json!(manage.remove_issuer(id).await?),
    })
}

/// The answer `v` (the admin API's JSON) as text.
pub(super) fn text(command: &JwtCommand, v: &Value) -> String {
    match command {
        JwtCommand::Add { .. } => format!(
            "Registered JWT issuer {} ({}, {}) as {}.",
            s(v, "issuer"),
            s(v, "algorithm"),
            s(v, "key_source"),
            s(v, "id")
        ),
        JwtCommand::List { .. } => lines(
            list(v).iter().map(|i| {
                format!(
                    "{}\t{}\t{}\taud={}\t{}\t{}",
                    s(i, "id"),
                    s(i, "tenant_id"),
                    s(i, "issuer"),
                    s(i, "audience"),
                    s(i, "algorithm"),
                    s(i, "key_source")
                )
            }),
            "No JWT issuers.",
        ),
        JwtCommand::Remove { .. } => format!("Removed JWT issuer {} ({}).", s(v, "id"), s(v, "issuer")),
    }
}

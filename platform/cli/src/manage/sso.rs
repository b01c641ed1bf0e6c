//! `hearth admin sso …`: a tenant's OpenID Connect sign-in: set, show, remove — through the
//! admin API ([`remote`]), on the database ([`direct`]), and the answer as text ([`text`]).

use hearth_billing::UsageLedger;
use hearth_gateway::manage::Management;
use hearth_tenants::TenantStore;
use reqwest::Method;
use serde_json::{json, Value};

use super::*;
use crate::args::SsoCommand;

/// Through the gateway's admin API.
pub(super) async fn remote(gw: &AdminClient, command: &SsoCommand) -> anyhow::Result<Value> {
    Ok(match command {
        SsoCommand::Set {
            tenant,
            issuer,
            client_id,
            client_secret,
        } => {
            let spec = sso_spec(issuer, client_id, client_secret);
            gw.call(Method::PUT, &["tenants", tenant, "sso"], &[], Some(json!(spec)))
                .await?
        }
        SsoCommand::Show { tenant } => gw.get(&["tenants", tenant, "sso"], &[]).await?,
        SsoCommand::Remove { tenant } => gw.call(Method::DELETE, &["tenants", tenant, "sso"], &[], None).await?,
    })
}

/// On the database, through the management service.
pub(super) async fn direct(
    manage: &Management<'_>,
    store: &TenantStore,
    _ledger: &UsageLedger,
    command: &SsoCommand,
) -> anyhow::Result<Value> {
    Ok(match command {
        SsoCommand::Set {
            tenant,
            issuer,
            client_id,
            client_secret,
        } => json!(
            manage
                .set_sso(tenant, &sso_spec(issuer, client_id, client_secret))
                .await?
        ),
        SsoCommand::Show { tenant } => json!(store.sso(tenant).await?),
        SsoCommand::Remove { tenant } => json!(manage.remove_sso(tenant).await?),
    })
}

/// The answer `v` (the admin API's JSON) as text.
pub(super) fn text(command: &SsoCommand, v: &Value) -> String {
    match command {
        SsoCommand::Set { tenant, .. } => format!(
            "Tenant {tenant} signs in through {} (client {}{}). Its members sign in at /dashboard/sso?tenant={tenant}; register <public URL>/dashboard/sso/callback as the client's redirect URI.",
            s(v, "issuer"),
            s(v, "client_id"),
            if v["has_client_secret"].as_bool() == Some(true) { ", with a secret" } else { ", public" }
        ),
        SsoCommand::Show { tenant } if v.is_null() => format!("Tenant {tenant} has no identity provider."),
        SsoCommand::Show { .. } => format!(
            "{}\tclient {}\t{}\tsince {}",
            s(v, "issuer"),
            s(v, "client_id"),
            if v["has_client_secret"].as_bool() == Some(true) { "confidential" } else { "public" },
            iso_ms(v["created_at"].as_i64().unwrap_or(0))
        ),
        SsoCommand::Remove { tenant } => format!("Tenant {tenant} no longer signs in through {}.", s(v, "issuer")),
    }
}

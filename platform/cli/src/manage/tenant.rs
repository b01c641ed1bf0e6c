//! `hearth admin tenant …`: tenants: create, list, suspend, resume, limits, budgets —
//! through the admin API ([`remote`]), on the database ([`direct`]), and the answer as text
//! ([`text`]).

use hearth_billing::UsageLedger;
use hearth_gateway::manage::Management;
use hearth_tenants::TenantStore;
use reqwest::Method;
use serde_json::{json, Value};

use super::*;
use crate::args::TenantCommand;

/// Through the gateway's admin API.
pub(super) async fn remote(gw: &AdminClient, command: &TenantCommand) -> anyhow::Result<Value> {
    Ok(match command {
        TenantCommand::Create { name } => {
            gw.call(Method::POST, &["tenants"], &[], Some(json!({"name": name})))
                .await?
        }
        TenantCommand::List => gw.get(&["tenants"], &[]).await?,
        TenantCommand::Suspend { name } => gw.call(Method::POST, &["tenants", name, "suspend"], &[], None).await?,
        TenantCommand::Resume { name } => gw.call(Method::POST, &["tenants", name, "resume"], &[], None).await?,
        TenantCommand::Limits { name, limits: l } => {
            gw.call(
                Method::PUT,
                &["tenants", name, "limits"],
                &[],
                Some(limits_json(l.limits())),
            )
            .await?
        }
        TenantCommand::Budget {
            name,
            monthly_usd,
            soft,
        } => {
            budget_arg(monthly_usd, *soft)?; // the same message as on the database
            let body = json!({"monthly_usd": monthly_usd, "mode": if *soft { "soft" } else { "hard" }});
            gw.call(Method::PUT, &["tenants", name, "budget"], &[], Some(body))
                .await?
        }
    })
}

/// On the database, through the management service.
pub(super) async fn direct(
    manage: &Management<'_>,
    store: &TenantStore,
    _ledger: &UsageLedger,
    command: &TenantCommand,
) -> anyhow::Result<Value> {
    Ok(match command {
        TenantCommand::Create { name } => json!(manage.create_tenant(name).await?),
        TenantCommand::List => json!(store.list_tenants().await?),
        TenantCommand::Suspend { name } => json!(manage.set_suspended(name, true).await?),
        TenantCommand::Resume { name } => json!(manage.set_suspended(name, false).await?),
        TenantCommand::Limits { name, limits } => {
            let l = limits.limits();
            let t = manage.set_tenant_limits(name, l).await?;
            json!({"tenant": t.name, "limits": l})
        }
        TenantCommand::Budget {
            name,
            monthly_usd,
            soft,
        } => {
            let b = budget_arg(monthly_usd, *soft)?;
            let t = manage.set_budget(name, b).await?;
            hearth_gateway::routes::admin::budget_json(&t.name, b)
        }
    })
}

/// The answer `v` (the admin API's JSON) as text.
pub(super) fn text(command: &TenantCommand, v: &Value) -> String {
    match command {
        TenantCommand::Create { .. } => format!("Created tenant {} ({}).", s(v, "name"), s(v, "id")),
        TenantCommand::Suspend { .. } => format!(
            "Suspended tenant {}: its keys, JWTs, sessions and members are refused until `hearth admin tenant resume`.",
            s(v, "name")
        ),
        TenantCommand::Resume { .. } => format!("Resumed tenant {}.", s(v, "name")),
        TenantCommand::List => lines(
            list(v).iter().map(|t| {
                let suspended = if t["suspended_at"].is_i64() { "\tsuspended" } else { "" };
                format!("{}\t{}{suspended}", s(t, "id"), s(t, "name"))
            }),
            "No tenants.",
        ),
        TenantCommand::Limits { .. } => format!("Tenant {} limits: {}.", s(v, "tenant"), limits_text(&v["limits"])),
        TenantCommand::Budget { .. } => match v["budget"].as_object() {
            Some(_) => format!(
                "Tenant {} budget: ${} per month ({}).",
                s(v, "tenant"),
                short_usd(&s(&v["budget"], "monthly_usd")),
                s(&v["budget"], "mode")
            ),
            None => format!("Tenant {} has no budget.", s(v, "tenant")),
        },
    }
}

//! `hearth admin member …`: members and invitations — through the admin API ([`remote`]),
//! on the database ([`direct`]), and the answer as text ([`text`]).

use hearth_billing::UsageLedger;
use hearth_gateway::manage::{Actor, Management};
use hearth_tenants::TenantStore;
use reqwest::Method;
use serde_json::{json, Value};

use super::*;
use crate::args::MemberCommand;

/// Through the gateway's admin API.
pub(super) async fn remote(gw: &AdminClient, command: &MemberCommand) -> anyhow::Result<Value> {
    Ok(match command {
        MemberCommand::Invite {
            tenant, email, role, ..
        } => {
            let role = role_arg(role)?;
            let body = json!({"email": email, "role": role});
            gw.call(Method::POST, &["tenants", tenant, "members"], &[], Some(body))
                .await?
        }
        MemberCommand::List { tenant } => gw.get(&["tenants", tenant, "members"], &[]).await?,
        MemberCommand::Invitations { tenant } => gw.get(&["tenants", tenant, "invitations"], &[]).await?,
        MemberCommand::Role { id, role } => {
            let body = json!({"role": role_arg(role)?});
            gw.call(Method::PUT, &["members", id, "role"], &[], Some(body)).await?
        }
        MemberCommand::Remove { id } => gw.call(Method::DELETE, &["members", id], &[], None).await?,
        MemberCommand::Uninvite { id } => gw.call(Method::DELETE, &["invitations", id], &[], None).await?,
    })
}

/// On the database, through the management service.
pub(super) async fn direct(
    manage: &Management<'_>,
    _store: &TenantStore,
    _ledger: &UsageLedger,
    command: &MemberCommand,
) -> anyhow::Result<Value> {
    Ok(match command {
        MemberCommand::Invite {
            tenant,
            email,
            role,
            public_url,
        } => {
            let (token, inv) = manage
                .invite_member(Actor::Operator, Some(tenant), email, role_arg(role)?)
                .await?;
            let url = format!("{}/dashboard/invite/{token}", public_url.trim_end_matches('/'));
            json!({"invitation": inv, "token": token, "url": url})
        }
        MemberCommand::List { tenant } => json!(manage.list_members(Actor::Operator, Some(tenant)).await?.0),
        MemberCommand::Invitations { tenant } => {
            json!(manage.list_members(Actor::Operator, Some(tenant)).await?.1)
        }
        MemberCommand::Role { id, role } => {
            json!(manage.set_member_role(Actor::Operator, id, role_arg(role)?).await?)
        }
        MemberCommand::Remove { id } => json!(manage.remove_member(Actor::Operator, id).await?),
        MemberCommand::Uninvite { id } => json!(manage.revoke_invitation(Actor::Operator, id).await?),
    })
}

/// The answer `v` (the admin API's JSON) as text.
pub(super) fn text(command: &MemberCommand, v: &Value) -> String {
    match command {
        MemberCommand::Invite { .. } => format!(
            "Invited {} as {} (invitation {}, valid until {}). Send them this link; it is not shown again:\n\n{}\n",
            s(&v["invitation"], "email"),
            s(&v["invitation"], "role"),
            s(&v["invitation"], "id"),
            iso_ms(v["invitation"]["expires_at"].as_i64().unwrap_or(0)),
            s(v, "url")
        ),
        MemberCommand::List { .. } => lines(
            list(v).iter().map(|m| {
                let how = if m["has_password"].as_bool() == Some(true) {
                    "password"
                } else {
                    "no password"
                };
                format!(
                    "{}\t{}\t{}\t{how}\tsince {}",
                    s(m, "id"),
                    s(m, "email"),
                    s(m, "role"),
                    iso_ms(m["created_at"].as_i64().unwrap_or(0))
                )
            }),
            "No members.",
        ),
        MemberCommand::Invitations { .. } => lines(
            list(v).iter().map(|i| {
                format!(
                    "{}\t{}\t{}\tby {}\tuntil {}",
                    s(i, "id"),
                    s(i, "email"),
                    s(i, "role"),
                    s(i, "invited_by"),
                    iso_ms(i["expires_at"].as_i64().unwrap_or(0))
                )
            }),
            "No open invitations.",
        ),
        MemberCommand::Role { .. } => format!("{} ({}) is now {}.", s(v, "email"), s(v, "id"), s(v, "role")),
        MemberCommand::Remove { .. } => format!(
            "Removed {} ({}); their dashboard sessions have ended.",
            s(v, "email"),
            s(v, "id")
        ),
        MemberCommand::Uninvite { .. } => format!("Withdrew the invitation of {} ({}).", s(v, "email"), s(v, "id")),
    }
}

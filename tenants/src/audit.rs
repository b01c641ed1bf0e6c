//! The audit log: who did what to which object, when, and from where. The management
//! service (`hearth_gateway::manage`) writes one entry per successful management action
//! for every adapter — the admin API, the self-service API, the dashboard and the CLI.
//! Entries are never updated or deleted by Hearth.

use serde::Serialize;
use sqlx::Row;

use crate::{now_ms, random_hex, TenantError, TenantStore};

/// One management action.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AuditEntry {
    pub id: String,
    /// Unix ms.
    pub at: i64,
    /// The tenant the object belongs to; None for platform objects (prices, models).
    pub tenant_id: Option<String>,
    /// `admin`, `cli:<user>`, `key:<id>` or `jwt:<issuer id>:<sub>`.
    pub actor: String,
    /// `api`, `dashboard` or `cli`.
    pub channel: String,
    /// The client's address (API and dashboard).
    pub address: Option<String>,
    /// A dotted verb: `key.create`, `processor.activate`, `session.sign_in`, …
    pub action: String,
    /// What it was done to: `key:<id>`, `processor:<id>`, `tenant:<id>`, `model:<id>`, …
    pub object: String,
    /// JSON with the action's parameters (never a secret).
    pub detail: serde_json::Value,
}

/// An entry to write (the id and time are given on write).
#[derive(Debug, Clone)]
pub struct NewAudit<'a> {
    pub tenant_id: Option<&'a str>,
    pub actor: &'a str,
    pub channel: &'a str,
    pub address: Option<&'a str>,
    pub action: &'a str,
    pub object: &'a str,
    pub detail: serde_json::Value,
}

impl TenantStore {
    pub async fn audit(&self, e: &NewAudit<'_>) -> Result<AuditEntry, TenantError> {
        let entry = AuditEntry {
            id: format!("aud_{}", random_hex(10)?),
            at: now_ms(),
            tenant_id: e.tenant_id.map(str::to_string),
            actor: e.actor.to_string(),
            channel: e.channel.to_string(),
            address: e.address.map(str::to_string),
            action: e.action.to_string(),
            object: e.object.to_string(),
            detail: e.detail.clone(),
        };
        sqlx::query(
            "INSERT INTO audit_log (id, at, tenant_id, actor, channel, address, action, object, detail) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
        )
        .bind(&entry.id)
        .bind(entry.at)
        .bind(&entry.tenant_id)
        .bind(&entry.actor)
        .bind(&entry.channel)
        .bind(&entry.address)
        .bind(&entry.action)
        .bind(&entry.object)
        .bind(entry.detail.to_string())
        .execute(&self.pool)
        .await?;
        Ok(entry)
    }

    /// The newest entries first, of one tenant id (None: all), at most `limit`.
    pub async fn audit_log(&self, tenant_id: Option<&str>, limit: u32) -> Result<Vec<AuditEntry>, TenantError> {
        let rows = sqlx::query(
            "SELECT id, at, tenant_id, actor, channel, address, action, object, detail FROM audit_log \
             WHERE ($1 IS NULL OR tenant_id = $1) ORDER BY at DESC, id DESC LIMIT $2",
        )
        .bind(tenant_id)
        .bind(i64::from(limit.min(10_000)))
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .iter()
            .map(|r| AuditEntry {
                id: r.get(0),
                at: r.get(1),
                tenant_id: r.get(2),
                actor: r.get(3),
                channel: r.get(4),
                address: r.get(5),
                action: r.get(6),
                object: r.get(7),
                detail: serde_json::from_str(&r.get::<String, _>(8)).unwrap_or(serde_json::Value::Null),
            })
            .collect())
    }
}

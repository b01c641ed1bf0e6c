//! Stored responses: what the OpenAI Responses API keeps under `store: true` (its default)
//! so that `previous_response_id` can continue a conversation, and `GET`/`DELETE
//! /v1/responses/{id}` and `…/input_items` can read it back. Each is its tenant's own
//! (another tenant's id is simply not found), lives until its expiry, and a tenant keeps at
//! most a quota of them: past it, storing a new one drops that tenant's oldest.

use sqlx::Row;

use crate::{now_ms, TenantError, TenantStore};

/// One stored response.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredResponse {
    pub id: String,
    pub tenant_id: String,
    pub created_at: i64,
    pub expires_at: i64,
    /// The response object as returned (JSON).
    pub response: String,
    /// Its input items, inherited ones first (a JSON array).
    pub input_items: String,
    /// Its output items (a JSON array).
    pub output: String,
}

/// How long responses are kept and how many per tenant.
#[derive(Debug, Clone, Copy)]
pub struct ResponseRetention {
    pub ttl_ms: i64,
    pub max_per_tenant: u64,
}

impl Default for ResponseRetention {
    /// 30 days (OpenAI's retention for stored responses), 10,000 per tenant.
    fn default() -> Self {
        Self {
            ttl_ms: 30 * 24 * 3600 * 1000,
            max_per_tenant: 10_000,
        }
    }
}

impl TenantStore {
    /// Stores `r` (its `expires_at` is set from `retention`); drops the tenant's oldest
    /// responses past the quota. Returns how many were dropped.
    pub async fn store_response(&self, r: &StoredResponse, retention: ResponseRetention) -> Result<u64, TenantError> {
        let bytes = (r.response.len() + r.input_items.len() + r.output.len()) as i64;
        sqlx::query(
            "INSERT INTO stored_responses (id, tenant_id, created_at, expires_at, response, input_items, output, bytes) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
        )
        .bind(&r.id)
        .bind(&r.tenant_id)
        .bind(r.created_at)
        .bind(r.created_at + retention.ttl_ms)
        .bind(&r.response)
        .bind(&r.input_items)
        .bind(&r.output)
        .bind(bytes)
        .execute(&self.pool)
        .await?;
        let count: i64 = sqlx::query("SELECT COUNT(*) FROM stored_responses WHERE tenant_id = $1")
            .bind(&r.tenant_id)
            .fetch_one(&self.pool)
            .await?
            .try_get(0)?;
        let over = count - retention.max_per_tenant as i64;
        if over <= 0 {
            return Ok(0);
        }
        let dropped = sqlx::query(
            "DELETE FROM stored_responses WHERE id IN \
             (SELECT id FROM stored_responses WHERE tenant_id = $1 ORDER BY created_at, id LIMIT $2)",
        )
        .bind(&r.tenant_id)
        .bind(over)
        .execute(&self.pool)
        .await?;
        Ok(dropped.rows_affected())
    }

    /// The tenant's response `id`, if it exists and has not expired.
    pub async fn stored_response(&self, tenant_id: &str, id: &str) -> Result<Option<StoredResponse>, TenantError> {
        let row = sqlx::query(
            "SELECT id, tenant_id, created_at, expires_at, response, input_items, output FROM stored_responses \
             WHERE id = $1 AND tenant_id = $2 AND expires_at > $3",
        )
        .bind(id)
        .bind(tenant_id)
        .bind(now_ms())
        .fetch_optional(&self.pool)
        .await?;
        row.map(|r| {
            Ok(StoredResponse {
                id: r.try_get(0)?,
                tenant_id: r.try_get(1)?,
                created_at: r.try_get(2)?,
                expires_at: r.try_get(3)?,
                response: r.try_get(4)?,
                input_items: r.try_get(5)?,
                output: r.try_get(6)?,
            })
        })
        .transpose()
    }

    /// Deletes the tenant's response `id`; false if it had none by that id.
    pub async fn delete_response(&self, tenant_id: &str, id: &str) -> Result<bool, TenantError> {
        let r = sqlx::query("DELETE FROM stored_responses WHERE id = $1 AND tenant_id = $2 AND expires_at > $3")
            .bind(id)
            .bind(tenant_id)
            .bind(now_ms())
            .execute(&self.pool)
            .await?;
        Ok(r.rows_affected() > 0)
    }

    /// Deletes every expired response; returns how many.
    pub async fn purge_responses(&self) -> Result<u64, TenantError> {
        let r = sqlx::query("DELETE FROM stored_responses WHERE expires_at <= $1")
            .bind(now_ms())
            .execute(&self.pool)
            .await?;
        Ok(r.rows_affected())
    }

    /// How many responses the tenant has stored (expired ones not yet purged included).
    pub async fn stored_response_count(&self, tenant_id: &str) -> Result<u64, TenantError> {
        let n: i64 = sqlx::query("SELECT COUNT(*) FROM stored_responses WHERE tenant_id = $1")
            .bind(tenant_id)
            .fetch_one(&self.pool)
            .await?
            .try_get(0)?;
        Ok(n as u64)
    }
}

//! Stored responses: what the OpenAI Responses API keeps under `store: true` (its default)
//! so that `previous_response_id` can continue a conversation, and `GET`/`DELETE
//! /v1/responses/{id}` and `…/input_items` can read it back. Each is its tenant's own
//! (another tenant's id is simply not found) and lives until its expiry.
//!
//! A response keeps its own items once: a continuation names the response it continues
//! (`previous_id`), and [`TenantStore::conversation`] reads the conversation by walking
//! that chain, oldest first. Storing a continuation extends its ancestors' lives to its own,
//! so a conversation expires as a whole. A tenant's responses are bounded in number and in
//! bytes ([`ResponseRetention`]): past either, storing a new one drops the tenant's least
//! recently continued; a conversation whose earlier response is gone is refused whole
//! ([`Conversation::Broken`]), never silently shortened.

use serde_json::Value;
use sqlx::Row;

use crate::{now_ms, TenantError, TenantStore};

/// One stored response.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredResponse {
    pub id: String,
    pub tenant_id: String,
    pub created_at: i64,
    pub expires_at: i64,
    /// The response object as returned, without its `output` (JSON; [`Self::object`] puts
    /// the output back).
    pub response: String,
    /// Its own input items (a JSON array): what its request sent, item references
    /// resolved. (Rows stored before chains hold their inherited items here too.)
    pub input_items: String,
    /// Its output items (a JSON array).
    pub output: String,
    /// The response it continues (`previous_response_id`): that conversation comes first.
    pub previous_id: Option<String>,
    /// The API key whose request it answered.
    pub key_id: Option<String>,
}

impl StoredResponse {
    /// What the row holds, in bytes: what counts against the quotas.
    pub fn bytes(&self) -> u64 {
        (self.response.len() + self.input_items.len() + self.output.len()) as u64
    }

    /// The response object as it was returned.
    pub fn object(&self) -> Option<Value> {
        let mut o: Value = serde_json::from_str(&self.response).ok()?;
        o.as_object_mut()?
            .insert("output".into(), serde_json::from_str(&self.output).ok()?);
        Some(o)
    }
}

/// How long responses are kept, and how many and how many bytes per tenant.
#[derive(Debug, Clone, Copy)]
pub struct ResponseRetention {
    pub ttl_ms: i64,
    pub max_per_tenant: u64,
    /// All of a tenant's stored responses together, in bytes.
    pub max_tenant_bytes: u64,
    /// One response as stored (its object, own input items and output), in bytes: a request
    /// that would store more is refused before it runs.
    pub max_response_bytes: u64,
    /// A conversation read back (a response and every response before it), in bytes.
    pub max_conversation_bytes: u64,
}

impl Default for ResponseRetention {
    /// 30 days (OpenAI's retention for stored responses); per tenant 10,000 responses and
    /// 1 GiB (as its files); 4 MiB per response, 16 MiB per conversation.
    fn default() -> Self {
        Self {
            ttl_ms: 30 * 24 * 3600 * 1000,
            max_per_tenant: 10_000,
            max_tenant_bytes: 1 << 30,
            max_response_bytes: 4 << 20,
            max_conversation_bytes: 16 << 20,
        }
    }
}

/// What storing a response did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Stored {
    /// The tenant's responses dropped to stay within its quotas.
    pub dropped: u64,
    /// The tenant's stored responses and their bytes afterwards.
    pub count: u64,
    pub bytes: u64,
}

/// A conversation read back for a continuation.
#[derive(Debug, Clone, PartialEq)]
pub enum Conversation {
    /// Each response of the chain, oldest first (the one asked for last).
    Found(Vec<StoredResponse>),
    /// The tenant has no live response by that id.
    NotFound,
    /// An earlier response of the chain has expired or was deleted: `missing` is its id.
    Broken { missing: String },
    /// The chain holds more bytes than the bound.
    TooLarge { bytes: u64 },
}

/// One tenant's stored responses, for the dashboard and `/metrics`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResponseTotals {
    pub tenant_id: String,
    pub tenant_name: String,
    pub count: u64,
    pub bytes: u64,
}

/// Responses in one chain, at most (a guard for the walk; bytes bound it first).
const MAX_CHAIN: i64 = 1_000_000;

/// The walk from response `$1` of tenant `$2` to the start of its conversation, live at `$3`,
/// at most `$4` deep: `chain(id, previous_id, depth)`, depth 0 the response itself.
const CHAIN: &str = "WITH RECURSIVE chain(id, previous_id, depth) AS ( \
               SELECT id, previous_id, CAST(0 AS BIGINT) FROM stored_responses \
               WHERE id = $1 AND tenant_id = $2 AND expires_at > $3 \
               UNION ALL SELECT s.id, s.previous_id, c.depth + 1 FROM stored_responses s JOIN chain c ON s.id = c.previous_id \
               WHERE s.tenant_id = $2 AND s.expires_at > $3 AND c.depth < $4)";

const COLUMNS: &str = "id, tenant_id, created_at, expires_at, response, input_items, output, previous_id, key_id";

fn row_of(r: &sqlx::any::AnyRow) -> Result<StoredResponse, TenantError> {
    Ok(StoredResponse {
        id: r.try_get(0)?,
        tenant_id: r.try_get(1)?,
        created_at: r.try_get(2)?,
        expires_at: r.try_get(3)?,
        response: r.try_get(4)?,
        input_items: r.try_get(5)?,
        output: r.try_get(6)?,
        previous_id: r.try_get(7)?,
        key_id: r.try_get(8)?,
    })
}

impl TenantStore {
    /// Stores `r` (its `expires_at` is set from `retention`), extends the lives of the
    /// responses it continues to its own, and drops the tenant's least recently continued
    /// responses past the quotas (never `r` itself).
    pub async fn store_response(
        &self,
        r: &StoredResponse,
        retention: ResponseRetention,
    ) -> Result<Stored, TenantError> {
        let expires_at = r.created_at + retention.ttl_ms;
        sqlx::query(
            "INSERT INTO stored_responses (id, tenant_id, created_at, expires_at, response, input_items, output, bytes, previous_id, key_id) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
        )
        .bind(&r.id)
        .bind(&r.tenant_id)
        .bind(r.created_at)
        .bind(expires_at)
        .bind(&r.response)
        .bind(&r.input_items)
        .bind(&r.output)
        .bind(r.bytes() as i64)
        .bind(&r.previous_id)
        .bind(&r.key_id)
        .execute(&self.pool)
        .await?;
        if r.previous_id.is_some() {
            sqlx::query(
                "WITH RECURSIVE chain(id) AS ( \
                   SELECT previous_id FROM stored_responses WHERE id = $1 AND tenant_id = $2 \
                   UNION SELECT s.previous_id FROM stored_responses s JOIN chain c ON s.id = c.id \
                   WHERE s.tenant_id = $2 AND s.previous_id IS NOT NULL) \
                 UPDATE stored_responses SET expires_at = $3 \
                 WHERE tenant_id = $2 AND expires_at < $3 AND id IN (SELECT id FROM chain)",
            )
            .bind(&r.id)
            .bind(&r.tenant_id)
            .bind(expires_at)
            .execute(&self.pool)
            .await?;
        }
        let (mut count, mut bytes) = self.response_usage(&r.tenant_id).await?;
        let mut dropped = 0;
        while count > retention.max_per_tenant || bytes > retention.max_tenant_bytes {
            let oldest = sqlx::query(
                "SELECT id, bytes FROM stored_responses WHERE tenant_id = $1 AND id <> $2 \
                 ORDER BY expires_at, created_at, id LIMIT 256",
            )
            .bind(&r.tenant_id)
            .bind(&r.id)
            .fetch_all(&self.pool)
            .await?;
            if oldest.is_empty() {
                break;
            }
            for row in oldest {
                if count <= retention.max_per_tenant && bytes <= retention.max_tenant_bytes {
                    break;
                }
                let (id, size): (String, i64) = (row.try_get(0)?, row.try_get(1)?);
                let gone = sqlx::query("DELETE FROM stored_responses WHERE id = $1 AND tenant_id = $2")
                    .bind(&id)
                    .bind(&r.tenant_id)
                    .execute(&self.pool)
                    .await?
                    .rows_affected();
                if gone > 0 {
                    dropped += 1;
                    count = count.saturating_sub(1);
                    bytes = bytes.saturating_sub(size as u64);
                }
            }
        }
        Ok(Stored { dropped, count, bytes })
    }

    /// The tenant's response `id`, if it exists and has not expired.
    pub async fn stored_response(&self, tenant_id: &str, id: &str) -> Result<Option<StoredResponse>, TenantError> {
        let row = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM stored_responses WHERE id = $1 AND tenant_id = $2 AND expires_at > $3"
        ))
        .bind(id)
        .bind(tenant_id)
        .bind(now_ms())
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(row_of).transpose()
    }

    /// The conversation response `id` ends: every response of its chain, oldest first, if
    /// together they hold at most `max_bytes` (their sizes are read before their items).
    pub async fn conversation(&self, tenant_id: &str, id: &str, max_bytes: u64) -> Result<Conversation, TenantError> {
        let now = now_ms();
        let links = sqlx::query(&format!(
            "{CHAIN} SELECT c.id, c.previous_id, r.bytes FROM chain c JOIN stored_responses r ON r.id = c.id ORDER BY c.depth"
        ))
        .bind(id)
        .bind(tenant_id)
        .bind(now)
        .bind(MAX_CHAIN)
        .fetch_all(&self.pool)
        .await?;
        let Some(last) = links.last() else {
            return Ok(Conversation::NotFound);
        };
        let missing: Option<String> = last.try_get(1)?;
        if let Some(missing) = missing {
            return Ok(Conversation::Broken { missing });
        }
        let mut total = 0u64;
        let mut ids = Vec::with_capacity(links.len());
        for l in &links {
            total = total.saturating_add(l.try_get::<i64, _>(2)?.max(0) as u64);
            ids.push(l.try_get::<String, _>(0)?);
        }
        if total > max_bytes {
            return Ok(Conversation::TooLarge { bytes: total });
        }
        // The rows themselves in one statement: the same walk, oldest first.
        let columns: Vec<String> = COLUMNS.split(", ").map(|c| format!("r.{c}")).collect();
        let rows = sqlx::query(&format!(
            "{CHAIN} SELECT {} FROM chain c JOIN stored_responses r ON r.id = c.id ORDER BY c.depth DESC",
            columns.join(", ")
        ))
        .bind(id)
        .bind(tenant_id)
        .bind(now)
        .bind(MAX_CHAIN)
        .fetch_all(&self.pool)
        .await?;
        let chain = rows.iter().map(row_of).collect::<Result<Vec<_>, _>>()?;
        if chain.len() != ids.len() {
            // A response was deleted or expired between the two reads.
            let missing = ids.iter().find(|i| !chain.iter().any(|r| &r.id == *i));
            return Ok(Conversation::Broken {
                missing: missing.cloned().unwrap_or_default(),
            });
        }
        Ok(Conversation::Found(chain))
    }

    /// Deletes the tenant's response `id`; false if it had none by that id. (The responses
    /// that continue it can no longer be continued: their conversation is broken.)
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
        Ok(self.response_usage(tenant_id).await?.0)
    }

    /// The tenant's stored responses and their bytes (expired ones not yet purged included).
    pub async fn response_usage(&self, tenant_id: &str) -> Result<(u64, u64), TenantError> {
        let row = sqlx::query(
            "SELECT COUNT(*), CAST(COALESCE(SUM(bytes), 0) AS BIGINT) FROM stored_responses WHERE tenant_id = $1",
        )
        .bind(tenant_id)
        .fetch_one(&self.pool)
        .await?;
        Ok((row.try_get::<i64, _>(0)? as u64, row.try_get::<i64, _>(1)? as u64))
    }

    /// Every tenant's stored responses that has any, by tenant.
    pub async fn response_totals(&self) -> Result<Vec<ResponseTotals>, TenantError> {
        let rows = sqlx::query(
            "SELECT s.tenant_id, t.name, COUNT(*), CAST(COALESCE(SUM(s.bytes), 0) AS BIGINT) \
             FROM stored_responses s JOIN tenants t ON t.id = s.tenant_id GROUP BY s.tenant_id, t.name",
        )
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| {
                Ok(ResponseTotals {
                    tenant_id: r.try_get(0)?,
                    tenant_name: r.try_get(1)?,
                    count: r.try_get::<i64, _>(2)? as u64,
                    bytes: r.try_get::<i64, _>(3)? as u64,
                })
            })
            .collect()
    }
}

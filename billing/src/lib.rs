//! Usage records: one row per request, keyed by request id, written before the client
//! receives its final response (write-before-ack), so a completed response always has its
//! record. Prices, rating, the ledger and exports arrive with the billing issue.

use serde::Serialize;
use sqlx::{Row, SqlitePool};

#[derive(Debug, thiserror::Error)]
pub enum BillingError {
    #[error("database error: {0}")]
    Db(#[from] sqlx::Error),
}

/// How a request ended, for billing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum UsageStatus {
    Completed,
    /// The client went away; what was generated is still recorded.
    Cancelled,
    Failed,
}

impl UsageStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Completed => "completed",
            Self::Cancelled => "cancelled",
            Self::Failed => "failed",
        }
    }
}

/// One request's usage. Token classes: `prompt_tokens` includes `cached_tokens`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct UsageRecord {
    pub request_id: String,
    pub tenant_id: String,
    pub key_id: Option<String>,
    pub model: String,
    pub endpoint: String,
    pub prompt_tokens: u32,
    pub cached_tokens: u32,
    pub completion_tokens: u32,
    pub status: String,
    pub finish_reason: Option<String>,
    pub error_code: Option<String>,
    pub started_at: i64,
    pub finished_at: i64,
}

/// Usage rows over SQLite.
#[derive(Debug, Clone)]
pub struct UsageLedger {
    pool: SqlitePool,
}

impl UsageLedger {
    pub fn new(pool: SqlitePool) -> Self {
        Self { pool }
    }

    /// Records a request's usage. Idempotent by request id: a replay changes nothing.
    pub async fn record(&self, u: &UsageRecord) -> Result<bool, BillingError> {
        let res = sqlx::query(
            "INSERT INTO usage_records (request_id, tenant_id, key_id, model, endpoint, prompt_tokens, cached_tokens, \
             completion_tokens, status, finish_reason, error_code, started_at, finished_at) \
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT(request_id) DO NOTHING",
        )
        .bind(&u.request_id)
        .bind(&u.tenant_id)
        .bind(&u.key_id)
        .bind(&u.model)
        .bind(&u.endpoint)
        .bind(u.prompt_tokens)
        .bind(u.cached_tokens)
        .bind(u.completion_tokens)
        .bind(&u.status)
        .bind(&u.finish_reason)
        .bind(&u.error_code)
        .bind(u.started_at)
        .bind(u.finished_at)
        .execute(&self.pool)
        .await?;
        Ok(res.rows_affected() == 1)
    }

    /// The most recent records, newest first, optionally for one tenant id.
    pub async fn recent(&self, tenant_id: Option<&str>, limit: u32) -> Result<Vec<UsageRecord>, BillingError> {
        let rows = sqlx::query(
            "SELECT request_id, tenant_id, key_id, model, endpoint, prompt_tokens, cached_tokens, completion_tokens, \
             status, finish_reason, error_code, started_at, finished_at FROM usage_records \
             WHERE (?1 IS NULL OR tenant_id = ?1) ORDER BY started_at DESC, request_id LIMIT ?2",
        )
        .bind(tenant_id)
        .bind(limit)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .iter()
            .map(|r| UsageRecord {
                request_id: r.get(0),
                tenant_id: r.get(1),
                key_id: r.get(2),
                model: r.get(3),
                endpoint: r.get(4),
                prompt_tokens: r.get(5),
                cached_tokens: r.get(6),
                completion_tokens: r.get(7),
                status: r.get(8),
                finish_reason: r.get(9),
                error_code: r.get(10),
                started_at: r.get(11),
                finished_at: r.get(12),
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn records_are_idempotent_by_request_id() {
        let pool = SqlitePool::connect("sqlite::memory:").await.unwrap();
        sqlx::migrate!("../migrations/sqlite").run(&pool).await.unwrap();
        sqlx::query("INSERT INTO tenants (id, name, created_at) VALUES ('tn_1', 'a', 0)")
            .execute(&pool)
            .await
            .unwrap();
        let l = UsageLedger::new(pool);
        let mut u = UsageRecord {
            request_id: "req_1".into(),
            tenant_id: "tn_1".into(),
            key_id: Some("k".into()),
            model: "m".into(),
            endpoint: "/v1/chat/completions".into(),
            prompt_tokens: 42,
            cached_tokens: 0,
            completion_tokens: 8,
            status: UsageStatus::Completed.as_str().into(),
            finish_reason: Some("stop".into()),
            error_code: None,
            started_at: 1,
            finished_at: 2,
        };
        assert!(l.record(&u).await.unwrap());
        u.completion_tokens = 999;
        assert!(!l.record(&u).await.unwrap(), "a replay must not write");
        let rows = l.recent(Some("tn_1"), 10).await.unwrap();
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0].completion_tokens, 8);
        assert!(l.recent(Some("other"), 10).await.unwrap().is_empty());
        assert_eq!(l.recent(None, 10).await.unwrap().len(), 1);
    }
}

//! The OpenAI Files and Batch APIs as stored: files (their bytes in the database, so every
//! gateway sharing it serves them), batches, and a batch's lines with their state.
//!
//! A line is claimed by a conditional update — `pending`, or `running` under a lease that
//! ran out (its gateway died) — so gateways sharing the database never run a line at the
//! same time; its owner renews the lease while it runs, and only the owner's result is kept
//! ([`TenantStore::finish_line`]), so no line is answered twice. A batch is finished once in
//! one transaction: its output and error files written, its status set.

use serde::Serialize;
use sqlx::any::AnyRow;
use sqlx::Row;

use crate::{now_ms, random_hex, TenantError, TenantStore};

/// A file's size, at most (OpenAI's Batch API takes up to 200 MB).
pub const MAX_FILE_BYTES: usize = 100 << 20;
/// What one tenant's files may hold together, by default (`TenantStore::file_quota`; batch
/// outputs are bounded by their lines: see [`MAX_RESULT_BYTES`]).
pub const MAX_TENANT_FILE_BYTES: i64 = 1 << 30;
/// One line's answer as kept, at most: a larger one is kept as an error.
pub const MAX_RESULT_BYTES: usize = 1 << 20;
/// Lines in one batch, at most (OpenAI's limit).
pub const MAX_BATCH_LINES: usize = 50_000;
/// Batches of one tenant not yet finished, at most.
pub const MAX_OPEN_BATCHES: i64 = 16;
/// The completion window, the only one offered (OpenAI's).
pub const COMPLETION_WINDOW_MS: i64 = 24 * 3600 * 1000;

/// A file as the Files API lists it (without its bytes).
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct FileInfo {
    pub id: String,
    pub tenant_id: String,
    /// `batch` (an upload) or `batch_output` (a batch's output or error file).
    pub purpose: String,
    pub filename: String,
    pub bytes: i64,
    pub created_at: i64,
    /// The API key that created it (an upload's, or its batch's for a batch output).
    #[serde(skip)]
    pub key_id: Option<String>,
}

/// The states of a batch, as OpenAI names them.
pub mod status {
    pub const IN_PROGRESS: &str = "in_progress";
    pub const FINALIZING: &str = "finalizing";
    pub const COMPLETED: &str = "completed";
    pub const EXPIRED: &str = "expired";
    pub const CANCELLING: &str = "cancelling";
    pub const CANCELLED: &str = "cancelled";
}

/// A batch as stored, with its lines counted.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct BatchInfo {
    pub id: String,
    pub tenant_id: String,
    /// The API key whose tenant, limits and models the lines run under.
    pub key_id: String,
    pub endpoint: String,
    pub input_file_id: String,
    pub completion_window: String,
    pub status: String,
    pub metadata: Option<String>,
    pub paused_reason: Option<String>,
    pub output_file_id: Option<String>,
    pub error_file_id: Option<String>,
    pub created_at: i64,
    pub in_progress_at: Option<i64>,
    pub expires_at: i64,
    pub finalizing_at: Option<i64>,
    pub completed_at: Option<i64>,
    pub expired_at: Option<i64>,
    pub cancelling_at: Option<i64>,
    pub cancelled_at: Option<i64>,
    pub counts: LineCounts,
}

/// A batch's lines by outcome.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq, Eq)]
pub struct LineCounts {
    pub total: i64,
    /// Answered with a 2xx status.
    pub completed: i64,
    /// Answered otherwise, or refused when the batch was created.
    pub failed: i64,
}

/// One line of a new batch: a request to run, or one refused as written.
#[derive(Debug, Clone)]
pub enum NewLine {
    Request {
        custom_id: String,
        body: String,
    },
    /// Not a request (not JSON, another endpoint, …): it goes to the error file with this
    /// error.
    Refused {
        custom_id: Option<String>,
        code: &'static str,
        message: String,
    },
}

/// A batch not finished, as the runner sees it.
#[derive(Debug, Clone)]
pub struct OpenBatch {
    pub id: String,
    pub tenant_id: String,
    pub key_id: String,
    pub status: String,
    pub expires_at: i64,
    pub endpoint: String,
}

/// A line claimed to run.
#[derive(Debug, Clone)]
pub struct ClaimedLine {
    pub batch_id: String,
    pub line: i64,
    /// Runs sent back before this one.
    pub attempt: i64,
    pub custom_id: String,
    pub body: String,
}

impl ClaimedLine {
    /// This run's request id (and the output line's id).
    pub fn request_id(&self) -> String {
        line_request_id(&self.batch_id, self.line, self.attempt)
    }
}

/// What a line's run came to.
#[derive(Debug, Clone)]
pub struct LineResult {
    pub status_code: Option<i64>,
    /// The output line's JSON.
    pub result: String,
}

const FILE_COLUMNS: &str = "id, tenant_id, purpose, filename, bytes, created_at, key_id";
const BATCH_COLUMNS: &str = "id, tenant_id, key_id, endpoint, input_file_id, completion_window, status, metadata, \
     paused_reason, output_file_id, error_file_id, created_at, in_progress_at, expires_at, finalizing_at, \
     completed_at, expired_at, cancelling_at, cancelled_at";

fn file_info(r: &AnyRow) -> FileInfo {
    FileInfo {
        id: r.get(0),
        tenant_id: r.get(1),
        purpose: r.get(2),
        filename: r.get(3),
        bytes: r.get(4),
        created_at: r.get(5),
        key_id: r.get(6),
    }
}

fn batch_info(r: &AnyRow, counts: LineCounts) -> BatchInfo {
    BatchInfo {
        id: r.get(0),
        tenant_id: r.get(1),
        key_id: r.get(2),
        endpoint: r.get(3),
        input_file_id: r.get(4),
        completion_window: r.get(5),
        status: r.get(6),
        metadata: r.get(7),
        paused_reason: r.get(8),
        output_file_id: r.get(9),
        error_file_id: r.get(10),
        created_at: r.get(11),
        in_progress_at: r.get(12),
        expires_at: r.get(13),
        finalizing_at: r.get(14),
        completed_at: r.get(15),
        expired_at: r.get(16),
        cancelling_at: r.get(17),
        cancelled_at: r.get(18),
        counts,
    }
}

fn invalid(field: &'static str, message: impl Into<String>) -> TenantError {
    TenantError::Invalid {
        field,
        message: message.into(),
    }
}

/// The page of a listing: `after` an id (in newest-first order), at most `limit`.
#[derive(Debug, Clone, Default)]
pub struct Page {
    pub after: Option<String>,
    pub limit: i64,
}

impl TenantStore {
    // ---- files ---------------------------------------------------------------------------

    /// Stores a file uploaded by `key_id` of `tenant` (its id), within the tenant's file
    /// quota.
    pub async fn add_file(
        &self,
        tenant_id: &str,
        key_id: Option<&str>,
        purpose: &str,
        filename: &str,
        content: &[u8],
    ) -> Result<FileInfo, TenantError> {
        if content.len() > MAX_FILE_BYTES {
            return Err(invalid(
                "file",
                format!(
                    "the file has {} bytes; at most {MAX_FILE_BYTES} are accepted",
                    content.len()
                ),
            ));
        }
        // The quota holds under concurrent uploads (and gateways): the tenant's row is
        // written first, so uploads of one tenant check and insert one at a time (a row lock
        // on PostgreSQL, the write lock on SQLite).
        let mut tx = self.pool.begin().await?;
        let held = sqlx::query("UPDATE tenants SET id = id WHERE id = $1")
            .bind(tenant_id)
            .execute(&mut *tx)
            .await?;
        if held.rows_affected() == 0 {
            return Err(TenantError::NoSuchTenant(tenant_id.to_string()));
        }
        let used = self.file_bytes_in(&mut *tx, tenant_id).await?;
        let quota = self.file_quota;
        if used + content.len() as i64 > quota {
            return Err(invalid(
                "file",
                format!(
                    "the tenant's files hold {used} bytes; this one would pass the quota of {quota} bytes (delete files no longer needed)"
                ),
            ));
        }
        let id = format!("file-{}", random_hex(12)?);
        self.insert_file(&mut *tx, &id, (tenant_id, key_id), purpose, filename, content)
            .await?;
        tx.commit().await?;
        self.file(tenant_id, &id).await
    }

    /// What the tenant's files hold together, in bytes (batch outputs included).
    pub async fn file_bytes(&self, tenant_id: &str) -> Result<i64, TenantError> {
        self.file_bytes_in(&self.pool, tenant_id).await
    }

    async fn file_bytes_in<'e, E>(&self, exec: E, tenant_id: &str) -> Result<i64, TenantError>
    where
        E: sqlx::Executor<'e, Database = sqlx::Any>,
    {
        Ok(
            sqlx::query_scalar("SELECT CAST(COALESCE(SUM(bytes), 0) AS BIGINT) FROM files WHERE tenant_id = $1")
                .bind(tenant_id)
                .fetch_one(exec)
                .await?,
        )
    }

    async fn insert_file<'e, E>(
        &self,
        exec: E,
        id: &str,
        (tenant_id, key_id): (&str, Option<&str>),
        purpose: &str,
        filename: &str,
        content: &[u8],
    ) -> Result<(), TenantError>
    where
        E: sqlx::Executor<'e, Database = sqlx::Any>,
    {
        sqlx::query(
            "INSERT INTO files (id, tenant_id, purpose, filename, bytes, content, created_at, key_id) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT (id) DO NOTHING",
        )
        .bind(id)
        .bind(tenant_id)
        .bind(purpose)
        .bind(filename)
        .bind(content.len() as i64)
        .bind(content.to_vec())
        .bind(now_ms())
        .bind(key_id)
        .execute(exec)
        .await?;
        Ok(())
    }

    /// A tenant's file; another tenant's is [`TenantError::NoSuchFile`], as a missing one.
    pub async fn file(&self, tenant_id: &str, id: &str) -> Result<FileInfo, TenantError> {
        let r = sqlx::query(&format!(
            "SELECT {FILE_COLUMNS} FROM files WHERE id = $1 AND tenant_id = $2"
        ))
        .bind(id)
        .bind(tenant_id)
        .fetch_optional(&self.pool)
        .await?
        .ok_or_else(|| TenantError::NoSuchFile(id.to_string()))?;
        Ok(file_info(&r))
    }

    /// A tenant's file's bytes.
    pub async fn file_content(&self, tenant_id: &str, id: &str) -> Result<(FileInfo, Vec<u8>), TenantError> {
        let r = sqlx::query(&format!(
            "SELECT {FILE_COLUMNS}, content FROM files WHERE id = $1 AND tenant_id = $2"
        ))
        .bind(id)
        .bind(tenant_id)
        .fetch_optional(&self.pool)
        .await?
        .ok_or_else(|| TenantError::NoSuchFile(id.to_string()))?;
        Ok((file_info(&r), r.get(7)))
    }

    /// A tenant's files, newest first, optionally of one purpose and only `key_id`'s.
    pub async fn list_files(
        &self,
        tenant_id: &str,
        key_id: Option<&str>,
        purpose: Option<&str>,
        page: &Page,
    ) -> Result<Vec<FileInfo>, TenantError> {
        let before = match &page.after {
            Some(id) => Some(self.file(tenant_id, id).await?),
            None => None,
        };
        let rows = sqlx::query(&format!(
            "SELECT {FILE_COLUMNS} FROM files WHERE tenant_id = $1 AND ($2 IS NULL OR purpose = $2) \
             AND ($3 IS NULL OR created_at < $3 OR (created_at = $3 AND id < $4)) \
             AND ($6 IS NULL OR key_id = $6) \
             ORDER BY created_at DESC, id DESC LIMIT $5"
        ))
        .bind(tenant_id)
        .bind(purpose)
        .bind(before.as_ref().map(|f| f.created_at))
        .bind(before.as_ref().map_or("", |f| f.id.as_str()))
        .bind(page.limit)
        .bind(key_id)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.iter().map(file_info).collect())
    }

    /// Deletes a tenant's file. A batch's input may be deleted once the batch has read it
    /// (its lines are stored with it).
    pub async fn delete_file(&self, tenant_id: &str, id: &str) -> Result<FileInfo, TenantError> {
        let info = self.file(tenant_id, id).await?;
        sqlx::query("DELETE FROM files WHERE id = $1 AND tenant_id = $2")
            .bind(id)
            .bind(tenant_id)
            .execute(&self.pool)
            .await?;
        Ok(info)
    }

    // ---- batches -------------------------------------------------------------------------

    /// Creates a batch of `lines` (read from `input_file_id`) for the key `key_id` of
    /// `tenant_id`, in progress at once.
    pub async fn create_batch(
        &self,
        tenant_id: &str,
        key_id: &str,
        endpoint: &str,
        input_file_id: &str,
        metadata: Option<String>,
        lines: &[NewLine],
    ) -> Result<BatchInfo, TenantError> {
        if lines.is_empty() {
            return Err(invalid("input_file_id", "the input file has no lines"));
        }
        if lines.len() > MAX_BATCH_LINES {
            return Err(invalid(
                "input_file_id",
                format!(
                    "the input file has {} lines; a batch takes at most {MAX_BATCH_LINES}",
                    lines.len()
                ),
            ));
        }
        let id = format!("batch_{}", random_hex(12)?);
        let now = now_ms();
        let mut tx = self.pool.begin().await?;
        // The tenant's row locked (SQLite: the write lock): concurrent creations count one
        // after the other.
        sqlx::query("UPDATE tenants SET name = name WHERE id = $1")
            .bind(tenant_id)
            .execute(&mut *tx)
            .await?;
        let open: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM batches WHERE tenant_id = $1 AND status IN ('in_progress', 'finalizing', 'cancelling')",
        )
        .bind(tenant_id)
        .fetch_one(&mut *tx)
        .await?;
        if open >= MAX_OPEN_BATCHES {
            return Err(TenantError::Conflict(format!(
                "the tenant has {open} batches running, the most it may; wait for one to finish or cancel one"
            )));
        }
        sqlx::query(
            "INSERT INTO batches (id, tenant_id, key_id, endpoint, input_file_id, completion_window, status, metadata, \
             total, created_at, in_progress_at, expires_at) VALUES ($1, $2, $3, $4, $5, '24h', 'in_progress', $6, $7, $8, $8, $9)",
        )
        .bind(&id)
        .bind(tenant_id)
        .bind(key_id)
        .bind(endpoint)
        .bind(input_file_id)
        .bind(metadata)
        .bind(lines.len() as i64)
        .bind(now)
        .bind(now + COMPLETION_WINDOW_MS)
        .execute(&mut *tx)
        .await?;
        // Many lines per statement, all in one transaction: a batch appears whole or not at all.
        const ROWS: usize = 200;
        for (c, chunk) in lines.chunks(ROWS).enumerate() {
            let values: Vec<String> = (0..chunk.len())
                .map(|k| {
                    let b = k * 7;
                    format!(
                        "(${}, ${}, ${}, ${}, ${}, ${}, ${})",
                        b + 1,
                        b + 2,
                        b + 3,
                        b + 4,
                        b + 5,
                        b + 6,
                        b + 7
                    )
                })
                .collect();
            let sql = format!(
                "INSERT INTO batch_lines (batch_id, line, custom_id, body, state, result, finished_at) VALUES {}",
                values.join(", ")
            );
            let mut q = sqlx::query(&sql);
            for (k, l) in chunk.iter().enumerate() {
                let line = (c * ROWS + k) as i64;
                q = q.bind(id.clone()).bind(line);
                q = match l {
                    NewLine::Request { custom_id, body } => q
                        .bind(Some(custom_id.clone()))
                        .bind(Some(body.clone()))
                        .bind("pending")
                        .bind(None::<String>)
                        .bind(None::<i64>),
                    NewLine::Refused {
                        custom_id,
                        code,
                        message,
                    } => q
                        .bind(custom_id.clone())
                        .bind(None::<String>)
                        .bind("done")
                        .bind(Some(
                            error_line(&line_request_id(&id, line, 0), custom_id.as_deref(), code, message).to_string(),
                        ))
                        .bind(Some(now)),
                };
            }
            q.execute(&mut *tx).await?;
        }
        tx.commit().await?;
        self.batch(tenant_id, &id).await
    }

    /// A tenant's batch; another tenant's is [`TenantError::NoSuchBatch`], as a missing one.
    pub async fn batch(&self, tenant_id: &str, id: &str) -> Result<BatchInfo, TenantError> {
        let r = sqlx::query(&format!(
            "SELECT {BATCH_COLUMNS} FROM batches WHERE id = $1 AND tenant_id = $2"
        ))
        .bind(id)
        .bind(tenant_id)
        .fetch_optional(&self.pool)
        .await?
        .ok_or_else(|| TenantError::NoSuchBatch(id.to_string()))?;
        let counts = self.line_counts(id).await?;
        Ok(batch_info(&r, counts))
    }

    async fn line_counts(&self, id: &str) -> Result<LineCounts, TenantError> {
        let rows = sqlx::query(
            "SELECT state, CAST(CASE WHEN status_code >= 200 AND status_code < 300 THEN 1 ELSE 0 END AS BIGINT) AS ok, \
             COUNT(*) FROM batch_lines WHERE batch_id = $1 GROUP BY state, ok",
        )
        .bind(id)
        .fetch_all(&self.pool)
        .await?;
        let mut c = LineCounts::default();
        for r in rows {
            let state: String = r.get(0);
            let ok: i64 = r.get(1);
            let n: i64 = r.get(2);
            c.total += n;
            match (state.as_str(), ok) {
                ("done", 1) => c.completed += n,
                ("done", _) => c.failed += n,
                _ => {}
            }
        }
        Ok(c)
    }

    /// A tenant's batches, newest first (only `key_id`'s when given).
    pub async fn list_batches(
        &self,
        tenant_id: &str,
        key_id: Option<&str>,
        page: &Page,
    ) -> Result<Vec<BatchInfo>, TenantError> {
        let before = match &page.after {
            Some(id) => Some(self.batch(tenant_id, id).await?),
            None => None,
        };
        let rows = sqlx::query(&format!(
            "SELECT {BATCH_COLUMNS} FROM batches WHERE tenant_id = $1 \
             AND ($2 IS NULL OR created_at < $2 OR (created_at = $2 AND id < $3)) \
             AND ($5 IS NULL OR key_id = $5) \
             ORDER BY created_at DESC, id DESC LIMIT $4"
        ))
        .bind(tenant_id)
        .bind(before.as_ref().map(|b| b.created_at))
        .bind(before.as_ref().map_or("", |b| b.id.as_str()))
        .bind(page.limit)
        .bind(key_id)
        .fetch_all(&self.pool)
        .await?;
        let mut out = Vec::with_capacity(rows.len());
        for r in &rows {
            let id: String = r.get(0);
            out.push(batch_info(r, self.line_counts(&id).await?));
        }
        Ok(out)
    }

    /// Cancels a tenant's batch: no new line starts; the lines running finish, then the
    /// batch is `cancelled`. Cancelling a finished batch is a conflict.
    pub async fn cancel_batch(&self, tenant_id: &str, id: &str) -> Result<BatchInfo, TenantError> {
        let b = self.batch(tenant_id, id).await?;
        if b.status == status::CANCELLING || b.status == status::CANCELLED {
            return Ok(b);
        }
        let res = sqlx::query(
            "UPDATE batches SET status = 'cancelling', cancelling_at = $1 WHERE id = $2 AND tenant_id = $3 \
             AND status = 'in_progress'",
        )
        .bind(now_ms())
        .bind(id)
        .bind(tenant_id)
        .execute(&self.pool)
        .await?;
        if res.rows_affected() == 0 {
            return Err(TenantError::Conflict(format!(
                "batch {id} is {} and cannot be cancelled",
                self.batch(tenant_id, id).await?.status
            )));
        }
        self.batch(tenant_id, id).await
    }

    /// Batches whose lines may run or which wait to be finished, oldest first (every tenant's).
    pub async fn open_batches(&self) -> Result<Vec<OpenBatch>, TenantError> {
        let rows = sqlx::query(
            "SELECT id, key_id, status, expires_at, endpoint, tenant_id FROM batches \
             WHERE status IN ('in_progress', 'finalizing', 'cancelling') ORDER BY created_at",
        )
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .iter()
            .map(|r| OpenBatch {
                id: r.get(0),
                key_id: r.get(1),
                status: r.get(2),
                expires_at: r.get(3),
                endpoint: r.get(4),
                tenant_id: r.get(5),
            })
            .collect())
    }

    /// Records why a batch's lines do not run now (None: they do; a batch that was not
    /// paused is not written).
    pub async fn set_batch_paused(&self, id: &str, reason: Option<&str>) -> Result<(), TenantError> {
        let q = match reason {
            Some(r) => {
                sqlx::query("UPDATE batches SET paused_reason = $1 WHERE id = $2 AND status = 'in_progress'").bind(r)
            }
            None => sqlx::query("UPDATE batches SET paused_reason = NULL WHERE id = $1 AND paused_reason IS NOT NULL"),
        };
        q.bind(id).execute(&self.pool).await?;
        Ok(())
    }

    /// Claims up to `n` lines of an in-progress batch for `owner` until `lease_until`: lines
    /// waiting (and due), or running under a lease that ran out.
    pub async fn claim_lines(
        &self,
        batch_id: &str,
        owner: &str,
        n: i64,
        lease_until: i64,
    ) -> Result<Vec<ClaimedLine>, TenantError> {
        let now = now_ms();
        let rows = sqlx::query(
            "SELECT l.line, l.custom_id, l.body, l.attempt FROM batch_lines l JOIN batches b ON b.id = l.batch_id \
             WHERE l.batch_id = $1 AND b.status = 'in_progress' AND b.expires_at > $2 \
             AND ((l.state = 'pending' AND l.not_before <= $2) OR (l.state = 'running' AND l.lease_until < $2)) \
             ORDER BY l.line LIMIT $3",
        )
        .bind(batch_id)
        .bind(now)
        .bind(n)
        .fetch_all(&self.pool)
        .await?;
        let mut claimed = Vec::with_capacity(rows.len());
        for r in rows {
            let line: i64 = r.get(0);
            // The same condition again: of two gateways that read this line, one updates it.
            let res = sqlx::query(
                "UPDATE batch_lines SET state = 'running', owner = $1, lease_until = $2 \
                 WHERE batch_id = $3 AND line = $4 \
                 AND ((state = 'pending' AND not_before <= $5) OR (state = 'running' AND lease_until < $5)) \
                 AND EXISTS (SELECT 1 FROM batches b WHERE b.id = $3 AND b.status = 'in_progress' AND b.expires_at > $5)",
            )
            .bind(owner)
            .bind(lease_until)
            .bind(batch_id)
            .bind(line)
            .bind(now)
            .execute(&self.pool)
            .await?;
            if res.rows_affected() == 1 {
                claimed.push(ClaimedLine {
                    batch_id: batch_id.to_string(),
                    line,
                    attempt: r.get(3),
                    custom_id: r.get::<Option<String>, _>(1).unwrap_or_default(),
                    body: r.get::<Option<String>, _>(2).unwrap_or_default(),
                });
            }
        }
        Ok(claimed)
    }

    /// Extends the lease of a line `owner` is running (false: it holds it no more).
    pub async fn renew_lease(&self, l: &ClaimedLine, owner: &str, lease_until: i64) -> Result<bool, TenantError> {
        let res = sqlx::query(
            "UPDATE batch_lines SET lease_until = $1 WHERE batch_id = $2 AND line = $3 AND owner = $4 AND state = 'running'",
        )
        .bind(lease_until)
        .bind(&l.batch_id)
        .bind(l.line)
        .bind(owner)
        .execute(&self.pool)
        .await?;
        Ok(res.rows_affected() == 1)
    }

    /// Keeps a line's result if `owner` still holds it; false when its lease was lost (the
    /// line ran elsewhere too, and that run's result counts).
    pub async fn finish_line(&self, l: &ClaimedLine, owner: &str, r: &LineResult) -> Result<bool, TenantError> {
        let res = sqlx::query(
            "UPDATE batch_lines SET state = 'done', status_code = $1, result = $2, finished_at = $3, owner = NULL \
             WHERE batch_id = $4 AND line = $5 AND owner = $6 AND state = 'running'",
        )
        .bind(r.status_code)
        .bind(&r.result)
        .bind(now_ms())
        .bind(&l.batch_id)
        .bind(l.line)
        .bind(owner)
        .execute(&self.pool)
        .await?;
        Ok(res.rows_affected() == 1)
    }

    /// Sends a line back to wait until `not_before` (rate limited, overloaded, over budget).
    pub async fn release_line(&self, l: &ClaimedLine, owner: &str, not_before: i64) -> Result<(), TenantError> {
        sqlx::query(
            "UPDATE batch_lines SET state = 'pending', owner = NULL, lease_until = 0, not_before = $1, attempt = attempt + 1 \
             WHERE batch_id = $2 AND line = $3 AND owner = $4 AND state = 'running'",
        )
        .bind(not_before)
        .bind(&l.batch_id)
        .bind(l.line)
        .bind(owner)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Finishes a batch whose lines have all run, or which was cancelled or expired and has
    /// no line running: in one transaction, sets its final status, marks the lines that never
    /// ran (`unrun`, so no claim can take them any more), writes its output and error files
    /// (lines not run go to the error file as `batch_cancelled` or `batch_expired`) and drops
    /// the lines' bodies and answers, which the files now hold. None when it is not ready
    /// (or another gateway finished it first).
    pub async fn finish_batch(&self, id: &str) -> Result<Option<BatchInfo>, TenantError> {
        let now = now_ms();
        let r = sqlx::query(&format!("SELECT {BATCH_COLUMNS} FROM batches WHERE id = $1"))
            .bind(id)
            .fetch_optional(&self.pool)
            .await?
            .ok_or_else(|| TenantError::NoSuchBatch(id.to_string()))?;
        let b = batch_info(&r, self.line_counts(id).await?);
        let unfinished = b.counts.total - b.counts.completed - b.counts.failed;
        let (final_status, unrun_code, unrun_message) = match b.status.as_str() {
            status::CANCELLING => (
                status::CANCELLED,
                "batch_cancelled",
                "The batch was cancelled before this line ran.",
            ),
            status::IN_PROGRESS | status::FINALIZING if unfinished == 0 => (status::COMPLETED, "", ""),
            status::IN_PROGRESS | status::FINALIZING if b.expires_at <= now => (
                status::EXPIRED,
                "batch_expired",
                "The batch's completion window ended before this line ran.",
            ),
            _ => return Ok(None),
        };
        // The batch's row first: it orders this against a concurrent finish and a cancel.
        let mut tx = self.pool.begin().await?;
        let moved = sqlx::query(&format!(
            "UPDATE batches SET status = $1, finalizing_at = $2, {col} = $2, paused_reason = NULL \
             WHERE id = $3 AND status IN ('in_progress', 'finalizing', 'cancelling')",
            col = match final_status {
                status::CANCELLED => "cancelled_at",
                status::EXPIRED => "expired_at",
                _ => "completed_at",
            }
        ))
        .bind(final_status)
        .bind(now)
        .bind(id)
        .execute(&mut *tx)
        .await?;
        if moved.rows_affected() == 0 {
            return Ok(None);
        }
        // A line still running under a live lease finishes first.
        let live: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM batch_lines WHERE batch_id = $1 AND state = 'running' AND lease_until >= $2",
        )
        .bind(id)
        .bind(now)
        .fetch_one(&mut *tx)
        .await?;
        if live > 0 {
            return Ok(None);
        }
        // The rest never ran (a claim or a late answer waiting on these rows finds them unrun).
        sqlx::query("UPDATE batch_lines SET state = 'unrun', owner = NULL WHERE batch_id = $1 AND state <> 'done'")
            .bind(id)
            .execute(&mut *tx)
            .await?;
        let rows = sqlx::query(
            "SELECT line, custom_id, status_code, result, state, attempt FROM batch_lines WHERE batch_id = $1 ORDER BY line",
        )
        .bind(id)
        .fetch_all(&mut *tx)
        .await?;
        let (mut out, mut err) = (Vec::new(), Vec::new());
        for r in &rows {
            let state: String = r.get(4);
            let code: Option<i64> = r.get(2);
            let text = if state == "done" {
                r.get::<Option<String>, _>(3).unwrap_or_default()
            } else {
                let custom_id: Option<String> = r.get(1);
                error_line(
                    &line_request_id(id, r.get(0), r.get(5)),
                    custom_id.as_deref(),
                    unrun_code,
                    unrun_message,
                )
                .to_string()
            };
            let to = if code.is_some_and(|c| (200..300).contains(&c)) {
                &mut out
            } else {
                &mut err
            };
            to.extend_from_slice(text.as_bytes());
            to.push(b'\n');
        }
        let hex = id.trim_start_matches("batch_");
        let mut files = [(None, out, "output"), (None, err, "errors")];
        for (fid, bytes, name) in &mut files {
            if !bytes.is_empty() {
                let file_id = format!("file-{hex}{}", &name[..3]);
                self.insert_file(
                    &mut *tx,
                    &file_id,
                    (&b.tenant_id, Some(&b.key_id)),
                    "batch_output",
                    &format!("{id}_{name}.jsonl"),
                    bytes,
                )
                .await?;
                *fid = Some(file_id);
            }
        }
        sqlx::query("UPDATE batches SET output_file_id = $1, error_file_id = $2 WHERE id = $3")
            .bind(files[0].0.clone())
            .bind(files[1].0.clone())
            .bind(id)
            .execute(&mut *tx)
            .await?;
        sqlx::query("UPDATE batch_lines SET body = NULL, result = NULL WHERE batch_id = $1")
            .bind(id)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        self.batch(&b.tenant_id, id).await.map(Some)
    }
}

/// The request id (and output line id) of a run of a batch's line. A line run again after
/// its gateway died keeps its id, so it is metered once (usage records are idempotent by
/// request id); a line sent back (rate limited, overloaded) runs next under a new one.
pub fn line_request_id(batch_id: &str, line: i64, attempt: i64) -> String {
    let hex = batch_id.trim_start_matches("batch_");
    match attempt {
        0 => format!("batch_req_{hex}_{line}"),
        n => format!("batch_req_{hex}_{line}_{n}"),
    }
}

/// An error file's line for a line that got no response.
pub fn error_line(id: &str, custom_id: Option<&str>, code: &str, message: &str) -> serde_json::Value {
    serde_json::json!({
        "id": id, "custom_id": custom_id, "response": null,
        "error": {"code": code, "message": message},
    })
}

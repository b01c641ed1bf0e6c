//! Tenants' LoRA adapters as recorded: one row per version of a tenant's adapter name, for
//! one base model. The files live in the adapter store, a directory the gateway writes and
//! the workers read (`hearth_protocol::AdapterRef::path`), named by digest so that
//! identical uploads are stored once; checking them against the base model is a worker's
//! job (the caller's, before [`TenantStore::add_adapter`]).

use serde::Serialize;
use sqlx::any::AnyRow;
use sqlx::Row;

use crate::{now_ms, random_hex, valid_name, TenantError, TenantStore};

/// Adapter versions one tenant may keep.
pub const MAX_TENANT_ADAPTERS: i64 = 64;

/// Adapter bytes one tenant may store, counting each distinct upload once.
pub const MAX_TENANT_ADAPTER_BYTES: i64 = 2 << 30;

/// An adapter version as listings show it.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AdapterInfo {
    pub id: String,
    pub tenant_id: String,
    /// What requests name after the base model: `model: "BASE:NAME"`.
    pub name: String,
    pub version: i64,
    pub base_model: String,
    /// SHA-256 of the files (its identity in workers' adapter caches).
    pub digest: String,
    /// `peft` (adapter_config.json + adapter_model.safetensors) or `gguf`.
    pub format: String,
    /// The rank in `adapter_config.json` (None for GGUF).
    pub rank: Option<i64>,
    pub size: i64,
    pub created_at: i64,
}

impl AdapterInfo {
    /// Where the files are in the adapter store.
    pub fn store_path(&self) -> String {
        store_path(&self.digest, &self.format)
    }
}

/// An adapter's path in the store: `DIGEST/` for PEFT, `DIGEST.gguf` for GGUF.
pub fn store_path(digest: &str, format: &str) -> String {
    match format {
        "gguf" => format!("{digest}.gguf"),
        _ => digest.to_string(),
    }
}

/// A model name that is not a served model's, read as `BASE:ADAPTER` (split at the last
/// `:`, since model ids may contain one): None when it has no adapter part.
pub fn split_model_name(name: &str) -> Option<(&str, &str)> {
    name.rsplit_once(':')
        .filter(|(base, adapter)| !base.is_empty() && !adapter.is_empty())
}

/// The model name requests use for `adapter` of `base`.
pub fn model_name(base: &str, adapter: &str) -> String {
    format!("{base}:{adapter}")
}

/// What a new version is (its files already in the store and checked).
#[derive(Debug, Clone)]
pub struct AdapterSpec {
    pub name: String,
    pub base_model: String,
    pub digest: String,
    pub format: String,
    pub rank: Option<i64>,
    pub size: i64,
}

const COLUMNS: &str = "id, tenant_id, name, version, base_model, digest, format, rank, size, created_at";

fn info(r: &AnyRow) -> AdapterInfo {
    AdapterInfo {
        id: r.get(0),
        tenant_id: r.get(1),
        name: r.get(2),
        version: r.get(3),
        base_model: r.get(4),
        digest: r.get(5),
        format: r.get(6),
        rank: r.get(7),
        size: r.get(8),
        created_at: r.get(9),
    }
}

fn invalid(field: &'static str, message: impl Into<String>) -> TenantError {
    TenantError::Invalid {
        field,
        message: message.into(),
    }
}

impl TenantStore {
    /// Whether `tenant` may store one more adapter version of `size` bytes with this
    /// digest (an upload it already stores costs no bytes). Checked before the upload is
    /// validated, and again by [`TenantStore::add_adapter`].
    pub async fn adapter_room(&self, tenant: &str, digest: &str, size: i64) -> Result<(), TenantError> {
        let t = self.tenant(tenant).await?;
        let count: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM adapters WHERE tenant_id = $1")
            .bind(&t.id)
            .fetch_one(&self.pool)
            .await?;
        if count >= self.adapter_count_quota {
            return Err(invalid(
                "file",
                format!(
                    "tenant {} keeps {count} adapter versions, its quota (delete unused versions)",
                    t.name
                ),
            ));
        }
        let known: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM adapters WHERE tenant_id = $1 AND digest = $2")
            .bind(&t.id)
            .bind(digest)
            .fetch_one(&self.pool)
            .await?;
        if known == 0 {
            let used: i64 = sqlx::query_scalar(
                // SUM of a BIGINT is NUMERIC on PostgreSQL: cast back for the Any driver.
                "SELECT CAST(COALESCE(SUM(s.size), 0) AS BIGINT) FROM (SELECT DISTINCT digest, size FROM adapters \
                 WHERE tenant_id = $1) s",
            )
            .bind(&t.id)
            .fetch_one(&self.pool)
            .await?;
            if used + size > self.adapter_quota {
                return Err(invalid(
                    "file",
                    format!(
                        "tenant {} stores {used} bytes of adapters; this {size}-byte adapter would pass its quota of {} bytes (delete unused versions)",
                        t.name, self.adapter_quota
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Records a new version of a tenant's adapter (files stored and checked by the caller).
    pub async fn add_adapter(&self, tenant: &str, spec: &AdapterSpec) -> Result<AdapterInfo, TenantError> {
        let t = self.tenant(tenant).await?;
        if !valid_name(&spec.name) {
            return Err(TenantError::InvalidName(spec.name.clone()));
        }
        self.adapter_room(&t.id, &spec.digest, spec.size).await?;
        let prev: Option<i64> =
            sqlx::query_scalar("SELECT MAX(version) FROM adapters WHERE tenant_id = $1 AND name = $2")
                .bind(&t.id)
                .bind(&spec.name)
                .fetch_one(&self.pool)
                .await?;
        let id = format!("lora_{}", random_hex(8)?);
        sqlx::query(&format!(
            "INSERT INTO adapters ({COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)"
        ))
        .bind(&id)
        .bind(&t.id)
        .bind(&spec.name)
        .bind(prev.unwrap_or(0) + 1)
        .bind(&spec.base_model)
        .bind(&spec.digest)
        .bind(&spec.format)
        .bind(spec.rank)
        .bind(spec.size)
        .bind(now_ms())
        .execute(&self.pool)
        .await
        .map_err(|e| match e {
            // Two uploads of one name at once: both read the same last version.
            sqlx::Error::Database(d) if d.is_unique_violation() => TenantError::Conflict(format!(
                "another version of adapter {:?} was stored at the same time; upload again",
                spec.name
            )),
            e => e.into(),
        })?;
        self.adapter(&id).await
    }

    pub async fn adapter(&self, id: &str) -> Result<AdapterInfo, TenantError> {
        let r = sqlx::query(&format!("SELECT {COLUMNS} FROM adapters WHERE id = $1"))
            .bind(id)
            .fetch_optional(&self.pool)
            .await?
            .ok_or_else(|| TenantError::NoSuchAdapter(id.to_string()))?;
        Ok(info(&r))
    }

    /// A tenant's adapters, every version, by name then version.
    pub async fn list_adapters(&self, tenant: &str) -> Result<Vec<AdapterInfo>, TenantError> {
        let t = self.tenant(tenant).await?;
        let rows = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM adapters WHERE tenant_id = $1 ORDER BY base_model, name, version"
        ))
        .bind(&t.id)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.iter().map(info).collect())
    }

    /// The adapter a request of `tenant_id` names as `BASE:NAME`: the name's latest
    /// version for that base model (None: the tenant has none).
    pub async fn find_adapter(
        &self,
        tenant_id: &str,
        base_model: &str,
        name: &str,
    ) -> Result<Option<AdapterInfo>, TenantError> {
        let r = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM adapters WHERE tenant_id = $1 AND base_model = $2 AND name = $3 \
             ORDER BY version DESC LIMIT 1"
        ))
        .bind(tenant_id)
        .bind(base_model)
        .bind(name)
        .fetch_optional(&self.pool)
        .await?;
        Ok(r.as_ref().map(info))
    }

    /// Whether any version (of any tenant) names these files.
    pub async fn adapter_digest_in_use(&self, digest: &str) -> Result<bool, TenantError> {
        let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM adapters WHERE digest = $1")
            .bind(digest)
            .fetch_one(&self.pool)
            .await?;
        Ok(n > 0)
    }

    /// Deletes a version; also says whether any row (of any tenant) still uses its files,
    /// so that the caller removes them from the store only when none does.
    pub async fn delete_adapter(&self, id: &str) -> Result<(AdapterInfo, bool), TenantError> {
        let a = self.adapter(id).await?;
        sqlx::query("DELETE FROM adapters WHERE id = $1")
            .bind(id)
            .execute(&self.pool)
            .await?;
        let left: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM adapters WHERE digest = $1")
            .bind(&a.digest)
            .fetch_one(&self.pool)
            .await?;
        Ok((a, left > 0))
    }
}

//! Tenants' processors as stored: versions, activation, attachment to the tenant or one key,
//! order, config and limits. The component bytes live in the database; validating and
//! compiling them is `hearth-runtime`'s job (the caller's, before [`TenantStore::add_processor`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use serde::Serialize;
use sqlx::any::AnyRow;
use sqlx::Row;

use crate::{now_ms, random_hex, valid_name, TenantError, TenantStore, KEY_CACHE_TTL};

/// Largest component accepted.
pub const MAX_PROCESSOR_BYTES: usize = 64 << 20;

/// Processor code one tenant may store, counting each distinct component once.
pub const MAX_TENANT_PROCESSOR_BYTES: i64 = 256 << 20;

/// A processor version as listings show it (never the bytes).
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ProcessorInfo {
    pub id: String,
    pub tenant_id: String,
    pub name: String,
    pub version: i64,
    pub sha256: String,
    pub size: i64,
    pub config: String,
    pub cpu_ms: u32,
    pub memory_mib: u32,
    pub active: bool,
    /// None: every request of the tenant; else only this key's.
    pub key_id: Option<String>,
    pub position: i64,
    pub created_at: i64,
}

/// What a new version is.
#[derive(Debug, Clone)]
pub struct ProcessorSpec {
    pub name: String,
    pub sha256: String,
    pub config: String,
    pub cpu_ms: u32,
    pub memory_mib: u32,
    pub key_id: Option<String>,
    /// None: after the tenant's other processors (or the previous version's place).
    pub position: Option<i64>,
    pub activate: bool,
}

/// An active processor, as the gateway runs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActiveProcessor {
    pub id: String,
    pub name: String,
    pub version: i64,
    pub sha256: String,
    pub config: Arc<str>,
    pub cpu_ms: u32,
    pub memory_mib: u32,
    pub key_id: Option<String>,
    pub position: i64,
}

/// Identical components are stored once (in the first row with their hash; later rows hold
/// no bytes), so a row's size is its hash's.
const COLUMNS: &str = "id, tenant_id, name, version, sha256, \
     (SELECT MAX(LENGTH(b.wasm)) FROM processors b WHERE b.sha256 = processors.sha256), \
     config, cpu_ms, memory_mib, active, key_id, position, created_at";

fn info(r: &AnyRow) -> ProcessorInfo {
    ProcessorInfo {
        id: r.get(0),
        tenant_id: r.get(1),
        name: r.get(2),
        version: r.get(3),
        sha256: r.get(4),
        size: r.get::<i64, _>(5),
        config: r.get(6),
        cpu_ms: r.get::<i64, _>(7).clamp(0, u32::MAX as i64) as u32,
        memory_mib: r.get::<i64, _>(8).clamp(0, u32::MAX as i64) as u32,
        active: r.get::<i64, _>(9) != 0,
        key_id: r.get(10),
        position: r.get(11),
        created_at: r.get(12),
    }
}

/// A tenant's active processors and when they were read.
type CachedList = (Arc<[ActiveProcessor]>, Instant);

/// Active processors per tenant, cached like keys.
#[derive(Default)]
pub(crate) struct ProcessorCache {
    by_tenant: Mutex<HashMap<String, CachedList>>,
}

impl ProcessorCache {
    pub(crate) fn clear(&self) {
        self.by_tenant.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }
}

fn invalid(field: &'static str, message: impl Into<String>) -> TenantError {
    TenantError::Invalid {
        field,
        message: message.into(),
    }
}

/// Processor positions run from 0 to this (bounded, so that "after the last one" never
/// overflows).
pub const MAX_POSITION: i64 = 1_000_000;

impl TenantStore {
    /// Stores a new version of a processor (validated by the caller).
    pub async fn add_processor(
        &self,
        tenant: &str,
        spec: &ProcessorSpec,
        wasm: &[u8],
    ) -> Result<ProcessorInfo, TenantError> {
        let t = self.tenant(tenant).await?;
        if !valid_name(&spec.name) {
            return Err(TenantError::InvalidName(spec.name.clone()));
        }
        if wasm.is_empty() || wasm.len() > MAX_PROCESSOR_BYTES {
            return Err(invalid(
                "wasm",
                format!("a component of 1 byte to {MAX_PROCESSOR_BYTES} bytes"),
            ));
        }
        if serde_json::from_str::<serde_json::Value>(&spec.config).is_err() || spec.config.len() > 64 << 10 {
            return Err(invalid("config", "config must be JSON, at most 64 KiB"));
        }
        let key_id = match &spec.key_id {
            Some(k) => {
                let key = self.key(k).await?;
                if key.tenant_id != t.id {
                    return Err(TenantError::NoSuchKey(k.clone()));
                }
                Some(key.id)
            }
            None => None,
        };
        // Identical bytes are stored once; the tenant's quota counts each component once.
        let stored: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM processors WHERE sha256 = $1 AND LENGTH(wasm) > 0")
            .bind(&spec.sha256)
            .fetch_one(&self.pool)
            .await?;
        let known: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM processors WHERE tenant_id = $1 AND sha256 = $2")
            .bind(&t.id)
            .bind(&spec.sha256)
            .fetch_one(&self.pool)
            .await?;
        if known == 0 {
            let used: i64 = sqlx::query_scalar(
                "SELECT COALESCE(SUM(s.size), 0) FROM (SELECT DISTINCT p.sha256, \
                 (SELECT MAX(LENGTH(b.wasm)) FROM processors b WHERE b.sha256 = p.sha256) AS size \
                 FROM processors p WHERE p.tenant_id = $1) s",
            )
            .bind(&t.id)
            .fetch_one(&self.pool)
            .await?;
            if used + wasm.len() as i64 > self.processor_quota {
                return Err(invalid(
                    "wasm",
                    format!(
                        "tenant {} stores {used} bytes of processor code; this {}-byte component would pass its quota of {} bytes (delete unused versions)",
                        t.name,
                        wasm.len(),
                        self.processor_quota
                    ),
                ));
            }
        }
        let bytes = wasm;
        let wasm: &[u8] = if stored > 0 { &[] } else { wasm };
        let prev = sqlx::query("SELECT MAX(version), MAX(position) FROM processors WHERE tenant_id = $1 AND name = $2")
            .bind(&t.id)
            .bind(&spec.name)
            .fetch_one(&self.pool)
            .await?;
        let version = prev.get::<Option<i64>, _>(0).unwrap_or(0) + 1;
        if let Some(p) = spec.position.filter(|p| !(0..=MAX_POSITION).contains(p)) {
            return Err(invalid(
                "position",
                format!("position {p} is outside 0..={MAX_POSITION}"),
            ));
        }
        let position = match (spec.position, prev.get::<Option<i64>, _>(1)) {
            (Some(p), _) => p,
            (None, Some(p)) => p,
            (None, None) => {
                let max: Option<i64> = sqlx::query_scalar("SELECT MAX(position) FROM processors WHERE tenant_id = $1")
                    .bind(&t.id)
                    .fetch_one(&self.pool)
                    .await?;
                max.map_or(10, |m| m.saturating_add(10).min(MAX_POSITION))
            }
        };
        let id = format!("proc_{}", random_hex(8)?);
        sqlx::query(
            "INSERT INTO processors (id, tenant_id, name, version, sha256, wasm, config, cpu_ms, memory_mib, active, \
             key_id, position, created_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, 0, $10, $11, $12)",
        )
        .bind(&id)
        .bind(&t.id)
        .bind(&spec.name)
        .bind(version)
        .bind(&spec.sha256)
        .bind(wasm)
        .bind(&spec.config)
        .bind(i64::from(spec.cpu_ms))
        .bind(i64::from(spec.memory_mib))
        .bind(&key_id)
        .bind(position)
        .bind(now_ms())
        .execute(&self.pool)
        .await?;
        if wasm.is_empty() {
            // The copy counted on above may have been deleted meanwhile (its bytes moved to
            // no row, as this one did not exist yet): then this row keeps them.
            sqlx::query(
                "UPDATE processors SET wasm = $1 WHERE id = $2 AND NOT EXISTS \
                 (SELECT 1 FROM processors WHERE sha256 = $3 AND LENGTH(wasm) > 0)",
            )
            .bind(bytes)
            .bind(&id)
            .bind(&spec.sha256)
            .execute(&self.pool)
            .await?;
        }
        if spec.activate {
            return self.set_processor_active(&id, true).await;
        }
        self.processor(&id).await
    }

    pub async fn processor(&self, id: &str) -> Result<ProcessorInfo, TenantError> {
        let r = sqlx::query(&format!("SELECT {COLUMNS} FROM processors WHERE id = $1"))
            .bind(id)
            .fetch_optional(&self.pool)
            .await?
            .ok_or_else(|| TenantError::NoSuchProcessor(id.to_string()))?;
        Ok(info(&r))
    }

    /// A tenant's processors, every version, in running order.
    pub async fn list_processors(&self, tenant: &str) -> Result<Vec<ProcessorInfo>, TenantError> {
        let t = self.tenant(tenant).await?;
        let rows = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM processors WHERE tenant_id = $1 ORDER BY position, name, version"
        ))
        .bind(&t.id)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.iter().map(info).collect())
    }

    /// Activates a version (deactivating the name's other versions) or deactivates it.
    /// Running gateways follow within [`KEY_CACHE_TTL`].
    pub async fn set_processor_active(&self, id: &str, active: bool) -> Result<ProcessorInfo, TenantError> {
        let p = self.processor(id).await?;
        let mut tx = self.pool.begin().await?;
        if active {
            sqlx::query("UPDATE processors SET active = 0 WHERE tenant_id = $1 AND name = $2")
                .bind(&p.tenant_id)
                .bind(&p.name)
                .execute(&mut *tx)
                .await?;
        }
        sqlx::query("UPDATE processors SET active = $1 WHERE id = $2")
            .bind(i64::from(active))
            .bind(id)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        self.processors.clear();
        self.processor(id).await
    }

    /// Attaches a processor version to one key (or, with None, the whole tenant).
    pub async fn attach_processor(&self, id: &str, key_id: Option<&str>) -> Result<ProcessorInfo, TenantError> {
        let p = self.processor(id).await?;
        if let Some(k) = key_id {
            let key = self.key(k).await?;
            if key.tenant_id != p.tenant_id {
                return Err(TenantError::NoSuchKey(k.to_string()));
            }
        }
        let key_id = match key_id {
            Some(k) => Some(self.key(k).await?.id),
            None => None,
        };
        sqlx::query("UPDATE processors SET key_id = $1 WHERE id = $2")
            .bind(&key_id)
            .bind(id)
            .execute(&self.pool)
            .await?;
        self.processors.clear();
        self.processor(id).await
    }

    pub async fn delete_processor(&self, id: &str) -> Result<ProcessorInfo, TenantError> {
        let p = self.processor(id).await?;
        let mut tx = self.pool.begin().await?;
        // If this row holds bytes that other rows share, they move to one of those first.
        let bytes: Option<Vec<u8>> = sqlx::query_scalar("SELECT wasm FROM processors WHERE id = $1")
            .bind(id)
            .fetch_optional(&mut *tx)
            .await?
            .filter(|b: &Vec<u8>| !b.is_empty());
        sqlx::query("DELETE FROM processors WHERE id = $1")
            .bind(id)
            .execute(&mut *tx)
            .await?;
        if let Some(bytes) = bytes {
            sqlx::query(
                "UPDATE processors SET wasm = $1 WHERE id = \
                 (SELECT id FROM processors WHERE sha256 = $2 ORDER BY created_at, id LIMIT 1)",
            )
            .bind(bytes)
            .bind(&p.sha256)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        self.processors.clear();
        Ok(p)
    }

    /// A processor's component bytes (by content hash).
    pub async fn processor_wasm(&self, sha256: &str) -> Result<Option<Vec<u8>>, TenantError> {
        Ok(
            sqlx::query_scalar("SELECT wasm FROM processors WHERE sha256 = $1 AND LENGTH(wasm) > 0 LIMIT 1")
                .bind(sha256)
                .fetch_optional(&self.pool)
                .await?,
        )
    }

    /// The processors that run on a request of `tenant_id` made with `key_id`, in order.
    pub async fn active_processors(&self, tenant_id: &str, key_id: &str) -> Result<Vec<ActiveProcessor>, TenantError> {
        let cached = {
            let c = self.processors.by_tenant.lock().unwrap_or_else(|e| e.into_inner());
            c.get(tenant_id).map(|(v, at)| (v.clone(), *at))
        };
        let all = match cached {
            Some((v, at)) if at.elapsed() < KEY_CACHE_TTL => v,
            // The store is down: the chain seen last runs on (see [`crate::outage`]).
            Some((v, at)) if self.health.is_down() && self.health.usable_stale(at, KEY_CACHE_TTL) => v,
            stale => {
                if !self.health.lookup(&self.pool) {
                    return Err(sqlx::Error::PoolTimedOut.into());
                }
                let query = sqlx::query(
                    "SELECT id, name, version, sha256, config, cpu_ms, memory_mib, key_id, position FROM processors \
                     WHERE tenant_id = $1 AND active = 1 ORDER BY position, name",
                )
                .bind(tenant_id)
                .fetch_all(&self.pool);
                let fallback = stale
                    .as_ref()
                    .is_some_and(|(_, at)| self.health.usable_stale(*at, KEY_CACHE_TTL));
                let rows = match crate::outage::query(fallback, query).await {
                    Ok(rows) => {
                        self.health.answered();
                        rows
                    }
                    Err(e) => match stale.filter(|(_, at)| self.health.usable_stale(*at, KEY_CACHE_TTL)) {
                        Some((v, _)) => {
                            self.health.failed("processors", &e.to_string());
                            return Ok(v
                                .iter()
                                .filter(|p| p.key_id.as_deref().is_none_or(|k| k == key_id))
                                .cloned()
                                .collect());
                        }
                        None => return Err(e.into()),
                    },
                };
                let v: Arc<[ActiveProcessor]> = rows
                    .iter()
                    .map(|r| ActiveProcessor {
                        id: r.get(0),
                        name: r.get(1),
                        version: r.get(2),
                        sha256: r.get(3),
                        config: r.get::<String, _>(4).into(),
                        cpu_ms: r.get::<i64, _>(5).clamp(0, u32::MAX as i64) as u32,
                        memory_mib: r.get::<i64, _>(6).clamp(0, u32::MAX as i64) as u32,
                        key_id: r.get(7),
                        position: r.get(8),
                    })
                    .collect();
                self.processors
                    .by_tenant
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(tenant_id.to_string(), (v.clone(), Instant::now()));
                v
            }
        };
        Ok(all
            .iter()
            .filter(|p| p.key_id.as_deref().is_none_or(|k| k == key_id))
            .cloned()
            .collect())
    }
}

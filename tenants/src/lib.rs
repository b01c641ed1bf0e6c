//! Tenants and their API keys.
//!
//! API keys look like `hk_<id>_<secret>`: the id is public (it names the key in listings and
//! logs), the secret is 32 random bytes shown once at creation and stored only as its
//! SHA-256. Checking a key looks the id up (cached briefly in memory) and compares hashes
//! in constant time.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::Serialize;
use sha2::{Digest, Sha256};
use sqlx::{Row, SqlitePool};

/// How long a looked-up key is trusted before the database is asked again: a revocation
/// made by another process takes effect within this time.
pub const KEY_CACHE_TTL: Duration = Duration::from_secs(5);

const KEY_PREFIX: &str = "hk_";

#[derive(Debug, thiserror::Error)]
pub enum TenantError {
    #[error("tenant {0:?} already exists")]
    TenantExists(String),
    #[error("tenant {0:?} does not exist")]
    NoSuchTenant(String),
    #[error("API key {0:?} does not exist")]
    NoSuchKey(String),
    #[error("invalid name {0:?}: use 1-64 letters, digits, '.', '_' or '-'")]
    InvalidName(String),
    #[error("database error: {0}")]
    Db(#[from] sqlx::Error),
    #[error("the OS random source failed: {0}")]
    Random(String),
}

/// Why a presented key was refused (the message a client sees does not tell which).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AuthError {
    #[error("malformed API key")]
    Malformed,
    #[error("unknown API key")]
    Unknown,
    #[error("revoked API key")]
    Revoked,
    #[error("key store unavailable: {0}")]
    Store(String),
}

#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Tenant {
    pub id: String,
    pub name: String,
    pub created_at: i64,
}

/// An API key's public description (never the secret).
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct ApiKeyInfo {
    pub id: String,
    pub tenant_id: String,
    pub name: String,
    pub created_at: i64,
    pub revoked_at: Option<i64>,
}

/// A freshly created key: the only time the full key is known.
#[derive(Debug, Clone, Serialize)]
pub struct CreatedKey {
    #[serde(flatten)]
    pub info: ApiKeyInfo,
    pub tenant: String,
    /// The full key; shown once.
    pub key: String,
}

/// Rate limits of a tenant or a key; `None` is unlimited.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct Limits {
    /// Requests per minute.
    pub rpm: Option<u32>,
    /// Tokens (prompt + completion) per minute.
    pub tpm: Option<u32>,
    /// Requests in flight at once.
    pub concurrent: Option<u32>,
}

impl Limits {
    fn from_row(r: &sqlx::sqlite::SqliteRow, first: usize) -> Self {
        let get = |i: usize| {
            r.get::<Option<i64>, _>(i)
                .and_then(|v| u32::try_from(v).ok())
                .filter(|v| *v > 0)
        };
        Self {
            rpm: get(first),
            tpm: get(first + 1),
            concurrent: get(first + 2),
        }
    }
}

/// Who a request is, once authenticated, and what it may use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TenantContext {
    pub tenant_id: String,
    pub tenant_name: String,
    pub key_id: String,
    pub tenant_limits: Limits,
    pub key_limits: Limits,
}

pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

fn random_hex(bytes: usize) -> Result<String, TenantError> {
    let mut buf = vec![0u8; bytes];
    getrandom::fill(&mut buf).map_err(|e| TenantError::Random(e.to_string()))?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len()) && name.chars().all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
}

/// Equal-length byte comparison whose time does not depend on where the inputs differ.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn sha256(data: &[u8]) -> Vec<u8> {
    Sha256::digest(data).to_vec()
}

#[derive(Clone)]
struct CachedKey {
    secret_sha256: Vec<u8>,
    revoked: bool,
    ctx: TenantContext,
    fetched: Instant,
}

fn tenant_from(r: &sqlx::sqlite::SqliteRow) -> Tenant {
    Tenant {
        id: r.get(0),
        name: r.get(1),
        created_at: r.get(2),
    }
}

/// Rows of `SELECT id, tenant_id, name, created_at, revoked_at FROM api_keys`.
const KEY_COLUMNS: &str = "SELECT id, tenant_id, name, created_at, revoked_at FROM api_keys";

fn key_from(r: &sqlx::sqlite::SqliteRow) -> ApiKeyInfo {
    ApiKeyInfo {
        id: r.get(0),
        tenant_id: r.get(1),
        name: r.get(2),
        created_at: r.get(3),
        revoked_at: r.get(4),
    }
}

/// Tenants and keys over SQLite (sqlx).
pub struct TenantStore {
    pool: SqlitePool,
    cache: Mutex<HashMap<String, CachedKey>>,
}

impl std::fmt::Debug for TenantStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TenantStore").finish_non_exhaustive()
    }
}

impl TenantStore {
    pub fn new(pool: SqlitePool) -> Self {
        Self {
            pool,
            cache: Mutex::new(HashMap::new()),
        }
    }

    pub async fn create_tenant(&self, name: &str) -> Result<Tenant, TenantError> {
        if !valid_name(name) {
            return Err(TenantError::InvalidName(name.to_string()));
        }
        let t = Tenant {
            id: format!("tn_{}", random_hex(8)?),
            name: name.to_string(),
            created_at: now_ms(),
        };
        let res = sqlx::query("INSERT INTO tenants (id, name, created_at) VALUES (?, ?, ?)")
            .bind(&t.id)
            .bind(&t.name)
            .bind(t.created_at)
            .execute(&self.pool)
            .await;
        match res {
            Ok(_) => Ok(t),
            Err(sqlx::Error::Database(e)) if e.is_unique_violation() => {
                Err(TenantError::TenantExists(name.to_string()))
            }
            Err(e) => Err(e.into()),
        }
    }

    pub async fn list_tenants(&self) -> Result<Vec<Tenant>, TenantError> {
        let rows = sqlx::query("SELECT id, name, created_at FROM tenants ORDER BY created_at, name")
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.iter().map(tenant_from).collect())
    }

    /// A tenant by name or id.
    pub async fn tenant(&self, name_or_id: &str) -> Result<Tenant, TenantError> {
        let row = sqlx::query("SELECT id, name, created_at FROM tenants WHERE name = ? OR id = ?")
            .bind(name_or_id)
            .bind(name_or_id)
            .fetch_optional(&self.pool)
            .await?
            .ok_or_else(|| TenantError::NoSuchTenant(name_or_id.to_string()))?;
        Ok(tenant_from(&row))
    }

    /// Creates a key for a tenant; the returned [`CreatedKey::key`] is never retrievable again.
    pub async fn create_key(&self, tenant: &str, name: &str) -> Result<CreatedKey, TenantError> {
        let t = self.tenant(tenant).await?;
        let id = random_hex(8)?;
        let secret = random_hex(32)?;
        let info = ApiKeyInfo {
            id: id.clone(),
            tenant_id: t.id.clone(),
            name: name.to_string(),
            created_at: now_ms(),
            revoked_at: None,
        };
        sqlx::query("INSERT INTO api_keys (id, tenant_id, name, secret_sha256, created_at) VALUES (?, ?, ?, ?, ?)")
            .bind(&info.id)
            .bind(&info.tenant_id)
            .bind(&info.name)
            .bind(sha256(secret.as_bytes()))
            .bind(info.created_at)
            .execute(&self.pool)
            .await?;
        Ok(CreatedKey {
            info,
            tenant: t.name,
            key: format!("{KEY_PREFIX}{id}_{secret}"),
        })
    }

    pub async fn list_keys(&self, tenant: &str) -> Result<Vec<ApiKeyInfo>, TenantError> {
        let t = self.tenant(tenant).await?;
        let rows = sqlx::query(&format!("{KEY_COLUMNS} WHERE tenant_id = ? ORDER BY created_at"))
            .bind(&t.id)
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.iter().map(key_from).collect())
    }

    /// Revokes a key (idempotent). Other processes stop accepting it within [`KEY_CACHE_TTL`].
    pub async fn revoke_key(&self, key_id: &str) -> Result<ApiKeyInfo, TenantError> {
        let key_id = key_id.strip_prefix(KEY_PREFIX).unwrap_or(key_id);
        sqlx::query("UPDATE api_keys SET revoked_at = COALESCE(revoked_at, ?) WHERE id = ?")
            .bind(now_ms())
            .bind(key_id)
            .execute(&self.pool)
            .await?;
        self.cache.lock().unwrap_or_else(|e| e.into_inner()).remove(key_id);
        let r = sqlx::query(&format!("{KEY_COLUMNS} WHERE id = ?"))
            .bind(key_id)
            .fetch_optional(&self.pool)
            .await?
            .ok_or_else(|| TenantError::NoSuchKey(key_id.to_string()))?;
        Ok(key_from(&r))
    }

    /// Sets a tenant's limits (None = unlimited). Running gateways apply them within
    /// [`KEY_CACHE_TTL`].
    pub async fn set_tenant_limits(&self, tenant: &str, l: Limits) -> Result<Tenant, TenantError> {
        let t = self.tenant(tenant).await?;
        sqlx::query("UPDATE tenants SET rpm = ?, tpm = ?, max_concurrent = ? WHERE id = ?")
            .bind(l.rpm)
            .bind(l.tpm)
            .bind(l.concurrent)
            .bind(&t.id)
            .execute(&self.pool)
            .await?;
        self.cache.lock().unwrap_or_else(|e| e.into_inner()).clear();
        Ok(t)
    }

    /// Sets a key's limits (None = unlimited).
    pub async fn set_key_limits(&self, key_id: &str, l: Limits) -> Result<(), TenantError> {
        let key_id = key_id.strip_prefix(KEY_PREFIX).unwrap_or(key_id);
        let res = sqlx::query("UPDATE api_keys SET rpm = ?, tpm = ?, max_concurrent = ? WHERE id = ?")
            .bind(l.rpm)
            .bind(l.tpm)
            .bind(l.concurrent)
            .bind(key_id)
            .execute(&self.pool)
            .await?;
        if res.rows_affected() == 0 {
            return Err(TenantError::NoSuchKey(key_id.to_string()));
        }
        self.cache.lock().unwrap_or_else(|e| e.into_inner()).remove(key_id);
        Ok(())
    }

    /// A tenant's limits.
    pub async fn tenant_limits(&self, tenant: &str) -> Result<Limits, TenantError> {
        let t = self.tenant(tenant).await?;
        let r = sqlx::query("SELECT rpm, tpm, max_concurrent FROM tenants WHERE id = ?")
            .bind(&t.id)
            .fetch_one(&self.pool)
            .await?;
        Ok(Limits::from_row(&r, 0))
    }

    /// Whether any usable key exists (for the first-start hint).
    pub async fn has_active_keys(&self) -> Result<bool, TenantError> {
        let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM api_keys WHERE revoked_at IS NULL")
            .fetch_one(&self.pool)
            .await?;
        Ok(n > 0)
    }

    /// Checks a presented API key.
    pub async fn authenticate(&self, presented: &str) -> Result<TenantContext, AuthError> {
        let rest = presented.strip_prefix(KEY_PREFIX).ok_or(AuthError::Malformed)?;
        let (id, secret) = rest.split_once('_').ok_or(AuthError::Malformed)?;
        if id.is_empty() || id.len() > 64 || secret.is_empty() || secret.len() > 256 {
            return Err(AuthError::Malformed);
        }
        let cached = {
            let cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
            cache.get(id).filter(|c| c.fetched.elapsed() < KEY_CACHE_TTL).cloned()
        };
        let entry = match cached {
            Some(c) => c,
            None => {
                let row = sqlx::query(
                    "SELECT k.secret_sha256, k.revoked_at, t.id, t.name, t.rpm, t.tpm, t.max_concurrent, k.rpm, k.tpm, k.max_concurrent \
                     FROM api_keys k JOIN tenants t ON t.id = k.tenant_id WHERE k.id = ?",
                )
                .bind(id)
                .fetch_optional(&self.pool)
                .await
                .map_err(|e| AuthError::Store(e.to_string()))?
                .ok_or(AuthError::Unknown)?;
                let revoked_at: Option<i64> = row.get(1);
                let c = CachedKey {
                    secret_sha256: row.get(0),
                    revoked: revoked_at.is_some(),
                    ctx: TenantContext {
                        tenant_id: row.get(2),
                        tenant_name: row.get(3),
                        key_id: id.to_string(),
                        tenant_limits: Limits::from_row(&row, 4),
                        key_limits: Limits::from_row(&row, 7),
                    },
                    fetched: Instant::now(),
                };
                self.cache
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(id.to_string(), c.clone());
                c
            }
        };
        if !constant_time_eq(&sha256(secret.as_bytes()), &entry.secret_sha256) {
            return Err(AuthError::Unknown);
        }
        if entry.revoked {
            return Err(AuthError::Revoked);
        }
        Ok(entry.ctx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn store() -> TenantStore {
        let pool = SqlitePool::connect("sqlite::memory:").await.unwrap();
        sqlx::migrate!("../migrations/sqlite").run(&pool).await.unwrap();
        TenantStore::new(pool)
    }

    #[tokio::test]
    async fn keys_authenticate_and_revoke() {
        let s = store().await;
        assert!(!s.has_active_keys().await.unwrap());
        let t = s.create_tenant("acme").await.unwrap();
        assert!(matches!(
            s.create_tenant("acme").await,
            Err(TenantError::TenantExists(_))
        ));
        assert!(matches!(
            s.create_tenant("no spaces").await,
            Err(TenantError::InvalidName(_))
        ));
        let k = s.create_key("acme", "ci").await.unwrap();
        assert!(k.key.starts_with("hk_"));
        assert!(s.has_active_keys().await.unwrap());
        let ctx = s.authenticate(&k.key).await.unwrap();
        assert_eq!(ctx.tenant_limits, Limits::default());
        let lim = Limits {
            rpm: Some(10),
            tpm: None,
            concurrent: Some(2),
        };
        s.set_tenant_limits("acme", lim).await.unwrap();
        s.set_key_limits(
            &k.info.id,
            Limits {
                tpm: Some(1000),
                ..Default::default()
            },
        )
        .await
        .unwrap();
        let limited = s.authenticate(&k.key).await.unwrap();
        assert_eq!((limited.tenant_limits, limited.key_limits.tpm), (lim, Some(1000)));
        assert_eq!(s.tenant_limits("acme").await.unwrap(), lim);
        assert_eq!(
            (ctx.tenant_id.as_str(), ctx.key_id.as_str()),
            (t.id.as_str(), k.info.id.as_str())
        );
        // Wrong secret, malformed, unknown.
        let forged = format!("hk_{}_{}", k.info.id, "0".repeat(64));
        assert_eq!(s.authenticate(&forged).await, Err(AuthError::Unknown));
        assert_eq!(s.authenticate("sk-whatever").await, Err(AuthError::Malformed));
        assert_eq!(s.authenticate("hk_nope_abc").await, Err(AuthError::Unknown));
        // The secret is not stored.
        let stored: Vec<u8> = sqlx::query_scalar("SELECT secret_sha256 FROM api_keys")
            .fetch_one(&s.pool)
            .await
            .unwrap();
        assert_eq!(stored.len(), 32);
        assert!(!String::from_utf8_lossy(&stored).contains(&k.key[20..]));
        // Revocation is immediate in this process.
        let r = s.revoke_key(&k.info.id).await.unwrap();
        assert!(r.revoked_at.is_some());
        assert_eq!(s.authenticate(&k.key).await, Err(AuthError::Revoked));
        assert!(matches!(s.revoke_key("missing").await, Err(TenantError::NoSuchKey(_))));
        assert_eq!(s.list_keys("acme").await.unwrap().len(), 1);
        assert!(matches!(
            s.create_key("ghost", "").await,
            Err(TenantError::NoSuchTenant(_))
        ));
    }

    #[test]
    fn constant_time_eq_compares() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
    }
}

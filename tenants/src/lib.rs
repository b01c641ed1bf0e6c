//! Tenants, their API keys, JWT issuers, limits and budgets, over SQLite or PostgreSQL.
//!
//! API keys look like `hk_<id>_<secret>`: the id is public (it names the key in listings and
//! logs), the secret is 32 random bytes shown once at creation and stored only as its
//! SHA-256. Checking a key looks the id up (cached briefly in memory) and compares hashes
//! in constant time. Keys carry scopes (`inference`, `manage`), an optional list of allowed
//! models and an optional expiry. JWTs from a tenant's registered issuers are the other way
//! in (see [`jwt`]).

pub mod adapters;
pub mod audit;
pub mod batches;
pub mod db;
pub mod jwt;
pub mod members;
pub mod outage;
pub mod processors;
pub mod responses;
pub mod sessions;
pub mod sso;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

pub use hearth_protocol::{Priority, MAX_SHARE};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use sqlx::any::AnyRow;
use sqlx::{AnyPool, Row};

pub use db::{Backend, Db};

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
    #[error("JWT issuer {0:?} does not exist")]
    NoSuchIssuer(String),
    #[error("processor {0:?} does not exist")]
    NoSuchProcessor(String),
    #[error("adapter {0:?} does not exist")]
    NoSuchAdapter(String),
    #[error("file {0:?} does not exist")]
    NoSuchFile(String),
    #[error("batch {0:?} does not exist")]
    NoSuchBatch(String),
    #[error("member {0:?} does not exist")]
    NoSuchMember(String),
    #[error("invitation {0:?} does not exist")]
    NoSuchInvitation(String),
    #[error("tenant {0:?} has no identity provider")]
    NoSuchProvider(String),
    /// The change collides with the object's current state.
    #[error("{0}")]
    Conflict(String),
    #[error("password hashing failed: {0}")]
    Password(String),
    #[error("invalid name {0:?}: use 1-64 letters, digits, '.', '_' or '-'")]
    InvalidName(String),
    #[error("invalid tenant name {0:?}: use 1-64 printable characters, without control characters, surrounding spaces or the 'tn_' prefix of tenant ids")]
    InvalidTenantName(String),
    #[error("invalid {field}: {message}")]
    Invalid { field: &'static str, message: String },
    #[error("a JWT issuer {0:?} is already registered")]
    IssuerExists(String),
    #[error("database error: {0}")]
    Db(#[from] sqlx::Error),
    #[error("the OS random source failed: {0}")]
    Random(String),
}

/// Why a presented credential was refused (the message a client sees names the reason only
/// where that tells an attacker nothing: expired, revoked, wrong audience…).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AuthError {
    #[error("malformed API key")]
    Malformed,
    #[error("unknown API key")]
    Unknown,
    #[error("revoked API key")]
    Revoked,
    #[error("this API key expired at {0} (Unix ms)")]
    Expired(i64),
    /// A JWT that was refused, with the reason.
    #[error("invalid token: {0}")]
    Jwt(String),
    #[error("key store unavailable: {0}")]
    Store(String),
    /// The credential is good but its tenant is suspended.
    #[error("tenant {0:?} is suspended")]
    Suspended(String),
}

#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Tenant {
    pub id: String,
    pub name: String,
    pub created_at: i64,
    /// When the operator suspended it (Unix ms); its credentials, sessions and members are
    /// refused until it is resumed. None: active.
    pub suspended_at: Option<i64>,
}

/// What a credential may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Scopes {
    /// Call the model APIs (`/v1/chat/completions`, `/v1/completions`, `/v1/models`).
    pub inference: bool,
    /// Use the tenant self-service API (`/v1/tenant/…`): keys, usage, limits.
    pub manage: bool,
}

impl Scopes {
    pub const ALL: Scopes = Scopes {
        inference: true,
        manage: true,
    };

    /// `inference,manage` (comma- or space-separated). Unknown names are an error.
    pub fn parse(s: &str) -> Result<Self, TenantError> {
        let mut out = Scopes::default();
        for part in s.split([',', ' ']).map(str::trim).filter(|p| !p.is_empty()) {
            match part {
                "inference" => out.inference = true,
                "manage" => out.manage = true,
                "all" | "*" => out = Scopes::ALL,
                other => {
                    return Err(TenantError::Invalid {
                        field: "scopes",
                        message: format!("unknown scope {other:?} (inference, manage)"),
                    })
                }
            }
        }
        Ok(out)
    }

    pub fn names(self) -> Vec<&'static str> {
        let mut v = Vec::new();
        if self.inference {
            v.push("inference");
        }
        if self.manage {
            v.push("manage");
        }
        v
    }

    fn db(self) -> String {
        self.names().join(",")
    }

    /// Whether `self` grants nothing `other` does not.
    pub fn within(self, other: Scopes) -> bool {
        (!self.inference || other.inference) && (!self.manage || other.manage)
    }
}

/// An API key's public description (never the secret).
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ApiKeyInfo {
    pub id: String,
    pub tenant_id: String,
    pub name: String,
    pub created_at: i64,
    pub revoked_at: Option<i64>,
    pub scopes: Vec<&'static str>,
    /// The models the key may use; None is every model.
    pub models: Option<Vec<String>>,
    pub expires_at: Option<i64>,
}

/// A freshly created key: the only time the full key is known.
#[derive(Debug, Clone, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct CreatedKey {
    #[serde(flatten)]
    pub info: ApiKeyInfo,
    pub tenant: String,
    /// The full key; shown once.
    pub key: String,
}

/// What a new key may do.
#[derive(Debug, Clone, Default)]
pub struct KeySpec {
    pub name: String,
    /// None: every scope.
    pub scopes: Option<Scopes>,
    pub models: Option<Vec<String>>,
    pub expires_at: Option<i64>,
}

/// Rate limits of a tenant or a key (`None` is unlimited), and how its requests are
/// scheduled on a shared worker.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Limits {
    /// Requests per minute.
    #[cfg_attr(feature = "openapi", schema(value_type = Option<i64>, minimum = 0, maximum = 4294967295_i64))]
    pub rpm: Option<u32>,
    /// Tokens (prompt + completion) per minute.
    #[cfg_attr(feature = "openapi", schema(value_type = Option<i64>, minimum = 0, maximum = 4294967295_i64))]
    pub tpm: Option<u32>,
    /// Requests in flight at once.
    #[cfg_attr(feature = "openapi", schema(value_type = Option<i64>, minimum = 0, maximum = 4294967295_i64))]
    pub concurrent: Option<u32>,
    /// The tenant's weight in fair scheduling (1 to [`MAX_SHARE`]; None or 0: 1). A
    /// tenant setting: keys have none.
    #[serde(default)]
    #[cfg_attr(feature = "openapi", schema(minimum = 0, maximum = 1000))]
    pub share: Option<u32>,
    /// The class of its requests (None: interactive). A key's class can only lower its
    /// tenant's, and a request's only lower its key's.
    #[serde(default)]
    pub priority: Option<Priority>,
}

impl Limits {
    /// Reads `rpm, tpm, max_concurrent, share, priority` from `first` on.
    fn from_row(r: &AnyRow, first: usize) -> Self {
        let get = |i: usize| {
            r.try_get::<Option<i64>, _>(i)
                .ok()
                .flatten()
                .and_then(|v| u32::try_from(v).ok())
                .filter(|v| *v > 0)
        };
        Self {
            rpm: get(first),
            tpm: get(first + 1),
            concurrent: get(first + 2),
            share: get(first + 3),
            priority: r
                .try_get::<Option<String>, _>(first + 4)
                .ok()
                .flatten()
                .and_then(|p| Priority::parse(&p)),
        }
    }

    fn check(&self) -> Result<(), TenantError> {
        if self.share.is_some_and(|s| s > MAX_SHARE) {
            return Err(TenantError::Invalid {
                field: "share",
                message: format!("a share is 1 to {MAX_SHARE}"),
            });
        }
        Ok(())
    }
}

/// A tenant's monthly spend limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Budget {
    /// Per calendar month (UTC), in nano-USD.
    pub monthly_nusd: i64,
    /// Hard: requests are refused once the month's spend reaches the budget. Soft: they
    /// carry a warning header.
    pub hard: bool,
}

/// Who a request is, once authenticated, and what it may use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TenantContext {
    pub tenant_id: String,
    pub tenant_name: String,
    /// The API key's id, or `jwt:<issuer id>:<sub>` for a JWT.
    pub key_id: String,
    pub scopes: Scopes,
    /// Allowed models; None is every model.
    pub models: Option<Arc<[String]>>,
    pub tenant_limits: Limits,
    pub key_limits: Limits,
    pub budget: Option<Budget>,
    /// When the credential stops working (Unix ms): the key's expiry or the JWT's `exp`.
    pub expires_at: Option<i64>,
}

impl TenantContext {
    pub fn allows_model(&self, model: &str) -> bool {
        self.models.as_ref().is_none_or(|m| m.iter().any(|x| x == model))
    }

    /// The class of this credential's requests: the tenant's, lowered by the key's.
    pub fn priority(&self) -> Priority {
        self.tenant_limits
            .priority
            .unwrap_or_default()
            .lowered_by(self.key_limits.priority)
    }

    /// The tenant's fair-scheduling weight.
    pub fn share(&self) -> u32 {
        self.tenant_limits.share.unwrap_or(1).clamp(1, MAX_SHARE)
    }
}

pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// `bytes` random bytes from the OS, as hex.
pub fn random_hex(bytes: usize) -> Result<String, TenantError> {
    let mut buf = vec![0u8; bytes];
    getrandom::fill(&mut buf).map_err(|e| TenantError::Random(e.to_string()))?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

/// Names of processors and adapters: 1-64 letters, digits, '.', '_' or '-'.
pub fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len()) && name.chars().all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
}

/// A tenant's name is a label people read (the id is the handle): any 1-64 printable
/// characters, trimmed, and never shaped like an id (`tn_…`), since a tenant is looked up by
/// name or id. Pages and exports escape it; it is never part of a file name or a cache key.
fn valid_tenant_name(name: &str) -> bool {
    let n = name.chars().count();
    (1..=64).contains(&n)
        && name.len() <= 256
        && name.trim() == name
        && !name.starts_with("tn_")
        && !name.chars().any(char::is_control)
}

/// Equal-length byte comparison whose time does not depend on where the inputs differ.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn sha256(data: &[u8]) -> Vec<u8> {
    Sha256::digest(data).to_vec()
}

fn models_from_db(v: Option<String>) -> Option<Vec<String>> {
    v.map(|s| s.split(',').filter(|m| !m.is_empty()).map(str::to_string).collect())
}

fn budget_from(nusd: Option<i64>, mode: &str) -> Option<Budget> {
    nusd.filter(|n| *n > 0).map(|monthly_nusd| Budget {
        monthly_nusd,
        hard: mode != "soft",
    })
}

#[derive(Clone)]
struct CachedKey {
    secret_sha256: Vec<u8>,
    revoked: bool,
    suspended: bool,
    expires_at: Option<i64>,
    ctx: TenantContext,
    fetched: Instant,
}

fn tenant_from(r: &AnyRow) -> Tenant {
    Tenant {
        id: r.get(0),
        name: r.get(1),
        created_at: r.get(2),
        suspended_at: r.get(3),
    }
}

const KEY_COLUMNS: &str =
    "SELECT id, tenant_id, name, created_at, revoked_at, scopes, models, expires_at FROM api_keys";

fn key_from(r: &AnyRow) -> ApiKeyInfo {
    let scopes: String = r.get(5);
    ApiKeyInfo {
        id: r.get(0),
        tenant_id: r.get(1),
        name: r.get(2),
        created_at: r.get(3),
        revoked_at: r.get(4),
        scopes: Scopes::parse(&scopes).unwrap_or_default().names(),
        models: models_from_db(r.get(6)),
        expires_at: r.get(7),
    }
}

fn opt_i64(v: Option<u32>) -> Option<i64> {
    v.map(i64::from)
}

/// Tenants, keys, issuers, limits and budgets over the shared database.
pub struct TenantStore {
    pool: AnyPool,
    cache: Mutex<HashMap<String, CachedKey>>,
    /// JWT principals' own limits, by principal, with when they were read.
    principals: Mutex<HashMap<String, (Limits, Instant)>>,
    /// Processor code one tenant may store (bytes; identical components count once).
    pub processor_quota: i64,
    /// Adapter bytes one tenant may store (identical uploads count once).
    pub adapter_quota: i64,
    /// Adapter versions one tenant may keep.
    pub adapter_count_quota: i64,
    /// File bytes one tenant may store (Files API uploads and batch outputs).
    pub file_quota: i64,
    jwt: jwt::IssuerCache,
    sso: sso::DiscoveryCache,
    processors: processors::ProcessorCache,
    /// Whether the database answers, and how long cached credentials outlive an outage.
    pub health: std::sync::Arc<outage::StoreHealth>,
    /// Key ids recently found not to exist.
    unknown_keys: outage::NegativeCache,
}

impl std::fmt::Debug for TenantStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TenantStore").finish_non_exhaustive()
    }
}

impl TenantStore {
    pub fn new(db: &Db) -> Self {
        Self {
            pool: db.pool.clone(),
            cache: Mutex::new(HashMap::new()),
            principals: Mutex::new(HashMap::new()),
            processor_quota: processors::MAX_TENANT_PROCESSOR_BYTES,
            adapter_quota: adapters::MAX_TENANT_ADAPTER_BYTES,
            adapter_count_quota: adapters::MAX_TENANT_ADAPTERS,
            file_quota: batches::MAX_TENANT_FILE_BYTES,
            jwt: jwt::IssuerCache::default(),
            sso: sso::DiscoveryCache::default(),
            processors: processors::ProcessorCache::default(),
            health: Default::default(),
            unknown_keys: Default::default(),
        }
    }

    /// How long past their refresh time cached credentials keep working while the database
    /// does not answer (0: not at all).
    pub fn set_stale_limit(&self, limit: Duration) {
        *self.health.stale_limit.lock().unwrap_or_else(|e| e.into_inner()) = limit;
    }

    pub fn pool(&self) -> &AnyPool {
        &self.pool
    }

    /// Whether the database answers (a gateway's readiness).
    pub async fn ping(&self) -> Result<(), TenantError> {
        sqlx::query("SELECT 1").execute(&self.pool).await?;
        Ok(())
    }

    /// Makes every cached credential `by` older (tests of expiry and outages).
    #[cfg(test)]
    pub(crate) fn age_cached_for_tests(&self, by: Duration) {
        for c in self.cache.lock().unwrap_or_else(|e| e.into_inner()).values_mut() {
            c.fetched = c.fetched.checked_sub(by).unwrap_or(c.fetched);
        }
    }

    fn forget_cached(&self) {
        self.cache.lock().unwrap_or_else(|e| e.into_inner()).clear();
        self.unknown_keys.clear();
        self.jwt.clear();
    }

    pub async fn create_tenant(&self, name: &str) -> Result<Tenant, TenantError> {
        if !valid_tenant_name(name) {
            return Err(TenantError::InvalidTenantName(name.to_string()));
        }
        let t = Tenant {
            id: format!("tn_{}", random_hex(8)?),
            name: name.to_string(),
            created_at: now_ms(),
            suspended_at: None,
        };
        let res = sqlx::query("INSERT INTO tenants (id, name, created_at) VALUES ($1, $2, $3)")
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
        let rows = sqlx::query("SELECT id, name, created_at, suspended_at FROM tenants ORDER BY created_at, name")
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.iter().map(tenant_from).collect())
    }

    /// A tenant by name or id.
    pub async fn tenant(&self, name_or_id: &str) -> Result<Tenant, TenantError> {
        let row = sqlx::query("SELECT id, name, created_at, suspended_at FROM tenants WHERE name = $1 OR id = $1")
            .bind(name_or_id)
            .fetch_optional(&self.pool)
            .await?
            .ok_or_else(|| TenantError::NoSuchTenant(name_or_id.to_string()))?;
        Ok(tenant_from(&row))
    }

    /// Suspends (or resumes) a tenant. Its API keys and JWTs get 403 `tenant_suspended`
    /// within the credential caches' 5 s on every gateway; its dashboard sessions and
    /// members are refused at their next request.
    pub async fn set_suspended(&self, tenant: &str, suspended: bool) -> Result<Tenant, TenantError> {
        let t = self.tenant(tenant).await?;
        sqlx::query("UPDATE tenants SET suspended_at = $1 WHERE id = $2")
            .bind(suspended.then(|| t.suspended_at.unwrap_or_else(now_ms)))
            .bind(&t.id)
            .execute(&self.pool)
            .await?;
        self.forget_cached();
        self.tenant(&t.id).await
    }

    /// Creates a key for a tenant; the returned [`CreatedKey::key`] is never retrievable again.
    pub async fn create_key(&self, tenant: &str, spec: &KeySpec) -> Result<CreatedKey, TenantError> {
        let t = self.tenant(tenant).await?;
        if spec.name.len() > 128 {
            return Err(TenantError::Invalid {
                field: "name",
                message: "at most 128 bytes".into(),
            });
        }
        if let Some(models) = &spec.models {
            if models.is_empty() || models.iter().any(|m| m.is_empty() || m.contains(',') || m.len() > 128) {
                return Err(TenantError::Invalid {
                    field: "models",
                    message: "a non-empty list of model ids (no commas)".into(),
                });
            }
        }
        let now = now_ms();
        if spec.expires_at.is_some_and(|e| e <= now) {
            return Err(TenantError::Invalid {
                field: "expires_at",
                message: "the expiry must be in the future".into(),
            });
        }
        let scopes = spec.scopes.unwrap_or(Scopes::ALL);
        if scopes == Scopes::default() {
            return Err(TenantError::Invalid {
                field: "scopes",
                message: "a key needs at least one scope (inference, manage)".into(),
            });
        }
        let id = random_hex(8)?;
        let secret = random_hex(32)?;
        let info = ApiKeyInfo {
            id: id.clone(),
            tenant_id: t.id.clone(),
            name: spec.name.clone(),
            created_at: now,
            revoked_at: None,
            scopes: scopes.names(),
            models: spec.models.clone(),
            expires_at: spec.expires_at,
        };
        sqlx::query(
            "INSERT INTO api_keys (id, tenant_id, name, secret_sha256, created_at, scopes, models, expires_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
        )
        .bind(&info.id)
        .bind(&info.tenant_id)
        .bind(&info.name)
        .bind(sha256(secret.as_bytes()))
        .bind(info.created_at)
        .bind(scopes.db())
        .bind(spec.models.as_ref().map(|m| m.join(",")))
        .bind(spec.expires_at)
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
        let rows = sqlx::query(&format!("{KEY_COLUMNS} WHERE tenant_id = $1 ORDER BY created_at, id"))
            .bind(&t.id)
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.iter().map(key_from).collect())
    }

    /// One key's description.
    pub async fn key(&self, key_id: &str) -> Result<ApiKeyInfo, TenantError> {
        let key_id = key_id.strip_prefix(KEY_PREFIX).unwrap_or(key_id);
        let key_id = key_id.split('_').next().unwrap_or(key_id);
        let r = sqlx::query(&format!("{KEY_COLUMNS} WHERE id = $1"))
            .bind(key_id)
            .fetch_optional(&self.pool)
            .await?
            .ok_or_else(|| TenantError::NoSuchKey(key_id.to_string()))?;
        Ok(key_from(&r))
    }

    /// Revokes a key (idempotent). Other processes stop accepting it within [`KEY_CACHE_TTL`].
    pub async fn revoke_key(&self, key_id: &str) -> Result<ApiKeyInfo, TenantError> {
        let info = self.key(key_id).await?;
        sqlx::query("UPDATE api_keys SET revoked_at = COALESCE(revoked_at, $1) WHERE id = $2")
            .bind(now_ms())
            .bind(&info.id)
            .execute(&self.pool)
            .await?;
        self.cache.lock().unwrap_or_else(|e| e.into_inner()).remove(&info.id);
        self.key(&info.id).await
    }

    /// Sets a tenant's limits (None = unlimited). Running gateways apply them within
    /// [`KEY_CACHE_TTL`].
    pub async fn set_tenant_limits(&self, tenant: &str, l: Limits) -> Result<Tenant, TenantError> {
        l.check()?;
        let t = self.tenant(tenant).await?;
        sqlx::query(
            "UPDATE tenants SET rpm = $1, tpm = $2, max_concurrent = $3, share = $4, priority = $5 WHERE id = $6",
        )
        .bind(opt_i64(l.rpm))
        .bind(opt_i64(l.tpm))
        .bind(opt_i64(l.concurrent))
        .bind(opt_i64(l.share))
        .bind(l.priority.map(Priority::as_str))
        .bind(&t.id)
        .execute(&self.pool)
        .await?;
        self.forget_cached();
        Ok(t)
    }

    /// Sets a key's limits (None = unlimited).
    /// A key's limits; for a JWT principal (`jwt:<issuer id>:<sub>`, as credentials show
    /// it), that subject's own limits.
    pub async fn set_key_limits(&self, key_id: &str, l: Limits) -> Result<(), TenantError> {
        if l.share.is_some() {
            return Err(TenantError::Invalid {
                field: "share",
                message: "a share is set per tenant, not per key or subject".into(),
            });
        }
        if let Some(rest) = key_id.strip_prefix("jwt:") {
            return self.set_principal_limits(key_id, rest, l).await;
        }
        let key_id = key_id.strip_prefix(KEY_PREFIX).unwrap_or(key_id);
        let res =
            sqlx::query("UPDATE api_keys SET rpm = $1, tpm = $2, max_concurrent = $3, priority = $4 WHERE id = $5")
                .bind(opt_i64(l.rpm))
                .bind(opt_i64(l.tpm))
                .bind(opt_i64(l.concurrent))
                .bind(l.priority.map(Priority::as_str))
                .bind(key_id)
                .execute(&self.pool)
                .await?;
        if res.rows_affected() == 0 {
            return Err(TenantError::NoSuchKey(key_id.to_string()));
        }
        self.cache.lock().unwrap_or_else(|e| e.into_inner()).remove(key_id);
        Ok(())
    }

    async fn set_principal_limits(&self, principal: &str, rest: &str, l: Limits) -> Result<(), TenantError> {
        let Some((issuer_id, sub)) = rest.split_once(':').filter(|(i, s)| !i.is_empty() && !s.is_empty()) else {
            return Err(TenantError::NoSuchKey(principal.to_string()));
        };
        if sub.len() > 512 {
            return Err(TenantError::Invalid {
                field: "key_id",
                message: "a JWT subject of at most 512 bytes".into(),
            });
        }
        let issuer = self.issuer(issuer_id).await.map_err(|e| match e {
            TenantError::NoSuchIssuer(_) => TenantError::NoSuchKey(principal.to_string()),
            e => e,
        })?;
        sqlx::query(
            "INSERT INTO principal_limits (principal, tenant_id, rpm, tpm, max_concurrent, priority) \
             VALUES ($1, $2, $3, $4, $5, $6) \
             ON CONFLICT (principal) DO UPDATE SET rpm = excluded.rpm, tpm = excluded.tpm, \
             max_concurrent = excluded.max_concurrent, priority = excluded.priority",
        )
        .bind(principal)
        .bind(&issuer.tenant_id)
        .bind(opt_i64(l.rpm))
        .bind(opt_i64(l.tpm))
        .bind(opt_i64(l.concurrent))
        .bind(l.priority.map(Priority::as_str))
        .execute(&self.pool)
        .await?;
        self.principals
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(principal);
        Ok(())
    }

    /// A JWT principal's own limits (none set: unlimited), cached like keys.
    pub(crate) async fn principal_limits(&self, principal: &str) -> Result<Limits, sqlx::Error> {
        let cached = self
            .principals
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(principal)
            .copied();
        if let Some((l, at)) = cached {
            if at.elapsed() < KEY_CACHE_TTL || (self.health.is_down() && self.health.usable_stale(at, KEY_CACHE_TTL)) {
                return Ok(l);
            }
        }
        if !self.health.lookup(&self.pool) {
            return Err(sqlx::Error::PoolTimedOut);
        }
        let query =
            sqlx::query("SELECT rpm, tpm, max_concurrent, share, priority FROM principal_limits WHERE principal = $1")
                .bind(principal)
                .fetch_optional(&self.pool);
        let fallback = cached.is_some_and(|(_, at)| self.health.usable_stale(at, KEY_CACHE_TTL));
        let row = match outage::query(fallback, query).await {
            Ok(r) => {
                self.health.answered();
                r
            }
            Err(e) => match cached.filter(|(_, at)| self.health.usable_stale(*at, KEY_CACHE_TTL)) {
                Some((l, _)) => {
                    self.health.failed("principal limits", &e.to_string());
                    return Ok(l);
                }
                None => return Err(e),
            },
        };
        let l = row.map_or_else(Limits::default, |r| Limits::from_row(&r, 0));
        let mut cache = self.principals.lock().unwrap_or_else(|e| e.into_inner());
        if cache.len() > 100_000 {
            cache.clear();
        }
        cache.insert(principal.to_string(), (l, Instant::now()));
        Ok(l)
    }

    /// A tenant's limits.
    pub async fn tenant_limits(&self, tenant: &str) -> Result<Limits, TenantError> {
        let t = self.tenant(tenant).await?;
        let r = sqlx::query("SELECT rpm, tpm, max_concurrent, share, priority FROM tenants WHERE id = $1")
            .bind(&t.id)
            .fetch_one(&self.pool)
            .await?;
        Ok(Limits::from_row(&r, 0))
    }

    /// Sets (or, with None, removes) a tenant's monthly budget.
    pub async fn set_budget(&self, tenant: &str, budget: Option<Budget>) -> Result<Tenant, TenantError> {
        let t = self.tenant(tenant).await?;
        if budget.is_some_and(|b| b.monthly_nusd <= 0) {
            return Err(TenantError::Invalid {
                field: "monthly_usd",
                message: "a budget must be positive (remove it instead)".into(),
            });
        }
        sqlx::query("UPDATE tenants SET monthly_budget_nusd = $1, budget_mode = $2 WHERE id = $3")
            .bind(budget.map(|b| b.monthly_nusd))
            .bind(if budget.is_some_and(|b| !b.hard) {
                "soft"
            } else {
                "hard"
            })
            .bind(&t.id)
            .execute(&self.pool)
            .await?;
        self.forget_cached();
        Ok(t)
    }

    pub async fn budget(&self, tenant: &str) -> Result<Option<Budget>, TenantError> {
        let t = self.tenant(tenant).await?;
        let r = sqlx::query("SELECT monthly_budget_nusd, budget_mode FROM tenants WHERE id = $1")
            .bind(&t.id)
            .fetch_one(&self.pool)
            .await?;
        Ok(budget_from(r.get(0), &r.get::<String, _>(1)))
    }

    /// Every tenant's monthly budget, by tenant id (one query; tenants without one are absent).
    pub async fn budgets(&self) -> Result<std::collections::HashMap<String, Budget>, TenantError> {
        let rows = sqlx::query("SELECT id, monthly_budget_nusd, budget_mode FROM tenants")
            .fetch_all(&self.pool)
            .await?;
        Ok(rows
            .iter()
            .filter_map(|r| Some((r.get::<String, _>(0), budget_from(r.get(1), &r.get::<String, _>(2))?)))
            .collect())
    }

    /// Whether any usable key exists (for the first-start hint).
    pub async fn has_active_keys(&self) -> Result<bool, TenantError> {
        let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM api_keys WHERE revoked_at IS NULL")
            .fetch_one(&self.pool)
            .await?;
        Ok(n > 0)
    }

    /// Checks a presented credential: an API key (`hk_…`) or a JWT from a registered issuer.
    pub async fn authenticate(&self, presented: &str) -> Result<TenantContext, AuthError> {
        if presented.starts_with(KEY_PREFIX) {
            self.authenticate_key(presented).await
        } else if presented.bytes().filter(|b| *b == b'.').count() == 2 {
            self.authenticate_jwt(presented).await
        } else {
            Err(AuthError::Malformed)
        }
    }

    /// Whether `presented` is an API key this process holds in its cache with the right
    /// secret (fresh, or usable while the store is down): a credential known to be good,
    /// which throttling for bad credentials must not hold up.
    pub fn cached_valid(&self, presented: &str) -> bool {
        let Some((id, secret)) = presented.strip_prefix(KEY_PREFIX).and_then(|r| r.split_once('_')) else {
            return false;
        };
        let cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        cache.get(id).is_some_and(|c| {
            (c.fetched.elapsed() < KEY_CACHE_TTL || self.health.usable_stale(c.fetched, KEY_CACHE_TTL))
                && !c.revoked
                && constant_time_eq(&sha256(secret.as_bytes()), &c.secret_sha256)
        })
    }

    async fn authenticate_key(&self, presented: &str) -> Result<TenantContext, AuthError> {
        let rest = presented.strip_prefix(KEY_PREFIX).ok_or(AuthError::Malformed)?;
        let (id, secret) = rest.split_once('_').ok_or(AuthError::Malformed)?;
        if id.is_empty() || id.len() > 64 || secret.is_empty() || secret.len() > 256 {
            return Err(AuthError::Malformed);
        }
        let entry = self.key_entry(id).await?;
        if !constant_time_eq(&sha256(secret.as_bytes()), &entry.secret_sha256) {
            return Err(AuthError::Unknown);
        }
        entry.usable()
    }

    /// The context of the API key `id` without its secret, for a dashboard session opened
    /// with that key: revoked or expired keys are refused, so ending the key ends the session.
    pub async fn key_context(&self, id: &str) -> Result<TenantContext, AuthError> {
        if id.is_empty() || id.len() > 64 {
            return Err(AuthError::Malformed);
        }
        self.key_entry(id).await?.usable()
    }

    async fn key_entry(&self, id: &str) -> Result<CachedKey, AuthError> {
        let cached = self.cache.lock().unwrap_or_else(|e| e.into_inner()).get(id).cloned();
        if let Some(c) = cached.as_ref().filter(|c| c.fetched.elapsed() < KEY_CACHE_TTL) {
            return Ok(c.clone());
        }
        if cached.is_none() && self.unknown_keys.contains(id) {
            return Err(AuthError::Unknown);
        }
        // What may answer if the store does not (see [`outage`]).
        let stale = cached.filter(|c| self.health.usable_stale(c.fetched, KEY_CACHE_TTL));
        let from_cache = |stale: Option<CachedKey>, why: String| match stale {
            Some(c) => {
                self.health.served_stale();
                Ok(c)
            }
            None => Err(AuthError::Store(why)),
        };
        if !self.health.lookup(&self.pool) {
            return from_cache(stale, "the key store is unreachable".into());
        }
        let query = sqlx::query(
            "SELECT k.secret_sha256, k.revoked_at, t.id, t.name, \
             t.rpm, t.tpm, t.max_concurrent, t.share, t.priority, \
             k.rpm, k.tpm, k.max_concurrent, k.share, k.priority, k.scopes, k.models, k.expires_at, \
             t.monthly_budget_nusd, t.budget_mode, t.suspended_at \
             FROM api_keys k JOIN tenants t ON t.id = k.tenant_id WHERE k.id = $1",
        )
        .bind(id)
        .fetch_optional(&self.pool);
        // With something to fall back on (or a store known to be down), a slow store is not
        // waited for.
        let row = outage::query(stale.is_some(), query).await;
        let row = match row {
            Ok(r) => {
                self.health.answered();
                r
            }
            Err(e) => {
                self.health.failed("api key", &e.to_string());
                return from_cache(stale, e.to_string());
            }
        };
        let Some(row) = row else {
            self.unknown_keys.insert(id);
            self.cache.lock().unwrap_or_else(|e| e.into_inner()).remove(id);
            return Err(AuthError::Unknown);
        };
        let revoked_at: Option<i64> = row.get(1);
        let scopes: String = row.get(14);
        let c = CachedKey {
            secret_sha256: row.get(0),
            revoked: revoked_at.is_some(),
            suspended: row.get::<Option<i64>, _>(19).is_some(),
            expires_at: row.get(16),
            ctx: TenantContext {
                tenant_id: row.get(2),
                tenant_name: row.get(3),
                key_id: id.to_string(),
                scopes: Scopes::parse(&scopes).unwrap_or_default(),
                models: models_from_db(row.get(15)).map(Into::into),
                tenant_limits: Limits::from_row(&row, 4),
                key_limits: Limits::from_row(&row, 9),
                budget: budget_from(row.get(17), &row.get::<String, _>(18)),
                expires_at: row.get(16),
            },
            fetched: Instant::now(),
        };
        self.cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id.to_string(), c.clone());
        Ok(c)
    }
}

impl CachedKey {
    fn usable(self) -> Result<TenantContext, AuthError> {
        let entry = self;
        if entry.revoked {
            return Err(AuthError::Revoked);
        }
        if entry.suspended {
            return Err(AuthError::Suspended(entry.ctx.tenant_name));
        }
        if let Some(e) = entry.expires_at.filter(|e| *e <= now_ms()) {
            return Err(AuthError::Expired(e));
        }
        Ok(entry.ctx)
    }
}

#[cfg(test)]
mod tests;

//! Dashboard sessions, kept server-side in the shared database so every gateway replica
//! knows them.
//!
//! Signing in exchanges a credential for a random session token (the cookie's value). The
//! database holds only the token's SHA-256, so reading the table yields no usable cookie.
//! A session ends at the first of: sign-out ([`TenantStore::end_session`]), its absolute
//! lifetime, [`IDLE_TIMEOUT`] without a request, or its credential's own end — an API key
//! is looked up again on every request (revoked or expired: the session is dead), a JWT
//! session never outlives the token's `exp`, an operator session dies when the admin token
//! changes (one opened through the operators' identity provider, when its address leaves
//! `--operators`), a member's session dies with the member (and reads its role again each time).

use sha2::{Digest, Sha256};
use sqlx::any::AnyRow;
use sqlx::Row;

use crate::{
    budget_from, constant_time_eq, models_from_db, now_ms, random_hex, AuthError, Limits, Scopes, TenantContext,
    TenantError, TenantStore,
};

/// A session's longest life.
pub const MAX_LIFETIME_MS: i64 = 12 * 3600 * 1000;
/// A session unused this long ends.
pub const IDLE_TIMEOUT_MS: i64 = 30 * 60 * 1000;
/// `last_seen` is written at most this often (a page view is not a database write).
const TOUCH_EVERY_MS: i64 = 60 * 1000;

/// Who a session is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SessionKind {
    /// The operator, by the admin token's fingerprint.
    Operator { admin_fp: String },
    /// An operator who signed in through the operators' identity provider (the dashboard or
    /// `hearth admin login`): lives while the address is on the gateway's `--operators`.
    OperatorSso { email: String },
    /// A tenant credential with the `manage` scope.
    Tenant {
        tenant_id: String,
        /// An API key id, or a JWT principal `jwt:<issuer id>:<sub>`.
        credential: String,
        /// A JWT's scopes and models as the token carried them (API keys are read again).
        scopes: Scopes,
        models: Option<Vec<String>>,
    },
    /// A tenant's member (its role is read again on every request; removal ends it).
    Member { tenant_id: String, member_id: String },
}

/// A live session.
#[derive(Debug, Clone)]
pub struct Session {
    pub kind: SessionKind,
    /// The anti-CSRF token every state change must carry.
    pub csrf: String,
    pub created_at: i64,
    pub expires_at: i64,
    /// The SHA-256 (hex) of the cookie's token: the session's id in the database.
    pub id: String,
}

/// A fingerprint of the admin token (its SHA-256, hex): an operator session remembers which
/// token opened it without storing the token.
pub fn admin_fingerprint(token: &str) -> String {
    hex(&Sha256::digest(token.as_bytes()))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn token_id(token: &str) -> String {
    hex(&Sha256::digest(token.as_bytes()))
}

impl TenantStore {
    /// Opens a session; returns its cookie token (shown once, never stored) and the session.
    /// `credential_end` caps its life (a key's expiry, a JWT's `exp`).
    pub async fn create_session(
        &self,
        kind: SessionKind,
        credential_end: Option<i64>,
        address: Option<&str>,
    ) -> Result<(String, Session), TenantError> {
        let token = random_hex(32)?;
        let now = now_ms();
        let expires_at = credential_end.map_or(now + MAX_LIFETIME_MS, |e| e.min(now + MAX_LIFETIME_MS));
        let s = Session {
            kind,
            csrf: random_hex(32)?,
            created_at: now,
            expires_at,
            id: token_id(&token),
        };
        let (k, tenant, credential, scopes, models, fp) = match &s.kind {
            SessionKind::Operator { admin_fp } => ("operator", None, None, None, None, Some(admin_fp.clone())),
            SessionKind::OperatorSso { email } => ("operator-sso", None, Some(email.clone()), None, None, None),
            SessionKind::Tenant {
                tenant_id,
                credential,
                scopes,
                models,
            } => (
                "tenant",
                Some(tenant_id.clone()),
                Some(credential.clone()),
                Some(scopes.names().join(",")),
                models.as_ref().map(|m| m.join(",")),
                None,
            ),
            SessionKind::Member { tenant_id, member_id } => (
                "member",
                Some(tenant_id.clone()),
                Some(member_id.clone()),
                None,
                None,
                None,
            ),
        };
        sqlx::query(
            "INSERT INTO dashboard_sessions (token_sha256, kind, tenant_id, credential, scopes, models, admin_fp, \
             csrf, address, created_at, last_seen, expires_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)",
        )
        .bind(&s.id)
        .bind(k)
        .bind(tenant)
        .bind(credential)
        .bind(scopes)
        .bind(models)
        .bind(fp)
        .bind(&s.csrf)
        .bind(address)
        .bind(now)
        .bind(now)
        .bind(expires_at)
        .execute(&self.pool)
        .await?;
        Ok((token, s))
    }

    /// The live session of a cookie token, if any (expired and idle ones are deleted).
    pub async fn session(&self, token: &str) -> Result<Option<Session>, TenantError> {
        if token.len() != 64 || !token.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Ok(None);
        }
        let id = token_id(token);
        let Some(r) = sqlx::query(
            "SELECT kind, tenant_id, credential, scopes, models, admin_fp, csrf, created_at, last_seen, expires_at \
             FROM dashboard_sessions WHERE token_sha256 = $1",
        )
        .bind(&id)
        .fetch_optional(&self.pool)
        .await?
        else {
            return Ok(None);
        };
        let now = now_ms();
        let last_seen: i64 = r.get(8);
        let expires_at: i64 = r.get(9);
        if now >= expires_at || now - last_seen >= IDLE_TIMEOUT_MS {
            self.end_session_id(&id).await?;
            return Ok(None);
        }
        if now - last_seen >= TOUCH_EVERY_MS {
            sqlx::query("UPDATE dashboard_sessions SET last_seen = $1 WHERE token_sha256 = $2")
                .bind(now)
                .bind(&id)
                .execute(&self.pool)
                .await?;
        }
        Ok(Some(session_from(&r, id)))
    }

    /// Signs a session out (idempotent).
    pub async fn end_session(&self, token: &str) -> Result<(), TenantError> {
        self.end_session_id(&token_id(token)).await
    }

    async fn end_session_id(&self, id: &str) -> Result<(), TenantError> {
        sqlx::query("DELETE FROM dashboard_sessions WHERE token_sha256 = $1")
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// The installation's secret `name` (32 random bytes, hex), created on first use and
    /// shared by every gateway on this database (concurrent first uses agree on one value).
    pub async fn server_secret(&self, name: &str) -> Result<String, TenantError> {
        sqlx::query(
            "INSERT INTO server_secrets (name, value, created_at) VALUES ($1, $2, $3) ON CONFLICT (name) DO NOTHING",
        )
        .bind(name)
        .bind(random_hex(32)?)
        .bind(now_ms())
        .execute(&self.pool)
        .await?;
        let r = sqlx::query("SELECT value FROM server_secrets WHERE name = $1")
            .bind(name)
            .fetch_one(&self.pool)
            .await?;
        Ok(r.get(0))
    }

    /// Deletes every expired or idle session; returns how many.
    pub async fn purge_sessions(&self) -> Result<u64, TenantError> {
        let now = now_ms();
        let r = sqlx::query("DELETE FROM dashboard_sessions WHERE expires_at <= $1 OR last_seen <= $2")
            .bind(now)
            .bind(now - IDLE_TIMEOUT_MS)
            .execute(&self.pool)
            .await?;
        Ok(r.rows_affected())
    }

    /// The tenant credential behind a session, as it stands now: an API key is read again
    /// (a revoked or expired key ends the session); a JWT principal gets its tenant's
    /// current limits and budget, and only while its issuer is still registered.
    pub async fn session_context(&self, s: &Session) -> Result<TenantContext, AuthError> {
        let SessionKind::Tenant {
            tenant_id,
            credential,
            scopes,
            models,
        } = &s.kind
        else {
            return Err(AuthError::Unknown);
        };
        let mut ctx = if let Some(rest) = credential.strip_prefix("jwt:") {
            let issuer = rest.split(':').next().unwrap_or("");
            let r = sqlx::query(
                "SELECT t.id, t.name, t.rpm, t.tpm, t.max_concurrent, t.share, t.priority, \
                 t.monthly_budget_nusd, t.budget_mode, t.suspended_at FROM jwt_issuers i \
                 JOIN tenants t ON t.id = i.tenant_id WHERE i.id = $1",
            )
            .bind(issuer)
            .fetch_optional(&self.pool)
            .await
            .map_err(|e| AuthError::Store(e.to_string()))?
            .ok_or(AuthError::Unknown)?;
            if r.get::<Option<i64>, _>(9).is_some() {
                return Err(AuthError::Suspended(r.get(1)));
            }
            let key_limits = self
                .principal_limits(credential)
                .await
                .map_err(|e| AuthError::Store(e.to_string()))?;
            TenantContext {
                tenant_id: r.get(0),
                tenant_name: r.get(1),
                key_id: credential.clone(),
                scopes: *scopes,
                models: models.clone().map(Into::into),
                tenant_limits: Limits::from_row(&r, 2),
                key_limits,
                budget: budget_from(r.get(7), &r.get::<String, _>(8)),
                expires_at: Some(s.expires_at),
            }
        } else {
            self.key_context(credential).await?
        };
        if !constant_time_eq(ctx.tenant_id.as_bytes(), tenant_id.as_bytes()) || !ctx.scopes.manage {
            return Err(AuthError::Unknown);
        }
        ctx.expires_at = Some(ctx.expires_at.map_or(s.expires_at, |e| e.min(s.expires_at)));
        Ok(ctx)
    }
}

fn session_from(r: &AnyRow, id: String) -> Session {
    let kind: String = r.get(0);
    let kind = if kind == "operator" {
        SessionKind::Operator {
            admin_fp: r.get::<Option<String>, _>(5).unwrap_or_default(),
        }
    } else if kind == "operator-sso" {
        SessionKind::OperatorSso {
            email: r.get::<Option<String>, _>(2).unwrap_or_default(),
        }
    } else if kind == "member" {
        SessionKind::Member {
            tenant_id: r.get::<Option<String>, _>(1).unwrap_or_default(),
            member_id: r.get::<Option<String>, _>(2).unwrap_or_default(),
        }
    } else {
        SessionKind::Tenant {
            tenant_id: r.get::<Option<String>, _>(1).unwrap_or_default(),
            credential: r.get::<Option<String>, _>(2).unwrap_or_default(),
            scopes: Scopes::parse(&r.get::<Option<String>, _>(3).unwrap_or_default()).unwrap_or_default(),
            models: models_from_db(r.get(4)),
        }
    };
    Session {
        kind,
        csrf: r.get(6),
        created_at: r.get(7),
        expires_at: r.get(9),
        id,
    }
}

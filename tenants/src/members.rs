//! A tenant's members: the people who sign into the dashboard, each with one [`Role`].
//!
//! What a role may do is decided by the gateway's management service (one table, enforced
//! for every channel); this module keeps the members, their invitations and their
//! passwords.
//!
//! * **Identity** is per tenant: a member is an e-mail address (lower-cased) within one
//!   tenant, so the same person in two tenants is two members, as with per-tenant identity
//!   providers.
//! * **Passwords** are stored as Argon2id PHC strings (the `argon2` crate's defaults: 19 MiB,
//!   2 passes, 1 lane — OWASP's minimum). Checking a sign-in for an address that is not a
//!   member, or has no password, verifies the password against a fixed dummy hash all the
//!   same, so the answer takes as long as a wrong password.
//! * **Invitations** carry a random token (shown once, as a link); only its SHA-256 is stored.
//!   They expire after [`INVITATION_TTL_MS`]; accepting one sets the password and deletes it.
//! * **Changes** ([`TenantStore::change_member`]) run in one transaction that first locks the
//!   tenant's row, apply only if the member still has the role the caller checked, and are
//!   undone if they would leave a tenant with members but no owner. Removal also deletes
//!   every dashboard session the member opened (the next request of an open tab is refused)
//!   and the invitations it sent.

use std::sync::OnceLock;

use argon2::password_hash::{PasswordHash, PasswordHasher, PasswordVerifier, SaltString};
use argon2::Argon2;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use sqlx::any::AnyRow;
use sqlx::Row;

use crate::sessions::Session;
use crate::{budget_from, now_ms, random_hex, AuthError, Limits, Scopes, TenantContext, TenantError, TenantStore};

/// An invitation's life.
pub const INVITATION_TTL_MS: i64 = 7 * 24 * 3600 * 1000;
/// The shortest password accepted.
pub const MIN_PASSWORD_CHARS: usize = 12;
/// The longest (hashing cost is per byte; nobody types more).
pub const MAX_PASSWORD_BYTES: usize = 1024;

/// A member's role. What each may do is the management service's table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Owner,
    Admin,
    Developer,
    Billing,
    Viewer,
}

impl Role {
    pub const ALL: [Role; 5] = [Role::Owner, Role::Admin, Role::Developer, Role::Billing, Role::Viewer];

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Owner => "owner",
            Role::Admin => "admin",
            Role::Developer => "developer",
            Role::Billing => "billing",
            Role::Viewer => "viewer",
        }
    }

    pub fn parse(s: &str) -> Option<Role> {
        Role::ALL.into_iter().find(|r| r.as_str() == s)
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A member (never with its password hash).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Member {
    /// `mb_…`
    pub id: String,
    pub tenant_id: String,
    /// Lower-cased.
    pub email: String,
    pub role: Role,
    /// Whether the member can sign in with a password.
    pub has_password: bool,
    /// Unix ms.
    pub created_at: i64,
}

/// An open invitation (the token itself is shown once, at creation).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Invitation {
    /// `inv_…`
    pub id: String,
    pub tenant_id: String,
    pub email: String,
    pub role: Role,
    /// The audit name of who invited.
    pub invited_by: String,
    pub created_at: i64,
    pub expires_at: i64,
}

/// A member signed in: who, and the tenant context their actions run under (the tenant's
/// limits and budget; all scopes — the role is what narrows them).
#[derive(Debug, Clone)]
pub struct MemberContext {
    pub member: Member,
    pub ctx: TenantContext,
}

/// A normalised e-mail address, or why not.
pub fn normalise_email(email: &str) -> Result<String, TenantError> {
    let e = email.trim().to_lowercase();
    let ok = e.len() <= 254
        && e.split_once('@').is_some_and(|(local, domain)| {
            !local.is_empty() && !domain.is_empty() && !domain.contains('@') && !domain.starts_with('.')
        })
        && !e
            .chars()
            .any(|c| c.is_whitespace() || c.is_control() || matches!(c, '<' | '>' | '"'));
    if ok {
        Ok(e)
    } else {
        Err(TenantError::Invalid {
            field: "email",
            message: format!("{email:?} is not an e-mail address"),
        })
    }
}

/// Checks a new password against the policy.
pub fn check_password_policy(password: &str) -> Result<(), TenantError> {
    let n = password.chars().count();
    if n < MIN_PASSWORD_CHARS || password.len() > MAX_PASSWORD_BYTES {
        return Err(TenantError::Invalid {
            field: "password",
            message: format!("a password has {MIN_PASSWORD_CHARS} to {MAX_PASSWORD_BYTES} characters"),
        });
    }
    Ok(())
}

/// The Argon2id PHC string of a password (CPU-heavy: call off the async threads).
pub fn hash_password(password: &str) -> Result<String, TenantError> {
    check_password_policy(password)?;
    let mut salt = [0u8; 16];
    getrandom::fill(&mut salt).map_err(|e| TenantError::Random(e.to_string()))?;
    let salt = SaltString::encode_b64(&salt).map_err(|e| TenantError::Random(e.to_string()))?;
    Argon2::default()
        .hash_password(password.as_bytes(), &salt)
        .map(|h| h.to_string())
        .map_err(|e| TenantError::Password(e.to_string()))
}

/// Whether `password` matches `hash`; with no hash (no such member, or none set) a dummy
/// hash is verified instead so the time taken does not tell (CPU-heavy).
pub fn verify_password(hash: Option<&str>, password: &str) -> bool {
    static DUMMY: OnceLock<Option<String>> = OnceLock::new();
    let dummy = DUMMY.get_or_init(|| {
        let salt = SaltString::encode_b64(b"hearth-dummy-salt").ok()?;
        Argon2::default()
            .hash_password(b"not-a-password-anyone-has", &salt)
            .ok()
            .map(|h| h.to_string())
    });
    let (phc, real) = match (hash, dummy) {
        (Some(h), _) => (h, true),
        (None, Some(d)) => (d.as_str(), false),
        (None, None) => {
            // No dummy (cannot happen with the default parameters): spend the same work.
            let _ = hash_password(password);
            return false;
        }
    };
    let ok = PasswordHash::new(phc)
        .map(|parsed| Argon2::default().verify_password(password.as_bytes(), &parsed).is_ok())
        .unwrap_or(false);
    ok && real && password.len() <= MAX_PASSWORD_BYTES
}

pub(crate) fn token_sha256(token: &str) -> String {
    Sha256::digest(token.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

pub(crate) const MEMBER_COLUMNS: &str = "SELECT id, tenant_id, email, role, password_hash, created_at FROM members";

pub(crate) fn member_from(r: &AnyRow) -> Member {
    Member {
        id: r.get(0),
        tenant_id: r.get(1),
        email: r.get(2),
        role: Role::parse(&r.get::<String, _>(3)).unwrap_or(Role::Viewer),
        has_password: r.get::<Option<String>, _>(4).is_some(),
        created_at: r.get(5),
    }
}

const INVITATION_COLUMNS: &str =
    "SELECT id, tenant_id, email, role, invited_by, created_at, expires_at FROM member_invitations";

fn invitation_from(r: &AnyRow) -> Invitation {
    Invitation {
        id: r.get(0),
        tenant_id: r.get(1),
        email: r.get(2),
        role: Role::parse(&r.get::<String, _>(3)).unwrap_or(Role::Viewer),
        invited_by: r.get(4),
        created_at: r.get(5),
        expires_at: r.get(6),
    }
}

impl TenantStore {
    /// Invites `email` into a tenant as `role`; returns the link's token (shown once) and
    /// the invitation. An open invitation for the same address is replaced; an address that
    /// is already a member is refused.
    pub async fn invite_member(
        &self,
        tenant: &str,
        email: &str,
        role: Role,
        invited_by: &str,
    ) -> Result<(String, Invitation), TenantError> {
        let t = self.tenant(tenant).await?;
        let email = normalise_email(email)?;
        if self.member_by_email(&t.id, &email).await?.is_some() {
            return Err(TenantError::Invalid {
                field: "email",
                message: format!("{email} is already a member of this tenant"),
            });
        }
        let token = random_hex(32)?;
        let now = now_ms();
        let inv = Invitation {
            id: format!("inv_{}", random_hex(8)?),
            tenant_id: t.id.clone(),
            email,
            role,
            invited_by: invited_by.to_string(),
            created_at: now,
            expires_at: now + INVITATION_TTL_MS,
        };
        let mut tx = self.pool.begin().await?;
        sqlx::query("DELETE FROM member_invitations WHERE (tenant_id = $1 AND email = $2) OR expires_at <= $3")
            .bind(&inv.tenant_id)
            .bind(&inv.email)
            .bind(now)
            .execute(&mut *tx)
            .await?;
        sqlx::query(
            "INSERT INTO member_invitations (id, token_sha256, tenant_id, email, role, invited_by, created_at, \
             expires_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
        )
        .bind(&inv.id)
        .bind(token_sha256(&token))
        .bind(&inv.tenant_id)
        .bind(&inv.email)
        .bind(inv.role.as_str())
        .bind(&inv.invited_by)
        .bind(inv.created_at)
        .bind(inv.expires_at)
        .execute(&mut *tx)
        .await
        .map_err(|e| match &e {
            sqlx::Error::Database(d) if d.is_unique_violation() => {
                TenantError::Conflict(format!("{} was invited at the same moment: try again", inv.email))
            }
            _ => TenantError::Db(e),
        })?;
        tx.commit().await?;
        Ok((token, inv))
    }

    /// The open invitation of a link's token, if it exists and has not expired.
    pub async fn invitation(&self, token: &str) -> Result<Option<Invitation>, TenantError> {
        if token.len() != 64 || !token.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Ok(None);
        }
        let r = sqlx::query(&format!("{INVITATION_COLUMNS} WHERE token_sha256 = $1"))
            .bind(token_sha256(token))
            .fetch_optional(&self.pool)
            .await?;
        Ok(r.map(|r| invitation_from(&r)).filter(|i| i.expires_at > now_ms()))
    }

    /// A tenant's open invitations, newest first.
    pub async fn list_invitations(&self, tenant_id: &str) -> Result<Vec<Invitation>, TenantError> {
        let rows = sqlx::query(&format!(
            "{INVITATION_COLUMNS} WHERE tenant_id = $1 AND expires_at > $2 ORDER BY created_at DESC, id"
        ))
        .bind(tenant_id)
        .bind(now_ms())
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.iter().map(invitation_from).collect())
    }

    /// The open invitation of an address in a tenant, if any.
    pub async fn open_invitation(&self, tenant_id: &str, email: &str) -> Result<Option<Invitation>, TenantError> {
        let Ok(email) = normalise_email(email) else {
            return Ok(None);
        };
        let r = sqlx::query(&format!(
            "{INVITATION_COLUMNS} WHERE tenant_id = $1 AND email = $2 AND expires_at > $3"
        ))
        .bind(tenant_id)
        .bind(email)
        .bind(now_ms())
        .fetch_optional(&self.pool)
        .await?;
        Ok(r.map(|r| invitation_from(&r)))
    }

    /// An invitation by id (open or expired).
    pub async fn invitation_by_id(&self, id: &str) -> Result<Invitation, TenantError> {
        let r = sqlx::query(&format!("{INVITATION_COLUMNS} WHERE id = $1"))
            .bind(id)
            .fetch_optional(&self.pool)
            .await?
            .ok_or_else(|| TenantError::NoSuchInvitation(id.to_string()))?;
        Ok(invitation_from(&r))
    }

    /// Withdraws an invitation; returns it.
    pub async fn revoke_invitation(&self, id: &str) -> Result<Invitation, TenantError> {
        let inv = self.invitation_by_id(id).await?;
        sqlx::query("DELETE FROM member_invitations WHERE id = $1")
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(inv)
    }

    /// Accepts an invitation: creates the member with the password's hash (from
    /// [`hash_password`]) and deletes the invitation, in one transaction. None: the token is
    /// unknown, used or expired.
    pub async fn accept_invitation(&self, token: &str, password_hash: &str) -> Result<Option<Member>, TenantError> {
        let Some(inv) = self.invitation(token).await? else {
            return Ok(None);
        };
        self.take_invitation(&inv, Some(password_hash), None).await
    }

    /// Turns an invitation into a member, with a password hash or an identity provider's
    /// (issuer, subject); None when another request took it first.
    pub(crate) async fn take_invitation(
        &self,
        inv: &Invitation,
        password_hash: Option<&str>,
        sso: Option<(&str, &str)>,
    ) -> Result<Option<Member>, TenantError> {
        let member = Member {
            id: format!("mb_{}", random_hex(8)?),
            tenant_id: inv.tenant_id.clone(),
            email: inv.email.clone(),
            role: inv.role,
            has_password: password_hash.is_some(),
            created_at: now_ms(),
        };
        let mut tx = self.pool.begin().await?;
        // Only the request that deletes the invitation creates the member (two tabs racing).
        let taken = sqlx::query("DELETE FROM member_invitations WHERE id = $1")
            .bind(&inv.id)
            .execute(&mut *tx)
            .await?
            .rows_affected();
        if taken == 0 {
            return Ok(None);
        }
        sqlx::query(
            "INSERT INTO members (id, tenant_id, email, role, password_hash, created_at, sso_issuer, sso_subject) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
        )
        .bind(&member.id)
        .bind(&member.tenant_id)
        .bind(&member.email)
        .bind(member.role.as_str())
        .bind(password_hash)
        .bind(member.created_at)
        .bind(sso.map(|s| s.0))
        .bind(sso.map(|s| s.1))
        .execute(&mut *tx)
        .await
        .map_err(|e| match &e {
            sqlx::Error::Database(d) if d.is_unique_violation() => TenantError::Invalid {
                field: "email",
                message: format!("{} is already a member of this tenant", member.email),
            },
            _ => TenantError::Db(e),
        })?;
        tx.commit().await?;
        Ok(Some(member))
    }

    /// A tenant's members, by e-mail.
    pub async fn list_members(&self, tenant_id: &str) -> Result<Vec<Member>, TenantError> {
        let rows = sqlx::query(&format!("{MEMBER_COLUMNS} WHERE tenant_id = $1 ORDER BY email"))
            .bind(tenant_id)
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.iter().map(member_from).collect())
    }

    /// Whether a tenant has any member (then its API keys no longer open dashboard sessions).
    pub async fn has_members(&self, tenant_id: &str) -> Result<bool, TenantError> {
        let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM members WHERE tenant_id = $1")
            .bind(tenant_id)
            .fetch_one(&self.pool)
            .await?;
        Ok(n > 0)
    }

    pub async fn member(&self, id: &str) -> Result<Member, TenantError> {
        let r = sqlx::query(&format!("{MEMBER_COLUMNS} WHERE id = $1"))
            .bind(id)
            .fetch_optional(&self.pool)
            .await?
            .ok_or_else(|| TenantError::NoSuchMember(id.to_string()))?;
        Ok(member_from(&r))
    }

    async fn member_by_email(
        &self,
        tenant_id: &str,
        email: &str,
    ) -> Result<Option<(Member, Option<String>)>, TenantError> {
        let r = sqlx::query(&format!("{MEMBER_COLUMNS} WHERE tenant_id = $1 AND email = $2"))
            .bind(tenant_id)
            .bind(email)
            .fetch_optional(&self.pool)
            .await?;
        Ok(r.map(|r| (member_from(&r), r.get(4))))
    }

    /// The member a password sign-in names (tenant by name or id), with its password hash;
    /// None when the tenant or the member does not exist (the caller still verifies against
    /// the dummy hash).
    pub async fn member_for_sign_in(
        &self,
        tenant: &str,
        email: &str,
    ) -> Result<Option<(Member, Option<String>)>, TenantError> {
        let Ok(email) = normalise_email(email) else {
            return Ok(None);
        };
        let t = match self.tenant(tenant).await {
            Ok(t) => t,
            Err(TenantError::NoSuchTenant(_)) => return Ok(None),
            Err(e) => return Err(e),
        };
        self.member_by_email(&t.id, &email).await
    }

    /// Changes a member's role (`Some`) or removes it (`None`), if it still has the role
    /// `expected` (else [`TenantError::Conflict`]: it changed meanwhile). In one transaction
    /// that locks the tenant's row first, so concurrent changes of one tenant's members run
    /// one after the other; undone if the tenant would be left without an owner (while it
    /// has members, or because the last owner leaves). Removal
    /// also deletes the member's dashboard sessions and the invitations it sent;
    /// `drop_invitations` deletes those on a role change too (the new role may not invite).
    pub async fn change_member(
        &self,
        id: &str,
        expected: Role,
        to: Option<Role>,
        drop_invitations: bool,
    ) -> Result<Member, TenantError> {
        let m = self.member(id).await?;
        let mut tx = self.pool.begin().await?;
        sqlx::query("UPDATE tenants SET name = name WHERE id = $1")
            .bind(&m.tenant_id)
            .execute(&mut *tx)
            .await?;
        let changed = match to {
            Some(role) => sqlx::query("UPDATE members SET role = $1 WHERE id = $2 AND role = $3")
                .bind(role.as_str())
                .bind(id)
                .bind(expected.as_str()),
            None => sqlx::query("DELETE FROM members WHERE id = $1 AND role = $2")
                .bind(id)
                .bind(expected.as_str()),
        }
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if changed == 0 {
            return Err(TenantError::Conflict(format!(
                "member {id:?} changed meanwhile: reload and try again"
            )));
        }
        let counts = sqlx::query(
            "SELECT COUNT(*), COALESCE(SUM(CASE WHEN role = 'owner' THEN 1 ELSE 0 END), 0) FROM members \
             WHERE tenant_id = $1",
        )
        .bind(&m.tenant_id)
        .fetch_one(&mut *tx)
        .await?;
        let (members, owners): (i64, i64) = (counts.get(0), counts.get(1));
        // Also the last owner leaving a tenant of one: a tenant that had people keeps one.
        if owners == 0 && (members > 0 || expected == Role::Owner) {
            return Err(TenantError::Conflict(
                "a tenant keeps at least one owner: make another member owner first".into(),
            ));
        }
        if to.is_none() {
            sqlx::query("DELETE FROM dashboard_sessions WHERE kind = 'member' AND credential = $1")
                .bind(id)
                .execute(&mut *tx)
                .await?;
        }
        if to.is_none() || drop_invitations {
            sqlx::query("DELETE FROM member_invitations WHERE invited_by LIKE $1")
                .bind(format!("member:{id}:%"))
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(Member {
            role: to.unwrap_or(m.role),
            ..m
        })
    }

    /// How many owners a tenant has.
    pub async fn owner_count(&self, tenant_id: &str) -> Result<i64, TenantError> {
        Ok(
            sqlx::query_scalar("SELECT COUNT(*) FROM members WHERE tenant_id = $1 AND role = 'owner'")
                .bind(tenant_id)
                .fetch_one(&self.pool)
                .await?,
        )
    }

    /// The member behind a member session, as it stands now (its current role; a removed
    /// member is `Unknown`), and the tenant context its actions run under.
    pub async fn session_member(&self, s: &Session) -> Result<MemberContext, AuthError> {
        let crate::sessions::SessionKind::Member { tenant_id, member_id } = &s.kind else {
            return Err(AuthError::Unknown);
        };
        self.member_context(member_id, tenant_id, s.expires_at).await
    }

    /// A member of `tenant_id` as it stands now, acting until `until` (Unix ms).
    pub async fn member_context(
        &self,
        member_id: &str,
        tenant_id: &str,
        until: i64,
    ) -> Result<MemberContext, AuthError> {
        let store = |e: sqlx::Error| AuthError::Store(e.to_string());
        let r = sqlx::query(
            "SELECT m.id, m.tenant_id, m.email, m.role, m.password_hash, m.created_at, t.name, t.rpm, t.tpm, \
             t.max_concurrent, t.share, t.priority, t.monthly_budget_nusd, t.budget_mode, t.suspended_at \
             FROM members m JOIN tenants t ON t.id = m.tenant_id WHERE m.id = $1",
        )
        .bind(member_id)
        .fetch_optional(&self.pool)
        .await
        .map_err(store)?
        .ok_or(AuthError::Unknown)?;
        let member = member_from(&r);
        if member.tenant_id != tenant_id {
            return Err(AuthError::Unknown);
        }
        if r.get::<Option<i64>, _>(14).is_some() {
            return Err(AuthError::Suspended(r.get(6)));
        }
        let ctx = TenantContext {
            tenant_id: member.tenant_id.clone(),
            tenant_name: r.get(6),
            key_id: format!("member:{}", member.id),
            scopes: Scopes::ALL,
            models: None,
            tenant_limits: Limits::from_row(&r, 7),
            key_limits: Limits::default(),
            budget: budget_from(r.get(12), &r.get::<String, _>(13)),
            expires_at: Some(until),
        };
        Ok(MemberContext { member, ctx })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn emails_and_passwords() {
        assert_eq!(normalise_email(" Ada@Example.COM ").unwrap(), "ada@example.com");
        for bad in ["", "ada", "@x", "a@", "a@@b", "a b@c", "a@.c", "<a@b>"] {
            assert!(normalise_email(bad).is_err(), "{bad:?}");
        }
        assert!(hash_password("short").is_err());
        let h = hash_password("correct horse battery").unwrap();
        assert!(h.starts_with("$argon2id$"), "{h}");
        assert!(verify_password(Some(&h), "correct horse battery"));
        assert!(!verify_password(Some(&h), "correct horse battery!"));
        assert!(!verify_password(Some("not a phc string"), "x"));
        // No member: the dummy hash is verified (and never matches, even its own password).
        assert!(!verify_password(None, "not-a-password-anyone-has"));
        for r in Role::ALL {
            assert_eq!(Role::parse(r.as_str()), Some(r));
        }
        assert_eq!(Role::parse("root"), None);
    }
}

//! The management service: one implementation of the operations on tenants' keys,
//! processors and usage, shared by its three adapters — the admin API ([`crate::routes::admin`]),
//! the self-service API ([`crate::routes::selfservice`]) and the `hearth admin|processor|billing`
//! commands. Each operation takes the [`Actor`] doing it: the operator may act on any
//! tenant; a tenant credential only on its own tenant, and a key it creates has no scope
//! or model it lacks, expires no later than it does, and carries its per-key limits; a
//! model-restricted credential revokes only keys within its models; a tenant holds at most
//! [`MAX_KEYS_PER_TENANT`] active keys. Another tenant's key or processor is
//! "not found", never "forbidden": ids are not confirmed across tenants.
//!
//! Operator-only operations (tenants, limits, budgets, issuers, prices) are thin wrappers
//! over the stores (`TenantStore`, `UsageLedger`), here so that they are audited too.
//!
//! **Members and roles.** A tenant's member acts as [`Actor::Member`]: on its own tenant,
//! with what its [`Role`] allows ([`allows`], one table — see the book's "Members and
//! roles"). Only an owner invites, promotes or removes owners, or creates a key with the
//! `manage` scope (such a key acts as the tenant, with every permission); a tenant's first
//! member is an owner, and it keeps one. Argon2id work runs on [`password_work`]'s few
//! threads, so a flood of sign-ins cannot take the machine's memory.
//!
//! **Audit.** Every successful change made through the service writes one
//! [`hearth_tenants::audit`] entry: the actor (`admin`, `cli:<user>`, `key:<id>`,
//! `jwt:<issuer>:<sub>`, `member:<id>:<email>`), the adapter it came through and the client's address
//! ([`Origin`]), the action, the object and its parameters (never a secret). The entry is
//! written after the change commits; if that write fails the change stands and the failure
//! is logged as an error.

pub mod adapters;

use std::sync::Arc;

use hearth_billing::export::{by_day, render, DayLine, Export, Format, Granularity, Totals};
use hearth_billing::{month_of, parse_day, BillingError, Price, PriceRates, UsageLedger};
use hearth_runtime::Runtime;
use hearth_tenants::audit::{AuditEntry, NewAudit};
use hearth_tenants::jwt::{IssuerInfo, IssuerSpec};
use hearth_tenants::members::{Invitation, Member, MemberContext, Role};
use hearth_tenants::processors::{ProcessorInfo, ProcessorSpec};
use hearth_tenants::{
    now_ms, ApiKeyInfo, Budget, CreatedKey, KeySpec, Limits, Scopes, Tenant, TenantContext, TenantError, TenantStore,
};
use serde_json::json;

use crate::server::error::{ledger_error, store_error, ApiError};

/// Through which adapter, and from where, a management action came.
#[derive(Debug, Clone, Default)]
pub struct Origin {
    pub channel: Channel,
    /// The client's address (API, dashboard); None for the CLI.
    pub address: Option<String>,
    /// The operator's e-mail address when one signed in through the operators' identity
    /// provider (the audit log then names the person, not the admin token).
    pub operator: Option<String>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Channel {
    #[default]
    Api,
    Dashboard,
    /// The `hearth` CLI against the database; the actor is `cli:<$USER>`.
    Cli,
}

impl Channel {
    pub fn as_str(self) -> &'static str {
        match self {
            Channel::Api => "api",
            Channel::Dashboard => "dashboard",
            Channel::Cli => "cli",
        }
    }
}

impl Origin {
    pub fn api(address: Option<String>) -> Self {
        Self {
            channel: Channel::Api,
            address,
            operator: None,
        }
    }

    pub fn dashboard(address: Option<String>) -> Self {
        Self {
            channel: Channel::Dashboard,
            address,
            operator: None,
        }
    }

    pub fn cli() -> Self {
        Self {
            channel: Channel::Cli,
            address: None,
            operator: None,
        }
    }
}

/// Who is managing.
#[derive(Clone, Copy)]
pub enum Actor<'a> {
    /// The operator: the admin token, or the CLI with the database.
    Operator,
    /// A tenant credential with the `manage` scope.
    Tenant(&'a TenantContext),
    /// A tenant's member, signed into the dashboard.
    Member(&'a MemberContext),
}

/// What an action needs. [`allows`] is the one table of who may.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Permission {
    /// Usage, requests and cost on the dashboard; the key and processor lists.
    Read,
    /// Billing exports.
    Export,
    /// Create and revoke API keys.
    ManageKeys,
    /// Upload, activate, attach and delete processors.
    ManageProcessors,
    /// Upload and delete LoRA adapters.
    ManageAdapters,
    /// Read the tenant's audit log.
    ReadAudit,
    /// Invite, remove and change the role of members below owner.
    ManageMembers,
    /// The same for owners.
    ManageOwners,
}

impl Permission {
    pub const ALL: [Permission; 8] = [
        Permission::Read,
        Permission::Export,
        Permission::ManageKeys,
        Permission::ManageProcessors,
        Permission::ManageAdapters,
        Permission::ReadAudit,
        Permission::ManageMembers,
        Permission::ManageOwners,
    ];

    /// For people: what the permission lets one do.
    pub fn describe(self) -> &'static str {
        match self {
            Permission::Read => "see usage, requests, keys and processors",
            Permission::Export => "download billing exports",
            Permission::ManageKeys => "create and revoke API keys",
            Permission::ManageProcessors => "manage processors",
            Permission::ManageAdapters => "manage adapters",
            Permission::ReadAudit => "read the audit log",
            Permission::ManageMembers => "invite and remove members",
            Permission::ManageOwners => "invite, promote and remove owners",
        }
    }
}

/// The role table: whether a member with `role` may do what `p` names.
///
/// | | owner | admin | developer | billing | viewer |
/// |---|---|---|---|---|---|
/// | see usage, requests, keys, processors | ✓ | ✓ | ✓ | ✓ | ✓ |
/// | billing exports | ✓ | ✓ | | ✓ | |
/// | create and revoke API keys | ✓ | ✓ | ✓ | | |
/// | manage processors | ✓ | ✓ | ✓ | | |
/// | manage adapters | ✓ | ✓ | ✓ | | |
/// | read the audit log | ✓ | ✓ | | ✓ | |
/// | invite and remove members | ✓ | ✓ | | | |
/// | the same for owners | ✓ | | | | |
pub fn allows(role: Role, p: Permission) -> bool {
    use Role::*;
    match p {
        Permission::Read => true,
        Permission::Export | Permission::ReadAudit => matches!(role, Owner | Admin | Billing),
        Permission::ManageKeys | Permission::ManageProcessors | Permission::ManageAdapters => {
            matches!(role, Owner | Admin | Developer)
        }
        Permission::ManageMembers => matches!(role, Owner | Admin),
        Permission::ManageOwners => role == Owner,
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ManageError {
    #[error(transparent)]
    Store(#[from] TenantError),
    #[error(transparent)]
    Ledger(#[from] BillingError),
    #[error("{message}")]
    Invalid { field: &'static str, message: String },
    /// The request would give more than the actor has.
    #[error("{0}")]
    Escalation(&'static str),
    #[error("{0}")]
    NotFound(String),
    /// The feature is off in this process.
    #[error("{0}")]
    Disabled(&'static str),
    #[error("{0}")]
    Internal(String),
    /// A per-tenant quota is reached.
    #[error("{0}")]
    Quota(String),
    /// The service is too busy for this now.
    #[error("{0}")]
    Busy(&'static str),
    /// The member's role does not allow it.
    #[error("{0}")]
    Role(String),
    /// The tenant is suspended.
    #[error("tenant {0:?} is suspended: ask the platform's operator")]
    Suspended(String),
}

/// Argon2id hashes and verifications run at once (each holds 19 MiB and a core for ~30 ms).
const PASSWORD_WORKERS: usize = 2;

/// Runs CPU-heavy password work (hashing, verifying) on the blocking pool, at most
/// [`PASSWORD_WORKERS`] at a time; waits up to 10 s for a turn, then refuses as busy.
pub async fn password_work<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T, ManageError> {
    static TURNS: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(PASSWORD_WORKERS);
    let busy = "too many sign-ins at once; try again in a few seconds";
    let _turn = tokio::time::timeout(std::time::Duration::from_secs(10), TURNS.acquire())
        .await
        .map_err(|_| ManageError::Busy(busy))?
        .map_err(|_| ManageError::Busy(busy))?;
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|_| ManageError::Internal("password work failed".into()))
}

/// Active API keys one tenant may hold.
pub const MAX_KEYS_PER_TENANT: usize = 1000;

fn invalid(field: &'static str, message: impl Into<String>) -> ManageError {
    ManageError::Invalid {
        field,
        message: message.into(),
    }
}

/// A new processor version, as any adapter receives it.
#[derive(Debug, Clone, Default)]
pub struct Upload {
    pub name: String,
    /// JSON for the guest's `host.config` (default `{}`).
    pub config: Option<String>,
    pub activate: bool,
    pub key_id: Option<String>,
    pub position: Option<i64>,
    pub cpu_ms: Option<u32>,
    pub memory_mib: Option<u32>,
}

/// A usage window: `from` inclusive, `to` exclusive (Unix ms).
#[derive(Debug, Clone, Copy)]
pub struct Window {
    pub from: i64,
    pub to: i64,
}

impl Window {
    /// From `YYYY-MM-DD` or Unix-ms texts; by default this month so far.
    pub fn parse(from: Option<&str>, to: Option<&str>) -> Result<Self, ManageError> {
        let now = now_ms();
        let month_start = parse_day(&format!("{}-01", month_of(now))).unwrap_or(0);
        let from = time_param(from, "from", month_start)?;
        let to = time_param(to, "to", now + 1)?;
        if to <= from {
            return Err(invalid("to", "'to' must be after 'from'"));
        }
        Ok(Self { from, to })
    }
}

fn time_param(v: Option<&str>, name: &'static str, default: i64) -> Result<i64, ManageError> {
    match v {
        None | Some("") => Ok(default),
        // Unix ms as at most 15 digits (no sign), as the documents state.
        Some(s) => (s.len() <= 15 && s.bytes().all(|b| b.is_ascii_digit()))
            .then(|| s.parse::<i64>().ok())
            .flatten()
            .or_else(|| {
                let b = s.as_bytes();
                let shaped = b.len() == 10
                    && b.iter().enumerate().all(|(i, c)| {
                        if i == 4 || i == 7 {
                            *c == b'-'
                        } else {
                            c.is_ascii_digit()
                        }
                    });
                shaped.then(|| parse_day(s)).flatten()
            })
            .ok_or_else(|| invalid(name, format!("'{name}' must be YYYY-MM-DD or Unix milliseconds"))),
    }
}

/// A rendered billing export.
pub struct ExportFile {
    pub export: Export,
    pub format: Format,
    /// `usage-<tenant>-<first day>-<last day>.<ext>`.
    pub file_name: String,
}

/// The service over one process's stores.
#[derive(Clone)]
pub struct Management<'a> {
    pub tenants: &'a TenantStore,
    pub ledger: &'a UsageLedger,
    /// Compiles (validates) uploaded processors; None: processors are disabled.
    pub runtime: Option<&'a Arc<Runtime>>,
    /// The adapter store and the workers that check uploads; None: adapters are disabled.
    pub adapters: Option<crate::manage::adapters::AdapterHost<'a>>,
    /// Where the actions come from, for the audit log.
    pub origin: Origin,
}

/// Counts audit entries that could not be written (see the module's docs).
pub static AUDIT_WRITE_FAILURES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

impl Actor<'_> {
    /// The audit log's name for the actor.
    pub fn audit_name(&self, origin: &Origin) -> String {
        match self {
            Actor::Operator if origin.channel == Channel::Cli => {
                let user = std::env::var("USER").unwrap_or_default();
                format!("cli:{}", if user.is_empty() { "unknown" } else { &user })
            }
            Actor::Operator => match &origin.operator {
                Some(email) => format!("operator:{email}"),
                None => "admin".into(),
            },
            Actor::Tenant(ctx) if ctx.key_id.starts_with("jwt:") => ctx.key_id.clone(),
            Actor::Tenant(ctx) => format!("key:{}", ctx.key_id),
            Actor::Member(m) => format!("member:{}:{}", m.member.id, m.member.email),
        }
    }

    /// The tenant credential acting (a member's is its tenant context); None: the operator.
    pub fn credential(&self) -> Option<&TenantContext> {
        match self {
            Actor::Operator => None,
            Actor::Tenant(ctx) => Some(ctx),
            Actor::Member(m) => Some(&m.ctx),
        }
    }

    /// Refuses what a member's role does not allow (operators and tenant credentials with
    /// the `manage` scope may do everything on their tenant).
    pub fn require(&self, p: Permission) -> Result<(), ManageError> {
        match self {
            Actor::Member(m) if !allows(m.member.role, p) => Err(ManageError::Role(format!(
                "A member with the {} role may not {}.",
                m.member.role,
                p.describe()
            ))),
            _ => Ok(()),
        }
    }
}

impl Management<'_> {
    /// The same service, acting from `origin`.
    pub fn via(self, origin: Origin) -> Self {
        Self { origin, ..self }
    }

    /// Writes an audit entry for a change that has been made (see the module's docs).
    pub async fn audit(
        &self,
        actor: Actor<'_>,
        tenant_id: Option<&str>,
        action: &str,
        object: &str,
        detail: serde_json::Value,
    ) {
        let who = actor.audit_name(&self.origin);
        let e = NewAudit {
            tenant_id,
            actor: &who,
            channel: self.origin.channel.as_str(),
            address: self.origin.address.as_deref(),
            action,
            object,
            detail,
        };
        if let Err(err) = self.tenants.audit(&e).await {
            AUDIT_WRITE_FAILURES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            tracing::error!(error = %err, actor = %who, action, object, "audit entry could not be written");
        }
    }

    /// The audit log: a tenant credential sees its tenant's entries; the operator one
    /// tenant's (`tenant`) or everyone's.
    pub async fn audit_log(
        &self,
        actor: Actor<'_>,
        tenant: Option<&str>,
        limit: u32,
    ) -> Result<Vec<AuditEntry>, ManageError> {
        actor.require(Permission::ReadAudit)?;
        let t = match (actor, tenant) {
            (Actor::Operator, None) => None,
            _ => Some(self.tenant_id(actor, tenant).await?),
        };
        Ok(self.tenants.audit_log(t.as_deref(), limit).await?)
    }

    // ---- operator-only changes -------------------------------------------------------

    pub async fn create_tenant(&self, name: &str) -> Result<Tenant, ManageError> {
        let t = self.tenants.create_tenant(name).await?;
        self.audit(
            Actor::Operator,
            Some(&t.id),
            "tenant.create",
            &format!("tenant:{}", t.id),
            json!({"name": t.name}),
        )
        .await;
        Ok(t)
    }

    /// Suspends or resumes a tenant (operators only).
    pub async fn set_suspended(&self, tenant: &str, suspended: bool) -> Result<Tenant, ManageError> {
        let t = self.tenants.set_suspended(tenant, suspended).await?;
        self.audit(
            Actor::Operator,
            Some(&t.id),
            if suspended { "tenant.suspend" } else { "tenant.resume" },
            &format!("tenant:{}", t.id),
            json!({"name": t.name}),
        )
        .await;
        Ok(t)
    }

    pub async fn set_tenant_limits(&self, tenant: &str, l: Limits) -> Result<Tenant, ManageError> {
        let t = self.tenants.set_tenant_limits(tenant, l).await?;
        let object = format!("tenant:{}", t.id);
        self.audit(Actor::Operator, Some(&t.id), "tenant.limits", &object, json!(l))
            .await;
        Ok(t)
    }

    pub async fn set_key_limits(&self, key_id: &str, l: Limits) -> Result<(), ManageError> {
        self.tenants.set_key_limits(key_id, l).await?;
        // A key id, or a JWT principal (`jwt:<issuer>:<sub>`, limits without a key row).
        let tenant = self.tenants.key(key_id).await.ok().map(|k| k.tenant_id);
        self.audit(
            Actor::Operator,
            tenant.as_deref(),
            "key.limits",
            &format!("key:{key_id}"),
            json!(l),
        )
        .await;
        Ok(())
    }

    pub async fn set_budget(&self, tenant: &str, b: Option<Budget>) -> Result<Tenant, ManageError> {
        let t = self.tenants.set_budget(tenant, b).await?;
        let object = format!("tenant:{}", t.id);
        self.audit(Actor::Operator, Some(&t.id), "tenant.budget", &object, json!(b))
            .await;
        Ok(t)
    }

    pub async fn add_issuer(&self, tenant: &str, spec: &IssuerSpec) -> Result<IssuerInfo, ManageError> {
        let i = self.tenants.add_issuer(tenant, spec).await?;
        self.audit(
            Actor::Operator,
            Some(&i.tenant_id),
            "jwt_issuer.add",
            &format!("jwt_issuer:{}", i.id),
            json!({"issuer": i.issuer, "audience": i.audience, "algorithm": i.algorithm}),
        )
        .await;
        Ok(i)
    }

    /// Sets a tenant's identity provider (operators only).
    pub async fn set_sso(
        &self,
        tenant: &str,
        spec: &hearth_tenants::sso::SsoSpec,
    ) -> Result<hearth_tenants::sso::SsoProvider, ManageError> {
        let p = self.tenants.set_sso(tenant, spec).await?;
        self.audit(
            Actor::Operator,
            Some(&p.tenant_id),
            "sso.set",
            "sso",
            json!({"issuer": p.issuer, "client_id": p.client_id, "client_secret": p.has_client_secret}),
        )
        .await;
        Ok(p)
    }

    pub async fn remove_sso(&self, tenant: &str) -> Result<hearth_tenants::sso::SsoProvider, ManageError> {
        let p = self.tenants.remove_sso(tenant).await?;
        self.audit(
            Actor::Operator,
            Some(&p.tenant_id),
            "sso.remove",
            "sso",
            json!({"issuer": p.issuer}),
        )
        .await;
        Ok(p)
    }

    pub async fn remove_issuer(&self, id: &str) -> Result<IssuerInfo, ManageError> {
        let i = self.tenants.remove_issuer(id).await?;
        self.audit(
            Actor::Operator,
            Some(&i.tenant_id),
            "jwt_issuer.remove",
            &format!("jwt_issuer:{}", i.id),
            json!({"issuer": i.issuer}),
        )
        .await;
        Ok(i)
    }

    pub async fn set_price(&self, model: &str, rates: PriceRates, from: Option<i64>) -> Result<Price, ManageError> {
        let p = self.ledger.set_price(model, rates, from).await?;
        self.audit(
            Actor::Operator,
            None,
            "price.set",
            &format!("price:{}", p.model),
            json!(p),
        )
        .await;
        Ok(p)
    }

    /// The tenant an actor means: the operator names one (by name or id); a tenant
    /// credential always means its own (naming another is "not found").
    pub async fn tenant_id(&self, actor: Actor<'_>, tenant: Option<&str>) -> Result<String, ManageError> {
        match (actor.credential(), tenant) {
            (Some(ctx), None) => Ok(ctx.tenant_id.clone()),
            (Some(ctx), Some(t)) if t == ctx.tenant_id || t == ctx.tenant_name => Ok(ctx.tenant_id.clone()),
            (Some(_), Some(t)) => Err(ManageError::NotFound(format!("tenant {t:?} does not exist"))),
            (None, Some(t)) => Ok(self.tenants.tenant(t).await?.id),
            (None, None) => Err(invalid("tenant", "'tenant' is required")),
        }
    }

    // ---- keys ------------------------------------------------------------------------

    pub async fn list_keys(&self, actor: Actor<'_>, tenant: Option<&str>) -> Result<Vec<ApiKeyInfo>, ManageError> {
        actor.require(Permission::Read)?;
        let t = self.tenant_id(actor, tenant).await?;
        Ok(self.tenants.list_keys(&t).await?)
    }

    /// A new key; a tenant credential's key is narrowed to (and may not exceed) its own
    /// scopes and models.
    pub async fn create_key(
        &self,
        actor: Actor<'_>,
        tenant: Option<&str>,
        mut spec: KeySpec,
    ) -> Result<CreatedKey, ManageError> {
        actor.require(Permission::ManageKeys)?;
        let t = self.tenant_id(actor, tenant).await?;
        if let Actor::Member(m) = actor {
            // A `manage` key acts as the tenant with every permission: an owner's to give.
            let scopes = spec.scopes.unwrap_or(Scopes {
                inference: true,
                manage: false,
            });
            if scopes.manage && m.member.role != Role::Owner {
                return Err(ManageError::Role(
                    "Only an owner may create keys with the manage scope (such a key may do everything on the tenant)."
                        .into(),
                ));
            }
            spec.scopes = Some(scopes);
        }
        if let Actor::Tenant(ctx) = actor {
            let scopes = spec.scopes.unwrap_or(ctx.scopes);
            if !scopes.within(ctx.scopes) {
                return Err(ManageError::Escalation("A key cannot grant scopes its creator lacks."));
            }
            spec.scopes = Some(scopes);
            // A key outlives neither the key nor the token that created it.
            if let Some(end) = ctx.expires_at {
                spec.expires_at = Some(spec.expires_at.map_or(end, |e| e.min(end)));
            }
            if let Some(allowed) = &ctx.models {
                match &spec.models {
                    None => spec.models = Some(allowed.to_vec()),
                    Some(m) if m.iter().all(|x| allowed.contains(x)) => {}
                    Some(_) => {
                        return Err(ManageError::Escalation(
                            "A key cannot allow models its creator may not use.",
                        ))
                    }
                }
            }
        }
        let active = self
            .tenants
            .list_keys(&t)
            .await?
            .iter()
            .filter(|k| k.revoked_at.is_none() && k.expires_at.is_none_or(|e| e > now_ms()))
            .count();
        if active >= MAX_KEYS_PER_TENANT {
            return Err(ManageError::Quota(format!(
                "a tenant may hold at most {MAX_KEYS_PER_TENANT} active API keys; revoke some first"
            )));
        }
        let created = self.tenants.create_key(&t, &spec).await?;
        // The creator's own per-key limits and class bind what it creates (else a limited or
        // batch key would mint an unlimited or interactive one).
        if let Actor::Tenant(ctx) = actor {
            let l = ctx.key_limits;
            if l.rpm.is_some() || l.tpm.is_some() || l.concurrent.is_some() || l.priority.is_some() {
                self.tenants.set_key_limits(&created.info.id, l).await?;
            }
        }
        let i = &created.info;
        self.audit(
            actor,
            Some(&t),
            "key.create",
            &format!("key:{}", i.id),
            json!({"name": i.name, "scopes": i.scopes, "models": i.models, "expires_at": i.expires_at}),
        )
        .await;
        Ok(created)
    }

    pub async fn revoke_key(&self, actor: Actor<'_>, key_id: &str) -> Result<ApiKeyInfo, ManageError> {
        actor.require(Permission::ManageKeys)?;
        if let Some(ctx) = actor.credential() {
            let k = self.tenants.key(key_id).await?;
            if k.tenant_id != ctx.tenant_id {
                return Err(ManageError::NotFound(format!("API key {key_id:?} does not exist")));
            }
            // A model-restricted credential manages only keys within its models.
            if let Some(allowed) = &ctx.models {
                let within = k.models.as_ref().is_some_and(|m| m.iter().all(|x| allowed.contains(x)));
                if !within {
                    return Err(ManageError::Escalation(
                        "A model-restricted key may only revoke keys restricted to its models.",
                    ));
                }
            }
        }
        let k = self.tenants.revoke_key(key_id).await?;
        self.audit(
            actor,
            Some(&k.tenant_id),
            "key.revoke",
            &format!("key:{}", k.id),
            json!({"name": k.name}),
        )
        .await;
        Ok(k)
    }

    // ---- members -----------------------------------------------------------------------

    /// A tenant's members and open invitations.
    pub async fn list_members(
        &self,
        actor: Actor<'_>,
        tenant: Option<&str>,
    ) -> Result<(Vec<Member>, Vec<Invitation>), ManageError> {
        actor.require(Permission::Read)?;
        let t = self.tenant_id(actor, tenant).await?;
        Ok((
            self.tenants.list_members(&t).await?,
            self.tenants.list_invitations(&t).await?,
        ))
    }

    /// Invites `email` as `role`; returns the link's token (shown once) and the invitation.
    pub async fn invite_member(
        &self,
        actor: Actor<'_>,
        tenant: Option<&str>,
        email: &str,
        role: Role,
    ) -> Result<(String, Invitation), ManageError> {
        actor.require(Permission::ManageMembers)?;
        if role == Role::Owner {
            actor.require(Permission::ManageOwners)?;
        }
        let t = self.tenant_id(actor, tenant).await?;
        // Replacing an open invitation withdraws it: an owner's is the owners' to withdraw.
        if let Some(open) = self.tenants.open_invitation(&t, email).await? {
            if open.role == Role::Owner {
                actor.require(Permission::ManageOwners)?;
            }
        }
        if role != Role::Owner && self.tenants.owner_count(&t).await? == 0 {
            return Err(TenantError::Conflict(
                "this tenant has no owner yet: its first member must be an owner (invite others once they have joined)"
                    .into(),
            )
            .into());
        }
        let who = actor.audit_name(&self.origin);
        let (token, inv) = self.tenants.invite_member(&t, email, role, &who).await?;
        self.audit(
            actor,
            Some(&t),
            "member.invite",
            &format!("invitation:{}", inv.id),
            json!({"email": inv.email, "role": inv.role, "expires_at": inv.expires_at}),
        )
        .await;
        Ok((token, inv))
    }

    /// Accepts an invitation with the new member's password; the member is the actor of
    /// the audit entry. None: the link is unknown, used or expired.
    pub async fn accept_invitation(&self, token: &str, password: &str) -> Result<Option<Member>, ManageError> {
        hearth_tenants::members::check_password_policy(password)?;
        let Some(inv) = self.tenants.invitation(token).await? else {
            return Ok(None);
        };
        // A suspended tenant takes no one in (the invitation stays for when it resumes).
        let t = self.tenants.tenant(&inv.tenant_id).await?;
        if t.suspended_at.is_some() {
            return Err(ManageError::Suspended(t.name));
        }
        let password = password.to_string();
        let hash = password_work(move || hearth_tenants::members::hash_password(&password)).await??;
        let Some(m) = self.tenants.accept_invitation(token, &hash).await? else {
            return Ok(None);
        };
        let mc = self
            .tenants
            .member_context(&m.id, &m.tenant_id, now_ms())
            .await
            .map_err(|e| match e {
                hearth_tenants::AuthError::Suspended(t) => ManageError::Suspended(t),
                e => ManageError::Internal(e.to_string()),
            })?;
        self.audit(
            Actor::Member(&mc),
            Some(&m.tenant_id),
            "member.join",
            &format!("member:{}", m.id),
            json!({"email": m.email, "role": m.role}),
        )
        .await;
        Ok(Some(m))
    }

    /// A member of the actor's tenant (another tenant's is "not found").
    async fn own_member(&self, actor: Actor<'_>, id: &str) -> Result<Member, ManageError> {
        let m = self.tenants.member(id).await?;
        if actor.credential().is_some_and(|c| c.tenant_id != m.tenant_id) {
            return Err(TenantError::NoSuchMember(id.to_string()).into());
        }
        Ok(m)
    }

    pub async fn set_member_role(&self, actor: Actor<'_>, id: &str, role: Role) -> Result<Member, ManageError> {
        actor.require(Permission::ManageMembers)?;
        let m = self.own_member(actor, id).await?;
        if m.role == Role::Owner || role == Role::Owner {
            actor.require(Permission::ManageOwners)?;
        }
        // Applied only if the member still has the role checked here; the last owner stays.
        let drop_invitations = !allows(role, Permission::ManageMembers);
        let after = self
            .tenants
            .change_member(id, m.role, Some(role), drop_invitations)
            .await?;
        self.audit(
            actor,
            Some(&m.tenant_id),
            "member.role",
            &format!("member:{id}"),
            json!({"email": m.email, "from": m.role, "to": role}),
        )
        .await;
        Ok(after)
    }

    /// Removes a member; its sessions end at once and its open invitations are withdrawn.
    pub async fn remove_member(&self, actor: Actor<'_>, id: &str) -> Result<Member, ManageError> {
        actor.require(Permission::ManageMembers)?;
        let m = self.own_member(actor, id).await?;
        if m.role == Role::Owner {
            actor.require(Permission::ManageOwners)?;
        }
        let m = self.tenants.change_member(id, m.role, None, true).await?;
        self.audit(
            actor,
            Some(&m.tenant_id),
            "member.remove",
            &format!("member:{id}"),
            json!({"email": m.email, "role": m.role}),
        )
        .await;
        Ok(m)
    }

    pub async fn revoke_invitation(&self, actor: Actor<'_>, id: &str) -> Result<Invitation, ManageError> {
        actor.require(Permission::ManageMembers)?;
        let inv = self.tenants.invitation_by_id(id).await?;
        if actor.credential().is_some_and(|c| c.tenant_id != inv.tenant_id) {
            return Err(TenantError::NoSuchInvitation(id.to_string()).into());
        }
        if inv.role == Role::Owner {
            actor.require(Permission::ManageOwners)?;
        }
        let inv = self.tenants.revoke_invitation(id).await?;
        self.audit(
            actor,
            Some(&inv.tenant_id),
            "member.uninvite",
            &format!("invitation:{id}"),
            json!({"email": inv.email, "role": inv.role}),
        )
        .await;
        Ok(inv)
    }

    // ---- processors ------------------------------------------------------------------

    /// Validates (compiles, filling the shared code cache) and stores a new version.
    pub async fn upload_processor(
        &self,
        actor: Actor<'_>,
        tenant: Option<&str>,
        up: Upload,
        wasm: Vec<u8>,
    ) -> Result<ProcessorInfo, ManageError> {
        let runtime = self
            .runtime
            .cloned()
            .ok_or(ManageError::Disabled("processors are disabled on this gateway"))?;
        actor.require(Permission::ManageProcessors)?;
        let t = self.tenant_id(actor, tenant).await?;
        if up.name.is_empty() {
            return Err(invalid("name", "'name' is required"));
        }
        if wasm.is_empty() {
            return Err(invalid("body", "the body must be the component (.wasm)"));
        }
        let defaults = hearth_runtime::Limits::default();
        let limits = hearth_runtime::Limits {
            cpu_ms: up.cpu_ms.unwrap_or(defaults.cpu_ms),
            memory_mib: up.memory_mib.unwrap_or(defaults.memory_mib),
            ..defaults
        }
        .clamped();
        let (wasm, compiled) = tokio::task::spawn_blocking(move || {
            let c = runtime.compile(&wasm);
            (wasm, c)
        })
        .await
        .map_err(|_| ManageError::Internal("compiling the processor failed".into()))?;
        let compiled = compiled.map_err(|e| invalid("body", e.to_string()))?;
        let spec = ProcessorSpec {
            name: up.name,
            sha256: compiled.sha256.clone(),
            config: up.config.unwrap_or_else(|| "{}".into()),
            cpu_ms: limits.cpu_ms,
            memory_mib: limits.memory_mib,
            key_id: up.key_id.filter(|k| !k.is_empty()),
            position: up.position,
            activate: up.activate,
        };
        let p = self.tenants.add_processor(&t, &spec, &wasm).await?;
        self.audit(
            actor,
            Some(&t),
            "processor.upload",
            &format!("processor:{}", p.id),
            json!({"name": p.name, "version": p.version, "sha256": p.sha256, "active": p.active, "key_id": p.key_id}),
        )
        .await;
        Ok(p)
    }

    pub async fn list_processors(
        &self,
        actor: Actor<'_>,
        tenant: Option<&str>,
    ) -> Result<Vec<ProcessorInfo>, ManageError> {
        actor.require(Permission::Read)?;
        let t = self.tenant_id(actor, tenant).await?;
        Ok(self.tenants.list_processors(&t).await?)
    }

    /// The processor `id`, if the actor may manage it.
    async fn own_processor(&self, actor: Actor<'_>, id: &str) -> Result<(), ManageError> {
        actor.require(Permission::ManageProcessors)?;
        if let Some(ctx) = actor.credential() {
            if self.tenants.processor(id).await?.tenant_id != ctx.tenant_id {
                return Err(ManageError::NotFound(format!("processor {id:?} does not exist")));
            }
        }
        Ok(())
    }

    pub async fn set_processor_active(
        &self,
        actor: Actor<'_>,
        id: &str,
        active: bool,
    ) -> Result<ProcessorInfo, ManageError> {
        self.own_processor(actor, id).await?;
        let p = self.tenants.set_processor_active(id, active).await?;
        let action = if active {
            "processor.activate"
        } else {
            "processor.deactivate"
        };
        self.audit_processor(actor, action, &p, json!({"name": p.name, "version": p.version}))
            .await;
        Ok(p)
    }

    async fn audit_processor(&self, actor: Actor<'_>, action: &str, p: &ProcessorInfo, detail: serde_json::Value) {
        self.audit(
            actor,
            Some(&p.tenant_id),
            action,
            &format!("processor:{}", p.id),
            detail,
        )
        .await;
    }

    /// Attaches to one key, or (None) to the whole tenant.
    pub async fn attach_processor(
        &self,
        actor: Actor<'_>,
        id: &str,
        key_id: Option<&str>,
    ) -> Result<ProcessorInfo, ManageError> {
        self.own_processor(actor, id).await?;
        let p = self.tenants.attach_processor(id, key_id).await?;
        self.audit_processor(actor, "processor.attach", &p, json!({"key_id": key_id}))
            .await;
        Ok(p)
    }

    pub async fn delete_processor(&self, actor: Actor<'_>, id: &str) -> Result<ProcessorInfo, ManageError> {
        self.own_processor(actor, id).await?;
        let p = self.tenants.delete_processor(id).await?;
        self.audit_processor(
            actor,
            "processor.delete",
            &p,
            json!({"name": p.name, "version": p.version}),
        )
        .await;
        Ok(p)
    }

    // ---- usage and exports -----------------------------------------------------------

    /// Usage and cost by day and model, and the rows' totals.
    pub async fn usage_by_day(
        &self,
        actor: Actor<'_>,
        tenant: Option<&str>,
        window: Window,
    ) -> Result<(Vec<DayLine>, Totals), ManageError> {
        actor.require(Permission::Read)?;
        let t = self.tenant_id(actor, tenant).await?;
        self.ledger.flush().await;
        let rows = self.ledger.rows(&t, window.from, window.to).await?;
        Ok((by_day(&rows), Totals::of(&rows)))
    }

    /// The billing export of one tenant and window.
    pub async fn export(
        &self,
        actor: Actor<'_>,
        tenant: Option<&str>,
        window: Window,
        format: Option<&str>,
        granularity: Option<&str>,
    ) -> Result<ExportFile, ManageError> {
        actor.require(Permission::Export)?;
        let format = Format::parse(format.unwrap_or("csv"))
            .ok_or_else(|| invalid("format", "'format' is csv, jsonl or parquet"))?;
        let granularity = Granularity::parse(granularity.unwrap_or("request"))
            .ok_or_else(|| invalid("granularity", "'granularity' is request or day"))?;
        let t = self.tenant_id(actor, tenant).await?;
        self.ledger.flush().await;
        let rows = self.ledger.rows(&t, window.from, window.to).await?;
        let export = render(&rows, format, granularity)?;
        let file_name = format!(
            "usage-{t}-{}-{}.{}",
            hearth_billing::day_of(window.from),
            hearth_billing::day_of(window.to - 1),
            format.extension()
        );
        Ok(ExportFile {
            export,
            format,
            file_name,
        })
    }
}

/// A management error as the client sees it (every channel but the CLI answers in HTTP).
impl From<ManageError> for ApiError {
    fn from(e: ManageError) -> Self {
        match e {
            ManageError::Store(e) => store_error(e),
            ManageError::Ledger(e) => ledger_error(e),
            ManageError::Invalid { field, message } => ApiError::invalid(field, message),
            ManageError::Escalation(m) => ApiError::permission("scope_escalation", m),
            ManageError::NotFound(m) => ApiError::not_found(m),
            ManageError::Disabled(m) => ApiError::forbidden(m),
            ManageError::Internal(m) => ApiError::internal(m),
            ManageError::Quota(m) => ApiError::permission("quota_exceeded", m),
            ManageError::Role(m) => ApiError::permission("role_forbidden", m),
            ManageError::Suspended(t) => ApiError::permission(
                "tenant_suspended",
                format!("Tenant {t:?} is suspended: ask the platform's operator."),
            ),
            ManageError::Busy(m) => ApiError::unavailable(m),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A window's ends are what the API documents state (`YYYY-MM-DD`, or Unix ms as at
    /// most 15 digits), nothing looser: the contract check sends the rest and expects 400s.
    #[test]
    fn window_ends_are_exactly_the_documented_shapes() {
        for ok in ["2026-01-01", "1700000000000", "0"] {
            assert!(time_param(Some(ok), "from", 0).is_ok(), "{ok}");
        }
        assert_eq!(time_param(Some(""), "from", 7).unwrap(), 7);
        for bad in [
            "-5",
            "+5",
            "1234567890123456",
            "2026-1-1",
            "+2026-01-01",
            "2026-13-01",
            "2026/01/01",
            "x",
        ] {
            assert!(time_param(Some(bad), "from", 0).is_err(), "{bad}");
        }
    }

    /// The book's role table (concepts/members.md) is this code's: one row per permission,
    /// in order, a ✓ exactly where [`allows`] says yes.
    #[test]
    fn the_books_role_table_is_the_codes() {
        let book = include_str!("../../../../docs/book/src/concepts/members.md");
        let header = format!("| | {} |", Role::ALL.map(Role::as_str).join(" | "));
        let start = book.find(&header).expect("the role table's header");
        let rows: Vec<Vec<&str>> = book[start..]
            .lines()
            .skip(2)
            .take_while(|l| l.starts_with('|'))
            .map(|l| l.trim_matches('|').split('|').map(str::trim).collect())
            .collect();
        assert_eq!(rows.len(), Permission::ALL.len());
        for (row, p) in rows.iter().zip(Permission::ALL) {
            let what = p.describe();
            assert_eq!(
                row[0],
                format!("{}{}", what[..1].to_uppercase(), &what[1..]),
                "the wording of {p:?}"
            );
            let marks: Vec<bool> = row[1..].iter().map(|c| *c == "✓").collect();
            let want: Vec<bool> = Role::ALL.iter().map(|r| allows(*r, p)).collect();
            assert_eq!(marks, want, "{p:?}: {row:?}");
        }
    }
}

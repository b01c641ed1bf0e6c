//! JWTs from a tenant's own identity provider.
//!
//! A tenant registers issuers: the `iss` value, the audience Hearth expects, exactly one
//! algorithm (pinned: the token's `alg` header never chooses it), and the verification key —
//! a PEM public key, an HMAC secret, a JWKS document, or a JWKS URL (fetched, cached for
//! five minutes, refetched early when a token names an unknown `kid`).
//!
//! A token is accepted only if its signature verifies under the pinned algorithm and `exp`,
//! `iss`, `aud` and `sub` are present and right (`nbf` too when present; 30 s leeway).
//! `alg: none` cannot even be parsed. Claims map to the request's identity:
//! the issuer's tenant; `sub` names the principal (`jwt:<issuer id>:<sub>`, for per-principal
//! limits and usage); `scope` (space-separated) or `scp` (array) grant `inference` and/or
//! `manage`, and `model:<id>` entries restrict the models (none: every model). A token
//! without any scope claim may call the models (`inference`) only.

use std::collections::HashMap;
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use jsonwebtoken::errors::ErrorKind;
use jsonwebtoken::jwk::JwkSet;
use jsonwebtoken::{Algorithm, AlgorithmFamily, DecodingKey, Validation};
use serde::{Deserialize, Serialize};
use sqlx::any::AnyRow;
use sqlx::Row;

use crate::{budget_from, now_ms, random_hex, AuthError, Limits, Scopes, TenantContext, TenantError, TenantStore};

const ISSUER_TTL: Duration = Duration::from_secs(5);
const JWKS_TTL: Duration = Duration::from_secs(300);
const JWKS_MIN_REFETCH: Duration = Duration::from_secs(30);
const LEEWAY_SECS: u64 = 30;
/// A failed fetch of a provider's document is not retried for this long: a dead or slow
/// provider costs one fetch per period, not one per request.
pub(crate) const FAILURE_BACKOFF: Duration = Duration::from_secs(10);

/// A recent failure for `key` (and how long ago), forgetting older ones.
pub(crate) fn cache_failure(
    failures: &Mutex<HashMap<String, (Instant, String)>>,
    key: &str,
) -> Option<(Duration, String)> {
    let mut f = failures.lock().unwrap_or_else(|e| e.into_inner());
    f.retain(|_, (at, _)| at.elapsed() < FAILURE_BACKOFF);
    f.get(key).map(|(at, why)| (at.elapsed(), why.clone()))
}

/// What registering an issuer takes; exactly one of `key`, `jwks`, `jwks_url` (the body of
/// the admin API's registration, which `hearth admin --gateway-url jwt add` sends).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct IssuerSpec {
    pub issuer: String,
    pub audience: String,
    /// HS256, HS384, HS512, RS256, RS384, RS512, PS256, PS384, PS512, ES256, ES384, EdDSA.
    pub algorithm: String,
    /// A PEM public key (RS*/PS*/ES*/EdDSA) or the shared secret (HS*, at least 32 bytes).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// A JWKS document (`{"keys": [...]}`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub jwks: Option<String>,
    /// Where to fetch the JWKS document.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub jwks_url: Option<String>,
}

/// A registered issuer as listings show it (never the key material).
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct IssuerInfo {
    pub id: String,
    pub tenant_id: String,
    pub issuer: String,
    pub audience: String,
    pub algorithm: String,
    /// `pem`, `secret`, `jwks` or `jwks_url`.
    pub key_source: &'static str,
    pub jwks_url: Option<String>,
    pub created_at: i64,
}

fn invalid(field: &'static str, message: impl Into<String>) -> TenantError {
    TenantError::Invalid {
        field,
        message: message.into(),
    }
}

fn static_key(alg: Algorithm, material: &str) -> Result<DecodingKey, String> {
    let pem = material.as_bytes();
    let r = match alg.family() {
        AlgorithmFamily::Hmac => {
            if material.len() < 32 {
                return Err("an HMAC secret must be at least 32 bytes".into());
            }
            DecodingKey::from_secret(pem)
        }
        AlgorithmFamily::Rsa => DecodingKey::from_rsa_pem(pem),
        AlgorithmFamily::Ec => DecodingKey::from_ec_pem(pem),
        AlgorithmFamily::Ed => DecodingKey::from_ed_pem(pem),
    };
    r.map_err(|e| format!("not a usable {alg:?} key: {e}"))
}

/// The keys of a JWKS document that fit `alg`, by `kid`.
fn jwks_keys(alg: Algorithm, doc: &str) -> Result<Vec<(Option<String>, DecodingKey)>, String> {
    let set: JwkSet = serde_json::from_str(doc).map_err(|e| format!("not a JWKS document: {e}"))?;
    let mut out = Vec::new();
    for jwk in &set.keys {
        if let Some(ka) = jwk.common.key_algorithm {
            if Algorithm::try_from(ka).ok() != Some(alg) {
                continue;
            }
        }
        if let Ok(k) = DecodingKey::from_jwk(jwk) {
            if k.family() == alg.family() {
                out.push((jwk.common.key_id.clone(), k));
            }
        }
    }
    if out.is_empty() {
        return Err(format!("the JWKS document has no key usable with {alg:?}"));
    }
    Ok(out)
}

#[derive(Clone)]
enum Keys {
    Static(Arc<DecodingKey>),
    Set(Arc<Vec<(Option<String>, DecodingKey)>>),
    Url(String),
}

#[derive(Clone)]
struct Resolved {
    id: String,
    audience: String,
    alg: Algorithm,
    keys: Keys,
    tenant_id: String,
    tenant_name: String,
    tenant_limits: Limits,
    budget: Option<crate::Budget>,
    suspended: bool,
    fetched: Instant,
}

struct FetchedJwks {
    keys: Arc<Vec<(Option<String>, DecodingKey)>>,
    fetched: Instant,
}

/// Issuers by `iss`, and fetched JWKS documents by URL.
#[derive(Default)]
pub(crate) struct IssuerCache {
    issuers: Mutex<HashMap<String, Resolved>>,
    jwks: tokio::sync::Mutex<HashMap<String, FetchedJwks>>,
    /// JWKS fetches that failed lately (not retried for [`FAILURE_BACKOFF`]).
    jwks_failures: Mutex<HashMap<String, (Instant, String)>>,
    /// Issuers recently found not to be registered.
    unknown: crate::outage::NegativeCache,
}

impl IssuerCache {
    pub(crate) fn clear(&self) {
        self.issuers.lock().unwrap_or_else(|e| e.into_inner()).clear();
        self.unknown.clear();
    }
}

#[derive(Deserialize)]
struct Claims {
    sub: String,
    /// Seconds since the epoch (required and checked by the validation).
    #[serde(default)]
    exp: Option<f64>,
    #[serde(default)]
    scope: Option<String>,
    #[serde(default)]
    scp: Option<Vec<String>>,
}

#[derive(Deserialize)]
struct UnverifiedIss {
    iss: Option<String>,
}

fn jwt_err(m: impl Into<String>) -> AuthError {
    AuthError::Jwt(m.into())
}

const ISSUER_COLUMNS: &str =
    "SELECT id, tenant_id, issuer, audience, algorithm, key_material, jwks, jwks_url, created_at FROM jwt_issuers";

fn issuer_info(r: &AnyRow) -> IssuerInfo {
    let alg: String = r.get(4);
    let key: Option<String> = r.get(5);
    let jwks: Option<String> = r.get(6);
    let url: Option<String> = r.get(7);
    let key_source = match (&key, &jwks, &url) {
        (Some(_), _, _) if alg.starts_with("HS") => "secret",
        (Some(_), _, _) => "pem",
        (_, Some(_), _) => "jwks",
        _ => "jwks_url",
    };
    IssuerInfo {
        id: r.get(0),
        tenant_id: r.get(1),
        issuer: r.get(2),
        audience: r.get(3),
        algorithm: alg,
        key_source,
        jwks_url: url,
        created_at: r.get(8),
    }
}

impl TenantStore {
    /// Registers a JWT issuer for a tenant, checking the key material now.
    pub async fn add_issuer(&self, tenant: &str, spec: &IssuerSpec) -> Result<IssuerInfo, TenantError> {
        let t = self.tenant(tenant).await?;
        if spec.issuer.is_empty() || spec.issuer.len() > 512 {
            return Err(invalid("issuer", "the `iss` value, 1-512 bytes"));
        }
        if spec.audience.is_empty() || spec.audience.len() > 512 {
            return Err(invalid("audience", "the expected `aud`, 1-512 bytes"));
        }
        let alg = Algorithm::from_str(&spec.algorithm).map_err(|_| {
            invalid(
                "algorithm",
                format!(
                    "unknown algorithm {:?} (HS256, HS384, HS512, RS256, RS384, RS512, PS256, PS384, PS512, ES256, ES384, EdDSA)",
                    spec.algorithm
                ),
            )
        })?;
        match (&spec.key, &spec.jwks, &spec.jwks_url) {
            (Some(k), None, None) => {
                static_key(alg, k).map_err(|e| invalid("key", e))?;
            }
            (None, Some(doc), None) => {
                if alg.family() == AlgorithmFamily::Hmac {
                    return Err(invalid("jwks", "HMAC issuers take a shared secret (`key`), not a JWKS"));
                }
                jwks_keys(alg, doc).map_err(|e| invalid("jwks", e))?;
            }
            (None, None, Some(url)) => {
                if alg.family() == AlgorithmFamily::Hmac {
                    return Err(invalid("jwks_url", "HMAC issuers take a shared secret (`key`)"));
                }
                if !(url.starts_with("https://") || url.starts_with("http://")) {
                    return Err(invalid("jwks_url", "an http(s) URL"));
                }
            }
            _ => return Err(invalid("key", "give exactly one of key, jwks, jwks_url")),
        }
        let id = format!("iss_{}", random_hex(6)?);
        let res = sqlx::query(
            "INSERT INTO jwt_issuers (id, tenant_id, issuer, audience, algorithm, key_material, jwks, jwks_url, created_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
        )
        .bind(&id)
        .bind(&t.id)
        .bind(&spec.issuer)
        .bind(&spec.audience)
        .bind(format!("{alg:?}"))
        .bind(&spec.key)
        .bind(&spec.jwks)
        .bind(&spec.jwks_url)
        .bind(now_ms())
        .execute(&self.pool)
        .await;
        match res {
            Ok(_) => {}
            Err(sqlx::Error::Database(e)) if e.is_unique_violation() => {
                return Err(TenantError::IssuerExists(spec.issuer.clone()))
            }
            Err(e) => return Err(e.into()),
        }
        self.jwt.clear();
        self.issuer(&id).await
    }

    pub async fn issuer(&self, id: &str) -> Result<IssuerInfo, TenantError> {
        let r = sqlx::query(&format!("{ISSUER_COLUMNS} WHERE id = $1"))
            .bind(id)
            .fetch_optional(&self.pool)
            .await?
            .ok_or_else(|| TenantError::NoSuchIssuer(id.to_string()))?;
        Ok(issuer_info(&r))
    }

    /// A tenant's issuers (all tenants' with None).
    pub async fn list_issuers(&self, tenant: Option<&str>) -> Result<Vec<IssuerInfo>, TenantError> {
        let tenant_id = match tenant {
            Some(t) => Some(self.tenant(t).await?.id),
            None => None,
        };
        let rows = sqlx::query(&format!(
            "{ISSUER_COLUMNS} WHERE ($1 IS NULL OR tenant_id = $1) ORDER BY created_at, id"
        ))
        .bind(tenant_id)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.iter().map(issuer_info).collect())
    }

    /// Removes an issuer; its tokens stop working within seconds on every gateway.
    pub async fn remove_issuer(&self, id: &str) -> Result<IssuerInfo, TenantError> {
        let info = self.issuer(id).await?;
        sqlx::query("DELETE FROM jwt_issuers WHERE id = $1")
            .bind(id)
            .execute(&self.pool)
            .await?;
        self.jwt.clear();
        Ok(info)
    }

    async fn resolve_issuer(&self, iss: &str) -> Result<Resolved, AuthError> {
        if let Some(r) = self
            .jwt
            .issuers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(iss)
            .filter(|r| r.fetched.elapsed() < ISSUER_TTL)
        {
            return Ok(r.clone());
        }
        if self.jwt.unknown.contains(iss) {
            return Err(jwt_err("the token's issuer is not registered"));
        }
        let stale = self
            .jwt
            .issuers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(iss)
            .filter(|r| self.health.usable_stale(r.fetched, ISSUER_TTL))
            .cloned();
        let from_cache = |stale: Option<Resolved>, why: String| match stale {
            Some(r) => {
                self.health.served_stale();
                Ok(r)
            }
            None => Err(AuthError::Store(why)),
        };
        if !self.health.lookup(&self.pool) {
            return from_cache(stale, "the key store is unreachable".into());
        }
        let query = sqlx::query(
            "SELECT i.id, i.audience, i.algorithm, i.key_material, i.jwks, i.jwks_url, t.id, t.name, \
             t.rpm, t.tpm, t.max_concurrent, t.share, t.priority, t.monthly_budget_nusd, t.budget_mode, \
             t.suspended_at FROM jwt_issuers i JOIN tenants t ON t.id = i.tenant_id WHERE i.issuer = $1",
        )
        .bind(iss)
        .fetch_optional(&self.pool);
        let row = crate::outage::query(stale.is_some(), query).await;
        let row = match row {
            Ok(r) => {
                self.health.answered();
                r
            }
            Err(e) => {
                self.health.failed("jwt issuer", &e.to_string());
                return from_cache(stale, e.to_string());
            }
        };
        let Some(row) = row else {
            if iss.len() <= 256 {
                self.jwt.unknown.insert(iss);
            }
            return Err(jwt_err("the token's issuer is not registered"));
        };
        let alg_name: String = row.get(2);
        let alg = Algorithm::from_str(&alg_name).map_err(|_| AuthError::Store(format!("bad algorithm {alg_name}")))?;
        let key: Option<String> = row.get(3);
        let jwks: Option<String> = row.get(4);
        let url: Option<String> = row.get(5);
        let keys = match (key, jwks, url) {
            (Some(k), _, _) => Keys::Static(Arc::new(static_key(alg, &k).map_err(AuthError::Store)?)),
            (_, Some(doc), _) => Keys::Set(Arc::new(jwks_keys(alg, &doc).map_err(AuthError::Store)?)),
            (_, _, Some(u)) => Keys::Url(u),
            _ => return Err(AuthError::Store("issuer without keys".into())),
        };
        let r = Resolved {
            id: row.get(0),
            audience: row.get(1),
            alg,
            keys,
            tenant_id: row.get(6),
            tenant_name: row.get(7),
            tenant_limits: Limits::from_row(&row, 8),
            budget: budget_from(row.get(13), &row.get::<String, _>(14)),
            suspended: row.get::<Option<i64>, _>(15).is_some(),
            fetched: Instant::now(),
        };
        self.jwt
            .issuers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(iss.to_string(), r.clone());
        Ok(r)
    }

    /// The keys at a JWKS URL, cached; refetched when stale, or when `kid` is unknown and the
    /// last fetch is older than 30 s (key rotation).
    pub(crate) async fn url_keys(
        &self,
        url: &str,
        alg: Algorithm,
        kid: Option<&str>,
    ) -> Result<Arc<Vec<(Option<String>, DecodingKey)>>, AuthError> {
        // Keys are kept per (algorithm, URL): one document may serve several algorithms.
        let slot = format!("{alg:?} {url}");
        {
            // The lock is never held across the fetch: a slow JWKS stalls only its own callers.
            let cache = self.jwt.jwks.lock().await;
            if let Some(f) = cache.get(&slot) {
                let known = kid.is_none_or(|k| f.keys.iter().any(|(id, _)| id.as_deref() == Some(k)));
                let age = f.fetched.elapsed();
                if age < JWKS_TTL && (known || age < JWKS_MIN_REFETCH) {
                    return Ok(f.keys.clone());
                }
            }
            if let Some((at, why)) = cache_failure(&self.jwt.jwks_failures, &slot) {
                return Err(AuthError::Store(format!("{why} ({}s ago)", at.as_secs())));
            }
        }
        let fetched = async {
            let client = crate::sso::client(Duration::from_secs(5))?;
            let doc = crate::sso::fetch_limited(client.get(url), crate::sso::MAX_DOCUMENT_BYTES).await?;
            jwks_keys(alg, &String::from_utf8_lossy(&doc))
        }
        .await
        .map_err(|e| format!("fetching the JWKS at {url}: {e}"));
        let keys = match fetched {
            Ok(k) => Arc::new(k),
            Err(why) => {
                self.jwt
                    .jwks_failures
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(slot, (Instant::now(), why.clone()));
                return Err(AuthError::Store(why));
            }
        };
        self.jwt.jwks.lock().await.insert(
            slot,
            FetchedJwks {
                keys: keys.clone(),
                fetched: Instant::now(),
            },
        );
        Ok(keys)
    }

    pub(crate) async fn authenticate_jwt(&self, token: &str) -> Result<TenantContext, AuthError> {
        if token.len() > 16 * 1024 {
            return Err(jwt_err("the token is too large"));
        }
        let header = jsonwebtoken::decode_header(token)
            .map_err(|_| jwt_err("malformed token header (and alg 'none' is never accepted)"))?;
        let iss = jsonwebtoken::dangerous::insecure_decode_claims::<UnverifiedIss>(token)
            .map_err(|_| jwt_err("malformed token claims"))?
            .iss
            .ok_or_else(|| jwt_err("the token has no 'iss' claim"))?;
        let issuer = self.resolve_issuer(&iss).await?;
        if issuer.suspended {
            return Err(AuthError::Suspended(issuer.tenant_name));
        }
        if header.alg != issuer.alg {
            return Err(jwt_err(format!(
                "algorithm {:?} is not accepted for this issuer",
                header.alg
            )));
        }
        let pick = |set: &[(Option<String>, DecodingKey)]| -> Option<DecodingKey> {
            match header.kid.as_deref() {
                Some(kid) => set.iter().find(|(id, _)| id.as_deref() == Some(kid)),
                None if set.len() == 1 => set.first(),
                None => None,
            }
            .map(|(_, k)| k.clone())
        };
        let key = match &issuer.keys {
            Keys::Static(k) => (**k).clone(),
            Keys::Set(set) => {
                pick(set).ok_or_else(|| jwt_err("no key in the issuer's JWKS matches the token's kid"))?
            }
            Keys::Url(url) => {
                let set = self.url_keys(url, issuer.alg, header.kid.as_deref()).await?;
                pick(&set).ok_or_else(|| jwt_err("no key in the issuer's JWKS matches the token's kid"))?
            }
        };
        let mut v = Validation::new(issuer.alg);
        v.set_issuer(&[&iss]);
        v.set_audience(&[&issuer.audience]);
        v.set_required_spec_claims(&["exp", "iss", "aud", "sub"]);
        v.leeway = LEEWAY_SECS;
        v.validate_nbf = true;
        let data = jsonwebtoken::decode::<Claims>(token, &key, &v).map_err(|e| {
            jwt_err(match e.kind() {
                ErrorKind::ExpiredSignature => "the token has expired".to_string(),
                ErrorKind::ImmatureSignature => "the token is not valid yet (nbf)".to_string(),
                ErrorKind::InvalidAudience => "the token's audience is not accepted".to_string(),
                ErrorKind::InvalidIssuer => "the token's issuer is not accepted".to_string(),
                ErrorKind::InvalidSignature => "the token's signature does not verify".to_string(),
                ErrorKind::InvalidAlgorithm => "the token's algorithm is not accepted".to_string(),
                ErrorKind::MissingRequiredClaim(c) => format!("the token has no '{c}' claim"),
                _ => format!("the token was refused ({e})"),
            })
        })?;
        let c = data.claims;
        if c.sub.is_empty() || c.sub.len() > 256 {
            return Err(jwt_err("the token's 'sub' must be 1-256 bytes"));
        }
        let words: Vec<String> = match (c.scope, c.scp) {
            (Some(s), _) => s.split_whitespace().map(str::to_string).collect(),
            (None, Some(v)) => v,
            (None, None) => vec!["inference".into()],
        };
        let mut scopes = Scopes::default();
        let mut models = Vec::new();
        for w in &words {
            match w.as_str() {
                "inference" => scopes.inference = true,
                "manage" => scopes.manage = true,
                m => {
                    if let Some(model) = m.strip_prefix("model:") {
                        models.push(model.to_string());
                    }
                }
            }
        }
        let key_id = format!("jwt:{}:{}", issuer.id, c.sub);
        let key_limits = self
            .principal_limits(&key_id)
            .await
            .map_err(|e| AuthError::Store(e.to_string()))?;
        Ok(TenantContext {
            tenant_id: issuer.tenant_id,
            tenant_name: issuer.tenant_name,
            key_id,
            scopes,
            models: (!models.is_empty()).then(|| models.into()),
            tenant_limits: issuer.tenant_limits,
            key_limits,
            budget: issuer.budget,
            expires_at: c.exp.map(|s| (s * 1000.0) as i64),
        })
    }
}

//! Single sign-on through OpenID Connect: a tenant's own identity provider (one per tenant,
//! stored here) or the operators' (configured on the gateway).
//!
//! The dashboard runs the authorization-code flow with PKCE (S256); this module holds what
//! does not depend on HTTP routes: the providers, issuer discovery (cached), the code
//! exchange, ID-token verification and the member an identity signs in as.
//!
//! An ID token is accepted only when:
//! - its `alg` is asymmetric and one the provider's discovery document lists (HMAC and
//!   `none` never: a token cannot choose to be checked with a public key as an HMAC secret);
//! - its signature verifies under a key of the provider's JWKS (by `kid`, refetched on an
//!   unknown `kid` for key rotation);
//! - `iss` is the provider's issuer, `aud` contains the client id (and `azp`, when present
//!   or when there are several audiences, is the client id), `exp` has not passed (30 s
//!   leeway) and `sub` is present;
//! - its `nonce` is the one this sign-in sent, and was not used before
//!   ([`TenantStore::consume_nonce`]: a replayed token is refused on every gateway).
//!
//! The identity becomes a member: by issuer and subject once linked; the first time, by the
//! token's e-mail address when `email_verified` is true — an existing member with that
//! address (the link is then kept) or an open invitation to it (accepted: the member has no
//! password and signs in through the provider). Anyone else is refused: a provider vouches
//! for who someone is, the tenant's owners decide who is a member.

use std::collections::HashMap;
use std::str::FromStr;
use std::time::{Duration, Instant};

use base64::Engine as _;
use jsonwebtoken::errors::ErrorKind;
use jsonwebtoken::{Algorithm, AlgorithmFamily, DecodingKey, Validation};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use sqlx::any::AnyRow;
use sqlx::Row;

use crate::members::Member;
use crate::{constant_time_eq, now_ms, random_hex, TenantError, TenantStore};

const DISCOVERY_TTL: Duration = Duration::from_secs(600);
const HTTP_TIMEOUT: Duration = Duration::from_secs(10);
const LEEWAY_SECS: u64 = 30;

/// What configuring a provider takes (the admin API's body).
#[derive(Clone, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SsoSpec {
    /// The issuer URL (`https://…`; `http://` only for a loopback host): its
    /// `/.well-known/openid-configuration` is read.
    pub issuer: String,
    /// The client id registered at the provider for this installation.
    pub client_id: String,
    /// The client's secret (confidential clients; sent with HTTP Basic to the token
    /// endpoint). None: a public client, protected by PKCE alone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_secret: Option<String>,
}

impl std::fmt::Debug for SsoSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SsoSpec")
            .field("issuer", &self.issuer)
            .field("client_id", &self.client_id)
            .field("client_secret", &self.client_secret.as_ref().map(|_| "…"))
            .finish()
    }
}

/// A tenant's provider as listings show it (never the secret).
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SsoProvider {
    pub tenant_id: String,
    pub issuer: String,
    pub client_id: String,
    pub has_client_secret: bool,
    pub created_at: i64,
}

/// The endpoints and algorithms an issuer's discovery document gives.
#[derive(Debug, Clone)]
pub struct Discovery {
    pub issuer: String,
    pub authorization_endpoint: String,
    pub token_endpoint: String,
    pub jwks_uri: String,
    /// Asymmetric ID-token algorithms the issuer uses (RS256 when it lists none usable).
    pub algorithms: Vec<Algorithm>,
}

/// Who the provider says signed in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub issuer: String,
    pub subject: String,
    /// Lower-cased; only when the provider marks it verified.
    pub verified_email: Option<String>,
}

/// How [`TenantStore::sso_member`] found the member.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SsoMatch {
    /// By issuer and subject, linked before.
    Linked,
    /// An existing member, linked to the identity now by its verified address.
    LinkedNow,
    /// A new member, from an open invitation to the verified address.
    Joined,
}

/// Why a sign-in through a provider failed.
#[derive(Debug, thiserror::Error)]
pub enum SsoError {
    /// The provider could not be reached or answered something unusable.
    #[error("the identity provider: {0}")]
    Provider(String),
    /// The provider's answer was refused (its ID token, or an error it reported).
    #[error("{0}")]
    Refused(String),
    #[error(transparent)]
    Store(#[from] TenantError),
}

/// A PKCE pair: the verifier stays with the browser's flow cookie, the challenge goes to the
/// provider.
pub struct Pkce {
    pub verifier: String,
    pub challenge: String,
}

impl Pkce {
    pub fn new() -> Result<Pkce, TenantError> {
        // 64 hex characters: within RFC 7636's 43-128 unreserved characters.
        let verifier = random_hex(32)?;
        let challenge = challenge(&verifier);
        Ok(Pkce { verifier, challenge })
    }
}

/// The S256 challenge of a verifier.
pub fn challenge(verifier: &str) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(Sha256::digest(verifier.as_bytes()))
}

/// The code `hearth admin login` prints and the gateway's confirmation page shows (the
/// start of the CLI's challenge), so that operators see it is their own command line they
/// sign in.
pub fn cli_code(challenge: &str) -> String {
    let c: Vec<char> = challenge.chars().take(8).collect();
    let (a, b) = c.split_at(c.len().min(4));
    format!("{}-{}", a.iter().collect::<String>(), b.iter().collect::<String>())
}

/// A random value for `state` and `nonce` (128 bits, hex).
pub fn random_value() -> Result<String, TenantError> {
    random_hex(16)
}

fn invalid(field: &'static str, message: impl Into<String>) -> TenantError {
    TenantError::Invalid {
        field,
        message: message.into(),
    }
}

/// Checks an issuer URL: https, or http to a loopback host (a provider on the same machine).
pub fn check_issuer(issuer: &str) -> Result<(), TenantError> {
    let url = reqwest::Url::parse(issuer).map_err(|e| invalid("issuer", format!("not a URL: {e}")))?;
    let host = url
        .host_str()
        .unwrap_or("")
        .trim_start_matches('[')
        .trim_end_matches(']');
    let loopback = host == "localhost" || host.parse::<std::net::IpAddr>().is_ok_and(|a| a.is_loopback());
    match url.scheme() {
        "https" => {}
        "http" if loopback => {}
        _ => return Err(invalid("issuer", "an https URL (http only for localhost)")),
    }
    if url.query().is_some() || url.fragment().is_some() || issuer.len() > 512 {
        return Err(invalid(
            "issuer",
            "an issuer URL without query or fragment, at most 512 bytes",
        ));
    }
    Ok(())
}

/// Checks what configuring a provider takes (the URL, the client id, the secret's size).
pub fn check_spec(spec: &SsoSpec) -> Result<(), TenantError> {
    check_issuer(&spec.issuer)?;
    if spec.client_id.is_empty() || spec.client_id.len() > 256 {
        return Err(invalid("client_id", "the client id, 1-256 bytes"));
    }
    if spec
        .client_secret
        .as_ref()
        .is_some_and(|s| s.is_empty() || s.len() > 1024)
    {
        return Err(invalid(
            "client_secret",
            "1-1024 bytes, or leave it out for a public client",
        ));
    }
    Ok(())
}

/// Discovery documents by issuer.
#[derive(Default)]
pub(crate) struct DiscoveryCache {
    docs: std::sync::Mutex<HashMap<String, (Discovery, Instant)>>,
    /// Issuers whose discovery failed lately (not retried for a few seconds).
    failures: std::sync::Mutex<HashMap<String, (Instant, String)>>,
}

#[derive(Deserialize)]
struct DiscoveryDoc {
    issuer: String,
    authorization_endpoint: String,
    token_endpoint: String,
    jwks_uri: String,
    #[serde(default)]
    id_token_signing_alg_values_supported: Vec<String>,
}

#[derive(Deserialize)]
struct TokenAnswer {
    id_token: Option<String>,
    error: Option<String>,
    error_description: Option<String>,
}

#[derive(Deserialize)]
struct IdClaims {
    sub: String,
    #[serde(default)]
    nonce: Option<String>,
    #[serde(default)]
    email: Option<String>,
    /// A boolean (some providers send the string "true").
    #[serde(default)]
    email_verified: Option<serde_json::Value>,
    #[serde(default)]
    azp: Option<String>,
    #[serde(default)]
    aud: Option<serde_json::Value>,
}

/// The largest discovery document, JWKS or token answer read from a provider.
pub(crate) const MAX_DOCUMENT_BYTES: usize = 1 << 20;

/// An HTTP client for providers: a timeout, and no redirects (an endpoint is where the
/// discovery document says, nowhere else).
pub(crate) fn client(timeout: Duration) -> Result<reqwest::Client, String> {
    reqwest::Client::builder()
        .timeout(timeout)
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .map_err(|e| e.to_string())
}

fn http() -> Result<reqwest::Client, SsoError> {
    client(HTTP_TIMEOUT).map_err(SsoError::Provider)
}

/// Sends `req` and reads at most `limit` bytes of a successful answer. A non-success status
/// is an error unless `any_status` (the token endpoint answers errors as JSON).
pub(crate) async fn fetch_limited(req: reqwest::RequestBuilder, limit: usize) -> Result<Vec<u8>, String> {
    fetch_answer(req, limit, false).await.map(|(_, b)| b)
}

async fn fetch_answer(
    req: reqwest::RequestBuilder,
    limit: usize,
    any_status: bool,
) -> Result<(reqwest::StatusCode, Vec<u8>), String> {
    let mut resp = req.send().await.map_err(|e| e.to_string())?;
    let status = resp.status();
    if !any_status && !status.is_success() {
        return Err(format!("answered {status}"));
    }
    let mut body = Vec::new();
    while let Some(chunk) = resp.chunk().await.map_err(|e| e.to_string())? {
        if body.len() + chunk.len() > limit {
            return Err(format!("answered more than {limit} bytes"));
        }
        body.extend_from_slice(&chunk);
    }
    Ok((status, body))
}

/// An endpoint a discovery document names: the issuer's own rules (https, or http to a
/// loopback host), so that a document cannot point the gateway at internal services.
fn check_endpoint(name: &str, url: &str) -> Result<(), SsoError> {
    check_issuer(url).map_err(|_| {
        SsoError::Provider(format!(
            "its {name} {url:?} is not an https URL (http only for localhost)"
        ))
    })
}

/// Verifies an ID token against `keys` (a JWKS's keys by `kid`) and returns who it names.
/// `expected_nonce` is the nonce this sign-in sent; whether it was used before is the
/// caller's check ([`TenantStore::consume_nonce`]).
pub fn verify_id_token(
    token: &str,
    keys: &[(Option<String>, DecodingKey)],
    algorithms: &[Algorithm],
    issuer: &str,
    client_id: &str,
    expected_nonce: &str,
) -> Result<(Identity, String), SsoError> {
    let refused = |m: &str| SsoError::Refused(format!("the ID token was refused: {m}"));
    if token.len() > 16 * 1024 {
        return Err(refused("it is too large"));
    }
    let header = jsonwebtoken::decode_header(token).map_err(|_| refused("its header is malformed"))?;
    if header.alg.family() == AlgorithmFamily::Hmac || !algorithms.contains(&header.alg) {
        return Err(refused(&format!(
            "algorithm {:?} is not one the provider signs with",
            header.alg
        )));
    }
    let key = match header.kid.as_deref() {
        Some(kid) => keys.iter().find(|(id, _)| id.as_deref() == Some(kid)),
        None if keys.len() == 1 => keys.first(),
        None => None,
    }
    .map(|(_, k)| k)
    .ok_or_else(|| refused("no key of the provider's JWKS matches its kid"))?;
    let mut v = Validation::new(header.alg);
    v.set_issuer(&[issuer]);
    v.set_audience(&[client_id]);
    v.set_required_spec_claims(&["exp", "iss", "aud", "sub"]);
    v.leeway = LEEWAY_SECS;
    v.validate_nbf = true;
    let claims = jsonwebtoken::decode::<IdClaims>(token, key, &v)
        .map_err(|e| {
            refused(&match e.kind() {
                ErrorKind::ExpiredSignature => "it has expired".to_string(),
                ErrorKind::ImmatureSignature => "it is not valid yet".to_string(),
                ErrorKind::InvalidAudience => "it was issued to another client".to_string(),
                ErrorKind::InvalidIssuer => "it comes from another issuer".to_string(),
                ErrorKind::InvalidSignature => "its signature does not verify".to_string(),
                ErrorKind::InvalidAlgorithm | ErrorKind::InvalidKeyFormat => {
                    "its algorithm does not fit the key".to_string()
                }
                ErrorKind::MissingRequiredClaim(c) => format!("it has no '{c}' claim"),
                _ => format!("{e}"),
            })
        })?
        .claims;
    let several = matches!(&claims.aud, Some(serde_json::Value::Array(a)) if a.len() > 1);
    match claims.azp.as_deref() {
        Some(azp) if azp != client_id => return Err(refused("it was issued to another client (azp)")),
        None if several => return Err(refused("it names several audiences and no azp")),
        _ => {}
    }
    let nonce = claims.nonce.unwrap_or_default();
    if nonce.is_empty() || !constant_time_eq(nonce.as_bytes(), expected_nonce.as_bytes()) {
        return Err(refused("its nonce is not this sign-in's"));
    }
    if claims.sub.is_empty() || claims.sub.len() > 256 {
        return Err(refused("its 'sub' must be 1-256 bytes"));
    }
    let verified = match claims.email_verified {
        Some(serde_json::Value::Bool(b)) => b,
        Some(serde_json::Value::String(s)) => s == "true",
        _ => false,
    };
    let verified_email = claims
        .email
        .filter(|_| verified)
        .and_then(|e| crate::members::normalise_email(&e).ok());
    Ok((
        Identity {
            issuer: issuer.to_string(),
            subject: claims.sub,
            verified_email,
        },
        nonce,
    ))
}

const PROVIDER_COLUMNS: &str = "SELECT tenant_id, issuer, client_id, client_secret, created_at FROM sso_providers";

fn provider_from(r: &AnyRow) -> (SsoProvider, Option<String>) {
    let secret: Option<String> = r.get(3);
    (
        SsoProvider {
            tenant_id: r.get(0),
            issuer: r.get(1),
            client_id: r.get(2),
            has_client_secret: secret.is_some(),
            created_at: r.get(4),
        },
        secret,
    )
}

impl TenantStore {
    /// Sets (or replaces) a tenant's identity provider.
    pub async fn set_sso(&self, tenant: &str, spec: &SsoSpec) -> Result<SsoProvider, TenantError> {
        let t = self.tenant(tenant).await?;
        check_spec(spec)?;
        sqlx::query(
            "INSERT INTO sso_providers (tenant_id, issuer, client_id, client_secret, created_at) \
             VALUES ($1, $2, $3, $4, $5) ON CONFLICT (tenant_id) DO UPDATE SET issuer = excluded.issuer, \
             client_id = excluded.client_id, client_secret = excluded.client_secret, created_at = excluded.created_at",
        )
        .bind(&t.id)
        .bind(&spec.issuer)
        .bind(&spec.client_id)
        .bind(&spec.client_secret)
        .bind(now_ms())
        .execute(&self.pool)
        .await?;
        self.sso_spec(&t.id)
            .await?
            .map(|(p, _)| p)
            .ok_or(TenantError::NoSuchTenant(t.id))
    }

    /// A tenant's provider, if it has one (by tenant id or name).
    pub async fn sso(&self, tenant: &str) -> Result<Option<SsoProvider>, TenantError> {
        let t = self.tenant(tenant).await?;
        Ok(self.sso_spec(&t.id).await?.map(|(p, _)| p))
    }

    /// A tenant's provider with what signing in through it takes (the secret included).
    pub async fn sso_spec(&self, tenant_id: &str) -> Result<Option<(SsoProvider, SsoSpec)>, TenantError> {
        let r = sqlx::query(&format!("{PROVIDER_COLUMNS} WHERE tenant_id = $1"))
            .bind(tenant_id)
            .fetch_optional(&self.pool)
            .await?;
        Ok(r.map(|r| {
            let (p, secret) = provider_from(&r);
            let spec = SsoSpec {
                issuer: p.issuer.clone(),
                client_id: p.client_id.clone(),
                client_secret: secret,
            };
            (p, spec)
        }))
    }

    /// Removes a tenant's provider; its members keep their passwords (if they set one).
    pub async fn remove_sso(&self, tenant: &str) -> Result<SsoProvider, TenantError> {
        let t = self.tenant(tenant).await?;
        let p = self
            .sso_spec(&t.id)
            .await?
            .map(|(p, _)| p)
            .ok_or(TenantError::NoSuchProvider(t.name))?;
        sqlx::query("DELETE FROM sso_providers WHERE tenant_id = $1")
            .bind(&t.id)
            .execute(&self.pool)
            .await?;
        Ok(p)
    }

    /// The issuer's discovery document (cached for ten minutes). Its `issuer` must be
    /// exactly the configured one (OpenID Connect Discovery §4.3).
    pub async fn discover(&self, issuer: &str) -> Result<Discovery, SsoError> {
        if let Some((d, at)) = self.sso.docs.lock().unwrap_or_else(|e| e.into_inner()).get(issuer) {
            if at.elapsed() < DISCOVERY_TTL {
                return Ok(d.clone());
            }
        }
        if let Some((ago, why)) = crate::jwt::cache_failure(&self.sso.failures, issuer) {
            return Err(SsoError::Provider(format!("{why} ({}s ago)", ago.as_secs())));
        }
        let d = self.fetch_discovery(issuer).await;
        let mut docs = self.sso.docs.lock().unwrap_or_else(|e| e.into_inner());
        match d {
            Ok(d) => {
                docs.insert(issuer.to_string(), (d.clone(), Instant::now()));
                Ok(d)
            }
            Err(e) => {
                self.sso
                    .failures
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(issuer.to_string(), (Instant::now(), e.to_string()));
                Err(e)
            }
        }
    }

    /// Reads and checks an issuer's discovery document (no lock held: a slow provider
    /// delays only its own sign-ins).
    async fn fetch_discovery(&self, issuer: &str) -> Result<Discovery, SsoError> {
        let url = format!("{}/.well-known/openid-configuration", issuer.trim_end_matches('/'));
        let body = fetch_limited(http()?.get(&url), MAX_DOCUMENT_BYTES)
            .await
            .map_err(|e| SsoError::Provider(format!("reading {url}: {e}")))?;
        let doc: DiscoveryDoc =
            serde_json::from_slice(&body).map_err(|e| SsoError::Provider(format!("reading {url}: {e}")))?;
        check_endpoint("authorization endpoint", &doc.authorization_endpoint)?;
        check_endpoint("token endpoint", &doc.token_endpoint)?;
        check_endpoint("JWKS URL", &doc.jwks_uri)?;
        if doc.issuer != issuer {
            return Err(SsoError::Provider(format!(
                "{url} names the issuer {:?}, not {issuer:?}",
                doc.issuer
            )));
        }
        let mut algorithms: Vec<Algorithm> = doc
            .id_token_signing_alg_values_supported
            .iter()
            .filter_map(|a| Algorithm::from_str(a).ok())
            .filter(|a| a.family() != AlgorithmFamily::Hmac)
            .collect();
        if algorithms.is_empty() {
            algorithms.push(Algorithm::RS256);
        }
        Ok(Discovery {
            issuer: doc.issuer,
            authorization_endpoint: doc.authorization_endpoint,
            token_endpoint: doc.token_endpoint,
            jwks_uri: doc.jwks_uri,
            algorithms,
        })
    }

    /// Exchanges an authorization code (with its PKCE verifier) for the ID token, verifies
    /// it and spends its nonce; returns who signed in.
    pub async fn complete_sso(
        &self,
        spec: &SsoSpec,
        code: &str,
        verifier: &str,
        redirect_uri: &str,
        expected_nonce: &str,
    ) -> Result<Identity, SsoError> {
        let d = self.discover(&spec.issuer).await?;
        let mut form = vec![
            ("grant_type", "authorization_code"),
            ("code", code),
            ("redirect_uri", redirect_uri),
            ("code_verifier", verifier),
        ];
        let mut req = http()?.post(&d.token_endpoint);
        match &spec.client_secret {
            Some(secret) => req = req.basic_auth(form_encode(&spec.client_id), Some(form_encode(secret))),
            None => form.push(("client_id", &spec.client_id)),
        }
        let (status, body) = fetch_answer(req.form(&form), MAX_DOCUMENT_BYTES, true)
            .await
            .map_err(|e| SsoError::Provider(format!("the token endpoint: {e}")))?;
        let answer: TokenAnswer = serde_json::from_slice(&body)
            .map_err(|e| SsoError::Provider(format!("the token endpoint answered {status} without JSON: {e}")))?;
        if let Some(err) = answer.error {
            return Err(SsoError::Refused(format!(
                "the identity provider refused the code: {err}{}",
                answer.error_description.map(|d| format!(" ({d})")).unwrap_or_default()
            )));
        }
        let token = answer
            .id_token
            .ok_or_else(|| SsoError::Provider("the token endpoint sent no id_token (is `openid` allowed?)".into()))?;
        let header = jsonwebtoken::decode_header(&token)
            .map_err(|_| SsoError::Refused("the ID token was refused: its header is malformed".into()))?;
        // A token in an algorithm the provider does not list is refused by the check below;
        // its keys are looked up under a listed one.
        let alg = if d.algorithms.contains(&header.alg) {
            header.alg
        } else {
            d.algorithms.first().copied().unwrap_or(Algorithm::RS256)
        };
        let keys = self
            .url_keys(&d.jwks_uri, alg, header.kid.as_deref())
            .await
            .map_err(|e| SsoError::Provider(e.to_string()))?;
        let (identity, nonce) =
            verify_id_token(&token, &keys, &d.algorithms, &d.issuer, &spec.client_id, expected_nonce)?;
        if !self.consume_nonce(&nonce).await? {
            return Err(SsoError::Refused(
                "the ID token was refused: its nonce was used before (a replayed sign-in)".into(),
            ));
        }
        Ok(identity)
    }

    /// Records a nonce as used; false when it was used before. Kept for a day (a sign-in's
    /// flow lives ten minutes; an ID token presented later is refused by its flow anyway).
    pub async fn consume_nonce(&self, nonce: &str) -> Result<bool, TenantError> {
        let now = now_ms();
        sqlx::query("DELETE FROM sso_nonces WHERE expires_at < $1")
            .bind(now)
            .execute(&self.pool)
            .await?;
        let r = sqlx::query("INSERT INTO sso_nonces (nonce, expires_at) VALUES ($1, $2)")
            .bind(nonce)
            .bind(now + 24 * 3600 * 1000)
            .execute(&self.pool)
            .await;
        match r {
            Ok(_) => Ok(true),
            Err(sqlx::Error::Database(e)) if e.is_unique_violation() => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// The member an identity signs in as (see the module's notes) and how it was found, or
    /// None.
    pub async fn sso_member(&self, tenant_id: &str, who: &Identity) -> Result<Option<(Member, SsoMatch)>, TenantError> {
        let by_subject = format!(
            "{} WHERE tenant_id = $1 AND sso_issuer = $2 AND sso_subject = $3",
            crate::members::MEMBER_COLUMNS
        );
        let linked = sqlx::query(&by_subject)
            .bind(tenant_id)
            .bind(&who.issuer)
            .bind(&who.subject)
            .fetch_optional(&self.pool)
            .await?;
        if let Some(r) = linked {
            return Ok(Some((crate::members::member_from(&r), SsoMatch::Linked)));
        }
        let Some(email) = &who.verified_email else {
            return Ok(None);
        };
        // Not linked yet, or linked at another issuer (the tenant changed providers): the
        // verified address decides once. A subject at the current issuer is never replaced.
        let linked = sqlx::query(
            "UPDATE members SET sso_issuer = $1, sso_subject = $2 \
             WHERE tenant_id = $3 AND email = $4 AND (sso_subject IS NULL OR sso_issuer <> $1)",
        )
        .bind(&who.issuer)
        .bind(&who.subject)
        .bind(tenant_id)
        .bind(email)
        .execute(&self.pool)
        .await?
        .rows_affected();
        if linked > 0 {
            let r = sqlx::query(&by_subject)
                .bind(tenant_id)
                .bind(&who.issuer)
                .bind(&who.subject)
                .fetch_optional(&self.pool)
                .await?;
            return Ok(r.map(|r| (crate::members::member_from(&r), SsoMatch::LinkedNow)));
        }
        match self.open_invitation(tenant_id, email).await? {
            Some(inv) => Ok(self
                .take_invitation(&inv, None, Some((&who.issuer, &who.subject)))
                .await?
                .map(|m| (m, SsoMatch::Joined))),
            None => Ok(None),
        }
    }
}

/// `application/x-www-form-urlencoded` encoding of a client credential for HTTP Basic
/// (RFC 6749 §2.3.1).
fn form_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'*' => (b as char).to_string(),
            b' ' => "+".to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

const CLI_GRANT_TTL_MS: i64 = 60 * 1000;

impl TenantStore {
    /// A one-time code for the CLI that started an operator's browser sign-in
    /// (`hearth admin login`), bound to its PKCE `challenge`; valid one minute.
    pub async fn create_cli_grant(&self, email: &str, challenge: &str) -> Result<String, TenantError> {
        let code = random_hex(32)?;
        let now = now_ms();
        sqlx::query("DELETE FROM cli_grants WHERE expires_at < $1")
            .bind(now)
            .execute(&self.pool)
            .await?;
        sqlx::query("INSERT INTO cli_grants (code_sha256, email, challenge, expires_at) VALUES ($1, $2, $3, $4)")
            .bind(crate::members::token_sha256(&code))
            .bind(email)
            .bind(challenge)
            .bind(now + CLI_GRANT_TTL_MS)
            .execute(&self.pool)
            .await?;
        Ok(code)
    }

    /// The operator's address of a CLI grant, spending it: None when the code is unknown,
    /// used or expired, or the verifier is not the one its challenge was made from (the
    /// grant is spent either way: one try).
    pub async fn take_cli_grant(&self, code: &str, verifier: &str) -> Result<Option<String>, TenantError> {
        let id = crate::members::token_sha256(code);
        let r = sqlx::query("SELECT email, challenge, expires_at FROM cli_grants WHERE code_sha256 = $1")
            .bind(&id)
            .fetch_optional(&self.pool)
            .await?;
        let Some(r) = r else {
            return Ok(None);
        };
        let taken = sqlx::query("DELETE FROM cli_grants WHERE code_sha256 = $1")
            .bind(&id)
            .execute(&self.pool)
            .await?
            .rows_affected();
        let (email, want, expires_at): (String, String, i64) = (r.get(0), r.get(1), r.get(2));
        let ok =
            taken == 1 && expires_at > now_ms() && constant_time_eq(challenge(verifier).as_bytes(), want.as_bytes());
        Ok(ok.then_some(email))
    }
}

//! Store tests; each runs on in-memory SQLite and, when `DATABASE_URL` names one, on a
//! fresh PostgreSQL schema.

use jsonwebtoken::{encode, Algorithm, EncodingKey, Header};
use serde_json::json;

use super::*;
use crate::db::testing;
use crate::jwt::IssuerSpec;

const RSA_PRIVATE: &str = include_str!("../tests/fixtures/rsa_private.pem");
const RSA_PUBLIC: &str = include_str!("../tests/fixtures/rsa_public.pem");
const RSA_JWKS: &str = include_str!("../tests/fixtures/rsa_jwks.json");
const ED_PRIVATE: &str = include_str!("../tests/fixtures/ed25519_private.pem");
const ED_PUBLIC: &str = include_str!("../tests/fixtures/ed25519_public.pem");
const HS_SECRET: &str = "an-hmac-secret-of-at-least-32-bytes!!";

#[tokio::test]
async fn keys_authenticate_and_revoke() {
    for db in testing::all().await {
        let s = TenantStore::new(&db);
        let name = db.backend.as_str();
        assert!(!s.has_active_keys().await.unwrap(), "{name}");
        let t = s.create_tenant("acme").await.unwrap();
        assert!(matches!(
            s.create_tenant("acme").await,
            Err(TenantError::TenantExists(_))
        ));
        // A tenant name is a label: any printable text, but never shaped like an id.
        for bad in ["", " padded", "line\nbreak", "tn_0123456789abcdef"] {
            assert!(
                matches!(s.create_tenant(bad).await, Err(TenantError::InvalidTenantName(_))),
                "{name}: {bad:?}"
            );
        }
        let odd = s.create_tenant("<img src=x onerror=alert(1)>").await.unwrap();
        assert_eq!(s.tenant("<img src=x onerror=alert(1)>").await.unwrap().id, odd.id);
        let k = s
            .create_key(
                "acme",
                &KeySpec {
                    name: "ci".into(),
                    ..Default::default()
                },
            )
            .await
            .unwrap();
        assert!(k.key.starts_with("hk_"));
        assert_eq!(k.info.scopes, vec!["inference", "manage"]);
        assert!(s.has_active_keys().await.unwrap());
        let ctx = s.authenticate(&k.key).await.unwrap();
        assert_eq!(ctx.tenant_limits, Limits::default());
        assert_eq!(ctx.scopes, Scopes::ALL);
        assert!(ctx.allows_model("anything"));
        let lim = Limits {
            rpm: Some(10),
            tpm: None,
            concurrent: Some(2),
            share: Some(3),
            priority: None,
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
        assert_eq!((limited.share(), limited.priority()), (3, Priority::Interactive));
        // A key lowers its tenant's class; a share is the tenant's alone.
        s.set_key_limits(
            &k.info.id,
            Limits {
                priority: Some(Priority::Batch),
                ..Default::default()
            },
        )
        .await
        .unwrap();
        assert_eq!(s.authenticate(&k.key).await.unwrap().priority(), Priority::Batch);
        let e = s
            .set_key_limits(
                &k.info.id,
                Limits {
                    share: Some(2),
                    ..Default::default()
                },
            )
            .await
            .unwrap_err();
        assert!(matches!(e, TenantError::Invalid { field: "share", .. }), "{e}");
        let e = s
            .set_tenant_limits(
                "acme",
                Limits {
                    share: Some(MAX_SHARE + 1),
                    ..Default::default()
                },
            )
            .await
            .unwrap_err();
        assert!(matches!(e, TenantError::Invalid { field: "share", .. }), "{e}");
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
            .fetch_one(s.pool())
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
            s.create_key("ghost", &KeySpec::default()).await,
            Err(TenantError::NoSuchTenant(_))
        ));
    }
}

#[tokio::test]
async fn key_scopes_models_and_expiry() {
    for db in testing::all().await {
        let s = TenantStore::new(&db);
        s.create_tenant("scoped").await.unwrap();
        let k = s
            .create_key(
                "scoped",
                &KeySpec {
                    name: "narrow".into(),
                    scopes: Some(Scopes::parse("inference").unwrap()),
                    models: Some(vec!["m1".into()]),
                    expires_at: Some(now_ms() + 60_000),
                },
            )
            .await
            .unwrap();
        let ctx = s.authenticate(&k.key).await.unwrap();
        assert!(ctx.scopes.inference && !ctx.scopes.manage);
        assert!(ctx.allows_model("m1") && !ctx.allows_model("m2"));
        let listed = s.key(&k.info.id).await.unwrap();
        assert_eq!(listed.models, Some(vec!["m1".to_string()]));
        assert_eq!(listed.scopes, vec!["inference"]);
        // An expiry in the past is refused at creation; one that passes refuses the key.
        assert!(matches!(
            s.create_key(
                "scoped",
                &KeySpec {
                    expires_at: Some(now_ms() - 1),
                    ..Default::default()
                }
            )
            .await,
            Err(TenantError::Invalid {
                field: "expires_at",
                ..
            })
        ));
        let short = s
            .create_key(
                "scoped",
                &KeySpec {
                    expires_at: Some(now_ms() + 150),
                    ..Default::default()
                },
            )
            .await
            .unwrap();
        assert!(s.authenticate(&short.key).await.is_ok());
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(matches!(s.authenticate(&short.key).await, Err(AuthError::Expired(_))));
        assert!(Scopes::parse("inference,admin").is_err());
        assert!(Scopes::parse("inference").unwrap().within(Scopes::ALL));
        assert!(!Scopes::ALL.within(Scopes::parse("inference").unwrap()));
    }
}

#[tokio::test]
async fn budgets_round_trip() {
    for db in testing::all().await {
        let s = TenantStore::new(&db);
        s.create_tenant("spender").await.unwrap();
        assert_eq!(s.budget("spender").await.unwrap(), None);
        let b = Budget {
            monthly_nusd: 5_000_000_000,
            hard: false,
        };
        s.set_budget("spender", Some(b)).await.unwrap();
        assert_eq!(s.budget("spender").await.unwrap(), Some(b));
        let k = s.create_key("spender", &KeySpec::default()).await.unwrap();
        assert_eq!(s.authenticate(&k.key).await.unwrap().budget, Some(b));
        s.set_budget("spender", None).await.unwrap();
        assert_eq!(s.budget("spender").await.unwrap(), None);
    }
}

/// A JWT subject can be given its own limits (as a key can), read at authentication; the
/// token's `exp` is the credential's expiry.
#[tokio::test]
async fn jwt_principals_have_their_own_limits() {
    for db in testing::all().await {
        let s = TenantStore::new(&db);
        s.create_tenant("sso").await.unwrap();
        let issuer = s
            .add_issuer(
                "sso",
                &IssuerSpec {
                    issuer: "https://sso.example".into(),
                    audience: "hearth".into(),
                    algorithm: "HS256".into(),
                    key: Some(HS_SECRET.into()),
                    jwks: None,
                    jwks_url: None,
                },
            )
            .await
            .unwrap();
        let token = sign(
            Algorithm::HS256,
            &EncodingKey::from_secret(HS_SECRET.as_bytes()).unwrap(),
            &claims("https://sso.example", "hearth", 600),
            None,
        );
        let ctx = s.authenticate(&token).await.unwrap();
        assert_eq!(ctx.key_limits, Limits::default());
        let exp = ctx.expires_at.expect("the token's exp");
        assert!((exp - (now_ms() + 600_000)).abs() < 5_000, "{exp}");
        let principal = format!("jwt:{}:user-42", issuer.id);
        assert_eq!(ctx.key_id, principal);
        let l = Limits {
            rpm: Some(2),
            tpm: None,
            concurrent: Some(1),
            share: None,
            priority: Some(Priority::Batch),
        };
        s.set_key_limits(&principal, l).await.unwrap();
        assert_eq!(s.authenticate(&token).await.unwrap().key_limits, l);
        // An issuer that does not exist names no principal.
        assert!(matches!(
            s.set_key_limits("jwt:iss_nope:user-42", l).await,
            Err(TenantError::NoSuchKey(_))
        ));
    }
}

#[tokio::test]
async fn processor_positions_are_bounded() {
    use crate::processors::{ProcessorSpec, MAX_POSITION};
    for db in testing::all().await {
        let s = TenantStore::new(&db);
        s.create_tenant("placed").await.unwrap();
        let spec = |name: &str, position| ProcessorSpec {
            name: name.into(),
            sha256: "00".repeat(32),
            config: "{}".into(),
            cpu_ms: 10,
            memory_mib: 16,
            key_id: None,
            position,
            activate: false,
        };
        let wasm = b"\0asm";
        for bad in [-1, MAX_POSITION + 1, i64::MAX, i64::MIN] {
            assert!(matches!(
                s.add_processor("placed", &spec("p", Some(bad)), wasm).await,
                Err(TenantError::Invalid { field: "position", .. })
            ));
        }
        let last = s
            .add_processor("placed", &spec("last", Some(MAX_POSITION)), wasm)
            .await
            .unwrap();
        assert_eq!(last.position, MAX_POSITION);
        // "After the last one" stays in range instead of wrapping.
        let next = s.add_processor("placed", &spec("next", None), wasm).await.unwrap();
        assert_eq!(next.position, MAX_POSITION);
    }
}

/// Identical components are stored once (and survive the deletion of the row holding
/// them); a tenant's processor code is bounded, each component counted once.
#[tokio::test]
async fn processor_code_is_deduplicated_and_bounded() {
    use crate::processors::ProcessorSpec;
    for db in testing::all().await {
        let mut s = TenantStore::new(&db);
        s.processor_quota = 1_000;
        s.create_tenant("coder").await.unwrap();
        let spec = |name: &str, sha: &str| ProcessorSpec {
            name: name.into(),
            sha256: sha.repeat(64),
            config: "{}".into(),
            cpu_ms: 10,
            memory_mib: 16,
            key_id: None,
            position: None,
            activate: false,
        };
        let big = vec![7u8; 600];
        let first = s.add_processor("coder", &spec("a", "a"), &big).await.unwrap();
        // The same bytes again: no new storage, no quota used.
        let second = s.add_processor("coder", &spec("b", "a"), &big).await.unwrap();
        assert_eq!((first.size, second.size), (600, 600));
        let stored: i64 = sqlx::query_scalar("SELECT COALESCE(SUM(LENGTH(wasm)), 0) FROM processors")
            .fetch_one(s.pool())
            .await
            .unwrap();
        assert_eq!(stored, 600);
        // Different bytes past the quota are refused.
        assert!(matches!(
            s.add_processor("coder", &spec("c", "c"), &vec![8u8; 500]).await,
            Err(TenantError::Invalid { field: "wasm", .. })
        ));
        // Deleting the row that holds the bytes keeps them for the other.
        s.delete_processor(&first.id).await.unwrap();
        assert_eq!(s.processor_wasm(&"a".repeat(64)).await.unwrap(), Some(big));
        assert_eq!(s.processor(&second.id).await.unwrap().size, 600);
    }
}

fn b64url(data: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::new();
    for chunk in data.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |acc, (i, b)| acc | (*b as u32) << (16 - 8 * i));
        for i in 0..=chunk.len() {
            out.push(A[(n >> (18 - 6 * i) & 63) as usize] as char);
        }
    }
    out
}

fn now_s() -> i64 {
    now_ms() / 1000
}

fn claims(iss: &str, aud: &str, exp_in: i64) -> serde_json::Value {
    json!({"iss": iss, "aud": aud, "sub": "user-42", "exp": now_s() + exp_in, "iat": now_s(),
           "scope": "inference manage model:m1 openid"})
}

fn sign(alg: Algorithm, key: &EncodingKey, claims: &serde_json::Value, kid: Option<&str>) -> String {
    let mut h = Header::new(alg);
    h.kid = kid.map(str::to_string);
    encode(&h, claims, key).unwrap()
}

#[tokio::test]
async fn jwt_issuers_verify_and_refuse_attacks() {
    for db in testing::all().await {
        let s = TenantStore::new(&db);
        let t = s.create_tenant("idp").await.unwrap();
        let add = |iss: &str, alg: &str, key: Option<&str>, jwks: Option<&str>| IssuerSpec {
            issuer: iss.into(),
            audience: "hearth".into(),
            algorithm: alg.into(),
            key: key.map(str::to_string),
            jwks: jwks.map(str::to_string),
            jwks_url: None,
        };
        s.add_issuer("idp", &add("https://hs.example", "HS256", Some(HS_SECRET), None))
            .await
            .unwrap();
        s.add_issuer("idp", &add("https://rs.example", "RS256", Some(RSA_PUBLIC), None))
            .await
            .unwrap();
        s.add_issuer("idp", &add("https://jwks.example", "RS256", None, Some(RSA_JWKS)))
            .await
            .unwrap();
        let ed = s
            .add_issuer("idp", &add("https://ed.example", "EdDSA", Some(ED_PUBLIC), None))
            .await
            .unwrap();
        assert_eq!(ed.key_source, "pem");
        // Bad registrations.
        for (spec, field) in [
            (add("https://x", "HS256", Some("short"), None), "key"),
            (add("https://x", "RS256", Some("not a pem"), None), "key"),
            (add("https://x", "none", Some(HS_SECRET), None), "algorithm"),
            (add("https://x", "RS256", None, None), "key"),
            (add("https://x", "EdDSA", None, Some(RSA_JWKS)), "jwks"),
        ] {
            match s.add_issuer("idp", &spec).await {
                Err(TenantError::Invalid { field: f, .. }) => assert_eq!(f, field),
                other => panic!("expected an invalid {field}, got {other:?}"),
            }
        }
        assert!(matches!(
            s.add_issuer("idp", &add("https://hs.example", "HS256", Some(HS_SECRET), None))
                .await,
            Err(TenantError::IssuerExists(_))
        ));
        assert_eq!(s.list_issuers(Some("idp")).await.unwrap().len(), 4);

        let hs = EncodingKey::from_secret(HS_SECRET.as_bytes()).unwrap();
        let rs = EncodingKey::from_rsa_pem(RSA_PRIVATE.as_bytes()).unwrap();
        let edk = EncodingKey::from_ed_pem(ED_PRIVATE.as_bytes()).unwrap();
        // Good tokens, each algorithm, and the claims mapping.
        let ok = [
            sign(
                Algorithm::HS256,
                &hs,
                &claims("https://hs.example", "hearth", 300),
                None,
            ),
            sign(
                Algorithm::RS256,
                &rs,
                &claims("https://rs.example", "hearth", 300),
                None,
            ),
            sign(
                Algorithm::RS256,
                &rs,
                &claims("https://jwks.example", "hearth", 300),
                Some("test-rsa-1"),
            ),
            sign(
                Algorithm::EdDSA,
                &edk,
                &claims("https://ed.example", "hearth", 300),
                None,
            ),
        ];
        for tok in &ok {
            let ctx = s.authenticate(tok).await.unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(ctx.tenant_id, t.id);
            assert!(ctx.key_id.starts_with("jwt:iss_") && ctx.key_id.ends_with(":user-42"));
            assert_eq!(ctx.scopes, Scopes::ALL);
            assert!(ctx.allows_model("m1") && !ctx.allows_model("m2"));
        }
        // No scope claim: inference only, every model.
        let mut plain = claims("https://hs.example", "hearth", 300);
        plain.as_object_mut().unwrap().remove("scope");
        let ctx = s
            .authenticate(&sign(Algorithm::HS256, &hs, &plain, None))
            .await
            .unwrap();
        assert!(ctx.scopes.inference && !ctx.scopes.manage && ctx.allows_model("m2"));

        let refused = |tok: String, why: &'static str| {
            let s = &s;
            async move {
                match s.authenticate(&tok).await {
                    Err(AuthError::Jwt(m)) => assert!(m.contains(why), "{m:?} should say {why:?}"),
                    other => panic!("expected a refusal ({why}), got {other:?}"),
                }
            }
        };
        // alg: none.
        let none = format!(
            "{}.{}.",
            b64url(br#"{"alg":"none","typ":"JWT"}"#),
            b64url(claims("https://hs.example", "hearth", 300).to_string().as_bytes())
        );
        refused(none, "alg 'none'").await;
        // Algorithm confusion: HS256 "signed" with the RSA public key, against an RS256 issuer.
        let confused = sign(
            Algorithm::HS256,
            &EncodingKey::from_secret(RSA_PUBLIC.as_bytes()).unwrap(),
            &claims("https://rs.example", "hearth", 300),
            None,
        );
        refused(confused, "algorithm").await;
        // Expired (beyond the leeway), wrong audience, not yet valid, unknown issuer.
        refused(
            sign(
                Algorithm::RS256,
                &rs,
                &claims("https://rs.example", "hearth", -120),
                None,
            ),
            "expired",
        )
        .await;
        refused(
            sign(Algorithm::RS256, &rs, &claims("https://rs.example", "other", 300), None),
            "audience",
        )
        .await;
        let mut early = claims("https://rs.example", "hearth", 600);
        early["nbf"] = json!(now_s() + 300);
        refused(sign(Algorithm::RS256, &rs, &early, None), "not valid yet").await;
        refused(
            sign(
                Algorithm::HS256,
                &hs,
                &claims("https://nobody.example", "hearth", 300),
                None,
            ),
            "not registered",
        )
        .await;
        // A forged signature: another secret.
        let other = EncodingKey::from_secret(b"another-secret-that-is-32-bytes-long!!").unwrap();
        refused(
            sign(
                Algorithm::HS256,
                &other,
                &claims("https://hs.example", "hearth", 300),
                None,
            ),
            "signature",
        )
        .await;
        // A tampered payload keeps the old signature.
        let good = &ok[1];
        let parts: Vec<&str> = good.split('.').collect();
        let mut evil = claims("https://rs.example", "hearth", 300);
        evil["sub"] = json!("admin");
        let tampered = format!("{}.{}.{}", parts[0], b64url(evil.to_string().as_bytes()), parts[2]);
        refused(tampered, "signature").await;
        // No exp at all.
        let mut no_exp = claims("https://hs.example", "hearth", 300);
        no_exp.as_object_mut().unwrap().remove("exp");
        refused(sign(Algorithm::HS256, &hs, &no_exp, None), "'exp'").await;
        // Unknown kid in the JWKS.
        refused(
            sign(
                Algorithm::RS256,
                &rs,
                &claims("https://jwks.example", "hearth", 300),
                Some("rotated-away"),
            ),
            "kid",
        )
        .await;
        // Removing the issuer stops its tokens.
        let hs_id = s
            .list_issuers(None)
            .await
            .unwrap()
            .into_iter()
            .find(|i| i.issuer == "https://hs.example")
            .unwrap()
            .id;
        s.remove_issuer(&hs_id).await.unwrap();
        refused(ok[0].clone(), "not registered").await;
    }
}

#[test]
fn constant_time_eq_compares() {
    assert!(constant_time_eq(b"abc", b"abc"));
    assert!(!constant_time_eq(b"abc", b"abd"));
    assert!(!constant_time_eq(b"abc", b"ab"));
}

/// An issuer whose keys come from a JWKS URL: fetched on first use, cached, and refetched
/// when a token names a kid the cached document lacks (key rotation).
#[tokio::test]
async fn jwks_url_is_fetched_and_cached() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let hits = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let served = hits.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut sock, _)) = listener.accept().await else {
                return;
            };
            served.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let mut buf = [0u8; 4096];
            let _ = sock.read(&mut buf).await;
            let resp = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{}",
                RSA_JWKS.len(),
                RSA_JWKS
            );
            let _ = sock.write_all(resp.as_bytes()).await;
        }
    });
    let db = testing::sqlite().await;
    let s = TenantStore::new(&db);
    s.create_tenant("remote").await.unwrap();
    s.add_issuer(
        "remote",
        &IssuerSpec {
            issuer: "https://remote.example".into(),
            audience: "hearth".into(),
            algorithm: "RS256".into(),
            jwks_url: Some(format!("http://{addr}/.well-known/jwks.json")),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let rs = EncodingKey::from_rsa_pem(RSA_PRIVATE.as_bytes()).unwrap();
    let good = sign(
        Algorithm::RS256,
        &rs,
        &claims("https://remote.example", "hearth", 300),
        Some("test-rsa-1"),
    );
    for _ in 0..3 {
        s.authenticate(&good).await.unwrap();
    }
    assert_eq!(hits.load(std::sync::atomic::Ordering::SeqCst), 1, "the JWKS is cached");
    // An unknown kid right after a fetch does not hammer the URL (30 s minimum between fetches).
    let rotated = sign(
        Algorithm::RS256,
        &rs,
        &claims("https://remote.example", "hearth", 300),
        Some("next-key"),
    );
    assert!(matches!(s.authenticate(&rotated).await, Err(AuthError::Jwt(_))));
    assert_eq!(hits.load(std::sync::atomic::Ordering::SeqCst), 1);
}

/// A server secret is created once and then the same for every store on the database (two
/// gateways), and distinct per name.
#[tokio::test]
async fn server_secrets_are_shared_and_stable() {
    for db in testing::all().await {
        let (a, b) = (TenantStore::new(&db), TenantStore::new(&db));
        let name = format!("test-{}", random_hex(4).unwrap());
        let (x, y) = tokio::join!(a.server_secret(&name), b.server_secret(&name));
        let (x, y) = (x.unwrap(), y.unwrap());
        assert_eq!(x, y, "concurrent first uses agree");
        assert_eq!(x.len(), 64);
        assert_eq!(a.server_secret(&name).await.unwrap(), x, "stable");
        assert_ne!(a.server_secret(&format!("{name}-other")).await.unwrap(), x);
    }
}

/// Dashboard sessions: only the token's hash is stored; a key session ends with its key;
/// a JWT session carries the token's scopes and never outlives its `exp`; sign-out ends it.
#[tokio::test]
async fn sessions_follow_their_credentials() {
    use crate::sessions::{admin_fingerprint, SessionKind};
    for db in testing::all().await {
        let s = TenantStore::new(&db);
        let t = s.create_tenant("dash").await.unwrap();
        let k = s.create_key("dash", &KeySpec::default()).await.unwrap();
        let ctx = s.authenticate(&k.key).await.unwrap();
        let kind = SessionKind::Tenant {
            tenant_id: t.id.clone(),
            credential: ctx.key_id.clone(),
            scopes: ctx.scopes,
            models: None,
        };
        let (token, opened) = s.create_session(kind, None, Some("127.0.0.1")).await.unwrap();
        let stored: String = sqlx::query_scalar("SELECT token_sha256 FROM dashboard_sessions")
            .fetch_one(s.pool())
            .await
            .unwrap();
        assert_ne!(stored, token, "the token itself is never stored");
        let live = s.session(&token).await.unwrap().expect("live");
        assert_eq!(live.csrf, opened.csrf);
        assert_eq!(s.session_context(&live).await.unwrap().tenant_id, t.id);
        assert!(s.session("f".repeat(64).as_str()).await.unwrap().is_none());
        assert!(s.session("not hex").await.unwrap().is_none());
        // Revoking the key ends what it opened.
        s.revoke_key(&k.info.id).await.unwrap();
        assert!(matches!(s.session_context(&live).await, Err(AuthError::Revoked)));
        s.end_session(&token).await.unwrap();
        assert!(s.session(&token).await.unwrap().is_none());

        // An operator session; one past its end is gone.
        let op = SessionKind::Operator {
            admin_fp: admin_fingerprint("secret"),
        };
        let (token, _) = s.create_session(op.clone(), None, None).await.unwrap();
        assert_eq!(s.session(&token).await.unwrap().unwrap().kind, op);
        let (gone, _) = s.create_session(op, Some(now_ms() - 1), None).await.unwrap();
        assert!(s.session(&gone).await.unwrap().is_none());
        assert_eq!(
            s.purge_sessions().await.unwrap(),
            0,
            "the expired one was deleted on read"
        );

        // A JWT principal: scopes from the token, limits and budget from the tenant now.
        let issuer = s
            .add_issuer(
                "dash",
                &IssuerSpec {
                    issuer: "https://dash.example".into(),
                    audience: "hearth".into(),
                    algorithm: "HS256".into(),
                    key: Some(HS_SECRET.into()),
                    jwks: None,
                    jwks_url: None,
                },
            )
            .await
            .unwrap();
        let end = now_ms() + 60_000;
        let kind = SessionKind::Tenant {
            tenant_id: t.id.clone(),
            credential: format!("jwt:{}:alice", issuer.id),
            scopes: Scopes::ALL,
            models: Some(vec!["m1".into()]),
        };
        let (token, _) = s.create_session(kind, Some(end), None).await.unwrap();
        let live = s.session(&token).await.unwrap().unwrap();
        assert_eq!(live.expires_at, end, "never past the token's exp");
        let ctx = s.session_context(&live).await.unwrap();
        assert_eq!(
            (ctx.tenant_name.as_str(), ctx.models.as_deref()),
            ("dash", Some(&["m1".to_string()][..]))
        );
        s.remove_issuer(&issuer.id).await.unwrap();
        assert!(
            s.session_context(&live).await.is_err(),
            "a removed issuer ends its sessions"
        );
    }
}

#[tokio::test]
async fn audit_entries_are_per_tenant_and_newest_first() {
    use crate::audit::NewAudit;
    for db in testing::all().await {
        let s = TenantStore::new(&db);
        let a = s.create_tenant("audit-a").await.unwrap();
        let b = s.create_tenant("audit-b").await.unwrap();
        for (t, action) in [(&a, "key.create"), (&b, "key.create"), (&a, "key.revoke")] {
            s.audit(&NewAudit {
                tenant_id: Some(&t.id),
                actor: "admin",
                channel: "api",
                address: Some("10.0.0.1"),
                action,
                object: "key:k1",
                detail: json!({"name": "<b>x</b>"}),
            })
            .await
            .unwrap();
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        }
        let mine = s.audit_log(Some(&a.id), 10).await.unwrap();
        assert_eq!(
            mine.iter().map(|e| e.action.as_str()).collect::<Vec<_>>(),
            ["key.revoke", "key.create"]
        );
        assert_eq!(mine[0].detail["name"], "<b>x</b>");
        assert_eq!(s.audit_log(None, 10).await.unwrap().len(), 3);
        assert_eq!(s.audit_log(Some(&b.id), 10).await.unwrap().len(), 1);
    }
}

/// While the store does not answer, a key checked recently keeps working from the cache
/// (within the stale limit), an id known not to exist is refused without a query, and one
/// never seen gets a store error at once; with no stale limit the cache does not outlive
/// its freshness.
#[tokio::test]
async fn credentials_outlive_a_store_outage_and_unknown_ids_are_remembered() {
    let db = testing::sqlite().await;
    let s = TenantStore::new(&db);
    s.create_tenant("acme").await.unwrap();
    let k = s
        .create_key(
            "acme",
            &KeySpec {
                name: "k".into(),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let tenant = s.authenticate(&k.key).await.unwrap().tenant_id;
    let unknown = "hk_nosuchkeyid_secret";
    assert!(matches!(s.authenticate(unknown).await, Err(AuthError::Unknown)));
    s.age_cached_for_tests(KEY_CACHE_TTL + Duration::from_secs(1));
    db.pool.close().await;
    assert_eq!(s.authenticate(&k.key).await.unwrap().tenant_id, tenant);
    assert!(s.health.is_down());
    assert_eq!(s.health.stale_served(), 1);
    // The wrong secret for the cached id is still refused.
    let wrong = format!("{}_wrongsecret", k.key.rsplit_once('_').unwrap().0);
    assert!(s.authenticate(&wrong).await.is_err());
    // Remembered as unknown: no query (it would fail with a store error now).
    assert!(matches!(s.authenticate(unknown).await, Err(AuthError::Unknown)));
    assert!(matches!(
        s.authenticate("hk_nevermet_secret").await,
        Err(AuthError::Store(_))
    ));
    s.set_stale_limit(Duration::ZERO);
    assert!(matches!(s.authenticate(&k.key).await, Err(AuthError::Store(_))));
}

#[tokio::test]
async fn stored_responses_are_per_tenant_expire_and_respect_the_quota() {
    use crate::responses::{ResponseRetention, StoredResponse};
    for db in testing::all().await {
        let s = TenantStore::new(&db);
        let name = db.backend.as_str();
        let r = |id: &str, tenant: &str, at: i64| StoredResponse {
            id: id.into(),
            tenant_id: tenant.into(),
            created_at: at,
            expires_at: 0,
            response: format!("{{\"id\":\"{id}\"}}"),
            input_items: "[]".into(),
            output: "[]".into(),
            previous_id: None,
            key_id: None,
        };
        let keep = ResponseRetention {
            ttl_ms: 3_600_000,
            max_per_tenant: 2,
            ..Default::default()
        };
        let now = now_ms();
        assert_eq!(
            s.store_response(&r("resp_a", "t1", now - 2), keep)
                .await
                .unwrap()
                .dropped,
            0
        );
        s.store_response(&r("resp_b", "t1", now - 1), keep).await.unwrap();
        s.store_response(&r("resp_x", "t2", now), keep).await.unwrap();
        let got = s.stored_response("t1", "resp_a").await.unwrap().unwrap();
        assert_eq!(got.expires_at, now - 2 + 3_600_000, "{name}");
        assert_eq!(got.object().unwrap(), serde_json::json!({"id": "resp_a", "output": []}));
        assert!(
            s.stored_response("t2", "resp_a").await.unwrap().is_none(),
            "{name}: another tenant's"
        );
        // The third of t1's drops its oldest.
        let third = s.store_response(&r("resp_c", "t1", now), keep).await.unwrap();
        assert_eq!((third.dropped, third.count), (1, 2), "{name}");
        assert!(s.stored_response("t1", "resp_a").await.unwrap().is_none(), "{name}");
        assert_eq!(s.stored_response_count("t1").await.unwrap(), 2, "{name}");
        assert!(!s.delete_response("t2", "resp_b").await.unwrap(), "{name}");
        assert!(s.delete_response("t1", "resp_b").await.unwrap(), "{name}");
        assert!(s.stored_response("t1", "resp_b").await.unwrap().is_none(), "{name}");
        // Expired: invisible, then purged.
        let gone = ResponseRetention {
            ttl_ms: -1,
            max_per_tenant: 10,
            ..Default::default()
        };
        s.store_response(&r("resp_old", "t3", now), gone).await.unwrap();
        assert!(s.stored_response("t3", "resp_old").await.unwrap().is_none(), "{name}");
        assert!(s.purge_responses().await.unwrap() >= 1, "{name}");
        assert_eq!(s.stored_response_count("t3").await.unwrap(), 0, "{name}");
    }
}

/// Issue 78, finding 1: a chain of continuations stores each response's own items once
/// (bytes grow with the conversation, not with its square); the conversation is read back
/// by walking the chain, refused whole when too large or broken; continuing extends the
/// ancestors' lives; past the tenant's byte quota the least recently continued go first.
#[tokio::test]
async fn a_chain_of_responses_stores_each_item_once() {
    use crate::responses::{Conversation, ResponseRetention, StoredResponse};
    for db in testing::all().await {
        let s = TenantStore::new(&db);
        let name = db.backend.as_str();
        let tenant = format!("tn_chain{}", random_hex(4).unwrap());
        let item = "x".repeat(10_000);
        let retention = ResponseRetention {
            ttl_ms: 3_600_000,
            max_tenant_bytes: 200_000,
            ..Default::default()
        };
        let now = now_ms();
        let mut previous: Option<String> = None;
        let mut sizes = Vec::new();
        for i in 0..8 {
            let r = StoredResponse {
                id: format!("resp_{tenant}_{i}"),
                tenant_id: tenant.clone(),
                created_at: now + i,
                expires_at: 0,
                response: "{}".into(),
                input_items: serde_json::json!([{"id": format!("in{i}"), "text": item}]).to_string(),
                output: serde_json::json!([{"id": format!("out{i}")}]).to_string(),
                previous_id: previous.replace(format!("resp_{tenant}_{i}")),
                key_id: None,
            };
            let stored = s.store_response(&r, retention).await.unwrap();
            sizes.push(stored.bytes);
        }
        // Linear: each step adds about one item's bytes.
        let step = sizes[7] - sizes[6];
        assert!(step < 11_000 && sizes[7] < 8 * 11_000, "{name}: {sizes:?}");
        let last = format!("resp_{tenant}_7");
        let Conversation::Found(chain) = s.conversation(&tenant, &last, 1 << 20).await.unwrap() else {
            panic!("{name}: the chain is whole")
        };
        let ids: Vec<_> = chain.iter().map(|r| r.id.clone()).collect();
        assert_eq!(ids.len(), 8, "{name}");
        assert_eq!(ids[0], format!("resp_{tenant}_0"), "{name}: oldest first");
        assert!(matches!(
            s.conversation(&tenant, &last, 50_000).await.unwrap(),
            Conversation::TooLarge { bytes } if bytes > 80_000
        ));
        assert_eq!(
            s.conversation("tn_other", &last, 1 << 20).await.unwrap(),
            Conversation::NotFound,
            "{name}: another tenant's"
        );
        // Continuing extended the first response's life to the last one's.
        let first = s.stored_response(&tenant, &ids[0]).await.unwrap().unwrap();
        assert_eq!(first.expires_at, now + 7 + 3_600_000, "{name}");
        // A deleted middle response breaks the conversation: refused, not shortened.
        assert!(s.delete_response(&tenant, &ids[3]).await.unwrap());
        assert_eq!(
            s.conversation(&tenant, &last, 1 << 20).await.unwrap(),
            Conversation::Broken {
                missing: ids[3].clone()
            },
            "{name}"
        );
        // Past the byte quota: an unrelated new response's arrival drops the oldest chain's
        // responses, and the tenant stays within its bytes.
        let big = StoredResponse {
            id: format!("resp_{tenant}_big"),
            tenant_id: tenant.clone(),
            created_at: now + 100,
            expires_at: 0,
            response: "{}".into(),
            input_items: serde_json::json!(["y".repeat(150_000)]).to_string(),
            output: "[]".into(),
            previous_id: None,
            key_id: None,
        };
        let stored = s.store_response(&big, retention).await.unwrap();
        assert!(stored.dropped > 0 && stored.bytes <= 200_000, "{name}: {stored:?}");
        assert!(s.stored_response(&tenant, &big.id).await.unwrap().is_some(), "{name}");
    }
}

/// Issue 78, finding 5: concurrent uploads cannot pass the tenant's file quota together
/// (each checks and inserts under the tenant's row lock).
#[tokio::test]
async fn racing_uploads_stay_within_the_file_quota() {
    for db in testing::all().await {
        let mut s = TenantStore::new(&db);
        s.file_quota = 10_000_000;
        let s = std::sync::Arc::new(s);
        let name = db.backend.as_str();
        let t = s
            .create_tenant(&format!("files-{}", random_hex(4).unwrap()))
            .await
            .unwrap();
        s.add_file(&t.id, None, "batch", "base.jsonl", &vec![b'x'; 4_000_000])
            .await
            .unwrap();
        let uploads: Vec<_> = (0..5)
            .map(|i| {
                let (s, id) = (s.clone(), t.id.clone());
                tokio::spawn(async move {
                    s.add_file(&id, None, "batch", &format!("{i}.jsonl"), &vec![b'y'; 2_500_000])
                        .await
                        .is_ok()
                })
            })
            .collect();
        let mut stored = 0;
        for u in uploads {
            stored += usize::from(u.await.unwrap());
        }
        assert_eq!(stored, 2, "{name}: 4 MB + 2 × 2.5 MB fit in 10 MB, a third does not");
        assert!(s.file_bytes(&t.id).await.unwrap() <= 10_000_000, "{name}");
    }
}

/// Members: an invitation is accepted once, into the tenant and role it names; the member's
/// session reads its current role; removal ends its sessions at once; another tenant's
/// invitations and members stay apart.
#[tokio::test]
async fn members_are_invited_signed_in_and_removed_with_their_sessions() {
    use crate::members::{hash_password, verify_password, Role};
    use crate::sessions::SessionKind;
    for db in testing::all().await {
        let s = TenantStore::new(&db);
        let name = format!("team-{}", random_hex(4).unwrap());
        let t = s.create_tenant(&name).await.unwrap();
        let other = s.create_tenant(&format!("{name}-other")).await.unwrap();
        let (first, inv) = s
            .invite_member(&name, "Ada@Example.com", Role::Developer, "admin")
            .await
            .unwrap();
        assert_eq!(inv.email, "ada@example.com");
        // Inviting again replaces the open invitation: the first link stops working.
        let (token, _) = s
            .invite_member(&t.id, "ada@example.com", Role::Owner, "admin")
            .await
            .unwrap();
        assert!(s.invitation(&first).await.unwrap().is_none());
        assert_eq!(s.list_invitations(&t.id).await.unwrap().len(), 1);
        assert!(s.list_invitations(&other.id).await.unwrap().is_empty());
        let stored: String = sqlx::query_scalar("SELECT token_sha256 FROM member_invitations WHERE tenant_id = $1")
            .bind(&t.id)
            .fetch_one(&s.pool)
            .await
            .unwrap();
        assert_ne!(stored, token, "only the token's hash is stored");
        let hash = hash_password("a long enough password").unwrap();
        let m = s.accept_invitation(&token, &hash).await.unwrap().unwrap();
        assert_eq!((m.role, m.tenant_id.as_str()), (Role::Owner, t.id.as_str()));
        assert!(s.accept_invitation(&token, &hash).await.unwrap().is_none(), "used once");
        assert!(
            s.invite_member(&t.id, "ada@example.com", Role::Viewer, "admin")
                .await
                .is_err(),
            "already a member"
        );
        assert!(s.has_members(&t.id).await.unwrap());
        assert!(!s.has_members(&other.id).await.unwrap());
        let (found, h) = s.member_for_sign_in(&name, " ADA@example.com").await.unwrap().unwrap();
        assert_eq!(found, m);
        assert!(verify_password(h.as_deref(), "a long enough password"));
        assert!(s
            .member_for_sign_in(&other.name, "ada@example.com")
            .await
            .unwrap()
            .is_none());
        assert!(s
            .member_for_sign_in("no-such-tenant", "ada@example.com")
            .await
            .unwrap()
            .is_none());
        // A session reads the member's role as it is now; the last owner stays; a change
        // applies only to the role the caller saw.
        let kind = SessionKind::Member {
            tenant_id: t.id.clone(),
            member_id: m.id.clone(),
        };
        let (cookie, session) = s.create_session(kind, None, None).await.unwrap();
        assert_eq!(s.session_member(&session).await.unwrap().member.role, Role::Owner);
        let last = s.change_member(&m.id, Role::Owner, Some(Role::Viewer), false).await;
        assert!(matches!(last, Err(TenantError::Conflict(_))), "{last:?}");
        let (bo, _) = s
            .invite_member(&t.id, "bo@example.com", Role::Developer, "admin")
            .await
            .unwrap();
        let b = s.accept_invitation(&bo, &hash).await.unwrap().unwrap();
        let stale = s.change_member(&b.id, Role::Viewer, Some(Role::Owner), false).await;
        assert!(
            matches!(stale, Err(TenantError::Conflict(_))),
            "not the role the caller saw: {stale:?}"
        );
        s.change_member(&b.id, Role::Developer, Some(Role::Owner), false)
            .await
            .unwrap();
        s.change_member(&m.id, Role::Owner, Some(Role::Viewer), false)
            .await
            .unwrap();
        let now = s
            .session_member(&s.session(&cookie).await.unwrap().unwrap())
            .await
            .unwrap();
        assert_eq!(
            (now.member.role, now.ctx.key_id.as_str()),
            (Role::Viewer, format!("member:{}", m.id).as_str())
        );
        assert_eq!(s.owner_count(&t.id).await.unwrap(), 1);
        // Removal: the member, its sessions and the invitations it sent are gone in one step.
        let by_m = format!("member:{}:{}", m.id, m.email);
        s.invite_member(&t.id, "cy@example.com", Role::Viewer, &by_m)
            .await
            .unwrap();
        s.change_member(&m.id, Role::Viewer, None, false).await.unwrap();
        assert!(s.session(&cookie).await.unwrap().is_none());
        assert!(s.session_member(&session).await.is_err());
        assert!(s.member(&m.id).await.is_err());
        assert!(
            s.list_invitations(&t.id).await.unwrap().is_empty(),
            "its invitations went with it"
        );
        assert_eq!(s.list_members(&t.id).await.unwrap().len(), 1);
        let last = s.change_member(&b.id, Role::Owner, None, false).await;
        assert!(matches!(last, Err(TenantError::Conflict(_))), "the last owner stays");
    }
}

/// A minimal OpenID provider for the SSO tests: discovery, the JWKS of the RSA fixture and a
/// token endpoint answering with whatever ID token the test put in `next_token` (checking
/// that the code exchange carries the PKCE verifier and the client's credentials).
async fn fake_provider(next_token: Arc<Mutex<String>>) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let issuer = format!("http://{}", listener.local_addr().unwrap());
    let base = issuer.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut sock, _)) = listener.accept().await else {
                return;
            };
            let mut buf = vec![0u8; 16384];
            let n = sock.read(&mut buf).await.unwrap_or(0);
            let req = String::from_utf8_lossy(&buf[..n]).to_string();
            let body = if req.starts_with("GET /.well-known/openid-configuration") {
                json!({
                    "issuer": base, "authorization_endpoint": format!("{base}/auth"),
                    "token_endpoint": format!("{base}/token"), "jwks_uri": format!("{base}/jwks"),
                    "id_token_signing_alg_values_supported": ["RS256"],
                })
                .to_string()
            } else if req.starts_with("GET /jwks") {
                RSA_JWKS.to_string()
            } else if req.starts_with("POST /token")
                && req.contains("code_verifier=")
                && req.to_ascii_lowercase().contains("authorization: basic ")
            {
                json!({"id_token": next_token.lock().unwrap().clone(), "token_type": "Bearer"}).to_string()
            } else {
                json!({"error": "invalid_request"}).to_string()
            };
            let resp = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = sock.write_all(resp.as_bytes()).await;
        }
    });
    issuer
}

fn id_token(alg: Algorithm, key: &EncodingKey, claims: serde_json::Value) -> String {
    let mut h = Header::new(alg);
    h.kid = Some("test-rsa-1".into());
    encode(&h, &claims, key).unwrap()
}

/// OpenID Connect sign-in: the code exchange yields the identity of a good ID token; a bad
/// signature, another audience or issuer, an expired token, another sign-in's nonce, a
/// replayed nonce, HS256 keyed with the public key (alg swapped) or an algorithm the issuer
/// does not list are refused. The identity becomes the invited member, then the linked one;
/// strangers and unverified addresses are nobody; removal ends it.
#[tokio::test]
async fn sso_sign_in_verifies_id_tokens_and_finds_members() {
    use crate::members::Role;
    use crate::sso::{SsoError, SsoSpec};
    let next = Arc::new(Mutex::new(String::new()));
    let issuer = fake_provider(next.clone()).await;
    let rs = EncodingKey::from_rsa_pem(RSA_PRIVATE.as_bytes()).unwrap();
    let now = now_ms() / 1000;
    let claims = |nonce: &str, sub: &str, email: &str| {
        json!({"iss": issuer, "aud": "hearth", "sub": sub, "exp": now + 300, "iat": now,
               "nonce": nonce, "email": email, "email_verified": true})
    };
    for db in testing::all().await {
        let s = TenantStore::new(&db);
        let name = format!("sso-{}", random_hex(4).unwrap());
        let t = s.create_tenant(&name).await.unwrap();
        assert!(s.sso(&name).await.unwrap().is_none());
        let bad = SsoSpec {
            issuer: "http://idp.example.com".into(),
            client_id: "hearth".into(),
            client_secret: None,
        };
        assert!(
            s.set_sso(&name, &bad).await.is_err(),
            "plain http only to a loopback host"
        );
        let spec = SsoSpec {
            issuer: issuer.clone(),
            client_id: "hearth".into(),
            client_secret: Some("client secret".into()),
        };
        let p = s.set_sso(&name, &spec).await.unwrap();
        assert!(p.has_client_secret);
        let (_, stored) = s.sso_spec(&t.id).await.unwrap().unwrap();
        assert_eq!(stored.client_secret.as_deref(), Some("client secret"));

        let sign_in = |token: String, nonce: &'static str| {
            *next.lock().unwrap() = token;
            let (s, spec) = (&s, &spec);
            async move { s.complete_sso(spec, "code", "verifier", "http://gw/cb", nonce).await }
        };
        // A good token, then the same token again (its nonce is spent).
        let good = id_token(Algorithm::RS256, &rs, claims("n1", "ada-sub", "Ada@Example.com"));
        let who = sign_in(good.clone(), "n1").await.unwrap();
        assert_eq!(who.subject, "ada-sub");
        assert_eq!(who.verified_email.as_deref(), Some("ada@example.com"));
        let replay = sign_in(good, "n1").await.unwrap_err();
        assert!(replay.to_string().contains("used before"), "{replay}");
        // Each attack, with its own nonce so that only the attack is wrong.
        let other_sig = id_token(Algorithm::RS256, &rs, claims("x", "mallory", "m@example.com"));
        let tampered = id_token(Algorithm::RS256, &rs, claims("t", "ada-sub", "ada@example.com"));
        let tampered = format!(
            "{}.{}",
            tampered.rsplit_once('.').unwrap().0,
            other_sig.rsplit_once('.').unwrap().1
        );
        let with = |nonce: &str, field: &str, v: serde_json::Value| {
            let mut c = claims(nonce, "ada-sub", "ada@example.com");
            c[field] = v;
            id_token(Algorithm::RS256, &rs, c)
        };
        let hs = EncodingKey::from_secret(RSA_PUBLIC.as_bytes()).unwrap();
        let cases: Vec<(&str, String, &'static str)> = vec![
            ("bad signature", tampered, "t"),
            ("wrong audience", with("a", "aud", json!("someone-else")), "a"),
            ("expired", with("e", "exp", json!(now - 3600)), "e"),
            (
                "another issuer",
                with("i", "iss", json!("https://evil.example.com")),
                "i",
            ),
            ("another client (azp)", with("z", "azp", json!("someone-else")), "z"),
            (
                "another sign-in's nonce",
                id_token(Algorithm::RS256, &rs, claims("theirs", "ada-sub", "a@b.c")),
                "mine",
            ),
            (
                "alg swapped to HS256 keyed with the public key",
                id_token(Algorithm::HS256, &hs, claims("h", "ada-sub", "ada@example.com")),
                "h",
            ),
            (
                "an algorithm the issuer does not list",
                id_token(Algorithm::RS384, &rs, claims("r", "ada-sub", "a@b.c")),
                "r",
            ),
        ];
        for (what, token, n) in cases {
            match sign_in(token, n).await {
                Err(SsoError::Refused(m)) => {
                    let why = match what {
                        "bad signature" => "signature does not verify",
                        "wrong audience" => "issued to another client",
                        "expired" => "has expired",
                        "another issuer" => "comes from another issuer",
                        "another client (azp)" => "another client (azp)",
                        "another sign-in's nonce" => "nonce is not this sign-in's",
                        _ => "is not one the provider signs with",
                    };
                    assert!(m.contains(why), "{what}: {m}")
                }
                other => panic!("{what}: {other:?}"),
            }
        }

        // Who the identity is: nobody until invited; the invitation is taken by the
        // provider's verified address; later sign-ins find the member by its subject.
        assert!(s.sso_member(&t.id, &who).await.unwrap().is_none(), "not invited");
        s.invite_member(&t.id, "ada@example.com", Role::Owner, "admin")
            .await
            .unwrap();
        let (m, how) = s.sso_member(&t.id, &who).await.unwrap().unwrap();
        assert_eq!(
            (m.role, m.has_password, how),
            (Role::Owner, false, crate::sso::SsoMatch::Joined)
        );
        assert!(
            s.open_invitation(&t.id, "ada@example.com").await.unwrap().is_none(),
            "taken"
        );
        let renamed = crate::sso::Identity {
            verified_email: Some("ada.new@example.com".into()),
            ..who.clone()
        };
        let (again, how) = s.sso_member(&t.id, &renamed).await.unwrap().unwrap();
        assert_eq!(
            (again.id, how),
            (m.id.clone(), crate::sso::SsoMatch::Linked),
            "by subject"
        );
        // An unverified address links nobody; an existing member is linked by address once.
        s.invite_member(&t.id, "bob@example.com", Role::Viewer, "admin")
            .await
            .unwrap();
        let unverified = crate::sso::Identity {
            issuer: issuer.clone(),
            subject: "bob-sub".into(),
            verified_email: None,
        };
        assert!(s.sso_member(&t.id, &unverified).await.unwrap().is_none());
        let bob = crate::sso::Identity {
            verified_email: Some("bob@example.com".into()),
            ..unverified
        };
        let (b, how) = s.sso_member(&t.id, &bob).await.unwrap().unwrap();
        assert_eq!((b.role, how), (Role::Viewer, crate::sso::SsoMatch::Joined));
        // A member that already exists (with a password) is linked by its verified address;
        // after the tenant changes providers, the address links it to the new one once.
        let (cy_token, _) = s
            .invite_member(&t.id, "cy@example.com", Role::Developer, "admin")
            .await
            .unwrap();
        s.accept_invitation(&cy_token, "phc").await.unwrap().unwrap();
        let cy = crate::sso::Identity {
            issuer: issuer.clone(),
            subject: "cy-sub".into(),
            verified_email: Some("cy@example.com".into()),
        };
        assert_eq!(
            s.sso_member(&t.id, &cy).await.unwrap().unwrap().1,
            crate::sso::SsoMatch::LinkedNow
        );
        let cy_elsewhere = crate::sso::Identity {
            issuer: "https://new-idp.example".into(),
            subject: "cy-new".into(),
            ..cy.clone()
        };
        assert_eq!(
            s.sso_member(&t.id, &cy_elsewhere).await.unwrap().unwrap().1,
            crate::sso::SsoMatch::LinkedNow,
            "relinked at the tenant's new provider"
        );
        let impostor = crate::sso::Identity {
            subject: "mallory-sub".into(),
            ..bob.clone()
        };
        assert!(
            s.sso_member(&t.id, &impostor).await.unwrap().is_none(),
            "an address already linked to another subject links no one else"
        );
        s.change_member(&b.id, Role::Viewer, None, true).await.unwrap();
        assert!(s.sso_member(&t.id, &bob).await.unwrap().is_none(), "removed");
        s.remove_sso(&name).await.unwrap();
        assert!(s.sso(&name).await.unwrap().is_none());

        // `hearth admin login`'s one-time codes: bound to the CLI's challenge, one try.
        let pkce = crate::sso::Pkce::new().unwrap();
        let code = s.create_cli_grant("ops@example.com", &pkce.challenge).await.unwrap();
        assert_eq!(s.take_cli_grant(&code, "not the verifier").await.unwrap(), None);
        assert_eq!(
            s.take_cli_grant(&code, &pkce.verifier).await.unwrap(),
            None,
            "spent by the wrong try"
        );
        let code = s.create_cli_grant("ops@example.com", &pkce.challenge).await.unwrap();
        assert_eq!(
            s.take_cli_grant(&code, &pkce.verifier).await.unwrap().as_deref(),
            Some("ops@example.com")
        );
        assert_eq!(s.take_cli_grant(&code, &pkce.verifier).await.unwrap(), None, "once");
    }
}

/// A suspended tenant's API keys, JWTs and members are refused (as suspended, not as bad
/// credentials); resuming restores them; other tenants are untouched.
#[tokio::test]
async fn suspended_tenants_are_refused_until_resumed() {
    use crate::members::{hash_password, Role};
    for db in testing::all().await {
        let s = TenantStore::new(&db);
        let t = s.create_tenant("paused").await.unwrap();
        s.create_tenant("running").await.unwrap();
        let key = s.create_key("paused", &KeySpec::default()).await.unwrap().key;
        let other = s.create_key("running", &KeySpec::default()).await.unwrap().key;
        s.add_issuer(
            "paused",
            &IssuerSpec {
                issuer: "https://paused.example".into(),
                audience: "hearth".into(),
                algorithm: "HS256".into(),
                key: Some(HS_SECRET.into()),
                ..Default::default()
            },
        )
        .await
        .unwrap();
        let jwt = encode(
            &Header::new(Algorithm::HS256),
            &json!({"iss": "https://paused.example", "aud": "hearth", "sub": "u", "exp": now_ms() / 1000 + 300}),
            &EncodingKey::from_secret(HS_SECRET.as_bytes()).unwrap(),
        )
        .unwrap();
        let (token, _) = s
            .invite_member("paused", "ada@example.com", Role::Owner, "admin")
            .await
            .unwrap();
        let m = s
            .accept_invitation(&token, &hash_password("a long enough password").unwrap())
            .await
            .unwrap()
            .unwrap();
        assert!(s.authenticate(&key).await.is_ok());
        assert!(s.authenticate(&key).await.is_ok(), "cached");

        let suspended = s.set_suspended("paused", true).await.unwrap();
        assert!(suspended.suspended_at.is_some());
        assert!(matches!(s.authenticate(&key).await, Err(AuthError::Suspended(n)) if n == "paused"));
        assert!(matches!(s.authenticate(&jwt).await, Err(AuthError::Suspended(_))));
        assert!(matches!(
            s.member_context(&m.id, &t.id, now_ms() + 1000).await,
            Err(AuthError::Suspended(_))
        ));
        assert!(s.authenticate(&other).await.is_ok(), "another tenant");
        let again = s.set_suspended("paused", true).await.unwrap();
        assert_eq!(
            again.suspended_at, suspended.suspended_at,
            "suspending twice keeps the first time"
        );

        assert_eq!(s.set_suspended(&t.id, false).await.unwrap().suspended_at, None);
        assert!(s.authenticate(&key).await.is_ok());
        assert!(s.authenticate(&jwt).await.is_ok());
        assert!(s.member_context(&m.id, &t.id, now_ms() + 1000).await.is_ok());
    }
}

/// An HMAC ID token is refused even if a provider's document lists HS256: the public key
/// must never serve as an HMAC secret.
#[test]
fn hmac_id_tokens_are_refused_even_when_listed() {
    use jsonwebtoken::DecodingKey;
    let hs = EncodingKey::from_secret(RSA_PUBLIC.as_bytes()).unwrap();
    let claims = json!({"iss": "https://idp", "aud": "hearth", "sub": "s", "exp": now_ms() / 1000 + 60, "nonce": "n"});
    let token = id_token(Algorithm::HS256, &hs, claims);
    let keys = vec![(
        Some("test-rsa-1".to_string()),
        DecodingKey::from_rsa_pem(RSA_PUBLIC.as_bytes()).unwrap(),
    )];
    let listed = [Algorithm::RS256, Algorithm::HS256];
    let e = crate::sso::verify_id_token(&token, &keys, &listed, "https://idp", "hearth", "n").unwrap_err();
    assert!(e.to_string().contains("not one the provider signs with"), "{e}");
}

/// Adapter versions per name, the latest found for `BASE:NAME`, private to their tenant;
/// the quotas count each distinct upload once; deleting says whether the files are shared.
#[tokio::test]
async fn adapters_are_versioned_private_and_bounded() {
    use crate::adapters::AdapterSpec;
    for db in testing::all().await {
        let mut s = TenantStore::new(&db);
        s.adapter_quota = 1_000;
        s.adapter_count_quota = 4;
        let a = s.create_tenant("tuner").await.unwrap();
        let b = s.create_tenant("other").await.unwrap();
        let spec = |name: &str, digest: &str, size: i64| AdapterSpec {
            name: name.into(),
            base_model: "base".into(),
            digest: digest.repeat(64),
            format: "peft".into(),
            rank: Some(8),
            size,
        };
        let v1 = s.add_adapter("tuner", &spec("style", "a", 600)).await.unwrap();
        let v2 = s.add_adapter("tuner", &spec("style", "b", 300)).await.unwrap();
        assert_eq!((v1.version, v2.version), (1, 2));
        assert_eq!(v2.store_path(), "b".repeat(64));
        let found = s.find_adapter(&a.id, "base", "style").await.unwrap().unwrap();
        assert_eq!(found.id, v2.id, "the latest version");
        assert!(s.find_adapter(&a.id, "other-base", "style").await.unwrap().is_none());
        assert!(
            s.find_adapter(&b.id, "base", "style").await.unwrap().is_none(),
            "private"
        );
        // Bytes: 900 used; the same files again cost nothing, new ones past 1,000 are refused.
        s.add_adapter("tuner", &spec("again", "a", 600)).await.unwrap();
        assert!(matches!(
            s.add_adapter("tuner", &spec("big", "c", 200)).await,
            Err(TenantError::Invalid { field: "file", .. })
        ));
        // Another tenant's quota is its own; the same files are shared.
        s.add_adapter("other", &spec("mine", "a", 600)).await.unwrap();
        assert!(matches!(
            s.add_adapter("tuner", &spec("bad name!", "a", 600)).await,
            Err(TenantError::InvalidName(_))
        ));
        // Versions: 3 of 4 kept; one more, then refused.
        s.add_adapter("tuner", &spec("fourth", "b", 300)).await.unwrap();
        assert!(matches!(
            s.add_adapter("tuner", &spec("fifth", "b", 300)).await,
            Err(TenantError::Invalid { field: "file", .. })
        ));
        assert_eq!(s.list_adapters("tuner").await.unwrap().len(), 4);
        // Deleting: files "a" stay in use (another row of this tenant, and tenant b's).
        let (gone, shared) = s.delete_adapter(&v1.id).await.unwrap();
        assert_eq!((gone.id.as_str(), shared), (v1.id.as_str(), true));
        let fourth = s.find_adapter(&a.id, "base", "fourth").await.unwrap().unwrap();
        s.delete_adapter(&fourth.id).await.unwrap();
        let (_, shared) = s.delete_adapter(&v2.id).await.unwrap();
        assert!(!shared, "nothing uses files b any more");
        assert!(matches!(s.adapter(&v2.id).await, Err(TenantError::NoSuchAdapter(_))));
    }
}

/// Files and batches: privacy, claims that never overlap (two gateways at once), leases that
/// run out, lines sent back under a new request id, and a batch finished once with its
/// output and error files.
#[tokio::test]
async fn batches_claim_once_and_finish_once() {
    use crate::batches::{status, LineResult, NewLine, Page};
    for db in testing::all().await {
        let s = TenantStore::new(&db);
        let name = db.backend.as_str();
        let a = s.create_tenant("batch-a").await.unwrap();
        let b = s.create_tenant("batch-b").await.unwrap();
        let f = s.add_file(&a.id, None, "batch", "in.jsonl", b"{}\n").await.unwrap();
        assert_eq!(f.bytes, 3);
        assert_eq!(
            s.file_content(&a.id, &f.id).await.unwrap().1,
            b"{}\n".to_vec(),
            "{name}"
        );
        // Another tenant's file is missing, not forbidden.
        assert!(
            matches!(s.file(&b.id, &f.id).await, Err(TenantError::NoSuchFile(_))),
            "{name}"
        );
        assert!(matches!(
            s.delete_file(&b.id, &f.id).await,
            Err(TenantError::NoSuchFile(_))
        ));
        let mut lines: Vec<NewLine> = (0..6)
            .map(|i| NewLine::Request {
                custom_id: format!("c{i}"),
                body: "{}".into(),
            })
            .collect();
        lines.push(NewLine::Refused {
            custom_id: None,
            code: "invalid_json",
            message: "not JSON".into(),
        });
        let batch = s
            .create_batch(&a.id, "k1", "/v1/chat/completions", &f.id, None, &lines)
            .await
            .unwrap();
        assert_eq!((batch.counts.total, batch.counts.failed), (7, 1), "{name}");
        assert!(matches!(
            s.batch(&b.id, &batch.id).await,
            Err(TenantError::NoSuchBatch(_))
        ));
        assert!(s
            .list_batches(&b.id, None, &Page { after: None, limit: 10 })
            .await
            .unwrap()
            .is_empty());
        // Two owners claim at once: each line goes to one of them.
        let far = now_ms() + 60_000;
        tokio::time::sleep(std::time::Duration::from_millis(2)).await; // listings order by time
        let race = s
            .create_batch(&a.id, "k1", "/v1/chat/completions", &f.id, None, &lines[..6])
            .await
            .unwrap();
        let (p, q) = tokio::join!(
            s.claim_lines(&race.id, "gw-p", 4, far),
            s.claim_lines(&race.id, "gw-q", 4, far)
        );
        let (mut p, q) = (p.unwrap(), q.unwrap());
        p.extend(s.claim_lines(&race.id, "gw-p", 10, far).await.unwrap());
        let mut ids: Vec<i64> = p.iter().chain(&q).map(|l| l.line).collect();
        ids.sort();
        ids.dedup();
        assert_eq!(
            (ids.len(), p.len() + q.len()),
            (6, 6),
            "{name}: a line claimed twice or not at all"
        );
        s.cancel_batch(&a.id, &race.id).await.unwrap();
        let x = s.claim_lines(&batch.id, "gw-x", 3, far).await.unwrap();
        let y = s.claim_lines(&batch.id, "gw-y", 10, far).await.unwrap();
        assert_eq!((x.len(), y.len()), (3, 3), "{name}");
        let done = |code: i64| LineResult {
            status_code: Some(code),
            result: format!("{{\"status\":{code}}}"),
        };
        // Only the owner's result counts.
        assert!(!s.finish_line(&x[0], "gw-y", &done(200)).await.unwrap(), "{name}");
        assert!(s.finish_line(&x[0], "gw-x", &done(200)).await.unwrap());
        assert!(s.finish_line(&x[1], "gw-x", &done(400)).await.unwrap());
        // Sent back: waits, then runs under a new request id.
        let back = x[2].clone();
        s.release_line(&back, "gw-x", now_ms() - 1).await.unwrap();
        // gw-y dies: its leases run out and gw-x takes its lines, same request ids.
        for l in &y {
            assert!(s.renew_lease(l, "gw-y", now_ms() - 1).await.unwrap(), "{name}");
        }
        assert!(
            !s.renew_lease(&x[0], "gw-y", far).await.unwrap(),
            "{name}: not gw-y's line"
        );
        assert!(
            s.finish_batch(&batch.id).await.unwrap().is_none(),
            "{name}: lines still to run"
        );
        let again = s.claim_lines(&batch.id, "gw-x", 10, far).await.unwrap();
        let rerun = again.iter().find(|l| l.line == back.line).unwrap();
        assert_eq!(rerun.attempt, 1, "{name}");
        assert_ne!(rerun.request_id(), back.request_id());
        for l in &again {
            if let Some(old) = y.iter().find(|o| o.line == l.line) {
                assert_eq!(
                    old.request_id(),
                    l.request_id(),
                    "{name}: a dead owner's line keeps its id"
                );
            }
        }
        // The dead owner's late result is refused.
        if let Some(late) = y.first() {
            assert!(!s.finish_line(late, "gw-y", &done(200)).await.unwrap(), "{name}");
        }
        for l in &again {
            s.finish_line(l, "gw-x", &done(200)).await.unwrap();
        }
        let fin = s.finish_batch(&batch.id).await.unwrap().expect("finished");
        assert_eq!(fin.status, status::COMPLETED, "{name}");
        assert_eq!((fin.counts.completed, fin.counts.failed), (5, 2), "{name}");
        assert!(
            s.finish_batch(&batch.id).await.unwrap().is_none(),
            "{name}: finished once"
        );
        let out = s
            .file_content(&a.id, fin.output_file_id.as_ref().unwrap())
            .await
            .unwrap()
            .1;
        assert_eq!(String::from_utf8(out).unwrap().lines().count(), 5, "{name}");
        let err = s
            .file_content(&a.id, fin.error_file_id.as_ref().unwrap())
            .await
            .unwrap()
            .1;
        let err = String::from_utf8(err).unwrap();
        assert_eq!(err.lines().count(), 2, "{name}");
        assert!(err.contains("invalid_json"), "{name}");
        // Cancelling: nothing claimed any more, unrun lines in the error file.
        tokio::time::sleep(std::time::Duration::from_millis(2)).await; // listings order by time
        let c = s
            .create_batch(&a.id, "k1", "/v1/chat/completions", &f.id, None, &lines[..3])
            .await
            .unwrap();
        assert_eq!(s.cancel_batch(&a.id, &c.id).await.unwrap().status, status::CANCELLING);
        assert!(
            s.claim_lines(&c.id, "gw-x", 10, far).await.unwrap().is_empty(),
            "{name}"
        );
        let fin = s.finish_batch(&c.id).await.unwrap().expect("cancelled");
        assert_eq!(fin.status, status::CANCELLED, "{name}");
        let err = s
            .file_content(&a.id, fin.error_file_id.as_ref().unwrap())
            .await
            .unwrap()
            .1;
        assert_eq!(
            String::from_utf8(err).unwrap().matches("batch_cancelled").count(),
            3,
            "{name}"
        );
        assert!(matches!(
            s.cancel_batch(&a.id, &batch.id).await,
            Err(TenantError::Conflict(_))
        ));
        // Past its window: nothing claimed, unrun lines in the error file as expired.
        tokio::time::sleep(std::time::Duration::from_millis(2)).await; // listings order by time
        let e = s
            .create_batch(&a.id, "k1", "/v1/chat/completions", &f.id, None, &lines[..2])
            .await
            .unwrap();
        let one = s.claim_lines(&e.id, "gw-x", 1, far).await.unwrap();
        sqlx::query("UPDATE batches SET expires_at = 1 WHERE id = $1")
            .bind(&e.id)
            .execute(s.pool())
            .await
            .unwrap();
        assert!(
            s.claim_lines(&e.id, "gw-x", 10, far).await.unwrap().is_empty(),
            "{name}"
        );
        assert!(
            s.finish_batch(&e.id).await.unwrap().is_none(),
            "{name}: a line still runs"
        );
        assert!(s.finish_line(&one[0], "gw-x", &done(200)).await.unwrap());
        let fin = s.finish_batch(&e.id).await.unwrap().expect("expired");
        assert_eq!(
            (fin.status.as_str(), fin.counts.completed),
            (status::EXPIRED, 1),
            "{name}"
        );
        let err = s
            .file_content(&a.id, fin.error_file_id.as_ref().unwrap())
            .await
            .unwrap()
            .1;
        assert_eq!(
            String::from_utf8(err).unwrap().matches("batch_expired").count(),
            1,
            "{name}"
        );
        // Listing: newest first, paged.
        let all = s
            .list_batches(&a.id, None, &Page { after: None, limit: 10 })
            .await
            .unwrap();
        assert_eq!(
            all.iter().map(|b| b.id.as_str()).collect::<Vec<_>>(),
            [e.id.as_str(), c.id.as_str(), race.id.as_str(), batch.id.as_str()]
        );
        let rest = s
            .list_batches(
                &a.id,
                None,
                &Page {
                    after: Some(c.id.clone()),
                    limit: 10,
                },
            )
            .await
            .unwrap();
        assert_eq!(rest.len(), 2, "{name}");
        let outputs = s
            .list_files(&a.id, None, Some("batch_output"), &Page { after: None, limit: 10 })
            .await
            .unwrap();
        assert_eq!(outputs.len(), 5, "{name}");
    }
}

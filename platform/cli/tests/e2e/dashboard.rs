//! The dashboard over HTTP against a real `hearth serve`: sign-in and its cookies, CSRF,
//! the security headers, usage numbers equal to the API's `usage`, key creation and
//! revocation (the revoked key gets 401, and a session opened with a revoked key ends),
//! tenant isolation, escaping of tenant-supplied names, the audit log from the API, the
//! dashboard and the CLI, and the Parquet export's types. (The browser test,
//! `scripts/dashboard-check`, drives the same pages in headless Chromium.)

use crate::harness::*;
use reqwest::header::{HeaderMap, LOCATION, SET_COOKIE};
use reqwest::redirect::Policy;
use serde_json::{json, Value};

fn browser() -> reqwest::Client {
    reqwest::Client::builder()
        .redirect(Policy::none())
        .timeout(std::time::Duration::from_secs(60))
        .build()
        .unwrap()
}

fn cookie_value(h: &HeaderMap, name: &str) -> Option<(String, String)> {
    h.get_all(SET_COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .find(|v| v.starts_with(&format!("{name}=")))
        .map(|v| {
            let value = v.split(';').next().unwrap()[name.len() + 1..].to_string();
            (value, v.to_string())
        })
}

/// The value of `<input … name="NAME" value="…">` or `<meta name="NAME" content="…">`.
fn field(html: &str, name: &str) -> String {
    let i = html
        .find(&format!("name=\"{name}\""))
        .unwrap_or_else(|| panic!("{name} in page"));
    let rest = &html[i..];
    let v = rest.find("value=\"").or_else(|| rest.find("content=\"")).unwrap();
    let rest = &rest[v..];
    let start = rest.find('"').unwrap() + 1;
    let end = rest[start..].find('"').unwrap();
    rest[start..start + end].to_string()
}

/// The text of the element with `id="ID"`.
fn by_id(html: &str, id: &str) -> String {
    let i = html
        .find(&format!("id=\"{id}\""))
        .unwrap_or_else(|| panic!("#{id} in page"));
    let rest = &html[i..];
    let start = rest.find('>').unwrap() + 1;
    let end = rest[start..].find('<').unwrap();
    rest[start..start + end].trim().to_string()
}

/// `(action, channel)` of each audit entry in `entries` (a JSON array).
fn actions_and_channels(entries: &Value) -> Vec<(&str, &str)> {
    entries
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["action"].as_str().unwrap(), e["channel"].as_str().unwrap()))
        .collect()
}

struct Session {
    cookie: String,
    csrf: String,
}

/// Signs in through the form; returns the session cookie and the page's CSRF token.
async fn sign_in(base: &str, credential: &str) -> Result<Session, (u16, String)> {
    sign_in_from(base, base, credential).await
}

/// [`sign_in`] from a page of `origin` (the `Origin` header the browser sends).
async fn sign_in_from(base: &str, origin: &str, credential: &str) -> Result<Session, (u16, String)> {
    let url = format!("{base}/dashboard/login");
    submit_signed_form(base, origin, &url, &[("credential", credential)]).await
}

/// A member's sign-in through the form.
async fn member_sign_in(base: &str, tenant: &str, email: &str, password: &str) -> Result<Session, (u16, String)> {
    let url = format!("{base}/dashboard/login");
    let form = [("tenant", tenant), ("email", email), ("password", password)];
    submit_signed_form(base, base, &url, &form).await
}

/// Opens an invitation link and joins with `password` (typed twice as `confirm`).
async fn accept(base: &str, link: &str, password: &str, confirm: &str) -> Result<Session, (u16, String)> {
    submit_signed_form(base, base, link, &[("password", password), ("confirm", confirm)]).await
}

/// GETs a form posted before there is a session (sign-in, invitation), posts `fields` with
/// its token and cookie, and on 303 returns the session it opened.
async fn submit_signed_form(
    base: &str,
    origin: &str,
    url: &str,
    fields: &[(&str, &str)],
) -> Result<Session, (u16, String)> {
    let c = browser();
    let form = c.get(url).send().await.unwrap();
    if form.status() != 200 {
        return Err((form.status().as_u16(), form.text().await.unwrap()));
    }
    assert_eq!(form.status(), 200);
    let (login, attrs) = cookie_value(form.headers(), "hearth_login").expect("login cookie");
    assert!(
        attrs.contains("HttpOnly") && attrs.contains("SameSite=Strict"),
        "{attrs}"
    );
    let html = form.text().await.unwrap();
    let nonce = field(&html, "login_csrf");
    let mut fields = fields.to_vec();
    fields.push(("login_csrf", &nonce));
    let resp = c
        .post(url)
        .header("cookie", format!("hearth_login={login}"))
        .header("origin", origin)
        .form(&fields)
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    if status != 303 {
        return Err((status, resp.text().await.unwrap()));
    }
    let (cookie, attrs) = cookie_value(resp.headers(), "hearth_session").expect("session cookie");
    for a in ["HttpOnly", "SameSite=Strict", "Path=/dashboard"] {
        assert!(attrs.contains(a), "{attrs}");
    }
    assert_eq!(
        attrs.contains("Secure"),
        origin.starts_with("https://"),
        "Secure exactly when the public origin is https ({attrs})"
    );
    let page = c
        .get(format!("{base}/dashboard"))
        .header("cookie", format!("hearth_session={cookie}"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    Ok(Session {
        csrf: field(&page, "csrf-token"),
        cookie,
    })
}

async fn page(base: &str, s: &Session, path: &str) -> (u16, String) {
    let r = browser()
        .get(format!("{base}{path}"))
        .header("cookie", format!("hearth_session={}", s.cookie))
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

async fn post_form(base: &str, s: &Session, path: &str, form: &[(&str, &str)]) -> reqwest::Response {
    browser()
        .post(format!("{base}{path}"))
        .header("cookie", format!("hearth_session={}", s.cookie))
        .header("origin", base)
        .form(form)
        .send()
        .await
        .unwrap()
}

#[tokio::test]
async fn dashboard_sessions_usage_keys_isolation_and_audit() {
    let data = temp_dir("dashboard");
    let server = serve(&data);
    let base = server.url.clone();
    let key_a = new_key(&data, "acme");
    let odd = "<img src=x onerror=alert(1)>";
    let key_b = new_key(&data, odd);
    admin(&data, &TEST_PRICE);

    // The root and unauthenticated pages lead to the sign-in form.
    let r = browser().get(format!("{base}/")).send().await.unwrap();
    assert_eq!(r.headers()[LOCATION], "/dashboard");
    let r = browser().get(format!("{base}/dashboard")).send().await.unwrap();
    assert_eq!(
        (r.status().as_u16(), r.headers()[LOCATION].to_str().unwrap()),
        (303, "/dashboard/login")
    );
    let r = browser().get(format!("{base}/dashboard/login")).send().await.unwrap();
    let csp = r.headers()["content-security-policy"].to_str().unwrap().to_string();
    for d in ["default-src 'none'", "script-src 'self'", "frame-ancestors 'none'"] {
        assert!(csp.contains(d), "{csp}");
    }
    assert!(!csp.contains("unsafe-inline"));
    assert_eq!(r.headers()["x-frame-options"], "DENY");
    assert_eq!(r.headers()["cache-control"], "no-store");

    // Sign-in: a wrong credential, a missing login token, another site's form, no manage scope.
    assert_eq!(sign_in(&base, "hk_nope_nope").await.err().unwrap().0, 401);
    let r = browser()
        .post(format!("{base}/dashboard/login"))
        .form(&[("credential", key_a.as_str()), ("login_csrf", "x")])
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403, "no login cookie");
    let inference_only = {
        let out = admin(
            &data,
            &["--json", "key", "create", "--tenant", "acme", "--scopes", "inference"],
        );
        serde_json::from_str::<Value>(&out).unwrap()["key"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let (status, html) = sign_in(&base, &inference_only).await.err().unwrap();
    assert_eq!(status, 403);
    assert!(
        html.contains("lacks the &#x27;manage&#x27; scope") || html.contains("lacks the 'manage' scope"),
        "{html}"
    );

    // Traffic for tenant A; the dashboard's totals are the sum of the API's usage.
    let url = format!("{base}/v1/chat/completions");
    let mut want = (0u64, 0u64, 0u64, 0u64);
    for i in 0..3 {
        let body = chat_body(
            json!({"max_tokens": 6, "messages": [{"role": "user", "content": format!("Say a colour. #{i}")}]}),
        );
        let (status, _, v) = post(&url, Some(&key_a), &body).await;
        assert_eq!(status, 200, "{v}");
        let u = &v["usage"];
        want.0 += 1;
        want.1 += u["prompt_tokens"].as_u64().unwrap();
        want.2 += u["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
        want.3 += u["completion_tokens"].as_u64().unwrap();
    }
    let a = sign_in(&base, &key_a).await.unwrap();
    let (status, html) = page(&base, &a, "/dashboard").await;
    assert_eq!(status, 200);
    let num = |id: &str| by_id(&html, id).parse::<u64>().unwrap();
    assert_eq!(
        (
            num("total-requests"),
            num("total-input"),
            num("total-cached"),
            num("total-output")
        ),
        want,
        "dashboard totals = the API's usage"
    );
    assert_eq!(num("total-uncached"), want.1 - want.2);
    assert!(html.contains("<svg id=\"tokens-chart\""));
    let (_, reqs) = page(&base, &a, "/dashboard/requests").await;
    assert_eq!(reqs.matches("<td><code>req_").count(), 3);

    // A new key: CSRF refused without the token or from another origin; shown once; works.
    let create = [
        ("name", "from-dashboard"),
        ("scope_inference", "on"),
        ("csrf", a.csrf.as_str()),
    ];
    assert_eq!(
        post_form(&base, &a, "/dashboard/keys", &create[..2]).await.status(),
        403
    );
    let r = browser()
        .post(format!("{base}/dashboard/keys"))
        .header("cookie", format!("hearth_session={}", a.cookie))
        .header("origin", "http://evil.example")
        .form(&create)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403, "cross-origin form");
    for (origin, site) in [
        ("null", None),
        ("null", Some("cross-site")),
        (base.as_str(), Some("cross-site")),
    ] {
        let mut req = browser()
            .post(format!("{base}/dashboard/keys"))
            .header("cookie", format!("hearth_session={}", a.cookie))
            .header("origin", origin)
            .form(&create);
        if let Some(site) = site {
            req = req.header("sec-fetch-site", site);
        }
        assert_eq!(req.send().await.unwrap().status(), 403, "{origin} {site:?}");
    }
    let r = post_form(&base, &a, "/dashboard/keys", &create).await;
    assert_eq!(r.status(), 201);
    let html = r.text().await.unwrap();
    let new_key = by_id(&html, "new-key");
    let new_id = by_id(&html, "new-key-id");
    assert!(new_key.starts_with("hk_"));
    let models = format!("{base}/v1/models");
    let ok = client().get(&models).bearer_auth(&new_key).send().await.unwrap();
    assert_eq!(ok.status(), 200);
    let (_, keys) = page(&base, &a, "/dashboard/keys").await;
    assert!(
        keys.contains(&new_id) && !keys.contains(&new_key),
        "the secret is shown once"
    );
    let r = post_form(
        &base,
        &a,
        &format!("/dashboard/keys/{new_id}/revoke"),
        &[("csrf", &a.csrf)],
    )
    .await;
    assert_eq!(r.status(), 303);
    let gone = client().get(&models).bearer_auth(&new_key).send().await.unwrap();
    assert_eq!(gone.status(), 401, "the revoked key is refused");

    // Tenant B (named like markup) sees none of A's data and cannot touch A's keys.
    let b = sign_in(&base, &key_b).await.unwrap();
    let (_, html) = page(&base, &b, "/dashboard").await;
    assert_eq!(by_id(&html, "total-requests"), "0");
    assert!(
        html.contains("&lt;img src=x onerror=alert(1)&gt;"),
        "the name is escaped"
    );
    assert!(!html.contains(odd), "never raw markup");
    let (_, reqs) = page(&base, &b, "/dashboard/requests").await;
    assert!(!reqs.contains("req_"));
    let (_, keys) = page(&base, &b, "/dashboard/keys").await;
    assert!(!keys.contains(&new_id));
    let a_key_id = key_a.split('_').nth(1).unwrap();
    let r = post_form(
        &base,
        &b,
        &format!("/dashboard/keys/{a_key_id}/revoke"),
        &[("csrf", &b.csrf)],
    )
    .await;
    assert_eq!(r.status(), 404, "another tenant's key does not exist");
    let r = post_form(
        &base,
        &b,
        &format!("/dashboard/keys/{a_key_id}/revoke"),
        &[("csrf", &a.csrf)],
    )
    .await;
    assert_eq!(r.status(), 403, "another session's CSRF token");
    let (status, _) = page(&base, &b, "/dashboard/processors").await;
    assert_eq!(status, 200);

    // The operator: every tenant with its spend; names escaped.
    let op = sign_in(&base, ADMIN_TOKEN).await.unwrap();
    let (status, html) = page(&base, &op, "/dashboard").await;
    assert_eq!(status, 200);
    assert!(html.contains("&lt;img src=x onerror=alert(1)&gt;") && !html.contains(odd));
    assert!(html.contains("acme") && html.contains(MODEL), "tenants and models");
    assert!(
        html.contains("policy kv_aware (prefill ×1") && !html.contains("KvAware"),
        "the routing policy for people, not Debug output"
    );
    let (status, _) = page(&base, &a, "/dashboard/audit").await;
    assert_eq!(status, 200);

    // The audit log: the dashboard's actions with their address, the CLI's, per tenant.
    let audit = get_json(&format!("{base}/v1/tenant/audit"), &key_a).await;
    let actions = actions_and_channels(&audit["data"]);
    for want in [
        ("key.revoke", "dashboard"),
        ("key.create", "dashboard"),
        ("session.sign_in", "dashboard"),
        ("key.create", "cli"),
        ("tenant.create", "cli"),
    ] {
        assert!(actions.contains(&want), "{want:?} in {actions:?}");
    }
    let revoke = audit["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["action"] == "key.revoke")
        .unwrap();
    assert_eq!(revoke["address"], "127.0.0.1");
    assert_eq!(revoke["object"], format!("key:{new_id}"));
    assert!(revoke["actor"].as_str().unwrap().starts_with("key:"));
    let b_audit = get_json(&format!("{base}/v1/tenant/audit"), &key_b).await;
    assert!(
        b_audit["data"]
            .as_array()
            .unwrap()
            .iter()
            .all(|e| e["object"] != format!("key:{new_id}")),
        "tenants see only their own entries"
    );
    let all: Value = client()
        .get(format!("{base}/admin/v1/audit"))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(all["data"]
        .as_array()
        .unwrap()
        .iter()
        .any(|e| e["action"] == "price.set"));
    let cli: Value = serde_json::from_str(&admin(&data, &["--json", "audit", "--tenant", "acme"])).unwrap();
    assert!(cli.as_array().unwrap().iter().any(|e| e["action"] == "key.revoke"));

    // Exports from the dashboard: the billing export, Parquet with native types.
    let r = browser()
        .get(format!("{base}/dashboard/export?format=parquet"))
        .header("cookie", format!("hearth_session={}", a.cookie))
        .send()
        .await
        .unwrap();
    assert_eq!(r.headers()["content-type"], "application/vnd.apache.parquet");
    assert!(r.bytes().await.unwrap().starts_with(b"PAR1"));

    // Revoking the key a session was opened with ends the session.
    let out = admin(&data, &["--json", "key", "create", "--tenant", "acme"]);
    let k2 = serde_json::from_str::<Value>(&out).unwrap()["key"]
        .as_str()
        .unwrap()
        .to_string();
    let s2 = sign_in(&base, &k2).await.unwrap();
    assert_eq!(page(&base, &s2, "/dashboard/keys").await.0, 200);
    admin(&data, &["key", "revoke", k2.split('_').nth(1).unwrap()]);
    tokio::time::sleep(std::time::Duration::from_millis(5_200)).await; // the key cache's 5 s
    let r = browser()
        .get(format!("{base}/dashboard/keys"))
        .header("cookie", format!("hearth_session={}", s2.cookie))
        .send()
        .await
        .unwrap();
    assert_eq!(r.headers()[LOCATION], "/dashboard/login");

    // Sign-out ends the session on the server, not just in the browser.
    let r = post_form(&base, &a, "/dashboard/logout", &[("csrf", &a.csrf)]).await;
    assert_eq!(r.status(), 303);
    let (_, attrs) = cookie_value(r.headers(), "hearth_session").unwrap();
    assert!(attrs.contains("Max-Age=0"));
    let r = browser()
        .get(format!("{base}/dashboard/keys"))
        .header("cookie", format!("hearth_session={}", a.cookie))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 303);

    // Behind a TLS proxy the session cookie is Secure.
    let form = browser()
        .get(format!("{base}/dashboard/login"))
        .header("x-forwarded-proto", "https")
        .send()
        .await
        .unwrap();
    let (_, attrs) = cookie_value(form.headers(), "hearth_login").unwrap();
    assert!(attrs.contains("Secure"), "{attrs}");
}

/// What an outside probe found, closed: wrong admin tokens on `/admin/v1` and `/metrics` are
/// throttled per source address (the 51st gets 429, another address is unaffected); the
/// sign-in form's CSRF token must be one the server issued (a cookie and field the client
/// picked are refused); with `--public-url`, a change must come from exactly that origin,
/// even when `Origin` matches the request's `Host`; a short admin token is refused at start.
#[tokio::test]
async fn admin_throttle_login_csrf_public_origin_and_token_length() {
    let data = temp_dir("hardening");
    let short = std::process::Command::new(bin())
        .args(["serve", "--listen", "127.0.0.1:0", "--backend", "sim"])
        .args(["--data-dir", data.to_str().unwrap()])
        .env("HEARTH_ADMIN_TOKEN", "fifteen-chars!!")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&short.stderr);
    assert!(!short.status.success(), "{stderr}");
    assert!(stderr.contains("at least 16"), "{stderr}");

    let public = "https://hearth.example.test";
    let server = sim_serve_with(&data, "100", &["--public-url", &format!("{public}/")]);
    let base = server.url.clone();

    // A login CSRF cookie and field the client chose, or a real token with its MAC changed.
    let form = browser().get(format!("{base}/dashboard/login")).send().await.unwrap();
    let (issued, _) = cookie_value(form.headers(), "hearth_login").unwrap();
    let tampered = format!("{}0", &issued[..issued.len() - 1]);
    let tampered = if tampered == issued {
        format!("{}1", &issued[..issued.len() - 1])
    } else {
        tampered
    };
    for forged in ["aaaa", tampered.as_str()] {
        let r = browser()
            .post(format!("{base}/dashboard/login"))
            .header("cookie", format!("hearth_login={forged}"))
            .header("origin", public)
            .form(&[("credential", ADMIN_TOKEN), ("login_csrf", forged)])
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 403, "forged login token {forged}");
        assert!(cookie_value(r.headers(), "hearth_session").is_none());
    }

    // `Origin` equal to the request's own host is not the public origin: refused.
    let (status, _) = sign_in_from(&base, &base, ADMIN_TOKEN).await.err().unwrap();
    assert_eq!(status, 403);
    let op = sign_in_from(&base, public, ADMIN_TOKEN).await.unwrap();
    let logout = |origin: &'static str| {
        let (base, cookie, csrf) = (base.clone(), op.cookie.clone(), op.csrf.clone());
        async move {
            let origin = if origin.is_empty() {
                base.clone()
            } else {
                origin.to_string()
            };
            browser()
                .post(format!("{base}/dashboard/logout"))
                .header("cookie", format!("hearth_session={cookie}"))
                .header("origin", origin)
                .form(&[("csrf", csrf.as_str())])
                .send()
                .await
                .unwrap()
                .status()
        }
    };
    assert_eq!(logout("").await, 403, "the request's own host, not the public origin");
    assert_eq!(logout("http://hearth.example.test").await, 403, "the scheme counts");
    assert_eq!(logout("https://hearth.example.test").await, 303);

    // Wrong admin tokens from one address, on both operator surfaces: 401 until the
    // throttle's burst is spent, then 429 (even for the right token) ...
    let c = client();
    let mut sent = 0;
    let first_throttled = loop {
        sent += 1;
        assert!(sent < 500, "never throttled");
        let path = if sent % 2 == 0 { "/metrics" } else { "/admin/v1/tenants" };
        let r = c
            .get(format!("{base}{path}"))
            .bearer_auth(format!("wrong-admin-token-{sent}"))
            .send()
            .await
            .unwrap();
        match r.status().as_u16() {
            401 => {}
            429 => {
                assert!(r.headers().contains_key("retry-after"));
                let body: Value = r.json().await.unwrap();
                assert_eq!(body["error"]["code"], "auth_failures", "{body}");
                break sent;
            }
            s => panic!("{path}: {s}"),
        }
    };
    println!(
        "wrong admin tokens from one address: {} × 401, then 429",
        first_throttled - 1
    );
    assert!(first_throttled > 50, "throttled after {first_throttled}");
    // The budget refills at 10 a second: right after a wrong token, the right one is refused
    // too (a slow machine may let 100 ms pass between the two; then try again).
    let mut right_refused = false;
    for _ in 0..20 {
        c.get(format!("{base}/metrics"))
            .bearer_auth("wrong-again")
            .send()
            .await
            .unwrap();
        let r = c
            .get(format!("{base}/admin/v1/tenants"))
            .bearer_auth(ADMIN_TOKEN)
            .send()
            .await
            .unwrap();
        if r.status() == 429 {
            right_refused = true;
            break;
        }
    }
    assert!(
        right_refused,
        "a throttled address learns nothing, even from the right token"
    );
    // ... while another address is unaffected.
    let other = reqwest::Client::builder()
        .local_address("127.0.0.2".parse::<std::net::IpAddr>().unwrap())
        .build()
        .unwrap();
    let r = other
        .get(format!("{base}/admin/v1/tenants"))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = other
        .get(format!("{base}/metrics"))
        .bearer_auth("wrong-admin-token")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
}

/// `hearth admin … --gateway-url` and `hearth billing export --gateway-url` with only the
/// admin token (no database access: the data directory they are given is empty): the
/// changes land in the gateway's database, and every answer prints as the database path
/// prints it.
#[tokio::test]
async fn remote_admin_cli_works_with_only_the_admin_token() {
    let data = temp_dir("remote-admin");
    let server = sim_serve_with(&data, "100", &[]);
    let elsewhere = temp_dir("remote-admin-laptop");
    let remote = |args: &[&str]| -> String {
        let out = std::process::Command::new(bin())
            .args([
                "admin",
                "--data-dir",
                elsewhere.to_str().unwrap(),
                "--gateway-url",
                &server.url,
            ])
            .args(args)
            .env("HEARTH_ADMIN_TOKEN", ADMIN_TOKEN)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let json = |s: String| -> Value { serde_json::from_str(&s).unwrap() };

    assert!(remote(&["tenant", "create", "far"]).starts_with("Created tenant far ("));
    let key = json(remote(&[
        "--json",
        "key",
        "create",
        "--tenant",
        "far",
        "--name",
        "remote",
        "--expires-in",
        "1d",
    ]));
    assert!(key["key"].as_str().unwrap().starts_with("hk_"), "{key}");
    assert!(key["expires_at"].as_i64().unwrap() > 0);
    let price = json(remote(&[&["--json"][..], &TEST_PRICE].concat()));
    assert_eq!(price["input_micros_per_mtok"], 1_000_000);
    assert!(remote(&["tenant", "budget", "far", "--monthly-usd", "12.5"]).contains("$12.50 per month (hard)"));
    assert!(remote(&["tenant", "limits", "far", "--rpm", "60"]).contains("60 requests/min"));

    // The gateway's database has them; both paths print the same JSON.
    for args in [
        &["--json", "tenant", "list"][..],
        &["--json", "key", "list", "--tenant", "far"],
        &["--json", "price", "list"],
        &["--json", "jwt", "list"],
    ] {
        assert_eq!(json(remote(args)), json(admin(&data, args)), "{args:?}");
    }
    let budget = json(admin(
        &data,
        &["--json", "tenant", "budget", "far", "--monthly-usd", "12.5"],
    ));
    assert_eq!(budget["budget"]["monthly_usd"], "12.500000000");
    let audit = json(admin(&data, &["--json", "audit", "--tenant", "far"]));
    let actions = actions_and_channels(&audit);
    for want in [
        ("tenant.create", "api"),
        ("key.create", "api"),
        ("tenant.budget", "api"),
    ] {
        assert!(actions.contains(&want), "{want:?} in {actions:?}");
    }
    assert!(
        !elsewhere.join("hearth.db").exists(),
        "the remote CLI opened no database"
    );

    // The key works; its request is in the export the remote CLI downloads.
    let (status, _, body) = post(
        &format!("{}/v1/chat/completions", server.url),
        Some(key["key"].as_str().unwrap()),
        &chat_body(json!({"max_tokens": 3})),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let export = std::process::Command::new(bin())
        .args([
            "billing",
            "export",
            "--gateway-url",
            &server.url,
            "--tenant",
            "far",
            "--from",
            "2020-01-01",
        ])
        .args(["--format", "jsonl"])
        .env("HEARTH_ADMIN_TOKEN", ADMIN_TOKEN)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&export.stderr);
    assert!(export.status.success(), "{stderr}");
    assert_eq!(String::from_utf8_lossy(&export.stdout).lines().count(), 1);
    assert!(stderr.starts_with("1 lines; 1 requests;"), "{stderr}");

    // A wrong token is the gateway's 401, said plainly.
    let out = std::process::Command::new(bin())
        .args(["admin", "--gateway-url", &server.url, "tenant", "list"])
        .env("HEARTH_ADMIN_TOKEN", "wrong-admin-token-0000")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("401"));
}

/// Members and roles end to end: the operator invites the first owner through the remote
/// CLI; the owner joins through the link, invites a viewer from the dashboard; the viewer
/// sees usage but may not create keys, export or read the audit log; a role change applies
/// at the next request; removal ends the member's session at once; the last owner stays;
/// another tenant's member is "not found"; API keys stop opening sessions once a tenant
/// has members; wrong, unknown-address and unknown-tenant passwords get one answer; every
/// action's audit row names the member.
#[tokio::test]
async fn members_roles_invitations_and_removal() {
    let data = temp_dir("members");
    let server = sim_serve_with(&data, "100", &[]);
    let base = server.url.as_str();
    let remote = |args: &[&str]| -> Value {
        let out = std::process::Command::new(bin())
            .args(["admin", "--json", "--gateway-url", base])
            .args(args)
            .env("HEARTH_ADMIN_TOKEN", ADMIN_TOKEN)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    };
    admin(&data, &["tenant", "create", "team"]);
    admin(&data, &["tenant", "create", "other"]);
    let key: Value = serde_json::from_str(&admin(
        &data,
        &[
            "--json",
            "key",
            "create",
            "--tenant",
            "team",
            "--scopes",
            "inference,manage",
        ],
    ))
    .unwrap();
    let key = key["key"].as_str().unwrap().to_string();
    // No members yet: the key still opens a session (bootstrap).
    let key_session = sign_in(base, &key).await.expect("a key session before members");
    // The first member must be an owner.
    let out = std::process::Command::new(bin())
        .args([
            "admin",
            "--gateway-url",
            base,
            "member",
            "invite",
            "--tenant",
            "team",
            "--email",
            "dev@example.com",
        ])
        .env("HEARTH_ADMIN_TOKEN", ADMIN_TOKEN)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("first member must be an owner"));

    // The operator invites the first owner through the gateway.
    let inv = remote(&[
        "member",
        "invite",
        "--tenant",
        "team",
        "--email",
        "Owner@Example.com",
        "--role",
        "owner",
    ]);
    let link = inv["url"].as_str().unwrap().to_string();
    assert!(link.starts_with(&format!("{base}/dashboard/invite/")), "{inv}");
    assert_eq!(inv["invitation"]["email"], "owner@example.com");
    let password = "owner password 1234";
    assert_eq!(
        accept(base, &link, "too short", "too short").await.err().map(|e| e.0),
        Some(400)
    );
    assert_eq!(
        accept(base, &link, password, "something else").await.err().map(|e| e.0),
        Some(400)
    );
    let owner = accept(base, &link, password, password).await.expect("the owner joins");
    assert_eq!(
        accept(base, &link, password, password).await.err().map(|e| e.0),
        Some(404),
        "a link works once"
    );
    let (status, html) = page(base, &owner, "/dashboard/members").await;
    assert_eq!(status, 200, "{html}");
    assert_eq!(
        (by_id(&html, "member"), by_id(&html, "role")),
        ("owner@example.com".into(), "owner".into())
    );
    // The key's session, opened before, ends now that the tenant has a member.
    let (status, _) = page(base, &key_session, "/dashboard").await;
    assert_eq!(status, 303, "a key session does not outlive the tenant's first member");

    // Passwords: one answer for a wrong password, an unknown address and an unknown tenant.
    let again = member_sign_in(base, "team", "OWNER@example.com", password).await;
    assert!(again.is_ok(), "e-mail addresses are case-insensitive");
    let checks = |m: String| metric_sum(&m, "hearth_dashboard_password_checks_total");
    let before = checks(metrics(base).await);
    for (tenant, email, pw) in [
        ("team", "owner@example.com", "wrong password 1234"),
        ("team", "nobody@example.com", password),
        ("no-such-tenant", "owner@example.com", password),
    ] {
        let (status, body) = member_sign_in(base, tenant, email, pw).await.err().expect("refused");
        assert_eq!(status, 401, "{tenant} {email}");
        assert_eq!(by_id(&body, "login-error"), "Wrong tenant, e-mail address or password.");
    }
    assert_eq!(
        checks(metrics(base).await) - before,
        3.0,
        "one Argon2id verification each, known member or not"
    );
    // The tenant has members now: its keys are for programs.
    let (status, body) = sign_in(base, &key).await.err().expect("key sign-in refused");
    assert_eq!(status, 403);
    assert!(
        by_id(&body, "login-error").contains("This tenant has members"),
        "{body}"
    );

    // The owner invites a viewer from the dashboard; the viewer joins.
    let r = post_form(
        base,
        &owner,
        "/dashboard/members",
        &[("csrf", &owner.csrf), ("email", "vi@example.com"), ("role", "viewer")],
    )
    .await;
    assert_eq!(r.status(), 201);
    // As the browser reads it (minijinja escapes '/').
    let link = by_id(&r.text().await.unwrap(), "invite-link").replace("&#x2f;", "/");
    let viewer_pw = "viewer password 1234";
    let viewer = accept(base, &link, viewer_pw, viewer_pw)
        .await
        .expect("the viewer joins");
    let members = remote(&["member", "list", "--tenant", "team"]);
    let id_of = |email: &str| -> String {
        members
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["email"] == email)
            .unwrap()["id"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let (owner_id, viewer_id) = (id_of("owner@example.com"), id_of("vi@example.com"));
    let direct: Value = serde_json::from_str(&admin(&data, &["--json", "member", "list", "--tenant", "team"])).unwrap();
    assert_eq!(direct, members, "both CLI paths print the same members");

    // A viewer sees usage and keys, but may not create keys, export, read the audit log or
    // invite: the pages hide it and the service refuses it.
    let (status, html) = page(base, &viewer, "/dashboard").await;
    assert_eq!(status, 200, "{html}");
    assert!(!html.contains("export-csv"));
    let (status, html) = page(base, &viewer, "/dashboard/keys").await;
    assert_eq!(status, 200);
    assert!(!html.contains("id=\"create-key\""), "no create button for a viewer");
    let r = post_form(
        base,
        &viewer,
        "/dashboard/keys",
        &[("csrf", &viewer.csrf), ("name", "v"), ("scope_inference", "on")],
    )
    .await;
    assert_eq!(r.status(), 403);
    assert!(r.text().await.unwrap().contains("may not create and revoke API keys"));
    for path in ["/dashboard/export?format=csv", "/dashboard/audit"] {
        assert_eq!(page(base, &viewer, path).await.0, 403, "{path}");
    }
    let r = post_form(
        base,
        &viewer,
        "/dashboard/members",
        &[("csrf", &viewer.csrf), ("email", "x@example.com"), ("role", "viewer")],
    )
    .await;
    assert_eq!(r.status(), 403);
    let r = post_form(
        base,
        &viewer,
        &format!("/dashboard/members/{owner_id}/remove"),
        &[("csrf", &viewer.csrf)],
    )
    .await;
    assert_eq!(r.status(), 403);

    // The owner makes them a developer: their next request may create a key.
    let r = post_form(
        base,
        &owner,
        &format!("/dashboard/members/{viewer_id}/role"),
        &[("csrf", &owner.csrf), ("role", "developer")],
    )
    .await;
    assert_eq!(r.status(), 303);
    let r = post_form(
        base,
        &viewer,
        "/dashboard/keys",
        &[("csrf", &viewer.csrf), ("name", "dev"), ("scope_inference", "on")],
    )
    .await;
    assert_eq!(r.status(), 201);
    // A `manage` key may do everything: only an owner creates one.
    let manage_key = [
        ("csrf", viewer.csrf.as_str()),
        ("name", "m"),
        ("scope_inference", "on"),
        ("scope_manage", "on"),
    ];
    let r = post_form(base, &viewer, "/dashboard/keys", &manage_key).await;
    assert_eq!(r.status(), 403);
    assert!(r
        .text()
        .await
        .unwrap()
        .contains("Only an owner may create keys with the manage scope"));
    let r = post_form(
        base,
        &owner,
        "/dashboard/keys",
        &[("csrf", owner.csrf.as_str()), ("name", "m"), ("scope_manage", "on")],
    )
    .await;
    assert_eq!(r.status(), 201);
    // The operator makes them an admin: an admin still cannot make or remove owners.
    remote(&["member", "role", &viewer_id, "admin"]);
    let r = post_form(
        base,
        &viewer,
        &format!("/dashboard/members/{viewer_id}/role"),
        &[("csrf", &viewer.csrf), ("role", "owner")],
    )
    .await;
    assert_eq!(r.status(), 403, "an admin cannot make an owner");
    let r = post_form(
        base,
        &viewer,
        &format!("/dashboard/members/{owner_id}/remove"),
        &[("csrf", &viewer.csrf)],
    )
    .await;
    assert_eq!(r.status(), 403, "an admin cannot remove an owner");
    // Nor replace an open owner invitation by inviting the address again.
    let r = post_form(
        base,
        &owner,
        "/dashboard/members",
        &[("csrf", &owner.csrf), ("email", "next@example.com"), ("role", "owner")],
    )
    .await;
    assert_eq!(r.status(), 201);
    let r = post_form(
        base,
        &viewer,
        "/dashboard/members",
        &[
            ("csrf", &viewer.csrf),
            ("email", "next@example.com"),
            ("role", "viewer"),
        ],
    )
    .await;
    assert_eq!(
        r.status(),
        403,
        "an admin cannot withdraw an owner invitation by replacing it"
    );

    // The last owner stays.
    let r = post_form(
        base,
        &owner,
        &format!("/dashboard/members/{owner_id}/remove"),
        &[("csrf", &owner.csrf)],
    )
    .await;
    assert_eq!(r.status(), 409);
    assert!(r.text().await.unwrap().contains("at least one owner"));

    // Another tenant's member is not found.
    let other = remote(&[
        "member",
        "invite",
        "--tenant",
        "other",
        "--email",
        "o@example.com",
        "--role",
        "owner",
    ]);
    let other_owner = accept(base, other["url"].as_str().unwrap(), password, password)
        .await
        .unwrap();
    let other_id = remote(&["member", "list", "--tenant", "other"])[0]["id"]
        .as_str()
        .unwrap()
        .to_string();
    let r = post_form(
        base,
        &owner,
        &format!("/dashboard/members/{other_id}/remove"),
        &[("csrf", &owner.csrf)],
    )
    .await;
    assert_eq!(r.status(), 404);
    assert_eq!(page(base, &other_owner, "/dashboard").await.0, 200, "untouched");

    // Removal ends the member's session at its next request.
    let r = post_form(
        base,
        &owner,
        &format!("/dashboard/members/{viewer_id}/remove"),
        &[("csrf", &owner.csrf)],
    )
    .await;
    assert_eq!(r.status(), 303);
    let r = browser()
        .get(format!("{base}/dashboard"))
        .header("cookie", format!("hearth_session={}", viewer.cookie))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 303);
    assert_eq!(r.headers()[LOCATION], "/dashboard/login");
    let r = post_form(
        base,
        &viewer,
        "/dashboard/keys",
        &[("csrf", &viewer.csrf), ("name", "late"), ("scope_inference", "on")],
    )
    .await;
    assert_eq!(r.status(), 401);
    assert!(member_sign_in(base, "team", "vi@example.com", viewer_pw).await.is_err());

    // The audit log names the member for every action it took.
    let audit: Value = serde_json::from_str(&admin(
        &data,
        &["--json", "audit", "--tenant", "team", "--limit", "100"],
    ))
    .unwrap();
    let by = |action: &str| -> Vec<String> {
        audit
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["action"] == action)
            .map(|e| e["actor"].as_str().unwrap().to_string())
            .collect()
    };
    let owner_actor = format!("member:{owner_id}:owner@example.com");
    let viewer_actor = format!("member:{viewer_id}:vi@example.com");
    let invites = by("member.invite");
    assert_eq!(invites.len(), 3, "{invites:?}");
    assert!(
        invites[..2].iter().all(|a| *a == owner_actor) && invites[2] == "admin",
        "{invites:?}"
    );
    assert!(by("member.join").contains(&viewer_actor) && by("member.join").contains(&owner_actor));
    assert_eq!(by("member.remove"), vec![owner_actor.clone()]);
    assert_eq!(by("member.role"), vec!["admin".to_string(), owner_actor.clone()]);
    assert!(by("key.create").contains(&viewer_actor));
    assert!(by("session.sign_in").contains(&owner_actor));
}

/// The operator console's write actions: create a tenant, open its drill-down, set its
/// budget and limits, revoke one of its keys and invite its first owner — each behind the
/// session's CSRF token, each audited as the operator through the dashboard, each seen by
/// the CLI and the admin API; bad input is a 400 page; a tenant's session gets 403.
#[tokio::test]
async fn operator_console_manages_tenants() {
    let data = temp_dir("console");
    let server = sim_serve_with(&data, "100", &[]);
    let base = server.url.as_str();
    let op = sign_in(base, ADMIN_TOKEN).await.expect("operator session");
    let r = post_form(
        base,
        &op,
        "/dashboard/tenants",
        &[("csrf", "wrong"), ("name", "console")],
    )
    .await;
    assert_eq!(r.status(), 403, "CSRF");
    let r = post_form(
        base,
        &op,
        "/dashboard/tenants",
        &[("csrf", &op.csrf), ("name", "console")],
    )
    .await;
    assert_eq!(r.status(), 303);
    let at = r.headers()[LOCATION].to_str().unwrap().to_string();
    assert!(at.starts_with("/dashboard/tenants/tn_"), "{at}");
    let tenants: Value = serde_json::from_str(&admin(&data, &["--json", "tenant", "list"])).unwrap();
    assert!(
        tenants.as_array().unwrap().iter().any(|t| t["name"] == "console"),
        "the CLI sees it"
    );
    let (status, html) = page(base, &op, &at).await;
    assert_eq!(status, 200, "{html}");
    assert_eq!(by_id(&html, "drill-tenant-name"), "console");

    let form = |extra: &[(&'static str, &'static str)]| -> Vec<(&'static str, String)> {
        let mut f = vec![("csrf", op.csrf.clone())];
        f.extend(extra.iter().map(|(k, v)| (*k, v.to_string())));
        f
    };
    let send = |path: String, f: Vec<(&'static str, String)>| {
        let (base, cookie) = (base.to_string(), op.cookie.clone());
        async move {
            browser()
                .post(format!("{base}{path}"))
                .header("cookie", format!("hearth_session={cookie}"))
                .header("origin", &base)
                .form(&f)
                .send()
                .await
                .unwrap()
        }
    };
    let r = send(
        format!("{at}/budget"),
        form(&[("monthly_usd", "7.5"), ("mode", "soft")]),
    )
    .await;
    assert_eq!(r.status(), 303);
    let r = send(
        format!("{at}/limits"),
        form(&[("rpm", "60"), ("share", "3"), ("priority", "batch")]),
    )
    .await;
    assert_eq!(r.status(), 303);
    let r = send(format!("{at}/limits"), form(&[("rpm", "lots")])).await;
    assert_eq!(r.status(), 400);
    let api = |path: &str| {
        let url = format!("{base}/admin/v1/{path}");
        async move {
            let r = client().get(url).bearer_auth(ADMIN_TOKEN).send().await.unwrap();
            r.json::<Value>().await.unwrap()
        }
    };
    assert_eq!(
        api("tenants/console/budget").await["budget"],
        json!({"monthly_usd": "7.500000000", "mode": "soft"})
    );
    let limits = api("tenants/console/limits").await;
    assert_eq!(
        (limits["limits"]["rpm"].clone(), limits["limits"]["share"].clone()),
        (json!(60), json!(3)),
        "{limits}"
    );
    assert_eq!(limits["limits"]["priority"], "batch", "{limits}");

    let key: Value = serde_json::from_str(&admin(
        &data,
        &[
            "--json",
            "key",
            "create",
            "--tenant",
            "console",
            "--scopes",
            "inference,manage",
        ],
    ))
    .unwrap();
    let key_id = key["id"].as_str().unwrap();
    let r = send(format!("{at}/keys/{key_id}/revoke"), form(&[])).await;
    assert_eq!(r.status(), 303);
    let keys: Value = serde_json::from_str(&admin(&data, &["--json", "key", "list", "--tenant", "console"])).unwrap();
    assert!(keys[0]["revoked_at"].is_i64(), "{keys}");
    let r = send(
        format!("{at}/invite"),
        form(&[("email", "boss@example.com"), ("role", "owner")]),
    )
    .await;
    assert_eq!(r.status(), 201);
    let link = by_id(&r.text().await.unwrap(), "invite-link").replace("&#x2f;", "/");
    assert!(link.contains("/dashboard/invite/"), "{link}");
    // The invitee joins as the only owner: the operator can neither demote nor remove them
    // (a tenant keeps an owner), but changes and removes a developer.
    let boss = accept(base, &link, "a long enough password", "a long enough password")
        .await
        .expect("joined");
    let members: Value =
        serde_json::from_str(&admin(&data, &["--json", "member", "list", "--tenant", "console"])).unwrap();
    let boss_id = members[0]["id"].as_str().unwrap().to_string();
    let r = send(format!("{at}/members/{boss_id}/role"), form(&[("role", "viewer")])).await;
    assert_eq!(r.status(), 409, "a tenant keeps an owner");
    let r = send(format!("{at}/members/mb_elsewhere/remove"), form(&[])).await;
    assert_eq!(r.status(), 404);
    // A key made by the operator for the tenant works; its billing export is the operator's.
    let r = send(
        format!("{at}/keys"),
        form(&[("name", "from-console"), ("scope_inference", "1")]),
    )
    .await;
    assert_eq!(r.status(), 201);
    let made = by_id(&r.text().await.unwrap(), "new-key");
    let ok = browser()
        .get(format!("{base}/v1/models"))
        .bearer_auth(&made)
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 200, "the console's key works");
    let (status, html) = page(base, &op, &format!("{at}/processors")).await;
    assert_eq!((status, by_id(&html, "processors-tenant").as_str()), (200, "console"));
    let r = send(format!("{at}/processors/pr_not_this_tenants/activate"), form(&[])).await;
    assert_eq!(r.status(), 404);
    let (status, csv) = page(base, &op, &format!("{at}/export?format=csv")).await;
    assert_eq!(status, 200);
    assert!(csv.lines().next().unwrap_or("").contains("tenant"), "{csv}");
    let r = send(format!("{at}/members/{boss_id}/remove"), form(&[])).await;
    assert_eq!(r.status(), 409, "nor its last owner");
    assert_eq!(page(base, &boss, "/dashboard").await.0, 200, "still a member");
    let inv: Value = serde_json::from_str(&admin(
        &data,
        &[
            "--json",
            "member",
            "invite",
            "--tenant",
            "console",
            "--email",
            "dev@example.com",
            "--role",
            "developer",
            "--public-url",
            base,
        ],
    ))
    .unwrap();
    let dev = accept(
        base,
        inv["url"].as_str().unwrap(),
        "another long password",
        "another long password",
    )
    .await
    .expect("joined");
    let members: Value =
        serde_json::from_str(&admin(&data, &["--json", "member", "list", "--tenant", "console"])).unwrap();
    let dev_id = members
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["email"] == "dev@example.com")
        .and_then(|m| m["id"].as_str())
        .expect("the developer is a member")
        .to_string();
    let r = send(format!("{at}/members/{dev_id}/role"), form(&[("role", "billing")])).await;
    assert_eq!(r.status(), 303);
    let r = send(format!("{at}/members/{dev_id}/remove"), form(&[])).await;
    assert_eq!(r.status(), 303);
    assert_ne!(
        page(base, &dev, "/dashboard").await.0,
        200,
        "the removed member's session ends"
    );

    // A price version from the console; the CLI lists it.
    let r = send(
        "/dashboard/prices".into(),
        form(&[
            ("model", "console-model"),
            ("input", "0.5"),
            ("cached_input", "0.05"),
            ("output", "1.5"),
        ]),
    )
    .await;
    assert_eq!(r.status(), 303);
    let r = send(
        "/dashboard/prices".into(),
        form(&[
            ("model", "m"),
            ("input", "cheap"),
            ("cached_input", "0"),
            ("output", "0"),
        ]),
    )
    .await;
    assert_eq!(r.status(), 400);
    let prices: Value =
        serde_json::from_str(&admin(&data, &["--json", "price", "list", "--model", "console-model"])).unwrap();
    assert_eq!(prices[0]["output_micros_per_mtok"], 1_500_000, "{prices}");
    assert!(page(base, &op, "/dashboard").await.1.contains("console-model"));

    // A tenant's session cannot use the console.
    let other = new_key(&data, "elsewhere");
    let t = sign_in(base, &other).await.expect("a tenant session");
    assert_eq!(page(base, &t, &at).await.0, 403);
    let r = post_form(base, &t, "/dashboard/tenants", &[("csrf", &t.csrf), ("name", "sneaky")]).await;
    assert_eq!(r.status(), 403);
    let r = post_form(
        base,
        &t,
        "/dashboard/prices",
        &[
            ("csrf", &t.csrf),
            ("model", "*"),
            ("input", "0"),
            ("cached_input", "0"),
            ("output", "0"),
        ],
    )
    .await;
    assert_eq!(r.status(), 403);

    // Suspending from the console: the tenant's key is refused as suspended at once (the
    // gateway's credential cache is cleared), the CLI sees it; resuming restores it.
    let key = admin(&data, &["key", "create", "--tenant", "console"])
        .split_whitespace()
        .find(|w| w.starts_with("hk_"))
        .expect("key printed")
        .to_string();
    let models = |key: String| {
        let base = base.to_string();
        async move {
            let r = browser()
                .get(format!("{base}/v1/models"))
                .bearer_auth(key)
                .send()
                .await
                .unwrap();
            (r.status().as_u16(), r.json::<Value>().await.unwrap())
        }
    };
    assert_eq!(models(key.clone()).await.0, 200);
    let r = send(format!("{at}/suspend"), form(&[])).await;
    assert_eq!(r.status(), 303);
    let (status, body) = models(key.clone()).await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (403, Some("tenant_suspended")),
        "{body}"
    );
    let tenants: Value = serde_json::from_str(&admin(&data, &["--json", "tenant", "list"])).unwrap();
    let console = tenants
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "console")
        .unwrap();
    assert!(console["suspended_at"].is_i64(), "{console}");
    let (_, html) = page(base, &op, &at).await;
    assert!(html.contains("id=\"resume-tenant\""));
    let r = send(format!("{at}/resume"), form(&[])).await;
    assert_eq!(r.status(), 303);
    assert_eq!(models(key).await.0, 200);

    // The tenant's identity provider and JWT issuers, from its page.
    let r = send(
        format!("{at}/sso"),
        form(&[("issuer", "https://login.console.example"), ("client_id", "hearth")]),
    )
    .await;
    assert_eq!(r.status(), 303);
    let r = send(
        format!("{at}/jwt"),
        form(&[
            ("issuer", "https://jwt.console.example"),
            ("audience", "hearth"),
            ("algorithm", "RS256"),
            ("jwks_url", "https://jwt.console.example/jwks"),
        ]),
    )
    .await;
    assert_eq!(r.status(), 303);
    let (_, html) = page(base, &op, &at).await;
    assert!(
        by_id(&html, "sso-provider").contains("Members sign in through"),
        "{html}"
    );
    let issuers: Value =
        serde_json::from_str(&admin(&data, &["--json", "jwt", "list", "--tenant", "console"])).unwrap();
    let issuer_id = issuers[0]["id"].as_str().unwrap().to_string();
    assert!(html.contains(&format!("id=\"issuer-{issuer_id}\"")));
    let r = send(
        format!("{at}/jwt-remove"),
        form(&[("issuer_id", "iss_not_this_tenants")]),
    )
    .await;
    assert_eq!(r.status(), 404);
    let mut f = form(&[]);
    f.push(("issuer_id", issuer_id.clone()));
    let r = send(format!("{at}/jwt-remove"), f).await;
    assert_eq!(r.status(), 303);
    let r = send(format!("{at}/sso-remove"), form(&[])).await;
    assert_eq!(r.status(), 303);
    assert_eq!(
        admin(&data, &["--json", "sso", "show", "--tenant", "console"]).trim(),
        "null"
    );

    let audit: Value = serde_json::from_str(&admin(&data, &["--json", "audit", "--tenant", "console"])).unwrap();
    let mut seen = actions_and_channels(&audit);
    seen.sort();
    let console = [
        "tenant.create",
        "tenant.budget",
        "tenant.limits",
        "key.revoke",
        "member.invite",
        "sso.set",
        "sso.remove",
        "tenant.suspend",
        "tenant.resume",
        "key.create",
        "member.role",
        "member.remove",
        "jwt_issuer.add",
        "jwt_issuer.remove",
    ];
    for want in console {
        assert!(seen.contains(&(want, "dashboard")), "{want} in {seen:?}");
    }
    // The console's changes are the operator's (the members' own joins and sign-ins are theirs).
    assert!(audit
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["channel"] == "dashboard" && console.contains(&e["action"].as_str().unwrap()))
        .all(|e| e["actor"] == "admin"));
}

/// Single sign-on's edges over HTTP (the browser check signs in through a real provider):
/// the admin API sets, shows and removes a tenant's provider (refusing plain http to a
/// remote host, never showing the secret, auditing both); a sign-in for a tenant without a
/// provider is 404 and one whose provider cannot be reached is 502; the callback refuses a
/// flow without this installation's sealed cookie.
#[tokio::test]
async fn sso_configuration_and_callback_refusals() {
    let data = temp_dir("sso");
    let server = sim_serve_with(&data, "100", &[]);
    let base = server.url.as_str();
    admin(&data, &["tenant", "create", "acme"]);
    let http = browser();
    let api = |method: reqwest::Method, body: Option<Value>| {
        let mut r = http
            .request(method, format!("{base}/admin/v1/tenants/acme/sso"))
            .bearer_auth(ADMIN_TOKEN);
        if let Some(b) = body {
            r = r.json(&b);
        }
        r.send()
    };
    let r = api(
        reqwest::Method::PUT,
        Some(json!({"issuer": "http://idp.example.com", "client_id": "h"})),
    )
    .await
    .unwrap();
    assert_eq!(r.status(), 400, "plain http to a remote host");
    let r = api(reqwest::Method::GET, None).await.unwrap();
    assert_eq!(r.json::<Value>().await.unwrap(), Value::Null);
    let (status, html) = {
        let r = http
            .get(format!("{base}/dashboard/sso?tenant=acme"))
            .send()
            .await
            .unwrap();
        (r.status(), r.text().await.unwrap())
    };
    assert_eq!(status, 404, "no provider yet: {html}");
    // A provider that does not answer (a closed port).
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let issuer = format!("http://127.0.0.1:{}", closed.local_addr().unwrap().port());
    drop(closed);
    let spec = json!({"issuer": issuer, "client_id": "hearth", "client_secret": "s3cret"});
    let r = api(reqwest::Method::PUT, Some(spec)).await.unwrap();
    assert_eq!(r.status(), 200);
    let shown: Value = r.json().await.unwrap();
    assert_eq!(shown["has_client_secret"], true);
    assert!(!shown.to_string().contains("s3cret"), "the secret is never shown");
    let r = http
        .get(format!("{base}/dashboard/sso?tenant=acme"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 502, "the provider cannot be reached");
    // Callbacks this installation did not start.
    let callback = |cookie: Option<&str>, state: &str| {
        let mut r = http.get(format!("{base}/dashboard/sso/callback?code=c&state={state}"));
        if let Some(c) = cookie {
            r = r.header("cookie", format!("hearth_sso={c}"));
        }
        r.send()
    };
    assert_eq!(callback(None, "s").await.unwrap().status(), 403, "no flow cookie");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis();
    let forged = format!("{now}.operator.s.n.v.{}", "ab".repeat(32));
    assert_eq!(
        callback(Some(&forged), "s").await.unwrap().status(),
        403,
        "a cookie the installation did not seal"
    );
    let r = api(reqwest::Method::DELETE, None).await.unwrap();
    assert_eq!(r.status(), 200);
    let r = api(reqwest::Method::DELETE, None).await.unwrap();
    assert_eq!(r.status(), 404, "nothing left to remove");
    let audit: Value = serde_json::from_str(&admin(&data, &["--json", "audit", "--tenant", "acme"])).unwrap();
    let actions = actions_and_channels(&audit);
    assert!(
        actions.contains(&("sso.set", "api")) && actions.contains(&("sso.remove", "api")),
        "{actions:?}"
    );
}

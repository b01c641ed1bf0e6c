//! `hearth admin login`: an operator signs in through the operators' identity provider in a
//! browser, and the CLI keeps the session it gets for that gateway, so that `hearth admin
//! --gateway-url URL …` works without the admin token.
//!
//! The CLI listens on a loopback port and opens (or prints) the gateway's
//! `/dashboard/sso/operator?cli_port=PORT&cli_challenge=C`, C the S256 challenge of a
//! verifier only the CLI knows. After the provider's sign-in, the gateway sends the browser
//! to `http://127.0.0.1:PORT/callback?code=…`; the CLI trades the code and its verifier at
//! `/dashboard/sso/cli-token` for an operator session token (a code alone is useless to
//! whoever else sees it). Tokens are kept in `~/.config/hearth/operator-sessions.json`
//! (mode 0600), by gateway URL; a session ends after 30 minutes unused or 12 hours.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const WAIT: Duration = Duration::from_secs(300);

#[derive(Serialize, Deserialize, Clone)]
struct Saved {
    token: String,
    operator: String,
    expires_at: i64,
}

fn store_path() -> anyhow::Result<PathBuf> {
    let base = std::env::var_os("XDG_CONFIG_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".config")))
        .context("neither XDG_CONFIG_HOME nor HOME is set: nowhere to keep the session")?;
    Ok(base.join("hearth").join("operator-sessions.json"))
}

fn load() -> BTreeMap<String, Saved> {
    store_path()
        .ok()
        .and_then(|p| std::fs::read(p).ok())
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default()
}

fn save(all: &BTreeMap<String, Saved>) -> anyhow::Result<()> {
    use std::io::Write;
    let path = store_path()?;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let tmp = path.with_extension("json.tmp");
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(0o600);
    }
    let mut f = opts.open(&tmp).with_context(|| format!("writing {}", tmp.display()))?;
    f.write_all(&serde_json::to_vec_pretty(all)?)?;
    f.sync_all()?;
    std::fs::rename(&tmp, &path).with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// The gateway URL as sessions are keyed: scheme, host, port, no trailing slash.
fn key(url: &str) -> String {
    url.trim_end_matches('/').to_string()
}

/// The session `hearth admin login` kept for this gateway, if it has not expired.
pub fn saved_token(url: &str) -> Option<String> {
    let now = hearth_tenants::now_ms();
    load().remove(&key(url)).filter(|s| s.expires_at > now).map(|s| s.token)
}

/// `hearth admin login`.
pub async fn login(url: &str, open_browser: bool) -> anyhow::Result<()> {
    let base = key(url);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .context("listening on a loopback port for the browser's return")?;
    let port = listener.local_addr()?.port();
    let pkce = hearth_tenants::sso::Pkce::new()?;
    let link = format!(
        "{base}/dashboard/sso/operator?cli_port={port}&cli_challenge={}",
        pkce.challenge
    );
    eprintln!(
        "Sign in through the operators' identity provider at this link (on this machine):\n\n  {link}\n\nThen confirm on the page that shows the code {}.",
        hearth_tenants::sso::cli_code(&pkce.challenge)
    );
    if open_browser {
        // Best effort: without a desktop the link above is the way.
        let _ = std::process::Command::new("xdg-open")
            .arg(&link)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn();
    }
    let code = tokio::time::timeout(WAIT, callback(&listener))
        .await
        .map_err(|_| anyhow::anyhow!("no sign-in within {} minutes", WAIT.as_secs() / 60))??;
    let http = reqwest::Client::builder().timeout(Duration::from_secs(30)).build()?;
    let resp = http
        .post(format!("{base}/dashboard/sso/cli-token"))
        .json(&serde_json::json!({"code": code, "verifier": pkce.verifier}))
        .send()
        .await
        .with_context(|| format!("reaching {base}"))?;
    let status = resp.status();
    let body: serde_json::Value = resp.json().await.unwrap_or_default();
    if !status.is_success() {
        bail!(
            "the gateway refused the sign-in ({status}): {}",
            body["error"]["message"].as_str().unwrap_or("no reason given")
        );
    }
    let saved = Saved {
        token: body["token"].as_str().context("the gateway sent no token")?.to_string(),
        operator: body["operator"].as_str().unwrap_or_default().to_string(),
        expires_at: body["expires_at"].as_i64().unwrap_or(0),
    };
    let mut all = load();
    all.insert(base.clone(), saved.clone());
    save(&all)?;
    println!(
        "Signed in to {base} as {} (until {} at the latest, or 30 minutes unused).",
        saved.operator,
        crate::manage::iso_ms(saved.expires_at)
    );
    Ok(())
}

/// `hearth admin logout`: ends the session kept for this gateway there, and forgets it.
pub async fn logout(url: &str) -> anyhow::Result<()> {
    let base = key(url);
    let mut all = load();
    let Some(saved) = all.remove(&base) else {
        println!("No session kept for {base}.");
        return Ok(());
    };
    let http = reqwest::Client::builder().timeout(Duration::from_secs(30)).build()?;
    let ended = http
        .post(format!("{base}/dashboard/sso/cli-logout"))
        .bearer_auth(&saved.token)
        .send()
        .await
        .map_err(anyhow::Error::from)
        .and_then(|r| r.error_for_status().map_err(anyhow::Error::from));
    save(&all)?;
    match ended {
        Ok(_) => println!("Signed out of {base}."),
        Err(e) => println!(
            "Forgot the session for {base}, but could not end it there ({e}): it ends after 30 minutes unused."
        ),
    }
    Ok(())
}

/// Waits for the browser's `GET /callback?code=…` and answers it.
async fn callback(listener: &tokio::net::TcpListener) -> anyhow::Result<String> {
    loop {
        let (mut sock, _) = listener.accept().await?;
        let mut buf = vec![0u8; 8192];
        let n = tokio::time::timeout(Duration::from_secs(10), sock.read(&mut buf))
            .await
            .unwrap_or(Ok(0))
            .unwrap_or(0);
        let head = String::from_utf8_lossy(&buf[..n]);
        let target = head.lines().next().unwrap_or("").split(' ').nth(1).unwrap_or("");
        let code = target
            .strip_prefix("/callback?")
            .and_then(|q| q.split('&').find_map(|kv| kv.strip_prefix("code=")))
            .filter(|c| !c.is_empty() && c.bytes().all(|b| b.is_ascii_hexdigit()))
            .map(str::to_string);
        let (status, text) = match &code {
            Some(_) => (
                "200 OK",
                "Signed in. You can close this tab and go back to the command line.",
            ),
            None => ("404 Not Found", "Not a sign-in."),
        };
        let page = format!(
            "HTTP/1.1 {status}\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{text}",
            text.len()
        );
        let _ = sock.write_all(page.as_bytes()).await;
        if let Some(code) = code {
            return Ok(code);
        }
    }
}

//! `hearth admin`, `hearth processor` and `hearth billing`: tenant, key, limit, budget,
//! issuer, price, processor and export management, against the database or (`hearth admin`,
//! `hearth billing` with `--gateway-url`) through a gateway's admin API.

mod jwt;
mod key;
mod member;
mod price;
mod sso;
mod tenant;

use std::path::PathBuf;

use anyhow::{bail, Context};
use std::sync::Arc;

use hearth_billing::UsageLedger;
use hearth_gateway::manage::{Actor, Management, Origin, Upload, Window};
use hearth_tenants::TenantStore;

use crate::args::*;
use crate::output::lines;

/// `YYYY-MM-DD` (UTC midnight) or Unix milliseconds.
fn parse_time(s: &str) -> anyhow::Result<i64> {
    if let Ok(ms) = s.parse::<i64>() {
        return Ok(ms);
    }
    hearth_billing::parse_day(s).ok_or_else(|| anyhow::anyhow!("{s:?} is neither YYYY-MM-DD nor Unix milliseconds"))
}

/// `90s`, `30m`, `12h`, `30d` → milliseconds.
fn parse_duration_ms(s: &str) -> anyhow::Result<i64> {
    let (n, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let n: i64 = n
        .parse()
        .map_err(|_| anyhow::anyhow!("bad duration {s:?}: use 90s, 30m, 12h or 30d"))?;
    let mult = match unit {
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" | "" => 86_400_000,
        _ => bail!("bad duration {s:?}: use 90s, 30m, 12h or 30d"),
    };
    n.checked_mul(mult)
        .filter(|v| *v > 0)
        .ok_or_else(|| anyhow::anyhow!("bad duration {s:?}"))
}

fn usd(s: &str, what: &str) -> anyhow::Result<i64> {
    hearth_billing::parse_usd_micros(s).ok_or_else(|| anyhow::anyhow!("{what}: {s:?} is not a USD amount like 0.15"))
}

pub async fn processor(a: ProcessorArgs) -> anyhow::Result<()> {
    let json = a.json;
    let show = |p: &hearth_tenants::processors::ProcessorInfo| {
        format!(
            "{}\t{} v{}\t{}\t{}\tposition {}\t{} bytes\tcpu {} ms, memory {} MiB\tsha256 {}",
            p.id,
            p.name,
            p.version,
            if p.active { "active" } else { "inactive" },
            p.key_id
                .as_deref()
                .map_or("tenant-wide".to_string(), |k| format!("key {k}")),
            p.position,
            p.size,
            p.cpu_ms,
            p.memory_mib,
            &p.sha256[..12]
        )
    };
    let print = |v: serde_json::Value, text: String| {
        if json {
            println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
        } else {
            println!("{text}");
        }
    };
    match a.command {
        ProcessorCommand::Wit => {
            print!("{}", hearth_runtime::WIT);
            return Ok(());
        }
        ProcessorCommand::BuildWat { file, out } => {
            let text = std::fs::read_to_string(&file).with_context(|| format!("reading {}", file.display()))?;
            let wasm = hearth_runtime::wat_guest::component(&text)?;
            std::fs::write(&out, &wasm).with_context(|| format!("writing {}", out.display()))?;
            println!("{}: {} bytes", out.display(), wasm.len());
            return Ok(());
        }
        _ => {}
    }
    let db = a.data.open().await?;
    let store = TenantStore::new(&db);
    let ledger = UsageLedger::new(&db);
    let manage = Management {
        tenants: &store,
        ledger: &ledger,
        runtime: None,
        adapters: None,
        origin: Origin::cli(),
    };
    match a.command {
        ProcessorCommand::Upload {
            tenant,
            name,
            file,
            config,
            activate,
            key,
            position,
            cpu_ms,
            memory_mib,
        } => {
            let wasm = std::fs::read(&file).with_context(|| format!("reading {}", file.display()))?;
            let config = match config {
                Some(c) if c.starts_with('@') => {
                    std::fs::read_to_string(&c[1..]).with_context(|| format!("reading {}", &c[1..]))?
                }
                Some(c) => c,
                None => "{}".into(),
            };
            // Compiling here validates the upload and fills the data dir's code cache that
            // gateways on this machine share.
            let cache = std::env::var_os("HEARTH_PROCESSOR_CACHE")
                .map(PathBuf::from)
                .unwrap_or_else(|| a.data.dir().join("processors"));
            let runtime = Arc::new(hearth_runtime::Runtime::new(Some(cache))?);
            let up = Upload {
                name,
                config: Some(config),
                activate,
                key_id: key,
                position,
                cpu_ms: Some(cpu_ms),
                memory_mib: Some(memory_mib),
            };
            let p = Management {
                runtime: Some(&runtime),
                ..manage
            }
            .upload_processor(Actor::Operator, Some(&tenant), up, wasm)
            .await?;
            print(serde_json::json!(p), format!("Uploaded {}", show(&p)));
        }
        ProcessorCommand::List { tenant } => {
            let ps = manage.list_processors(Actor::Operator, Some(&tenant)).await?;
            print(serde_json::json!(ps), lines(ps.iter().map(show), "No processors."));
        }
        ProcessorCommand::Activate { id } => {
            let p = manage.set_processor_active(Actor::Operator, &id, true).await?;
            print(
                serde_json::json!(p),
                format!("Activated {} (gateways follow within 5 s).", show(&p)),
            );
        }
        ProcessorCommand::Deactivate { id } => {
            let p = manage.set_processor_active(Actor::Operator, &id, false).await?;
            print(serde_json::json!(p), format!("Deactivated {}.", show(&p)));
        }
        ProcessorCommand::Attach { id, key, tenant_wide } => {
            if key.is_none() && !tenant_wide {
                bail!("give --key KEY_ID or --tenant-wide");
            }
            let p = manage.attach_processor(Actor::Operator, &id, key.as_deref()).await?;
            print(serde_json::json!(p), format!("Attached {}.", show(&p)));
        }
        ProcessorCommand::Delete { id } => {
            let p = manage.delete_processor(Actor::Operator, &id).await?;
            print(serde_json::json!(p), format!("Deleted {}.", show(&p)));
        }
        ProcessorCommand::Wit | ProcessorCommand::BuildWat { .. } => unreachable!("handled above"),
    }
    Ok(())
}

pub async fn billing(command: BillingCommand) -> anyhow::Result<()> {
    let BillingCommand::Export {
        data,
        gateway,
        tenant,
        from,
        to,
        format,
        granularity,
        out,
    } = command;
    let e = match AdminClient::from_args(&gateway)? {
        Some(gw) => {
            let mut query = vec![
                ("tenant", tenant),
                ("from", from),
                ("format", format),
                ("granularity", granularity),
            ];
            query.extend(to.map(|t| ("to", t)));
            gw.export(&query).await?
        }
        None => {
            let window = Window::parse(Some(&from), to.as_deref())?;
            let db = data.open().await?;
            let (store, ledger) = (TenantStore::new(&db), UsageLedger::new(&db));
            // Records still in this data directory's outbox count too.
            ledger.recover_dir(&data.dir()).await?;
            let manage = Management {
                tenants: &store,
                ledger: &ledger,
                runtime: None,
                adapters: None,
                origin: Origin::cli(),
            };
            manage
                .export(
                    Actor::Operator,
                    Some(&tenant),
                    window,
                    Some(&format),
                    Some(&granularity),
                )
                .await?
                .export
        }
    };
    match out {
        Some(path) => std::fs::write(&path, &e.bytes).with_context(|| format!("writing {}", path.display()))?,
        None => {
            use std::io::Write;
            std::io::stdout().write_all(&e.bytes)?;
        }
    }
    let tt = &e.totals;
    eprintln!(
        "{} lines; {} requests; tokens: {} uncached input, {} cached input, {} output; cost ${} (input ${}, cached ${}, output ${})",
        e.lines,
        tt.requests,
        tt.uncached_input_tokens,
        tt.cached_input_tokens,
        tt.output_tokens,
        hearth_billing::format_nusd(tt.cost_nusd),
        hearth_billing::format_nusd(tt.cost_input_nusd),
        hearth_billing::format_nusd(tt.cost_cached_nusd),
        hearth_billing::format_nusd(tt.cost_output_nusd),
    );
    Ok(())
}

/// A running gateway's admin API (`--gateway-url` and the admin token).
struct AdminClient {
    base: reqwest::Url,
    token: String,
    http: reqwest::Client,
}

/// The answer of a refused admin API call: the status and the gateway's own message (or the
/// start of whatever else answered, e.g. a proxy's error page).
fn refused(status: reqwest::StatusCode, body: &[u8]) -> anyhow::Error {
    let v: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
    let msg = match v["error"]["message"].as_str() {
        Some(m) => m.to_string(),
        None => String::from_utf8_lossy(&body[..body.len().min(200)]).trim().to_string(),
    };
    anyhow::anyhow!("the gateway answered {status}: {msg}")
}

/// How long an admin call may take: adding a model reads (or fetches) it, an export reads
/// every row of the window.
const SLOW_CALL: std::time::Duration = std::time::Duration::from_secs(900);
const CALL: std::time::Duration = std::time::Duration::from_secs(120);

impl AdminClient {
    /// The client `--gateway-url` asks for (None: act on the database).
    fn from_args(a: &GatewayApiArgs) -> anyhow::Result<Option<Self>> {
        match a.url.as_deref().filter(|u| !u.is_empty()) {
            None => Ok(None),
            Some(url) => Self::new(url, a.admin_token.as_deref()).map(Some),
        }
    }

    /// The client for `--gateway-url`, or for a local gateway (http://127.0.0.1:8080): for
    /// the commands that only a running gateway can carry out.
    fn named_or_local(a: &GatewayApiArgs) -> anyhow::Result<Self> {
        let url = a
            .url
            .as_deref()
            .filter(|u| !u.is_empty())
            .unwrap_or("http://127.0.0.1:8080");
        Self::new(url, a.admin_token.as_deref())
    }

    fn new(url: &str, token: Option<&str>) -> anyhow::Result<Self> {
        let saved = crate::login::saved_token(url);
        let token = token
            .filter(|t| !t.is_empty())
            .or(saved.as_deref())
            .ok_or_else(|| {
                anyhow::anyhow!(
                    "set HEARTH_ADMIN_TOKEN (or --admin-token) to the gateway's admin token, or sign in with `hearth admin --gateway-url {url} login`"
                )
            })?;
        let base = reqwest::Url::parse(url.trim_end_matches('/'))
            .ok()
            .filter(|u| matches!(u.scheme(), "http" | "https") && u.host().is_some())
            .ok_or_else(|| anyhow::anyhow!("--gateway-url {url:?}: give the gateway's http(s) URL"))?;
        let loopback = base.host_str().is_some_and(|h| {
            h == "localhost"
                || h.trim_matches(['[', ']'])
                    .parse::<std::net::IpAddr>()
                    .is_ok_and(|ip| ip.is_loopback())
        });
        if base.scheme() == "http" && !loopback {
            eprintln!("warning: {base} is plain HTTP: the admin token crosses the network unencrypted");
        }
        let http = reqwest::Client::builder()
            .connect_timeout(std::time::Duration::from_secs(10))
            .build()
            .context("building the HTTP client")?;
        Ok(Self {
            base,
            token: token.to_string(),
            http,
        })
    }

    /// `/admin/v1/` and `segments`, each percent-encoded.
    fn url(&self, segments: &[&str]) -> reqwest::Url {
        let mut url = self.base.clone();
        if let Ok(mut path) = url.path_segments_mut() {
            path.pop_if_empty().extend(["admin", "v1"]).extend(segments);
        }
        url
    }

    async fn send(
        &self,
        req: reqwest::RequestBuilder,
        timeout: std::time::Duration,
    ) -> anyhow::Result<reqwest::Response> {
        let resp = req
            .bearer_auth(&self.token)
            .timeout(timeout)
            .send()
            .await
            .with_context(|| format!("cannot reach the gateway at {}", self.base))?;
        if resp.status().is_success() {
            return Ok(resp);
        }
        let status = resp.status();
        Err(refused(status, &resp.bytes().await.unwrap_or_default()))
    }

    /// A JSON call, its answer as the gateway sent it.
    async fn call(
        &self,
        method: reqwest::Method,
        segments: &[&str],
        query: &[(&str, String)],
        body: Option<serde_json::Value>,
    ) -> anyhow::Result<serde_json::Value> {
        let slow = method == reqwest::Method::POST && segments == ["models"];
        let mut req = self.http.request(method, self.url(segments)).query(query);
        if let Some(b) = body {
            req = req.json(&b);
        }
        self.send(req, if slow { SLOW_CALL } else { CALL })
            .await?
            .json()
            .await
            .context("the gateway's answer was not JSON")
    }

    /// A `GET`; a list answer (`{"object": "list", "data"}`) is its `data` (as the database
    /// path prints listings).
    async fn get(&self, segments: &[&str], query: &[(&str, String)]) -> anyhow::Result<serde_json::Value> {
        Ok(match self.call(reqwest::Method::GET, segments, query, None).await? {
            serde_json::Value::Object(mut o) if o.get("object").and_then(|x| x.as_str()) == Some("list") => {
                o.remove("data").unwrap_or_default()
            }
            v => v,
        })
    }

    /// `GET /admin/v1/billing/export`: the file and its totals (from the `x-hearth-export-*`
    /// headers).
    async fn export(&self, query: &[(&str, String)]) -> anyhow::Result<hearth_billing::export::Export> {
        let resp = self
            .send(self.http.get(self.url(&["billing", "export"])).query(query), SLOW_CALL)
            .await?;
        let h = resp.headers().clone();
        anyhow::ensure!(
            h.contains_key("x-hearth-export-cost-input-nusd"),
            "the gateway sent the export without its totals (is it older than this CLI?)"
        );
        let n = |k: &str| -> i64 {
            h.get(format!("x-hearth-export-{k}"))
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
        };
        let totals = hearth_billing::export::Totals {
            requests: n("requests"),
            uncached_input_tokens: n("uncached-input-tokens"),
            cached_input_tokens: n("cached-input-tokens"),
            output_tokens: n("output-tokens"),
            processor_us: n("processor-us"),
            cost_input_nusd: n("cost-input-nusd"),
            cost_cached_nusd: n("cost-cached-nusd"),
            cost_output_nusd: n("cost-output-nusd"),
            cost_processor_nusd: n("cost-processor-nusd"),
            cost_nusd: n("cost-nusd"),
        };
        let lines = n("lines") as usize;
        let bytes = resp.bytes().await.context("reading the export")?.to_vec();
        Ok(hearth_billing::export::Export { bytes, totals, lines })
    }
}

/// `hearth admin model …`: the gateway's `/admin/v1/models` over HTTP.
async fn admin_models(gw: GatewayApiArgs, command: AdminModelCommand, json: bool) -> anyhow::Result<()> {
    let gw = AdminClient::named_or_local(&gw)?;
    let body = match command {
        AdminModelCommand::List => gw.call(reqwest::Method::GET, &["models"], &[], None).await?,
        AdminModelCommand::Add {
            id,
            source,
            idle_ttl_s,
            min_warm,
            context_length,
            rope_scaling,
            memory_mib,
            tenants,
            chat_template,
            kv_disk_dir,
            kv_disk_gib,
        } => {
            let spec = hearth_protocol::ModelSpec {
                id,
                source,
                idle_ttl_s,
                min_warm,
                context_length,
                rope_scaling,
                memory_mib,
                tenants,
                chat_template,
                kv_disk_dir,
                kv_disk_gib,
            };
            gw.call(reqwest::Method::POST, &["models"], &[], Some(serde_json::json!(spec)))
                .await?
        }
        AdminModelCommand::Remove { id } => gw.call(reqwest::Method::DELETE, &["models", &id], &[], None).await?,
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&body).unwrap_or_default());
        return Ok(());
    }
    let one = |m: &serde_json::Value| {
        let workers: Vec<String> = m["workers"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|w| {
                format!(
                    "{}={}",
                    w["worker"].as_str().unwrap_or("?"),
                    w["state"].as_str().unwrap_or("-")
                )
            })
            .collect();
        let tenants = match m["tenants"].as_array() {
            Some(t) if !t.is_empty() => t.iter().filter_map(|v| v.as_str()).collect::<Vec<_>>().join(","),
            _ => "all tenants".into(),
        };
        format!(
            "{}\t{}\t{}\t{}",
            m["id"].as_str().unwrap_or("?"),
            m["state"].as_str().unwrap_or("-"),
            workers.join(" "),
            tenants
        )
    };
    if let Some(list) = body["data"].as_array() {
        for m in list {
            println!("{}", one(m));
        }
    } else if body["deleted"] == serde_json::json!(true) {
        println!("removed {}", body["id"].as_str().unwrap_or("?"));
    } else {
        println!("{}", one(&body));
    }
    Ok(())
}

/// `hearth admin adapter …`, through a gateway's admin API (a worker checks uploads).
async fn admin_adapters(gw: GatewayApiArgs, command: AdminAdapterCommand, json: bool) -> anyhow::Result<()> {
    let gw = AdminClient::named_or_local(&gw)?;
    let body = match command {
        AdminAdapterCommand::Upload {
            tenant,
            base_model,
            name,
            path,
        } => {
            let files: Vec<PathBuf> = if path.is_dir() {
                ["adapter_config.json", "adapter_model.safetensors"]
                    .iter()
                    .map(|f| path.join(f))
                    .collect()
            } else {
                vec![path.clone()]
            };
            let mut form = reqwest::multipart::Form::new()
                .text("base_model", base_model)
                .text("name", name);
            for f in files {
                let bytes = std::fs::read(&f).with_context(|| format!("reading {}", f.display()))?;
                let file_name = f
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default();
                form = form.part("file", reqwest::multipart::Part::bytes(bytes).file_name(file_name));
            }
            let req = gw.http.post(gw.url(&["tenants", &tenant, "adapters"])).multipart(form);
            gw.send(req, SLOW_CALL)
                .await?
                .json()
                .await
                .context("the gateway's answer was not JSON")?
        }
        AdminAdapterCommand::List { tenant } => gw.get(&["tenants", &tenant, "adapters"], &[]).await?,
        AdminAdapterCommand::Delete { id } => gw.call(reqwest::Method::DELETE, &["adapters", &id], &[], None).await?,
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&body).unwrap_or_default());
        return Ok(());
    }
    let one = |a: &serde_json::Value| {
        format!(
            "{}\t{}:{}\tv{}\t{}\t{} bytes\t{}",
            a["id"].as_str().unwrap_or("?"),
            a["base_model"].as_str().unwrap_or("?"),
            a["name"].as_str().unwrap_or("?"),
            a["version"],
            a["format"].as_str().unwrap_or("?"),
            a["size"],
            a["digest"].as_str().unwrap_or("?"),
        )
    };
    match body.as_array() {
        Some(list) if list.is_empty() => println!("No adapters."),
        Some(list) => list.iter().for_each(|a| println!("{}", one(a))),
        None => println!("{}", one(&body)),
    }
    Ok(())
}

/// `hearth admin …`: on the database, or through a gateway's admin API with
/// `--gateway-url`. Both print the same: the admin API's JSON (`--json`, lists as arrays), or
/// text made from it.
pub async fn admin(a: AdminArgs) -> anyhow::Result<()> {
    let url = a.gateway.url.as_deref().filter(|u| !u.is_empty());
    match (&a.command, url) {
        (AdminCommand::Login { no_browser }, Some(url)) => return crate::login::login(url, !no_browser).await,
        (AdminCommand::Logout, Some(url)) => return crate::login::logout(url).await,
        (AdminCommand::Login { .. } | AdminCommand::Logout, None) => {
            anyhow::bail!("name the gateway with --gateway-url (or HEARTH_GATEWAY_URL)")
        }
        _ => {}
    }
    if let AdminCommand::Model { command } = a.command {
        return admin_models(a.gateway, command, a.json).await;
    }
    if let AdminCommand::Adapter { command } = a.command {
        return admin_adapters(a.gateway, command, a.json).await;
    }
    let v = match AdminClient::from_args(&a.gateway)? {
        Some(gw) => admin_remote(&gw, &a.command).await?,
        None => admin_direct(&a.data, &a.command).await?,
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
    } else {
        println!("{}", admin_text(&a.command, &v));
    }
    Ok(())
}

/// A key's expiry from now, from `--expires-in`.
fn expires_in_ms(expires_in: &Option<String>) -> anyhow::Result<Option<i64>> {
    expires_in.as_deref().map(parse_duration_ms).transpose()
}

/// `--monthly-usd` and `--soft` as a budget (None: no budget).
fn budget_arg(monthly_usd: &str, soft: bool) -> anyhow::Result<Option<hearth_tenants::Budget>> {
    let micros = usd(monthly_usd, "--monthly-usd")?;
    Ok((micros > 0).then_some(hearth_tenants::Budget {
        monthly_nusd: micros * 1000,
        hard: !soft,
    }))
}

/// `hearth admin …` through the gateway's admin API.
async fn admin_remote(gw: &AdminClient, command: &AdminCommand) -> anyhow::Result<serde_json::Value> {
    Ok(match command {
        AdminCommand::Tenant { command } => tenant::remote(gw, command).await?,
        AdminCommand::Key { command } => key::remote(gw, command).await?,
        AdminCommand::Jwt { command } => jwt::remote(gw, command).await?,
        AdminCommand::Sso { command } => sso::remote(gw, command).await?,
        AdminCommand::Member { command } => member::remote(gw, command).await?,
        AdminCommand::Price { command } => price::remote(gw, command).await?,
        AdminCommand::Usage { tenant, limit } => {
            let mut q: Vec<_> = opt("tenant", tenant).into_iter().collect();
            q.push(("limit", limit.to_string()));
            gw.get(&["usage"], &q).await?
        }
        AdminCommand::Audit { tenant, limit } => {
            let mut q: Vec<_> = opt("tenant", tenant).into_iter().collect();
            q.push(("limit", limit.to_string()));
            gw.get(&["audit"], &q).await?
        }
        AdminCommand::Model { .. } => unreachable!("answered by admin_models"),
        AdminCommand::Adapter { .. } => unreachable!("answered by admin_adapters"),
        AdminCommand::Login { .. } | AdminCommand::Logout => unreachable!("answered by login"),
    })
}

/// A role from the command line.
fn role_arg(role: &str) -> anyhow::Result<hearth_tenants::members::Role> {
    hearth_tenants::members::Role::parse(role).ok_or_else(|| {
        let names = hearth_tenants::members::Role::ALL.map(|r| r.as_str()).join(", ");
        anyhow::anyhow!("unknown role {role:?}: one of {names}")
    })
}

fn sso_spec(issuer: &str, client_id: &str, client_secret: &Option<String>) -> hearth_tenants::sso::SsoSpec {
    hearth_tenants::sso::SsoSpec {
        issuer: issuer.to_string(),
        client_id: client_id.to_string(),
        client_secret: client_secret.clone().filter(|s| !s.is_empty()),
    }
}

/// A JWT issuer from `hearth admin jwt add`'s arguments (key files read here).
fn issuer_spec(
    issuer: &str,
    audience: &str,
    algorithm: &str,
    key_file: &Option<PathBuf>,
    jwks_file: &Option<PathBuf>,
    jwks_url: &Option<String>,
) -> anyhow::Result<hearth_tenants::jwt::IssuerSpec> {
    let read = |p: &Option<PathBuf>| -> anyhow::Result<Option<String>> {
        p.as_ref()
            .map(|p| std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display())))
            .transpose()
    };
    let key = read(key_file)?.map(|k| {
        if algorithm.starts_with("HS") {
            k.trim().to_string()
        } else {
            k
        }
    });
    Ok(hearth_tenants::jwt::IssuerSpec {
        issuer: issuer.to_string(),
        audience: audience.to_string(),
        algorithm: algorithm.to_string(),
        key,
        jwks: read(jwks_file)?,
        jwks_url: jwks_url.clone(),
    })
}

/// `hearth admin …` on the database (the bootstrap path: no gateway needed).
async fn admin_direct(data: &DataArgs, command: &AdminCommand) -> anyhow::Result<serde_json::Value> {
    use serde_json::json;
    let db = data.open().await?;
    let store = TenantStore::new(&db);
    let ledger = UsageLedger::new(&db);
    let manage = Management {
        tenants: &store,
        ledger: &ledger,
        runtime: None,
        adapters: None,
        origin: Origin::cli(),
    };
    Ok(match command {
        AdminCommand::Tenant { command } => tenant::direct(&manage, &store, &ledger, command).await?,
        AdminCommand::Key { command } => key::direct(&manage, &store, &ledger, command).await?,
        AdminCommand::Jwt { command } => jwt::direct(&manage, &store, &ledger, command).await?,
        AdminCommand::Sso { command } => sso::direct(&manage, &store, &ledger, command).await?,
        AdminCommand::Member { command } => member::direct(&manage, &store, &ledger, command).await?,
        AdminCommand::Price { command } => price::direct(&manage, &store, &ledger, command).await?,
        AdminCommand::Audit { tenant, limit } => {
            json!(manage.audit_log(Actor::Operator, tenant.as_deref(), *limit).await?)
        }
        AdminCommand::Usage { tenant, limit } => {
            let tenant_id = match tenant {
                Some(t) => Some(store.tenant(t).await?.id),
                None => None,
            };
            ledger.recover_dir(&data.dir()).await?;
            json!(ledger.recent(tenant_id.as_deref(), *limit).await?)
        }
        AdminCommand::Model { .. } => unreachable!("answered by admin_models"),
        AdminCommand::Adapter { .. } => unreachable!("answered by admin_adapters"),
        AdminCommand::Login { .. } | AdminCommand::Logout => unreachable!("answered by login"),
    })
}

/// The text `hearth admin …` prints for `v`, its answer (the admin API's JSON).
fn admin_text(command: &AdminCommand, v: &serde_json::Value) -> String {
    match command {
        AdminCommand::Tenant { command } => tenant::text(command, v),
        AdminCommand::Key { command } => key::text(command, v),
        AdminCommand::Jwt { command } => jwt::text(command, v),
        AdminCommand::Sso { command } => sso::text(command, v),
        AdminCommand::Member { command } => member::text(command, v),
        AdminCommand::Price { command } => price::text(command, v),
        AdminCommand::Audit { .. } => lines(
            list(v).iter().map(|e| {
                format!(
                    "{}\t{}\t{}\t{}\t{}\t{}",
                    iso_ms(e["at"].as_i64().unwrap_or(0)),
                    s(e, "actor"),
                    s(e, "channel"),
                    e["address"].as_str().unwrap_or("-"),
                    s(e, "action"),
                    s(e, "object")
                )
            }),
            "No audit entries.",
        ),
        AdminCommand::Usage { .. } => lines(
            list(v).iter().map(|r| {
                let cost = &r["cost"];
                format!(
                    "{}\t{}\t{}\tprompt={} cached={} completion={}\t{}\t${}",
                    s(r, "request_id"),
                    s(r, "tenant_id"),
                    s(r, "model"),
                    r["prompt_tokens"],
                    r["cached_tokens"],
                    r["completion_tokens"],
                    s(r, "status"),
                    short_usd(&hearth_billing::format_nusd(cost["total_nusd"].as_i64().unwrap_or(0)))
                )
            }),
            "No usage yet.",
        ),
        AdminCommand::Model { .. } => unreachable!("answered by admin_models"),
        AdminCommand::Adapter { .. } => unreachable!("answered by admin_adapters"),
        AdminCommand::Login { .. } | AdminCommand::Logout => unreachable!("answered by login"),
    }
}

/// A tenant's or key's limits as the admin API takes them.
fn limits_json(l: hearth_tenants::Limits) -> serde_json::Value {
    serde_json::json!({"rpm": l.rpm, "tpm": l.tpm, "concurrent": l.concurrent, "share": l.share,
           "priority": l.priority.map(|p| p.to_string())})
}

/// An optional query parameter.
fn opt(k: &'static str, v: &Option<String>) -> Option<(&'static str, String)> {
    v.clone().map(|v| (k, v))
}

/// A string field of an answer ("" when absent).
fn s(v: &serde_json::Value, k: &str) -> String {
    v[k].as_str().unwrap_or("").to_string()
}

/// An answer's list (empty when it is not one).
fn list(v: &serde_json::Value) -> Vec<serde_json::Value> {
    v.as_array().cloned().unwrap_or_default()
}

/// A price field in micro-USD, for people.
fn usd_micros(v: &serde_json::Value, k: &str) -> String {
    short_usd(&hearth_billing::format_nusd(v[k].as_i64().unwrap_or(0) * 1000))
}

/// Limits as text.
fn limits_text(l: &serde_json::Value) -> String {
    let n = |k: &str| match l[k].as_u64() {
        Some(n) if n > 0 => n.to_string(),
        _ => "unlimited".into(),
    };
    let share = l["share"].as_u64().filter(|s| *s > 0).unwrap_or(1);
    let class = l["priority"].as_str().unwrap_or("interactive");
    format!(
        "{} requests/min, {} tokens/min, {} concurrent, share {share}, class {class}",
        n("rpm"),
        n("tpm"),
        n("concurrent")
    )
}

/// A price's rates as text.
fn rates(p: &serde_json::Value) -> String {
    format!(
        "input ${}, cached input ${}, output ${} per 1M tokens; processors ${} per CPU-second; batches pay {}%",
        usd_micros(p, "input_micros_per_mtok"),
        usd_micros(p, "cached_input_micros_per_mtok"),
        usd_micros(p, "output_micros_per_mtok"),
        usd_micros(p, "processor_micros_per_cpu_s"),
        p["batch_percent"]
            .as_i64()
            .unwrap_or(hearth_billing::DEFAULT_BATCH_PERCENT),
    )
}

/// A USD amount for people: `12.500000000` → `12.50`, `0.000150000` → `0.00015`.
fn short_usd(amount: &str) -> String {
    match amount.split_once('.') {
        Some((whole, frac)) => {
            let frac = frac.trim_end_matches('0');
            format!("{whole}.{frac:0<2}")
        }
        None => format!("{amount}.00"),
    }
}

/// Unix milliseconds as `YYYY-MM-DDTHH:MM:SSZ` (UTC).
pub(crate) fn iso_ms(ms: i64) -> String {
    let secs = ms.div_euclid(1000);
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    format!(
        "{}T{:02}:{:02}:{:02}Z",
        hearth_billing::day_of(days * 86_400_000),
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn amounts_and_times_print_for_people() {
        assert_eq!(super::short_usd("12.500000000"), "12.50");
        assert_eq!(super::short_usd("0.000150000"), "0.00015");
        assert_eq!(super::short_usd("3"), "3.00");
        assert_eq!(super::iso_ms(0), "1970-01-01T00:00:00Z");
        assert_eq!(super::iso_ms(1_764_720_000_000), "2025-12-03T00:00:00Z");
    }
}

//! `hearth admin`, `hearth processor` and `hearth billing`: tenant, key, limit, budget,
//! issuer, price, processor and export management against the database.

use std::path::PathBuf;

use anyhow::{bail, Context};
use std::sync::Arc;

use hearth_billing::UsageLedger;
use hearth_gateway::management::{Actor, Management, Origin, Upload, Window};
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
        tenant,
        from,
        to,
        format,
        granularity,
        out,
    } = command;
    let window = Window::parse(Some(&from), to.as_deref())?;
    let db = data.open().await?;
    let (store, ledger) = (TenantStore::new(&db), UsageLedger::new(&db));
    // Records still in this data directory's outbox count too.
    ledger.recover_dir(&data.dir()).await?;
    let manage = Management {
        tenants: &store,
        ledger: &ledger,
        runtime: None,
        origin: Origin::cli(),
    };
    let e = manage
        .export(
            Actor::Operator,
            Some(&tenant),
            window,
            Some(&format),
            Some(&granularity),
        )
        .await?
        .export;
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

/// `hearth admin model …`: the gateway's `/admin/v1/models` over HTTP.
async fn admin_models(gw: GatewayApiArgs, command: AdminModelCommand, json: bool) -> anyhow::Result<()> {
    let token = gw
        .admin_token
        .filter(|t| !t.is_empty())
        .ok_or_else(|| anyhow::anyhow!("set HEARTH_ADMIN_TOKEN (or --admin-token) to the gateway's admin token"))?;
    let base = format!("{}/admin/v1/models", gw.url.trim_end_matches('/'));
    let client = reqwest::Client::new();
    let req = match command {
        AdminModelCommand::List => client.get(&base),
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
        } => client.post(&base).json(&hearth_protocol::ModelSpec {
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
        }),
        AdminModelCommand::Remove { id } => {
            let mut url = reqwest::Url::parse(&base).with_context(|| format!("bad --gateway-url {}", gw.url))?;
            url.path_segments_mut()
                .map_err(|()| anyhow::anyhow!("bad --gateway-url {}", gw.url))?
                .push(&id);
            client.delete(url)
        }
    };
    let resp = req
        .bearer_auth(token)
        .timeout(std::time::Duration::from_secs(900))
        .send()
        .await
        .with_context(|| format!("cannot reach the gateway at {}", gw.url))?;
    let status = resp.status();
    let body: serde_json::Value = resp.json().await.unwrap_or_default();
    if !status.is_success() {
        let msg = body["error"]["message"].as_str().unwrap_or("no explanation");
        bail!("the gateway answered {status}: {msg}");
    }
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

pub async fn admin(a: AdminArgs) -> anyhow::Result<()> {
    if let AdminCommand::Model { gateway, command } = a.command {
        return admin_models(gateway, command, a.json).await;
    }
    let db = a.data.open().await?;
    let store = TenantStore::new(&db);
    let ledger = UsageLedger::new(&db);
    let manage = Management {
        tenants: &store,
        ledger: &ledger,
        runtime: None,
        origin: Origin::cli(),
    };
    let json = a.json;
    let print = |v: serde_json::Value, text: String| {
        if json {
            println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
        } else {
            println!("{text}");
        }
    };
    match a.command {
        AdminCommand::Tenant {
            command: TenantCommand::Create { name },
        } => {
            let t = manage.create_tenant(&name).await?;
            print(serde_json::json!(t), format!("Created tenant {} ({}).", t.name, t.id));
        }
        AdminCommand::Tenant {
            command: TenantCommand::List,
        } => {
            let ts = store.list_tenants().await?;
            let text = lines(ts.iter().map(|t| format!("{}\t{}", t.id, t.name)), "No tenants.");
            print(serde_json::json!(ts), text);
        }
        AdminCommand::Key {
            command:
                KeyCommand::Create {
                    tenant,
                    name,
                    scopes,
                    models,
                    expires_in,
                },
        } => {
            let spec = hearth_tenants::KeySpec {
                name,
                scopes: Some(hearth_tenants::Scopes::parse(&scopes)?),
                models,
                expires_at: match expires_in {
                    Some(d) => Some(hearth_tenants::now_ms() + parse_duration_ms(&d)?),
                    None => None,
                },
            };
            let k = manage.create_key(Actor::Operator, Some(&tenant), spec).await?;
            print(
                serde_json::json!(k),
                format!(
                    "Created API key {} for tenant {}. Copy it now; it is not shown again:\n\n{}\n",
                    k.info.id, k.tenant, k.key
                ),
            );
        }
        AdminCommand::Key {
            command: KeyCommand::List { tenant },
        } => {
            let ks = manage.list_keys(Actor::Operator, Some(&tenant)).await?;
            let state = |k: &hearth_tenants::ApiKeyInfo| if k.revoked_at.is_some() { "revoked" } else { "active" };
            let text = lines(
                ks.iter().map(|k| format!("{}\t{}\t{}", k.id, state(k), k.name)),
                "No keys.",
            );
            print(serde_json::json!(ks), text);
        }
        AdminCommand::Tenant {
            command: TenantCommand::Limits { name, limits },
        } => {
            let l = limits.limits();
            let t = manage.set_tenant_limits(&name, l).await?;
            print(
                serde_json::json!({"tenant": t.name, "limits": l}),
                format!("Tenant {} limits: {l:?}.", t.name),
            );
        }
        AdminCommand::Key {
            command: KeyCommand::Limits { key_id, limits },
        } => {
            let l = limits.limits();
            manage.set_key_limits(&key_id, l).await?;
            print(
                serde_json::json!({"key": key_id, "limits": l}),
                format!("Key {key_id} limits: {l:?}."),
            );
        }
        AdminCommand::Key {
            command: KeyCommand::Revoke { key_id },
        } => {
            let k = manage.revoke_key(Actor::Operator, &key_id).await?;
            print(
                serde_json::json!(k),
                format!("Revoked key {} (running servers stop accepting it within 5 s).", k.id),
            );
        }
        AdminCommand::Tenant {
            command:
                TenantCommand::Budget {
                    name,
                    monthly_usd,
                    soft,
                },
        } => {
            let micros = usd(&monthly_usd, "--monthly-usd")?;
            let b = (micros > 0).then_some(hearth_tenants::Budget {
                monthly_nusd: micros * 1000,
                hard: !soft,
            });
            let t = manage.set_budget(&name, b).await?;
            let text = match b {
                Some(b) => format!(
                    "Tenant {} budget: ${} per month ({}).",
                    t.name,
                    hearth_billing::format_nusd(b.monthly_nusd),
                    if b.hard { "hard" } else { "soft" }
                ),
                None => format!("Tenant {} has no budget.", t.name),
            };
            print(serde_json::json!({"tenant": t.name, "budget": b}), text);
        }
        AdminCommand::Jwt {
            command:
                JwtCommand::Add {
                    tenant,
                    issuer,
                    audience,
                    algorithm,
                    key_file,
                    jwks_file,
                    jwks_url,
                },
        } => {
            let read = |p: Option<PathBuf>| -> anyhow::Result<Option<String>> {
                p.map(|p| std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display())))
                    .transpose()
            };
            let key = read(key_file)?.map(|k| {
                if algorithm.starts_with("HS") {
                    k.trim().to_string()
                } else {
                    k
                }
            });
            let spec = hearth_tenants::jwt::IssuerSpec {
                issuer,
                audience,
                algorithm,
                key,
                jwks: read(jwks_file)?,
                jwks_url,
            };
            let i = manage.add_issuer(&tenant, &spec).await?;
            print(
                serde_json::json!(i),
                format!(
                    "Registered JWT issuer {} ({}, {}) as {}.",
                    i.issuer, i.algorithm, i.key_source, i.id
                ),
            );
        }
        AdminCommand::Jwt {
            command: JwtCommand::List { tenant },
        } => {
            let is = store.list_issuers(tenant.as_deref()).await?;
            let text = lines(
                is.iter().map(|i| {
                    format!(
                        "{}\t{}\t{}\taud={}\t{}\t{}",
                        i.id, i.tenant_id, i.issuer, i.audience, i.algorithm, i.key_source
                    )
                }),
                "No JWT issuers.",
            );
            print(serde_json::json!(is), text);
        }
        AdminCommand::Jwt {
            command: JwtCommand::Remove { id },
        } => {
            let i = manage.remove_issuer(&id).await?;
            print(
                serde_json::json!(i),
                format!("Removed JWT issuer {} ({}).", i.id, i.issuer),
            );
        }
        AdminCommand::Price {
            command:
                PriceCommand::Set {
                    model,
                    input,
                    cached_input,
                    output,
                    processor,
                    effective_from,
                },
        } => {
            let processor = match processor {
                Some(p) => usd(&p, "--processor")?,
                None => ledger
                    .latest_rates(&model)
                    .await?
                    .map_or(0, |r| r.processor_micros_per_cpu_s),
            };
            let rates = hearth_billing::PriceRates {
                input_micros_per_mtok: usd(&input, "--input")?,
                cached_input_micros_per_mtok: usd(&cached_input, "--cached-input")?,
                output_micros_per_mtok: usd(&output, "--output")?,
                processor_micros_per_cpu_s: processor,
            };
            let from = effective_from.as_deref().map(parse_time).transpose()?;
            let p = manage.set_price(&model, rates, from).await?;
            print(
                serde_json::json!(p),
                format!("Price for {} from {}: {:?}.", p.model, p.effective_from, p.rates),
            );
        }
        AdminCommand::Price {
            command: PriceCommand::List { model },
        } => {
            let ps = UsageLedger::new(&db).prices(model.as_deref()).await?;
            let m = |v: i64| hearth_billing::format_nusd(v * 1000);
            let text = lines(
                ps.iter().map(|p| {
                    format!(
                        "{}\tfrom {}\tinput ${}\tcached ${}\toutput ${} per 1M tokens",
                        p.model,
                        p.effective_from,
                        m(p.rates.input_micros_per_mtok),
                        m(p.rates.cached_input_micros_per_mtok),
                        m(p.rates.output_micros_per_mtok)
                    )
                }),
                "No prices.",
            );
            print(serde_json::json!(ps), text);
        }
        AdminCommand::Audit { tenant, limit } => {
            let entries = manage.audit_log(Actor::Operator, tenant.as_deref(), limit).await?;
            let text = lines(
                entries.iter().map(|e| {
                    format!(
                        "{}\t{}\t{}\t{}\t{}\t{}\t{}",
                        hearth_billing::day_of(e.at),
                        e.at,
                        e.actor,
                        e.channel,
                        e.address.as_deref().unwrap_or("-"),
                        e.action,
                        e.object
                    )
                }),
                "No audit entries.",
            );
            print(serde_json::json!(entries), text);
        }
        AdminCommand::Usage { tenant, limit } => {
            let tenant_id = match tenant {
                Some(t) => Some(store.tenant(&t).await?.id),
                None => None,
            };
            let ledger = UsageLedger::new(&db);
            ledger.recover_dir(&a.data.dir()).await?;
            let rows = ledger.recent(tenant_id.as_deref(), limit).await?;
            let text = lines(
                rows.iter().map(|r| {
                    format!(
                        "{}\t{}\t{}\tprompt={} cached={} completion={}\t{}\t${}",
                        r.rec.request_id,
                        r.rec.tenant_id,
                        r.rec.model,
                        r.rec.prompt_tokens,
                        r.rec.cached_tokens,
                        r.rec.completion_tokens,
                        r.rec.status,
                        hearth_billing::format_nusd(r.cost.total_nusd)
                    )
                }),
                "No usage yet.",
            );
            print(serde_json::json!(rows), text);
        }
        AdminCommand::Model { .. } => unreachable!("answered by admin_models above"),
    }
    Ok(())
}

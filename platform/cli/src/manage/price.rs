//! `hearth admin price …`: prices: set, list — through the admin API ([`remote`]), on the
//! database ([`direct`]), and the answer as text ([`text`]).

use hearth_billing::UsageLedger;
use hearth_gateway::manage::Management;
use hearth_tenants::TenantStore;
use reqwest::Method;
use serde_json::{json, Value};

use super::*;
use crate::args::PriceCommand;

/// Through the gateway's admin API.
pub(super) async fn remote(gw: &AdminClient, command: &PriceCommand) -> anyhow::Result<Value> {
    Ok(match command {
        PriceCommand::Set {
            model,
            input,
            cached_input,
            output,
            processor,
            batch_percent,
            effective_from,
        } => {
            // Checked here too, for the same messages as on the database.
            for (v, what) in [
                (input, "--input"),
                (cached_input, "--cached-input"),
                (output, "--output"),
            ] {
                usd(v, what)?;
            }
            let mut body = json!({"model": model, "input": input, "cached_input": cached_input, "output": output});
            if let Some(p) = processor {
                usd(p, "--processor")?;
                body["processor"] = json!(p);
            }
            if let Some(p) = batch_percent {
                body["batch_percent"] = json!(p);
            }
            if let Some(f) = effective_from {
                body["effective_from"] = json!(parse_time(f)?);
            }
            gw.call(Method::POST, &["prices"], &[], Some(body)).await?
        }
        PriceCommand::List { model } => {
            let q: Vec<_> = opt("model", model).into_iter().collect();
            gw.get(&["prices"], &q).await?
        }
    })
}

/// On the database, through the management service.
pub(super) async fn direct(
    manage: &Management<'_>,
    _store: &TenantStore,
    ledger: &UsageLedger,
    command: &PriceCommand,
) -> anyhow::Result<Value> {
    Ok(match command {
        PriceCommand::Set {
            model,
            input,
            cached_input,
            output,
            processor,
            batch_percent,
            effective_from,
        } => {
            let latest = ledger.latest_rates(model).await?;
            let processor = match processor {
                Some(p) => usd(p, "--processor")?,
                None => latest.as_ref().map_or(0, |r| r.processor_micros_per_cpu_s),
            };
            let batch_percent = batch_percent.map(i64::from).unwrap_or_else(|| {
                latest
                    .as_ref()
                    .map_or(hearth_billing::DEFAULT_BATCH_PERCENT, |r| r.batch_percent)
            });
            let rates = hearth_billing::PriceRates {
                input_micros_per_mtok: usd(input, "--input")?,
                cached_input_micros_per_mtok: usd(cached_input, "--cached-input")?,
                output_micros_per_mtok: usd(output, "--output")?,
                processor_micros_per_cpu_s: processor,
                batch_percent,
            };
            let from = effective_from.as_deref().map(parse_time).transpose()?;
            json!(manage.set_price(model, rates, from).await?)
        }
        PriceCommand::List { model } => json!(ledger.prices(model.as_deref()).await?),
    })
}

/// The answer `v` (the admin API's JSON) as text.
pub(super) fn text(command: &PriceCommand, v: &Value) -> String {
    match command {
        PriceCommand::Set { .. } => format!(
            "Price for {} from {}: {}.",
            s(v, "model"),
            iso_ms(v["effective_from"].as_i64().unwrap_or(0)),
            rates(v)
        ),
        PriceCommand::List { .. } => lines(
            list(v).iter().map(|p| {
                format!(
                    "{}\tfrom {}\t{}",
                    s(p, "model"),
                    iso_ms(p["effective_from"].as_i64().unwrap_or(0)),
                    rates(p)
                )
            }),
            "No prices.",
        ),
    }
}

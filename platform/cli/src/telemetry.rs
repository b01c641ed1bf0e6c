//! Logging and tracing for the process: `tracing` to stderr (colours only on a terminal,
//! `NO_COLOR` honoured) and, with `--otlp-endpoint`, every span exported over OTLP/HTTP
//! (JSON) through a batch processor. The exporter's HTTP requests run on the process's
//! tokio runtime through the same `reqwest` client stack as the rest of Hearth.

use std::time::Duration;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_http::{Bytes, HttpClient, HttpError, Request, Response};
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::Resource;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::Layer;

/// Flushes and stops the exporter when dropped.
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some(p) = self.provider.take() {
            if let Err(e) = p.shutdown() {
                eprintln!("hearth: flushing traces failed: {e}");
            }
        }
    }
}

/// The OTLP exporter's HTTP client: each export runs as a task on the runtime (the batch
/// processor calls from its own thread).
#[derive(Debug)]
struct RuntimeClient {
    client: reqwest::Client,
    runtime: tokio::runtime::Handle,
}

#[async_trait::async_trait]
impl HttpClient for RuntimeClient {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let client = self.client.clone();
        let task = self.runtime.spawn(async move {
            let (parts, body) = request.into_parts();
            let resp = client
                .request(parts.method, parts.uri.to_string())
                .headers(parts.headers)
                .body(body)
                .send()
                .await?;
            let mut out = Response::builder().status(resp.status());
            if let Some(h) = out.headers_mut() {
                *h = resp.headers().clone();
            }
            Ok::<_, HttpError>(out.body(resp.bytes().await?)?)
        });
        task.await?
    }
}

/// Installs the subscriber. `otlp_endpoint` is the collector's base URL
/// (`http://HOST:4318`); spans go to `<endpoint>/v1/traces`.
pub fn init(otlp_endpoint: Option<&str>, service: &'static str) -> anyhow::Result<Telemetry> {
    let filter = || {
        tracing_subscriber::EnvFilter::try_from_env("HEARTH_LOG")
            .or_else(|_| tracing_subscriber::EnvFilter::try_from_default_env())
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,sqlx=warn"))
    };
    // Colours only for a person at a terminal: a log file or pipe gets plain text, and
    // NO_COLOR (https://no-color.org) turns them off everywhere.
    let colour = std::io::IsTerminal::is_terminal(&std::io::stderr())
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let fmt = tracing_subscriber::fmt::layer()
        .with_ansi(colour)
        .with_writer(std::io::stderr)
        .with_filter(filter());
    let Some(endpoint) = otlp_endpoint.filter(|e| !e.is_empty()) else {
        tracing_subscriber::registry().with(fmt).init();
        return Ok(Telemetry { provider: None });
    };
    let client = RuntimeClient {
        client: reqwest::Client::builder().timeout(Duration::from_secs(10)).build()?,
        runtime: tokio::runtime::Handle::current(),
    };
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(Protocol::HttpJson)
        .with_endpoint(format!("{}/v1/traces", endpoint.trim_end_matches('/')))
        .with_http_client(client)
        .build()?;
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(Resource::builder().with_service_name(service).build())
        .build();
    opentelemetry::global::set_tracer_provider(provider.clone());
    // Spans are exported whatever the log level (HEARTH_LOG=warn must not empty traces);
    // the HTTP stack's own spans would only trace the exporter itself.
    let otel = tracing_opentelemetry::layer()
        .with_tracer(provider.tracer("hearth"))
        .with_filter(tracing_subscriber::EnvFilter::new(
            "info,sqlx=warn,hyper=warn,hyper_util=warn,reqwest=warn,h2=warn,opentelemetry=warn,opentelemetry_sdk=warn",
        ));
    tracing_subscriber::registry().with(fmt).with(otel).init();
    Ok(Telemetry {
        provider: Some(provider),
    })
}

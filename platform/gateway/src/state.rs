//! The state one gateway process shares between its requests: stores, limiter, models,
//! processors. Built once by the launcher (`hearth serve`/`hearth gateway`) and handed to
//! [`crate::app::router`].

use hearth_billing::UsageLedger;
use hearth_tenants::TenantStore;

use crate::policy::budget::BudgetCache;
use crate::policy::limits::Limiter;
use crate::policy::processors::ProcessorHost;
use crate::server::metrics::Metrics;
use crate::upstream::registry::ModelRegistry;

/// The shortest admin token a gateway starts with (`HEARTH_ADMIN_TOKEN`): it is a bearer
/// secret for every tenant's data, guessed only through the per-address throttle.
pub const MIN_ADMIN_TOKEN_LEN: usize = 16;

/// Shared state of one gateway process.
pub struct AppState {
    pub tenants: TenantStore,
    pub ledger: UsageLedger,
    pub models: ModelRegistry,
    /// `HEARTH_ADMIN_TOKEN`; the admin API (and `/metrics`) is closed without it.
    pub admin_token: Option<String>,
    pub limiter: Limiter,
    pub budgets: std::sync::Arc<BudgetCache>,
    /// Tenant processors (None: processors are disabled in this gateway).
    pub processors: Option<ProcessorHost>,
    pub metrics: Metrics,
    /// Session pins and load shared with the other gateways (None: this gateway alone).
    pub shared_routing: Option<std::sync::Arc<crate::upstream::cluster::SharedRouting>>,
    /// Set when the process is shutting down: `/readyz` answers 503 so that load balancers
    /// stop sending requests, while those in flight finish.
    pub draining: std::sync::atomic::AtomicBool,
    /// Set when the drain timeout passes: requests still in flight end with an error (and
    /// their usage record) so that the process can exit.
    pub abort: tokio::sync::watch::Sender<bool>,
    /// Authenticated requests whose usage is not recorded yet (from authentication, through
    /// the relay task, to the record): the launcher waits for them before the last flush.
    pub unrecorded: Tasks,
    /// Sources sending bad credentials are throttled (None: never, e.g. for benchmarks).
    pub auth_throttle: Option<crate::policy::throttle::AuthThrottle>,
    /// Sources sending wrong admin tokens (`/admin/v1`, `/metrics`), in a budget of their
    /// own: a flood of bad API keys through a shared address (a NAT, an ingress) must not
    /// lock the operator out.
    pub admin_throttle: Option<crate::policy::throttle::AuthThrottle>,
    /// Request body limits (see [`crate::server::http`]).
    pub body_limits: crate::server::http::BodyLimits,
    /// How long a request may run, and its worker stay quiet (see [`RequestLimits`]).
    pub request_limits: RequestLimits,
    /// How long stored responses (the Responses API's `store: true`) are kept, and how many
    /// per tenant (`--responses-ttl-days`, `--responses-per-tenant`).
    pub response_retention: hearth_tenants::responses::ResponseRetention,
    /// Keep Claude Code's `x-anthropic-billing-header` system block in the prompt
    /// (`--keep-billing-header`; dropped by default: it changes every request and would
    /// defeat the prefix cache).
    pub keep_billing_header: bool,
    /// The completion budget of a request that sets none (`--default-max-tokens`; None: the
    /// room the prompt leaves in the context). Agent harnesses (Codex) send no limit.
    pub default_max_tokens: Option<u32>,
    /// The origin browsers reach this gateway at (`--public-url`, as `scheme://host[:port]`):
    /// the dashboard's state-changing requests must come from it (None: from the request's
    /// own `Host`).
    pub public_origin: Option<String>,
    /// The key that signs the dashboard sign-in form's anti-CSRF token (a server secret
    /// shared by the gateways on one database; read once).
    pub login_key: tokio::sync::OnceCell<String>,
    /// The operators' identity provider and who may sign in through it as an operator
    /// (`--operator-oidc-*`, `--operators`; None: operators sign in with the admin token).
    pub operator_sso: Option<OperatorSso>,
    /// The adapter store shared with the workers (`--adapter-dir`; None: no adapters).
    pub adapter_dir: Option<std::path::PathBuf>,
    /// How this gateway works batches off (`--batch-concurrency`, `--batch-lease-secs`).
    pub batches: BatchSettings,
}

/// Operators signing into the dashboard through an OpenID Connect provider.
#[derive(Debug, Clone)]
pub struct OperatorSso {
    pub provider: hearth_tenants::sso::SsoSpec,
    /// Lower-cased e-mail addresses; the provider must mark the address verified.
    pub operators: Vec<String>,
}

/// How one gateway works batches off.
#[derive(Debug, Clone)]
pub struct BatchSettings {
    /// Lines this gateway runs at once, over every batch (0: it runs none).
    pub concurrency: usize,
    /// How long a claimed line is this gateway's without a renewal; a line whose gateway
    /// died runs again elsewhere after it.
    pub lease: std::time::Duration,
    /// How often the runner looks for work (and for cancelled or finished batches).
    pub poll: std::time::Duration,
}

impl Default for BatchSettings {
    fn default() -> Self {
        Self {
            concurrency: 4,
            lease: std::time::Duration::from_secs(60),
            poll: std::time::Duration::from_millis(250),
        }
    }
}

/// Time limits on one request, enforced by the relay.
#[derive(Debug, Clone, Copy)]
pub struct RequestLimits {
    /// A worker stream that sends nothing for this long is treated as lost: the request
    /// continues on another worker, or ends with `stream_idle_timeout`
    /// (`--stream-idle-timeout-secs`).
    pub stream_idle: std::time::Duration,
    /// A request still running after this long ends with `request_timeout`, billed for what
    /// was generated (`--max-request-secs`).
    pub max_duration: std::time::Duration,
}

impl Default for RequestLimits {
    fn default() -> Self {
        Self {
            stream_idle: std::time::Duration::from_secs(120),
            max_duration: std::time::Duration::from_secs(900),
        }
    }
}

/// A count of running tasks that can be waited on until it reaches zero.
#[derive(Debug, Default)]
pub struct Tasks {
    running: std::sync::Arc<(std::sync::atomic::AtomicUsize, tokio::sync::Notify)>,
}

/// One running task, counted until dropped.
pub struct TaskGuard(std::sync::Arc<(std::sync::atomic::AtomicUsize, tokio::sync::Notify)>);

impl Drop for TaskGuard {
    fn drop(&mut self) {
        if self.0 .0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst) == 1 {
            self.0 .1.notify_waiters();
        }
    }
}

impl Tasks {
    pub fn start(&self) -> TaskGuard {
        self.running.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        TaskGuard(self.running.clone())
    }

    pub fn running(&self) -> usize {
        self.running.0.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Returns when none is running.
    pub async fn idle(&self) {
        loop {
            let woken = self.running.1.notified();
            if self.running() == 0 {
                return;
            }
            woken.await;
        }
    }
}

impl AppState {
    /// The management service over this process's stores (acting through the API; see
    /// [`crate::manage::Management::via`]).
    pub fn management(&self) -> crate::manage::Management<'_> {
        crate::manage::Management {
            tenants: &self.tenants,
            ledger: &self.ledger,
            runtime: self.processors.as_ref().map(|h| &h.runtime),
            adapters: self
                .adapter_dir
                .as_deref()
                .map(|dir| crate::manage::adapters::AdapterHost {
                    dir,
                    models: &self.models,
                }),
            origin: Default::default(),
        }
    }

    /// Whether the client reached us over TLS: a terminating proxy says so, or the public URL
    /// is `https`.
    pub fn over_tls(&self, headers: &axum::http::HeaderMap) -> bool {
        self.public_origin.as_deref().is_some_and(|o| o.starts_with("https://"))
            || headers
                .get("x-forwarded-proto")
                .and_then(|v| v.to_str().ok())
                .is_some_and(|v| v.eq_ignore_ascii_case("https"))
    }

    /// The base of links this gateway hands out (invitations, the single sign-on
    /// callback): the public URL (`--public-url`). Without one, only a request addressed to
    /// this machine (`Host` of localhost or a loopback address: one person trying Hearth
    /// out) gets links from its `Host`; any other `Host` is the client's word, and a link
    /// built from it could send an invitee or an identity provider's code elsewhere, so
    /// there is none (None).
    pub fn link_base(&self, headers: &axum::http::HeaderMap) -> Option<String> {
        if let Some(o) = &self.public_origin {
            return Some(o.clone());
        }
        let host = headers.get(axum::http::header::HOST)?.to_str().ok()?;
        let scheme = if self.over_tls(headers) { "https" } else { "http" };
        loopback_host(host).then(|| format!("{scheme}://{host}"))
    }

    /// The link that accepts an invitation: `<link base>/dashboard/invite/<token>` (None
    /// without a link base: the invitation's token is handed out alone).
    pub fn invite_link(&self, headers: &axum::http::HeaderMap, token: &str) -> Option<String> {
        Some(format!("{}/dashboard/invite/{token}", self.link_base(headers)?))
    }

    /// A gateway with in-process limits, no admin token and no processors; set the public
    /// fields for more.
    pub fn new(tenants: TenantStore, ledger: UsageLedger, models: ModelRegistry) -> Self {
        Self {
            tenants,
            ledger,
            models,
            admin_token: None,
            limiter: Limiter::default(),
            budgets: Default::default(),
            processors: None,
            metrics: Metrics::new(),
            shared_routing: None,
            draining: Default::default(),
            abort: tokio::sync::watch::Sender::new(false),
            unrecorded: Tasks::default(),
            auth_throttle: Some(Default::default()),
            admin_throttle: Some(Default::default()),
            body_limits: crate::server::http::BodyLimits::new(
                &crate::server::http::HttpLimits::default(),
                "/processors",
                hearth_tenants::processors::MAX_PROCESSOR_BYTES + (1 << 20),
            )
            .with_upload(
                "/adapters",
                crate::manage::adapters::MAX_ADAPTER_UPLOAD_BYTES + (1 << 20),
            )
            .with_upload("/v1/files", hearth_tenants::batches::MAX_FILE_BYTES + (1 << 20)),
            request_limits: RequestLimits::default(),
            response_retention: Default::default(),
            keep_billing_header: false,
            default_max_tokens: None,
            public_origin: None,
            login_key: Default::default(),
            operator_sso: None,
            adapter_dir: None,
            batches: Default::default(),
        }
    }
}

/// The models served, for the background tasks that need no more of the state
/// ([`crate::upstream::cluster`]'s registry poll and load exchange).
impl AsRef<ModelRegistry> for AppState {
    fn as_ref(&self) -> &ModelRegistry {
        &self.models
    }
}

/// Whether a `Host` header names this machine: localhost or a loopback address, with or
/// without a port.
fn loopback_host(host: &str) -> bool {
    // An authority with user info (`localhost:80@evil.example`) names another host.
    if host.contains(['@', '/', '\\', '?', '#']) {
        return false;
    }
    let Ok(authority) = host.parse::<axum::http::uri::Authority>() else {
        return false;
    };
    let name = authority.host().trim_start_matches('[').trim_end_matches(']');
    name.eq_ignore_ascii_case("localhost") || name.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

#[cfg(test)]
mod tests {
    /// Issue 78, finding 7: without a public URL, links come only from a `Host` that names
    /// this machine.
    #[test]
    fn links_are_built_only_from_loopback_hosts() {
        for host in [
            "localhost",
            "localhost:8080",
            "127.0.0.1:80",
            "127.1.2.3",
            "[::1]:8080",
            "LOCALHOST",
        ] {
            assert!(super::loopback_host(host), "{host}");
        }
        for host in [
            "evil.example",
            "evil.example:80",
            "10.0.0.1:80",
            "[2001:db8::1]:80",
            "localhost.evil.example",
            "",
            "localhost:80@evil.example",
            "127.0.0.1:1@evil.example",
            "[::1]@evil.example",
            "localhost/evil",
        ] {
            assert!(!super::loopback_host(host), "{host}");
        }
    }
}

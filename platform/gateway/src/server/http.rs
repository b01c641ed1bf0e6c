//! The HTTP server both the gateway and the workers run: hyper's HTTP/1.1 connection with
//! the limits a public endpoint needs, and a body guard in front of every route.
//!
//! * **Header read timeout** (`--header-read-timeout-secs`, 30 s): a request's head must
//!   arrive within it, and an idle keep-alive connection is closed after it — a client that
//!   sends half a header and stalls (slowloris) holds a connection for at most this long.
//! * **Header size** (`--max-header-bytes`, 64 KiB): a larger head gets 431.
//! * **Connections** (`--max-connections`, 4096; `--max-connections-per-ip`, 512): past
//!   either cap a new connection is closed at once, before any byte is read, so slow or
//!   half-open clients cannot exhaust the process's file descriptors or starve others.
//!   [`ConnectionMetrics`] counts the open connections and those refused.
//! * **Body** ([`body_guard`]; `--max-body-bytes`, 8 MiB; `--body-read-timeout-secs`, 30 s):
//!   read whole before the handler runs. A larger body gets a 413 the client can read: the
//!   rest of its body is read and discarded first (up to [`DRAIN_BYTES`] within the body
//!   timeout), since closing a socket with unread data makes the kernel reset the
//!   connection, and the client would never see the answer. With `Expect: 100-continue`
//!   the 413 goes out before the client sends anything. A body that does not arrive within
//!   its timeout gets 408.
//! * **Body budget** ([`BODY_BUDGET_KIB`], 512 MiB): the bodies the process holds at once.
//!   Each body is charged to its [`BodyOwner`] — the tenant or operator whose credential a
//!   layer in front checked before any byte of it was read, else the client's address —
//!   and no owner may hold more than its share (a tenant a quarter of the budget, or its
//!   largest upload if larger; an address one sixteenth, or the body limit if larger; the
//!   operator all of it): one tenant or client trickling bodies cannot take every other's.
//!
//! Request duration and streams that go quiet are the relay's limits
//! ([`crate::state::RequestLimits`]).

use std::collections::HashMap;
use std::future::Future;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{ConnectInfo, Request};
use axum::http::{header, HeaderValue};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http_body_util::BodyExt;
use hyper_util::rt::{TokioIo, TokioTimer};
use tower::ServiceExt;

use crate::server::error::ApiError;

/// Connection and body limits (see the module's docs).
#[derive(Debug, Clone, Copy)]
pub struct HttpLimits {
    pub header_read_timeout: Duration,
    pub max_header_bytes: usize,
    pub max_connections: usize,
    pub max_connections_per_ip: usize,
    pub max_body_bytes: usize,
    pub body_read_timeout: Duration,
}

impl Default for HttpLimits {
    fn default() -> Self {
        Self {
            header_read_timeout: Duration::from_secs(30),
            max_header_bytes: 64 << 10,
            max_connections: 4096,
            max_connections_per_ip: 512,
            max_body_bytes: 8 << 20,
            body_read_timeout: Duration::from_secs(30),
        }
    }
}

/// How much of an oversized body is read (and discarded) so that its 413 reaches the client.
pub const DRAIN_BYTES: usize = 256 << 20;

/// What [`serve`] reports about its connections: how many are open now, and how many were
/// closed at once for being over a cap. Clones share their values.
#[derive(Debug, Clone, Default)]
pub struct ConnectionMetrics {
    pub open: prometheus_client::metrics::gauge::Gauge,
    pub refused: prometheus_client::metrics::counter::Counter,
}

/// Open connections, in all and per client address.
#[derive(Default)]
struct Connections {
    total: usize,
    per_ip: HashMap<IpAddr, usize>,
}

/// One admitted connection, counted until dropped.
struct ConnectionSlot {
    open: Arc<Mutex<Connections>>,
    ip: IpAddr,
    gauge: prometheus_client::metrics::gauge::Gauge,
}

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        let mut c = self.open.lock().unwrap_or_else(|e| e.into_inner());
        c.total = c.total.saturating_sub(1);
        if let Some(n) = c.per_ip.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                c.per_ip.remove(&self.ip);
            }
        }
        // Last, so that a scrape never shows a slot free before it is.
        self.gauge.dec();
    }
}

fn admit(
    open: &Arc<Mutex<Connections>>,
    ip: IpAddr,
    limits: &HttpLimits,
    metrics: &ConnectionMetrics,
) -> Option<ConnectionSlot> {
    let mut c = open.lock().unwrap_or_else(|e| e.into_inner());
    let mine = c.per_ip.get(&ip).copied().unwrap_or(0);
    if c.total >= limits.max_connections || mine >= limits.max_connections_per_ip {
        metrics.refused.inc();
        return None;
    }
    c.total += 1;
    *c.per_ip.entry(ip).or_default() += 1;
    metrics.open.inc();
    Some(ConnectionSlot {
        open: open.clone(),
        ip,
        gauge: metrics.open.clone(),
    })
}

/// Serves `app` on `listener` until `shutdown` completes, then lets the requests in flight
/// finish (the caller bounds that). Every request carries its peer's [`ConnectInfo`].
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    limits: HttpLimits,
    metrics: ConnectionMetrics,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let open = Arc::new(Mutex::new(Connections::default()));
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut shutdown = std::pin::pin!(shutdown);
    let mut refused_logged = std::time::Instant::now() - Duration::from_secs(60);
    loop {
        let (stream, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    if !matches!(
                        e.kind(),
                        std::io::ErrorKind::ConnectionRefused
                            | std::io::ErrorKind::ConnectionAborted
                            | std::io::ErrorKind::ConnectionReset
                    ) {
                        // Out of file descriptors, most likely: wait for some to close.
                        tracing::error!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let Some(slot) = admit(&open, peer.ip(), &limits, &metrics) else {
            if refused_logged.elapsed() > Duration::from_secs(10) {
                refused_logged = std::time::Instant::now();
                tracing::warn!(peer = %peer.ip(), "connection limit reached: closing new connections");
            }
            drop(stream);
            continue;
        };
        let _ = stream.set_nodelay(true);
        let app = app.clone();
        let mut stop = stop_rx.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let service = hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                let mut req = req.map(Body::new);
                req.extensions_mut().insert(ConnectInfo(peer));
                app.clone().oneshot(req)
            });
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_read_timeout)
                .max_header_size(limits.max_header_bytes.max(1024));
            let conn = builder.serve_connection(TokioIo::new(stream), service);
            let mut conn = std::pin::pin!(conn);
            let ended = tokio::select! {
                r = conn.as_mut() => r,
                () = async { let _ = stop.wait_for(|s| *s).await; } => {
                    conn.as_mut().graceful_shutdown();
                    // Served to the end (the caller bounds how long).
                    conn.as_mut().await
                }
            };
            if let Err(e) = ended {
                tracing::debug!(error = %e, "connection ended");
            }
        });
    }
    drop(listener);
    drop(stop_rx);
    stop_tx.send_replace(true);
    // Until every connection has ended.
    stop_tx.closed().await;
    Ok(())
}

/// Whom a request's body is charged to in the body budget: set by a layer in front of
/// [`body_guard`] once the request's credential is checked; without it, the client's
/// address.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum BodyOwner {
    /// The operator (the admin token): may hold the whole budget.
    Operator,
    /// A tenant, by id.
    Tenant(String),
    /// A client not (yet) known, by address.
    Address(Option<IpAddr>),
}

/// What each owner holds of the body budget now, in KiB.
#[derive(Debug, Default)]
struct Shares {
    held: Mutex<HashMap<BodyOwner, usize>>,
}

/// One body's part of its owner's share, given back when dropped.
struct Share {
    shares: Arc<Shares>,
    owner: BodyOwner,
    kib: usize,
}

impl Shares {
    /// Adds `kib` to `owner`'s holding if it stays within `cap`.
    fn take(self: &Arc<Self>, owner: &BodyOwner, kib: usize, cap: usize) -> Option<Share> {
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        let h = held.entry(owner.clone()).or_default();
        if *h + kib > cap {
            return None;
        }
        *h += kib;
        Some(Share {
            shares: self.clone(),
            owner: owner.clone(),
            kib,
        })
    }
}

impl Drop for Share {
    fn drop(&mut self) {
        let mut held = self.shares.held.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(h) = held.get_mut(&self.owner) {
            *h = h.saturating_sub(self.kib);
            if *h == 0 {
                held.remove(&self.owner);
            }
        }
    }
}

/// The body limits of one route: the default, or a larger one (processor and adapter
/// uploads).
#[derive(Debug, Clone)]
pub struct BodyLimits {
    pub max_bytes: usize,
    pub read_timeout: Duration,
    /// `POST`s to paths under the management prefixes ending in a suffix here may send up
    /// to its bytes (processor uploads, adapter uploads).
    pub uploads: Vec<(&'static str, usize)>,
    /// Request bodies held at once by the whole process, in KiB ([`BODY_BUDGET_KIB`]): past
    /// it a request gets 503 instead of more memory.
    budget: Arc<tokio::sync::Semaphore>,
    /// What each owner holds of it.
    shares: Arc<Shares>,
}

/// Request bodies the process holds at once, at most (KiB): 512 MiB.
pub const BODY_BUDGET_KIB: usize = 512 << 10;

/// Where uploads are (the admin API, the self-service API, the dashboard).
const UPLOAD_PREFIXES: [&str; 4] = ["/admin/v1/tenants/", "/v1/tenant/", "/dashboard/", "/v1/files"];

impl BodyLimits {
    pub fn new(http: &HttpLimits, upload_suffix: &'static str, upload_bytes: usize) -> Self {
        Self {
            max_bytes: http.max_body_bytes,
            read_timeout: http.body_read_timeout,
            uploads: if upload_suffix.is_empty() {
                Vec::new()
            } else {
                vec![(upload_suffix, upload_bytes)]
            },
            budget: Arc::new(tokio::sync::Semaphore::new(BODY_BUDGET_KIB)),
            shares: Arc::default(),
        }
    }

    /// The most of the budget `owner` may hold at once, in KiB.
    pub fn share_kib(&self, owner: &BodyOwner) -> usize {
        let largest = self
            .uploads
            .iter()
            .map(|(_, b)| *b)
            .max()
            .unwrap_or(0)
            .max(self.max_bytes);
        let share = match owner {
            BodyOwner::Operator => BODY_BUDGET_KIB,
            BodyOwner::Tenant(_) => (BODY_BUDGET_KIB / 4).max(largest.div_ceil(1024)),
            BodyOwner::Address(_) => (BODY_BUDGET_KIB / 16).max(self.max_bytes.div_ceil(1024)),
        };
        share.min(BODY_BUDGET_KIB)
    }

    /// Whether `method` and `path` may send more than the default body (an upload route).
    pub fn is_upload(&self, method: &axum::http::Method, path: &str) -> bool {
        self.limit_for(method, path) > self.max_bytes
    }

    /// POSTs to paths ending in `suffix` (under the management prefixes) may send up to
    /// `bytes`.
    pub fn with_upload(mut self, suffix: &'static str, bytes: usize) -> Self {
        self.uploads.push((suffix, bytes));
        self
    }

    /// The most a body of `method` to `path` may send.
    pub fn limit_for(&self, method: &axum::http::Method, path: &str) -> usize {
        let upload = (method == axum::http::Method::POST && UPLOAD_PREFIXES.iter().any(|p| path.starts_with(p)))
            .then(|| self.uploads.iter().find(|(suffix, _)| path.ends_with(suffix)))
            .flatten();
        match upload {
            Some((_, bytes)) => (*bytes).max(self.max_bytes),
            None => self.max_bytes,
        }
    }
}

impl Default for BodyLimits {
    fn default() -> Self {
        Self::new(&HttpLimits::default(), "", 0)
    }
}

fn too_large(limit: usize) -> Response {
    let mut resp = ApiError::payload_too_large(format!(
        "The request body is larger than this server accepts ({} bytes at most).",
        limit
    ))
    .into_response();
    // The client may still be sending: the connection is not reused.
    resp.headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    resp
}

/// `503 server_busy` for a body the budget cannot hold; the connection is not reused.
fn busy(message: &str) -> Response {
    let mut resp = ApiError::unavailable_code("server_busy", message).into_response();
    resp.headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    resp
}

/// The TCP peer's address (the server runs with connect info).
pub fn peer(extensions: &axum::http::Extensions) -> Option<IpAddr> {
    extensions
        .get::<axum::extract::ConnectInfo<std::net::SocketAddr>>()
        .map(|c| c.0.ip())
}

/// Middleware: the request's body read whole, within its size and time limits, before the
/// handler runs (see the module's docs).
pub async fn body_guard(limits: BodyLimits, req: Request, next: Next) -> Response {
    let limit = limits.limit_for(req.method(), req.uri().path());
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let expects_continue = req
        .headers()
        .get(header::EXPECT)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
    if declared.is_some_and(|n| n > limit as u64) && expects_continue {
        // The client waits for 100 Continue before sending: answer now, read nothing.
        return too_large(limit);
    }
    if declared == Some(0) || (declared.is_none() && !req.headers().contains_key(header::TRANSFER_ENCODING)) {
        return next.run(req).await;
    }
    let (parts, body) = req.into_parts();
    let owner = parts
        .extensions
        .get::<BodyOwner>()
        .cloned()
        .unwrap_or_else(|| BodyOwner::Address(peer(&parts.extensions)));
    let cap = limits.share_kib(&owner);
    let deadline = tokio::time::Instant::now() + limits.read_timeout;
    let mut body = body;
    // An announced body over the limit is only drained; memory grows with what arrives,
    // never with what a header announces.
    let drain_only = declared.is_some_and(|n| n > limit as u64);
    let mut buf = Vec::with_capacity(declared.map_or(0, |n| (n as usize).min(limit).min(64 << 10)));
    let mut held = Vec::new();
    let mut seen = 0usize;
    loop {
        let frame = match tokio::time::timeout_at(deadline, body.frame()).await {
            Err(_) => {
                let mut resp = ApiError::request_timeout(format!(
                    "The request body did not arrive within {} s.",
                    limits.read_timeout.as_secs()
                ))
                .into_response();
                resp.headers_mut()
                    .insert(header::CONNECTION, HeaderValue::from_static("close"));
                return resp;
            }
            Ok(None) => break,
            Ok(Some(Err(e))) => {
                return ApiError::invalid("body", format!("The request body could not be read: {e}")).into_response()
            }
            Ok(Some(Ok(f))) => f,
        };
        let Ok(data) = frame.into_data() else { continue };
        seen = seen.saturating_add(data.len());
        if drain_only || seen > limit {
            // Read on (and discard) so that the client reads the 413 rather than a reset.
            if seen > DRAIN_BYTES {
                return too_large(limit);
            }
            buf = Vec::new();
            held.clear();
            continue;
        }
        let kib = data.len().div_ceil(1024);
        let Some(share) = limits.shares.take(&owner, kib, cap) else {
            return busy(
                "This client holds its share of the server's request bodies; retry once its other requests are done.",
            );
        };
        match limits.budget.clone().try_acquire_many_owned(kib as u32) {
            Ok(p) => held.push((p, share)),
            Err(_) => return busy("The server is holding too many request bodies; retry shortly."),
        }
        buf.extend_from_slice(&data);
    }
    if seen > limit {
        return too_large(limit);
    }
    let resp = next.run(Request::from_parts(parts, Body::from(Bytes::from(buf)))).await;
    drop(held); // the body's share of the budget, until the handler is done with it
    resp
}

#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::net::TcpStream;

    use super::*;

    /// An admitted connection is counted open until it closes; one past the cap is closed at
    /// once and counted refused, never open.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn connections_are_counted_open_until_closed_and_refused_past_the_cap() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let limits = HttpLimits {
            max_connections_per_ip: 2,
            ..HttpLimits::default()
        };
        let metrics = ConnectionMetrics::default();
        let server = tokio::spawn(serve(
            listener,
            axum::Router::new(),
            limits,
            metrics.clone(),
            std::future::pending(),
        ));
        let a = TcpStream::connect(addr).unwrap();
        let b = TcpStream::connect(addr).unwrap();
        let mut over = TcpStream::connect(addr).unwrap();
        over.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        // Accepted in order: once the third is closed, the first two were admitted.
        assert!(matches!(over.read(&mut [0u8; 1]), Ok(0) | Err(_)), "closed at once");
        assert_eq!((metrics.open.get(), metrics.refused.get()), (2, 1));
        drop((a, b));
        let t = std::time::Instant::now();
        while metrics.open.get() != 0 {
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "{} still open",
                metrics.open.get()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // The slots are free again.
        let c = TcpStream::connect(addr).unwrap();
        let t = std::time::Instant::now();
        while metrics.open.get() != 1 {
            assert!(t.elapsed() < Duration::from_secs(5), "the next connection is admitted");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(metrics.refused.get(), 1);
        drop(c);
        server.abort();
    }
}

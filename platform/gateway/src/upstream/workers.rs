//! How the gateway reaches engines: the [`WorkerClient`] trait and its HTTP client
//! (`hearth gateway --worker URL`); the embedded `hearth serve` supplies an in-process
//! client from `hearth-cli`, so that this crate never links the engine. Both
//! yield the same stream of `hearth-protocol` events; dropping the stream cancels the
//! generation (the HTTP client closes its connection, which the worker notices).

use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use futures_util::stream::{self, BoxStream};
use futures_util::{FutureExt, StreamExt};
use hearth_protocol::{GenerateEvent, GenerateRequest, KvEvent, ModelSpec, WorkerInfo};

/// Events of one generation. A stream that ends without `Done`/`Error` means the worker
/// was lost mid-way.
pub type EventStream = BoxStream<'static, GenerateEvent>;

#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("worker {worker} is unreachable: {detail}")]
    Unavailable { worker: String, detail: String },
    #[error("worker {worker} answered badly: {detail}")]
    Protocol { worker: String, detail: String },
}

/// KV events of one worker: a snapshot, then changes. Ends when the worker goes away.
pub type KvEventStream = BoxStream<'static, KvEvent>;

pub trait WorkerClient: Send + Sync + 'static {
    /// A name for logs and errors (`local-N`, or the worker's URL).
    fn name(&self) -> &str;
    fn info(&self) -> BoxFuture<'_, Result<WorkerInfo, WorkerError>>;
    fn generate(&self, req: GenerateRequest) -> BoxFuture<'_, Result<EventStream, WorkerError>>;
    /// The worker's prefix-cache events (for the router's index).
    fn kv_events(&self) -> BoxFuture<'_, Result<KvEventStream, WorkerError>>;
    /// Liveness.
    fn health(&self) -> BoxFuture<'_, Result<(), WorkerError>>;
    /// `warm`, `loading` or `cold` for a worker that loads its model on demand (None: it
    /// does not say).
    fn model_state(&self) -> Option<String> {
        None
    }
    /// Asks a worker that loads on demand to load the model now, in the background.
    fn preload(&self) -> BoxFuture<'_, Result<(), WorkerError>> {
        async move { Ok(()) }.boxed()
    }
    /// Where another worker fetches the KV blocks this worker holds ([`KvSource`]'s
    /// `worker`: a base URL, or a local worker's name) — a decode half, or a peer fetch.
    /// None: it cannot hand requests off or serve peers (no workers' token).
    ///
    /// [`KvSource`]: hearth_protocol::KvSource
    fn kv_address(&self) -> Option<String> {
        None
    }
    /// Ends a prefill-only request's hold on its KV blocks (its decode half went elsewhere
    /// or was abandoned). Best effort: holds also expire.
    fn release_hold(&self, _hold: &str) -> BoxFuture<'_, ()> {
        async {}.boxed()
    }
}

/// A worker reached over HTTP (`hearth worker`): one of its models.
pub struct HttpWorker {
    base: String,
    client: reqwest::Client,
    /// Where this model's routes are: `/v1/worker`, or `/v1/worker/m/{model}` on a worker
    /// serving a catalogue.
    prefix: String,
    /// The model, on a catalogue worker (its state is followed through health checks).
    model: Option<String>,
    state: std::sync::Mutex<Option<String>>,
    /// The workers' shared token, sent with every request (a worker holding one refuses
    /// requests without it; disaggregated halves and peer fetches need it in any case).
    token: Option<String>,
}

/// One entry of a catalogue worker's `GET /v1/worker/models`.
#[derive(serde::Deserialize)]
struct ListedModel {
    info: WorkerInfo,
    state: Option<String>,
}

#[derive(serde::Deserialize)]
struct ModelList {
    models: Vec<ListedModel>,
    /// The worker takes runtime catalogue changes (its models may change).
    #[serde(default)]
    catalogue: bool,
}

/// Why a worker's catalogue refused a change.
#[derive(Debug, thiserror::Error)]
pub enum HostChangeError {
    #[error(transparent)]
    Worker(#[from] WorkerError),
    /// The worker's answer: HTTP status, error code, message.
    #[error("{message}")]
    Refused { status: u16, code: String, message: String },
}

/// A model a catalogue took: its info and a client for it.
pub type AddedModel = (WorkerInfo, Arc<dyn WorkerClient>);

/// A worker's model catalogue, to which models are added (and removed) at runtime.
pub trait ModelHostClient: Send + Sync + 'static {
    fn name(&self) -> &str;
    /// Adds a model: its info and a client for it.
    fn add_model(&self, spec: ModelSpec) -> BoxFuture<'_, Result<AddedModel, HostChangeError>>;
    /// Removes a model (the worker lets its requests in flight finish).
    fn remove_model(&self, id: &str) -> BoxFuture<'_, Result<(), HostChangeError>>;
}

/// The catalogue of a worker reached over HTTP (`hearth worker --catalogue`); its changes
/// carry the worker's token (`HEARTH_WORKER_TOKEN`), without which the worker refuses them.
pub struct HttpModelHost {
    worker: HttpWorker,
}

impl HttpModelHost {
    async fn refused(resp: reqwest::Response) -> HostChangeError {
        let status = resp.status().as_u16();
        match resp.json::<GenerateEvent>().await {
            Ok(GenerateEvent::Error { code, message }) => HostChangeError::Refused { status, code, message },
            _ => HostChangeError::Refused {
                status,
                code: "worker_error".into(),
                message: format!("the worker answered {status}"),
            },
        }
    }
}

impl ModelHostClient for HttpModelHost {
    fn name(&self) -> &str {
        &self.worker.base
    }

    fn add_model(&self, spec: ModelSpec) -> BoxFuture<'_, Result<AddedModel, HostChangeError>> {
        async move {
            let w = &self.worker;
            let resp = w
                .request(reqwest::Method::POST, format!("{}/v1/worker/models", w.base))
                // Reading the model's metadata (or fetching a known model) takes a while.
                .timeout(Duration::from_secs(600))
                .json(&spec)
                .send()
                .await
                .map_err(|e| w.unavailable(e))?;
            if !resp.status().is_success() {
                return Err(Self::refused(resp).await);
            }
            let listed: ListedModel = resp.json().await.map_err(|e| w.protocol(e))?;
            let client = HttpWorker::for_model(&w.base, &listed.info.model, listed.state)?.with_token(w.token.clone());
            Ok((listed.info, Arc::new(client) as Arc<dyn WorkerClient>))
        }
        .boxed()
    }

    fn remove_model(&self, id: &str) -> BoxFuture<'_, Result<(), HostChangeError>> {
        let id = id.to_string();
        async move {
            let w = &self.worker;
            let resp = w
                .request(reqwest::Method::DELETE, format!("{}/v1/worker/models/{id}", w.base))
                .timeout(Duration::from_secs(30))
                .send()
                .await
                .map_err(|e| w.unavailable(e))?;
            if !resp.status().is_success() {
                return Err(Self::refused(resp).await);
            }
            Ok(())
        }
        .boxed()
    }
}

/// A worker's base URL as its client names it: no trailing `/`, `http://` when no scheme
/// is given (so `10.0.0.7:8081/` and `http://10.0.0.7:8081` are the same worker).
pub fn base_url(url: &str) -> String {
    let base = url.trim_end_matches('/');
    if base.contains("://") {
        base.to_string()
    } else {
        format!("http://{base}")
    }
}

impl HttpWorker {
    pub fn new(base: &str) -> Result<Self, WorkerError> {
        let base = base_url(base);
        let client = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(5))
            .tcp_nodelay(true)
            .build()
            .map_err(|e| WorkerError::Unavailable {
                worker: base.clone(),
                detail: e.to_string(),
            })?;
        Ok(Self {
            base,
            client,
            prefix: "/v1/worker".into(),
            model: None,
            state: std::sync::Mutex::new(None),
            token: None,
        })
    }

    /// Sends `token` (the workers' shared token) with every request.
    pub fn with_token(mut self, token: Option<String>) -> Self {
        self.token = token.filter(|t| !t.is_empty());
        self
    }

    /// A request to the worker, with the workers' token when this client has one.
    fn request(&self, method: reqwest::Method, url: String) -> reqwest::RequestBuilder {
        let req = self.client.request(method, url);
        match &self.token {
            Some(t) => req.bearer_auth(t),
            None => req,
        }
    }

    /// The client of one model of a catalogue worker.
    pub fn for_model(base: &str, model: &str, state: Option<String>) -> Result<Self, WorkerError> {
        let mut w = Self::new(base)?;
        w.prefix = format!("/v1/worker/m/{model}");
        *w.state.lock().unwrap_or_else(|e| e.into_inner()) = state;
        w.model = Some(model.to_string());
        Ok(w)
    }

    /// One client per model the worker at `base` serves (a catalogue worker lists its
    /// models; an older or single-model worker is one client), and the worker's catalogue
    /// when it takes runtime changes; all of them send `token` (the workers' shared token).
    pub async fn discover(
        base: &str,
        token: Option<String>,
    ) -> Result<(Vec<Self>, Option<HttpModelHost>), WorkerError> {
        let (clients, catalogue) = Self::discover_models(base, &token).await?;
        let host = if catalogue {
            Some(HttpModelHost {
                worker: Self::new(base)?.with_token(token),
            })
        } else {
            None
        };
        Ok((clients, host))
    }

    async fn discover_models(base: &str, token: &Option<String>) -> Result<(Vec<Self>, bool), WorkerError> {
        let one = Self::new(base)?.with_token(token.clone());
        let resp = one
            .request(reqwest::Method::GET, format!("{}/v1/worker/models", one.base))
            .timeout(Duration::from_secs(30))
            .send()
            .await
            .map_err(|e| one.unavailable(e))?;
        if resp.status() == reqwest::StatusCode::NOT_FOUND {
            return Ok((vec![one], false));
        }
        if !resp.status().is_success() {
            return Err(one.refused("models", resp.status()));
        }
        let list: ModelList = resp.json().await.map_err(|e| one.protocol(e))?;
        // A single-model worker is reached through the unprefixed routes; a catalogue's
        // models (which may change) each through their own.
        if list.models.len() <= 1 && !list.catalogue {
            return Ok((vec![one], false));
        }
        let clients = list
            .models
            .into_iter()
            .map(|m| Self::for_model(base, &m.info.model, m.state).map(|w| w.with_token(token.clone())))
            .collect::<Result<_, _>>()?;
        Ok((clients, list.catalogue))
    }

    fn url(&self, path: &str) -> String {
        format!("{}{}/{path}", self.base, self.prefix)
    }

    fn unavailable(&self, e: impl std::fmt::Display) -> WorkerError {
        WorkerError::Unavailable {
            worker: self.base.clone(),
            detail: e.to_string(),
        }
    }

    /// A worker route answered `status`: a 401 is a token mismatch, said as one.
    fn refused(&self, route: &str, status: reqwest::StatusCode) -> WorkerError {
        if status == reqwest::StatusCode::UNAUTHORIZED {
            self.protocol(format!(
                "{route} returned 401: the worker refused this gateway's workers' token (HEARTH_WORKER_TOKEN is missing here or differs from the worker's)"
            ))
        } else {
            self.protocol(format!("{route} returned {status}"))
        }
    }

    fn protocol(&self, e: impl std::fmt::Display) -> WorkerError {
        WorkerError::Protocol {
            worker: self.base.clone(),
            detail: e.to_string(),
        }
    }
}

impl WorkerClient for HttpWorker {
    fn name(&self) -> &str {
        &self.base
    }

    /// Only with the workers' token: without it, a decode worker refuses to fetch.
    fn kv_address(&self) -> Option<String> {
        self.token.as_ref().map(|_| self.base.clone())
    }

    fn release_hold(&self, hold: &str) -> BoxFuture<'_, ()> {
        let body = serde_json::json!({ "hold": hold });
        async move {
            let post = self.request(reqwest::Method::POST, self.url("kv/release")).json(&body);
            if let Err(e) = post.timeout(Duration::from_secs(10)).send().await {
                tracing::debug!(worker = %self.base, error = %e, "releasing a KV hold failed (it expires)");
            }
        }
        .boxed()
    }

    fn kv_events(&self) -> BoxFuture<'_, Result<KvEventStream, WorkerError>> {
        async move {
            let resp = self
                .request(reqwest::Method::GET, self.url("events"))
                .send()
                .await
                .map_err(|e| self.unavailable(e))?;
            if !resp.status().is_success() {
                return Err(self.refused("events", resp.status()));
            }
            let lines = ndjson_lines(resp.bytes_stream().boxed());
            Ok(lines
                .filter_map(|l| async move { serde_json::from_slice::<KvEvent>(&l).ok() })
                .boxed())
        }
        .boxed()
    }

    fn health(&self) -> BoxFuture<'_, Result<(), WorkerError>> {
        async move {
            let resp = self
                .client
                .get(format!("{}/healthz", self.base))
                .timeout(Duration::from_secs(3))
                .send()
                .await
                .map_err(|e| self.unavailable(e))?;
            if !resp.status().is_success() {
                return Err(self.unavailable(format!("healthz returned {}", resp.status())));
            }
            // A catalogue worker: follow the model's state (warm / loading / cold).
            if let Some(model) = &self.model {
                let listed = self
                    .request(reqwest::Method::GET, format!("{}/v1/worker/models", self.base))
                    .timeout(Duration::from_secs(3))
                    .send()
                    .await
                    .map_err(|e| self.unavailable(e))?
                    .json::<ModelList>()
                    .await
                    .map_err(|e| self.protocol(e))?;
                let state = listed
                    .models
                    .into_iter()
                    .find(|m| &m.info.model == model)
                    .and_then(|m| m.state);
                *self.state.lock().unwrap_or_else(|e| e.into_inner()) = state;
            }
            Ok(())
        }
        .boxed()
    }

    fn model_state(&self) -> Option<String> {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn preload(&self) -> BoxFuture<'_, Result<(), WorkerError>> {
        async move {
            if self.model.is_none() {
                return Ok(()); // a single-model worker is always loaded
            }
            let resp = self
                .request(reqwest::Method::POST, self.url("load"))
                .timeout(Duration::from_secs(10))
                .send()
                .await
                .map_err(|e| self.unavailable(e))?;
            if !resp.status().is_success() {
                return Err(self.refused("load", resp.status()));
            }
            // Reported `loading` from now on (the next health check confirms).
            *self.state.lock().unwrap_or_else(|e| e.into_inner()) = Some("loading".into());
            Ok(())
        }
        .boxed()
    }

    fn info(&self) -> BoxFuture<'_, Result<WorkerInfo, WorkerError>> {
        async move {
            let resp = self
                .request(reqwest::Method::GET, self.url("info"))
                .timeout(Duration::from_secs(30))
                .send()
                .await
                .map_err(|e| self.unavailable(e))?;
            if !resp.status().is_success() {
                return Err(self.refused("info", resp.status()));
            }
            resp.json::<WorkerInfo>().await.map_err(|e| self.protocol(e))
        }
        .boxed()
    }

    fn generate(&self, req: GenerateRequest) -> BoxFuture<'_, Result<EventStream, WorkerError>> {
        // The worker's spans join this request's trace (W3C traceparent).
        let traceparent = crate::server::telemetry::current_traceparent();
        async move {
            let mut post = self.request(reqwest::Method::POST, self.url("generate")).json(&req);
            if let Some(tp) = traceparent {
                post = post.header(hearth_protocol::TRACEPARENT, tp);
            }
            let resp = post.send().await.map_err(|e| self.unavailable(e))?;
            if !resp.status().is_success() {
                // The worker explains refusals as one error event.
                let status = resp.status();
                return match resp.json::<GenerateEvent>().await {
                    // Shutting down: it takes nothing new, another worker will (nothing
                    // has been streamed).
                    Ok(GenerateEvent::Error { code, message }) if code == "draining" => Err(self.unavailable(message)),
                    Ok(ev @ GenerateEvent::Error { .. }) => Ok(stream::iter([ev]).boxed()),
                    _ => Err(self.protocol(format!("generate returned {status}"))),
                };
            }
            Ok(ndjson_events(resp.bytes_stream().boxed()))
        }
        .boxed()
    }
}

/// Splits a byte stream into lines (without the newline); ends at the first transport error.
fn ndjson_lines(bytes: BoxStream<'static, reqwest::Result<axum::body::Bytes>>) -> BoxStream<'static, Vec<u8>> {
    stream::unfold((bytes, Vec::<u8>::new()), |(mut bytes, mut buf)| async move {
        loop {
            if let Some(pos) = buf.iter().position(|&b| b == b'\n') {
                let mut line: Vec<u8> = buf.drain(..=pos).collect();
                line.pop();
                if line.iter().all(u8::is_ascii_whitespace) {
                    continue;
                }
                return Some((line, (bytes, buf)));
            }
            match bytes.next().await {
                Some(Ok(chunk)) => buf.extend_from_slice(&chunk),
                _ => return None,
            }
        }
    })
    .boxed()
}

/// Splits a byte stream into newline-delimited JSON events. A transport error or a bad line
/// ends the stream with an `Error` event.
fn ndjson_events(bytes: BoxStream<'static, reqwest::Result<axum::body::Bytes>>) -> EventStream {
    stream::unfold(
        (bytes, Vec::<u8>::new(), false),
        |(mut bytes, mut buf, mut done)| async move {
            loop {
                if done {
                    return None;
                }
                if let Some(pos) = buf.iter().position(|&b| b == b'\n') {
                    let line: Vec<u8> = buf.drain(..=pos).collect();
                    if line.iter().all(u8::is_ascii_whitespace) {
                        continue;
                    }
                    let ev = serde_json::from_slice::<GenerateEvent>(&line).unwrap_or_else(|e| {
                        done = true;
                        GenerateEvent::Error {
                            code: "worker_protocol".into(),
                            message: format!("bad event from worker: {e}"),
                        }
                    });
                    return Some((ev, (bytes, buf, done)));
                }
                match bytes.next().await {
                    Some(Ok(chunk)) => buf.extend_from_slice(&chunk),
                    Some(Err(e)) => {
                        let ev = GenerateEvent::Error {
                            code: "worker_disconnected".into(),
                            message: format!("lost the worker mid-stream: {e}"),
                        };
                        return Some((ev, (bytes, buf, true)));
                    }
                    None => return None,
                }
            }
        },
    )
    .boxed()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn events(chunks: Vec<Vec<u8>>) -> Vec<GenerateEvent> {
        let bytes = futures_util::stream::iter(chunks.into_iter().map(|c| Ok(axum::body::Bytes::from(c)))).boxed();
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        rt.block_on(ndjson_events(bytes).collect())
    }

    fn sample() -> Vec<GenerateEvent> {
        vec![
            GenerateEvent::Token {
                index: 0,
                id: 7,
                text: "héllo\n{\"x\": 1}".into(),
                logprob: Some(-0.5),
                top_logprobs: Vec::new(),
            },
            GenerateEvent::Finish {
                index: 0,
                finish_reason: hearth_protocol::FinishReason::Stop,
            },
            GenerateEvent::Done {
                finish_reason: hearth_protocol::FinishReason::Stop,
                usage: hearth_protocol::Usage {
                    prompt_tokens: 3,
                    cached_tokens: 1,
                    completion_tokens: 1,
                },
                timings: Default::default(),
            },
        ]
    }

    fn fuzz_cases() -> u32 {
        std::env::var("HEARTH_FUZZ_CASES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(512)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(fuzz_cases()))]

        /// The worker's NDJSON stream cut at any points reads as the same events.
        #[test]
        fn ndjson_split_anywhere_reads_the_same(cuts in proptest::collection::vec(any::<usize>(), 0..10)) {
            let mut bytes = Vec::new();
            for ev in sample() {
                bytes.extend(serde_json::to_vec(&ev).unwrap());
                bytes.push(b'\n');
            }
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % (bytes.len() + 1)).collect();
            cuts.sort_unstable();
            let mut chunks = Vec::new();
            let mut at = 0;
            for c in cuts.into_iter().chain([bytes.len()]) {
                chunks.push(bytes[at..c.max(at)].to_vec());
                at = c.max(at);
            }
            prop_assert_eq!(events(chunks), sample());
        }

        /// Garbage from a worker ends the stream with one `worker_protocol` error, never a
        /// panic, and nothing after it.
        #[test]
        fn ndjson_garbage_ends_with_an_error(noise in proptest::collection::vec(any::<u8>(), 1..200)) {
            let evs = events(vec![noise]);
            if let Some(pos) = evs.iter().position(|e| matches!(e, GenerateEvent::Error { .. })) {
                prop_assert_eq!(pos, evs.len() - 1);
            }
        }
    }
}

//! The in-process [`WorkerClient`]: an engine (or sim) backend in the same process as the
//! gateway (`hearth serve`). Lives in the CLI so that the gateway library never links the
//! engine.

use std::sync::Arc;

use futures_util::future::BoxFuture;
use futures_util::stream;
use futures_util::{FutureExt, StreamExt};
use hearth_engine::kv::transfer::LocalKvTransport;
use hearth_engine::Backend;
use hearth_gateway::upstream::workers::{EventStream, KvEventStream, WorkerClient, WorkerError};
use hearth_protocol::{GenerateRequest, WorkerInfo};
use tokio_stream::wrappers::UnboundedReceiverStream;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// An engine in this process.
pub struct InProcessWorker {
    engine: Arc<dyn Backend>,
    name: String,
    /// `prefill`, `decode` or `both` when it shares KV blocks with other local workers
    /// (None: `both`).
    role: Option<String>,
    /// How it fetches KV blocks from the other local workers (several in one process).
    transport: Option<Arc<LocalKvTransport>>,
}

impl InProcessWorker {
    pub fn new(engine: Arc<dyn Backend>, name: &str) -> Self {
        Self {
            engine,
            name: name.to_string(),
            role: None,
            transport: None,
        }
    }

    /// One of several local workers: it reports `role`, and its engine joins `transport`
    /// under its name, so that its peers fetch KV blocks from it (a decode half from its
    /// prefill half, or a peer fetch).
    pub fn with_role(mut self, role: &str, transport: Arc<LocalKvTransport>) -> Self {
        if let Some(e) = self.engine.engine() {
            transport.add(&self.name, e);
        }
        self.role = Some(role.to_string());
        self.transport = Some(transport);
        self
    }
}

impl WorkerClient for InProcessWorker {
    fn name(&self) -> &str {
        &self.name
    }

    fn kv_events(&self) -> BoxFuture<'_, Result<KvEventStream, WorkerError>> {
        async move {
            let (snap, rx) = self
                .engine
                .subscribe_kv()
                .await
                .ok_or_else(|| WorkerError::Unavailable {
                    worker: self.name.clone(),
                    detail: "the engine is not running".into(),
                })?;
            // A lagging subscriber's stream ends; the caller resubscribes and gets a new snapshot.
            let rest = tokio_stream::wrappers::BroadcastStream::new(rx)
                .take_while(|r| futures_util::future::ready(r.is_ok()))
                .filter_map(|r| futures_util::future::ready(r.ok()));
            Ok(stream::iter([snap]).chain(rest).boxed())
        }
        .boxed()
    }

    fn health(&self) -> BoxFuture<'_, Result<(), WorkerError>> {
        async move { Ok(()) }.boxed()
    }

    fn model_state(&self) -> Option<String> {
        self.engine.model_state().map(str::to_string)
    }

    fn preload(&self) -> BoxFuture<'_, Result<(), WorkerError>> {
        self.engine.preload();
        async move { Ok(()) }.boxed()
    }

    fn info(&self) -> BoxFuture<'_, Result<WorkerInfo, WorkerError>> {
        let mut info = self.engine.info().clone();
        if let Some(r) = &self.role {
            info.role = r.clone();
        }
        async move { Ok(info) }.boxed()
    }

    fn kv_address(&self) -> Option<String> {
        self.transport.as_ref().map(|_| self.name.clone())
    }

    fn release_hold(&self, hold: &str) -> BoxFuture<'_, ()> {
        if let Some(e) = self.engine.engine() {
            e.release_hold(hold);
        }
        async {}.boxed()
    }

    fn generate(&self, req: GenerateRequest) -> BoxFuture<'_, Result<EventStream, WorkerError>> {
        // The caller's span (the gateway's dispatch phase) parents the engine's spans.
        let parent = tracing::Span::current().context();
        let (model, request_id) = (req.model.clone(), req.request_id.clone());
        async move {
            // A decode half or a peer fetch: the blocks it lacks come from the holder first
            // (what does not arrive is computed).
            if let (Some(t), Some(e)) = (&self.transport, self.engine.engine()) {
                hearth_engine::kv::transfer::prepare(&e, &**t, &req, &self.name, &parent).await;
            }
            let rx = self.engine.generate(req);
            let events = hearth_engine::worker::telemetry::traced(
                UnboundedReceiverStream::new(rx),
                parent,
                self.name.clone(),
                model,
                request_id,
            );
            Ok(events.boxed())
        }
        .boxed()
    }
}

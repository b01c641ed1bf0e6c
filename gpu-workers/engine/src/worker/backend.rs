//! What a worker serves requests with: the real engine ([`crate::engine::EngineHandle`]) or the
//! `sim` backend ([`crate::worker::sim::SimHandle`]). The worker server and in-process clients
//! see only this trait.

use std::future::Future;
use std::pin::Pin;

use hearth_protocol::{GenerateEvent, GenerateRequest, KvEvent, WorkerInfo};
use tokio::sync::broadcast;
use tokio::sync::mpsc::UnboundedReceiver;

pub type KvSubscription = Option<(KvEvent, broadcast::Receiver<KvEvent>)>;

pub trait Backend: Send + Sync + 'static {
    fn info(&self) -> &WorkerInfo;
    /// Queues a request; dropping the receiver cancels it.
    fn generate(&self, req: GenerateRequest) -> UnboundedReceiver<GenerateEvent>;
    /// A snapshot of the prefix cache and every change after it.
    fn subscribe_kv(&self) -> Pin<Box<dyn Future<Output = KvSubscription> + Send + '_>>;
    /// Counters for `/metrics` (None: this backend keeps none).
    fn stats(&self) -> Option<crate::engine::command::EngineStats> {
        None
    }
    /// Per-request timing histograms for `/metrics`.
    fn metrics(&self) -> Option<std::sync::Arc<crate::engine::metrics::EngineMetrics>> {
        None
    }
    /// Seconds the model took to load.
    fn load_seconds(&self) -> Option<f64> {
        None
    }
    /// How far the model's packed weights are ready (None: not loaded, or no engine).
    fn load_progress(&self) -> Option<std::sync::Arc<crate::kernels::pack_cache::LoadProgress>> {
        None
    }
    /// `warm`, `loading` or `cold` (None: this backend does not load and unload models).
    fn model_state(&self) -> Option<&'static str> {
        None
    }
    /// Starts loading the model in the background if it is cold (the gateway spreads a
    /// busy model to more workers); false if this backend does not load on demand.
    fn preload(&self) -> bool {
        false
    }
    /// The running engine, for KV transfers (None: not loaded, or not a real engine).
    fn engine(&self) -> Option<crate::engine::EngineHandle> {
        None
    }
}

impl Backend for crate::engine::EngineHandle {
    fn info(&self) -> &WorkerInfo {
        crate::engine::EngineHandle::info(self)
    }
    fn generate(&self, req: GenerateRequest) -> UnboundedReceiver<GenerateEvent> {
        crate::engine::EngineHandle::generate(self, req)
    }
    fn subscribe_kv(&self) -> Pin<Box<dyn Future<Output = KvSubscription> + Send + '_>> {
        Box::pin(crate::engine::EngineHandle::subscribe_kv(self))
    }
    fn stats(&self) -> Option<crate::engine::command::EngineStats> {
        Some(crate::engine::EngineHandle::stats(self))
    }
    fn metrics(&self) -> Option<std::sync::Arc<crate::engine::metrics::EngineMetrics>> {
        Some(crate::engine::EngineHandle::metrics(self))
    }
    fn load_seconds(&self) -> Option<f64> {
        Some(crate::engine::EngineHandle::load_seconds(self))
    }
    fn load_progress(&self) -> Option<std::sync::Arc<crate::kernels::pack_cache::LoadProgress>> {
        Some(crate::engine::EngineHandle::load_progress(self))
    }
    fn model_state(&self) -> Option<&'static str> {
        Some("warm")
    }
    fn engine(&self) -> Option<crate::engine::EngineHandle> {
        Some(self.clone())
    }
}

